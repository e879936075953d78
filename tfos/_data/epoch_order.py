"""A node's train() feed handed out epoch by epoch (TF process, the tf.data reader thread).

Spark runs the feed job's tasks in an order of its choosing, so a node can get the first
chunk of epoch ``e + 1`` before the last partitions of epoch ``e`` (an executor done with
its own PROCESS_LOCAL partitions of epoch ``e`` runs those of ``e + 1`` while another
executor still has partitions of ``e`` waiting; when the locality wait expires, the first
executor runs them too, after its ``e + 1`` ones). The epoch-aware readers of
:mod:`tfos._data.tfdata` read through :class:`EpochOrder`, which holds the later epoch back
until the driver says every partition of epoch ``e`` went to a node and this node read its
own to the end; so every epoch holds exactly the rows of one pass.
"""

from __future__ import annotations

import collections
import logging
import queue
import time
from typing import Any, Optional

from tfos._control import messages as _msg
from tfos._data.feed_connection import END_OF_FEED, Chunk, PartitionEnd
from tfos.errors import TFOSError

__all__ = ["EpochOrder"]

log = logging.getLogger(__name__)


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
