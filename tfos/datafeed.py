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
up to ``data_timeout_s``. When the driver aborts the cluster (a node failed, ...), the feed
is cut off, never ended: reads raise :class:`~tfos.errors.FeedAbortedError`.
"""

from __future__ import annotations

import collections
import logging
import queue
from typing import Any, Optional, Sequence, Union

from ._common.deadline import Deadline
from ._data.columns import rows_to_columns
from ._data.feed_connection import END_OF_FEED, Chunk, FeedConnection, PartitionEnd
from ._data.feed_datasets import FeedDatasets
from ._data.feed_hub import FeedHub
from ._data.figures import FIGURES
from ._data.framing import FeedState, FrameType, decode_chunk
from ._data.input_mapping import InputMapping, row_names
from ._data.results import result_frames, result_items
from ._data.row_count import ROWS
from .errors import FeedAbortedError, InferenceResultError, TFOSError

__all__ = ["DataFeed", "rows_to_columns"]

log = logging.getLogger(__name__)

#: Seconds next_batch() waits for data while an ended partition has unanswered batches.
_READ_AHEAD_WAIT_S = 5.0

class DataFeed(FeedDatasets):
    """Reads rows fed by ``cluster.train()`` / ``cluster.inference()`` (TF process).

    Args:
        mgr: The node's feed hub (``ctx.mgr``); None on nodes that are not fed.
        train_mode: True (default): a batch of ``train()`` rows may span partitions.
            False (TFoS's inference form): no batch spans partitions. Either way a batch
            holds rows of one kind: a batch of ``cluster.inference()`` rows never spans
            partitions and must be answered with :meth:`batch_results`, and results
            given for a batch of ``train()`` rows are dropped, so one ``main_fun`` can
            serve ``train()`` and then ``inference()`` on one cluster (:attr:`batch_mode`
            tells its batches apart).
        qname_in: Queue to read ('input').
        qname_out: Kept for TFoS compatibility (results go back on the row's own
            connection, in order).
        input_mapping: Optional ``{column: tensor_name}``; then :meth:`next_batch` returns
            ``{tensor_name: [values]}``. Rows that carry column names (a DataFrame's rows,
            ``Row`` objects) give each tensor its column by name; plain tuples give the i-th
            mapped column, in sorted column-name order (the order in which TFEstimator
            selects them, as in TFoS), the i-th value. When the rows' names do not include
            every mapped column, the positional pairing is used and a WARNING names the
            missing columns.
        timeout_s: Longest wait for the next chunk, in seconds (default: the cluster's
            ``data_timeout_s``).

    Raises:
        TFOSError: When ``mgr`` is None (InputMode.TENSORFLOW, or a ps/evaluator node) or
            the queue does not exist.

    Threads: one thread at a time reads a DataFeed (any thread: a
    ``tf.data.Dataset.from_generator`` generator, which tf.data runs in one thread, is
    fine). It keeps its place in the current chunk without a lock, so two threads calling
    :meth:`next_batch` at once are not supported.
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
        #: The ``mgr`` this feed reads from (TFoS attribute).
        self.mgr = mgr
        self.train_mode = train_mode
        self.qname_in = qname_in
        self.qname_out = qname_out
        self._mapping = InputMapping(input_mapping, getattr(mgr, "node_name", "?")) if input_mapping else None
        self.input_tensors = self._mapping.tensors if self._mapping else None
        self.done_feeding = False
        #: ``'train'`` or ``'inference'``: the job (``cluster.train()`` or
        #: ``cluster.inference()``) that fed the rows of the last non-empty batch
        #: :meth:`next_batch` returned; None before the first one, and on a TFManager feed.
        self.batch_mode: Optional[str] = None
        self._legacy: Any = None
        if not isinstance(getattr(mgr, "queues", None), dict) and hasattr(mgr, "get_queue"):
            # A TFoS-style TFManager (tfos.TFManager.start / TFSparkNode.run): rows on plain queues.
            from ._data.queue_feed import QueueFeed

            self._legacy = QueueFeed(mgr, qname_in, qname_out, train_mode)
            return
        if qname_in not in mgr.queues:
            raise TFOSError(f"no queue {qname_in!r} on this node; queues are {sorted(mgr.queues)}")
        self._hub = mgr
        ROWS.reader(self)  # its unread rows when main_fun returns (docs/datafeed.md "Row accounting")
        self._q: queue.Queue = mgr.queues[qname_in]
        self._timeout_s = timeout_s if timeout_s is not None else getattr(mgr, "data_timeout_s", 3600.0)
        self._rows: list = []
        self._pos = 0
        self._conn: Optional[FeedConnection] = None
        self._peeked: Any = None
        self._pending: collections.deque = collections.deque()
        self._last_batch_empty = False
        #: ``(start index in batch, partition, epoch, row index in partition)`` per run of rows.
        self.last_origins: list[tuple[int, int, int, int]] = []

    @property
    def queue_in(self) -> Any:
        """TFoS's input queue: the ``mgr`` queue of a TFoS-style ``TFManager``.

        Raises:
            TFOSError: On a tfos node (``ctx.mgr`` of ``TFCluster.run``), which has no row
                queue: rows arrive in chunks on the node's data connections. Read them with
                :meth:`next_batch`, :meth:`batches` or :meth:`as_dataset`.
        """
        if self._legacy is not None:
            return self._legacy.queue_in
        raise TFOSError(
            "DataFeed.queue_in: a tfos node has no row queue (rows arrive in chunks on the node's data "
            "connections); read rows with next_batch(), batches() or as_dataset() instead"
        )

    @property
    def queue_out(self) -> Any:
        """TFoS's output queue: the ``mgr`` queue of a TFoS-style ``TFManager``.

        Raises:
            TFOSError: On a tfos node, where results go back on each partition's own
                connection: answer every inference batch with :meth:`batch_results`.
        """
        if self._legacy is not None:
            return self._legacy.queue_out
        raise TFOSError(
            "DataFeed.queue_out: a tfos node has no output queue (results go back, in order, on the "
            "connection of the partition they answer); use batch_results() instead"
        )

    # ------------------------------------------------------------------ input
    def _take(self) -> Any:
        # The abort is checked before and after every wait: an item taken once the cluster
        # aborted (an END_OF_FEED queued just before the abort, a chunk of a cut-off feed)
        # is never handed out.
        if self._hub.aborted:
            self._raise_aborted()
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
                item = self._q.get(timeout=deadline.slice(1.0))
            except queue.Empty:
                item = None  # queue items are never None
            if self._hub.aborted:
                self._raise_aborted()
            if item is not None:
                return item
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

    def _raise_aborted(self) -> None:
        raise FeedAbortedError(
            f"node {self._hub.node_name}: the cluster aborted ({self._hub.aborted}) while main_fun was reading queue "
            f"{self.qname_in!r}; its feed was cut off, not ended (the driver raises the failure that caused this, or "
            "restarts the cluster with max_restarts)"
        )

    def _finish_partition(self, conn: FeedConnection, answered_later: bool = False) -> None:
        conn.ended = True
        if self._hub.aborted:
            return  # no ACK once the cluster aborted: the driver must not count it as consumed
        if conn.mode == "train":
            self._hub.finish_connection(conn, FrameType.ACK, {"rows": conn.rows_taken})
        elif conn.pending == 0 and not answered_later:
            self._hub.finish_connection(conn, FrameType.RESULTS_END, {"rows": conn.rows_taken})

    def _spans(self, conn: FeedConnection) -> bool:
        """Whether a batch may run on past the end of ``conn``'s partition: only rows of
        ``train()`` read with ``train_mode=True``. A batch of ``inference()`` rows never
        spans partitions (its results go back on the partition's connection), whatever
        ``train_mode`` says; neither does a batch mix the two kinds of rows."""
        return self.train_mode and conn.mode == "train"

    def next_batch(self, batch_size: int) -> Union[list, dict]:
        """Returns up to ``batch_size`` rows (fewer at the end of the feed, at the end of an
        inference partition, at the end of any partition with ``train_mode=False``, or
        where the rows of ``train()`` are followed by those of ``inference()``).

        Args:
            batch_size: Maximum rows to return (>= 1).

        Returns:
            A list of rows as fed (tuples, lists, numpy arrays, strings), or with
            ``input_mapping`` a dict ``{tensor_name: [column values]}``.

        Raises:
            ValueError: For ``batch_size`` < 1.
            DeadlineExceededError: No data arrived within ``timeout_s``.
            FeedAbortedError: The cluster aborted (a node failed, the driver was interrupted
                or a Spark job of the cluster failed): the feed was cut off, not ended. Also
                raised by every later call, whatever rows were left in the current chunk.
            InferenceResultError: Inference only: this call waited 5 s for more rows while
                a batch of a partition whose rows all arrived is still unanswered (call
                ``batch_results()`` for every batch before reading past its partition).
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if self._legacy is not None:
            rows = self._legacy.next_batch(batch_size)
            self.done_feeding = self._legacy.done_feeding
            return rows if self._mapping is None else self._mapping.positional(rows)
        # main_fun's time in the feed (waiting for chunks, unpacking them): the driver's
        # feed-wait share and its live wait (docs/status.md).
        FIGURES.wait_begin("feed_wait")
        try:
            return self._next_batch(batch_size)
        finally:
            FIGURES.wait_end("feed_wait")

    def _next_batch(self, batch_size: int) -> Union[list, dict]:
        if self._hub.aborted:
            self._raise_aborted()
        out: list = []
        origins: list[tuple[int, int, int, int]] = []
        segments: list[tuple[int, tuple]] = []  # (first row in out, column names of its rows) with input_mapping
        batch_conn: Optional[FeedConnection] = None
        while len(out) < batch_size and not self.done_feeding:
            if self._pos >= len(self._rows):
                item = self._take()
                if item is END_OF_FEED:
                    self.done_feeding = True
                    break
                if isinstance(item, PartitionEnd):
                    # Rows of an inference partition still in ``out`` are answered by
                    # batch_results(), which then ends the partition. The end of another
                    # partition (chunks of concurrent feed tasks interleave) is handled now.
                    in_batch = item.conn is batch_conn and not self._spans(item.conn)
                    self._finish_partition(item.conn, answered_later=in_batch)
                    if in_batch:
                        break
                    continue
                if not isinstance(item, Chunk):
                    continue
                if batch_conn is not None and item.conn is not batch_conn and not (self._spans(batch_conn) and self._spans(item.conn)):
                    self._peeked = item  # the batch ends with its partition
                    break
                self._rows = decode_chunk(item.conn.kind, item.payload)
                self._pos = 0
                self._conn = item.conn
            conn = self._conn
            assert conn is not None
            take = min(batch_size - len(out), len(self._rows) - self._pos)
            origins.append((len(out), conn.partition, conn.epoch, conn.rows_taken))
            if self._mapping is not None:
                segments.append((len(out), row_names(self._rows, self._pos)))
            out.extend(self._rows[self._pos : self._pos + take])
            self._pos += take
            conn.rows_taken += take
            # Counted as rows leave the feed (not when the batch is returned), so the driver's
            # final count after train() includes a last batch still waiting for more rows.
            self._hub.rows_taken += take
            if conn.mode == "train":
                ROWS.handed(conn.feed_id, conn.epoch, take)  # docs/datafeed.md "Row accounting"
            batch_conn = conn
        self._last_batch_empty = not out
        if out and batch_conn is not None:
            self.batch_mode = batch_conn.mode
        self.last_origins = origins
        if out and batch_conn is not None and batch_conn.mode != "train":
            batch_conn.pending += 1
            self._pending.append((batch_conn, len(out), origins[0]))
        if self._mapping is None:
            return out
        return self._mapping.columns(out, segments)

    def should_stop(self) -> bool:
        """True once the feed ended (end of feed from the driver, or :meth:`terminate`)."""
        return self.done_feeding

    # ----------------------------------------------------------------- output
    def batch_results(self, results: Sequence) -> None:
        """Answers the oldest unanswered inference batch with one result per row.

        Args:
            results: A sequence (list, tuple, numpy array or ``tf.Tensor``) with exactly as
                many items as rows in the batch. Items are returned as they are, as in TFoS:
                the rows of a 2-D numpy array stay 1-D numpy arrays, the items of a 1-D array
                stay numpy scalars (a ``tf.Tensor`` is converted with ``.numpy()`` first).

        Empty ``results`` right after an empty ``next_batch`` answer that batch and do
        nothing (as in TFoS, where a loop may call ``batch_results`` after the last, empty
        ``next_batch``). Results for a batch of ``train()`` rows are dropped (nothing
        waits for them, as in TFoS) when that batch is the last one returned and no
        inference batch waits: a loop that answers every batch must answer each one before
        reading the next (or check :attr:`batch_mode` and answer inference batches only).

        Raises:
            InferenceResultError: With no unanswered inference batch (and the last batch
                was not of ``train()`` rows), or a wrong number of results (the message
                names the partition and the counts).
        """
        if self._legacy is not None:
            self._legacy.batch_results(results)
            return
        items = result_items(results)
        if not items and self._last_batch_empty:
            # The answer to an empty batch (next_batch() at the end of the feed returns []);
            # empty batches are never waited for, so there is nothing to send (TFoS: no-op).
            return
        if not self._pending:
            if not self._last_batch_empty and self.batch_mode == "train":
                # The last batch came from train(): nothing waits for results, and they are
                # dropped, as in TFoS (one main_fun may serve train() and inference()).
                return
            raise InferenceResultError(
                f"node {self._hub.node_name}: batch_results() was called but no inference batch is waiting for "
                "results (each batch of cluster.inference() rows is answered once, in the order next_batch() "
                "returned them)"
            )
        conn, n, origin = self._pending.popleft()
        if len(items) != n:
            msg = (
                f"batch_results() got {len(items)} results for a batch of {n} rows "
                f"(partition {origin[1]}, rows {origin[3]}-{origin[3] + n - 1}); main_fun must return exactly "
                "one result per input row"
            )
            self._hub.finish_connection(conn, FrameType.ERROR, {"state": FeedState.MAIN_FUN_FAILED, "message": msg})
            raise InferenceResultError(msg)
        conn.pending -= 1
        for frame in result_frames(items):
            conn.send(FrameType.RESULTS, frame)
        if conn.ended and conn.pending == 0:
            self._hub.finish_connection(conn, FrameType.RESULTS_END, {"rows": conn.rows_taken})

    def terminate(self) -> None:
        """Stops the feed early: feed tasks skip the remaining partitions, and
        :meth:`should_stop` becomes True. ``cluster.train()`` then returns normally.

        After the cluster aborted (:class:`~tfos.errors.FeedAbortedError`) it only makes
        :meth:`should_stop` True: the feed tasks are not told to skip, because a skipped
        partition counts as consumed when a restart decides where the feed resumes."""
        log.info("DataFeed.terminate(): the remaining partitions for queue %r will be skipped", self.qname_in)
        if self._legacy is not None:
            self._legacy.terminate()
            self.done_feeding = True
            return
        self._hub.terminate(self.qname_in)
        self._rows, self._pos, self._peeked = [], 0, None
        self.done_feeding = True
