"""Arrow record batches -> feed chunks, without copying their data (Spark task, DataFrame feeds).

Spark hands ``mapInArrow`` record batches of up to
``spark.sql.execution.arrow.maxRecordsPerBatch`` rows; :func:`arrow_slices` cuts them into
zero-copy slices of about :data:`ARROW_CHUNK_BYTES` and :func:`arrow_ipc_parts` writes each
as an Arrow IPC stream whose data buffers go to the socket uncopied.
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["ARROW_CHUNK_BYTES", "arrow_ipc_parts", "arrow_slices", "rename_columns"]

#: Target size of one Arrow chunk, in bytes. Spark hands ``mapInArrow`` record batches of up
#: to ``spark.sql.execution.arrow.maxRecordsPerBatch`` (10,000) rows, 30 MB for MNIST rows;
#: they are sliced (zero copy) so that the node's bounded queue holds megabytes, not
#: hundreds of megabytes, and the node decodes while the task still sends.
ARROW_CHUNK_BYTES = 1 << 20


def rename_columns(batch: Any, names: Optional[list]) -> Any:
    """``batch`` (a ``pyarrow.RecordBatch``) with its columns named ``names``, or unchanged
    for None (pure; Spark task). Zero-copy: the columns are shared."""
    if names is None:
        return batch
    import pyarrow as pa

    return pa.RecordBatch.from_arrays(batch.columns, schema=pa.schema(
        [f.with_name(n) for f, n in zip(batch.schema, names)], metadata=batch.schema.metadata))


class _GatherSink:
    """A write-only file for ``pyarrow.PythonFile`` that keeps every written buffer.

    The Arrow IPC writer hands its output stream the record batch's body buffers as
    ``pyarrow.Buffer`` objects (zero-copy views of the batch's memory) and the metadata
    and padding as small ``bytes``; this sink keeps them in order instead of copying them
    into one stream buffer.
    """

    def __init__(self) -> None:
        self.parts: list = []
        self.size = 0
        self.closed = False

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        self.parts.append(data)
        self.size += n
        return n

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False


def arrow_ipc_parts(batch: Any, schema: Any = None) -> list:
    """An Arrow IPC stream holding ``batch``, as a list of buffers (pure; Spark task).

    The concatenation of the returned buffers is exactly the stream
    ``pa.ipc.new_stream(sink, schema).write_batch(batch)`` writes into a
    ``BufferOutputStream``; the batch's data buffers are not copied (for a sliced batch,
    Arrow's writer slices them; only list offsets of a slice are rewritten). Send it as
    one frame with :func:`tfos._data.framing.send_frame_parts`; the parts reference the
    batch's memory, so the batch must stay alive until they are sent.

    Args:
        batch: A ``pyarrow.RecordBatch`` (or a slice of one).
        schema: The stream's schema: ``batch.schema``, possibly with metadata (the Spark
            schema, :data:`tfos._data.arrow_views.SPARK_SCHEMA_KEY`). Default ``batch.schema``.

    Returns:
        Bytes-like objects (``pyarrow.Buffer`` and ``bytes``), in stream order.
    """
    import pyarrow as pa

    sink = _GatherSink()
    with pa.ipc.new_stream(pa.PythonFile(sink, mode="w"), schema if schema is not None else batch.schema) as w:
        w.write_batch(batch)
    return sink.parts


def arrow_slices(batch: Any, target_bytes: int = ARROW_CHUNK_BYTES) -> list:
    """Splits an Arrow record batch into zero-copy slices of about ``target_bytes`` (pure).

    Runs in Spark tasks (DataFrame feeds).

    Args:
        batch: A ``pyarrow.RecordBatch``.
        target_bytes: Target slice size in bytes (at least one row per slice).

    Returns:
        The slices in order (none for an empty batch); their rows are exactly the batch's.
    """
    n = batch.num_rows
    if n == 0:
        return []
    per = max(1, min(n, int(n * target_bytes // max(1, batch.nbytes))))
    if per >= n:
        return [batch]
    return [batch.slice(i, per) for i in range(0, n, per)]
