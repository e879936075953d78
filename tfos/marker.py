"""TFoS's queue markers (pure).

The code is :mod:`tfos._legacy.marker`, part of TFoS's own runtime, which ``TFCluster.run``
does not use; ``from tensorflowonspark import marker`` becomes ``from tfos import
marker``. Every name of that module reads through this one, its state included.
"""

from __future__ import annotations

from typing import Any

from tfos._legacy import marker as _impl
from tfos._legacy.marker import *  # noqa: F403 - TFoS's public names

__all__ = list(_impl.__all__)


def __getattr__(name: str) -> Any:
    return getattr(_impl, name)
