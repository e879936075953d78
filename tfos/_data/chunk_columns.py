"""One fed chunk -> one numpy array per column (pure; the TF process's tf.data reader thread).

Arrow chunks whose columns are numeric, fixed-length numeric lists or dense Spark ML vectors
become zero-copy views of the received buffer (:func:`arrow_columns`); every other chunk is
decoded to rows and stacked with :func:`~tfos._data.columns.rows_to_columns`, which names a
bad row's partition, epoch and row.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from tfos._data.arrow_codec import ArrowRows, arrow_rows
from tfos._data.columns import rows_to_columns
from tfos._data.framing import ChunkKind, decode_chunk

__all__ = ["Column", "chunk_columns", "arrow_columns", "batch_bytes", "columns_of", "check_batch_dims"]


class Column:
    """One column of the batches: numpy dtype, row shape (None: from the data) and the
    number of values a row holds (``width``)."""

    __slots__ = ("dtype", "shape", "width")

    def __init__(self, dtype: Any, shape: Optional[tuple]):
        import numpy as np

        self.dtype = np.dtype(dtype)
        self.shape = None if shape is None else tuple(int(d) for d in shape)
        width = 1
        for d in self.shape or ():
            width *= d
        self.width = width


def chunk_columns(conn: Any, payload: Any, cols: Sequence[Column], single: bool) -> tuple:
    """One chunk's payload -> one numpy array per column (``n`` rows each).

    Args:
        conn: The feed connection the chunk came on (its ``kind``, ``partition``, ``epoch``
            and ``rows_taken`` name a bad row).
        payload: The chunk as received.
        cols: The batches' columns.
        single: Rows are single values (an RDD of scalars or arrays), not tuples.

    Raises:
        MalformedRowError: A row does not fit the columns.
    """
    origins = [(0, conn.partition, conn.epoch, conn.rows_taken)]
    if conn.kind is ChunkKind.ARROW:
        out = arrow_columns(payload, cols)
        if out is not None:
            return out
        rows = arrow_rows(payload)
    else:
        rows = decode_chunk(conn.kind, payload)
    # Rows decoded from an Arrow chunk are already tuples of columns, with the column
    # names for error messages, also for a single TensorSpec; only the single values of
    # an RDD feed are wrapped (docs/datafeed.md "DataFrames").
    spec = [(c.dtype, c.shape) for c in cols]
    if single and not isinstance(rows, ArrowRows):
        return rows_to_columns([(r,) for r in rows], spec, origins)
    return rows_to_columns(rows, spec, origins)


def arrow_columns(payload: Any, cols: Sequence[Column]) -> Optional[tuple]:
    """Numpy views of an Arrow chunk's columns, or None when the slow path must decode it.

    Numeric columns and list columns whose lists all have the row's size become
    zero-copy views of the received buffer (cast only when the dtype differs).
    """
    import pyarrow as pa

    from tfos._data.arrow_vectors import arrow_vector_ndarray
    from tfos._data.arrow_views import arrow_ndarray, numeric_view

    batches = list(pa.ipc.open_stream(pa.py_buffer(payload)))
    if len(batches) != 1 or batches[0].num_columns != len(cols):
        return None
    batch = batches[0]
    n = batch.num_rows
    out: list = []
    for arr, col in zip(batch.columns, cols):
        t = arr.type
        if pa.types.is_integer(t) or pa.types.is_floating(t):
            if col.shape not in ((), None):
                return None
            view = numeric_view(arr, 0, n)
        elif pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
            if arr.null_count or col.shape is None or len(col.shape) < 1:
                return None
            view = list_view(arr, n, col.width)
            if view is None:
                # nested numeric lists (e.g. array<array<float>> images) -> (n, d1, ..., dk)
                view = arrow_ndarray(arr)
                if view is None or view.shape[1:] != col.shape:
                    return None
            else:
                view = view.reshape((n,) + col.shape)
        elif pa.types.is_struct(t) and col.shape is not None and len(col.shape) == 1:
            # a column of dense Spark ML vectors -> (n, size) (sparse ones: slow path)
            view = arrow_vector_ndarray(arr, batch.schema, len(out))
            if view is None or view.shape[1:] != col.shape:
                return None
        else:
            return None
        if view is None:
            return None
        if view.dtype != col.dtype:
            view = view.astype(col.dtype)
        out.append(view)
    return tuple(out)



def batch_bytes(batch: tuple) -> int:
    """Bytes a ready batch holds: its arrays' buffers, plus the objects an object column
    refers to (strings, bytes, arrays; ``sys.getsizeof`` each) (reader thread)."""
    import sys

    total = 0
    for col in batch:
        total += col.nbytes
        if col.dtype.kind == "O":
            total += sum(map(sys.getsizeof, col.ravel()))
    return total


def list_view(arr: Any, n: int, width: int) -> Any:
    """A zero-copy ``(n, width)`` numpy view of an Arrow list column whose lists all hold
    ``width`` numbers, or None (other lengths, nulls or non-numeric values; pure)."""
    import pyarrow as pa

    from tfos._data.arrow_views import equal_steps, numeric_view

    if pa.types.is_fixed_size_list(arr.type):
        if arr.type.list_size != width:
            return None
        start = arr.offset * width
    else:
        offsets = numeric_view(arr.offsets, 0, n + 1)
        if offsets is None or (n and (int(offsets[1] - offsets[0]) != width or not equal_steps(offsets))):
            return None
        start = int(offsets[0])
    values = arr.values
    if values.null_count:
        return None
    flat = numeric_view(values, start, start + n * width)
    return None if flat is None else flat.reshape(n, width)


def _specs(output_signature: Any) -> tuple:
    """The TensorSpecs of ``output_signature`` (one spec or a tuple of them), as a tuple."""
    import tensorflow as tf

    return (output_signature,) if isinstance(output_signature, tf.TensorSpec) else tuple(output_signature)


def check_batch_dims(output_signature: Any, batch_size: int) -> None:
    """Raises ValueError for a spec of ``output_signature`` that is not batched (TF process)."""
    for i, spec in enumerate(_specs(output_signature)):
        if spec.shape.rank is None:
            continue
        example = "TensorSpec((None,), ...) for one value per row, TensorSpec((None, 784), ...) for 784 values per row"
        if spec.shape.rank == 0:
            raise ValueError(
                f"as_dataset: output_signature column {i} is {spec}, a shape without the batch dimension: the "
                f"dataset yields whole batches, so every spec starts with None ({example})")
        first = spec.shape[0]
        if first is not None and first != batch_size:
            raise ValueError(
                f"as_dataset: output_signature column {i} is {spec}: its first dimension is the batch ({batch_size} "
                f"rows, or fewer at an epoch's end), not {first}; start it with None ({example})")


def columns_of(output_signature: Any) -> tuple[list[tuple[Any, Optional[tuple]]], bool]:
    """``(columns, single)`` for a TensorSpec or tuple of them (TF process).

    Raises:
        TypeError: When ``output_signature`` is not a TensorSpec or tuple of them.
    """
    import tensorflow as tf

    single = isinstance(output_signature, tf.TensorSpec)
    specs = _specs(output_signature)
    if not specs or not all(isinstance(s, tf.TensorSpec) for s in specs):
        raise TypeError("output_signature must be a tf.TensorSpec or a tuple of tf.TensorSpec")
    columns = []
    for s in specs:
        shape = None if s.shape.rank is None else s.shape[1:].as_list()
        columns.append((s.dtype.as_numpy_dtype, None if shape is None or None in shape else tuple(shape)))
    return columns, single
