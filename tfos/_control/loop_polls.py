"""Long-polls on the control event loop: deferred answers subscribed to the cluster state's
change topics, answered when ready or at their deadline. See :mod:`tfos._control.loop`."""

from __future__ import annotations

import heapq
import time

from tfos._control.loop_parts import LoopState, _Conn, _Poll
from tfos._control.protocol import LongPoll


class LongPolls(LoopState):
    """The long-poll part of :class:`tfos._control.loop.EventLoop` (a mixin: it uses the
    loop's ``topics``, ``poll_heap``, ``dirty`` and its ``_answer``/``_close``/``reject``)."""

    def _start_poll(self, conn: _Conn, seq: int, lp: LongPoll) -> None:
        poll = _Poll(conn, seq, lp)
        for topic in lp.topics:  # subscribed before the first check: no change is missed
            self.topics.setdefault(topic, set()).add(poll)
        conn.polls.add(poll)
        if not self._check(poll):
            heapq.heappush(self.poll_heap, (time.monotonic() + max(0.0, lp.timeout_s), next(self._poll_ids), poll))

    def _check(self, poll: _Poll) -> bool:
        """Answers ``poll`` when it is ready; True once it is answered (or failed)."""
        try:
            reply = poll.lp.ready()
        except Exception as exc:  # noqa: BLE001 - a bug in one poll closes its connection only
            self._end_poll(poll)
            self.reject(poll.conn.peer, f"internal error in a long-poll: {exc!r}")
            self._close(poll.conn)
            return True
        if reply is None:
            return False
        self._end_poll(poll)
        self._answer(poll.conn, poll.seq, reply)
        return True

    def _end_poll(self, poll: _Poll) -> None:
        poll.done = True
        poll.conn.polls.discard(poll)
        for topic in poll.lp.topics:
            polls = self.topics.get(topic)
            if polls is not None:
                polls.discard(poll)
                if not polls:
                    del self.topics[topic]

    def _recheck(self) -> None:
        if not self.dirty:
            return
        with self._lock:
            dirty, self.dirty = self.dirty, set()
        seen: set[_Poll] = set()
        for topic in dirty:
            for poll in list(self.topics.get(topic, ())):
                if poll not in seen and not poll.done:
                    seen.add(poll)
                    self._check(poll)

    def _expire(self, now: float) -> None:
        heap = self.poll_heap
        while heap and heap[0][0] <= now:
            _, _, poll = heapq.heappop(heap)
            if poll.done:
                continue
            if self._check(poll):
                continue
            self._end_poll(poll)
            try:
                reply = poll.lp.expire()
            except Exception as exc:  # noqa: BLE001 - a bug in one poll closes its connection only
                self.reject(poll.conn.peer, f"internal error in a long-poll: {exc!r}")
                self._close(poll.conn)
                continue
            self._answer(poll.conn, poll.seq, reply)
