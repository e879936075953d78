"""Serialized tf.train.Example -> Rows or schema-ordered tuples (Spark tasks; TensorFlow imported lazily)."""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Sequence

from pyspark.sql import Row

from tfos._dfutil.schema import _BYTES, _as_name_set, _FieldSpec, infer_schema


def fromTFExample(iter: Iterable[Any], binary_features: Iterable[str] = ()) -> Iterator[Row]:  # noqa: A002
    """Converts serialized ``tf.train.Example`` records to Rows.

    Runs in Spark tasks (e.g. via ``rdd.mapPartitions``) or anywhere else with
    TensorFlow installed; TensorFlow is imported on first use.  Each record is
    decoded on its own, without a schema (TensorFlowOnSpark semantics): a
    feature with more than one value becomes a list, one value becomes a
    scalar, and no value becomes ``None``.  :func:`loadTFRecords` instead
    decodes against the inferred schema, so its array columns are always lists.

    Args:
        iter: Iterable of records, each serialized ``tf.train.Example`` bytes
            (``bytes``/``bytearray``), a ``(bytes, None)`` pair as produced by
            the Hadoop TFRecord input format, or a ``tf.train.Example``.
        binary_features: Names of ``BytesList`` features whose values are kept
            as ``bytearray`` instead of being decoded as utf-8 strings.

    Yields:
        One ``Row`` per record, with fields sorted by feature name: ``int``
        for ``Int64List``, ``float`` for ``FloatList``, ``str`` (or
        ``bytearray`` for binary features) for ``BytesList``.

    Raises:
        TypeError: If a record is not one of the accepted forms.
        ValueError: If a non-binary ``BytesList`` value is not valid utf-8.
    """
    import tensorflow as tf

    binary = _as_name_set(binary_features)
    for record in iter:
        example = _parse_example(tf, record)
        values = {}
        for name, feature in sorted(example.features.feature.items()):
            kind = feature.WhichOneof("kind")
            raw = list(getattr(feature, kind).value) if kind else []
            if kind == _BYTES:
                raw = [bytearray(v) if name in binary else _decode_utf8(name, v) for v in raw]
            values[name] = raw if len(raw) > 1 else (raw[0] if raw else None)
        yield Row(**values)


def _parse_example(tf: Any, record: Any) -> Any:
    """Parses one record into a ``tf.train.Example``.

    Args:
        tf: The imported ``tensorflow`` module.
        record: Serialized bytes, a ``(bytes, ...)`` pair, or an Example.

    Returns:
        A ``tf.train.Example``.

    Raises:
        TypeError: If ``record`` is none of the accepted forms.
    """
    if isinstance(record, tf.train.Example):
        return record
    if isinstance(record, (tuple, list)) and record:
        record = record[0]
    if not isinstance(record, (bytes, bytearray, memoryview)):
        raise TypeError(f"expected serialized tf.train.Example bytes, got {type(record).__name__}")
    example = tf.train.Example()
    example.ParseFromString(bytes(record))
    return example


def _infer_schema_in_task(record: bytes, binary_features: frozenset[str]) -> tuple[str, Any]:
    """Infers the schema from one serialized record; runs in a Spark task.

    Returns:
        ``("ok", StructType)`` or ``("error", message)``, so the driver can raise
        a ``ValueError`` instead of a wrapped task exception.
    """
    import tensorflow as tf

    try:
        return "ok", infer_schema(_parse_example(tf, record), binary_features)
    except ValueError as exc:
        return "error", str(exc)


def _decode_feature(feature: Any, spec: _FieldSpec) -> Any:
    """Decodes one feature into a value of its schema column.

    Args:
        feature: A ``tf.train.Feature``.
        spec: The column's decoding rule.

    Returns:
        A list for array columns (``[]`` when empty); for scalar columns the
        single value, or ``None`` when the list is empty.

    Raises:
        ValueError: If the feature's kind or value count does not fit the schema,
            or a string value is not valid utf-8.
    """
    kind = feature.WhichOneof("kind")
    raw = getattr(feature, kind).value if kind else ()
    if not raw:
        return [] if spec.is_array else None
    if kind != spec.kind:
        raise ValueError(f"feature {spec.name!r} is a {kind} but the schema inferred from the first "
                         f"record expects a {spec.kind}")
    if spec.kind == _BYTES:
        values = [bytearray(v) if spec.is_binary else _decode_utf8(spec.name, v) for v in raw]
    else:
        values = list(raw)
    if spec.is_array:
        return values
    if len(values) > 1:
        raise ValueError(f"feature {spec.name!r} has {len(values)} values but the schema inferred from "
                         "the first record (which had one value) is scalar")
    return values[0]


def _decode_utf8(name: str, value: bytes) -> str:
    """Decodes one ``BytesList`` value of feature ``name`` as utf-8.

    Raises:
        ValueError: If it is not valid utf-8 (naming the feature and the fix).
    """
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"bytes feature {name!r} is not valid utf-8 ({exc}); "
                         "pass it in binary_features to load it as binary") from None


def _examples_to_tuples(serialized: Iterable[Any], fields: Sequence[_FieldSpec]) -> Iterator[tuple[Any, ...]]:
    """Decodes serialized Examples into tuples ordered like ``fields``.

    Runs in a Spark task.

    Args:
        serialized: Serialized ``tf.train.Example`` records.
        fields: Decoding rules, in schema order.

    Yields:
        One tuple per record; missing features are ``None``.
    """
    import tensorflow as tf

    for record in serialized:
        feature_map = _parse_example(tf, record).features.feature
        yield tuple(
            _decode_feature(feature_map[spec.name], spec) if spec.name in feature_map else None
            for spec in fields
        )
