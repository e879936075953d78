"""The driver's control server (driver, or the control host under Spark Connect).

One listener per cluster, bound to the driver host's address, served by one event-loop
thread (:mod:`tfos._control.loop`) whatever the number of nodes. Every request is an
authenticated frame (:mod:`tfos._common.wire`) on a connection whose first bytes proved the
cluster key; :class:`tfos._control.protocol.ServerSession` refuses replays. Handlers run on
the loop thread, as deferred answers (:class:`~tfos._control.protocol.LongPoll`), or on a
bounded pool when they may block (:class:`~tfos._control.protocol.Call`). The caps
(:class:`tfos._control.limits.ControlLimits`) bound what a connection costs before and
after its proof; hostile input closes that connection only and never affects the cluster.
The rules and their figures: docs/architecture.md "Control plane" and docs/reliability.md
"Security" ("Control plane", "Bounded resources before authentication", "Floods").
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import threading
from typing import Any, Optional

from tfos._common.admission import REMEDY
from tfos._control.limits import ControlLimits
from tfos._control.loop import EventLoop, Timeouts
from tfos.errors import ConfigurationError

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
#: Descriptors kept free beyond the connection cap (Spark, py4j, logs, the TF processes
#: of driver-hosted nodes).
_FD_RESERVE = 256


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


def _timeouts() -> Timeouts:
    """The deadlines of this module, as they are now (tests shorten them)."""
    return Timeouts(FIRST_FRAME_TIMEOUT_S, FRAME_TIMEOUT_S, IDLE_TIMEOUT_S, WRITE_TIMEOUT_S)


class ControlServer:
    """The authenticated control listener of one cluster (driver side).

    Args:
        key: The cluster's HMAC key (never logged).
        dispatch: The request side of the cluster state: a
            :class:`tfos._control.protocol.Routes` object (a
            :class:`~tfos._control.host.ClusterHost`), whose long-polls are deferred
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
        want = limits.max_connections + limits.max_unauthenticated + _FD_RESERVE
        fds = _raise_fd_limit(want)
        if fds < want:
            fitting = max(64, (fds - _FD_RESERVE) // 2)
            log.warning("the open-files limit of the driver process (%d) holds only %d control connections and as many "
                        "unauthenticated ones, not %d and %d; raise it (ulimit -n) for a cluster of this size", fds,
                        fitting, limits.max_connections, limits.max_unauthenticated)
            limits = ControlLimits(min(fitting, limits.max_connections), min(limits.max_unauthenticated, fitting),
                                   limits.backlog, limits.handler_threads, limits.max_inflight)
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
        self._loop = EventLoop(listener, key, dispatch, limits, _timeouts)
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
        ``rejected``, ``refused`` (by the connection cap), ``evicted`` (unproven
        connections shed over their cap), ``unproven`` (open now), ``turned_away`` (connections without a
        proof closed: rejected, evicted or refused)."""
        loop = self._loop
        conns = list(loop.conns.values())
        return {
            "frames_in": loop.frames_in, "frames_out": loop.frames_out, "connections": len(conns),
            "peak_connections": loop.peak_connections, "long_polls": sum(len(c.polls) for c in conns),
            "rejected": loop.rejected, "refused": loop.refused, "evicted": loop.evicted,
            "unproven": len(loop.unproven), "turned_away": loop.flood.total,
        }

    def flood_report(self) -> str:
        """A sentence for the driver's errors when there is evidence of a flood on this
        server's own port since it started: connections without the key turned away
        (rejected, evicted, refused at a cap), or its own accept queue found full (with the
        host's ListenDrops rise over those spans): the port, the counts, the top source
        addresses and the remedy (docs/reliability.md "Floods"); "" otherwise, whatever
        other listeners of the host went through."""
        where = f"the tfos control port {self.host}:{self.port}"
        text = self._loop.flood.summary(where)
        queue = self._loop.queue.summary()
        if queue:
            text = (text + "; " + queue) if text else f"{where}: {queue}; {REMEDY}"
        return text

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
