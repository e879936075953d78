"""TFoS-compatible entry point: ``TFCluster.run(...)`` and ``TFCluster.InputMode`` (driver).

A TensorFlowOnSpark program keeps working after ``from tensorflowonspark import TFCluster``
becomes ``from tfos import TFCluster``::

    cluster = TFCluster.run(sc, main_fun, args, num_executors, num_ps, tensorboard,
                            TFCluster.InputMode.SPARK, master_node="chief")
    cluster.train(rdd, num_epochs=2)
    cluster.shutdown()
"""

from ._cluster import TFCluster, run
from .cluster_template import InputMode

__all__ = ["run", "TFCluster", "InputMode"]
