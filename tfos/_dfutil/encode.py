"""Rows -> serialized tf.train.Example (the function runs in Spark tasks; TensorFlow imported lazily)."""

from __future__ import annotations

import operator
from typing import Any, Callable, Iterable, Iterator, Sequence

from tfos._dfutil.schema import _FLOAT, _INT64, _column_spec, _ColumnSpec


def toTFExample(dtypes: Sequence[tuple[str, str]]) -> Callable[[Iterable[Any]], Iterator[bytes]]:
    """Makes a function that converts Rows to serialized ``tf.train.Example``.

    Call it on the driver (the column types are checked here); the returned
    function runs in Spark tasks, typically via
    ``df.rdd.mapPartitions(toTFExample(df.dtypes))``, and imports TensorFlow.

    Args:
        dtypes: ``(column name, Spark SQL type string)`` pairs, as returned by
            ``DataFrame.dtypes``.  Supported types: boolean, tinyint, smallint,
            int, bigint (-> ``Int64List``), float, double (-> ``FloatList``,
            stored as float32), string (-> utf-8 ``BytesList``), binary
            (-> ``BytesList``) and ``array<...>`` of any of these.

    Returns:
        A function taking an iterable of Rows (or any objects indexable by
        column name, such as dicts) and yielding one serialized
        ``tf.train.Example`` (``bytes``) per row, with one feature per column.
        Null values become empty lists of the column's kind.  It raises
        ``ValueError`` for a null element inside an array and ``TypeError`` for
        a value that does not match its column type, naming the column.

    Raises:
        TypeError: If a column type is not supported (the message names the
            column and its type).
    """
    specs = [_column_spec(name, dtype) for name, dtype in dtypes]

    def _toTFExample(rows: Iterable[Any]) -> Iterator[bytes]:
        import tensorflow as tf

        names = [spec.name for spec in specs]
        row_fields: Any = None
        positions: list[int] = []
        for row in rows:
            fields = getattr(row, "__fields__", None)
            if fields is None:  # dict-like row: look values up by name
                values = [row[name] for name in names]
            else:  # pyspark Row: map names to positions once per distinct field list
                if fields is not row_fields and fields != row_fields:
                    positions = [_field_position(fields, name) for name in names]
                    row_fields = fields
                values = [row[i] for i in positions]
            example = tf.train.Example()
            feature_map = example.features.feature
            for spec, value in zip(specs, values):
                _fill_feature(feature_map[spec.name], spec, value)
            yield example.SerializeToString()

    return _toTFExample


def _field_position(fields: Sequence[str], name: str) -> int:
    """Returns the position of column ``name`` in a Row's field list.

    Raises:
        KeyError: If the Row has no such column.
    """
    try:
        return list(fields).index(name)
    except ValueError:
        raise KeyError(f"row has no column {name!r}; its columns are {list(fields)}") from None


def _encode_value(spec: _ColumnSpec, value: Any) -> Any:
    """Converts one Python value to the element type of its feature list.

    Args:
        spec: The column's encoding.
        value: A non-null scalar value of the column (or element of an array).

    Returns:
        ``int`` for int64 features, ``float`` for float features, ``bytes`` for
        bytes features.

    Raises:
        TypeError: If the value's Python type does not fit the feature kind.
    """
    if spec.kind == _INT64:
        return operator.index(value)  # ints, bools and numpy integers; not floats or strings
    if spec.kind == _FLOAT:
        if isinstance(value, (str, bytes, bytearray)):
            raise TypeError("expected a number")
        return float(value)
    if spec.is_string:
        return value.encode("utf-8") if isinstance(value, str) else str(value).encode("utf-8")
    return bytes(value)


def _fill_feature(feature: Any, spec: _ColumnSpec, value: Any) -> None:
    """Stores one column value into an (empty) ``tf.train.Feature``.

    Args:
        feature: The ``tf.train.Feature`` message to fill.
        spec: The column's encoding.
        value: The column value of one row (``None``, a scalar, or a list).

    Raises:
        ValueError: If an array contains a null element.
        TypeError: If the value does not match the column type.
    """
    values = getattr(feature, spec.kind)
    values.SetInParent()  # keep the kind even when the list is empty (null value)
    if value is None:
        return
    try:
        if spec.is_array:
            for element in value:
                if element is None:
                    raise ValueError(f"column {spec.name!r} ({spec.dtype}) has a null array element, "
                                     "which tf.train.Example cannot represent")
                values.value.append(_encode_value(spec, element))
        else:
            values.value.append(_encode_value(spec, value))
    except (TypeError, AttributeError, OverflowError) as exc:
        raise TypeError(f"column {spec.name!r} ({spec.dtype}): cannot encode {type(value).__name__} "
                        f"value as {spec.kind}: {exc}") from exc
