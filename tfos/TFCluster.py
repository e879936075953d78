"""TFoS-compatible entry point: ``TFCluster.run(...)`` and ``TFCluster.InputMode`` (driver).

A TensorFlowOnSpark program keeps working after ``from tensorflowonspark import TFCluster``
becomes ``from tfos import TFCluster``::

    cluster = TFCluster.run(sc, main_fun, args, num_executors, num_ps, tensorboard,
                            TFCluster.InputMode.SPARK, master_node="chief")
    cluster.train(rdd, num_epochs=2)
    cluster.shutdown()

``TFCluster.Lifecycle`` names the states ``cluster.state`` goes through (forming, running,
restarting, shutting down, closed, failed; docs/architecture.md "Driver plane").
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Dict

from tfos._driver import cluster as _cluster

from ._driver.cluster import TFCluster
from ._driver.lifecycle import Lifecycle
from .cluster_template import InputMode

__all__ = ["run", "TFCluster", "InputMode", "Lifecycle", "tf_status"]

#: TFoS's name for the cluster's logger: the parent of the driver's cluster loggers
#: (``tfos._driver.*``), so its level and handlers apply to what ``run``, ``train``,
#: ``inference`` and ``shutdown`` log.
logger = logging.getLogger("tfos._driver")

#: TFoS's module-level status (driver): empty while things succeed; ``{'error': message}``
#: once the last ``run()`` raised, or a ``train()``/``inference()``/``shutdown()`` of its cluster raised
#: ``ClusterFailedError`` (a node failed). tfos reports every failure as an exception
#: (``ClusterFailedError`` names the node), so this is informational only.
tf_status: Dict[str, Any] = _cluster.tf_status


@functools.wraps(_cluster.run)
def run(*args: Any, **kwargs: Any) -> TFCluster:
    tf_status.clear()
    try:
        return _cluster.run(*args, **kwargs)
    except BaseException as exc:
        tf_status["error"] = f"{type(exc).__name__}: {exc}"
        raise
