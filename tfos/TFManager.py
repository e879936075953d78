"""TFoS's ``TFManager``: named queues and a key/value state in a multiprocessing manager (TF
process, Spark task).

The code is :mod:`tfos._legacy.manager`, part of TFoS's own runtime, which ``TFCluster.run``
does not use; ``from tensorflowonspark import TFManager`` becomes ``from tfos import
TFManager``. Every name of that module reads through this one, its state included.
"""

from __future__ import annotations

from typing import Any

from tfos._legacy import manager as _impl
from tfos._legacy.manager import *  # noqa: F403 - TFoS's public names

__all__ = list(_impl.__all__)


def __getattr__(name: str) -> Any:
    return getattr(_impl, name)
