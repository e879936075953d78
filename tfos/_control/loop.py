"""The control server's event loop (driver, or the control host under Spark Connect).

One thread serves every connection of a :class:`tfos._control.server.ControlServer`
(:mod:`selectors`: epoll on Linux): it accepts within the caps, reads frames with
:class:`tfos._control.protocol.FrameReader`, checks each connection's nonces and sequence
numbers (:class:`tfos._control.protocol.ServerSession`), runs the handlers that do not
block, hands the others to a bounded thread pool, keeps long-polls as deferred answers
woken by the cluster state's change topics, writes the answers without blocking, and
enforces the deadlines (first frame, finishing a started frame, idle, unread answers).
See :mod:`tfos._control.server` for the rules it enforces.
"""

from __future__ import annotations

import collections
import itertools
import logging
import selectors
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Hashable, Iterable, Optional, Union

from tfos._common import wire as _wire
from tfos._common.admission import PROOF_BYTES, Admission, FloodStats, ProofChecker, RejectLog
from tfos._control.accept_queue import QueueWatch
from tfos._control.limits import ControlLimits
from tfos._control.loop_accept import Accepting
from tfos._control.loop_parts import LoopState, Timeouts, _Conn, _malformed, _Poll, _Reject, _run_call
from tfos._control.loop_polls import LongPolls
from tfos._control.protocol import PROOF_MAGIC, Call, LongPoll, is_routes
from tfos.errors import ControlProtocolError

__all__ = ["Timeouts", "EventLoop"]

log = logging.getLogger(__name__)

#: Largest amount of answers, in bytes, kept for one peer that does not read them.
_MAX_OUT_BYTES = 4 * _wire.MAX_CONTROL_FRAME_BYTES
#: Seconds between two checks of the frame deadlines.
_SWEEP_S = 0.25
#: Seconds between two checks for idle and stalled connections.
_IDLE_SWEEP_S = 5.0


class Dispatching(LoopState):
    """The dispatching part of :class:`EventLoop`: a request checked by its session goes to
    its handler, on the loop thread or the bounded pool, and the result comes back as an
    answer, a long-poll or a rejection."""

    def _request(self, conn: _Conn, body: dict) -> None:
        try:
            seq = conn.session.accept(body)
        except ControlProtocolError as exc:
            self.reject(conn.peer, str(exc))
            self._close(conn)
            return
        if seq == 1:
            self.pending.pop(conn, None)
            conn.reader.max_bytes = _wire.MAX_CONTROL_FRAME_BYTES
        conn.frame_since = None
        self.partial.discard(conn)
        self.frames_in += 1
        conn.inflight += 1
        if body.get("type") == "hi":  # a client's small first frame (see MAX_FIRST_FRAME_BYTES)
            self._answer(conn, seq, {"type": "hi"})
            return
        try:
            call = self.prepare(body, conn.peer)
        except ControlProtocolError as exc:
            self.reject(conn.peer, str(exc))
            self._close(conn)
            return
        except Exception as exc:  # noqa: BLE001 - a malformed message from a key holder
            self.reject(conn.peer, _malformed(body, exc))
            self._close(conn)
            return
        if call.offload:
            try:
                self.pool.submit(self._pooled, conn, seq, call, body)
            except RuntimeError:
                if self.closing:  # the pool is shut down: the server is closing
                    self._close(conn)
                    return
                # The interpreter is exiting (concurrent.futures refuses new work once the
                # main thread ended): the teardown at exit still waits for the nodes' exit
                # reports, so this one is served in a thread of its own.
                threading.Thread(target=self._pooled, args=(conn, seq, call, body), name="tfos-control-handler-exit",
                                 daemon=True).start()
            return
        self._complete(conn, seq, _run_call(call, body))

    def _pooled(self, conn: _Conn, seq: int, call: Call, body: dict) -> None:
        self.done.append((conn, seq, _run_call(call, body)))
        self.wake()

    def _drain_done(self) -> None:
        while self.done:
            conn, seq, result = self.done.popleft()
            self._complete(conn, seq, result)

    def _complete(self, conn: _Conn, seq: int, result: Union[dict, LongPoll, _Reject]) -> None:
        if conn.closed:
            return
        if isinstance(result, _Reject):
            self.reject(conn.peer, result.why)
            self._close(conn)
        elif isinstance(result, LongPoll):
            self._start_poll(conn, seq, result)
        elif isinstance(result, dict):
            self._answer(conn, seq, result)
        else:
            self.reject(conn.peer, f"internal error: dispatch returned {type(result).__name__}")
            self._close(conn)


class EventLoop(Accepting, Dispatching, LongPolls):
    """The event loop of one control server (run in its own thread by :meth:`run`).

    Args:
        listener: The bound, listening, non-blocking socket.
        key: The cluster's HMAC key.
        dispatch: A :class:`tfos._control.protocol.Routes` object or a plain function
            ``(body, peer) -> dict`` (run on the handler pool).
        limits: The caps.
        timeouts: Gives the deadlines at each check.
    """

    def __init__(self, listener: socket.socket, key: bytes, dispatch: Any, limits: ControlLimits,
                 timeouts: Callable[[], Timeouts]):
        self.timeouts = timeouts
        self.key = key
        self.limits = limits
        self.listener = listener
        if is_routes(dispatch):
            self.prepare: Callable[[dict, str], Call] = dispatch.prepare
            dispatch.add_change_listener(self.changed)
        elif callable(dispatch):
            plain = dispatch

            def _prepare(body: dict, peer: str) -> Call:
                return Call(run=lambda: plain(body, peer), offload=True)

            self.prepare = _prepare
        else:
            raise TypeError(f"dispatch must be callable or a Routes object, got {type(dispatch).__name__}")
        self.sel = selectors.DefaultSelector()
        self.sel.register(listener, selectors.EVENT_READ, None)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._wake_pending = False
        self._lock = threading.Lock()
        self.conns: dict[int, _Conn] = {}
        self.unproven = Admission(limits.max_unauthenticated)  # no proof of the key yet (evictable)
        self.checker = ProofChecker(key, PROOF_MAGIC)
        self.flood = FloodStats()
        self.queue = QueueWatch(listener)  # evidence of this listener's own accept queue overflowing
        self.pending: dict[_Conn, float] = {}  # proven, no first frame yet -> proof time (oldest first)
        self.partial: set[_Conn] = set()  # a frame started and not finished
        self.topics: dict[Hashable, set[_Poll]] = {}
        self.poll_heap: list[tuple[float, int, _Poll]] = []
        self._poll_ids = itertools.count()
        self.dirty: set[Hashable] = set()
        self.done: collections.deque = collections.deque()
        self.resume: set[_Conn] = set()  # reading paused at max_inflight, answers went out since
        self.pool = ThreadPoolExecutor(limits.handler_threads, thread_name_prefix="tfos-control-handler")
        self.closing = False
        self.ident: Optional[int] = None
        self.accept_paused_until = 0.0
        # figures (read by other threads without the lock: plain ints)
        self.rejected = 0
        self.reject_log = RejectLog()
        self.refused = 0
        self.evicted = 0
        self.frames_in = 0
        self.frames_out = 0
        self.peak_connections = 0

    # ------------------------------------------------------------ cross-thread
    def changed(self, topics: Iterable[Hashable]) -> None:
        """A cluster state changed (any thread, maybe under the state's lock)."""
        with self._lock:
            self.dirty.update(topics)
        if threading.get_ident() != self.ident:
            self.wake()

    def wake(self) -> None:
        if self._wake_pending:
            return
        self._wake_pending = True
        try:
            self._wake_w.send(b"w")
        except (BlockingIOError, OSError):
            pass

    # ---------------------------------------------------------------- the loop
    def run(self) -> None:
        self.ident = threading.get_ident()
        next_sweep = next_idle = time.monotonic()
        try:
            while not self.closing:
                now = time.monotonic()
                timeout = max(0.0, min(next_sweep, self.poll_heap[0][0] if self.poll_heap else next_sweep) - now)
                if self.accept_paused_until and now >= self.accept_paused_until:
                    self._resume_accepting()
                accept = False
                for key, mask in self.sel.select(timeout):
                    data = key.data
                    if data is None:
                        accept = True  # after the reads: a proof that arrived is seen before any eviction
                    elif data == "wake":
                        self._drain_wake()
                    else:
                        if mask & selectors.EVENT_READ:
                            self._readable(data)
                        if mask & selectors.EVENT_WRITE and not data.closed:
                            self._flush(data)
                if accept or self.accept_paused_until:
                    self.queue.sample()
                if accept:
                    self._accept()
                self._drain_done()
                self._recheck()
                now = time.monotonic()
                self._expire(now)
                while self.resume:
                    self._frames(self.resume.pop())
                if now >= next_sweep:
                    self._sweep(now)
                    next_sweep = now + _SWEEP_S
                if now >= next_idle:
                    self._idle_sweep(now)
                    next_idle = now + _IDLE_SWEEP_S
        except Exception:  # noqa: BLE001 - a bug here must not pass silently
            log.exception("tfos control server loop failed; closing every connection")
        finally:
            self._shutdown()

    def _drain_wake(self) -> None:
        self._wake_pending = False
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _shutdown(self) -> None:
        try:
            self.sel.unregister(self.listener)
        except (KeyError, ValueError, OSError):
            pass
        self.listener.close()
        for conn in list(self.conns.values()):
            self._close(conn)
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.sel.close()
        self._wake_r.close()
        self._wake_w.close()

    # ----------------------------------------------------------------- reading
    def _readable(self, conn: _Conn) -> None:
        if conn.closed:
            return
        try:  # before its proof, no byte more than the proof is read
            data = conn.sock.recv(65536 if conn.proof is None else PROOF_BYTES - len(conn.proof))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            if conn.proof is not None:  # reset before its proof (connect/close churn)
                self.flood.count("rejected", conn.peer.rsplit(":", 1)[0])
            self._close(conn)
            return
        if not data:
            if conn.proof is not None:  # closed before its proof: not a client of this cluster
                self.flood.count("rejected", conn.peer.rsplit(":", 1)[0])
                if conn.proof:
                    self.reject(conn.peer, f"closed after {len(conn.proof)} of the {PROOF_BYTES} bytes of its proof")
            if conn.reader.in_frame:
                self.reject(conn.peer, f"truncated frame: connection closed after {conn.reader.buffered} bytes of a frame")
                self._close(conn)
            else:
                self._close(conn)
            return
        conn.last_rx = time.monotonic()
        if conn.proof is not None:
            data = self._proof(conn, data)
            if not data:
                return
        conn.reader.feed(data)
        self._frames(conn)

    def _frames(self, conn: _Conn) -> None:
        """Handles the complete frames buffered on ``conn`` (while it may have more open)."""
        if conn.closed:
            return
        while not conn.closed and conn.inflight < self.limits.max_inflight:
            try:
                body = conn.reader.next()
            except ControlProtocolError as exc:
                self.reject(conn.peer, str(exc))
                self._close(conn)
                return
            if body is None:
                break
            self._request(conn, body)
        if conn.closed:
            return
        if conn.reader.in_frame:
            if conn.frame_since is None:
                conn.frame_since = time.monotonic()
                self.partial.add(conn)
        elif conn.frame_since is not None:
            conn.frame_since = None
            self.partial.discard(conn)
        self._interest(conn)

    # ----------------------------------------------------------------- writing
    def _answer(self, conn: _Conn, seq: int, reply: dict) -> None:
        if conn.closed:
            return
        try:
            frame = conn.session.answer(self.key, seq, reply)
        except (TypeError, ValueError, ControlProtocolError) as exc:
            self.reject(conn.peer, f"cannot encode the response: {type(exc).__name__}: {str(exc)[:200]}")
            self._close(conn)
            return
        conn.inflight -= 1
        if not conn.out:
            conn.out_since = time.monotonic()
        conn.out += frame
        self.frames_out += 1
        if len(conn.out) > _MAX_OUT_BYTES:
            self.reject(conn.peer, f"does not read its answers ({len(conn.out)} bytes waiting)")
            self._close(conn)
            return
        self._flush(conn)
        if not conn.closed and conn.inflight == self.limits.max_inflight - 1 and conn.reader.buffered:
            self.resume.add(conn)  # reading had paused at the cap: the loop goes on with the buffered requests

    def _flush(self, conn: _Conn) -> None:
        while conn.out:
            try:
                sent = conn.sock.send(conn.out)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self._close(conn)
                return
            del conn.out[:sent]
            conn.out_since = time.monotonic()
        self._interest(conn)

    def _interest(self, conn: _Conn) -> None:
        if conn.closed:
            return
        mask = selectors.EVENT_READ if conn.inflight < self.limits.max_inflight else 0
        if conn.out:
            mask |= selectors.EVENT_WRITE
        if mask == conn.mask:
            return
        if not conn.mask:
            self.sel.register(conn.sock, mask, conn)
        elif not mask:
            self.sel.unregister(conn.sock)
        else:
            self.sel.modify(conn.sock, mask, conn)
        conn.mask = mask

    # -------------------------------------------------------------- deadlines
    def _sweep(self, now: float) -> None:
        deadlines = self.timeouts()
        first_s = deadlines.first_frame_s
        for conn in self.unproven.expired(now, first_s):
            self.flood.count("rejected", conn.peer.rsplit(":", 1)[0])
            self.reject(conn.peer, f"no proof of the cluster key in time (timed out after {first_s:g} s)")
            self._close(conn)
        for conn, since in list(self.pending.items()):
            if now - since <= first_s:
                break  # oldest first
            self.reject(conn.peer, f"no complete frame in time (timed out after {first_s:g} s waiting for a control frame)")
            self._close(conn)
        frame_s = deadlines.frame_s
        for conn in list(self.partial):
            if conn.inflight >= self.limits.max_inflight:
                continue  # not read while its requests are answered (its frames may be complete)
            if conn.frame_since is not None and now - conn.frame_since > frame_s:
                self.reject(conn.peer, f"no complete frame in time (timed out after {frame_s:g} s waiting for the rest of a "
                                       f"control frame; received {conn.reader.buffered} bytes)")
                self._close(conn)

    def _idle_sweep(self, now: float) -> None:
        deadlines = self.timeouts()
        idle_s = deadlines.idle_s
        for conn in list(self.conns.values()):
            if conn.out and now - conn.out_since > deadlines.write_s:
                self.reject(conn.peer, f"left its answers unread for {deadlines.write_s:g} s")
                self._close(conn)
            elif (conn.inflight == 0 and not conn.reader.in_frame and conn not in self.pending and conn.proof is None
                  and now - conn.last_rx > idle_s):
                self._close(conn)  # an idle client reconnects when it needs to

    # ---------------------------------------------------------------- closing
    def _close(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        for poll in list(conn.polls):
            self._end_poll(poll)
        self.pending.pop(conn, None)
        self.unproven.remove(conn)
        self.partial.discard(conn)
        self.resume.discard(conn)
        self.conns.pop(conn.fd, None)
        if conn.mask:
            try:
                self.sel.unregister(conn.sock)
            except (KeyError, ValueError):
                pass
        try:
            conn.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        conn.sock.close()

    def reject(self, peer: str, why: str) -> None:
        self.rejected += 1
        n = self.rejected
        if self.reject_log.due(n):
            log.warning("tfos control server rejected a connection from %s: %s (%d rejected so far)", peer, why, n)
