"""The fast path from a node's feed queue into ``tf.data`` (runs in the TF process only).

:class:`FeedBatches` owns a node's :class:`~tfos.datafeed.DataFeed` once started: a
background thread takes whole chunks off the feed queue, turns each chunk into numpy
columns at once (no per-row Python on the Arrow path, one ``np.asarray`` stack per column
and chunk on the pickled path), cuts the columns into batches and keeps a bounded buffer
of ready batches. TensorFlow then only receives whole batches:

* :meth:`FeedBatches.dataset` is a ``tf.data.Dataset`` over them (``from_generator`` whose
  generator only hands over ready batches, followed by ``prefetch``);
* iterating the object itself gives the numpy batches (for custom loops).

Epochs (docs/datafeed.md "tf.data"): with ``per_epoch=True`` each iteration yields exactly
one epoch (the reader keeps reading ahead across epoch boundaries); with
``steps_per_epoch=S`` one iteration cuts every epoch into exactly ``S`` batches on every
node (:mod:`tfos._data.epoch_steps`). Both read through
:class:`~tfos._data.epoch_order.EpochOrder`, so every epoch holds exactly the rows of one
pass whatever order Spark runs the feed tasks in.

Memory bound of a node (bytes): the feed queue ``(queue_chunks + 2) x chunk bytes``
(see :mod:`tfos._data.feed_hub`), plus ``buffer_batches + 2`` batches here (the buffer, the
batch being assembled and the one the generator hands over), plus the ``prefetch``
batches of ``tf.data``, plus ``shuffle_rows`` rows with the row-level shuffle, plus, while
:class:`~tfos._data.epoch_order.EpochOrder` holds a later epoch back, its chunks as received (at most
``max(2 x buffer_bytes, 64 MiB)``);
:attr:`FeedBatches.buffer_bytes` states the part held here.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from typing import Any, Iterator, Optional, Sequence

from tfos._data.chunk_columns import Column, batch_bytes, chunk_columns
from tfos._data.epoch_order import EpochOrder
from tfos._data.epoch_steps import EpochSteps, check_steps
from tfos._data.feed_connection import END_OF_FEED, Chunk, PartitionEnd
from tfos._data.figures import FIGURES
from tfos._data.row_count import ROWS
from tfos.errors import InferenceResultError, TFOSError

__all__ = ["FeedBatches", "DEFAULT_BUFFER_BYTES"]

log = logging.getLogger(__name__)

#: Default size of the ready-batch buffer, in bytes (at least 2 and at most 256 batches).
DEFAULT_BUFFER_BYTES = 32 << 20

_END = object()  # buffer marker: the feed ended


#: The last tfos error a feed reader raised into TensorFlow in this process (see
#: :func:`unwrap_tf_data_error`).
_raised_in_tf_data: list = []


def note_raised_in_tf_data(exc: BaseException) -> None:
    """Remembers ``exc``, raised by a tfos reader inside ``tf.data`` (TF process)."""
    _raised_in_tf_data[:] = [exc]


def unwrap_tf_data_error(exc: BaseException) -> Optional[BaseException]:
    """The tfos error behind a TensorFlow error, or None (TF process).

    ``tf.data`` re-raises an exception of a ``from_generator`` generator as a TensorFlow
    error (``InvalidArgumentError``, ``UnknownError``) whose message embeds the original's
    ``"<type>: <message>"``. When ``exc`` is such an error and the original was the last
    tfos error a reader of this process raised, that original is returned, so the node
    reports a ``MalformedRowError`` as itself rather than as TensorFlow's wrapper.
    """
    from tfos.errors import TFOSError

    if not _raised_in_tf_data or not type(exc).__module__.startswith("tensorflow"):
        return None
    orig = _raised_in_tf_data[0]
    if isinstance(orig, TFOSError) and f"{type(orig).__name__}: {orig}" in str(exc):
        return orig
    return None



class _EpochStart:
    """Buffer marker (``per_epoch``): the first rows of a later epoch arrived."""

    __slots__ = ("epoch",)

    def __init__(self, epoch: int):
        self.epoch = epoch




class FeedBatches:
    """Whole numpy batches from a node's feed, read ahead by a background thread (TF process).

    Args:
        feed: The node's :class:`~tfos.datafeed.DataFeed` in train mode. From the first
            iteration on, this object is its only reader (do not call ``next_batch``).
        batch_size: Rows per batch (>= 1). Under ``MultiWorkerMirroredStrategy`` this is
            the global batch (tf.distribute splits it over the replicas).
        columns: ``[(numpy dtype, row shape), ...]``, one per column of a row; a row shape
            ``()`` is a scalar and ``None`` is taken from the data (fixed within a batch).
        single: Rows are single values, not tuples; batches are then one array, not a
            tuple of arrays.
        per_epoch: Each iteration ends at the end of one epoch (see the module docstring);
            otherwise one iteration runs to the end of the feed.
        drop_remainder: Drop a batch shorter than ``batch_size`` (at the end of the feed,
            or of an epoch with ``per_epoch``).
        buffer_batches: Ready batches kept ahead of TensorFlow (default: about
            :data:`DEFAULT_BUFFER_BYTES` worth, 2 to 256 batches; when the row size is
            unknown, 8 batches and also at most :data:`DEFAULT_BUFFER_BYTES` of them, as
            counted by :func:`~tfos._data.chunk_columns.batch_bytes`, though always at least one batch).
        track_sums: Also keep per-epoch float64 sums of every numeric column in
            :attr:`sums` (a checksum of exactly what was handed to TensorFlow).
        steps_per_epoch: Cut every epoch of the feed into exactly this many batches
            (one iteration then runs over all epochs; see :mod:`tfos._data.epoch_steps`), so that
            every node agrees on the steps of every epoch. Excludes ``per_epoch`` and
            ``drop_remainder``.
        shuffle_rows: With ``steps_per_epoch``: a row-level shuffle window of this many
            rows (0: the fed order). Rows are drawn uniformly at random from a pool that
            holds at least this many rows of the current epoch (the window refills from
            every chunk, of whatever partition, as it arrives), so a batch mixes rows of
            several chunks and partitions; the pool empties at the end of each epoch, so
            batches never mix epochs and every epoch keeps exactly ``steps_per_epoch``
            batches. Costs one copy of every row and ``shuffle_rows`` rows of memory.
        shuffle_seed: Seed of the shuffle (None: a fresh one from the OS).

    Attributes:
        rows: ``{epoch: rows handed out}`` (a Counter), for exact-delivery checks.
        sums: ``{epoch: [sum of column 0, ...]}`` when ``track_sums``.
        wait_s: Seconds the consumer (TensorFlow) waited for a batch in total.
        first_wait_s: Seconds of ``wait_s`` spent waiting for the first batch.
        buffer_bytes: Bytes of the ready-batch buffer bound, including with
            ``steps_per_epoch`` the ``hold_batches`` held back at each epoch's end (0 when a
            row's size is unknown: then at most 8 batches and :data:`DEFAULT_BUFFER_BYTES`).
        hold_batches: With ``steps_per_epoch``: the last batches of each epoch, which are
            cut only once the epoch's end is known, to spread its remaining rows evenly.
        shuffle_rows: The row-level shuffle window (rows; 0: none).
        order: The :class:`~tfos._data.epoch_order.EpochOrder` the epoch-aware modes read through (None before
            the reader starts and in the other modes).

    Raises:
        ValueError: For ``batch_size`` < 1, no columns, a feed not in train mode,
            ``steps_per_epoch`` < 1 or with ``per_epoch``/``drop_remainder``,
            ``shuffle_rows`` < 0 or > 0 without ``steps_per_epoch``.
    """

    def __init__(
        self,
        feed: Any,
        batch_size: int,
        columns: Sequence[tuple[Any, Optional[tuple]]],
        single: bool = False,
        per_epoch: bool = False,
        drop_remainder: bool = False,
        buffer_batches: Optional[int] = None,
        track_sums: bool = False,
        steps_per_epoch: Optional[int] = None,
        shuffle_rows: int = 0,
        shuffle_seed: Optional[int] = None,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not columns:
            raise ValueError("at least one column is needed")
        if single and len(columns) != 1:
            raise ValueError("single=True needs exactly one column")
        if not getattr(feed, "train_mode", True):
            raise ValueError("the tf.data fast path reads train() feeds only; inference needs next_batch()/batch_results()")
        self._feed = feed
        self.batch_size = batch_size
        self._cols = [Column(d, s) for d, s in columns]
        self._single = single
        self.per_epoch = per_epoch
        self.drop_remainder = drop_remainder
        # A row's size is known when every column has a shape and a fixed-size dtype; a
        # string/bytes column (numpy object dtype: 8-byte references to values of any size)
        # leaves it unknown, and the buffer then holds 8 batches (256 batches of 8-byte
        # "rows" held 312 MB of 4 MB strings).
        sized = all(c.shape is not None and c.dtype.kind not in "OSUV" for c in self._cols)
        row_bytes = sum(c.dtype.itemsize * c.width for c in self._cols) if sized else 0
        #: Byte bound of the ready batches (None: the count bound says it all). Rows of
        #: unknown size are counted as they come (strings and bytes by their size).
        self._cap_bytes: Optional[int] = None
        if buffer_batches is None:
            per_batch = max(1, row_bytes * batch_size)
            buffer_batches = max(2, min(256, DEFAULT_BUFFER_BYTES // per_batch)) if row_bytes else 8
            if not row_bytes:
                self._cap_bytes = DEFAULT_BUFFER_BYTES
        if buffer_batches < 1:
            raise ValueError(f"buffer_batches must be >= 1, got {buffer_batches}")
        self.buffer_batches = int(buffer_batches)
        self.steps_per_epoch, self.shuffle_rows = check_steps(steps_per_epoch, shuffle_rows, per_epoch, drop_remainder)
        self._shuffle_seed = shuffle_seed
        self.hold_batches = 0 if steps_per_epoch is None else max(1, min(steps_per_epoch, self.buffer_batches // 2))
        self.buffer_bytes = row_bytes * (batch_size * (self.buffer_batches + 2 + self.hold_batches) + self.shuffle_rows)
        self.track_sums = track_sums
        self._out: queue.Queue = queue.Queue(maxsize=self.buffer_batches)
        self._held = 0  # bytes of the ready batches in _out (counted when _cap_bytes is set)
        self._held_cond = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self._closed = False
        self._ended = False
        self.rows: collections.Counter = collections.Counter()
        self.sums: dict[int, list[float]] = {}
        self.wait_s = 0.0
        self.first_wait_s = 0.0
        self._waited_first = False
        self.batches_out = 0
        #: The :class:`~tfos._data.epoch_order.EpochOrder` of the epoch-aware modes (None until the reader starts,
        #: and in the other modes): its ``waits``/``wait_s`` show held-back epochs.
        self.order: Optional[EpochOrder] = None
        self._epoch_feed = ""  # feed id of the chunks being read (see _epoch_of)
        self._epoch_base = 0
        self._last_epoch = -1  # the dataset epoch of the last feed job's last epoch (-1: not known)
        #: ``{dataset epoch: (feed id, epoch of that train() call)}``, for the row accounting.
        self.epoch_keys: dict[int, tuple[str, int]] = {}

    # ------------------------------------------------------------ reader thread
    def start(self) -> None:
        """Starts the reader thread (idempotent; the first iteration calls it)."""
        with self._lock:
            if self._thread is not None:
                return
            owner = getattr(self._feed, "_fast_reader", None)
            if owner is not None and owner is not self:
                raise TFOSError("this DataFeed is already read by another as_dataset()/FeedBatches; create one per feed")
            self._feed._fast_reader = self
            ROWS.reader(self)  # its ready batches, if main_fun returns without them (docs/datafeed.md "Row accounting")
            self._thread = threading.Thread(target=self._run, name="tfos-tfdata-reader", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stops the reader thread without reading further (TF process; idempotent)."""
        self._closed = True

    def _emit(self, item: Any) -> bool:
        size = 0
        if self._cap_bytes is not None and isinstance(item, tuple):
            size = batch_bytes(item[1])
            with self._held_cond:
                # at least one batch is always let through, however large
                while self._held and self._held + size > self._cap_bytes and not self._closed:
                    self._held_cond.wait(0.2)
                self._held += size
        while not self._closed:
            try:
                self._out.put((item, size), timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            if self.steps_per_epoch is not None:
                self._read_steps()
            else:
                self._read()
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, raised there
            self._emit(exc)

    def _epoch_of(self, conn: Any, current: Optional[int]) -> int:
        """The dataset's epoch of a chunk: its feed's epoch, counted on across train() calls.

        A chunk of another feed than the previous chunk's (the next call) starts the epoch
        after ``current`` (None: none yet), so ``train(data, 2)`` then ``train(data, 1)``
        make epochs 0, 1 and 2; "after" the previous call's last epoch as its feed header
        planned it (``last_epoch``), so a node that got no partition of those last epochs
        numbers the next call's epochs as every other node does.
        """
        if current is None or not conn.feed_id or conn.feed_id == self._epoch_feed:
            if current is None:
                self._epoch_feed, self._epoch_base = conn.feed_id, 0
        else:
            self._epoch_feed = conn.feed_id
            self._epoch_base = max(current, self._last_epoch) + 1 - conn.first_epoch
        if getattr(conn, "last_epoch", -1) >= 0:
            self._last_epoch = self._epoch_base + conn.last_epoch
        if getattr(conn, "mode", "") == "train":
            self.epoch_keys.setdefault(self._epoch_base + conn.epoch, (conn.feed_id, conn.epoch))  # row accounting
        return self._epoch_base + conn.epoch

    def _source(self) -> Any:
        """The item source of the reader: epoch-ordered in the epoch-aware modes."""
        if self.per_epoch or self.steps_per_epoch is not None:
            self.order = EpochOrder(self._feed, lambda: self._closed, max(2 * self.buffer_bytes, 2 * DEFAULT_BUFFER_BYTES))
            return self.order.next
        return self._feed._take

    def _chunks(self) -> Iterator[tuple]:
        """The reader's input: ``(conn, columns)`` of every non-empty chunk, in the order of
        :meth:`_source`, then ``(None, None)`` at the end of the feed (nothing once closed)."""
        feed = self._feed
        hub = feed._hub
        take_item = self._source()
        while not self._closed:
            item = take_item()
            if item is None:
                return  # closed
            if item is END_OF_FEED:
                feed.done_feeding = True
                yield None, None
                return
            if isinstance(item, PartitionEnd):
                feed._finish_partition(item.conn)
                continue
            if not isinstance(item, Chunk):
                continue
            conn = item.conn
            cols = self._decode(conn, item.payload)
            n = len(cols[0])
            if n == 0:
                continue
            conn.rows_taken += n
            hub.rows_taken += n
            yield conn, cols

    def _read(self) -> None:
        """Reader of the ``batch_size`` modes: full batches, a short one at an epoch's end
        with ``per_epoch``, or at the end of the feed."""
        import numpy as np

        size = self.batch_size
        parts: list[tuple] = []  # column tuples of the batch being assembled
        have = 0
        epoch: Optional[int] = None  # epoch of the rows in ``parts``

        def flush(final: bool) -> bool:
            # Short batches (final) are dropped by the consumer when drop_remainder.
            nonlocal parts, have
            if not parts:
                return True
            batch = parts[0] if len(parts) == 1 else tuple(np.concatenate(c) for c in zip(*parts))
            parts, have = [], 0
            return self._emit((epoch, batch))

        for conn, cols in self._chunks():
            if conn is None:
                flush(True)
                self._emit(_END)
                return
            n = len(cols[0])
            e = self._epoch_of(conn, epoch)
            if epoch is None:
                epoch = e
            elif e > epoch:
                # A later epoch starts: with per_epoch, the batch so far ends the epoch
                # (EpochOrder handed out every row of the earlier ones first; rows it gave
                # up waiting for, or rows outside per_epoch, go with the current epoch).
                # The marker ends the epoch's iteration at once, before a whole batch of
                # the next epoch has arrived.
                if self.per_epoch and not (flush(True) and self._emit(_EpochStart(e))):
                    return
                epoch = e
            start = 0
            while start < n:
                take = min(size - have, n - start)
                if start == 0 and take == n:
                    parts.append(cols)
                else:
                    parts.append(tuple(c[start : start + take] for c in cols))
                have += take
                start += take
                if have == size and not flush(False):
                    return

    def _read_steps(self) -> None:
        """Reader of the ``steps_per_epoch`` mode: exactly that many batches per epoch
        (see :mod:`tfos._data.epoch_steps`)."""
        assert self.steps_per_epoch is not None
        cut = EpochSteps(self.batch_size, self.steps_per_epoch, self.hold_batches, self._cols, self._emit,
                         self.shuffle_rows, self._shuffle_seed)
        for conn, cols in self._chunks():
            if conn is None:
                if cut.finish(self._last_epoch):
                    self._emit(_END)
                return
            if not cut.add(conn, cols, self._epoch_of(conn, cut.epoch if cut.started else None)):
                return

    def _decode(self, conn: Any, payload: Any) -> tuple:
        """One chunk -> one numpy array per column (``n`` rows each).

        Raises:
            InferenceResultError: The chunk is of ``cluster.inference()`` rows (this
                reader trains; it returns no results).
            MalformedRowError: A row does not fit the columns.
        """
        if conn.mode != "train":
            raise InferenceResultError(
                f"node {self._feed._hub.node_name}: partition {conn.partition} was fed by cluster.inference(), but "
                f"main_fun reads queue {self._feed.qname_in!r} with as_dataset(), which trains and returns no "
                "results; read inference rows with next_batch() and answer every batch with batch_results()"
            )
        return chunk_columns(conn, payload, self._cols, self._single)

    # ------------------------------------------------------------------ consumer
    def _next(self) -> Any:
        began = time.perf_counter()
        FIGURES.wait_begin("feed_wait")  # the driver's feed-wait share (docs/status.md)
        try:
            return self._next_item(began)
        finally:
            FIGURES.wait_end("feed_wait")

    def _next_item(self, began: float) -> Any:
        while True:
            try:
                item, size = self._out.get(timeout=1.0)
                if size:
                    with self._held_cond:
                        self._held -= size
                        self._held_cond.notify()
                break
            except queue.Empty:
                if self._ended:  # another iteration (e.g. tf.data's prefetch thread) took the end
                    return _END
                if self._thread is not None and not self._thread.is_alive() and self._out.empty():
                    raise TFOSError("the tf.data feed reader stopped without ending the feed") from None
        waited = time.perf_counter() - began
        self.wait_s += waited
        if not self._waited_first:
            self._waited_first = True
            self.first_wait_s = waited
        return item

    def __iter__(self) -> Iterator:
        """Yields numpy batches: one epoch with ``per_epoch``, else up to the end of the feed.

        Yields:
            A tuple of arrays (one per column, ``(n,) + row shape``; one array when ``single``).

        Raises:
            MalformedRowError: A row does not fit the columns (names partition and row).
            DeadlineExceededError: No data arrived within the feed's ``timeout_s``.
            FeedAbortedError: The driver aborted the cluster: the feed was cut off, not ended
                (batches handed out before stay handed out).
        """
        self.start()
        while not self._ended:
            item = self._next()
            if item is _END:
                self._ended = True
                return
            if isinstance(item, BaseException):
                self._ended = True
                note_raised_in_tf_data(item)
                raise item
            if isinstance(item, _EpochStart):
                if self.per_epoch:
                    return  # the next iteration reads the next epoch
                continue
            use_epoch, batch = item
            n = len(batch[0])
            if self.drop_remainder and n < self.batch_size:
                continue
            self.rows[use_epoch] += n
            if use_epoch in self.epoch_keys:
                ROWS.handed(*self.epoch_keys[use_epoch], n)  # docs/datafeed.md "Row accounting"
            if self.track_sums:
                _add_sums(self.sums, use_epoch, batch)
            self.batches_out += 1
            yield batch[0] if self._single else batch

    @property
    def ended(self) -> bool:
        """True once iterating ended for good (the end of the feed, or an error raised)."""
        return self._ended

    def dataset(self, output_signature: Any, prefetch: int = 2) -> Any:
        """A ``tf.data.Dataset`` over the batches (TF process).

        Each iteration of the dataset is one iteration of this object (one epoch with
        ``per_epoch``). Auto-sharding is off: each worker is fed its own partitions.

        Args:
            output_signature: The ``tf.TensorSpec`` (``single``) or tuple of them, with a
                leading ``None`` batch dimension.
            prefetch: Batches ``tf.data`` prefetches on top of this object's buffer.

        Returns:
            The dataset.
        """
        import tensorflow as tf

        ds = tf.data.Dataset.from_generator(self.__iter__, output_signature=output_signature)
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
        ds = ds.with_options(options)
        return ds.prefetch(prefetch) if prefetch else ds


def _add_sums(sums: dict[int, list[float]], epoch: int, batch: tuple) -> None:
    """Adds a batch's float64 column sums to ``sums[epoch]`` (numeric columns only)."""
    import numpy as np

    total = sums.setdefault(epoch, [0.0] * len(batch))
    for i, col in enumerate(batch):
        if col.dtype.kind in "biuf":
            total[i] += float(np.sum(col, dtype=np.float64))
