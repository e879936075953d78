"""The driver's control server (driver, or the control host under Spark Connect).

One listener per cluster, bound to the driver host's address (never to every interface),
served by one event-loop thread (:mod:`selectors`: epoll on Linux) whatever the number of
nodes. Requests are authenticated frames (:mod:`tfos._common.wire`); the replay protection
is :class:`tfos._control.protocol.ServerSession`: every connection starts with a MAC'd
``hello`` carrying a fresh server nonce; every client frame must carry that nonce, the
client's own nonce (``cn``, fixed for the connection) and the next sequence number, so
replayed frames are refused; every answer carries both nonces and the sequence number it
answers. A client may send its next requests before the answers came (one connection
serves all the threads of a node process); answers may come in any order.

How a request is served (see :class:`tfos._control.protocol.Call`):

* most handlers only read or update the cluster state under its lock: they run on the
  loop thread;
* long-polls (``await_cluster``, ``wait_event``, ``node_stack``, a Connect client's
  ``client_wait``) return a :class:`~tfos._control.protocol.LongPoll`: the answer is
  deferred, not a blocked thread; the loop checks it again whenever the cluster state
  changes on one of its topics, and answers it when its poll time ends;
* handlers that may block (a failure report, on which the driver cancels Spark jobs; a
  node's output lines written to the driver's stderr) run on a small bounded thread pool
  (:attr:`ControlLimits.handler_threads`), so one slow handler never stalls the others.

Before a connection has sent one authenticated frame it costs one socket and at most
:data:`tfos._common.wire.MAX_FIRST_FRAME_BYTES` of buffer: at most
:attr:`ControlLimits.max_unauthenticated` such connections are kept (a new one evicts the
oldest), and at most :attr:`ControlLimits.max_connections` in all; both are derived from
the number of nodes (:meth:`ControlLimits.for_nodes`). An authenticated message that is
malformed (missing or mistyped fields, NaN/Infinity) is a protocol error that closes that
connection only.

Hostile input (garbage, truncated frames, oversize length prefixes, wrong keys, replays,
slow-loris peers) is rejected and logged without key material, and never affects the
cluster: such connections are simply closed.
"""

from __future__ import annotations

import collections
import errno
import heapq
import itertools
import logging
import os
import selectors
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Hashable, Iterable, Optional, Union

from tfos._common import wire as _wire
from tfos._control.limits import ControlLimits
from tfos._control.protocol import Call, FrameReader, LongPoll, ServerSession, is_routes
from tfos.errors import ConfigurationError, ControlProtocolError

__all__ = ["ControlServer", "parse_port_spec"]

log = logging.getLogger(__name__)

#: Seconds a new connection may take to send its first frame.
FIRST_FRAME_TIMEOUT_S = 10.0
#: Seconds an authenticated connection may stay idle between frames (no request open).
IDLE_TIMEOUT_S = 300.0
#: Seconds allowed to finish a frame once its first byte arrived (slow-loris defence).
FRAME_TIMEOUT_S = 10.0
#: Seconds a peer may leave an answer unread before its connection is closed.
WRITE_TIMEOUT_S = 30.0
#: Default cap on connections (a cluster's own is derived from its size, see ControlLimits).
MAX_CONNECTIONS = ControlLimits().max_connections
#: Default cap on connections that have not yet sent an authenticated frame.
MAX_UNAUTHENTICATED = ControlLimits().max_unauthenticated
#: Largest amount of answers, in bytes, kept for one peer that does not read them.
_MAX_OUT_BYTES = 4 * _wire.MAX_CONTROL_FRAME_BYTES
#: Descriptors kept free beyond the connection cap (Spark, py4j, logs, the TF processes
#: of driver-hosted nodes).
_FD_RESERVE = 256
#: Seconds between two checks of the frame deadlines.
_SWEEP_S = 0.25
#: Seconds between two checks for idle and stalled connections.
_IDLE_SWEEP_S = 5.0


def parse_port_spec(spec: Optional[str]) -> list[int]:
    """Ports to try from ``TFOS_SERVER_PORT``: '' -> [0] (any), '9000', or '9000-9010'.

    Raises:
        ConfigurationError: For text that is not a port or a range of ports.
    """
    if not spec:
        return [0]
    try:
        if "-" in spec:
            lo, hi = (int(x) for x in spec.split("-", 1))
        else:
            lo = hi = int(spec)
    except ValueError:
        raise ConfigurationError(f"TFOS_SERVER_PORT must be a port or a range like 9000-9010, got {spec!r}") from None
    if not (0 < lo <= hi < 65536):
        raise ConfigurationError(f"TFOS_SERVER_PORT range {spec!r} is out of 1-65535")
    return list(range(lo, hi + 1))


def _listen(host: str, port: int, backlog: int) -> socket.socket:
    """A non-blocking listening socket with SO_REUSEADDR: a fixed port whose previous
    server just closed (its connections in TIME_WAIT) binds again at once, while a port
    another socket listens on is still refused (Linux)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def _raise_fd_limit(want: int) -> int:
    """Raises this process's soft limit of open files towards ``want`` (up to the hard
    limit); returns the limit now in force."""
    try:
        import resource
    except ImportError:  # not POSIX
        return want
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= want:
        return want
    new = want if hard == resource.RLIM_INFINITY else min(hard, want)
    if new > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
        except (ValueError, OSError):
            pass
    return soft


class _Conn:
    """One connection's state on the loop."""

    __slots__ = ("sock", "fd", "peer", "reader", "session", "out", "out_since", "last_rx", "frame_since",
                 "inflight", "polls", "closed", "mask")

    def __init__(self, sock: socket.socket, peer: str, key: bytes, now: float):
        self.sock = sock
        self.fd = sock.fileno()
        self.peer = peer
        self.reader = FrameReader(key, _wire.MAX_FIRST_FRAME_BYTES)
        self.session = ServerSession()
        self.out = bytearray()
        self.out_since = 0.0
        self.last_rx = now
        self.frame_since: Optional[float] = None
        self.inflight = 0
        self.polls: set[_Poll] = set()
        self.closed = False
        self.mask = 0


class _Poll:
    """A deferred answer on the loop."""

    __slots__ = ("conn", "seq", "lp", "done")

    def __init__(self, conn: _Conn, seq: int, lp: LongPoll):
        self.conn, self.seq, self.lp, self.done = conn, seq, lp, False


class _Reject:
    """A pooled handler's refusal, carried back to the loop."""

    __slots__ = ("why",)

    def __init__(self, why: str):
        self.why = why


def _malformed(body: dict, exc: BaseException) -> str:
    return f"malformed {str(body.get('type'))[:40]!r} message: {type(exc).__name__}: {str(exc)[:200]}"


class _Loop:
    """The event loop of one control server (its own thread)."""

    def __init__(self, listener: socket.socket, key: bytes, dispatch: Any, limits: ControlLimits):
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
        self.pending: dict[_Conn, float] = {}  # not yet authenticated -> accept time (oldest first)
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
                    self.accept_paused_until = 0.0
                    self.sel.register(self.listener, selectors.EVENT_READ, None)
                for key, mask in self.sel.select(timeout):
                    data = key.data
                    if data is None:
                        self._accept()
                    elif data == "wake":
                        self._drain_wake()
                    else:
                        if mask & selectors.EVENT_READ:
                            self._readable(data)
                        if mask & selectors.EVENT_WRITE and not data.closed:
                            self._flush(data)
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

    # --------------------------------------------------------------- accepting
    def _accept(self) -> None:
        for _ in range(256):
            try:
                sock, addr = self.listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # Out of descriptors: stop accepting for a moment (else the listener
                    # stays readable and the loop spins); clients retry their connects.
                    log.warning("tfos control server cannot accept connections: %s (raise the open-files limit, "
                                "ulimit -n)", exc)
                    self.sel.unregister(self.listener)
                    self.accept_paused_until = time.monotonic() + 0.5
                return
            peer = f"{addr[0]}:{addr[1]}"
            if len(self.conns) >= self.limits.max_connections:
                self.refused += 1
                self.reject(peer, f"too many connections (the cap is {self.limits.max_connections})")
                sock.close()
                continue
            now = time.monotonic()
            try:
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn = _Conn(sock, peer, self.key, now)
                self.conns[conn.fd] = conn
                conn.mask = selectors.EVENT_READ
                self.sel.register(sock, conn.mask, conn)
            except Exception as exc:  # noqa: BLE001 - one connection's set-up failure closes it only
                self.conns.pop(sock.fileno(), None)
                self.reject(peer, f"internal error: {exc!r}")
                sock.close()
                continue
            self.peak_connections = max(self.peak_connections, len(self.conns))
            if len(self.pending) >= self.limits.max_unauthenticated:
                oldest = next(iter(self.pending))
                self.evicted += 1
                self.reject(peer, "evicted the oldest unauthenticated connection")
                self._close(oldest)
            self.pending[conn] = now
            conn.out += conn.session.hello(self.key)
            self.frames_out += 1
            self._flush(conn)

    # ----------------------------------------------------------------- reading
    def _readable(self, conn: _Conn) -> None:
        if conn.closed:
            return
        try:
            data = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        if not data:
            if conn.reader.in_frame:
                self.reject(conn.peer, f"truncated frame: connection closed after {conn.reader.buffered} bytes of a frame")
                self._close(conn)
            else:
                self._close(conn)
            return
        conn.last_rx = time.monotonic()
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
            except RuntimeError:  # the pool is shut down: the server is closing
                self._close(conn)
            return
        try:
            result: Any = call.run()
        except ControlProtocolError as exc:
            result = _Reject(str(exc))
        except Exception as exc:  # noqa: BLE001 - a malformed message from a key holder
            result = _Reject(_malformed(body, exc))
        self._complete(conn, seq, result)

    def _pooled(self, conn: _Conn, seq: int, call: Call, body: dict) -> None:
        try:
            result: Any = call.run()
        except ControlProtocolError as exc:
            result = _Reject(str(exc))
        except Exception as exc:  # noqa: BLE001 - a malformed message from a key holder
            result = _Reject(_malformed(body, exc))
        self.done.append((conn, seq, result))
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

    # -------------------------------------------------------------- long-polls
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
        first_s = FIRST_FRAME_TIMEOUT_S
        for conn, since in list(self.pending.items()):
            if now - since <= first_s:
                break  # oldest first
            self.reject(conn.peer, f"no complete frame in time (timed out after {first_s:g} s waiting for a control frame)")
            self._close(conn)
        frame_s = FRAME_TIMEOUT_S
        for conn in list(self.partial):
            if conn.inflight >= self.limits.max_inflight:
                continue  # not read while its requests are answered (its frames may be complete)
            if conn.frame_since is not None and now - conn.frame_since > frame_s:
                self.reject(conn.peer, f"no complete frame in time (timed out after {frame_s:g} s waiting for the rest of a "
                                       f"control frame; received {conn.reader.buffered} bytes)")
                self._close(conn)

    def _idle_sweep(self, now: float) -> None:
        idle_s = IDLE_TIMEOUT_S
        for conn in list(self.conns.values()):
            if conn.out and now - conn.out_since > WRITE_TIMEOUT_S:
                self.reject(conn.peer, f"left its answers unread for {WRITE_TIMEOUT_S:g} s")
                self._close(conn)
            elif conn.inflight == 0 and not conn.reader.in_frame and conn not in self.pending and now - conn.last_rx > idle_s:
                self._close(conn)  # an idle client reconnects when it needs to

    # ---------------------------------------------------------------- closing
    def _close(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        for poll in list(conn.polls):
            self._end_poll(poll)
        self.pending.pop(conn, None)
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
        if n <= 20 or n % 100 == 0:
            log.warning("tfos control server rejected a connection from %s: %s (%d rejected so far)", peer, why, n)


class ControlServer:
    """The authenticated control listener of one cluster (driver side).

    Args:
        key: The cluster's HMAC key (never logged).
        dispatch: The request side of the cluster state: a
            :class:`tfos._control.protocol.Routes` object (a
            :class:`~tfos._driver.state.ClusterState`), whose long-polls are deferred
            answers; or a plain function ``(body, peer) -> response body`` (raising
            ControlProtocolError to drop the peer), which runs on the handler pool.
        host: The address to bind: ``TFOS_SERVER_HOST`` if set, else this argument
            (the driver host, ``spark.driver.host``).
        port_spec: ``TFOS_SERVER_PORT`` if set, else this value ('' = any free port,
            '9000' or '9000-9010').
        num_nodes: The cluster's size; the caps derive from it
            (:meth:`ControlLimits.for_nodes`).
        limits: Explicit caps instead.

    Raises:
        ConfigurationError: No port of the range could be bound.
    """

    def __init__(self, key: bytes, dispatch: Any, host: str, port_spec: str = "", num_nodes: int = 0,
                 limits: Optional[ControlLimits] = None):
        host = os.environ.get("TFOS_SERVER_HOST") or host
        ports = parse_port_spec(os.environ.get("TFOS_SERVER_PORT") or port_spec)
        limits = limits or ControlLimits.for_nodes(num_nodes)
        fds = _raise_fd_limit(limits.max_connections + _FD_RESERVE)
        if fds < limits.max_connections + _FD_RESERVE:
            fitting = max(64, fds - _FD_RESERVE)
            log.warning("the open-files limit of the driver process (%d) holds only %d control connections, not %d; "
                        "raise it (ulimit -n) for a cluster of this size", fds, fitting, limits.max_connections)
            limits = ControlLimits(fitting, min(limits.max_unauthenticated, fitting), limits.backlog,
                                   limits.handler_threads, limits.max_inflight)
        self.limits = limits
        last: Optional[OSError] = None
        listener: Optional[socket.socket] = None
        for port in ports:
            try:
                listener = _listen(host, port, limits.backlog)
                break
            except OSError as exc:
                last = exc
        if listener is None:
            hint = ""
            if last is not None and last.errno == errno.EADDRINUSE:
                hint = (" (another socket listens there: a port of a tfos cluster that was shut down is free again "
                        "at once, so another program or a cluster still running holds it)")
            raise ConfigurationError(
                f"cannot bind the tfos control server on {host} ports {ports[0]}-{ports[-1]}: {last}{hint}. "
                "Set TFOS_SERVER_HOST / TFOS_SERVER_PORT to a free address or range"
            )
        self.host, self.port = listener.getsockname()[:2]
        self._loop = _Loop(listener, key, dispatch, limits)
        self._closed = False
        self._thread = threading.Thread(target=self._loop.run, name="tfos-control-server", daemon=True)
        self._thread.start()
        log.debug("tfos control server listening on %s:%d", self.host, self.port)

    @property
    def rejected(self) -> int:
        """Number of connections rejected so far (bad frames, wrong keys, replays, caps...)."""
        return self._loop.rejected

    @property
    def active_connections(self) -> int:
        """Connections currently open."""
        return len(self._loop.conns)

    def stats(self) -> dict:
        """Figures of the server so far: ``frames_in`` (requests), ``frames_out`` (answers
        and hellos), ``connections``, ``peak_connections``, ``long_polls`` (open now),
        ``rejected``, ``refused`` (by the connection cap), ``evicted`` (unauthenticated
        connections evicted by newer ones)."""
        loop = self._loop
        conns = list(loop.conns.values())
        return {
            "frames_in": loop.frames_in, "frames_out": loop.frames_out, "connections": len(conns),
            "peak_connections": loop.peak_connections, "long_polls": sum(len(c.polls) for c in conns),
            "rejected": loop.rejected, "refused": loop.refused, "evicted": loop.evicted,
        }

    def close(self, timeout_s: float = 5.0) -> None:
        """Stops listening, closes every connection and joins the loop thread (idempotent,
        bounded by ``timeout_s``)."""
        loop = self._loop
        if self._closed:
            return
        self._closed = True
        loop.closing = True
        loop.wake()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("tfos control server thread still running %g s after close()", timeout_s)
