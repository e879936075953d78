"""Spark ML params of ``TFEstimator``/``TFModel`` and the ``tf_args`` namespace they merge into
(TFoS-compatible names, public through :mod:`tfos.pipeline`; driver)."""

from __future__ import annotations

import argparse
import copy
import types
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


def _has(camel: str, name: str, doc: str, conv: Callable, summary: str, base: Any = Params) -> Any:
    """TFoS's ``Has<camel>`` mixin: Param ``name`` with ``set<camel>(value)`` and ``get<camel>()``."""

    def setter(self: Any, value: Any) -> Any:
        return self._set(**{name: value})

    def getter(self: Any) -> Any:
        return self.getOrDefault(getattr(self, name))

    setter.__name__, setter.__qualname__ = f"set{camel}", f"Has{camel}.set{camel}"
    getter.__name__, getter.__qualname__ = f"get{camel}", f"Has{camel}.get{camel}"
    setter.__doc__, getter.__doc__ = f"Sets param ``{name}`` ({doc}).", f"Param ``{name}`` (set, else its default)."
    body = {name: _param(name, doc, conv), f"set{camel}": setter, f"get{camel}": getter, "__doc__": summary,
            "__module__": __name__}
    return types.new_class(f"Has{camel}", (base,), {}, lambda ns: ns.update(body))


HasBatchSize: Any = _has("BatchSize", "batch_size", "Number of records per batch", TypeConverters.toInt,
                          "Param ``batch_size``: rows per batch.")
HasClusterSize: Any = _has("ClusterSize", "cluster_size", "Number of nodes in the cluster", TypeConverters.toInt,
                            "Param ``cluster_size``: number of nodes.")
HasEpochs: Any = _has("Epochs", "epochs", "Number of epochs to train", TypeConverters.toInt,
                       "Param ``epochs``: passes over the data (>= 1).")
HasFeedTimeout: Any = _has("FeedTimeout", "feed_timeout", "Seconds a node may accept no data before the feed fails", TypeConverters.toFloat,
                            "Param ``feed_timeout``: seconds a node may accept no data before the feed fails.")
HasGraceSecs: Any = _has("GraceSecs", "grace_secs", "Seconds to wait after the workers finish before stopping ps nodes", TypeConverters.toInt,
                          "Param ``grace_secs``: passed to ``shutdown(grace_secs=...)``.")
HasInputMapping: Any = _has("InputMapping", "input_mapping", "Mapping of input DataFrame column to input tensor", TFTypeConverters.toDict,
                             "Param ``input_mapping``: ``{DataFrame column: tensor/signature input name}``.")
HasInputMode: Any = _has("InputMode", "input_mode", "Input data feeding mode (0=TENSORFLOW, 1=SPARK)", TFTypeConverters.toInputMode,
                          "Param ``input_mode``: :class:`InputMode` (SPARK for TFEstimator).")
HasMasterNode: Any = _has("MasterNode", "master_node", "Job name of the master/chief node", TypeConverters.identity,
                           "Param ``master_node``: None, 'chief' or 'master'.")
HasDriverPSNodes: Any = _has("DriverPSNodes", "driver_ps_nodes", "Run parameter servers on the driver", TypeConverters.toBoolean,
                              "Param ``driver_ps_nodes``: run ps nodes on the driver host.")
HasModelDir: Any = _has("ModelDir", "model_dir", "Path to save/load model checkpoints", TypeConverters.identity,
                         "Param ``model_dir``: checkpoint directory.")
HasExportDir: Any = _has("ExportDir", "export_dir", "Directory of the exported SavedModel", TypeConverters.identity,
                          "Param ``export_dir``: SavedModel directory.")
HasNumPS: Any = _has("NumPS", "num_ps", "Number of PS nodes in cluster", TypeConverters.toInt,
                      "Params ``num_ps`` (number of parameter servers) and, as in TFoS, ``driver_ps_nodes``.",
                      HasDriverPSNodes)
HasOutputMapping: Any = _has("OutputMapping", "output_mapping", "Mapping of output tensor to output DataFrame column", TFTypeConverters.toDict,
                              "Param ``output_mapping``: ``{signature output name: DataFrame column}``.")
HasProtocol: Any = _has("Protocol", "protocol", "Network protocol for TensorFlow (grpc|rdma)", TypeConverters.toString,
                         "Param ``protocol``: 'grpc' (kept for TFoS compatibility).")
HasReaders: Any = _has("Readers", "readers", "Number of reader/enqueue threads", TypeConverters.toInt,
                        "Param ``readers``: reader threads (for the user's own input pipeline).")
HasSignatureDefKey: Any = _has("SignatureDefKey", "signature_def_key", "Identifier for a specific saved signature", TypeConverters.identity,
                                "Param ``signature_def_key``: SavedModel signature used by TFModel.")
HasSteps: Any = _has("Steps", "steps", "Maximum number of steps to train", TypeConverters.toInt,
                      "Param ``steps``: maximum training steps (for ``train_fn``).")
HasTagSet: Any = _has("TagSet", "tag_set", "Comma-delimited list of tags identifying a saved model", TypeConverters.toString,
                       "Param ``tag_set``: comma-separated SavedModel tags.")
HasTensorboard: Any = _has("Tensorboard", "tensorboard", "Launch tensorboard process", TypeConverters.toBoolean,
                            "Param ``tensorboard``: start TensorBoard on the chief.")
HasTFRecordDir: Any = _has("TFRecordDir", "tfrecord_dir", "Path to temporarily export a DataFrame as TFRecords", TypeConverters.identity,
                            "Param ``tfrecord_dir``: kept for TFoS compatibility (InputMode.TENSORFLOW staging).")


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
