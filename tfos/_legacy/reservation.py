"""TFoS's reservation server and client, on tfos's authenticated control channel
(driver for :class:`Server`; Spark tasks / TF processes for :class:`Client`). Public path:
:mod:`tfos.reservation`.

``TFCluster.run`` does not use this module: nodes register with the cluster's own control
server. It is kept for TFoS programs and tools that use it directly, e.g. TFoS's streaming
examples and :func:`tfos.TFSparkNode.run`.

Differences from TFoS (see docs/migration.md): frames are JSON with an HMAC-SHA256 tag, not
unauthenticated pickles, so a reservation must be JSON-serialisable (tuples come back as
lists), and a :class:`Client` needs the server's key: pass the address returned by
:meth:`Server.start` (it carries the key, like the cluster key that travels in a Spark
closure), or any ``(host, port)`` of a server started in the same process.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from typing import Any, Dict, List, Optional, Tuple

from tfos._common import wire as _wire
from tfos._control import key_files as _key_files
from tfos._control.client import ControlClient
from tfos._control.key_files import ServerAddress
from tfos._control.server import ControlServer, parse_port_spec
from tfos._legacy.message_socket import MessageSocket
from tfos.errors import (
    ConfigurationError,
    ControlProtocolError,
    ReservationTimeoutError,
    TFOSError,
)

__all__ = ["Reservations", "MessageSocket", "Server", "Client", "ServerAddress", "TFOS_SERVER_PORT", "TFOS_SERVER_HOST", "MAX_RETRIES", "BUFSIZE",
           "TFOS_KEY_DIR", "write_key_file", "remove_key_file", "read_key_file"]

log = logging.getLogger("tfos.reservation")  # TFoS's module name: its public logger
#: TFoS's name for this module's logger.
logger = log

TFOS_SERVER_PORT = "TFOS_SERVER_PORT"
TFOS_SERVER_HOST = "TFOS_SERVER_HOST"
#: Kept from TFoS (its socket read size); tfos frames are length-prefixed and read whole.
BUFSIZE = 1024
#: Reconnection attempts of a :class:`Client` request.
MAX_RETRIES = 3

#: Keys of servers started in this process, by (host, port).
_LOCAL_KEYS: Dict[Tuple[str, int], Tuple[bytes, str]] = {}


class Reservations:
    """Thread-safe list of node reservations, complete once ``required`` were added."""

    def __init__(self, required: int):
        self.required = required
        self.lock = threading.RLock()
        self.reservations: List[Any] = []

    def add(self, meta: Any) -> None:
        """Adds one node's reservation (any JSON-serialisable value)."""
        with self.lock:
            self.reservations.append(meta)

    def done(self) -> bool:
        """True once at least ``required`` reservations were added."""
        with self.lock:
            return len(self.reservations) >= self.required

    def get(self) -> List[Any]:
        """A copy of the reservations so far, in arrival order."""
        with self.lock:
            return list(self.reservations)

    def remaining(self) -> int:
        """Reservations still missing (0 when done)."""
        with self.lock:
            return max(0, self.required - len(self.reservations))


class Server:
    """Collects ``count`` reservations from :class:`Client` s (driver).

    Args:
        count: Number of reservations expected (> 0).

    Attributes:
        reservations: The :class:`Reservations`.
        done: True once a client requested a stop, or :meth:`stop` was called.
    """

    def __init__(self, count: int):
        if count <= 0:
            raise ValueError("expected number of reservations must be greater than zero")
        self.reservations = Reservations(count)
        self.done = False
        self._key = _wire.new_key()
        self._id = f"reservation-{uuid.uuid4().hex[:12]}"
        self._control: Optional[ControlServer] = None
        self._sockets: List[socket.socket] = []
        self._lock = threading.Lock()

    def await_reservations(self, sc: Any = None, status: Optional[dict] = None, timeout: float = 600) -> List[Any]:
        """Blocks until every reservation arrived; returns them (driver).

        Args:
            sc: Unused (TFoS cancelled its jobs and stopped it on an error; tfos raises).
            status: A dict; an ``'error'`` entry set by another thread ends the wait.
            timeout: Longest wait, in seconds.

        Raises:
            TFOSError: ``status`` reported an error.
            ReservationTimeoutError: Not every reservation arrived within ``timeout``.
        """
        del sc
        deadline = time.monotonic() + timeout
        while not self.reservations.done():
            if status and "error" in status:
                raise TFOSError(f"reservations aborted: {status['error']}")
            if time.monotonic() >= deadline:
                raise ReservationTimeoutError(
                    f"timed out after {timeout} s waiting for reservations: {self.reservations.remaining()} of "
                    f"{self.reservations.required} missing"
                )
            log.info("waiting for %d reservations", self.reservations.remaining())
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        log.info("all reservations completed")
        return self.reservations.get()

    def _dispatch(self, body: dict, peer: str) -> dict:
        if body.get("cluster") != self._id:
            raise ControlProtocolError("frame is for another reservation server")
        kind = body.get("type")
        if kind == "REG":
            self.reservations.add(body["data"])
            return {"data": "OK"}
        if kind == "QUERY":
            return {"data": self.reservations.done()}
        if kind == "QINFO":
            return {"data": self.reservations.get()}
        if kind == "STOP":
            log.info("reservation server %s: stop requested by %s", self._id, peer)
            self.done = True
            # Close after this answer went out (the handler thread sends it after we return).
            threading.Timer(0.5, self._close).start()
            return {"data": "OK"}
        return {"data": "ERR"}

    def start(self) -> ServerAddress:
        """Starts listening in background threads (driver).

        Binds ``TFOS_SERVER_HOST`` (else :meth:`get_server_ip`) on the first free port of
        ``TFOS_SERVER_PORT`` (else any port).

        Returns:
            The :class:`ServerAddress` ``(host, port)`` to give to clients.

        Raises:
            ConfigurationError: No port of ``TFOS_SERVER_PORT`` could be bound.
        """
        host = self.get_server_ip()
        self._control = ControlServer(self._key, self._dispatch, host=host)
        addr = ServerAddress((str(self._control.host), int(self._control.port)), self._key, self._id)
        _LOCAL_KEYS[(addr[0], addr[1])] = (self._key, self._id)
        log.info("listening for reservations at %s:%d", addr[0], addr[1])
        return addr

    def get_server_ip(self) -> str:
        """``TFOS_SERVER_HOST`` if set, else this host's address (:func:`tfos.util.get_ip_address`)."""
        from tfos.util import get_ip_address

        return os.environ.get(TFOS_SERVER_HOST) or get_ip_address()

    def get_server_ports(self) -> List[int]:
        """Ports from ``TFOS_SERVER_PORT`` ('9999' or '9997-9999'), else ``[0]`` (any).

        Raises:
            ConfigurationError: The variable is not a port or a range of ports.
        """
        return parse_port_spec(os.environ.get(TFOS_SERVER_PORT, ""))

    def start_listening_socket(self) -> socket.socket:
        """Binds and listens on the first free port of :meth:`get_server_ports`, on
        :meth:`get_server_ip` (not on every interface); the socket is closed by :meth:`stop`.

        Raises:
            ConfigurationError: None of the ports could be bound.
        """
        host = self.get_server_ip()
        ports = self.get_server_ports()
        last: Optional[OSError] = None
        for port in ports:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.bind((host, port))
                sock.listen(16)
            except OSError as exc:
                sock.close()
                last = exc
                log.warning("reservation server cannot bind %s:%d: %s", host, port, exc)
                continue
            with self._lock:
                self._sockets.append(sock)
            return sock
        raise ConfigurationError(f"reservation server unable to bind to any port of {ports} on {host}: {last}")

    def _close(self) -> None:
        with self._lock:
            control, self._control = self._control, None
            socks, self._sockets = self._sockets, []
        if control is not None:
            _LOCAL_KEYS.pop((str(control.host), int(control.port)), None)
            control.close()
        for s in socks:
            s.close()

    def stop(self) -> None:
        """Stops listening (idempotent)."""
        self.done = True
        self._close()


class Client:
    """Talks to a :class:`Server` (Spark task, TF process or driver).

    Args:
        server_addr: The :class:`ServerAddress` from :meth:`Server.start`, or a plain
            ``(host, port)`` of a server started in this process.

    Raises:
        ConfigurationError: A plain ``(host, port)`` of a server this process did not start
            (the key is unknown: pass the address ``Server.start()`` returned).
    """

    def __init__(self, server_addr: Any):
        host, port = server_addr[0], int(server_addr[1])
        key, sid = getattr(server_addr, "key", b""), getattr(server_addr, "server_id", "")
        if not key:
            known = _LOCAL_KEYS.get((host, port)) or read_key_file(host, port)  # see write_key_file
            if known is None:
                raise ConfigurationError(
                    f"no key for reservation server {host}:{port}: tfos reservation servers authenticate every "
                    "client; pass the address returned by Server.start() (it carries the key), or run as the "
                    f"driver's user on its host (key files in {_key_dir()})"
                )
            key, sid = known
        self.server_addr = (host, port)
        self._client = ControlClient(host, port, key, sid)

    def _request(self, msg_type: str, msg_data: Any = None) -> Any:
        last: Optional[BaseException] = None
        for _ in range(MAX_RETRIES):
            try:
                resp = self._client.send_raw(msg_type, {"data": msg_data})
                return resp.get("data")
            except ConnectionError as exc:
                last = exc
        raise ConnectionError(f"reservation server {self.server_addr[0]}:{self.server_addr[1]} unreachable: {last}")

    def close(self) -> None:
        """Closes the connection (idempotent)."""
        self._client.close()

    def register(self, reservation: Any) -> Any:
        """Adds ``reservation`` (JSON-serialisable) on the server; returns 'OK'.

        Raises:
            TypeError: ``reservation`` is not JSON-serialisable (e.g. holds bytes).
        """
        return self._request("REG", reservation)

    def get_reservations(self) -> List[Any]:
        """The reservations the server holds now."""
        return self._request("QINFO")

    def await_reservations(self, timeout: float = 600, poll_s: float = 1.0) -> List[Any]:
        """Polls until every reservation arrived, then returns them.

        Raises:
            ReservationTimeoutError: Not complete within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while not self._request("QUERY"):
            if time.monotonic() >= deadline:
                raise ReservationTimeoutError(f"reservations not complete after {timeout} s at {self.server_addr[0]}:{self.server_addr[1]}")
            time.sleep(poll_s)
        return self.get_reservations()

    def request_stop(self) -> Any:
        """Asks the server to stop (its ``done`` becomes True); returns 'OK'."""
        return self._request("STOP")


# ----------------- key files (docs/streaming.md "Asking a streaming cluster to stop from outside")
def write_key_file(addr: ServerAddress) -> str:
    """Writes the key and id of the server at ``addr`` to a file only this user can read
    (see :func:`tfos._control.key_files.write_key_file`); returns its path (driver)."""
    return _key_files.write_key_file(addr)


remove_key_file = _key_files.remove_key_file
read_key_file = _key_files.read_key_file
TFOS_KEY_DIR = _key_files.TFOS_KEY_DIR
_key_path = _key_files.key_path
_key_dir = _key_files.key_dir
