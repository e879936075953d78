"""The Arrow/Spark type codec of DataFrame feeds (pure; driver, Spark tasks and the TF
process): which Spark schema a feed task sends with its Arrow chunks
(:func:`feed_schema_json`), and an Arrow chunk back to the rows ``df.rdd`` gives
(:func:`arrow_rows`: the same Python types and values, column by column)."""

from __future__ import annotations

import codecs
import datetime
import functools
import json
from typing import Any, Optional, Union

from tfos._data.arrow_vectors import vector_values
from tfos._data.arrow_views import SPARK_SCHEMA_KEY, arrow_ndarray, is_list_type, numeric_view, valid_list

__all__ = ["ArrowRows", "BINARY_AS_BYTES_KEY", "arrow_rows", "binary_as_bytes", "feed_schema_json"]

#: Key of the Spark schema JSON (:data:`SPARK_SCHEMA_KEY`) saying whether ``df.rdd`` gives
#: binary values as ``bytes`` (Spark's ``spark.sql.execution.pyspark.binaryAsBytes``, true
#: by default since Spark 4.1) or ``bytearray`` (false, and Spark before 4.1). A chunk
#: without it decodes binary as ``bytearray``.
BINARY_AS_BYTES_KEY = "tfos.binaryAsBytes"
_BINARY_CONF = "spark.sql.execution.pyspark.binaryAsBytes"


def binary_as_bytes(spark: Any) -> bool:
    """True when ``df.rdd`` gives ``BinaryType`` values as ``bytes`` in this session (driver).

    Reads ``spark.sql.execution.pyspark.binaryAsBytes``; a Spark without that conf gives
    ``bytearray`` (False). Works with classic and Connect sessions.
    """
    try:
        # No default argument: conf.get(key, default) returns that default, not Spark's,
        # when the conf was not set explicitly.
        value = spark.conf.get(_BINARY_CONF)
    except Exception:  # noqa: BLE001 - a Spark without the conf raises (type varies: classic/Connect)
        return False
    return value is not None and str(value).strip().lower() == "true"


def feed_schema_json(schema: Any, as_bytes: bool) -> Optional[str]:
    """The Spark schema JSON a DataFrame feed puts into every Arrow chunk, or None (driver; pure).

    Needed when the schema has a user-defined type (``VectorUDT``...: Spark's Arrow form is a
    bare struct) or a ``BinaryType`` (``bytes`` or ``bytearray``, as ``df.rdd`` in the session:
    see :func:`binary_as_bytes`) at any depth; every other type decodes from its Arrow type.

    Args:
        schema: The DataFrame's ``StructType``.
        as_bytes: :func:`binary_as_bytes` of the session.

    Raises:
        ConfigurationError: A ``CalendarIntervalType`` or ``YearMonthIntervalType`` at any
            depth: ``df.rdd`` has no Python value for it (PySpark raises), so neither has the
            feed; the message names the column.
    """
    from pyspark.sql.types import ArrayType, BinaryType, MapType, StructType, UserDefinedType

    _refuse_unfeedable(schema)

    def needs(t: Any) -> bool:
        if isinstance(t, (UserDefinedType, BinaryType)):
            return True
        if isinstance(t, StructType):
            return any(needs(f.dataType) for f in t.fields)
        if isinstance(t, ArrayType):
            return needs(t.elementType)
        if isinstance(t, MapType):
            return needs(t.keyType) or needs(t.valueType)
        return False

    if not needs(schema):
        return None
    obj = schema.jsonValue()
    obj[BINARY_AS_BYTES_KEY] = bool(as_bytes)
    return json.dumps(obj, separators=(",", ":"))


def _refuse_unfeedable(schema: Any) -> None:
    """Raises ConfigurationError for a column ``df.rdd`` cannot give to Python (driver; pure)."""
    from pyspark.sql import types as T

    from tfos.errors import ConfigurationError

    interval = getattr(T, "CalendarIntervalType", None)  # not in every PySpark version
    year_month = getattr(T, "YearMonthIntervalType", None)
    ArrayType, MapType, StructType = T.ArrayType, T.MapType, T.StructType

    def walk(t: Any, path: str) -> None:
        if interval is not None and isinstance(t, interval):
            raise ConfigurationError(
                f"train(df): column {path!r} is a CalendarIntervalType (INTERVAL with months), which df.rdd "
                "cannot convert to Python either; cast it (e.g. to a string or a number of days) or drop it")
        if year_month is not None and isinstance(t, year_month):
            # df.rdd raises NOT_IMPLEMENTED (no fromInternal), and Spark's Arrow batches of it
            # cannot reach Python either (mapInArrow fails in the Spark task).
            raise ConfigurationError(
                f"train(df): column {path!r} is a YearMonthIntervalType ({t.simpleString()}, e.g. INTERVAL 1 MONTH), "
                "which neither df.rdd nor Spark's Arrow batches can convert to Python; cast it to a number of months "
                f"(col({path.split('.')[0].split('[')[0].split('{')[0]!r}).cast('int')) or to a string, or drop it")
        if isinstance(t, StructType):
            for f in t.fields:
                walk(f.dataType, f"{path}.{f.name}" if path else f.name)
        elif isinstance(t, ArrayType):
            walk(t.elementType, path + "[]")
        elif isinstance(t, MapType):
            walk(t.keyType, path + "{key}")
            walk(t.valueType, path + "{value}")

    walk(schema, "")


class ArrowRows(list):
    """The rows of one Arrow chunk (a list of tuples) with the chunk's column names."""

    column_names: tuple = ()


def arrow_rows(payload: Union[bytes, bytearray]) -> list:
    """Decodes an Arrow IPC stream chunk into a list of row tuples (TF process side).

    Every value is the Python value the same row of ``df.rdd`` holds (see the table in
    docs/datafeed.md): exact integers, ``None`` for nulls, ``Row`` for structs, ``dict``
    for maps, ``bytes`` or ``bytearray`` for binary (as the schema metadata says, see
    :func:`feed_schema_json`; ``bytearray`` without it), naive local ``datetime`` for timestamps,
    ``DenseVector``/``SparseVector`` (or the value of any other UDT) when the chunk's
    schema metadata names the column's UDT (:data:`SPARK_SCHEMA_KEY`). One exception,
    for speed: a column of numeric arrays (nested to any depth) without nulls at any
    level whose arrays all have the same shape in the chunk gives each row as a
    read-only numpy array of that shape and of the Arrow dtype (a zero-copy view of
    ``payload``; the same numbers, none converted).

    Returns:
        An :class:`ArrowRows` list of tuples, one per row.

    Raises:
        ValueError: For a payload that is not an Arrow IPC stream.
    """
    import pyarrow as pa

    reader = pa.ipc.open_stream(pa.py_buffer(payload))
    batches = list(reader)
    out = ArrowRows()
    out.column_names = tuple(reader.schema.names)
    if not batches:
        return out
    if len(batches) == 1:
        # Zero copy: the columns are views of ``payload`` (combine_chunks() would copy them
        # into Arrow's allocator, which keeps the freed memory mapped).
        columns = list(batches[0].columns)
    else:
        columns = [col.combine_chunks() for col in pa.Table.from_batches(batches).itercolumns()]
    spark_types, as_bytes = _spark_types(reader.schema)
    cols = []
    for i, arr in enumerate(columns):
        spark_type = spark_types[i] if spark_types is not None else None
        cols.append(_column_values(arr, spark_type, as_bytes))
    out.extend(zip(*cols))
    return out


def _spark_types(schema: Any) -> tuple:
    """``(Spark DataType of every column or None, binary as bytes)`` from the chunk's schema
    metadata (``(None, False)`` without it)."""
    meta = schema.metadata or {}
    text = meta.get(SPARK_SCHEMA_KEY)
    if not text:
        return None, False
    types, as_bytes = _parse_spark_schema(bytes(text))
    if len(types) != len(schema.names):
        raise ValueError(
            f"the Arrow chunk has {len(schema.names)} columns but its Spark schema has {len(types)}"
        )
    return list(types), as_bytes


@functools.lru_cache(maxsize=32)
def _parse_spark_schema(text: bytes) -> tuple:
    """``(tuple of the columns' Spark DataTypes, binary as bytes)`` of a Spark schema JSON (pure).

    Cached per JSON text (every chunk of a feed carries the same one; at most 32 texts are
    kept): parsing it builds the UDT objects, which costs a chunk more than decoding its rows.
    """
    from pyspark.sql.types import StructType

    obj = json.loads(text)
    st = StructType.fromJson(obj)
    return tuple(f.dataType for f in st.fields), bool(obj.get(BINARY_AS_BYTES_KEY, False))


def _column_values(arr: Any, spark_type: Any, as_bytes: bool = False) -> list:
    """One column of an Arrow chunk as the list of its rows' Python values (pure)."""
    import pyarrow as pa

    t = arr.type
    if spark_type is None or not _is_udt(spark_type):
        if pa.types.is_integer(t) or pa.types.is_floating(t):
            view = numeric_view(arr, 0, len(arr))
            if view is not None:
                return view.tolist()
        elif is_list_type(t):
            nd = arrow_ndarray(arr)
            if nd is not None:
                return list(nd)
    return _exact_values(arr, spark_type, as_bytes)


def _exact_values(arr: Any, spark_type: Any, as_bytes: bool) -> list:
    """One column as the list of the values ``df.rdd`` holds, without numpy views (pure).

    The same values as ``[conv(v) for v in arr.to_pylist()]`` with :func:`_converter`, built
    column-wise where that is faster: ML vector columns (:func:`_vector_values`), struct
    columns (:func:`_struct_values`), numeric columns without nulls.
    """
    import pyarrow as pa

    t = arr.type
    if spark_type is not None and _is_udt(spark_type):
        fast = vector_values(arr, spark_type)
        if fast is not None:
            return fast
    elif _is_variant(t):
        return [_variant_value(v) for v in arr.to_pylist()]
    elif pa.types.is_struct(t):
        return _struct_values(arr, spark_type, as_bytes)
    elif (pa.types.is_integer(t) or pa.types.is_floating(t)) and not pa.types.is_float16(t):
        view = numeric_view(arr, 0, len(arr))
        if view is not None:
            return view.tolist()  # the same Python ints and floats as to_pylist()
    try:
        values = arr.to_pylist()
    except UnicodeDecodeError:  # a string that is not valid UTF-8 (e.g. CAST(binary AS STRING))
        values = _replacing_pylist(arr)
    conv = _converter(t, spark_type, as_bytes)
    return values if conv is None else [conv(v) for v in values]


def _strings_as_binary(t: Any) -> Any:
    """Arrow type ``t`` with every string type in it (also nested) made the binary type of
    the same offsets (pure)."""
    import pyarrow as pa

    if pa.types.is_string(t):
        return pa.binary()
    if pa.types.is_large_string(t):
        return pa.large_binary()
    if pa.types.is_list(t):
        return pa.list_(t.value_field.with_type(_strings_as_binary(t.value_type)))
    if pa.types.is_large_list(t):
        return pa.large_list(t.value_field.with_type(_strings_as_binary(t.value_type)))
    if pa.types.is_fixed_size_list(t):
        return pa.list_(t.value_field.with_type(_strings_as_binary(t.value_type)), t.list_size)
    if pa.types.is_struct(t):
        return pa.struct([t.field(i).with_type(_strings_as_binary(t.field(i).type)) for i in range(t.num_fields)])
    if pa.types.is_map(t):
        return pa.map_(t.key_field.with_type(_strings_as_binary(t.key_type)),
                       t.item_field.with_type(_strings_as_binary(t.item_type)), t.keys_sorted)
    return t


def _java_replace(exc: UnicodeError) -> tuple[str, int]:
    """A codec error handler: U+FFFD for each invalid UTF-8 sequence, cut as Java's UTF-8
    decoder cuts it, so a decoded string equals the one ``df.rdd`` gets through the JVM (pure).

    Python's ``"replace"`` and Java agree on every sequence but an encoded surrogate (``ED``
    followed by ``A0``-``BF``): Java takes ``ED A0``-``BF`` and one continuation byte as one
    invalid sequence (one U+FFFD for ``ED A0 80``, where Python puts three).
    """
    if not isinstance(exc, UnicodeDecodeError):
        raise exc
    b, i = exc.object, exc.start
    if b[i] == 0xED and i + 1 < len(b) and 0xA0 <= b[i + 1] <= 0xBF:
        return "\ufffd", i + 3 if i + 2 < len(b) and 0x80 <= b[i + 2] <= 0xBF else i + 2
    return "\ufffd", exc.end


_JAVA_REPLACE = "tfos.java_replace"
codecs.register_error(_JAVA_REPLACE, _java_replace)


def _replace_invalid_utf8(v: Any, t: Any) -> Any:
    """A ``to_pylist()`` value of ``_strings_as_binary(t)`` with its strings decoded as
    ``df.rdd`` decodes them: invalid UTF-8 becomes U+FFFD (pure)."""
    import pyarrow as pa

    if v is None:
        return None
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return str(v, "utf-8", _JAVA_REPLACE)
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return [_replace_invalid_utf8(x, t.value_type) for x in v]
    if pa.types.is_struct(t):
        return {t.field(i).name: _replace_invalid_utf8(x, t.field(i).type) for i, x in enumerate(v.values())}
    if pa.types.is_map(t):
        return [(_replace_invalid_utf8(k, t.key_type), _replace_invalid_utf8(x, t.item_type)) for k, x in v]
    return v


def _replacing_pylist(arr: Any) -> list:
    """``arr.to_pylist()`` for a column holding a string that is not valid UTF-8 (pure).

    Spark does not check that its strings are UTF-8 (``CAST(binary AS STRING)``, text files in
    another encoding); ``df.rdd`` decodes them through Java, which puts U+FFFD for each
    invalid sequence, where ``to_pylist()`` raises ``UnicodeDecodeError``. The column is read
    with its strings as bytes and decoded as Java does (:func:`_java_replace`).
    """
    raw = arr.cast(_strings_as_binary(arr.type)).to_pylist()
    return [_replace_invalid_utf8(v, arr.type) for v in raw]


def _struct_values(arr: Any, spark_type: Any, as_bytes: bool) -> list:
    """A struct column as ``df.rdd``'s ``Row`` objects (None for a null struct), built field-wise (pure).

    Every field is converted as a column (:func:`_exact_values`) and each row's values
    become a ``Row`` as PySpark builds them for ``df.rdd`` (``_create_row``: a tuple of the
    values with ``__fields__``, the field names, one list shared by the rows of a chunk).
    """
    from pyspark.sql import Row

    t = arr.type
    names = [t.field(i).name for i in range(t.num_fields)]
    fields = getattr(spark_type, "fields", None)
    fields = fields if fields is not None and len(fields) == len(names) else None
    # flatten(): the fields of the struct's rows, null where the struct is null.
    cols = [_exact_values(child, fields[i].dataType if fields else None, as_bytes)
            for i, child in enumerate(arr.flatten())]
    tuples: Any = zip(*cols) if cols else [()] * len(arr)
    # Row(*vals) then row.__fields__ = names, without Row's Python-level __new__/__setattr__.
    rows = list(map(functools.partial(tuple.__new__, Row), tuples))
    setattr_ = object.__setattr__
    for row in rows:
        setattr_(row, "__fields__", names)
    valid = valid_list(arr)
    if valid is None:
        return rows
    return [row if ok else None for ok, row in zip(valid, rows)]


def _is_udt(spark_type: Any) -> bool:
    return hasattr(spark_type, "deserialize") and hasattr(spark_type, "sqlType")


def _is_variant(t: Any) -> bool:
    """True for Spark's Arrow form of a ``VariantType`` value (pure): a struct of binary
    ``value`` and ``metadata`` whose ``metadata`` field is tagged ``variant: true`` (the
    test PySpark's own Arrow conversion uses)."""
    import pyarrow as pa

    if not pa.types.is_struct(t) or t.num_fields != 2:
        return False
    names = {t.field(i).name: t.field(i) for i in range(2)}
    meta = names.get("metadata")
    return "value" in names and meta is not None and (meta.metadata or {}).get(b"variant") == b"true"


def _variant_value(v: Any) -> Any:
    """A ``to_pylist()`` variant struct as ``df.rdd`` gives it: ``VariantVal`` of two
    ``bytearray`` (PySpark 4), None for a null (pure)."""
    if v is None:
        return None
    from pyspark.sql.types import VariantVal

    # bytearray, as df.rdd holds them (PySpark's annotation says bytes)
    return VariantVal(bytearray(v["value"]), bytearray(v["metadata"]))  # type: ignore[arg-type]


def _converter(t: Any, spark_type: Any = None, as_bytes: bool = False) -> Optional[Any]:
    """A function from ``Array.to_pylist()`` values of Arrow type ``t`` to the values of
    ``df.rdd`` (None when they are already the same; pure).

    Args:
        t: The Arrow type.
        spark_type: The Spark ``DataType`` of the same value when known (needed for UDTs).
        as_bytes: Binary values stay ``bytes`` (else become ``bytearray``).
    """
    import pyarrow as pa

    if spark_type is not None and _is_udt(spark_type):
        udt = spark_type
        inner = _converter(t, udt.sqlType(), as_bytes)

        def convert_udt(v: Any) -> Any:
            return None if v is None else udt.deserialize(inner(v) if inner is not None else v)

        return convert_udt
    if _is_variant(t):
        return _variant_value
    if pa.types.is_struct(t):
        from pyspark.sql import Row

        names = [t.field(i).name for i in range(t.num_fields)]
        fields = getattr(spark_type, "fields", None)
        fields = fields if fields is not None and len(fields) == len(names) else None
        convs = [_converter(t.field(i).type, fields[i].dataType if fields else None, as_bytes) for i in range(t.num_fields)]

        def convert_struct(v: Any) -> Any:
            if v is None:
                return None
            vals = list(v.values()) if len(v) == len(names) else [v.get(n) for n in names]
            # As PySpark builds the Rows of df.rdd (Row(*values), then __fields__), without
            # Row's Python-level __new__ and __setattr__.
            row = tuple.__new__(Row, [x if c is None else c(x) for c, x in zip(convs, vals)])
            object.__setattr__(row, "__fields__", names)
            return row

        return convert_struct
    if is_list_type(t):
        elem = _converter(t.value_type, getattr(spark_type, "elementType", None), as_bytes)
        if elem is None:
            return None
        return lambda v: None if v is None else [elem(x) for x in v]
    if pa.types.is_map(t):
        kc = _converter(t.key_type, getattr(spark_type, "keyType", None), as_bytes)
        vc = _converter(t.item_type, getattr(spark_type, "valueType", None), as_bytes)

        def convert_map(v: Any) -> Any:
            if v is None:
                return None
            return {(k if kc is None else kc(k)): (x if vc is None else vc(x)) for k, x in v}

        return convert_map
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        if as_bytes:
            return None  # to_pylist() gives bytes
        return lambda v: None if v is None else bytearray(v)
    if pa.types.is_decimal(t):
        return _rdd_decimal
    if pa.types.is_timestamp(t) and t.tz is not None:
        return _rdd_timestamp
    return None


_EPOCH_UTC = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)
_ONE_US = datetime.timedelta(microseconds=1)


def _rdd_timestamp(v: Any) -> Any:
    """The naive local ``datetime`` ``df.rdd`` gives for a Spark ``TimestampType`` value (pure).

    ``v`` is the zone-aware ``datetime`` Arrow gives. The result is built as PySpark's
    ``TimestampType.fromInternal`` builds it, from the instant's whole microseconds since the
    epoch through ``datetime.fromtimestamp`` in the process's local time zone, so a time in the
    hour a daylight-saving change repeats keeps its ``fold`` (``.timestamp()`` gives the same
    instant back). ``v.astimezone().replace(tzinfo=None)`` would drop it and move the instant
    of the repeated hour one hour earlier.
    """
    if v is None:
        return None
    us = (v - _EPOCH_UTC) // _ONE_US
    return datetime.datetime.fromtimestamp(us // 1_000_000).replace(microsecond=us % 1_000_000)


def _rdd_decimal(v: Any) -> Any:
    """The ``Decimal`` ``df.rdd`` gives for a Spark decimal read from Arrow (pure).

    Same value; the exponent as Spark's JVM pickler (Pyrolite) writes it: through Java's
    ``BigDecimal.toEngineeringString``, whose exponent is a multiple of 3 in scientific
    form (scale > 0 and adjusted exponent < -6), padding the coefficient with zeros when it
    has fewer digits than that needs: unscaled 1 at scale 19 gives ``Decimal('1.00E-19')``
    (exponent -21), where Arrow gives ``Decimal('1E-19')``.
    """
    if v is None:
        return None
    sign, digits, exp = v.as_tuple()
    if not isinstance(exp, int) or exp >= 0 or not any(digits):
        return v
    adjusted = exp + len(digits) - 1
    if adjusted >= -6:
        return v
    sig = adjusted % 3 + 1  # digits before the point in engineering notation
    pad = sig - len(digits)
    if pad <= 0:
        return v
    import decimal

    return decimal.Decimal((sign, digits + (0,) * pad, exp - pad))
