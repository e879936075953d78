"""TFoS's low-level ``TFSparkNode`` functions: one unsupervised node in the foreground of a
Spark task (Spark task).

The code is :mod:`tfos._legacy.spark_node`, part of TFoS's own runtime, which ``TFCluster.run``
does not use; ``from tensorflowonspark import TFSparkNode`` becomes ``from tfos import
TFSparkNode``. Every name of that module reads through this one, its state included.
"""

from __future__ import annotations

from typing import Any

from tfos._legacy import spark_node as _impl
from tfos._legacy.spark_node import *  # noqa: F403 - TFoS's public names

__all__ = list(_impl.__all__)


def __getattr__(name: str) -> Any:
    return getattr(_impl, name)
