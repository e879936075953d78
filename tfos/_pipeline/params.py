"""Spark ML params of ``TFEstimator``/``TFModel`` and the ``tf_args`` namespace they merge into
(TFoS-compatible names, public through :mod:`tfos.pipeline`; driver)."""

from __future__ import annotations

import argparse
import copy
from typing import Any, Callable, Iterator, Optional

from pyspark.ml.param.shared import Param, Params, TypeConverters

from tfos.cluster_template import InputMode


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
