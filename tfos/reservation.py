"""TFoS's ``reservation`` module: its reservation server and client, authenticated (driver
for ``Server``; Spark tasks and TF processes for ``Client``).

The code is :mod:`tfos._legacy.reservation`, part of TFoS's own runtime, which ``TFCluster.run``
does not use; ``from tensorflowonspark import reservation`` becomes ``from tfos import
reservation``. Every name of that module reads through this one, its state included.
"""

from __future__ import annotations

from typing import Any

from tfos._legacy import reservation as _impl
from tfos._legacy.reservation import *  # noqa: F403 - TFoS's public names

__all__ = list(_impl.__all__)


def __getattr__(name: str) -> Any:
    return getattr(_impl, name)
