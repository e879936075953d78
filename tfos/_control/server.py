"""The driver's control server (driver only).

One listener per cluster, bound to the driver host's address (never to every interface),
serving authenticated request/response frames (see :mod:`tfos._common.wire`). Every connection
starts with a MAC'd ``hello`` carrying a fresh server nonce; every client frame must carry
that nonce, the client's own nonce (``cn``, fixed for the connection) and the next sequence
number, so replayed frames are refused; every response carries both nonces and the
sequence number it answers, so a client cannot be fed a response from another connection.

Before a connection has sent one authenticated frame it costs at most one thread and
:data:`tfos._common.wire.MAX_FIRST_FRAME_BYTES` of buffer: at most
:data:`MAX_UNAUTHENTICATED` such connections are kept (a new one evicts the oldest), and at
most :data:`MAX_CONNECTIONS` in all. An authenticated message that is malformed (missing or
mistyped fields, NaN/Infinity) is a protocol error that closes that connection only.

Hostile input (garbage, truncated frames, oversize length prefixes, wrong keys, replays,
slow-loris peers) is rejected and logged without key material, and never affects the
cluster: such connections are simply closed.
"""

from __future__ import annotations

import logging
import os
import socket
import socketserver
import threading
import time
from typing import Any, Callable, Optional

from tfos._common import wire as _wire
from tfos._common.deadline import Deadline
from tfos.errors import ConfigurationError, ControlProtocolError, DeadlineExceededError

__all__ = ["ControlServer", "parse_port_spec"]

log = logging.getLogger(__name__)

#: Seconds a new connection may take to send its first frame.
FIRST_FRAME_TIMEOUT_S = 10.0
#: Seconds an authenticated connection may stay idle between frames.
IDLE_TIMEOUT_S = 300.0
#: Seconds allowed to finish a frame once its first byte arrived (slow-loris defence).
FRAME_TIMEOUT_S = 10.0
#: Most connections served at once; more are closed on accept.
MAX_CONNECTIONS = 512
#: Most connections that have not yet sent an authenticated frame; a new one evicts the
#: oldest, so a flood of idle strangers cannot lock out the cluster's own processes.
MAX_UNAUTHENTICATED = 64
#: Client nonces are this many hex characters (16 random bytes).
_CNONCE_CHARS = 32


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


class _Handler(socketserver.BaseRequestHandler):
    server: "_Server"

    def handle(self) -> None:
        srv = self.server
        sock: socket.socket = self.request
        peer = f"{self.client_address[0]}:{self.client_address[1]}"
        try:
            snonce = os.urandom(16).hex()
            sock.sendall(_wire.encode_frame(srv.key, {"type": "hello", "sn": snonce}))
            seq = 0
            cnonce: Optional[str] = None
            idle = FIRST_FRAME_TIMEOUT_S
            while not srv.closing:
                try:
                    body = _wire.read_frame(
                        sock, srv.key, Deadline(idle, "a control frame"), FRAME_TIMEOUT_S,
                        _wire.MAX_FIRST_FRAME_BYTES if seq == 0 else _wire.MAX_CONTROL_FRAME_BYTES,
                    )
                except _wire.TruncatedFrameError as exc:
                    srv.reject(peer, str(exc))
                    return
                except ConnectionError:
                    return
                except DeadlineExceededError as exc:
                    if seq == 0:
                        srv.reject(peer, f"no complete frame in time ({exc})")
                    return
                except ControlProtocolError as exc:
                    srv.reject(peer, str(exc))
                    return
                if body.get("sn") != snonce or body.get("seq") != seq + 1:
                    srv.reject(peer, "replayed or out-of-order frame")
                    return
                cn = body.get("cn")
                if not isinstance(cn, str) or len(cn) != _CNONCE_CHARS or (cnonce is not None and cn != cnonce):
                    srv.reject(peer, "frame without this connection's client nonce")
                    return
                if cnonce is None:
                    cnonce = cn
                    srv.authenticated(sock)
                seq += 1
                idle = IDLE_TIMEOUT_S
                if body.get("type") == "hi":  # a client's small first frame (see MAX_FIRST_FRAME_BYTES)
                    resp: dict = {"type": "hi"}
                else:
                    try:
                        resp = srv.dispatch(body, peer)
                        if not isinstance(resp, dict):
                            raise TypeError(f"dispatch returned {type(resp).__name__}")
                    except ControlProtocolError as exc:
                        srv.reject(peer, str(exc))
                        return
                    except Exception as exc:  # noqa: BLE001 - a malformed message from a key holder
                        srv.reject(peer, f"malformed {str(body.get('type'))[:40]!r} message: {type(exc).__name__}: {str(exc)[:200]}")
                        return
                resp = dict(resp, re=seq, sn=snonce, cn=cnonce)
                try:
                    frame = _wire.encode_frame(srv.key, resp)
                except (TypeError, ValueError, ControlProtocolError) as exc:
                    srv.reject(peer, f"cannot encode the response: {type(exc).__name__}: {str(exc)[:200]}")
                    return
                sock.sendall(frame)
        except OSError:
            return


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = False
    request_queue_size = 128

    def __init__(self, addr: Any, key: bytes, dispatch: Callable[[dict, str], dict]):
        self.key = key
        self.dispatch = dispatch
        self.count_lock = threading.Lock()
        self.active = 0
        self.closing = False
        self.rejected = 0
        self.sockets: set[socket.socket] = set()
        self.pending: dict[socket.socket, float] = {}  # not yet authenticated -> accept time
        super().__init__(addr, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        """Admits a connection within the caps, then serves it on a thread of its own."""
        evict: Optional[socket.socket] = None
        with self.count_lock:
            full = self.active >= MAX_CONNECTIONS
            if not full:
                if len(self.pending) >= MAX_UNAUTHENTICATED:
                    evict = min(self.pending, key=self.pending.__getitem__)
                    del self.pending[evict]
                self.pending[request] = time.monotonic()
                self.active += 1
                self.sockets.add(request)
        peer = f"{client_address[0]}:{client_address[1]}"
        if full:
            self.reject(peer, "too many connections")
            self.shutdown_request(request)
            return
        if evict is not None:
            self.reject(peer, "evicted the oldest unauthenticated connection")
            try:
                evict.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._forget(request)  # e.g. Thread.start failed; the caller closes the socket
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._forget(request)

    def _forget(self, request: Any) -> None:
        with self.count_lock:
            if request in self.sockets:
                self.sockets.discard(request)
                self.active -= 1
            self.pending.pop(request, None)

    def authenticated(self, sock: socket.socket) -> None:
        """The connection sent its first authenticated frame: no longer evictable."""
        with self.count_lock:
            self.pending.pop(sock, None)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Any error serving one connection (even a failed ``Thread.start``) is logged and
        only closes that connection; the accept loop goes on."""
        import sys

        exc = sys.exc_info()[1]
        self.reject(f"{client_address[0]}:{client_address[1]}", f"internal error: {exc!r}")

    def reject(self, peer: str, why: str) -> None:
        with self.count_lock:
            self.rejected += 1
            n = self.rejected
        if n <= 20 or n % 100 == 0:
            log.warning("tfos control server rejected a connection from %s: %s (%d rejected so far)", peer, why, n)


class ControlServer:
    """The authenticated control listener of one cluster (driver side).

    Args:
        key: The cluster's HMAC key (never logged).
        dispatch: Called with each authenticated request body and the peer address;
            returns the response body, or raises ControlProtocolError to drop the peer.
        host: The address to bind: ``TFOS_SERVER_HOST`` if set, else this argument
            (the driver host, ``spark.driver.host``).
        port_spec: ``TFOS_SERVER_PORT`` if set, else this value ('' = any free port,
            '9000' or '9000-9010').

    Raises:
        ConfigurationError: No port of the range could be bound.
    """

    def __init__(self, key: bytes, dispatch: Callable[[dict, str], dict], host: str, port_spec: str = ""):
        host = os.environ.get("TFOS_SERVER_HOST") or host
        ports = parse_port_spec(os.environ.get("TFOS_SERVER_PORT") or port_spec)
        last: Optional[OSError] = None
        self._server: Optional[_Server] = None
        for port in ports:
            try:
                self._server = _Server((host, port), key, dispatch)
                break
            except OSError as exc:
                last = exc
        if self._server is None:
            raise ConfigurationError(
                f"cannot bind the tfos control server on {host} ports {ports[0]}-{ports[-1]}: {last}. "
                "Set TFOS_SERVER_HOST / TFOS_SERVER_PORT to a free address or range"
            )
        self.host, self.port = self._server.server_address[:2]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2}, name="tfos-control-server", daemon=True)
        self._thread.start()
        log.debug("tfos control server listening on %s:%d", self.host, self.port)

    @property
    def rejected(self) -> int:
        """Number of connections rejected so far (bad frames, wrong keys, replays...)."""
        return self._server.rejected if self._server else 0

    @property
    def active_connections(self) -> int:
        """Connections currently open."""
        return self._server.active if self._server else 0

    def close(self, timeout_s: float = 5.0) -> None:
        """Stops listening and joins the server thread (idempotent, bounded by ``timeout_s``)."""
        srv = self._server
        if srv is None:
            return
        srv.closing = True
        srv.shutdown()
        srv.server_close()
        with srv.count_lock:
            open_socks = list(srv.sockets)
        for sock in open_socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(timeout_s)
        self._server = None
