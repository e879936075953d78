"""Control-plane client (runs in Spark tasks, node supervisors and TF processes).

Executors only dial out to the driver. A :class:`ControlClient` keeps one authenticated
connection, sends request frames carrying the server's per-connection nonce, its own
per-connection nonce and an increasing sequence number, and checks that each response
carries both nonces and answers its request.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Optional

from tfos._common import wire as _wire
from tfos._common.deadline import Deadline
from tfos.errors import ControlProtocolError, DeadlineExceededError

__all__ = ["ControlClient"]

log = logging.getLogger(__name__)

_FRAME_TIMEOUT_S = 30.0


class ControlClient:
    """A thread-safe request/response client of the driver's control server.

    Args:
        host: The driver's control server address.
        port: Its port.
        key: The cluster's HMAC key (never logged).
        cluster_id: The cluster id, sent in every frame and checked by the server.
        connect_timeout_s: Seconds allowed to (re)connect before giving up.

    Raises (from :meth:`request`):
        ConnectionError: The driver could not be reached within ``connect_timeout_s``.
        ControlProtocolError: The server's answer failed authentication.
        DeadlineExceededError: The server did not answer in time.
    """

    def __init__(self, host: str, port: int, key: bytes, cluster_id: str, connect_timeout_s: float = 30.0):
        self._addr = (host, int(port))
        self._key = key
        self._cluster_id = cluster_id
        self._connect_timeout_s = connect_timeout_s
        self._lock = threading.Lock()
        self._sock: Optional[socket.socket] = None
        self._snonce = ""
        self._cnonce = ""
        self._seq = 0
        #: ``time.monotonic()`` of the last answer from the driver (0.0: none yet).
        self.last_contact = 0.0
        #: The error of the last failed connection attempt (None after a connection):
        #: a ConnectionRefusedError means nothing listens on the control port any more.
        self.last_connect_error: Optional[BaseException] = None

    def __repr__(self) -> str:
        return f"ControlClient(driver={self._addr[0]}:{self._addr[1]}, cluster={self._cluster_id})"

    def _connect(self, timeout_s: Optional[float] = None) -> None:
        deadline = Deadline(
            self._connect_timeout_s if timeout_s is None else timeout_s,
            f"a connection to the tfos driver at {self._addr[0]}:{self._addr[1]}",
            "the driver program exited, or a firewall blocks the control port "
            "(set TFOS_SERVER_HOST/TFOS_SERVER_PORT on the driver)",
        )
        last_err: Optional[BaseException] = None
        while not deadline.expired():
            sock: Optional[socket.socket] = None
            try:
                sock = socket.create_connection(self._addr, timeout=deadline.slice(10.0))
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                hello_s = max(0.1, min(10.0, deadline.remaining()))
                hello = _wire.read_frame(sock, self._key, Deadline(hello_s, "the driver's hello"), hello_s)
                if hello.get("type") != "hello" or not isinstance(hello.get("sn"), str):
                    raise ControlProtocolError("unexpected first frame from the control server")
                self._sock, self._snonce, self._seq = sock, hello["sn"], 0
                self.last_connect_error = None
                self._cnonce = os.urandom(16).hex()
                sock = None  # owned by the client now
                return
            except (OSError, DeadlineExceededError) as exc:
                last_err = self.last_connect_error = exc
                time.sleep(deadline.slice(0.2))
            finally:
                if sock is not None:  # a failed attempt (wrong key, bad hello...) must not leak it
                    sock.close()
        raise ConnectionError(f"{deadline.error().args[0]} (last error: {last_err!r})")

    def close(self) -> None:
        """Closes the connection (idempotent)."""
        with self._lock:
            if self._sock is not None:
                try:
                    self._sock.close()
                finally:
                    self._sock = None

    def request(
        self, msg_type: str, timeout_s: float = _FRAME_TIMEOUT_S, retry: bool = True,
        connect_timeout_s: Optional[float] = None, **fields,
    ) -> dict:
        """Sends one request and returns the server's response body.

        Args:
            msg_type: The message type, e.g. 'register' or 'heartbeat'.
            timeout_s: Seconds to wait for the response (long-polls pass their poll time
                plus a margin).
            retry: Reconnect and resend once if the connection broke (only for idempotent
                messages).
            connect_timeout_s: Seconds allowed to (re)connect for this request (default: the
                client's ``connect_timeout_s``); callers bound it by the time left since
                :attr:`last_contact` so that a dead driver is given up on in time.
            **fields: JSON-serialisable message fields.

        Returns:
            The response body (a dict). A response with ``"error"`` is returned as is.

        Raises:
            ConnectionError, ControlProtocolError, DeadlineExceededError: see the class.
        """
        with self._lock:
            attempts = 2 if retry else 1
            for attempt in range(attempts):
                try:
                    if self._sock is None:
                        self._connect(connect_timeout_s)
                    assert self._sock is not None
                    frame = self._frame(msg_type, fields)
                    if self._seq == 1 and len(frame) > _wire.MAX_FIRST_FRAME_BYTES:
                        # The server caps a connection's first frame: open with a small one.
                        self._seq = 0
                        self._exchange("hi", self._frame("hi", {}), timeout_s)
                        frame = self._frame(msg_type, fields)
                    return self._exchange(msg_type, frame, timeout_s)
                except (OSError, DeadlineExceededError) as exc:
                    if self._sock is not None:
                        try:
                            self._sock.close()
                        except OSError:
                            pass
                        self._sock = None
                    if attempt + 1 >= attempts:
                        if isinstance(exc, OSError) and not isinstance(exc, ConnectionError):
                            raise ConnectionError(f"control request {msg_type!r} failed: {exc}") from exc
                        raise
            raise AssertionError("unreachable")

    def _frame(self, msg_type: str, fields: dict) -> bytes:
        # The sequence number is taken only once the frame encodes: a message that is not
        # JSON (TypeError) must not leave a gap the server reads as a replayed frame.
        seq = self._seq + 1
        body = dict(fields, type=msg_type, cluster=self._cluster_id, sn=self._snonce, cn=self._cnonce, seq=seq)
        frame = _wire.encode_frame(self._key, body)
        self._seq = seq
        return frame

    def _exchange(self, msg_type: str, frame: bytes, timeout_s: float) -> dict:
        assert self._sock is not None
        self._sock.sendall(frame)
        resp = _wire.read_frame(
            self._sock, self._key, Deadline(timeout_s, f"the driver's answer to {msg_type!r}"), _FRAME_TIMEOUT_S
        )
        if resp.get("re") != self._seq or resp.get("sn") != self._snonce or resp.get("cn") != self._cnonce:
            raise ControlProtocolError("control response does not answer this request")
        self.last_contact = time.monotonic()
        return resp
