"""Rows to numpy columns: the column path of :meth:`tfos.datafeed.DataFeed.as_dataset`'s
``input_mapping``/TensorSpec batches and of :class:`tfos._data.tfdata.FeedBatches` (pure; TF
process). Public as :func:`tfos.datafeed.rows_to_columns`.

A bad row raises :class:`~tfos.errors.MalformedRowError` naming its partition, epoch, row
and column (docs/datafeed.md "DataFrames").
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from tfos.errors import MalformedRowError


def _row_error(origins: Sequence[tuple[int, int, int, int]], index: int, message: str) -> MalformedRowError:
    part, epoch, row = -1, 0, index
    for start, p, e, first in origins:
        if start <= index:
            part, epoch, row = p, e, first + (index - start)
    return MalformedRowError(f"malformed row in partition {part} (epoch {epoch}), row {row}: {message}")


def rows_to_columns(
    rows: Sequence,
    columns: Sequence[tuple[Any, Optional[tuple]]],
    origins: Sequence[tuple[int, int, int, int]] = (),
    names: Optional[Sequence[str]] = None,
) -> tuple:
    """Converts a batch of rows into one numpy array per column (pure; TF process).

    A null (``None``) anywhere in a value is an error, never a NaN: numpy would silently
    turn it into NaN for a float dtype.

    Args:
        rows: ``n`` rows, each a tuple/list with ``len(columns)`` values.
        columns: ``[(numpy dtype, row shape or None), ...]``; ``()`` means a scalar and
            ``None`` means any shape (taken from the data).
        origins: :attr:`DataFeed.last_origins`, used to name the partition and row index
            of a bad row.
        names: Column names for error messages (default: the ``column_names`` of rows
            decoded from an Arrow chunk, if any).

    Returns:
        A tuple of arrays: column ``i`` has dtype ``columns[i][0]`` and shape
        ``(n,) + columns[i][1]``.

    Raises:
        MalformedRowError: For a ``None`` row, a row with the wrong number of values, a
            null value, or a value of the wrong size or type; the message names partition,
            row and column.
    """
    import numpy as np

    if names is None:
        names = getattr(rows, "column_names", None) or None
    ncol = len(columns)
    try:
        bad_len = any(len(row) != ncol for row in rows)
    except TypeError:  # a None or scalar row
        bad_len = True
    if bad_len and ncol:
        _raise_first_bad(rows, ncol, 0, columns[0][0], columns[0][1], origins, names)
    out = []
    for c, (dtype, shape) in enumerate(columns):
        try:
            vals = [row[c] for row in rows]
            if np.dtype(dtype).kind in "biufc":
                # Inferred first, then cast (no copy when the types agree): np.asarray(vals,
                # dtype=float32) would parse numeric strings ("1.5" -> 1.5) where a string
                # column must be refused.
                arr = np.asarray(vals)
                if arr.dtype.kind in "USO" and _has_text(vals):
                    raise ValueError("text")
                arr = arr.astype(dtype, copy=False)
            else:
                arr = np.asarray(vals, dtype=dtype)
            if not rows and shape is not None:
                arr = arr.reshape((0,) + tuple(shape))  # an empty batch still has the row shape
            if shape is not None and arr.shape[1:] != tuple(shape):
                raise ValueError("shape")
            if arr.dtype.kind in "fc" and bool(np.isnan(arr).any()) and any(_has_null(v) for v in vals):
                raise ValueError("null")  # np.asarray turned a None into NaN
            out.append(arr)
        except (TypeError, ValueError, IndexError, KeyError):
            _raise_first_bad(rows, ncol, c, dtype, shape, origins, names)
            raise
    return tuple(out)


def _has_text(values: Sequence) -> bool:
    """True when a value, or an item of a list/tuple value at any depth, is str or bytes (pure)."""
    stack = list(values)
    while stack:
        v = stack.pop()
        if isinstance(v, (str, bytes, bytearray)):
            return True
        if isinstance(v, (list, tuple)):
            stack.extend(v)
    return False


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _has_null(value: Any) -> bool:
    """True when ``value`` is None or a list/tuple holding a None at any depth (pure)."""
    if value is None:
        return True
    if isinstance(value, (list, tuple)):
        return any(_has_null(v) for v in value)
    return False


def _raise_first_bad(
    rows: Sequence, ncol: int, c: int, dtype: Any, shape: Optional[tuple], origins: Sequence,
    names: Optional[Sequence[str]] = None,
) -> None:
    import numpy as np

    col = f"column {c}" + (f" ({names[c]!r})" if names is not None and c < len(names) else "")

    for i, row in enumerate(rows):
        if row is None:
            raise _row_error(origins, i, "the row is None")
        try:
            n = len(row)
        except TypeError:
            raise _row_error(origins, i, f"expected a row of {ncol} values, got {type(row).__name__}") from None
        if n != ncol:
            raise _row_error(origins, i, f"expected {ncol} values per row, got {n}")
        if np.dtype(dtype).kind in "biufc" and _has_text([row[c]]):
            raise _row_error(
                origins, i,
                f"{col}: text {_short(row[c])} where a number ({np.dtype(dtype).name}) is asked; "
                "cast the column to a number in Spark first, or ask for a string tensor (tf.string)",
            )
        if _has_null(row[c]) and np.dtype(dtype).kind != "O":
            raise _row_error(
                origins, i,
                f"{col}: null value where a dense {np.dtype(dtype).name} tensor is asked ({row[c]!r}); "
                "fill or drop nulls in Spark first (e.g. df.na.drop() / df.na.fill())",
            )
        try:
            v = np.asarray(row[c], dtype=dtype)
        except (TypeError, ValueError) as exc:
            raise _row_error(origins, i, f"{col}: cannot convert to {np.dtype(dtype).name}: {exc}") from None
        if shape is not None and v.shape != tuple(shape):
            raise _row_error(origins, i, f"{col}: expected shape {tuple(shape)}, got {v.shape}")
    raise _row_error(origins, 0, f"{col}: values do not form an array of {np.dtype(dtype).name}")

