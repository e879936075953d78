"""The driver's control server (driver only).

One listener per cluster, bound to the driver host's address (never to every interface),
serving authenticated request/response frames (see :mod:`tfos._wire`). Every connection
starts with a MAC'd ``hello`` carrying a fresh server nonce; every client frame must carry
that nonce and the next sequence number, so replayed frames are refused.

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
from typing import Callable, Optional

from . import _wire
from ._deadline import Deadline
from .errors import ConfigurationError, ControlProtocolError, DeadlineExceededError

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
        with srv.count_lock:
            srv.active += 1
            srv.sockets.add(sock)
            too_many = srv.active > MAX_CONNECTIONS
        try:
            if too_many:
                srv.reject(peer, "too many connections")
                return
            snonce = os.urandom(16).hex()
            sock.sendall(_wire.encode_frame(srv.key, {"type": "hello", "sn": snonce}))
            seq = 0
            idle = FIRST_FRAME_TIMEOUT_S
            while not srv.closing:
                try:
                    body = _wire.read_frame(sock, srv.key, Deadline(idle, "a control frame"), FRAME_TIMEOUT_S)
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
                seq += 1
                idle = IDLE_TIMEOUT_S
                try:
                    resp = srv.dispatch(body, peer)
                except ControlProtocolError as exc:
                    srv.reject(peer, str(exc))
                    return
                resp = dict(resp, re=seq, sn=snonce)
                sock.sendall(_wire.encode_frame(srv.key, resp))
        except OSError:
            return
        finally:
            with srv.count_lock:
                srv.active -= 1
                srv.sockets.discard(sock)


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = False
    request_queue_size = 128

    def __init__(self, addr, key: bytes, dispatch: Callable[[dict, str], dict]):
        self.key = key
        self.dispatch = dispatch
        self.count_lock = threading.Lock()
        self.active = 0
        self.closing = False
        self.rejected = 0
        self.sockets: set[socket.socket] = set()
        super().__init__(addr, _Handler)

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
