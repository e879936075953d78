"""Authenticated framing for the control and data planes (pure; runs anywhere).

Control frames (driver <-> executors)::

    magic b"TFO1" | body length (uint32, big-endian) | HMAC-SHA256(key, length || body) | body

The body is UTF-8 JSON. The MAC is checked with :func:`hmac.compare_digest` *before* the
body is decoded, the length is capped *before* the body is read, and nothing is ever
unpickled. Replays are refused without relying on clocks: on every new connection the
server first sends a MAC'd ``hello`` carrying a random server nonce, and every client frame
must carry that nonce and a sequence number one higher than the previous frame's. A frame
captured from another connection or another cluster (another key) is rejected.

Data connections (feed task -> TF process, same host or cluster-internal) authenticate
once with a challenge-response over the same key (:func:`serve_challenge` /
:func:`answer_challenge`), after which frames are ``type (1 byte) | length (uint64) |
payload``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import struct
from typing import Any, Optional

from ._deadline import Deadline
from .errors import ControlProtocolError

__all__ = [
    "MAGIC",
    "MAX_CONTROL_FRAME_BYTES",
    "KEY_BYTES",
    "new_key",
    "encode_frame",
    "decode_frame",
    "read_frame",
    "recv_exact",
    "recv_into",
    "TruncatedFrameError",
    "serve_challenge",
    "answer_challenge",
]

MAGIC = b"TFO1"
_HEADER = struct.Struct(">4sI")
_MAC_BYTES = 32
#: Control bodies are small JSON documents; tracebacks and log lines are truncated to fit.
MAX_CONTROL_FRAME_BYTES = 1 << 20
#: Length of the per-cluster HMAC key, in bytes.
KEY_BYTES = 32
_CHALLENGE_BYTES = 32
_DATA_AUTH_CONTEXT = b"tfos-data-v1"


def new_key() -> bytes:
    """A fresh random per-cluster key of :data:`KEY_BYTES` bytes (driver side)."""
    return os.urandom(KEY_BYTES)


def _mac(key: bytes, *parts: bytes) -> bytes:
    m = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:
        m.update(p)
    return m.digest()


def encode_frame(key: bytes, body: dict) -> bytes:
    """Serialises and authenticates one control frame.

    Args:
        key: The cluster's HMAC key (:data:`KEY_BYTES` bytes).
        body: A JSON-serialisable dict.

    Returns:
        The frame bytes, ready for ``sendall``.

    Raises:
        ControlProtocolError: When the encoded body exceeds :data:`MAX_CONTROL_FRAME_BYTES`.
        TypeError: When ``body`` is not JSON-serialisable.
    """
    payload = json.dumps(body, separators=(",", ":"), allow_nan=False).encode("utf-8")
    if len(payload) > MAX_CONTROL_FRAME_BYTES:
        raise ControlProtocolError(
            f"control frame of {len(payload)} bytes exceeds the cap of "
            f"{MAX_CONTROL_FRAME_BYTES} bytes"
        )
    length = struct.pack(">I", len(payload))
    return MAGIC + length + _mac(key, length, payload) + payload


def decode_frame(key: bytes, header: bytes, mac: bytes, payload: bytes) -> dict:
    """Verifies and decodes one control frame whose parts were already read.

    Args:
        key: The cluster's HMAC key.
        header: The 8 header bytes (magic and length).
        mac: The 32 MAC bytes.
        payload: The body bytes.

    Returns:
        The decoded JSON object.

    Raises:
        ControlProtocolError: On a bad magic, a MAC mismatch (wrong key or tampering), or a
            body that is not a UTF-8 JSON object.
    """
    magic, length = _HEADER.unpack(header)
    if magic != MAGIC:
        raise ControlProtocolError("bad frame magic: not a tfos control frame")
    expected = _mac(key, header[4:], payload)
    if not hmac.compare_digest(expected, mac):
        raise ControlProtocolError("frame authentication failed (wrong key or tampered frame)")
    try:
        body = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise ControlProtocolError("authenticated frame body is not valid JSON") from None
    if not isinstance(body, dict):
        raise ControlProtocolError("authenticated frame body is not a JSON object")
    return body


def recv_into(sock: socket.socket, view: memoryview, deadline: Deadline) -> None:
    """Fills ``view`` from ``sock`` before ``deadline`` (used by both planes).

    Raises:
        ConnectionError: When the peer closes the connection first.
        DeadlineExceededError: When the deadline expires first (slow or stalled peer).
    """
    got, n = 0, len(view)
    while got < n:
        remaining = deadline.remaining()
        if remaining <= 0:
            raise deadline.error(extra=f"received {got} of {n} bytes")
        sock.settimeout(min(remaining, 3600.0))
        try:
            k = sock.recv_into(view[got:], n - got)
        except socket.timeout:
            raise deadline.error(extra=f"received {got} of {n} bytes") from None
        if k == 0:
            raise ConnectionError(f"connection closed after {got} of {n} bytes")
        got += k


def recv_exact(sock: socket.socket, n: int, deadline: Deadline) -> bytes:
    """Reads exactly ``n`` bytes from ``sock`` before ``deadline``.

    Raises:
        ConnectionError: When the peer closes the connection first (``EOFError`` semantics:
            an empty read at a frame boundary is reported the same way).
        DeadlineExceededError: When the deadline expires first (slow or stalled peer).
    """
    buf = bytearray(n)
    recv_into(sock, memoryview(buf), deadline)
    return bytes(buf)


class TruncatedFrameError(ConnectionError):
    """The peer closed the connection in the middle of a control frame (not at a frame
    boundary): a broken or hostile peer, rejected by the control server."""


def _recv_rest(sock: socket.socket, n: int, deadline: Deadline) -> bytes:
    try:
        return recv_exact(sock, n, deadline)
    except ConnectionError as exc:
        raise TruncatedFrameError(f"truncated frame: {exc}") from None


def read_frame(
    sock: socket.socket,
    key: bytes,
    first_byte_deadline: Deadline,
    frame_timeout_s: float,
    max_bytes: int = MAX_CONTROL_FRAME_BYTES,
) -> dict:
    """Reads, size-checks, authenticates and decodes one control frame.

    Args:
        sock: A connected stream socket.
        key: The cluster's HMAC key.
        first_byte_deadline: How long to wait for the frame to start (idle time).
        frame_timeout_s: Once the frame has started, seconds allowed for the rest of it
            (defeats slow-loris peers that trickle bytes).
        max_bytes: Cap on the body length; larger length prefixes are refused unread.

    Returns:
        The authenticated JSON body.

    Raises:
        ConnectionError: The peer closed the connection (:class:`TruncatedFrameError`
            when it did so in the middle of a frame).
        DeadlineExceededError: The frame did not start, or did not finish, in time.
        ControlProtocolError: Bad magic, oversize length, MAC mismatch or bad JSON.
    """
    first = recv_exact(sock, 1, first_byte_deadline)
    frame_deadline = Deadline(frame_timeout_s, "the rest of a control frame")
    header = first + _recv_rest(sock, _HEADER.size - 1, frame_deadline)
    magic, length = _HEADER.unpack(header)
    if magic != MAGIC:
        raise ControlProtocolError("bad frame magic: not a tfos control frame")
    if length > max_bytes:
        raise ControlProtocolError(
            f"frame length prefix {length} exceeds the cap of {max_bytes} bytes"
        )
    mac = _recv_rest(sock, _MAC_BYTES, frame_deadline)
    payload = _recv_rest(sock, length, frame_deadline)
    return decode_frame(key, header, mac, payload)


def serve_challenge(sock: socket.socket, key: bytes, deadline: Deadline) -> None:
    """Server half of the data-connection handshake: proves the peer holds ``key``.

    Sends a random challenge; expects ``HMAC(key, context || challenge)`` back.

    Raises:
        ControlProtocolError: The answer is wrong (stranger or wrong key).
        ConnectionError, DeadlineExceededError: The peer went away or was too slow.
    """
    challenge = os.urandom(_CHALLENGE_BYTES)
    sock.sendall(challenge)
    answer = recv_exact(sock, _MAC_BYTES, deadline)
    if not hmac.compare_digest(answer, _mac(key, _DATA_AUTH_CONTEXT, challenge)):
        raise ControlProtocolError("data connection authentication failed (wrong key)")


def answer_challenge(sock: socket.socket, key: bytes, deadline: Deadline) -> None:
    """Client half of the data-connection handshake (see :func:`serve_challenge`).

    Raises:
        ConnectionError, DeadlineExceededError: The server went away or was too slow.
    """
    challenge = recv_exact(sock, _CHALLENGE_BYTES, deadline)
    sock.sendall(_mac(key, _DATA_AUTH_CONTEXT, challenge))


def json_safe(value: Any, max_chars: Optional[int] = None) -> str:
    """``str(value)``, truncated to ``max_chars`` characters (for reports in frames)."""
    text = str(value)
    if max_chars is not None and len(text) > max_chars:
        text = text[: max_chars - 20] + "... [truncated]"
    return text
