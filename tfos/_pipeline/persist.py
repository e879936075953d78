"""Spark ML persistence of ``TFEstimator``/``TFModel`` (driver): metadata JSON, and the
cloudpickled code with its SHA-256 (see :mod:`tfos.pipeline` for what loading trusts)."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import pickle
from typing import Any

from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter, MLReader, MLWriter

log = logging.getLogger(__name__)


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
    if hasattr(instance, "train_fn"):  # a TFEstimator
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
    if code_meta and getattr(cls, "_CODE_HOLDS_ONLY_ARGS", False) and metadata.get("args") is not None:
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
