"""``TFModel.transform``'s work in Spark tasks: load the SavedModel once per Python worker,
run its signature over a partition in batches, and the output schema it gives (driver)."""

from __future__ import annotations

import threading
from typing import Any, Iterator

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


def signature_outputs(s: dict) -> list:
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


def output_schema(cols: list, kinds: list) -> Any:
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


def run_model(rows: Iterator[Any], s: dict) -> Iterator[tuple]:
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
