"""Control-plane client (runs in Spark tasks, node supervisors and TF processes).

Executors only dial out to the driver. A :class:`ControlClient` keeps one authenticated
connection for every thread of its process: requests go out as they come (each frame
carries the server's per-connection nonce, the client's own nonce and the next sequence
number, :class:`tfos._control.protocol.ClientSession`), and a reader thread hands each
answer to the request it answers, so a long-poll of one thread never holds up another
thread's heartbeat or report. The connection is opened on the first request and opened
again after it broke.

:func:`shared_client` gives the Spark tasks of one Python worker process one connection
per cluster instead of one per request.
"""

from __future__ import annotations

import collections
import logging
import os
import random
import socket
import threading
import time
from typing import Optional

from tfos._common import wire as _wire
from tfos._common.deadline import Deadline
from tfos._control.messages import Message
from tfos._control.protocol import REFUSED, ClientSession, FrameReader, client_proof
from tfos.errors import ControlProtocolError, DeadlineExceededError

__all__ = ["ControlClient", "shared_client"]

log = logging.getLogger(__name__)

_FRAME_TIMEOUT_S = 30.0
#: First and longest pause (seconds) between two connection attempts; each failed attempt
#: doubles it, with jitter, until the connect budget is spent.
_BACKOFF_FIRST_S = 0.05
_BACKOFF_MAX_S = 2.0
#: Longest single wait of the reader thread for bytes (it then checks its deadlines).
_READ_SLICE_S = 1.0


class _Answer:
    """The answer slot of one request."""

    __slots__ = ("event", "body", "error")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.body: Optional[dict] = None
        self.error: Optional[BaseException] = None


class _Connection:
    """One open connection: its socket, session, unanswered requests and reader thread."""

    def __init__(self, sock: socket.socket, session: ClientSession, key: bytes, owner: "ControlClient"):
        self.sock = sock
        self.session = session
        self.owner = owner
        self.reader = FrameReader(key)
        self.send_lock = threading.Lock()
        self.lock = threading.Lock()
        self.waiting: dict[int, _Answer] = {}
        self.broken: Optional[BaseException] = None
        self.last_rx = time.monotonic()
        sock.settimeout(_READ_SLICE_S)
        self.thread = threading.Thread(target=self._read_loop, name="tfos-control-reader", daemon=True)
        self.thread.start()

    def send(self, msg_type: str, fields: dict, timeout_s: float) -> _Answer:
        """Sends one request; returns its answer slot.

        Raises:
            ConnectionError: The connection is broken (or breaks while sending).
            TypeError, ValueError, ControlProtocolError: The request does not encode.
        """
        answer = _Answer()
        if not self.send_lock.acquire(timeout=max(0.0, timeout_s)):  # another thread's send is stuck
            raise Deadline(timeout_s, f"the control connection to send {msg_type!r}").error()
        try:
            if self.broken is not None:
                raise ConnectionError(f"control connection broken: {self.broken}")
            frames = self.session.encode(msg_type, fields)
            with self.lock:
                self.waiting[frames[-1][0]] = answer
            try:
                self.sock.settimeout(max(0.05, min(timeout_s, _FRAME_TIMEOUT_S)))
                self.sock.sendall(b"".join(f for _, f, _ in frames))
            except OSError as exc:
                self.fail(ConnectionError(f"control request {msg_type!r} could not be sent: {exc}"))
                raise ConnectionError(f"control request {msg_type!r} failed: {exc}") from exc
            finally:
                try:
                    self.sock.settimeout(_READ_SLICE_S)
                except OSError:
                    pass
        finally:
            self.send_lock.release()
        return answer

    def forget(self, answer: _Answer) -> None:
        """Drops a request that timed out (its answer, if it ever comes, is ignored)."""
        with self.lock:
            for seq, slot in list(self.waiting.items()):
                if slot is answer:
                    del self.waiting[seq]

    def fail(self, error: BaseException) -> None:
        """Marks the connection broken, fails every unanswered request, closes the socket."""
        with self.lock:
            if self.broken is None:
                self.broken = error
            waiting, self.waiting = self.waiting, {}
        for slot in waiting.values():
            slot.error = error
            slot.event.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.sock.close()
        except OSError:
            pass

    def _read_loop(self) -> None:
        partial_since: Optional[float] = None
        while self.broken is None:
            try:
                data = self.sock.recv(65536)
            except socket.timeout:
                if partial_since is not None and time.monotonic() - partial_since > _FRAME_TIMEOUT_S:
                    self.fail(DeadlineExceededError(f"the driver did not finish an answer frame in {_FRAME_TIMEOUT_S:g} s"))
                continue
            except OSError as exc:
                self.fail(ConnectionError(f"control connection lost: {exc}"))
                return
            if not data:
                self.fail(ConnectionError("the driver closed the control connection"))
                return
            self.last_rx = time.monotonic()
            self.reader.feed(data)
            while True:
                try:
                    body = self.reader.next()
                    if body is None:
                        break
                    seq = self.session.answers(body)
                except ControlProtocolError as exc:
                    self.fail(exc)
                    return
                self.owner.last_contact = time.monotonic()
                with self.lock:
                    slot = self.waiting.pop(seq, None)
                if slot is not None:
                    slot.body = body
                    slot.event.set()
            if self.reader.in_frame:
                partial_since = partial_since or time.monotonic()
            else:
                partial_since = None


class ControlClient:
    """A thread-safe client of the driver's control server: one connection shared by the
    threads of a process, requests answered in any order.

    Args:
        host: The driver's control server address.
        port: Its port.
        key: The cluster's HMAC key (never logged).
        cluster_id: The cluster id, sent in every frame and checked by the server.
        connect_timeout_s: Seconds allowed to (re)connect before giving up.

    Raises (from :meth:`request` and :meth:`call`):
        ConnectionError: The driver could not be reached within ``connect_timeout_s``, or
            the connection broke (after one resend when ``retry``).
        ControlProtocolError: The server's answer failed authentication, or the request
            is not a valid message.
        DeadlineExceededError: The server did not answer in time.
    """

    def __init__(self, host: str, port: int, key: bytes, cluster_id: str, connect_timeout_s: float = 30.0):
        self._addr = (host, int(port))
        self._key = key
        self._cluster_id = cluster_id
        self._connect_timeout_s = connect_timeout_s
        self._connect_lock = threading.Lock()
        self._conn: Optional[_Connection] = None
        self._pid = os.getpid()
        self._closed = False
        #: Shared by the tasks of a process (:func:`shared_client`): :meth:`close` keeps it open.
        self.shared = False
        #: ``time.monotonic()`` of the last answer from the driver (0.0: none yet).
        self.last_contact = 0.0
        #: The error of the last failed connection attempt (None after a connection):
        #: a ConnectionRefusedError means nothing listens on the control port any more.
        self.last_connect_error: Optional[BaseException] = None

    def __repr__(self) -> str:
        return f"ControlClient(driver={self._addr[0]}:{self._addr[1]}, cluster={self._cluster_id})"

    # --------------------------------------------------------------- connecting
    def _open(self, timeout_s: Optional[float]) -> _Connection:
        deadline = Deadline(
            self._connect_timeout_s if timeout_s is None else timeout_s,
            f"a connection to the tfos driver at {self._addr[0]}:{self._addr[1]}",
            "the driver program exited, or a firewall blocks the control port "
            "(set TFOS_SERVER_HOST/TFOS_SERVER_PORT on the driver)",
        )
        last_err: Optional[BaseException] = None
        pause = _BACKOFF_FIRST_S
        while not deadline.expired():
            sock: Optional[socket.socket] = None
            try:
                sock = socket.create_connection(self._addr, timeout=max(0.05, deadline.slice(10.0)))
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.sendall(client_proof(self._key))  # first, so that a flood of strangers never evicts it
                hello = _read_hello(sock, self._key, max(0.1, min(10.0, deadline.remaining())))
                session = ClientSession(self._key, self._cluster_id, hello)
                conn = _Connection(sock, session, self._key, self)
                self.last_connect_error = None
                sock = None  # owned by the connection now
                return conn
            except (OSError, DeadlineExceededError) as exc:
                # Refused, reset or closed before the hello (a driver under a flood, still
                # starting, or gone): back off and try again within the connect budget.
                last_err = self.last_connect_error = exc
                time.sleep(deadline.slice(pause * random.uniform(0.5, 1.0)))
                pause = min(_BACKOFF_MAX_S, pause * 2)
            finally:
                if sock is not None:  # a failed attempt (wrong key, bad hello...) must not leak it
                    sock.close()
        flood = ""
        if isinstance(last_err, (TimeoutError, socket.timeout, DeadlineExceededError)):
            flood = ("; connects timed out: a flood of connections to the driver's control port (its host drops "
                     "SYNs when the port's queue is full) keeps this process out too, see docs/reliability.md "
                     "\"Floods\"")
        raise ConnectionError(f"{deadline.error().args[0]} (last error: {last_err!r}){flood}")

    def _connection(self, timeout_s: Optional[float]) -> _Connection:
        if self._pid != os.getpid():  # a forked child never uses its parent's connection
            self._conn, self._pid = None, os.getpid()
            self._connect_lock = threading.Lock()
        conn = self._conn
        if conn is not None and conn.broken is None:
            return conn
        budget = self._connect_timeout_s if timeout_s is None else timeout_s
        if not self._connect_lock.acquire(timeout=max(0.0, budget)):
            raise ConnectionError(f"no connection to the tfos driver at {self._addr[0]}:{self._addr[1]} within "
                                  f"{budget:g} s (another thread of this process is connecting)")
        try:
            if self._closed:
                raise ConnectionError("the control client was closed")
            conn = self._conn
            if conn is None or conn.broken is not None:
                conn = self._conn = self._open(timeout_s)
            return conn
        finally:
            self._connect_lock.release()

    def close(self) -> None:
        """Closes the connection (idempotent); a :func:`shared_client` stays open."""
        if not self.shared:
            self._close()

    def _close(self) -> None:
        self._closed = True
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.fail(ConnectionError("the control client was closed"))

    # ----------------------------------------------------------------- requests
    def call(self, msg: Message, timeout_s: float = _FRAME_TIMEOUT_S, retry: bool = True,
             connect_timeout_s: Optional[float] = None) -> dict:
        """Sends the typed message ``msg`` and returns the server's response body.

        Args:
            msg: A message of :mod:`tfos._control.messages`; its fields are checked as the
                server checks them before it is sent (the sender finds its own malformed
                message first).
            timeout_s: Seconds to wait for the response (long-polls pass their poll time
                plus a margin).
            retry: Reconnect and resend once if the connection broke or the answer did not
                come in time (only for idempotent messages). A connection the driver
                closed while no request was open is reopened in any case.
            connect_timeout_s: Seconds allowed to (re)connect for this request (default: the
                client's ``connect_timeout_s``); callers bound it by the time left since
                :attr:`last_contact` so that a dead driver is given up on in time.

        Returns:
            The response body (a dict). A response with ``"error"`` is returned as is.

        Raises:
            ConnectionError, ControlProtocolError, DeadlineExceededError: see the class.
        """
        fields = msg.fields()
        type(msg).decode(fields)
        return self._request(msg.TYPE, fields, timeout_s, retry, connect_timeout_s)

    def send_raw(self, msg_type: str, fields: dict, timeout_s: float = _FRAME_TIMEOUT_S, retry: bool = True) -> dict:
        """Sends a request of another protocol carried in control frames (the TFoS
        reservation server's ``REG``/``QUERY``/...); tfos's own senders use :meth:`call`.

        Raises:
            ConnectionError, ControlProtocolError, DeadlineExceededError: see the class.
        """
        return self._request(msg_type, fields, timeout_s, retry, None)

    def _request(self, msg_type: str, fields: dict, timeout_s: float, retry: bool, connect_timeout_s: Optional[float]) -> dict:
        attempts = 2 if retry else 1
        for attempt in range(attempts):
            try:
                return self._exchange(msg_type, fields, timeout_s, connect_timeout_s)
            except (OSError, DeadlineExceededError) as exc:
                if attempt + 1 >= attempts:
                    if isinstance(exc, OSError) and not isinstance(exc, ConnectionError):
                        raise ConnectionError(f"control request {msg_type!r} failed: {exc}") from exc
                    raise
        raise AssertionError("unreachable")

    def _exchange(self, msg_type: str, fields: dict, timeout_s: float, connect_timeout_s: Optional[float]) -> dict:
        conn = self._connection(connect_timeout_s)
        sent = time.monotonic()
        answer = conn.send(msg_type, fields, timeout_s)
        if not answer.event.wait(timeout_s):
            conn.forget(answer)
            if conn.last_rx < sent:
                # Nothing at all came on this connection since the request went out: it is
                # dead (a driver stopped, a path cut): the next request opens a new one.
                conn.fail(ConnectionError("no answer on the control connection"))
            raise Deadline(timeout_s, f"the driver's answer to {msg_type!r}").error()
        if answer.error is not None:
            raise answer.error
        assert answer.body is not None
        return answer.body


_shared: "collections.OrderedDict[tuple, ControlClient]" = collections.OrderedDict()
_shared_lock = threading.Lock()
#: Clusters whose shared client a process keeps (the oldest is closed beyond).
_SHARED_KEPT = 4


def shared_client(host: str, port: int, key: bytes, cluster_id: str, connect_timeout_s: float = 10.0) -> ControlClient:
    """The control client of this process for one cluster (Spark task side).

    The feed and inference tasks a Python worker runs one after another share one
    connection per cluster (the driver would otherwise accept one connection per request).
    Its :meth:`ControlClient.close` does not close it; the clients of the oldest clusters
    are closed once a process has used more than :data:`_SHARED_KEPT`.
    """
    ident = (os.getpid(), host, int(port), cluster_id, key)
    with _shared_lock:
        client = _shared.get(ident)
        if client is not None:
            _shared.move_to_end(ident)
            return client
        client = ControlClient(host, port, key, cluster_id, connect_timeout_s=connect_timeout_s)
        client.shared = True
        _shared[ident] = client
        while len(_shared) > _SHARED_KEPT:
            _, old = _shared.popitem(last=False)
            old._close()
        return client


def _read_hello(sock: socket.socket, key: bytes, timeout_s: float) -> dict:
    """The server's hello, read after the client's proof.

    Raises:
        ControlProtocolError: The server refused the proof (another key or another
            cluster's driver), or the hello failed authentication.
        ConnectionError, DeadlineExceededError: As :func:`tfos._common.wire.read_frame`.
    """
    deadline = Deadline(timeout_s, "the driver's hello")
    head = _wire.recv_exact(sock, len(REFUSED), deadline)
    if head == REFUSED:
        raise ControlProtocolError("the driver refused this process's proof of the cluster key: frame authentication "
                                   "failed (another key, or another cluster's driver at this address)")
    length = int.from_bytes(head[4:], "big")
    if head[:4] != _wire.MAGIC or length > _wire.MAX_FIRST_FRAME_BYTES:
        raise ControlProtocolError("the driver's hello is not a tfos control frame")
    rest = _wire.recv_exact(sock, 32 + length, deadline)
    return _wire.decode_frame(key, head, rest[:32], rest[32:])
