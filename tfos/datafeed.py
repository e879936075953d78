"""``DataFeed``: the TF-process end of InputMode.SPARK (runs in the TF process only).

A TFoS program reads its partitions with::

    feed = TFNode.DataFeed(ctx.mgr, train_mode=True)      # or ctx.get_data_feed()
    while not feed.should_stop():
        batch = feed.next_batch(batch_size)                # list of rows
        ...

and, for inference, answers every batch with ``feed.batch_results(results)``. For
``tf.data`` pipelines use :meth:`DataFeed.as_dataset`.

End of data: ``next_batch`` returns a short (possibly empty) batch and ``should_stop()``
becomes True once the driver calls ``cluster.shutdown()`` (end of feed) or after
:meth:`DataFeed.terminate`. Between ``train()`` calls the feed simply waits for more data,
up to ``data_timeout_s``.
"""

from __future__ import annotations

import collections
import logging
import pickle
import queue
from typing import Any, Iterator, Optional, Sequence, Union

from ._data_plane import FrameType, decode_chunk
from ._deadline import Deadline
from ._feed_hub import END_OF_FEED, Chunk, FeedConnection, FeedHub, PartitionEnd
from .errors import InferenceResultError, MalformedRowError, TFOSError

__all__ = ["DataFeed", "rows_to_columns"]

log = logging.getLogger(__name__)

#: Seconds next_batch() waits for data while an ended partition has unanswered batches.
_READ_AHEAD_WAIT_S = 5.0

#: Target size of one inference results frame, in bytes. Bigger answers are split into
#: several frames (same rows, same order): the executor JVM persists every frame as one
#: byte array, and arrays of half a G1 heap region (512 KB with a 1 GB heap) or more are
#: "humongous" objects that make persisting the results slower (docs/performance.md).
RESULT_FRAME_BYTES = 256 * 1024


def result_frames(items: list, limit: Optional[int] = None) -> list[bytes]:
    """Pickles inference results into frames of about ``limit`` bytes (pure; TF process).

    The number of results per frame is estimated from the pickled size of the first
    result, so every result is pickled once.

    Args:
        items: The results of one batch, in order.
        limit: Target frame size in bytes (default :data:`RESULT_FRAME_BYTES`); a single
            result larger than that gets a frame of its own.

    Returns:
        Pickled lists whose concatenation is ``items``.
    """
    limit = RESULT_FRAME_BYTES if limit is None else limit
    proto = pickle.HIGHEST_PROTOCOL
    if len(items) > 1:
        per = max(1, limit // (len(pickle.dumps(items[0], protocol=proto)) + 1))
        if per < len(items):
            return [pickle.dumps(items[i : i + per], protocol=proto) for i in range(0, len(items), per)]
    return [pickle.dumps(items, protocol=proto)]


class DataFeed:
    """Reads rows fed by ``cluster.train()`` / ``cluster.inference()`` (TF process).

    Args:
        mgr: The node's feed hub (``ctx.mgr``); None on nodes that are not fed.
        train_mode: True for ``train()`` data; False for inference, where batches never
            span partitions and every batch must be answered with :meth:`batch_results`.
        qname_in: Queue to read ('input').
        qname_out: Kept for TFoS compatibility (results go back on the row's own
            connection, in order).
        input_mapping: Optional ``{column: tensor_name}``; then :meth:`next_batch` returns
            ``{tensor_name: [values]}`` with columns taken in sorted column-name order
            (the order in which TFEstimator selects them).
        timeout_s: Longest wait for the next chunk, in seconds (default: the cluster's
            ``data_timeout_s``).

    Raises:
        TFOSError: When ``mgr`` is None (InputMode.TENSORFLOW, or a ps/evaluator node) or
            the queue does not exist.
    """

    def __init__(
        self,
        mgr: Optional[FeedHub],
        train_mode: bool = True,
        qname_in: str = "input",
        qname_out: str = "output",
        input_mapping: Optional[dict] = None,
        timeout_s: Optional[float] = None,
    ):
        if mgr is None:
            raise TFOSError(
                "this node has no data feed: DataFeed works only in InputMode.SPARK on chief/master/worker "
                "nodes (ps and evaluator nodes are never fed)"
            )
        if qname_in not in mgr.queues:
            raise TFOSError(f"no queue {qname_in!r} on this node; queues are {sorted(mgr.queues)}")
        self._hub = mgr
        self._q: queue.Queue = mgr.queues[qname_in]
        self.qname_in = qname_in
        self.qname_out = qname_out
        self.train_mode = train_mode
        self.input_tensors = [input_mapping[c] for c in sorted(input_mapping)] if input_mapping else None
        self._timeout_s = timeout_s if timeout_s is not None else getattr(mgr, "data_timeout_s", 3600.0)
        self._rows: list = []
        self._pos = 0
        self._conn: Optional[FeedConnection] = None
        self._peeked: Any = None
        self.done_feeding = False
        self._pending: collections.deque = collections.deque()
        #: ``(start index in batch, partition, epoch, row index in partition)`` per run of rows.
        self.last_origins: list[tuple[int, int, int, int]] = []

    # ------------------------------------------------------------------ input
    def _take(self) -> Any:
        if self._peeked is not None:
            item, self._peeked = self._peeked, None
            return item
        deadline = Deadline(
            self._timeout_s,
            f"data on queue {self.qname_in!r}",
            "the driver has not called cluster.train()/inference() or cluster.shutdown(), or feed tasks "
            "cannot reach this node",
        )
        waited = 0.0
        while True:
            try:
                return self._q.get(timeout=deadline.slice(1.0))
            except queue.Empty:
                waited += 1.0
                if self.qname_in in self._hub.terminated:
                    return END_OF_FEED
                if deadline.expired():
                    raise deadline.error()
                stuck = [o for c, _, o in self._pending if c.ended]
                if stuck and waited >= _READ_AHEAD_WAIT_S:
                    # The partition's feed task waits for these results before it ends, so
                    # the next partition may never come: answer before reading ahead.
                    raise InferenceResultError(
                        f"next_batch() is waiting for more data while a batch of partition {stuck[0][1]} is still "
                        "unanswered; call batch_results() for every batch before reading past the end of its "
                        "partition (inference must not read ahead)"
                    )

    def _finish_partition(self, conn: FeedConnection, answered_later: bool = False) -> None:
        conn.ended = True
        if conn.mode == "train":
            self._hub.finish_connection(conn, FrameType.ACK, {"rows": conn.rows_taken})
        elif conn.pending == 0 and not answered_later:
            self._hub.finish_connection(conn, FrameType.RESULTS_END, {"rows": conn.rows_taken})

    def next_batch(self, batch_size: int) -> Union[list, dict]:
        """Returns up to ``batch_size`` rows (fewer at the end of the feed, or in inference
        mode at the end of a partition).

        Args:
            batch_size: Maximum rows to return (>= 1).

        Returns:
            A list of rows as fed (tuples, lists, numpy arrays, strings), or with
            ``input_mapping`` a dict ``{tensor_name: [column values]}``.

        Raises:
            ValueError: For ``batch_size`` < 1.
            DeadlineExceededError: No data arrived within ``timeout_s``.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        out: list = []
        origins: list[tuple[int, int, int, int]] = []
        batch_conn: Optional[FeedConnection] = None
        while len(out) < batch_size and not self.done_feeding:
            if self._pos >= len(self._rows):
                item = self._take()
                if item is END_OF_FEED:
                    self.done_feeding = True
                    break
                if isinstance(item, PartitionEnd):
                    # In inference, rows of this partition still in ``out`` are answered by
                    # batch_results(), which then ends the partition. The end of another
                    # partition (chunks of concurrent feed tasks interleave) is handled now.
                    in_batch = not self.train_mode and item.conn is batch_conn
                    self._finish_partition(item.conn, answered_later=in_batch)
                    if in_batch:
                        break
                    continue
                if not isinstance(item, Chunk):
                    continue
                if not self.train_mode and batch_conn is not None and item.conn is not batch_conn:
                    self._peeked = item  # batches never span partitions in inference
                    break
                self._rows = decode_chunk(item.conn.kind, item.payload)
                self._pos = 0
                self._conn = item.conn
            conn = self._conn
            assert conn is not None
            take = min(batch_size - len(out), len(self._rows) - self._pos)
            origins.append((len(out), conn.partition, conn.epoch, conn.rows_taken))
            out.extend(self._rows[self._pos : self._pos + take])
            self._pos += take
            conn.rows_taken += take
            # Counted as rows leave the feed (not when the batch is returned), so the driver's
            # final count after train() includes a last batch still waiting for more rows.
            self._hub.rows_taken += take
            batch_conn = conn
        self.last_origins = origins
        if not self.train_mode and out:
            assert batch_conn is not None
            batch_conn.pending += 1
            self._pending.append((batch_conn, len(out), origins[0]))
        if self.input_tensors is None:
            return out
        cols: dict[str, list] = {t: [] for t in self.input_tensors}
        for row in out:
            for i, t in enumerate(self.input_tensors):
                cols[t].append(row[i])
        return cols

    def should_stop(self) -> bool:
        """True once the feed ended (end of feed from the driver, or :meth:`terminate`)."""
        return self.done_feeding

    # ----------------------------------------------------------------- output
    def batch_results(self, results: Sequence) -> None:
        """Answers the oldest unanswered inference batch with one result per row.

        Args:
            results: A sequence (list, tuple or numpy array) with exactly as many items as
                rows in the batch; numpy arrays are sent as ``.tolist()``.

        Raises:
            InferenceResultError: With no unanswered batch, or a wrong number of results
                (the message names the partition and the counts).
        """
        if not self._pending:
            raise InferenceResultError("batch_results() was called but no inference batch is waiting for results")
        conn, n, origin = self._pending.popleft()
        items = results.tolist() if hasattr(results, "tolist") else list(results)
        if len(items) != n:
            msg = (
                f"batch_results() got {len(items)} results for a batch of {n} rows "
                f"(partition {origin[1]}, rows {origin[3]}-{origin[3] + n - 1}); main_fun must return exactly "
                "one result per input row"
            )
            self._hub.finish_connection(conn, FrameType.ERROR, {"state": "failed", "message": msg})
            raise InferenceResultError(msg)
        conn.pending -= 1
        for frame in result_frames(items):
            conn.send(FrameType.RESULTS, frame)
        if conn.ended and conn.pending == 0:
            self._hub.finish_connection(conn, FrameType.RESULTS_END, {"rows": conn.rows_taken})

    def terminate(self) -> None:
        """Stops the feed early: feed tasks skip the remaining partitions, and
        :meth:`should_stop` becomes True. ``cluster.train()`` then returns normally."""
        log.info("DataFeed.terminate(): the remaining partitions for queue %r will be skipped", self.qname_in)
        self._hub.terminate(self.qname_in)
        self._rows, self._pos, self._peeked = [], 0, None
        self.done_feeding = True

    # ---------------------------------------------------------------- tf.data
    def batches(self, batch_size: int, columns: Optional[Sequence[tuple[Any, Optional[tuple]]]] = None) -> Iterator:
        """Yields batches until the end of the feed (TF process).

        Args:
            batch_size: Rows per batch (the last batch may be short).
            columns: When given, ``[(numpy dtype, row shape), ...]`` per column: each batch
                is converted with :func:`rows_to_columns` into a tuple of numpy arrays of
                shape ``(n,) + row shape``; otherwise raw row lists are yielded.

        Raises:
            MalformedRowError: A row does not fit ``columns`` (names partition and row).
        """
        while not self.should_stop():
            batch = self.next_batch(batch_size)
            if not batch:
                continue
            if columns is None:
                yield batch
            else:
                assert isinstance(batch, list)  # batches() is used without input_mapping
                yield rows_to_columns(batch, columns, self.last_origins)

    def as_dataset(self, batch_size: int, output_signature: Any, drop_remainder: bool = False):
        """A ``tf.data.Dataset`` of batches from this feed (TF process).

        Each row must be a tuple/list with one value per column of ``output_signature`` (or a
        single value when the signature is a single ``tf.TensorSpec``). The dataset ends
        cleanly at the end of the feed.

        Under ``MultiWorkerMirroredStrategy`` the workers may receive different amounts of
        data (uneven partitions, C12). Distribute the dataset with
        ``strategy.experimental_distribute_dataset`` and iterate it to exhaustion (or use
        tf_keras ``model.fit`` without ``steps_per_epoch``): TensorFlow synchronises the end
        of input across workers — a worker that runs out is fed empty batches until every
        worker is done — so no worker waits forever for another and every row is used.
        The dataset has auto-sharding turned off (each worker already gets only its own
        partitions). See ``docs/datafeed.md``.

        Args:
            batch_size: Rows per batch.
            output_signature: A ``tf.TensorSpec`` or tuple of them, with a leading ``None``
                (batch) dimension, e.g. ``(TensorSpec((None, 784), tf.float32),
                TensorSpec((None,), tf.int64))``.
            drop_remainder: Drop a last batch shorter than ``batch_size``.

        Returns:
            A ``tf.data.Dataset`` yielding tensors of the given dtypes and shapes.

        Raises:
            TypeError: When ``output_signature`` is not a TensorSpec or tuple of them.
            MalformedRowError: (while iterating) a row that does not fit the signature.
        """
        import tensorflow as tf

        single = isinstance(output_signature, tf.TensorSpec)
        specs = (output_signature,) if single else tuple(output_signature)
        if not specs or not all(isinstance(s, tf.TensorSpec) for s in specs):
            raise TypeError("output_signature must be a tf.TensorSpec or a tuple of tf.TensorSpec")
        columns = [(s.dtype.as_numpy_dtype, tuple(s.shape[1:].as_list()) if s.shape.rank else ()) for s in specs]

        def gen() -> Iterator:
            for cols in self.batches(batch_size, columns if not single else None):
                if single:
                    arr = rows_to_columns([(r,) for r in cols], columns, self.last_origins)[0]
                    if drop_remainder and len(arr) < batch_size:
                        return
                    yield arr
                else:
                    if drop_remainder and len(cols[0]) < batch_size:
                        return
                    yield cols

        sig = specs[0] if single else specs
        ds = tf.data.Dataset.from_generator(gen, output_signature=sig)
        # Each worker has its own feed: auto-sharding would silently drop part of it.
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
        return ds.with_options(options)


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
) -> tuple:
    """Converts a batch of rows into one numpy array per column (pure; TF process).

    Args:
        rows: ``n`` rows, each a tuple/list with ``len(columns)`` values.
        columns: ``[(numpy dtype, row shape or None), ...]``; ``()`` means a scalar and
            ``None`` means any shape (taken from the data).
        origins: :attr:`DataFeed.last_origins`, used to name the partition and row index
            of a bad row.

    Returns:
        A tuple of arrays: column ``i`` has dtype ``columns[i][0]`` and shape
        ``(n,) + columns[i][1]``.

    Raises:
        MalformedRowError: For a ``None`` row, a row with the wrong number of values, or a
            value of the wrong size or type; the message names partition and row.
    """
    import numpy as np

    ncol = len(columns)
    try:
        bad_len = any(len(row) != ncol for row in rows)
    except TypeError:  # a None or scalar row
        bad_len = True
    if bad_len and ncol:
        _raise_first_bad(rows, ncol, 0, columns[0][0], columns[0][1], origins)
    out = []
    for c, (dtype, shape) in enumerate(columns):
        try:
            vals = [row[c] for row in rows]
            arr = np.asarray(vals, dtype=dtype)
            if not rows and shape is not None:
                arr = arr.reshape((0,) + tuple(shape))  # an empty batch still has the row shape
            if shape is not None and arr.shape[1:] != tuple(shape):
                raise ValueError("shape")
            out.append(arr)
        except (TypeError, ValueError, IndexError, KeyError):
            _raise_first_bad(rows, ncol, c, dtype, shape, origins)
            raise
    return tuple(out)


def _raise_first_bad(rows: Sequence, ncol: int, c: int, dtype: Any, shape: Optional[tuple], origins: Sequence) -> None:
    import numpy as np

    for i, row in enumerate(rows):
        if row is None:
            raise _row_error(origins, i, "the row is None")
        try:
            n = len(row)
        except TypeError:
            raise _row_error(origins, i, f"expected a row of {ncol} values, got {type(row).__name__}") from None
        if n != ncol:
            raise _row_error(origins, i, f"expected {ncol} values per row, got {n}")
        try:
            v = np.asarray(row[c], dtype=dtype)
        except (TypeError, ValueError) as exc:
            raise _row_error(origins, i, f"column {c}: cannot convert to {np.dtype(dtype).name}: {exc}") from None
        if shape is not None and v.shape != tuple(shape):
            raise _row_error(origins, i, f"column {c}: expected shape {tuple(shape)}, got {v.shape}")
    raise _row_error(origins, 0, f"column {c}: values do not form an array of {np.dtype(dtype).name}")

