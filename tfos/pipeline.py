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

import argparse
import base64
import copy
import hashlib
import json
import logging
import os
import pickle
import threading
from typing import Any, Callable, Iterator, Optional

from pyspark.ml import Estimator, Model
from pyspark.ml.param.shared import Param, Params, TypeConverters
from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter, MLReadable, MLReader, MLWritable, MLWriter

from . import TFCluster
from .cluster_template import InputMode
from .errors import ConfigurationError

__all__ = [
    "TFEstimator", "TFModel", "TFEstimatorReader", "TFModelReader", "TFStageWriter", "Namespace", "TFParams", "TFTypeConverters", "single_node_env", "get_meta_graph_def",
    "yield_batch",
]

log = logging.getLogger(__name__)
#: TFoS's name for this module's logger.
logger = log


class TFTypeConverters:
    """Extra Param type converters."""

    @staticmethod
    def toDict(value: Any) -> dict:
        """Accepts a dict only.

        Raises:
            TypeError: For anything else.
        """
        if isinstance(value, dict):
            return value
        raise TypeError(f"Could not convert {value!r} to a dict")

    @staticmethod
    def toInputMode(value: Any) -> int:
        """Accepts an :class:`InputMode` or its int value (0 or 1); returns the int.

        (Spark's ``TypeConverters.toInt`` refuses ``InputMode.SPARK``, an IntEnum.)

        Raises:
            TypeError: For anything else.
        """
        if isinstance(value, int) and not isinstance(value, bool):
            try:
                return int(InputMode(int(value)))
            except ValueError:
                pass
        raise TypeError(f"Could not convert {value!r} to an InputMode (0=TENSORFLOW, 1=SPARK)")


def _param(name: str, doc: str, conv: Callable = TypeConverters.identity) -> Param:
    return Param(Params._dummy(), name, doc, typeConverter=conv)


class HasBatchSize(Params):
    """Param ``batch_size``: rows per batch."""

    batch_size = _param("batch_size", "Number of records per batch", TypeConverters.toInt)

    def setBatchSize(self, value: int):
        return self._set(batch_size=value)

    def getBatchSize(self) -> int:
        return self.getOrDefault(self.batch_size)


class HasClusterSize(Params):
    """Param ``cluster_size``: number of nodes."""

    cluster_size = _param("cluster_size", "Number of nodes in the cluster", TypeConverters.toInt)

    def setClusterSize(self, value: int):
        return self._set(cluster_size=value)

    def getClusterSize(self) -> int:
        return self.getOrDefault(self.cluster_size)


class HasEpochs(Params):
    """Param ``epochs``: passes over the data (>= 1)."""

    epochs = _param("epochs", "Number of epochs to train", TypeConverters.toInt)

    def setEpochs(self, value: int):
        return self._set(epochs=value)

    def getEpochs(self) -> int:
        return self.getOrDefault(self.epochs)


class HasFeedTimeout(Params):
    """Param ``feed_timeout``: seconds a node may accept no data before the feed fails."""

    feed_timeout = _param("feed_timeout", "Seconds a node may accept no data before the feed fails", TypeConverters.toFloat)

    def setFeedTimeout(self, value: float):
        return self._set(feed_timeout=value)

    def getFeedTimeout(self) -> float:
        return self.getOrDefault(self.feed_timeout)


class HasGraceSecs(Params):
    """Param ``grace_secs``: passed to ``shutdown(grace_secs=...)``."""

    grace_secs = _param("grace_secs", "Seconds to wait after the workers finish before stopping ps nodes", TypeConverters.toInt)

    def setGraceSecs(self, value: int):
        return self._set(grace_secs=value)

    def getGraceSecs(self) -> int:
        return self.getOrDefault(self.grace_secs)


class HasInputMapping(Params):
    """Param ``input_mapping``: ``{DataFrame column: tensor/signature input name}``."""

    input_mapping = _param("input_mapping", "Mapping of input DataFrame column to input tensor", TFTypeConverters.toDict)

    def setInputMapping(self, value: dict):
        return self._set(input_mapping=value)

    def getInputMapping(self) -> dict:
        return self.getOrDefault(self.input_mapping)


class HasInputMode(Params):
    """Param ``input_mode``: :class:`InputMode` (SPARK for TFEstimator)."""

    input_mode = _param("input_mode", "Input data feeding mode (0=TENSORFLOW, 1=SPARK)", TFTypeConverters.toInputMode)

    def setInputMode(self, value: Any):
        return self._set(input_mode=value)

    def getInputMode(self) -> int:
        return self.getOrDefault(self.input_mode)


class HasMasterNode(Params):
    """Param ``master_node``: None, 'chief' or 'master'."""

    master_node = _param("master_node", "Job name of the master/chief node", TypeConverters.identity)

    def setMasterNode(self, value: Optional[str]):
        return self._set(master_node=value)

    def getMasterNode(self) -> Optional[str]:
        return self.getOrDefault(self.master_node)


class HasDriverPSNodes(Params):
    """Param ``driver_ps_nodes``: run ps nodes on the driver host."""

    driver_ps_nodes = _param("driver_ps_nodes", "Run parameter servers on the driver", TypeConverters.toBoolean)

    def setDriverPSNodes(self, value: bool):
        return self._set(driver_ps_nodes=value)

    def getDriverPSNodes(self) -> bool:
        return self.getOrDefault(self.driver_ps_nodes)


class HasModelDir(Params):
    """Param ``model_dir``: checkpoint directory."""

    model_dir = _param("model_dir", "Path to save/load model checkpoints", TypeConverters.identity)

    def setModelDir(self, value: str):
        return self._set(model_dir=value)

    def getModelDir(self) -> Optional[str]:
        return self.getOrDefault(self.model_dir)


class HasExportDir(Params):
    """Param ``export_dir``: SavedModel directory."""

    export_dir = _param("export_dir", "Directory of the exported SavedModel", TypeConverters.identity)

    def setExportDir(self, value: str):
        return self._set(export_dir=value)

    def getExportDir(self) -> Optional[str]:
        return self.getOrDefault(self.export_dir)


class HasNumPS(HasDriverPSNodes):
    """Params ``num_ps`` (number of parameter servers) and, as in TFoS, ``driver_ps_nodes``
    (``setDriverPSNodes`` / ``getDriverPSNodes``)."""

    num_ps = _param("num_ps", "Number of PS nodes in cluster", TypeConverters.toInt)

    def setNumPS(self, value: int):
        return self._set(num_ps=value)

    def getNumPS(self) -> int:
        return self.getOrDefault(self.num_ps)


class HasOutputMapping(Params):
    """Param ``output_mapping``: ``{signature output name: DataFrame column}``."""

    output_mapping = _param("output_mapping", "Mapping of output tensor to output DataFrame column", TFTypeConverters.toDict)

    def setOutputMapping(self, value: dict):
        return self._set(output_mapping=value)

    def getOutputMapping(self) -> dict:
        return self.getOrDefault(self.output_mapping)


class HasProtocol(Params):
    """Param ``protocol``: 'grpc' (kept for TFoS compatibility)."""

    protocol = _param("protocol", "Network protocol for TensorFlow (grpc|rdma)", TypeConverters.toString)

    def setProtocol(self, value: str):
        return self._set(protocol=value)

    def getProtocol(self) -> str:
        return self.getOrDefault(self.protocol)


class HasReaders(Params):
    """Param ``readers``: reader threads (for the user's own input pipeline)."""

    readers = _param("readers", "Number of reader/enqueue threads", TypeConverters.toInt)

    def setReaders(self, value: int):
        return self._set(readers=value)

    def getReaders(self) -> int:
        return self.getOrDefault(self.readers)


class HasSignatureDefKey(Params):
    """Param ``signature_def_key``: SavedModel signature used by TFModel."""

    signature_def_key = _param("signature_def_key", "Identifier for a specific saved signature", TypeConverters.identity)

    def setSignatureDefKey(self, value: str):
        return self._set(signature_def_key=value)

    def getSignatureDefKey(self) -> str:
        return self.getOrDefault(self.signature_def_key)


class HasSteps(Params):
    """Param ``steps``: maximum training steps (for ``train_fn``)."""

    steps = _param("steps", "Maximum number of steps to train", TypeConverters.toInt)

    def setSteps(self, value: int):
        return self._set(steps=value)

    def getSteps(self) -> int:
        return self.getOrDefault(self.steps)


class HasTagSet(Params):
    """Param ``tag_set``: comma-separated SavedModel tags."""

    tag_set = _param("tag_set", "Comma-delimited list of tags identifying a saved model", TypeConverters.toString)

    def setTagSet(self, value: str):
        return self._set(tag_set=value)

    def getTagSet(self) -> str:
        return self.getOrDefault(self.tag_set)


class HasTensorboard(Params):
    """Param ``tensorboard``: start TensorBoard on the chief."""

    tensorboard = _param("tensorboard", "Launch tensorboard process", TypeConverters.toBoolean)

    def setTensorboard(self, value: bool):
        return self._set(tensorboard=value)

    def getTensorboard(self) -> bool:
        return self.getOrDefault(self.tensorboard)


class HasTFRecordDir(Params):
    """Param ``tfrecord_dir``: kept for TFoS compatibility (InputMode.TENSORFLOW staging)."""

    tfrecord_dir = _param("tfrecord_dir", "Path to temporarily export a DataFrame as TFRecords", TypeConverters.identity)

    def setTFRecordDir(self, value: str):
        return self._set(tfrecord_dir=value)

    def getTFRecordDir(self) -> Optional[str]:
        return self.getOrDefault(self.tfrecord_dir)


class Namespace(argparse.Namespace):
    """An argparse-like namespace built from a dict, a Namespace or an argv list.

    Attributes:
        argv: The argv list when built from one (passed to ``train_fn`` as is), else None
            (a class attribute then, so it is not among the namespace's keys, as in TFoS).

    Raises:
        TypeError: For any other ``d`` (None gives an empty namespace).
    """

    argv: Optional[list] = None

    def __init__(self, d: Any = None):
        super().__init__()
        if isinstance(d, list):
            self.argv = d
        elif isinstance(d, dict):
            self.__dict__.update(d)
        elif isinstance(d, argparse.Namespace):
            self.__dict__.update(vars(d))
        elif d is not None:
            raise TypeError(f"tf_args must be a dict, an argparse.Namespace or an argv list, got {type(d).__name__}")

    def __contains__(self, key: object) -> bool:
        return key in self.__dict__

    def __iter__(self) -> Iterator[str]:
        """The argv items when built from an argv list, else the attribute names (TFoS)."""
        return iter(self.argv if self.argv else list(self.__dict__))


class TFParams(Params):
    """Mixes the Spark ML params into the user's ``tf_args`` (driver)."""

    args: Namespace

    def merge_args_params(self) -> Namespace:
        """A copy of ``self.args`` with every param's value set as an attribute."""
        local_args = copy.copy(self.args)
        for p in self.params:
            if self.isDefined(p):
                setattr(local_args, p.name, self.getOrDefault(p))
        return local_args


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
            tfrecord_dir=None, batch_size=100, epochs=1, readers=1, steps=1000, grace_secs=30, feed_timeout=600.0,
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
        kinds = spark.sparkContext.parallelize([settings], 1).map(_signature_outputs).collect()[0]
        schema = _output_schema(output_cols, kinds)
        rdd_out = dataset.select(input_cols).rdd.mapPartitions(lambda it: _run_model(it, settings))
        return spark.createDataFrame(rdd_out, schema if schema is not None else output_cols)

    def write(self) -> "TFStageWriter":
        """A Spark ML writer: params and args (driver)."""
        return TFStageWriter(self)

    @classmethod
    def read(cls) -> "TFModelReader":
        """A Spark ML reader (driver)."""
        return TFModelReader(cls)


# --------------------------------------------------------------------------------------------
# Spark ML persistence (driver)
# --------------------------------------------------------------------------------------------

#: Version of the tfos part of a saved stage's metadata.
PERSIST_FORMAT = 1


def _json_exact(value: Any) -> bool:
    """True when ``value`` survives a JSON round trip unchanged (types included: no tuple,
    no int dict key, no float subclass, no NaN)."""
    try:
        text = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return _same(json.loads(text), value)


def _same(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _stage_payload(instance: Any) -> tuple:
    """``(metadata extras, code dict or None)`` of a TFEstimator/TFModel (driver; pure).

    ``args`` go into the JSON metadata when they survive JSON exactly, else into the code
    dict. A TFEstimator's ``train_fn``/``export_fn`` always go into the code dict.

    Raises:
        ValueError: A set or default param value that JSON cannot hold exactly (names it).
    """
    for pmap in (instance._paramMap, instance._defaultParamMap):
        for param, value in pmap.items():
            if not _json_exact(value):
                raise ValueError(
                    f"{type(instance).__name__} param {param.name}={value!r} cannot be saved: "
                    "Spark ML persistence stores params as JSON (use str/int/float/bool/None, lists and dicts with str keys)"
                )
    args = dict(vars(instance.args))
    code: dict = {}
    extras: dict = {"tfosFormat": PERSIST_FORMAT, "args": None}
    if _json_exact(args):
        extras["args"] = args
    else:
        code["args"] = args
    if isinstance(instance, TFEstimator):
        code["train_fn"] = instance.train_fn
        code["export_fn"] = instance.export_fn
    return extras, (code or None)


def _dump_code(code: dict) -> tuple:
    """``(base64 text, sha256 hex)`` of ``code`` pickled with cloudpickle (functions by value
    when their module is not importable, by reference otherwise)."""
    from pyspark import cloudpickle

    blob = cloudpickle.dumps(code, protocol=pickle.HIGHEST_PROTOCOL)
    return base64.b64encode(blob).decode("ascii"), hashlib.sha256(blob).hexdigest()


def _load_code(text: str, sha256: str, where: str) -> dict:
    """Unpickles what :func:`_dump_code` wrote, after checking its SHA-256 (driver).

    Raises:
        ValueError: The bytes are not the ones saved (truncated or changed file).
    """
    blob = base64.b64decode(text.encode("ascii"), validate=True)
    got = hashlib.sha256(blob).hexdigest()
    if got != sha256:
        raise ValueError(f"{where}: the saved code's SHA-256 is {got}, the metadata says {sha256}: the stage is damaged or was changed")
    code = pickle.loads(blob)
    if not isinstance(code, dict):
        raise ValueError(f"{where}: the saved code is a {type(code).__name__}, not a dict")
    return code


class TFStageWriter(MLWriter):
    """Saves a :class:`TFEstimator` or :class:`TFModel` to a directory (driver).

    ``<path>/metadata``: Spark's ``DefaultParamsWriter`` JSON (class, uid, every set and
    default param) plus ``tfosFormat``, ``args`` (JSON, or null when pickled) and ``code``
    (``{"sha256": ...}`` or null). ``<path>/code``: one text line, the base64 of the
    cloudpickled ``{"train_fn", "export_fn"[, "args"]}``. Both go through Spark's writers,
    so any Hadoop file system path works.

    Raises (from ``save``):
        ValueError: A param value JSON cannot hold exactly.
        pickle.PicklingError / TypeError: ``train_fn`` or args cloudpickle cannot serialize.
    """

    def __init__(self, instance: Any):
        super().__init__()
        self.instance = instance

    def saveImpl(self, path: str) -> None:
        extras, code = _stage_payload(self.instance)
        spark = self.sparkSession
        text = None
        if code is not None:
            text, sha = _dump_code(code)
            extras["code"] = {"sha256": sha}
        else:
            extras["code"] = None
        DefaultParamsWriter.saveMetadata(self.instance, path, _metadata_target(spark), extraMetadata=extras)
        if text is not None:
            spark.createDataFrame([(text,)], schema=["value"]).coalesce(1).write.text(os.path.join(path, "code"))
        log.info("saved %s %s to %s (code: %s)", type(self.instance).__name__, self.instance.uid, path, code is not None)


def _metadata_target(spark: Any) -> Any:
    """What PySpark's ``DefaultParamsWriter.saveMetadata``/``DefaultParamsReader.loadMetadata``
    take (driver): the session on PySpark 4 (its SparkContext is not there under Spark
    Connect); PySpark 3.5 calls ``sc.parallelize``/``sc.textFile``, so the SparkContext there."""
    import pyspark

    return spark if int(pyspark.__version__.split(".")[0]) >= 4 else spark.sparkContext


def _check_metadata(metadata: dict, cls: type, path: str) -> Any:
    """Checks a saved stage's metadata before anything is unpickled; returns its ``code``
    entry (``{"sha256": ...}`` or None) (driver).

    Raises:
        ValueError: Not a tfos stage, a newer format, saved by another class than ``cls``, or
            malformed or contradictory metadata (JSON args and a ``code/`` part for a
            TFModel); the message names ``path``.
    """
    if "tfosFormat" not in metadata:
        raise ValueError(f"{path} holds a saved {metadata.get('class')}, not a tfos TFEstimator/TFModel")
    fmt = metadata["tfosFormat"]
    if not isinstance(fmt, int) or isinstance(fmt, bool):
        raise ValueError(f"{path}: metadata tfosFormat is {fmt!r}, not an integer: the stage is damaged or was changed")
    if fmt > PERSIST_FORMAT:
        raise ValueError(f"{path} was saved in tfos persistence format {fmt}; this tfos reads up to {PERSIST_FORMAT}")
    want = f"{cls.__module__}.{cls.__name__}"
    if metadata.get("class") != want:
        raise ValueError(f"{path} holds a saved {metadata.get('class')}, not a {want}: load it with that class")
    code_meta = metadata.get("code")
    if code_meta is not None and not (isinstance(code_meta, dict) and isinstance(code_meta.get("sha256"), str)):
        raise ValueError(f"{path}: metadata code is {code_meta!r}, not {{'sha256': ...}}: the stage is damaged or was changed")
    if code_meta and cls is TFModel and metadata.get("args") is not None:
        # save() pickles a TFModel's args only when JSON cannot hold them: never both
        raise ValueError(f"{path}: a TFModel with JSON args and a code/ part was not written by tfos; refusing to unpickle it")
    return code_meta


class _TFStageReader(MLReader):
    """Loads what :class:`TFStageWriter` saved (driver)."""

    def __init__(self, cls: type):
        super().__init__()
        self.cls = cls

    def _metadata_and_code(self, path: str) -> tuple:
        spark = self.sparkSession
        metadata = DefaultParamsReader.loadMetadata(path, _metadata_target(spark))
        code_meta = _check_metadata(metadata, self.cls, path)
        code: dict = {}
        if code_meta:
            code_path = os.path.join(path, "code")
            first = spark.read.text(code_path).first()
            if first is None:
                raise ValueError(f"{code_path} is empty: the stage is damaged")
            text = first[0]
            code = _load_code(text, metadata["code"]["sha256"], code_path)
        args = metadata["args"] if metadata.get("args") is not None else code.get("args", {})
        return metadata, code, args

    @staticmethod
    def _finish(instance: Any, metadata: dict) -> Any:
        instance._resetUid(metadata["uid"])
        DefaultParamsReader.getAndSetParams(instance, metadata)
        return instance


class TFEstimatorReader(_TFStageReader):
    """Loads a saved :class:`TFEstimator` (driver). ``load`` unpickles ``train_fn``: it runs
    code like any pickle, so load only from paths you trust.

    Raises (from ``load``):
        ValueError: Not a tfos stage, a newer format, or damaged code (SHA-256 mismatch).
        Whatever unpickling raises (e.g. ModuleNotFoundError for a ``train_fn`` saved by
        reference to a module that is not importable here).
    """

    def load(self, path: str) -> Any:
        metadata, code, args = self._metadata_and_code(path)
        if "train_fn" not in code:
            raise ValueError(f"{path} holds no train_fn (saved by a {metadata.get('class')}?)")
        return self._finish(self.cls(code["train_fn"], args, code.get("export_fn")), metadata)


class TFModelReader(_TFStageReader):
    """Loads a saved :class:`TFModel` (driver). It unpickles ``code/`` only when the metadata
    says the args were not JSON (then it runs code like any pickle: load only from paths that
    only you can write); metadata with JSON args and a ``code/`` part is refused.

    Raises (from ``load``):
        ValueError: Not a tfos TFModel (e.g. a saved TFEstimator), a newer format, damaged or
            contradictory metadata, or damaged code (SHA-256 mismatch); names the path.
    """

    def load(self, path: str) -> Any:
        metadata, _code, args = self._metadata_and_code(path)
        return self._finish(self.cls(args), metadata)


_model_cache: dict = {}
_model_lock = threading.Lock()

# TFoS's per-Python-worker globals of TFModel (kept names; Spark task). tfos caches every
# loaded SavedModel in ``_model_cache`` by (export dir, tag set, signature key); these name
# the most recently used one, as TFoS's did. Assigning them changes nothing tfos does.
#: The signature function TFModel last ran in this Python worker (a ``ConcreteFunction``).
pred_fn: Any = None
#: TF1 session cache of TFoS; always None: tfos runs SavedModels eagerly (TF2).
global_sess: Any = None
#: The TFModel arguments of the last run in this Python worker (a dict of its params).
global_args: Any = None
#: The SavedModel object of ``pred_fn`` (from ``tf.saved_model.load``).
global_model: Any = None


def _load_signature(export_dir: str, tag_set: str, key: str) -> Any:
    import tensorflow as tf

    global pred_fn, global_model
    cache_key = (export_dir, tag_set, key)
    with _model_lock:
        if cache_key not in _model_cache:
            tags = [t for t in tag_set.split(",") if t] if tag_set else None
            loaded = tf.saved_model.load(export_dir, tags=tags)
            if key not in loaded.signatures:
                raise ValueError(f"SavedModel {export_dir} has no signature {key!r}; it has {list(loaded.signatures)}")
            _model_cache[cache_key] = (loaded, loaded.signatures[key])
        global_model, pred_fn = _model_cache[cache_key]
        return pred_fn


def _check_names(fn: Any, s: dict) -> None:
    """Raises ValueError when the mappings name a signature input/output that does not exist."""
    inputs = fn.structured_input_signature[1]
    for name in s["inputs"]:
        if name not in inputs:
            raise ValueError(f"input_mapping names signature input {name!r}, but the signature has {sorted(inputs)}")
    outputs = fn.structured_outputs
    if isinstance(outputs, dict):
        for name in s["outputs"]:
            if name not in outputs:
                raise ValueError(f"output_mapping names signature output {name!r}, but the signature has {sorted(outputs)}")


def _signature_outputs(s: dict) -> list:
    """``[(kind, rank), ...]`` of the mapped signature outputs (Spark task).

    ``kind`` is 'float', 'int', 'bool' or 'bytes' (None when unknown) and ``rank`` the
    rank of one row's value (the output's rank minus the batch dimension; None when
    unknown).

    Raises:
        ValueError: A mapping names a signature input/output that does not exist.
    """
    fn = _load_signature(s["export_dir"], s["tag_set"], s["signature_def_key"])
    _check_names(fn, s)
    outputs = fn.structured_outputs
    kinds = []
    for name in s["outputs"]:
        spec = outputs.get(name) if isinstance(outputs, dict) else None
        dtype = getattr(spec, "dtype", None)
        ndims = spec.shape.ndims if spec is not None else None
        kind = None
        if dtype is not None:
            if dtype.is_bool:
                kind = "bool"
            elif dtype.is_floating:
                kind = "float"
            elif dtype.is_integer and dtype.name != "uint64":
                kind = "int"
            elif dtype.name == "string":
                kind = "bytes"
        kinds.append((kind, ndims - 1 if ndims else None))
    return kinds


def _output_schema(cols: list, kinds: list) -> Any:
    """The StructType of TFModel's output (driver), or None when a type is unknown.

    Values come from ``numpy.tolist()``: floats -> DoubleType, ints -> LongType, bools ->
    BooleanType, strings -> BinaryType, nested in one ArrayType per row dimension.
    """
    from pyspark.sql.types import (
        ArrayType,
        BinaryType,
        BooleanType,
        DataType,
        DoubleType,
        LongType,
        StructField,
        StructType,
    )

    base = {"float": DoubleType, "int": LongType, "bool": BooleanType, "bytes": BinaryType}
    fields = []
    for col, (kind, rank) in zip(cols, kinds):
        if kind is None or rank is None or rank < 0:
            return None
        dtype: DataType = base[kind]()
        for _ in range(rank):
            dtype = ArrayType(dtype, True)
        fields.append(StructField(col, dtype, True))
    return StructType(fields)


def _fit_shape(values: Any, spec_shape: Any, column: str, name: str) -> Any:
    """The batch ``values`` (numpy, ``(rows, ...)``) of DataFrame column ``column`` in the
    shape of signature input ``name`` (pure; Spark task).

    Spark columns hold flat arrays, so, as TFoS did, a flat row whose length is the number
    of values of one element of a fully known input shape is reshaped to it: 784 values
    feed a ``(None, 28, 28, 1)`` input.

    Raises:
        ValueError: The row shape fits neither the input's shape nor its element count;
            names the column, the input, both shapes.
    """
    import numpy as np

    dims = list(spec_shape.as_list()) if spec_shape.rank is not None else None
    if dims is None or len(values) == 0:
        return values
    want = dims[1:]
    got = list(values.shape[1:])
    if len(got) == len(want) and all(w is None or w == g for w, g in zip(want, got)):
        return values
    if all(w is not None for w in want) and values.ndim >= 1 and values.dtype != object:
        if int(np.prod(want, dtype=np.int64)) == int(np.prod(got, dtype=np.int64)):
            return values.reshape([len(values)] + want)
    raise ValueError(
        f"TFModel: column {column!r} holds rows of shape {tuple(got)} ({int(np.prod(got, dtype=np.int64))} values), "
        f"but signature input {name!r} takes rows of shape {tuple(want)}: give the column rows of that shape, "
        "or of that many values in one flat array (they are reshaped)"
    )


def _run_model(rows: Iterator[Any], s: dict) -> Iterator[tuple]:
    """Runs the SavedModel over one partition in batches (Spark task)."""
    import numpy as np
    import tensorflow as tf

    global global_args
    global_args = dict(s)
    fn = _load_signature(s["export_dir"], s["tag_set"], s["signature_def_key"])
    _check_names(fn, s)
    specs = fn.structured_input_signature[1]
    batch: list = []

    in_cols = s.get("input_cols") or s["inputs"]

    def run(batch: list) -> Iterator[tuple]:
        feeds = {}
        for i, name in enumerate(s["inputs"]):
            values = _fit_shape(np.asarray([r[i] for r in batch]), specs[name].shape, in_cols[i], name)
            feeds[name] = tf.constant(values, dtype=specs[name].dtype)
        out = fn(**feeds)
        for name in s["outputs"]:
            if name not in out:
                raise ValueError(f"output_mapping names signature output {name!r}, but the signature has {sorted(out)}")
        cols = [out[name].numpy().tolist() for name in s["outputs"]]
        yield from zip(*cols)

    for row in rows:
        batch.append(row)
        if len(batch) >= s["batch_size"]:
            yield from run(batch)
            batch = []
    if batch:
        yield from run(batch)


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
