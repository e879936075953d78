"""tfos: distributed TensorFlow training and inference on Apache Spark.

The TensorFlowOnSpark names are kept, so a TFoS program runs after renaming its imports:
``from tfos import TFCluster, TFNode`` gives ``TFCluster.run(...)``,
``TFCluster.InputMode`` and ``TFNode.DataFeed``.

Where code runs:
    driver: :mod:`tfos.TFCluster` (``run``, ``TFCluster``), :mod:`tfos.TFParallel`, :mod:`tfos.pipeline`,
    :func:`tfos.authenticate_spark` (Spark authentication for a program that starts its own Spark);
    TF process: :mod:`tfos.TFNode`, :class:`tfos.datafeed.DataFeed`, :mod:`tfos.tf_server`, :mod:`tfos.compat`;
    anywhere (pure): :mod:`tfos.errors`, :mod:`tfos.cluster_template`.

TFoS's other modules are kept for programs that import them: :mod:`tfos.TFManager`,
:mod:`tfos.TFSparkNode`, :mod:`tfos.reservation`, :mod:`tfos.marker`, :mod:`tfos.util`,
:mod:`tfos.gpu_info`, :mod:`tfos.dfutil`, :mod:`tfos.compat` (``from tfos import TFManager``
works). docs/migration.md lists every difference from TFoS.
TensorFlow is imported lazily, only in the TF process and in TF helpers.
"""

from . import TFCluster, TFNode, errors
from .cluster_template import InputMode
from .datafeed import DataFeed
from .errors import (
    ClusterFailedError,
    ConfigurationError,
    FeedError,
    FeedTimeoutError,
    MalformedRowError,
    NodeFailedError,
    RecoveryFailedError,
    ReservationTimeoutError,
    TFOSError,
)
from .node_context import TFNodeContext
from .spark_auth import authenticate_spark

__version__ = "0.1.0"

__all__ = [
    "TFCluster",
    "TFNode",
    "InputMode",
    "DataFeed",
    "TFNodeContext",
    "authenticate_spark",
    "errors",
    "TFOSError",
    "ConfigurationError",
    "ReservationTimeoutError",
    "ClusterFailedError",
    "RecoveryFailedError",
    "NodeFailedError",
    "FeedTimeoutError",
    "FeedError",
    "MalformedRowError",
    "__version__",
]
