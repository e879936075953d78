"""Spark ML pipeline API: ``TFEstimator`` and ``TFModel`` (TFoS-compatible; driver + Spark tasks).

``TFEstimator.fit(df)`` starts a tfos cluster in InputMode.SPARK, feeds the DataFrame's
``input_mapping`` columns (in sorted column order) to ``train_fn(args, ctx)`` for ``epochs``
epochs, shuts the cluster down and returns a :class:`TFModel`. ``TFModel.transform(df)``
runs the exported SavedModel on every partition (no cluster needed) and returns a
DataFrame with the ``output_mapping`` columns::

    est = TFEstimator(train_fn, args).setInputMapping({"image": "image", "label": "label"}) \\
        .setClusterSize(2).setEpochs(2).setExportDir("/tmp/export").setFeedTimeout(900)
    model = est.fit(df)
    preds = model.setInputMapping({"image": "x"}).setOutputMapping({"y": "prediction"}).transform(df)

Both are Spark ML persistable (``MLWritable``/``MLReadable``), alone or as pipeline stages::

    Pipeline(stages=[assembler, est]).fit(df).write().overwrite().save(path)
    PipelineModel.load(path).transform(df)

A saved stage is a directory: ``metadata/`` (Spark's JSON of every param, set and default,
plus tfos's ``tfosFormat``/``args``) and, for a ``TFEstimator`` (or args that are not plain
JSON), ``code/``: ``train_fn``/``export_fn`` (and args) serialized with cloudpickle, with its
SHA-256 in the metadata. Loading ``code/`` unpickles it, which runs code like any pickle.
``save`` writes no ``code/`` for a ``TFModel`` whose args are plain JSON (the usual case), but
``load`` trusts the directory's metadata: whoever can write a saved directory (metadata and
``code/``) can make ``load`` run code, whatever the stage's class. The SHA-256 detects a
damaged file, not a forged one. Load stages only from paths that only you can write.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Iterator, Optional

from pyspark.ml import Estimator, Model
from pyspark.ml.util import MLReadable, MLWritable

from . import TFCluster
from ._data.feed_plan import FEED_TIMEOUT_S
from ._pipeline import runner as _runner
from ._pipeline.params import (
    HasBatchSize,
    HasClusterSize,
    HasDriverPSNodes,
    HasEpochs,
    HasExportDir,
    HasFeedTimeout,
    HasGraceSecs,
    HasInputMapping,
    HasInputMode,
    HasMasterNode,
    HasModelDir,
    HasNumPS,
    HasOutputMapping,
    HasProtocol,
    HasReaders,
    HasSignatureDefKey,
    HasSteps,
    HasTagSet,
    HasTensorboard,
    HasTFRecordDir,
    Namespace,
    TFParams,
    TFTypeConverters,
)
from ._pipeline.persist import TFEstimatorReader, TFModelReader, TFStageWriter
from ._pipeline.runner import output_schema, run_model, signature_outputs
from .cluster_template import InputMode
from .errors import ConfigurationError

__all__ = [
    "TFEstimator", "TFModel", "TFEstimatorReader", "TFModelReader", "TFStageWriter", "Namespace", "TFParams", "TFTypeConverters",
    "single_node_env", "get_meta_graph_def", "yield_batch",
]

#: TFoS's per-Python-worker model globals, read from :mod:`tfos._pipeline.runner` (Spark task).
_RUNNER_GLOBALS = frozenset({"pred_fn", "global_sess", "global_args", "global_model"})


def __getattr__(name: str) -> Any:
    """``pred_fn``, ``global_sess``, ``global_args``, ``global_model``: the runner's current values."""
    if name in _RUNNER_GLOBALS:
        return getattr(_runner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

log = logging.getLogger(__name__)
#: TFoS's name for this module's logger.
logger = log


class TFEstimator(
    Estimator, TFParams, MLWritable, MLReadable, HasInputMapping, HasClusterSize, HasNumPS, HasInputMode, HasMasterNode, HasProtocol,
    HasGraceSecs, HasTensorboard, HasModelDir, HasExportDir, HasTFRecordDir, HasBatchSize, HasEpochs, HasReaders,
    HasSteps, HasDriverPSNodes, HasFeedTimeout,
):
    """Spark ML Estimator that trains with tfos in InputMode.SPARK (driver).

    Args:
        train_fn: ``train_fn(args, ctx)``, run on every node; reads with ``TFNode.DataFeed``
            (rows hold the ``input_mapping`` columns in sorted column-name order).
        tf_args: dict, argparse Namespace or argv list; params are merged into it.
        export_fn: Kept for TFoS compatibility (unused; export from ``train_fn``).

    Raises (from ``fit``):
        ConfigurationError, ClusterFailedError: As ``TFCluster.run`` / ``train``.
    """

    def __init__(self, train_fn: Callable, tf_args: Any, export_fn: Optional[Callable] = None):
        super().__init__()
        self.train_fn = train_fn
        self.export_fn = export_fn
        self.args = Namespace(tf_args)
        self._setDefault(
            input_mapping={}, cluster_size=1, num_ps=0, driver_ps_nodes=False, input_mode=int(InputMode.SPARK),
            master_node="chief", protocol="grpc", tensorboard=False, model_dir=None, export_dir=None,
            tfrecord_dir=None, batch_size=100, epochs=1, readers=1, steps=1000, grace_secs=30, feed_timeout=FEED_TIMEOUT_S,
        )

    def _fit(self, dataset: Any) -> "TFModel":
        from pyspark import SparkContext

        local_args = self.merge_args_params()
        tf_args = self.args.argv if self.args.argv else local_args
        if InputMode(local_args.input_mode) != InputMode.SPARK:
            raise ConfigurationError("TFEstimator feeds the DataFrame to the nodes: input_mode must be InputMode.SPARK")
        sc = SparkContext.getOrCreate()
        input_cols = sorted(self.getInputMapping())
        cluster = TFCluster.run(
            sc, self.train_fn, tf_args, local_args.cluster_size, local_args.num_ps, local_args.tensorboard,
            InputMode.SPARK, driver_ps_nodes=local_args.driver_ps_nodes, master_node=local_args.master_node,
        )
        with cluster:
            data = dataset.select(input_cols) if input_cols else dataset
            cluster.train(data.rdd, local_args.epochs, feed_timeout=local_args.feed_timeout)
            cluster.shutdown(grace_secs=local_args.grace_secs)
        _warn_if_not_exported(local_args.export_dir)
        return self._copyValues(TFModel(self.args))

    def write(self) -> "TFStageWriter":
        """A Spark ML writer: params, args and ``train_fn``/``export_fn`` (cloudpickle) (driver)."""
        return TFStageWriter(self)

    @classmethod
    def read(cls) -> "TFEstimatorReader":
        """A Spark ML reader; its ``load`` unpickles ``train_fn`` (trusted paths only) (driver)."""
        return TFEstimatorReader(cls)


def _warn_if_not_exported(export_dir: Optional[str]) -> None:
    """WARNING when ``fit`` ends with no SavedModel the driver can see at ``export_dir`` (driver).

    ``TFModel.transform`` loads ``export_dir`` in every Spark task; without this the first sign
    of a ``train_fn`` that exported nothing (or elsewhere) is a failed transform job. Only
    local paths (no scheme, or ``file:``) are checked; a path on another host's local disk
    shows as missing here too, which is also what transform's tasks on other hosts would see.
    """
    if not export_dir:
        log.warning("TFEstimator.fit: export_dir is not set; TFModel.transform needs the SavedModel train_fn "
                    "exports (set it with setExportDir or an export_dir argument, and export there from train_fn)")
        return
    path = str(export_dir)
    if path.startswith("file:"):
        path = path[len("file:"):]
        if path.startswith("//"):
            path = path[2:]
    elif "://" in path:
        return
    if not os.path.exists(os.path.join(path, "saved_model.pb")):
        log.warning("TFEstimator.fit: no SavedModel at export_dir %s after training (no saved_model.pb there, as "
                    "seen from the driver); TFModel.transform loads it from there in every Spark task, so train_fn "
                    "should export to it (e.g. the chief with model.export or tf.saved_model.save)", export_dir)


class TFModel(Model, TFParams, MLWritable, MLReadable, HasInputMapping, HasOutputMapping, HasBatchSize, HasModelDir, HasExportDir, HasSignatureDefKey, HasTagSet):
    """Spark ML Model that runs an exported SavedModel on every partition (driver + Spark tasks).

    ``transform(df)`` feeds the ``input_mapping`` columns (sorted by column name) in batches of
    ``batch_size`` to the signature ``signature_def_key`` of the SavedModel at ``export_dir``
    and returns a DataFrame of the ``output_mapping`` columns, one row per input row. The
    model is loaded once per Python worker and cached.

    Spark array columns are flat: as in TFoS, a row whose number of values equals that of
    one element of a fully known signature input shape is reshaped to it (784 floats feed a
    ``(None, 28, 28, 1)`` input).

    The output schema is read from the signature (floats -> double, ints -> long, bools ->
    boolean, strings -> binary, one array level per row dimension), so an empty input gives
    an empty DataFrame with that schema.

    Raises (from ``transform``):
        ValueError: Missing export_dir, input_mapping or output_mapping (driver); a mapping
            that names an unknown signature input/output, or a column whose rows fit
            neither the input's shape nor its number of values (both raised in a Spark
            task, so they reach the driver inside Spark's Python error).
    """

    #: Its saved ``code/`` part holds only pickled args (never code): see tfos._pipeline.persist.
    _CODE_HOLDS_ONLY_ARGS = True

    def __init__(self, tf_args: Any = None):
        super().__init__()
        self.args = Namespace(tf_args or {})
        self._setDefault(input_mapping={}, output_mapping={}, batch_size=100, model_dir=None, export_dir=None, signature_def_key="serving_default", tag_set="serve")

    def _transform(self, dataset: Any) -> Any:
        from pyspark.sql import SparkSession

        input_cols = sorted(self.getInputMapping())
        output_cols = [col for _, col in sorted(self.getOutputMapping().items())]
        local_args = self.merge_args_params()
        if not local_args.export_dir:
            raise ValueError("TFModel needs export_dir (the SavedModel to run)")
        if not input_cols or not output_cols:
            raise ValueError("TFModel needs input_mapping {column: signature input} and output_mapping {signature output: column}")
        spark = SparkSession.builder.getOrCreate()
        settings = {
            "export_dir": local_args.export_dir,
            "tag_set": local_args.tag_set,
            "signature_def_key": local_args.signature_def_key,
            "batch_size": int(local_args.batch_size),
            "inputs": [self.getInputMapping()[c] for c in input_cols],
            "input_cols": input_cols,
            "outputs": [name for name, _ in sorted(self.getOutputMapping().items())],
        }
        # The output schema comes from the signature (one small Spark task, which also checks
        # the mappings); inferring it from the first rows would fail on an empty DataFrame and
        # run the model on the first partition(s) an extra time.
        kinds = spark.sparkContext.parallelize([settings], 1).map(signature_outputs).collect()[0]
        schema = output_schema(output_cols, kinds)
        rdd_out = dataset.select(input_cols).rdd.mapPartitions(lambda it: run_model(it, settings))
        return spark.createDataFrame(rdd_out, schema if schema is not None else output_cols)

    def write(self) -> "TFStageWriter":
        """A Spark ML writer: params and args (driver)."""
        return TFStageWriter(self)

    @classmethod
    def read(cls) -> "TFModelReader":
        """A Spark ML reader (driver)."""
        return TFModelReader(cls)


# --------------------------------------------------------------------------------------------
# TFoS's module-level helpers
# --------------------------------------------------------------------------------------------


def single_node_env(args: Any) -> None:
    """Prepares this process for single-node TensorFlow from parsed args (Spark task).

    Sets ``sys.argv`` from an argv list (or ``args.argv``), then calls
    :func:`tfos.util.single_node_env` with ``args.num_gpus`` (default 1): Hadoop class path
    and ``CUDA_VISIBLE_DEVICES``.

    Args:
        args: An argv list, or a namespace/:class:`Namespace` (optionally with ``argv`` and
            ``num_gpus``).
    """
    import sys

    from . import util

    if isinstance(args, list):
        sys.argv = args
    elif getattr(args, "argv", None):
        sys.argv = args.argv
    num_gpus = args.num_gpus if not isinstance(args, list) and "num_gpus" in args else 1
    util.single_node_env(num_gpus)


def get_meta_graph_def(saved_model_dir: str, tag_set: str) -> Any:
    """The ``MetaGraphDef`` of a SavedModel whose tags are exactly ``tag_set`` (anywhere TF is).

    Reads ``saved_model.pb`` with TensorFlow's SavedModel loader (TFoS used the removed
    ``tf.contrib`` reader).

    Args:
        saved_model_dir: The SavedModel directory (any TensorFlow file system URI).
        tag_set: Comma-separated tags, e.g. ``"serve"``.

    Returns:
        A ``tensorflow.core.protobuf.meta_graph_pb2.MetaGraphDef``.

    Raises:
        RuntimeError: No meta graph has exactly these tags (the message lists the tag sets).
        OSError: No SavedModel in ``saved_model_dir``.
    """
    from tensorflow.python.saved_model import loader_impl

    wanted = {t.strip() for t in tag_set.split(",") if t.strip()}
    saved_model = loader_impl.parse_saved_model(saved_model_dir)
    found = []
    for mgd in saved_model.meta_graphs:
        tags = set(mgd.meta_info_def.tags)
        if tags == wanted:
            return mgd
        found.append(sorted(tags))
    raise RuntimeError(f"MetaGraphDef associated with tag-set {tag_set} could not be found in SavedModel {saved_model_dir}; it has {found}")


def yield_batch(iterable: Any, batch_size: int, num_tensors: int = 1) -> Iterator[list]:
    """Groups rows into column batches (Spark task; pure).

    Args:
        iterable: Rows (tuples/lists of at least ``num_tensors`` items); a ``None`` row ends
            the input early.
        batch_size: Rows per batch (the last batch may be shorter).
        num_tensors: Columns to take from each row.

    Yields:
        ``[column_0_values, ..., column_{n-1}_values]``, each a list of ``batch_size``
        values; ``bytearray`` values become ``str(value)`` exactly as in TFoS (which gives
        ``"bytearray(b'...')"`` on Python 3).
    """
    cols: list = [[] for _ in range(num_tensors)]
    for row in iterable:
        if row is None:
            break
        for i in range(num_tensors):
            v = row[i]
            cols[i].append(str(v) if type(v) is bytearray else v)
        if len(cols[0]) >= batch_size:
            yield cols
            cols = [[] for _ in range(num_tensors)]
    if cols and cols[0]:
        yield cols
