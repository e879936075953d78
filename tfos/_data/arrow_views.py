"""Zero-copy numpy views of Arrow arrays, and the metadata key a DataFrame chunk carries its
Spark schema under (pure; Spark tasks and the TF process)."""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["SPARK_SCHEMA_KEY", "arrow_ndarray", "equal_steps", "is_list_type", "numeric_view", "valid_list"]

#: Arrow schema metadata key under which a DataFrame feed task puts the DataFrame's Spark
#: schema (JSON) when a column needs it to decode (Spark ML vectors and other UDTs: Spark's
#: Arrow batches carry a UDT as its bare SQL struct, without metadata).
SPARK_SCHEMA_KEY = b"tfos.spark_schema"


def is_list_type(t: Any) -> bool:
    import pyarrow as pa

    return bool(pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t))


def valid_list(arr: Any) -> Optional[list]:
    """``[bool]`` per row of ``arr`` (True = not null), or None when it has no nulls (pure)."""
    return arr.is_valid().to_pylist() if arr.null_count else None


def arrow_ndarray(arr: Any) -> Any:
    """A zero-copy numpy view of a (nested) list column of numbers, or None (pure).

    Args:
        arr: An Arrow array of ``n`` rows: list, large list or fixed-size list, nested
            to any depth, with integer or floating-point leaves.

    Returns:
        A read-only array of shape ``(n, d1, ..., dk)`` and the leaves' dtype, or None when
        a list or leaf is null at any level, the lists of one level differ in length, the
        leaves are not numbers, or a level below an empty list has no length to read.
    """
    shape = [len(arr)]
    cur, lo, hi = arr, 0, len(arr)
    while is_list_type(cur.type):
        if cur.null_count:
            return None
        count = hi - lo
        if hasattr(cur.type, "list_size"):
            width = cur.type.list_size
            base = cur.offset + lo
            lo, hi = base * width, (base + count) * width
        else:
            if count == 0:
                return None
            offsets = numeric_view(cur.offsets, lo, hi + 1)
            if offsets is None or not equal_steps(offsets):  # pragma: no cover - offsets never have nulls
                return None
            width = int(offsets[1] - offsets[0])
            lo, hi = int(offsets[0]), int(offsets[-1])
        shape.append(width)
        cur = cur.values
    flat = numeric_view(cur, lo, hi)
    if flat is None:
        return None
    return flat.reshape(shape)


def numeric_view(arr: Any, start: int, stop: int) -> Any:
    """A zero-copy, read-only numpy view of ``arr[start:stop]`` (pure; TF process).

    Only for integer and floating-point Arrow arrays without nulls; reads the data buffer
    directly (``Array.to_numpy()`` would import pandas, ~50 MB, on first use).

    Returns:
        The numpy array, or None when ``arr`` is of another type or has nulls.
    """
    import numpy as np
    import pyarrow as pa

    t = arr.type
    if arr.null_count or not (pa.types.is_integer(t) or pa.types.is_floating(t)):
        return None
    kind = "f" if pa.types.is_floating(t) else ("i" if pa.types.is_signed_integer(t) else "u")
    dtype = np.dtype(f"<{kind}{t.bit_width // 8}")
    if stop <= start:
        empty = np.empty(0, dtype)
        empty.flags.writeable = False  # read-only like every view of a chunk
        return empty
    return np.frombuffer(arr.buffers()[1], dtype=dtype, count=stop - start, offset=(arr.offset + start) * dtype.itemsize)


def equal_steps(offsets: Any) -> bool:
    """True when every list of an Arrow list column has the same length (pure)."""
    import numpy as np

    if len(offsets) < 3:
        return True
    steps = np.diff(offsets)
    return bool((steps == steps[0]).all())
