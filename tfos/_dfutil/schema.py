"""Column types <-> tf.train.Feature kinds, and schema inference (pure; driver or Spark task)."""

from __future__ import annotations

import re
from typing import Any, Iterable, NamedTuple

from pyspark.sql.types import ArrayType, BinaryType, DataType, FloatType, LongType, StringType, StructField, StructType

_INT64 = "int64_list"


_FLOAT = "float_list"


_BYTES = "bytes_list"


_INT64_DTYPES = frozenset({"boolean", "tinyint", "smallint", "int", "bigint", "byte", "short", "integer", "long"})


_FLOAT_DTYPES = frozenset({"float", "double", "real"})


_STRING_DTYPE_RE = re.compile(r"^(string(\s+collate\s+\S+)?|(var)?char\(\d+\))$")


class _ColumnSpec(NamedTuple):
    """How one DataFrame column is encoded as a ``tf.train.Feature``.

    Attributes:
        name: Column name, used as the feature key.
        dtype: The column's Spark SQL type string, as in ``DataFrame.dtypes``.
        kind: Feature kind: ``"int64_list"``, ``"float_list"`` or ``"bytes_list"``.
        is_array: True for ``array<...>`` columns.
        is_string: True for (arrays of) strings, which are utf-8 encoded.
    """

    name: str
    dtype: str
    kind: str
    is_array: bool
    is_string: bool


class _FieldSpec(NamedTuple):
    """How one feature is decoded into a DataFrame column of a known schema.

    Attributes:
        name: Feature key and column name.
        kind: Expected feature kind (``"int64_list"``, ``"float_list"`` or ``"bytes_list"``).
        is_array: True when the column is an ``ArrayType``.
        is_binary: True when bytes are kept as ``bytearray`` instead of decoded as utf-8.
    """

    name: str
    kind: str
    is_array: bool
    is_binary: bool


def _column_spec(name: str, dtype: str) -> _ColumnSpec:
    """Maps a ``DataFrame.dtypes`` entry to its feature encoding.

    Args:
        name: Column name.
        dtype: Spark SQL type string, e.g. ``"int"`` or ``"array<float>"``.

    Returns:
        The column's ``_ColumnSpec``.

    Raises:
        TypeError: If the type is not supported.
    """
    normalized = dtype.strip().lower()
    is_array = normalized.startswith("array<") and normalized.endswith(">")
    element = normalized[len("array<") : -1].strip() if is_array else normalized
    if element in _INT64_DTYPES:
        return _ColumnSpec(name, dtype, _INT64, is_array, False)
    if element in _FLOAT_DTYPES:
        return _ColumnSpec(name, dtype, _FLOAT, is_array, False)
    if element == "binary":
        return _ColumnSpec(name, dtype, _BYTES, is_array, False)
    if _STRING_DTYPE_RE.match(element):
        return _ColumnSpec(name, dtype, _BYTES, is_array, True)
    raise TypeError(
        f"column {name!r} has unsupported type {dtype!r} for tf.train.Example; supported: "
        "boolean, tinyint, smallint, int, bigint, float, double, string, binary and arrays of these"
    )


def infer_schema(example: Any, binary_features: Iterable[str] = ()) -> StructType:
    """Infers a Spark SQL schema from one ``tf.train.Example``.

    Pure function; runs wherever it is called (driver or Spark task) and needs
    no TensorFlow import itself, only the ``tf.train.Example`` message.

    Args:
        example: A ``tf.train.Example`` message.
        binary_features: Names of ``BytesList`` features to type as
            ``BinaryType`` instead of ``StringType``.

    Returns:
        A ``StructType`` with one nullable field per feature, sorted by name:
        ``Int64List`` -> ``LongType``, ``FloatList`` -> ``FloatType``,
        ``BytesList`` -> ``StringType`` (``BinaryType`` for ``binary_features``),
        each wrapped in ``ArrayType`` when the feature holds more than one value.
        A feature with no kind set is typed ``StringType`` (as in
        TensorFlowOnSpark).

    Raises:
        ValueError: If ``binary_features`` names a feature that is not a
            ``BytesList``.
    """
    binary = _as_name_set(binary_features)
    fields = []
    for name, feature in sorted(example.features.feature.items()):
        kind = feature.WhichOneof("kind")
        if kind == _INT64:
            base: DataType = LongType()
        elif kind == _FLOAT:
            base = FloatType()
        else:
            base = StringType()
        if name in binary:
            if kind not in (_BYTES, None):
                raise ValueError(f"binary feature {name!r} is a {kind}, not a bytes_list")
            base = BinaryType()
        num_values = len(getattr(feature, kind).value) if kind else 0
        sql_type = ArrayType(base) if num_values > 1 else base
        fields.append(StructField(name, sql_type, nullable=True))
    return StructType(fields)


def _field_specs(schema: StructType) -> list[_FieldSpec]:
    """Derives per-column decoding rules from an inferred schema.

    Args:
        schema: Schema produced by :func:`infer_schema`.

    Returns:
        One ``_FieldSpec`` per field, in schema order.
    """
    specs = []
    for field in schema.fields:
        data_type = field.dataType
        is_array = isinstance(data_type, ArrayType)
        base = data_type.elementType if isinstance(data_type, ArrayType) else data_type
        if isinstance(base, LongType):
            kind = _INT64
        elif isinstance(base, FloatType):
            kind = _FLOAT
        else:
            kind = _BYTES
        specs.append(_FieldSpec(field.name, kind, is_array, isinstance(base, BinaryType)))
    return specs


def _as_name_set(names: Iterable[str] | None) -> frozenset[str]:
    """Returns feature names as a frozenset (``None`` -> empty)."""
    if names is None:
        return frozenset()
    if isinstance(names, str):
        return frozenset([names])
    return frozenset(names)
