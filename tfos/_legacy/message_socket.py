"""TFoS's ``reservation.MessageSocket``: messages between two processes that share a key,
authenticated and encrypted like a tfos data connection, JSON only (never a pickle). Public
path: :class:`tfos.reservation.MessageSocket`."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import math
import os
import socket
import threading
import weakref
from typing import Any, Iterator, Optional, Tuple

from tfos._common import wire as _wire
from tfos.errors import ConfigurationError, DeadlineExceededError, TFOSError

__all__ = ["MessageSocket"]


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
