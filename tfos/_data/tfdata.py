"""The fast path from a node's feed queue into ``tf.data`` (runs in the TF process only).

:class:`FeedBatches` owns a node's :class:`~tfos.datafeed.DataFeed` once started: a
background thread takes whole chunks off the feed queue, turns each chunk into numpy
columns at once (no per-row Python on the Arrow path, one ``np.asarray`` stack per column
and chunk on the pickled path), cuts the columns into batches and keeps a bounded buffer
of ready batches. TensorFlow then only receives whole batches:

* :meth:`FeedBatches.dataset` is a ``tf.data.Dataset`` over them (``from_generator`` whose
  generator only hands over ready batches, followed by ``prefetch``);
* iterating the object itself gives the numpy batches (for custom loops; e.g. a
  ``ParameterServerStrategy`` coordinator could pass them to
  ``ClusterCoordinator.schedule``, since PSS datasets run on remote workers and cannot
  call back into this process, but tfos routes partitions to every chief/worker node, so
  fed PSS training is not supported yet).

Epochs: ``cluster.train(data, num_epochs)`` tags every partition with its epoch. With
``per_epoch=True`` each iteration over the dataset yields exactly one epoch (it ends as
soon as the first chunk of a later epoch arrives, or at the end of the feed); the reader
keeps reading ahead across epoch boundaries, so the next epoch is buffered before Keras
asks for it. One ``model.fit(ds, initial_epoch=e, epochs=e + 1)`` per epoch on the same
dataset trains every epoch exactly once (a single ``fit(epochs=n)`` only when all epochs
have the same number of steps: tf_keras infers them from the first epoch).

With ``steps_per_epoch=S`` instead, one iteration runs over all epochs and cuts each
epoch into exactly ``S`` batches on every node (see :meth:`FeedBatches._read_steps`), so
one ``model.fit(ds, epochs=n, steps_per_epoch=S)`` covers all epochs with one iterator:
no ``fit`` restart and no new iterator between epochs. All nodes must use the same
``S``; :func:`steps_per_epoch` derives it from the rows of one epoch.

Epoch order: Spark runs the feed job's tasks in an order of its choosing, so a node can
get the first chunk of epoch ``e + 1`` before the last partitions of epoch ``e`` (an
executor done with its own PROCESS_LOCAL partitions of epoch ``e`` runs those of ``e + 1``
while another executor still has partitions of ``e`` waiting; when the locality wait
expires, the first executor runs them too, after its ``e + 1`` ones). Both epoch-aware
modes read through :class:`EpochOrder`, which holds the later epoch back until the driver
says every partition of epoch ``e`` went to a node and this node read its own to the
end; so every epoch holds exactly the rows of one pass.

Memory bound of a node (bytes): the feed queue ``(queue_chunks + 2) x chunk bytes``
(see :mod:`tfos._data.feed_hub`), plus ``buffer_batches + 2`` batches here (the buffer, the
batch being assembled and the one the generator hands over), plus the ``prefetch``
batches of ``tf.data``, plus ``shuffle_rows`` rows with the row-level shuffle, plus, while
:class:`EpochOrder` holds a later epoch back, its chunks as received (at most
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

from tfos._control import messages as _msg
from tfos._data.columns import rows_to_columns
from tfos._data.feed_hub import END_OF_FEED, Chunk, PartitionEnd
from tfos._data.framing import ChunkKind, arrow_rows, decode_chunk
from tfos._node.figures import FIGURES
from tfos.errors import InferenceResultError, TFOSError

__all__ = ["FeedBatches", "EpochOrder", "feed_dataset", "steps_per_epoch", "DEFAULT_BUFFER_BYTES"]

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


def _nbytes(payload: Any) -> int:
    """Size of a chunk's payload as received (bytes)."""
    try:
        return len(payload) if not isinstance(payload, (list, tuple)) else sum(len(p) for p in payload)
    except TypeError:
        return 0


class EpochOrder:
    """A node's feed queue handed out epoch by epoch (TF process, the tf.data reader thread).

    :meth:`next` returns the queue's items (``Chunk``, ``PartitionEnd``, ``END_OF_FEED``)
    in queue order, except that the items of a later epoch of a ``train()`` feed wait
    until the epochs before it are complete on this node. When the first item of epoch
    ``t`` > the open epoch ``e`` arrives, it is held in memory; the items of epoch ``e``
    and earlier keep coming, and the driver is asked (``epoch_handover``, at once and then
    every 50-500 ms) whether every partition of the epochs ``e..t-1`` was handed to a node
    or skipped, and which ones this node got. Once all are settled and this node handed
    out the end of each of its own, the held items follow. A feed without a driver to ask
    (``hub.ask_driver`` None), or whose feed tasks send no feed id or epoch size, passes
    through unchanged.

    Feed tasks are never paused: the queue keeps being read, and a held partition whose
    end arrived is acknowledged at once (its rows are in this process, as for the reader's
    buffer), so its task ends and the executor goes on to the partitions Spark still has
    to run, the missing ones of epoch ``e`` among them. (Pausing them instead deadlocked
    when every executor core held a task of epoch ``t`` while Spark kept epoch ``e``'s
    remaining tasks for a busy executor.)

    Bounds: at most ``max_held_bytes`` of held chunks, and at most half of the connection's
    ``feed_timeout`` of waiting. Past either, a warning names the epoch and the held items
    go on, so that rows of the earlier epoch that arrive later count in the later one.

    Args:
        feed: The node's :class:`~tfos.datafeed.DataFeed` (its queue and hub).
        closed: Returns True once the reader was closed; :meth:`next` then returns None.
        max_held_bytes: Largest total size of held chunks (bytes, as received).

    Attributes:
        boundaries: Times a later epoch's first item arrived (the driver was asked).
        waits: Of those, the times the epochs before it were still incomplete at the first
            answer: a later epoch was really held back.
        wait_s: Seconds from the arrival of a later epoch's first item until it went on,
            in total (a boundary that was complete at once costs one request).
        peak_held_bytes: The most bytes of chunks held at once.
    """

    _POLL_S = (0.05, 0.5)  # first and longest interval between two driver queries

    def __init__(self, feed: Any, closed: Any = lambda: False, max_held_bytes: int = 2 * (32 << 20)):
        self._feed = feed
        self._hub = feed._hub
        self._closed = closed
        self._pending: collections.deque = collections.deque()  # later-epoch items held, in queue order
        self.max_held_bytes = max_held_bytes
        self._held_bytes = 0
        self.peak_held_bytes = 0
        self._feed_id = ""
        self._open = 0  # the open epoch of ``_feed_id``
        self._first = 0
        self._finished: set[int] = set()  # job indices of ``_feed_id`` whose end was handed out
        self._target: Optional[int] = None  # while holding: the earliest epoch held back
        self._draining = False  # the feed ended: held items go out in epoch order
        self.boundaries = 0
        self.waits = 0
        self.wait_s = 0.0
        self._asked = False  # the current hold asked the driver once already

    def _tracked(self, item: Any) -> Any:
        """The connection of a train() item that epoch order applies to, else None."""
        if not isinstance(item, (Chunk, PartitionEnd)):
            return None
        conn = item.conn
        if conn.mode != "train" or not conn.feed_id or conn.parts_per_epoch <= 0 or conn.index < 0 or self._hub.ask_driver is None:
            return None
        return conn

    def _adopt(self, item: Any) -> None:
        """A fresh item of another feed (the next train() call) opens that feed's first
        epoch, unless items are held (they are handed out first)."""
        conn = self._tracked(item)
        if conn is not None and conn.feed_id != self._feed_id and self._target is None and not self._pending:
            self._switch(conn)

    def _switch(self, conn: Any) -> None:
        self._feed_id, self._first, self._open = conn.feed_id, conn.first_epoch, conn.first_epoch
        self._finished = set()

    def _newer_feed(self, item: Any) -> bool:
        """True for an item of another feed than the open one (the next train() call)."""
        conn = self._tracked(item)
        return conn is not None and bool(self._feed_id) and conn.feed_id != self._feed_id

    def _holds_open_feed(self) -> bool:
        """True while items of the open feed are held."""
        return any((c := self._tracked(i)) is not None and c.feed_id == self._feed_id for i in self._pending)

    def _later(self, item: Any) -> Optional[int]:
        """The epoch of an item of the open feed that is later than the open epoch, else None."""
        conn = self._tracked(item)
        if conn is None or conn.feed_id != self._feed_id or conn.epoch <= self._open:
            return None
        return conn.epoch

    def _note(self, item: Any) -> Any:
        """Records an item handed out (partition ends read here; the open epoch)."""
        conn = self._tracked(item)
        if conn is not None and conn.feed_id == self._feed_id:
            if isinstance(item, PartitionEnd):
                self._finished.add(conn.index)
            self._open = max(self._open, conn.epoch)  # only after a give-up or the end of the feed
        return item

    def _keep(self, item: Any) -> None:
        """Holds a later-epoch item; acknowledges a held partition end at once."""
        self._pending.append(item)
        if isinstance(item, Chunk):
            self._held_bytes += _nbytes(item.payload)
            self.peak_held_bytes = max(self.peak_held_bytes, self._held_bytes)
        elif isinstance(item, PartitionEnd):
            self._feed._finish_partition(item.conn)  # the task may end: see the class doc

    def _ready(self) -> Any:
        """Removes and returns the first held item that may go now, else None."""
        if self._draining:
            item = self._pending.popleft()
        else:
            behind: Optional[bool] = None  # whether the next call's items must still wait
            for i, item in enumerate(self._pending):
                if self._newer_feed(item):
                    # The next train() call's items follow every held item of this one.
                    if behind is None:
                        behind = self._target is not None or self._holds_open_feed()
                    if behind:
                        continue
                    del self._pending[i]
                    self._switch(item.conn)
                    break
                if self._later(item) is None:
                    del self._pending[i]
                    break
            else:
                return None
        if isinstance(item, Chunk):
            self._held_bytes -= _nbytes(item.payload)
        return item

    def next(self) -> Any:
        """The next item (blocks like ``DataFeed._take``); None once ``closed()``.

        Raises:
            FeedAbortedError: The cluster aborted.
            DeadlineExceededError: No item within the feed's ``timeout_s``.
        """
        while not self._closed():
            if self._pending:
                item = self._ready()
                if item is not None:
                    if not self._pending:
                        self._draining = False
                    return self._note(item)
                if self._target is None:
                    self._hold()
            if self._target is not None:
                if self._settled():
                    self._release()
                    continue
                item = self._poll(min(self._next_ask - time.monotonic(), 0.2))
                if item is None:
                    continue
            else:
                item = self._feed._take()
            self._adopt(item)
            if item is END_OF_FEED and self._pending:
                # No connection is reading any more: every partition came in. Hand out
                # what is held in epoch order (stable), then the end.
                self._pending.append(item)
                if self._target is not None:
                    self._release()
                self._pending = collections.deque(sorted(self._pending, key=self._end_order))
                self._draining = True
                continue
            epoch = self._later(item)
            if epoch is not None:
                self._keep(item)
                if self._target is not None and epoch < self._target:
                    self._target = epoch  # an earlier later epoch: wait for the epochs before it
                continue
            if self._pending and self._newer_feed(item):
                # The next train() call started while this one's later epoch is held (its
                # hold ends at the driver's next answer): its items wait behind.
                self._keep(item)
                continue
            return self._note(item)
        return None

    def _end_order(self, item: Any) -> float:
        conn = self._tracked(item)
        return conn.epoch if conn is not None and conn.feed_id == self._feed_id else float("inf")

    def _hold(self) -> None:
        later = [(e, item.conn) for item in self._pending if (e := self._later(item)) is not None]
        epoch, conn = min(later, key=lambda ec: ec[0])
        self._target = epoch
        self._parts = conn.parts_per_epoch
        self._since = time.monotonic()
        self._until = self._since + conn.feed_timeout_s / 2
        self._interval = self._POLL_S[0]
        self._next_ask = self._since  # ask at once: usually every partition went out already
        self._asked = False

    def _release(self) -> None:
        assert self._target is not None
        self.wait_s += time.monotonic() - self._since
        self._open = max(self._open, self._target)
        self._target = None

    def _settled(self) -> bool:
        """Asks the driver when due; True once epochs ``open..target-1`` are complete here,
        or when a bound of the wait is reached (with a warning)."""
        now = time.monotonic()
        if now < self._next_ask and self._held_bytes <= self.max_held_bytes:
            return False
        assert self._target is not None
        lo = (self._open - self._first) * self._parts
        hi = (self._target - self._first) * self._parts
        try:
            ans = self._hub.ask_driver(_msg.EpochHandover(feed_id=self._feed_id, lo=lo, hi=hi, node=self._hub.node_name))
            if "error" in ans:
                raise TFOSError(str(ans["error"]))
            settled, mine = int(ans["settled"]), {int(i) for i in ans["mine"]}
        except Exception as exc:  # noqa: BLE001 - the driver is reached again at the next poll
            log.debug("node %s: epoch_handover query failed: %s", self._hub.node_name, exc)
            settled, mine = -1, set()
        complete = settled == hi - lo and mine <= self._finished
        if not self._asked:
            self._asked = True
            self.boundaries += 1
            if not complete:
                self.waits += 1
        if complete:
            return True
        over = self._held_bytes > self.max_held_bytes
        if now >= self._until or over:
            missing = sorted(mine - self._finished)
            log.warning(
                "node %s: epoch %d of the feed is still incomplete after %.1f s%s (%s); handing out epoch %d now, so "
                "rows of epoch %d that arrive later count in epoch %d", self._hub.node_name, self._target - 1,
                now - self._since,
                f" with {self._held_bytes:,} bytes of later epochs held (max_held_bytes {self.max_held_bytes:,})" if over else "",
                (f"{hi - lo - settled} of its partitions not yet handed to any node" if settled >= 0 and settled < hi - lo
                 else f"partitions {missing} sent here not yet read to the end" if missing else "the driver did not answer"),
                self._target, self._target - 1, self._target)
            return True
        self._next_ask = now + self._interval
        self._interval = min(self._interval * 2, self._POLL_S[1])
        return False

    def _poll(self, timeout_s: float) -> Any:
        """One item from the queue within ``timeout_s`` (>= 0), or None."""
        feed = self._feed
        if self._hub.aborted:
            feed._raise_aborted()
        if feed._peeked is not None:
            item, feed._peeked = feed._peeked, None
            return item
        try:
            item = feed._q.get(timeout=max(timeout_s, 0.001))
        except queue.Empty:
            item = None
        if self._hub.aborted:
            feed._raise_aborted()
        if item is None and feed.qname_in in self._hub.terminated:
            return END_OF_FEED
        return item


class _EpochStart:
    """Buffer marker (``per_epoch``): the first rows of a later epoch arrived."""

    __slots__ = ("epoch",)

    def __init__(self, epoch: int):
        self.epoch = epoch


class _Column:
    __slots__ = ("dtype", "shape", "width")

    def __init__(self, dtype: Any, shape: Optional[tuple]):
        import numpy as np

        self.dtype = np.dtype(dtype)
        self.shape = None if shape is None else tuple(int(d) for d in shape)
        width = 1
        for d in self.shape or ():
            width *= d
        self.width = width


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
            counted by :func:`_batch_bytes`, though always at least one batch).
        track_sums: Also keep per-epoch float64 sums of every numeric column in
            :attr:`sums` (a checksum of exactly what was handed to TensorFlow).
        steps_per_epoch: Cut every epoch of the feed into exactly this many batches
            (one iteration then runs over all epochs; see :meth:`_read_steps`), so that
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
        buffer_bytes: Bytes of the ready-batch buffer bound (0 when a row shape is unknown,
            or a column holds strings or bytes, whose size only the data tells: then the
            buffer holds at most 8 batches and at most :data:`DEFAULT_BUFFER_BYTES` of
            them, or one larger batch);
            with ``steps_per_epoch`` it includes the ``hold_batches`` batches held back
            at the end of each epoch (not a node's surplus over ``steps_per_epoch x
            batch_size`` rows in an epoch, which is held too).
        hold_batches: With ``steps_per_epoch``: the last batches of each epoch, which are
            cut only once the epoch's end is known, to spread its remaining rows evenly.
        shuffle_rows: The row-level shuffle window (rows; 0: none).
        order: The :class:`EpochOrder` the epoch-aware modes read through (None before
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
        self._cols = [_Column(d, s) for d, s in columns]
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
        if steps_per_epoch is not None:
            if isinstance(steps_per_epoch, bool) or int(steps_per_epoch) != steps_per_epoch or steps_per_epoch < 1:
                raise ValueError(f"steps_per_epoch must be an integer >= 1, got {steps_per_epoch!r}")
            if per_epoch or drop_remainder:
                raise ValueError("steps_per_epoch cuts every epoch into a fixed number of batches; "
                                 "it excludes per_epoch=True and drop_remainder=True")
            steps_per_epoch = int(steps_per_epoch)
        self.steps_per_epoch = steps_per_epoch
        if isinstance(shuffle_rows, bool) or int(shuffle_rows) != shuffle_rows or shuffle_rows < 0:
            raise ValueError(f"shuffle_rows must be an integer >= 0, got {shuffle_rows!r}")
        if shuffle_rows and steps_per_epoch is None:
            raise ValueError("shuffle_rows needs steps_per_epoch (without it, shuffle on the TF side: "
                             "ds.unbatch().shuffle(rows).batch(batch_size))")
        self.shuffle_rows = int(shuffle_rows)
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
        #: The :class:`EpochOrder` of the epoch-aware modes (None until the reader starts,
        #: and in the other modes): its ``waits``/``wait_s`` show held-back epochs.
        self.order: Optional[EpochOrder] = None
        self._epoch_feed = ""  # feed id of the chunks being read (see _epoch_of)
        self._epoch_base = 0
        self._last_epoch = -1  # the dataset epoch of the last feed job's last epoch (-1: not known)

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
            self._thread = threading.Thread(target=self._run, name="tfos-tfdata-reader", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stops the reader thread without reading further (TF process; idempotent)."""
        self._closed = True

    def _emit(self, item: Any) -> bool:
        size = 0
        if self._cap_bytes is not None and isinstance(item, tuple):
            size = _batch_bytes(item[1])
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

        Each ``train()`` call numbers its epochs from 0 (a resumed feed from its
        ``first_epoch``); a chunk of another feed than the previous chunk's (the next
        call) starts the epoch after ``current``, the epoch being read (None: none yet),
        so that ``train(data, 2)`` then ``train(data, 1)`` make epochs 0, 1 and 2. The
        epoch after the previous call is its last epoch as the feed header planned it
        (``last_epoch``), not the last one this node read: a node that got no partition
        of the previous call's last epochs (Spark ran them all on another executor) still
        numbers the next call's first epoch after them, as every other node does.
        """
        if current is None or not conn.feed_id or conn.feed_id == self._epoch_feed:
            if current is None:
                self._epoch_feed, self._epoch_base = conn.feed_id, 0
        else:
            self._epoch_feed = conn.feed_id
            self._epoch_base = max(current, self._last_epoch) + 1 - conn.first_epoch
        if getattr(conn, "last_epoch", -1) >= 0:
            self._last_epoch = self._epoch_base + conn.last_epoch
        return self._epoch_base + conn.epoch

    def _source(self) -> Any:
        """The item source of the reader: epoch-ordered in the epoch-aware modes."""
        if self.per_epoch or self.steps_per_epoch is not None:
            self.order = EpochOrder(self._feed, lambda: self._closed, max(2 * self.buffer_bytes, 2 * DEFAULT_BUFFER_BYTES))
            return self.order.next
        return self._feed._take

    def _read(self) -> None:
        import numpy as np

        feed = self._feed
        hub = feed._hub
        size = self.batch_size
        parts: list[tuple] = []  # column tuples of the batch being assembled
        have = 0
        epoch: Optional[int] = None  # epoch of the rows in ``parts``
        take_item = self._source()

        def flush(final: bool) -> bool:
            # Short batches (final) are dropped by the consumer when drop_remainder.
            nonlocal parts, have
            if not parts:
                return True
            batch = parts[0] if len(parts) == 1 else tuple(np.concatenate(c) for c in zip(*parts))
            parts, have = [], 0
            return self._emit((epoch, batch))

        while not self._closed:
            item = take_item()
            if item is None:
                return  # closed
            if item is END_OF_FEED:
                feed.done_feeding = True
                flush(True)
                self._emit(_END)
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
        """Reader of the ``steps_per_epoch`` mode: exactly that many batches per epoch.

        Epoch ``e`` of the feed becomes ``S = steps_per_epoch`` batches, handed out in
        order, so every node's dataset has the same steps in every epoch whatever share
        of the partitions Spark gave it. The first ``S - hold_batches`` batches hold
        ``batch_size`` rows; the rows of the epoch after them are held back until the
        epoch's end is known (the first chunk of a later epoch, or the end of the feed)
        and then spread evenly over the epoch's remaining batches: fewer than
        ``batch_size`` rows each (down to empty batches) when the node got fewer than ``S
        x batch_size`` rows in the epoch, more when it got more. An epoch without rows on
        this node is ``S`` empty batches. Epochs are counted from the feed job's first
        epoch (a restarted ``train()`` resumes its feed at epoch ``c > 0``: the dataset
        then holds ``S`` batches for each of the epochs ``c..n-1``, as a ``fit`` resumed
        after ``c`` checkpointed epochs expects). At the end of the feed the current epoch is
        completed, and so is every later epoch of the last feed job this node got rows of
        (its feed header names the job's last epoch): ``S`` empty batches each. A node that
        got no row at all of a later ``train()`` call cannot know that call's epochs.

        With ``shuffle_rows = W`` the epoch's rows go into a :class:`_RowPool` instead and
        each batch is drawn from it at random: the first ``S - hold_batches`` batches once
        ``W + batch_size`` rows are pooled (so at least ``W`` rows remain to draw from),
        the held ones at the epoch's end as above.
        """
        import numpy as np

        feed = self._feed
        hub = feed._hub
        size = self.batch_size
        steps = self.steps_per_epoch
        assert steps is not None
        free = steps - self.hold_batches  # batches of an epoch cut before its end is known
        held: collections.deque = collections.deque()  # column tuples of `epoch`, not yet handed out
        have = 0
        epoch = 0
        started = False  # `epoch` set to the feed job's first epoch (from the first chunk)
        emitted = 0  # batches of `epoch` handed out
        empty: Optional[tuple] = None  # zero-row columns with the data's row shapes
        window = self.shuffle_rows
        pool = _RowPool(np.random.default_rng(self._shuffle_seed)) if window else None
        take_item = self._source()

        def take(n: int) -> bool:
            nonlocal have, emitted
            if pool is not None:
                have -= n
                emitted += 1
                drawn = pool.take(n)
                batch = drawn if drawn is not None else empty if empty is not None else tuple(
                    np.empty((0,) + (c.shape or ()), c.dtype) for c in self._cols)
                return self._emit((epoch, batch))
            pieces: list[tuple] = []
            got = 0
            while got < n:
                piece = held[0]
                m = len(piece[0])
                if m <= n - got:
                    pieces.append(held.popleft())
                    got += m
                else:
                    cut = n - got
                    pieces.append(tuple(c[:cut] for c in piece))
                    held[0] = tuple(c[cut:] for c in piece)
                    got += cut
            have -= n
            emitted += 1
            if not pieces:
                batch = empty if empty is not None else tuple(
                    np.empty((0,) + (c.shape or ()), c.dtype) for c in self._cols)
            elif len(pieces) == 1:
                batch = pieces[0]
            else:
                batch = tuple(np.concatenate(c) for c in zip(*pieces))
            return self._emit((epoch, batch))

        def close_epoch() -> bool:
            # The end of `epoch` is known: spread its held rows over its remaining batches.
            nonlocal epoch, emitted
            while emitted < steps:
                left = steps - emitted
                if not take(-(-have // left)):
                    return False
            epoch += 1
            emitted = 0
            return True

        while not self._closed:
            item = take_item()
            if item is None:
                return  # closed
            if item is END_OF_FEED:
                feed.done_feeding = True
                # The current epoch, then any later epoch of the last feed job this node
                # saw rows of, that brought it no row (S empty batches each).
                if not close_epoch():
                    return
                while started and epoch <= self._last_epoch:
                    if not close_epoch():
                        return
                self._emit(_END)
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
            if empty is None:
                empty = tuple(c[:0] for c in cols)
            e = self._epoch_of(conn, epoch if started else None)
            if not started:
                # A feed resumed after a restart starts at its first epoch, not at 0.
                started = True
                epoch = conn.first_epoch
            # A later epoch starts (or the next train() call's first one): the epochs
            # before it are complete on this node (EpochOrder handed out their rows first;
            # rows of an earlier epoch that it gave up waiting for count with the current
            # one, after a warning).
            while e > epoch:
                if not close_epoch():
                    return
            if pool is not None:
                pool.add(cols, conn)
            else:
                held.append(cols)
            have += n
            while emitted < free and have >= size + window:
                if not take(size):
                    return

    def _decode(self, conn: Any, payload: Any) -> tuple:
        """One chunk -> one numpy array per column (``n`` rows each).

        Raises:
            InferenceResultError: The chunk is of ``cluster.inference()`` rows (this
                reader trains; it returns no results).
        """
        if conn.mode != "train":
            raise InferenceResultError(
                f"node {self._feed._hub.node_name}: partition {conn.partition} was fed by cluster.inference(), but "
                f"main_fun reads queue {self._feed.qname_in!r} with as_dataset(), which trains and returns no "
                "results; read inference rows with next_batch() and answer every batch with batch_results()"
            )
        origins = [(0, conn.partition, conn.epoch, conn.rows_taken)]
        if conn.kind is ChunkKind.ARROW:
            cols = self._arrow_columns(payload)
            if cols is not None:
                return cols
            rows = arrow_rows(payload)
        else:
            rows = decode_chunk(conn.kind, payload)
        return self._row_columns(rows, origins)

    def _row_columns(self, rows: list, origins: list) -> tuple:
        # Rows decoded from an Arrow chunk are already tuples of columns, with the column
        # names for error messages, also for a single TensorSpec; only the single values of
        # an RDD feed are wrapped (docs/datafeed.md "DataFrames").
        from tfos._data.framing import ArrowRows

        spec = [(c.dtype, c.shape) for c in self._cols]
        if self._single and not isinstance(rows, ArrowRows):
            return rows_to_columns([(r,) for r in rows], spec, origins)
        return rows_to_columns(rows, spec, origins)

    def _arrow_columns(self, payload: Any) -> Optional[tuple]:
        """Numpy views of an Arrow chunk's columns, or None when the slow path must decode it.

        Numeric columns and list columns whose lists all have the row's size become
        zero-copy views of the received buffer (cast only when the dtype differs).
        """
        import pyarrow as pa

        from tfos._data.framing import _numeric_view, arrow_ndarray, arrow_vector_ndarray

        batches = list(pa.ipc.open_stream(pa.py_buffer(payload)))
        if len(batches) != 1 or batches[0].num_columns != len(self._cols):
            return None
        batch = batches[0]
        n = batch.num_rows
        out: list = []
        for arr, col in zip(batch.columns, self._cols):
            t = arr.type
            if pa.types.is_integer(t) or pa.types.is_floating(t):
                if col.shape not in ((), None):
                    return None
                view = _numeric_view(arr, 0, n)
            elif pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
                if arr.null_count or col.shape is None or len(col.shape) < 1:
                    return None
                view = _list_view(arr, n, col.width)
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
            A tuple of arrays (one per column, ``(n,) + row shape``), or one array when
            ``single``; ``n`` is ``batch_size`` except for the last batch.

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
            if self.track_sums:
                self._add_sums(use_epoch, batch)
            self.batches_out += 1
            yield batch[0] if self._single else batch

    def _add_sums(self, epoch: int, batch: tuple) -> None:
        import numpy as np

        sums = self.sums.setdefault(epoch, [0.0] * len(batch))
        for i, col in enumerate(batch):
            if col.dtype.kind in "biuf":
                sums[i] += float(np.sum(col, dtype=np.float64))

    @property
    def ended(self) -> bool:
        """True once iterating ended for good: the end of the feed was handed out, or an
        error (e.g. FeedAbortedError) was raised."""
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


class _RowPool:
    """The rows of one epoch held for the row-level shuffle (reader thread of FeedBatches).

    Rows are copied into preallocated numpy columns (grown by doubling, never shrunk);
    :meth:`take` draws ``k`` rows uniformly at random without replacement and moves the
    pool's last rows into the holes, so a draw costs ``O(k)`` rows whatever the pool holds.
    """

    def __init__(self, rng: Any):
        self._rng = rng
        self._cols: Optional[list] = None
        self.n = 0

    def add(self, cols: tuple, conn: Any) -> None:
        """Appends a chunk's columns (copied).

        Raises:
            MalformedRowError: A column's row shape differs from the pooled rows'.
        """
        import numpy as np

        from tfos.errors import MalformedRowError

        m = len(cols[0])
        if self._cols is None:
            self._cols = [np.empty((max(m, 1024),) + c.shape[1:], c.dtype) for c in cols]
        for i, (dst, src) in enumerate(zip(self._cols, cols)):
            if src.shape[1:] != dst.shape[1:]:
                raise MalformedRowError(
                    f"partition {conn.partition} (epoch {conn.epoch}): column {i}: rows of shape "
                    f"{src.shape[1:]} cannot be shuffled with rows of shape {dst.shape[1:]} "
                    f"(shuffle_rows needs one row shape per column)")
        need = self.n + m
        if need > len(self._cols[0]):
            cap = max(need, 2 * len(self._cols[0]))
            grown = []
            for c in self._cols:
                g = np.empty((cap,) + c.shape[1:], c.dtype)
                g[: self.n] = c[: self.n]
                grown.append(g)
            self._cols = grown
        for dst, src in zip(self._cols, cols):
            dst[self.n : need] = src
        self.n = need

    def take(self, k: int) -> Optional[tuple]:
        """``k`` (<= held) random rows as new arrays, in random order; None when nothing was pooled yet."""
        import numpy as np

        if self._cols is None:
            return None
        n = self.n
        if k == 0:
            return tuple(c[:0].copy() for c in self._cols)
        idx = self._rng.choice(n, size=k, replace=False)
        out = tuple(c[idx] for c in self._cols)
        rest = n - k
        holes = idx[idx < rest]
        if len(holes):
            keep = np.ones(k, bool)
            keep[idx[idx >= rest] - rest] = False
            sources = np.arange(rest, n)[keep]
            for c in self._cols:
                c[holes] = c[sources]
        self.n = rest
        return out


def _batch_bytes(batch: tuple) -> int:
    """Bytes a ready batch holds: its arrays' buffers, plus the objects an object column
    refers to (strings, bytes, arrays; ``sys.getsizeof`` each) (reader thread)."""
    import sys

    total = 0
    for col in batch:
        total += col.nbytes
        if col.dtype.kind == "O":
            total += sum(map(sys.getsizeof, col.ravel()))
    return total


def _list_view(arr: Any, n: int, width: int) -> Any:
    """A zero-copy ``(n, width)`` numpy view of an Arrow list column whose lists all hold
    ``width`` numbers, or None (other lengths, nulls or non-numeric values; pure)."""
    import pyarrow as pa

    from tfos._data.framing import _equal_steps, _numeric_view

    if pa.types.is_fixed_size_list(arr.type):
        if arr.type.list_size != width:
            return None
        start = arr.offset * width
    else:
        offsets = _numeric_view(arr.offsets, 0, n + 1)
        if offsets is None or (n and (int(offsets[1] - offsets[0]) != width or not _equal_steps(offsets))):
            return None
        start = int(offsets[0])
    values = arr.values
    if values.null_count:
        return None
    flat = _numeric_view(values, start, start + n * width)
    return None if flat is None else flat.reshape(n, width)


def _specs(output_signature: Any) -> tuple:
    """The TensorSpecs of ``output_signature`` (one spec or a tuple of them), as a tuple."""
    import tensorflow as tf

    return (output_signature,) if isinstance(output_signature, tf.TensorSpec) else tuple(output_signature)


def _check_batch_dims(output_signature: Any, batch_size: int) -> None:
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


def feed_dataset(
    feed: Any,
    batch_size: int,
    output_signature: Any,
    drop_remainder: bool = False,
    per_epoch: bool = False,
    prefetch: int = 2,
    buffer_batches: Optional[int] = None,
    steps_per_epoch: Optional[int] = None,
    shuffle_rows: int = 0,
    shuffle_seed: Optional[int] = None,
) -> Any:
    """``DataFeed`` -> ``tf.data.Dataset`` of whole batches (TF process).

    See :meth:`tfos.datafeed.DataFeed.as_dataset` for the arguments; the dataset keeps its
    :class:`FeedBatches` as ``dataset.tfos_batches`` (row counts per epoch).

    Raises:
        TypeError: When ``output_signature`` is not a TensorSpec or tuple of them.
        ValueError: A spec without the leading batch dimension (a per-row shape such as
            ``TensorSpec(())``), or whose first dimension is fixed to another size than
            ``batch_size``.
    """
    columns, single = columns_of(output_signature)
    _check_batch_dims(output_signature, batch_size)
    reader = FeedBatches(feed, batch_size, columns, single=single, per_epoch=per_epoch,
                         drop_remainder=drop_remainder, buffer_batches=buffer_batches,
                         steps_per_epoch=steps_per_epoch, shuffle_rows=shuffle_rows, shuffle_seed=shuffle_seed)
    ds = reader.dataset(output_signature, prefetch)
    ds.tfos_batches = reader
    return ds



def steps_per_epoch(rows_per_epoch: int, batch_size: int, num_nodes: int) -> int:
    """Steps of one epoch that every fed node agrees on (pure; anywhere).

    ``ceil(rows_per_epoch / (batch_size x num_nodes))``: the steps of an epoch when the
    rows are spread evenly over the nodes, each node taking ``batch_size`` rows per step.

    Args:
        rows_per_epoch: Rows of one epoch over all nodes (e.g. ``data.count()`` on the
            driver, passed to ``main_fun`` in its args).
        batch_size: Rows per step on one node (the per-worker batch).
        num_nodes: Nodes fed (the workers of ``MultiWorkerMirroredStrategy``).

    Returns:
        The steps (>= 1).

    Raises:
        ValueError: For ``rows_per_epoch`` < 1, ``batch_size`` < 1 or ``num_nodes`` < 1.
    """
    if rows_per_epoch < 1 or batch_size < 1 or num_nodes < 1:
        raise ValueError(f"rows_per_epoch, batch_size and num_nodes must be >= 1, got "
                         f"{rows_per_epoch}, {batch_size}, {num_nodes}")
    return -(-int(rows_per_epoch) // (int(batch_size) * int(num_nodes)))
