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
import pickle
import queue
from typing import Any, Iterator, Optional, Sequence, Union

from ._common.deadline import Deadline
from ._data.columns import rows_to_columns
from ._data.feed_hub import END_OF_FEED, Chunk, FeedConnection, FeedHub, PartitionEnd
from ._data.framing import FrameType, decode_chunk
from ._node.figures import FIGURES
from .errors import FeedAbortedError, InferenceResultError, TFOSError

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
        #: ``[(column, tensor)]`` of ``input_mapping``, sorted by column name.
        self._mapping: Optional[list] = sorted(input_mapping.items(), key=lambda kv: str(kv[0])) if input_mapping else None
        self.input_tensors = [t for _, t in self._mapping] if self._mapping else None
        self._mapping_idx: dict = {}  # column names of a chunk -> the value index of each mapped column
        self.done_feeding = False
        #: ``'train'`` or ``'inference'``: the job (``cluster.train()`` or
        #: ``cluster.inference()``) that fed the rows of the last non-empty batch
        #: :meth:`next_batch` returned; None before the first one, and on a TFManager feed.
        self.batch_mode: Optional[str] = None
        self._legacy: Optional[_QueueFeed] = None
        if not isinstance(getattr(mgr, "queues", None), dict) and hasattr(mgr, "get_queue"):
            # A TFoS-style TFManager (tfos.TFManager.start / TFSparkNode.run): rows on plain queues.
            self._legacy = _QueueFeed(mgr, qname_in, qname_out, train_mode)
            return
        if qname_in not in mgr.queues:
            raise TFOSError(f"no queue {qname_in!r} on this node; queues are {sorted(mgr.queues)}")
        self._hub = mgr
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
            return rows if self.input_tensors is None else _to_columns(rows, self.input_tensors)
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
                segments.append((len(out), self._row_names(self._rows, self._pos)))
            out.extend(self._rows[self._pos : self._pos + take])
            self._pos += take
            conn.rows_taken += take
            # Counted as rows leave the feed (not when the batch is returned), so the driver's
            # final count after train() includes a last batch still waiting for more rows.
            self._hub.rows_taken += take
            batch_conn = conn
        self._last_batch_empty = not out
        if out and batch_conn is not None:
            self.batch_mode = batch_conn.mode
        self.last_origins = origins
        if out and batch_conn is not None and batch_conn.mode != "train":
            batch_conn.pending += 1
            self._pending.append((batch_conn, len(out), origins[0]))
        if self.input_tensors is None:
            return out
        return self._mapped_columns(out, segments)

    @staticmethod
    def _row_names(rows: Sequence, pos: int) -> tuple:
        """The column names the rows of a chunk carry: a DataFrame chunk's columns, or the
        fields of a ``Row`` (``df.rdd``); () for plain tuples."""
        names = getattr(rows, "column_names", None)
        if names:
            return tuple(names)
        fields = getattr(rows[pos], "__fields__", None) if pos < len(rows) else None
        return tuple(fields) if fields else ()

    def _mapped_columns(self, rows: list, segments: list) -> dict[str, list]:
        """``{tensor: [values]}`` of ``input_mapping`` (TF process). Rows that carry column
        names (DataFrame chunks, ``Row`` objects) give each tensor its column by name; plain
        tuples give the i-th mapped column (sorted by name) the i-th value, as in TFoS."""
        assert self._mapping is not None
        cols: dict[str, list] = {t: [] for _, t in self._mapping}
        ends = [start for start, _ in segments[1:]] + [len(rows)]
        for (start, names), end in zip(segments, ends):
            idx = self._mapping_idx.get(names)
            if idx is None:
                idx = self._mapping_idx[names] = self._value_index(names)
            for row in rows[start:end]:
                for i, (_, t) in zip(idx, self._mapping):
                    cols[t].append(row[i])
        return cols

    def _value_index(self, names: tuple) -> list[int]:
        assert self._mapping is not None
        wanted = [str(c) for c, _ in self._mapping]
        if names and all(c in names for c in wanted):
            return [names.index(c) for c in wanted]
        if names:
            missing = [c for c in wanted if c not in names]
            log.warning(
                "node %s: input_mapping columns %s are not among the fed rows' columns %s; pairing the i-th mapped "
                "column (sorted by name: %s) with the i-th value of each row, as TFoS did", self._hub.node_name,
                missing, list(names), wanted)
        return list(range(len(wanted)))

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
        items = _result_items(results)
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
            self._hub.finish_connection(conn, FrameType.ERROR, {"state": "failed", "message": msg})
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
            FeedAbortedError: The cluster aborted (see :meth:`next_batch`).
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

    def as_dataset(
        self,
        batch_size: int,
        output_signature: Any,
        drop_remainder: bool = False,
        per_epoch: bool = False,
        prefetch: int = 2,
        buffer_batches: Optional[int] = None,
        steps_per_epoch: Optional[int] = None,
        shuffle_rows: int = 0,
        shuffle_seed: Optional[int] = None,
    ):
        """A ``tf.data.Dataset`` of whole batches from this feed (TF process, train mode).

        Each row must be a tuple/list with one value per column of ``output_signature`` (or a
        single value when the signature is a single ``tf.TensorSpec``). A background thread
        reads the feed ahead, turns every chunk into numpy columns at once (zero-copy views
        for Arrow chunks of numeric and fixed-length list columns; one stack per column for
        pickled chunks) and cuts them into batches; TensorFlow receives whole batches
        (``tfos._data.tfdata.FeedBatches``, kept as ``dataset.tfos_batches``). The dataset ends
        cleanly at the end of the feed. From its first iteration on, the dataset is the
        feed's only reader.

        With ``per_epoch=True`` every iteration over the dataset is one epoch of
        ``cluster.train(data, num_epochs)`` (it ends as soon as the first row of the next
        epoch arrives), and the reader keeps reading ahead across iterations, so the next
        epoch is already buffered when Keras starts it. Call ``model.fit(ds,
        initial_epoch=e, epochs=e + 1)`` once per epoch on the same dataset: tf_keras infers
        the steps of every epoch from the first one and ends ``fit(epochs=n)`` early ("Your
        input ran out of data") when a later epoch has fewer steps, which happens whenever
        Spark assigns a node fewer partitions in that epoch. A single
        ``fit(ds, epochs=n)`` is right only when every epoch has the same number of steps.

        With ``steps_per_epoch=S`` (the same on every node) one iteration covers all
        epochs and every epoch is exactly ``S`` batches on every node, so one
        ``model.fit(ds, epochs=n, steps_per_epoch=S)`` trains all epochs with one iterator
        (no gap between epochs). Batches hold ``batch_size`` rows except the last
        ``hold_batches`` of each epoch (``min(S, buffer_batches // 2)``: all ``S`` when the
        read-ahead buffer holds a whole epoch, as with small data), which are cut once the
        epoch's end is known and share its remaining rows evenly: smaller (down to empty)
        on a node that got fewer than ``S x batch_size`` rows in that epoch, larger on a
        node that got more. Every fed row is handed out exactly once, in its epoch; a feed
        that ends without any row gives ``S`` empty batches, so every node still takes
        the same steps. Take ``S`` from
        :meth:`DataFeed.steps_per_epoch` ``(rows_per_epoch, batch_size, num_nodes)``, with
        ``batch_size`` the per-worker batch; under ``MultiWorkerMirroredStrategy`` give
        ``model.fit`` ``strategy.distribute_datasets_from_function(lambda _: ds)`` (each
        batch is one worker's step, not split again). A node's surplus rows of an epoch
        are held until the epoch ends (memory: see ``tfos._data.tfdata``).
        The dataset's epochs run on across ``train()`` calls: after ``train(data, 2)``,
        the first epoch of ``train(data, 1)`` is the dataset's epoch 2 (its own rows only;
        each call numbers its epochs from 0 on the driver and in error messages).

        Both epoch-aware forms keep every epoch whole when Spark runs a later epoch's
        task before an earlier one's (``tfos._data.tfdata.EpochOrder``): the node holds a
        later epoch's chunks back in memory until the driver says the earlier epoch's
        partitions all went out and this node read its own; at most ``feed_timeout / 2``
        seconds and ``max(2 x buffer, 64 MiB)`` bytes, then a WARNING names the epoch.

        ``shuffle_rows=W`` (with ``steps_per_epoch``) shuffles rows, not batches: the
        reader thread pools the epoch's rows as they arrive, from every chunk and
        partition, and draws each batch uniformly at random from a pool of at least ``W``
        rows (more at the epoch's end, when the pool empties into its last batches).
        Batches never mix epochs, every epoch keeps exactly ``S`` batches and every row is
        handed out exactly once. Spark feeds the partitions in the same order every epoch,
        so without it a batch holds consecutive rows of one partition. ``shuffle_seed``
        makes the order repeatable (for the same arrival order of chunks). Shuffling a
        dataset of whole batches on the TF side (``ds.shuffle``) would only reorder
        batches, and ``ds.unbatch().shuffle().batch()`` would change ``S``.

        Under ``MultiWorkerMirroredStrategy`` the workers may receive different amounts of
        data (uneven partitions: docs/datafeed.md "Uneven data under MultiWorkerMirroredStrategy").
        Distribute the dataset with
        ``strategy.experimental_distribute_dataset`` and iterate it to exhaustion (or use
        tf_keras ``model.fit`` without ``steps_per_epoch``): TensorFlow synchronises the end
        of input across workers — a worker that runs out is fed empty batches until every
        worker is done — so no worker waits forever for another and every row is used.
        The dataset has auto-sharding turned off (each worker already gets only its own
        partitions). See ``docs/datafeed.md``.

        Args:
            batch_size: Rows per batch of this node's dataset. Under
                MultiWorkerMirroredStrategy, a dataset given to ``model.fit`` as is is
                distributed by Keras, which takes each batch as a global batch and splits
                it over the replicas (every fed row is still trained once); through
                ``strategy.distribute_datasets_from_function(lambda _: ds)`` (needed with
                ``steps_per_epoch``) each batch is one worker's step: the per-worker batch.
            output_signature: A ``tf.TensorSpec`` or tuple of them, with a leading ``None``
                (batch) dimension, e.g. ``(TensorSpec((None, 784), tf.float32),
                TensorSpec((None,), tf.int64))``.
            drop_remainder: Drop a last batch (of the feed, or of an epoch with
                ``per_epoch``) shorter than ``batch_size``.
            per_epoch: One epoch per iteration (see above).
            prefetch: Batches ``tf.data`` prefetches (0: none).
            buffer_batches: Batches the reader thread keeps ready (default about 32 MB; when a
                column holds strings or bytes or has no fixed shape, at most 8 batches and
                at most about 32 MB of them, counted as they come, but at least one).
            steps_per_epoch: Batches per epoch on every node (see above); excludes
                ``per_epoch`` and ``drop_remainder``.
            shuffle_rows: Row-level shuffle window in rows (0: the fed order); needs
                ``steps_per_epoch``. Memory: ``W`` rows more in the reader.
            shuffle_seed: Seed of that shuffle (None: from the OS).

        Returns:
            A ``tf.data.Dataset`` yielding tensors of the given dtypes and shapes.

        Raises:
            TypeError: When ``output_signature`` is not a TensorSpec or tuple of them.
            ValueError: For a spec without the leading batch dimension (a per-row shape such
                as ``TensorSpec(())``) or with a first dimension fixed to another size than
                ``batch_size``; in inference mode (``train_mode=False``), for ``batch_size`` < 1,
                ``shuffle_rows`` < 0, or ``shuffle_rows`` without ``steps_per_epoch``.
            MalformedRowError: (while iterating) a row that does not fit the signature
                (or, with ``shuffle_rows``, a column whose row shape changes).
            FeedAbortedError: (while iterating) the cluster aborted: the feed was cut off,
                not ended. TensorFlow wraps it in a ``tf.errors.UnknownError`` (see
                :class:`~tfos.errors.FeedAbortedError`); the driver counts it as a
                consequence of the abort either way.
        """
        from ._data.tfdata import feed_dataset

        return feed_dataset(self, batch_size, output_signature, drop_remainder, per_epoch, prefetch, buffer_batches,
                            steps_per_epoch, shuffle_rows, shuffle_seed)

    @staticmethod
    def steps_per_epoch(rows_per_epoch: int, batch_size: int, num_nodes: int) -> int:
        """The ``steps_per_epoch`` for :meth:`as_dataset` that every node can compute alike (pure).

        ``ceil(rows_per_epoch / (batch_size x num_nodes))``: the steps of an epoch when its
        rows are spread evenly over the nodes.

        Args:
            rows_per_epoch: Rows of one epoch over all nodes (``data.count()`` on the driver,
                passed to ``main_fun`` in its args).
            batch_size: Rows per step on one node (the per-worker batch).
            num_nodes: Nodes fed: ``ctx.num_workers`` (chief/master plus workers;
                ``strategy.num_replicas_in_sync`` equals it only with one replica per
                node). See docs/datafeed.md.

        Returns:
            The steps per epoch (>= 1).

        Raises:
            ValueError: When an argument is < 1.
        """
        from ._data.tfdata import steps_per_epoch

        return steps_per_epoch(rows_per_epoch, batch_size, num_nodes)

def _to_columns(rows: Sequence, tensors: Sequence[str]) -> dict[str, list]:
    """``{tensor: [row[i] for row in rows]}`` for the i-th mapped tensor (TFoS ``input_mapping``)."""
    cols: dict[str, list] = {t: [] for t in tensors}
    for row in rows:
        for i, t in enumerate(tensors):
            cols[t].append(row[i])
    return cols


def _result_items(results: Any) -> list:
    """One item per row, as TFoS returned them: numpy rows stay numpy, scalars stay scalars.

    Args:
        results: A list, tuple, numpy array, ``tf.Tensor`` or any iterable.

    Returns:
        ``list(results)``; a ``tf.Tensor`` is first converted with ``.numpy()``.

    Raises:
        InferenceResultError: For None, a string/bytes, or anything not iterable.
    """
    if type(results).__module__.startswith("tensorflow") and callable(getattr(results, "numpy", None)):
        results = results.numpy()
    if isinstance(results, (str, bytes, bytearray)) or results is None:
        # list("abc") would answer one row per character: never what main_fun meant.
        raise InferenceResultError(
            f"batch_results() needs one result per input row (a list, tuple, numpy array or tf.Tensor), got "
            f"{type(results).__name__}{'' if results is None else ' (a string would give one result per character)'}"
        )
    try:
        return list(results)
    except TypeError:
        raise InferenceResultError(
            f"batch_results() needs one result per input row (a list, tuple, numpy array or tf.Tensor), got "
            f"{type(results).__name__}, which is not iterable"
        ) from None


class _QueueFeed:
    """TFoS's row-queue protocol on a :mod:`tfos.TFManager` manager (TF process or test).

    Rows are single queue items; ``None`` ends the feed and a
    :class:`tfos.marker.EndPartition` ends a partition (an inference batch never spans one).
    Results go to ``qname_out``, one item per row.
    """

    def __init__(self, mgr: Any, qname_in: str, qname_out: str, train_mode: bool):
        self.mgr = mgr
        self.train_mode = train_mode
        self.queue_in = mgr.get_queue(qname_in)
        self.queue_out = mgr.get_queue(qname_out)
        if self.queue_in is None:
            raise TFOSError(f"the manager has no queue {qname_in!r}")
        self.done_feeding = False

    def next_batch(self, batch_size: int) -> list:
        from tfos._legacy.marker import EndPartition

        out: list = []
        while len(out) < batch_size:
            item = self.queue_in.get(block=True)
            self.queue_in.task_done()
            if item is None:
                self.done_feeding = True
                break
            if isinstance(item, EndPartition):
                if not self.train_mode and out:
                    break
                continue
            out.append(item)
        return out

    def batch_results(self, results: Any) -> None:
        if self.queue_out is None:
            raise TFOSError("batch_results(): the manager has no output queue")
        for item in _result_items(results):
            self.queue_out.put(item, block=True)

    def terminate(self) -> None:
        self.mgr.set("state", "terminating")
        dropped = 0
        while True:
            try:
                self.queue_in.get(block=True, timeout=5)
            except queue.Empty:
                break
            self.queue_in.task_done()
            dropped += 1
        log.info("DataFeed.terminate(): dropped %d queued items", dropped)
        self.done_feeding = True

