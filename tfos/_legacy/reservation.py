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

import contextlib
import hashlib
import hmac
import json
import logging
import math
import os
import socket
import threading
import time
import uuid
import weakref
from typing import Any, Dict, Iterator, List, Optional, Tuple

from tfos._common import wire as _wire
from tfos._control.client import ControlClient
from tfos._control.server import ControlServer, parse_port_spec
from tfos.errors import (
    ConfigurationError,
    ControlProtocolError,
    DeadlineExceededError,
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


class ServerAddress(tuple):
    """``(host, port)`` of a :class:`Server`, also carrying its key and id (never in repr).

    It indexes and unpacks like TFoS's tuple and pickles with its key, so it can be shipped
    to Spark tasks in a closure (as TFoS's ``cluster_meta['server_addr']`` was).
    """

    key: bytes
    server_id: str

    def __new__(cls, addr: Any, key: bytes = b"", server_id: str = "") -> "ServerAddress":
        obj = super().__new__(cls, addr)
        obj.key = key
        obj.server_id = server_id
        return obj


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


#: Deepest nesting of lists/dicts in a MessageSocket message.
_MSG_MAX_DEPTH = 64


def _check_message(value: Any, depth: int = 0) -> None:
    """Refuses what JSON would change or cannot carry: non-str dict keys, deep nesting."""
    if depth > _MSG_MAX_DEPTH:
        raise ValueError(f"MessageSocket: the message nests deeper than {_MSG_MAX_DEPTH} lists/dicts")
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"MessageSocket: dict keys must be str (JSON would turn {k!r} into a string), got {type(k).__name__}")
            _check_message(v, depth + 1)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _check_message(v, depth + 1)


class _MsgConn:
    """One socket's state in a :class:`MessageSocket`: its session and the lock that makes
    calls on the socket one at a time."""

    __slots__ = ("session", "started", "broken", "foreign", "lock", "__weakref__")

    def __init__(self) -> None:
        self.session: Any = None
        self.started = False
        self.broken = ""
        self.foreign = False
        self.lock = threading.Lock()

    def usable(self) -> None:
        if self.foreign:
            raise TFOSError(
                "MessageSocket: this connection was set up before a fork, in the parent process; a forked process must "
                "open its own connection (sharing one would reuse AES-GCM nonces, which lets an on-path attacker forge "
                "messages)"
            )
        if self.broken:
            raise ConnectionError(f"MessageSocket: the connection is unusable after an earlier error ({self.broken}); open a new one")


#: Every MessageSocket connection and object of this process (made unusable, and their
#: locks new, in a forked child: see _after_fork_in_child).
_MSG_CONNS: "weakref.WeakSet[_MsgConn]" = weakref.WeakSet()
_MSG_SOCKETS: "weakref.WeakSet[MessageSocket]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for conn in list(_MSG_CONNS):
        conn.foreign = True
        conn.lock = threading.Lock()  # a lock held by a thread of the parent would never be released here
    for ms in list(_MSG_SOCKETS):
        ms._lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class MessageSocket:
    """TFoS's message transport over a connected stream socket, authenticated (driver, Spark
    task or TF process; tfos itself does not use it).

    TFoS sent length-prefixed pickles with no authentication. Here a message is a
    JSON-serialisable value (dict keys must be str; tuples come back as lists; NaN and
    infinities are refused; at most 64 levels of nesting), sent as one frame encrypted and
    authenticated with AES-GCM (a 16-byte tag), as tfos's own data frames are, and nothing
    received is parsed before its tag is checked or unpickled at all.

    The first call on a socket runs tfos's mutual handshake (both ends prove they hold
    ``key``, with fresh nonces from both): the side whose first call is :meth:`receive`
    acts as the server, the side whose first call is :meth:`send` as the client, which is
    TFoS's request/reply pattern (the client sends first; if both ends send first, both
    calls fail at their deadline). Each direction then has its own session key and frame
    counter, so a frame replayed, reordered, reflected or moved to another connection fails
    the check. Both ends hold the same key and prove only that: a process that is client
    on one connection and server on another, with the same key, could be spliced to itself
    by an on-path attacker (use one key per pair of parties if that matters).

    One object may serve many sockets and threads; calls on one socket run one at a time
    (a call waits for the one before it, within its own deadline). A connection belongs to
    the process that set it up: in a forked child every call on it raises ``TFOSError``,
    and the child must open its own connection. After any error on a connection (a wrong tag, a
    deadline, a refused or broken frame), every later call on it raises
    ``ConnectionError``: open a new connection.

    Args:
        key: The shared secret: at least 16 bytes, and random (``os.urandom(32)``, or the
            ``key`` of the :class:`ServerAddress` a :class:`Server` returned). A guessable
            key can be found offline from one recorded handshake. Used through a derived
            key, so a tfos cluster key given here cannot authenticate a tfos data
            connection.
        timeout_s: Deadline in seconds of each :meth:`send` / :meth:`receive`, including
            the handshake of a socket's first call (> 0; ``None`` or ``math.inf`` for none).
        max_bytes: Largest encoded message accepted, in bytes (JSON, before the tag; at
            least 16); a longer announced length is refused before anything is allocated.

    Raises:
        ConfigurationError: ``key`` is missing or shorter than 16 bytes, ``timeout_s`` is
            not a number > 0 (``None`` and ``math.inf`` mean no deadline), or ``max_bytes``
            is not an int from 16 to 2**31 - 1.
    """

    #: Domain separation of the derived key from the cluster's data connections.
    _CONTEXT = b"tfos reservation.MessageSocket v1"

    def __init__(self, key: Optional[bytes] = None, timeout_s: float = 60.0, max_bytes: int = 1 << 20):
        if not isinstance(key, (bytes, bytearray)) or len(key) < 16:
            raise ConfigurationError(
                "reservation.MessageSocket needs a shared random key of at least 16 bytes (e.g. ServerAddress.key, or "
                "os.urandom(32) given to both ends); TFoS's unauthenticated pickle transport is not offered"
            )
        if timeout_s is None:
            timeout_s = math.inf
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ConfigurationError(f"MessageSocket timeout_s must be a number of seconds > 0 (or None/math.inf), got {timeout_s!r}")
        from tfos._data.framing import MAX_DATA_FRAME_BYTES

        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or not 16 <= max_bytes <= MAX_DATA_FRAME_BYTES:
            raise ConfigurationError(f"MessageSocket max_bytes must be an int from 16 to {MAX_DATA_FRAME_BYTES}, got {max_bytes!r}")
        derived = hmac.new(bytes(key), self._CONTEXT, hashlib.sha256).digest()
        self._key = lambda: derived  # not an attribute holding bytes: dumps of vars() do not show it
        self.timeout_s = float(timeout_s)
        self.max_bytes = int(max_bytes)
        self._conns: "weakref.WeakKeyDictionary[socket.socket, _MsgConn]" = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()
        _MSG_SOCKETS.add(self)

    def __repr__(self) -> str:
        return f"MessageSocket(timeout_s={self.timeout_s}, max_bytes={self.max_bytes}, connections={len(self._conns)})"

    def _handshake(self, conn: _MsgConn, sock: socket.socket, server: bool, deadline: Any) -> None:
        """The first call on ``sock``: tfos's mutual handshake (``receive`` first: server)."""
        if conn.started:  # an earlier handshake was interrupted: the peer's state is unknown
            raise ConnectionError("MessageSocket: the connection is unusable after an interrupted handshake; open a new one")
        conn.started = True
        role = "receive" if server else "send"
        sock.settimeout(max(0.001, min(deadline.remaining(), _wire.RECV_SLICE_S)))
        handshake = _wire.server_handshake if server else _wire.client_handshake
        try:
            conn.session = handshake(sock, self._key(), deadline)
        except _wire.DataAuthError:
            conn.broken = "the handshake failed"
            raise _wire.DataAuthError(
                f"MessageSocket.{role}: the peer did not prove it holds the key (a wrong key, or not a MessageSocket)"
            ) from None
        except (socket.timeout, DeadlineExceededError):
            conn.broken = "the handshake timed out"
            hint = ("the peer did not answer the handshake: a wrong key on either side, both ends calling send() first, "
                    "or a peer that is not a MessageSocket" if not server else
                    "the peer sent no handshake: both ends calling receive() first, or a peer that is not a MessageSocket")
            raise DeadlineExceededError(
                f"MessageSocket.{role}: no handshake within {self.timeout_s:g} s ({hint}; the side that receives "
                "first acts as the server)"
            ) from None
        except BaseException as exc:
            conn.broken = f"the handshake failed: {type(exc).__name__}"
            raise

    @contextlib.contextmanager
    def _call(self, sock: socket.socket, what: str) -> Iterator[Tuple[_MsgConn, Any]]:
        """One send/receive on ``sock``, one call per socket at a time: its deadline, the
        connection (set up on first use), any error inside marks the connection unusable,
        the socket's own timeout restored."""
        from tfos._common.deadline import Deadline

        deadline = Deadline(self.timeout_s, f"MessageSocket.{what}")
        with self._lock:
            conn = self._conns.get(sock)
            if conn is None:
                conn = self._conns[sock] = _MsgConn()
                _MSG_CONNS.add(conn)
        # One call at a time per socket: concurrent calls would also race on the socket's
        # timeout, which each call sets for its deadline and restores.
        if not conn.lock.acquire(timeout=-1 if deadline.remaining() == math.inf else deadline.remaining()):
            raise deadline.error(extra="another call on this socket did not end")
        try:
            conn.usable()
            saved = sock.gettimeout()
            try:
                if conn.session is None:
                    self._handshake(conn, sock, what == "receive", deadline)
                try:
                    yield conn, deadline
                except BaseException as exc:
                    conn.broken = f"a {what} failed: {type(exc).__name__}"
                    raise
            finally:
                sock.settimeout(saved)
        finally:
            conn.lock.release()

    def send(self, sock: socket.socket, msg: Any) -> None:
        """Sends ``msg`` (a JSON-serialisable value) as one authenticated frame.

        Blocks for at most ``timeout_s`` in all (the socket's own timeout is restored
        after).

        Raises:
            TypeError, ValueError: ``msg`` is not JSON-serialisable (or has a non-str dict
                key, NaN, nests too deeply), or encodes to more than ``max_bytes``. Nothing
                is sent; the connection stays usable.
            DataAuthError: On a socket's first call, the peer did not prove it holds the key
                (a :class:`tfos.errors.ControlProtocolError`).
            ConnectionError: The peer went away, or the connection failed earlier.
            DeadlineExceededError: The handshake or the frame did not finish in time.
            TFOSError: The connection was set up by another process (before a fork).
        """
        from tfos._data.framing import FrameType, seal_frame

        _check_message(msg)
        try:
            payload = json.dumps({"m": msg}, separators=(",", ":"), allow_nan=False).encode("utf-8")
        except TypeError as exc:
            raise TypeError(f"MessageSocket carries JSON values only (str, int, float, bool, None, list, dict): {exc}") from None
        if len(payload) > self.max_bytes:
            raise ValueError(f"MessageSocket: a message of {len(payload)} bytes exceeds max_bytes={self.max_bytes}")
        with self._call(sock, "send") as (conn, deadline):
            _wire.send_all(sock, seal_frame(conn.session, FrameType.DATA, payload), deadline)

    def receive(self, sock: socket.socket) -> Any:
        """Receives one message sent by :meth:`send` on the other end and returns it.

        Blocks for at most ``timeout_s`` (the socket's own timeout is restored after). The
        frame is authenticated before its JSON is parsed.

        Raises:
            DataAuthError: A wrong key (first call on the socket), or a frame that fails its
                tag (tampered, replayed, reordered or reflected).
            ConnectionError: The peer closed the connection, sent an oversize or malformed
                frame, or the connection failed earlier.
            DeadlineExceededError: No whole message within ``timeout_s``.
            TFOSError: The connection was set up by another process (before a fork).
        """
        from tfos._data.framing import FrameType, parse_json, recv_frame

        with self._call(sock, "receive") as (conn, deadline):
            ftype, payload = recv_frame(sock, conn.session, deadline, self.max_bytes)
            if ftype is not FrameType.DATA:
                raise ConnectionError(f"MessageSocket: unexpected {ftype.name} frame")
            try:
                body = parse_json(ftype, payload)
            except RecursionError:
                raise ConnectionError("MessageSocket: the message nests too deeply") from None
            if "m" not in body:
                raise ConnectionError("MessageSocket: a frame without a message")
        return body["m"]


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
#: Environment variable naming the directory of the stop-endpoint key files
#: (default ``~/.tfos/keys``).
TFOS_KEY_DIR = "TFOS_KEY_DIR"


def _key_dir() -> str:
    return os.environ.get(TFOS_KEY_DIR) or os.path.join(os.path.expanduser("~"), ".tfos", "keys")


def _key_path(host: str, port: int) -> str:
    safe = "".join(c if c.isalnum() or c in ".-" else "_" for c in str(host))
    return os.path.join(_key_dir(), f"{safe}_{int(port)}.key")


def _private_key_dir(create: bool) -> str:
    """The key directory, checked: a real directory (not a symlink) owned by this user that
    no other user can enter. A directory of this user with a wider mode is narrowed to 0700
    (INFO); one owned by another user is refused.

    Raises:
        ConfigurationError: The directory is a symlink, not a directory, or owned by another
            user (names the directory and the fix).
        OSError: The directory cannot be created.
    """
    import stat

    path = _key_dir()
    if create:
        os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigurationError(f"key directory {path} is not a directory (a symlink or a file): set {TFOS_KEY_DIR} to a directory of your own")
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise ConfigurationError(
            f"key directory {path} is owned by uid {st.st_uid}, not by this user ({os.getuid()}): another user could "
            f"read or replace the stop key; set {TFOS_KEY_DIR} to a directory of your own"
        )
    if st.st_mode & 0o077:
        log.info("key directory %s had mode %o; narrowing it to 0700", path, stat.S_IMODE(st.st_mode))
        os.chmod(path, 0o700)
    return path


def write_key_file(addr: ServerAddress) -> str:
    """Writes the key and id of the server at ``addr`` to a file only this user can read
    (directory mode 0700, file mode 0600), so that a :class:`Client` given a plain
    ``(host, port)`` in another process of this user finds it (driver).

    The key is written to a new file with a random name (``O_EXCL``: never into a file, FIFO
    or symlink somebody else placed), then renamed over ``<host>_<port>.key``.

    Returns:
        The key file's path (the key itself is never logged).

    Raises:
        ConfigurationError: The key directory is not this user's own (see ``TFOS_KEY_DIR``).
        OSError: The directory or file cannot be written.
    """
    import json
    import tempfile

    path = _key_path(addr[0], addr[1])
    directory = _private_key_dir(create=True)
    fd, tmp = tempfile.mkstemp(prefix=".", suffix=".tmp", dir=directory)  # mode 0600, O_EXCL
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"key": addr.key.hex(), "server_id": addr.server_id}, f)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def remove_key_file(addr: Any) -> None:
    """Removes the key file of ``addr`` (no error when it is gone)."""
    try:
        os.unlink(_key_path(addr[0], addr[1]))
    except FileNotFoundError:
        pass


def read_key_file(host: str, port: int) -> Optional[Tuple[bytes, str]]:
    """``(key, server_id)`` from the key file of ``host:port``, or None when there is none,
    or when it or its directory could be read or replaced by another user, or it is not a
    regular file (then a WARNING names the file)."""
    import json
    import stat

    path = _key_path(host, port)
    try:
        _private_key_dir(create=False)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd) as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                log.warning("ignoring key file %s: not a regular file", path)
                return None
            if hasattr(os, "getuid") and st.st_uid != os.getuid():
                log.warning("ignoring key file %s: owned by uid %d, not by this user", path, st.st_uid)
                return None
            if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
                log.warning("ignoring key file %s: readable by other users (chmod 600 it)", path)
                return None
            data = json.load(f)
        return bytes.fromhex(data["key"]), str(data["server_id"])
    except FileNotFoundError:
        return None
    except ConfigurationError as exc:
        log.warning("ignoring key file %s: %s", path, exc)
        return None
    except (OSError, ValueError, KeyError) as exc:
        log.warning("cannot read key file %s: %s", path, exc)
        return None
