"""Authenticated framing for the control and data planes (pure; runs anywhere).

Control frames (driver <-> executors)::

    magic b"TFO1" | body length (uint32, big-endian) | HMAC-SHA256(key, length || body) | body

The body is UTF-8 JSON. The MAC is checked with :func:`hmac.compare_digest` *before* the
body is decoded, the length is capped *before* the body is read, and nothing is ever
unpickled. Replays are refused without relying on clocks: on every new connection the
server first sends a MAC'd ``hello`` carrying a random server nonce, and every client frame
must carry that nonce and a sequence number one higher than the previous frame's. A frame
captured from another connection or another cluster (another key) is rejected.

Every client frame also carries a client nonce chosen at connect (``cn``), which the server
echoes in its responses, so a response from an earlier connection (or another server
instance) cannot be replayed to a client either. A connection's first frame is capped at
:data:`MAX_FIRST_FRAME_BYTES` before it is read.

Data connections (feed task -> TF process) start with a mutual handshake bound to both
sides' nonces, to the direction and to the node the feed task means to reach
(:func:`server_handshake` / :func:`client_handshake`); the feed task sends nothing but its
nonce and proof until the node has proven it is that node. Every later frame is encrypted
and authenticated (AES-GCM) under a per-connection, per-direction session key and a
sequence number (:class:`DataSession`, framing in :mod:`tfos._data.framing`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import struct
from typing import Any, Mapping, Optional, Protocol, Union

from tfos._common.deadline import Deadline
from tfos.errors import ControlProtocolError

__all__ = [
    "MAGIC",
    "MAX_CONTROL_FRAME_BYTES",
    "KEY_BYTES",
    "new_key",
    "encode_frame",
    "frame_of_payload",
    "decode_frame",
    "read_frame",
    "recv_exact",
    "recv_into",
    "TruncatedFrameError",
    "DataAuthError",
    "DataRelayError",
    "DataSession",
    "node_identity",
    "server_handshake",
    "client_handshake",
    "loads_strict",
    "MAX_FIRST_FRAME_BYTES",
]

MAGIC = b"TFO1"
_HEADER = struct.Struct(">4sI")
_MAC_BYTES = 32
#: Control bodies are small JSON documents; tracebacks and log lines are truncated to fit.
MAX_CONTROL_FRAME_BYTES = 1 << 20
#: Cap on the first frame of a control connection, read before its sender is known to hold
#: the key: a stranger cannot make the server allocate more than this per connection.
#: A client whose first request is larger sends a small ``hi`` frame first.
MAX_FIRST_FRAME_BYTES = 16 << 10
#: Length of the per-cluster HMAC key, in bytes.
KEY_BYTES = 32
_CHALLENGE_BYTES = 32
_DATA_AUTH_CONTEXT = b"tfos-data-v3"


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
    return frame_of_payload(key, json.dumps(body, separators=(",", ":"), allow_nan=False).encode("utf-8"))


def frame_of_payload(key: bytes, payload: bytes) -> bytes:
    """Authenticates an already encoded JSON body into one control frame (see
    :func:`encode_frame`; the control server splices a body encoded once for many answers).

    Raises:
        ControlProtocolError: When ``payload`` exceeds :data:`MAX_CONTROL_FRAME_BYTES`.
    """
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
        body = loads_strict(payload)
    except (UnicodeDecodeError, ValueError):
        raise ControlProtocolError("authenticated frame body is not valid JSON (or holds NaN/Infinity)") from None
    if not isinstance(body, dict):
        raise ControlProtocolError("authenticated frame body is not a JSON object")
    return body


def _no_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name} in JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"non-finite number {text[:40]} in JSON")
    return value


def loads_strict(data: Union[bytes, bytearray, memoryview, str]) -> Any:
    """``json.loads`` that refuses NaN, Infinity and numbers that overflow to infinity.

    Used for every JSON body received on either plane (after its frame authenticated).

    Raises:
        ValueError: Not UTF-8 JSON, or a non-finite number.
    """
    text = data if isinstance(data, str) else bytes(data).decode("utf-8")
    return json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)


#: Longest socket timeout ``recv_into``/``send_all`` set at once; longer deadlines are waited
#: in slices.
RECV_SLICE_S = 3600.0


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
        sock.settimeout(min(remaining, RECV_SLICE_S))
        try:
            k = sock.recv_into(view[got:], n - got)
        except socket.timeout:
            continue  # the loop ends at the deadline (above), not at a one-hour slice of it
        if k == 0:
            raise ConnectionError(f"connection closed after {got} of {n} bytes")
        got += k


def send_all(sock: socket.socket, data: Union[bytes, bytearray, memoryview], deadline: Deadline) -> None:
    """Sends all of ``data`` before ``deadline`` (``sendall`` gives each call the whole
    socket timeout anew; this bounds the whole send).

    Raises:
        DeadlineExceededError: When the deadline expires first (a peer that reads slowly
            or not at all).
        OSError: The connection broke.
    """
    view = memoryview(data).cast("B")
    sent, n = 0, len(view)
    while sent < n:
        remaining = deadline.remaining()
        if remaining <= 0:
            raise deadline.error(extra=f"sent {sent} of {n} bytes")
        sock.settimeout(min(remaining, RECV_SLICE_S))
        try:
            sent += sock.send(view[sent:])
        except socket.timeout:
            continue  # the loop ends at the deadline (above), not at a one-hour slice of it


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


class DataAuthError(ControlProtocolError):
    """The peer of a data connection did not prove it holds the cluster key.

    Raised on the feed-task side when the *node* fails to authenticate (a process without
    the key listening on a released data port, or a relay), and on the node side when the
    feed task fails. The message never contains key material.

    Attributes:
        address: Where a feed task reached the failing peer (a Unix socket path or
            ``host:port``), "" when not known.
        connection: The feed task's connection to it (``local -> remote`` endpoints, and
            the listener's owner when it is on the task's host), "" when not known.
    """

    address: str = ""
    connection: str = ""


class DataRelayError(DataAuthError):
    """The process at a node's data address passed the feed task's handshake on to another
    node of the cluster (a relay without the key), which refused it: raised on the feed-task
    side. Nothing but a nonce and a proof was sent.

    Attributes:
        reached: The name of the node the handshake was relayed to.
    """

    reached: str = ""


class _Identified(Protocol):
    """What :func:`node_identity` reads (a :class:`tfos.cluster_template.NodeInfo`)."""

    @property
    def executor_id(self) -> int: ...
    @property
    def job_name(self) -> str: ...
    @property
    def task_index(self) -> int: ...
    @property
    def host(self) -> str: ...
    @property
    def data_port(self) -> int: ...


def node_identity(node: _Identified) -> bytes:
    """The identity a data connection's handshake binds (pure): the node's executor id,
    role and the data address it registered (host and TCP port; the same whether the task
    connects there or to the node's Unix socket).

    A feed task proves it holds the key *for the node it meant to reach*, and that node
    proves it is that node: a relay that passes the handshake to another node fails.
    """
    return json.dumps([node.executor_id, node.job_name, node.task_index, node.host, node.data_port],
                      separators=(",", ":")).encode("utf-8")


def _gcm() -> Any:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    return AESGCM


_IN_PLACE: Optional[bool] = None


def _in_place_ok() -> bool:
    """Whether ``AESGCM.decrypt_into`` may write the plaintext over its own ciphertext
    (checked once per process on a known answer; without it, a frame is decrypted into a
    second buffer)."""
    global _IN_PLACE
    if _IN_PLACE is None:
        try:
            aead = _gcm()(bytes(range(32)))
            nonce, text = bytes(12), bytes(range(200)) * 3
            buf = bytearray(aead.encrypt(nonce, text, b"h"))
            view = memoryview(buf)
            aead.decrypt_into(nonce, view, b"h", view[: len(text)])
            _IN_PLACE = bytes(buf[: len(text)]) == text
        except Exception:  # noqa: BLE001 - any failure: decrypt into a second buffer
            _IN_PLACE = False
    return _IN_PLACE


class DataSession:
    """Per-connection, per-direction encryption and authentication of a data connection
    (pure).

    Every data frame's payload is encrypted with AES-256-GCM, and its 9-byte header (type
    and length) is authenticated with it as associated data: no byte of a row can be read on
    the wire, and a frame whose header, payload or tag was altered is refused before
    anything acts on it. The 96-bit GCM nonce is ``sequence number (uint64) || frame type
    || three zero bytes``: each direction has its own session key and its own counter, so
    a nonce is never reused under one key, a frame's type is bound to it, and a replayed,
    dropped, reordered or reflected frame fails the check.

    The session keys are derived from the cluster key, both sides' handshake nonces and
    the node's identity (:func:`server_handshake`), so they are fresh for every connection.

    Cost: encrypting plus decrypting with AES-GCM (AES-NI and carry-less multiply) runs at
    about 10 GB/s of CPU time on the project's machine, against 0.8 GB/s for HMAC-SHA256
    tags alone (``scripts/bench_frame_tags.py``); the payload is encrypted straight from
    the sender's buffers (several parts are gathered by the encryption itself) into one
    send buffer that the session reuses, and decrypted in place in the receive buffer.

    Args:
        send_key: 32-byte key of frames this side sends.
        recv_key: 32-byte key of frames this side receives.
    """

    TAG_BYTES = 16
    #: Send buffers up to this size are kept for the next frame.
    _KEEP_BYTES = 8 << 20

    def __init__(self, send_key: bytes, recv_key: bytes):
        aead = _gcm()
        self._tx = aead(send_key)
        self._tx_key = send_key
        self._rx = aead(recv_key)
        self._tx_seq = 0
        self._rx_seq = 0
        self._out = bytearray()

    def _out_view(self, n: int) -> memoryview:
        if n <= self._KEEP_BYTES:
            if len(self._out) < n:
                self._out = bytearray(n)
            return memoryview(self._out)[:n]
        return memoryview(bytearray(n))

    def _next_nonce(self, ftype: int) -> bytes:
        self._tx_seq += 1
        return _NONCE.pack(self._tx_seq, ftype)

    def seal(self, ftype: int, head: bytes, payload: Union[bytes, bytearray, memoryview]) -> memoryview:
        """The ciphertext and tag of the next outgoing frame (call in send order, one
        thread at a time).

        Args:
            ftype: The frame type byte.
            head: The frame's header (authenticated, sent in clear).
            payload: The plaintext.

        Returns:
            The payload's size in bytes plus ``TAG_BYTES`` in the session's send buffer:
            send them before the next call.
        """
        data = _byte_view(payload)
        out = self._out_view((len(data) if data is not None else 0) + self.TAG_BYTES)
        self._tx.encrypt_into(self._next_nonce(ftype), data if data is not None else b"", head, out)
        return out

    def seal_parts(self, ftype: int, head: bytes, parts: Any, n: int) -> memoryview:
        """As :meth:`seal` for a payload that is the concatenation of ``parts`` (``n``
        bytes in all): the parts are encrypted one after the other into the send buffer,
        never joined first. The receiver decrypts the frame as one payload.

        Args:
            parts: Bytes-like objects, in payload order (the Arrow buffers of a record
                batch, PySpark's batches and their length prefixes).
        """
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

        out = self._out_view(n + self.TAG_BYTES)
        enc = Cipher(algorithms.AES(self._tx_key), modes.GCM(self._next_nonce(ftype))).encryptor()
        enc.authenticate_additional_data(head)
        at = 0
        for part in parts:
            view = _byte_view(part)
            if view is not None:
                at += enc.update_into(view, out[at:])
        if at != n:
            raise ValueError(f"the parts hold {at} bytes, not the {n} announced")
        enc.finalize()
        out[n:] = enc.tag
        return out

    def open(self, ftype: int, head: bytes, buf: bytearray) -> None:
        """Decrypts and verifies the next incoming frame in place.

        Args:
            ftype: The frame type byte.
            head: The frame's header as received.
            buf: Ciphertext and tag as received; on return it holds the plaintext only
                (truncated by :data:`TAG_BYTES`).

        Raises:
            DataAuthError: Wrong tag: a tampered, injected, replayed, reordered or
                reflected frame, or another key. ``buf`` then holds nothing usable.
        """
        from cryptography.exceptions import InvalidTag

        self._rx_seq += 1
        nonce = _NONCE.pack(self._rx_seq, ftype)
        n = len(buf) - self.TAG_BYTES
        if n < 0:
            raise DataAuthError(f"data frame {self._rx_seq} is shorter than its tag")
        try:
            view = memoryview(buf)
            if _in_place_ok():
                self._rx.decrypt_into(nonce, view, head, view[:n])
                del view
            else:
                plain = bytearray(n)
                self._rx.decrypt_into(nonce, view, head, plain)
                del view
                buf[:n] = plain
        except InvalidTag:
            raise DataAuthError(
                f"data frame {self._rx_seq} failed authentication (tampered, injected, replayed or reordered)"
            ) from None
        del buf[n:]  # truncating a bytearray in place does not copy the payload


def _byte_view(payload: Any) -> Any:
    """``payload`` as something ``cryptography`` reads without a copy (None when empty).

    Buffers exported with another format than unsigned bytes (a ``pyarrow.Buffer`` exports
    signed chars, numpy arrays their dtype) are recast, which copies nothing.
    """
    if not len(payload):
        return None
    if isinstance(payload, (bytes, bytearray)):
        return payload
    view = memoryview(payload)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


_NONCE = struct.Struct(">QB3x")
_DATA_MAGIC = b"TFD3"
_HELLO = struct.Struct(">4s32s")  # magic, nonce
_IDENTITY_LEN = struct.Struct(">H")


def _bound(key: bytes, label: bytes, snonce: bytes, cnonce: bytes, identity: bytes) -> bytes:
    """HMAC of one handshake message: the direction label, both nonces and the node's
    identity (length-prefixed)."""
    return _mac(key, _DATA_AUTH_CONTEXT, label, snonce, cnonce, _IDENTITY_LEN.pack(len(identity)), identity)


def _session_keys(key: bytes, snonce: bytes, cnonce: bytes, identity: bytes) -> tuple[bytes, bytes]:
    """(client->server key, server->client key) of one data connection."""
    return (_bound(key, b" key c2s ", snonce, cnonce, identity), _bound(key, b" key s2c ", snonce, cnonce, identity))


def server_handshake(sock: socket.socket, key: bytes, deadline: Deadline, identity: bytes = b"") -> DataSession:
    """Server (node) half of the mutual data-connection handshake.

    1. server -> client: ``"TFD3" | server nonce (32 random bytes)``;
    2. client -> server: ``"TFD3" | client nonce (32) | HMAC(key, "client" Ns Nc identity)``;
    3. server -> client: ``HMAC(key, "server" Ns Nc identity)``, or, when the client's proof
       is wrong, ``HMAC(key, "refuse" Ns Nc identity)`` and the connection closes.

    ``identity`` is the node's (:func:`node_identity`): the client proves it holds the key
    for the node it meant to reach, and the node proves it is that node. Both proofs
    cover both nonces and carry a direction label, so neither can be replayed on another
    connection, reflected to the other side, or relayed to any effect: a relay to another
    node fails there (and the refusal, bound to the refusing node, tells the feed task which
    node it reached), and a relay to the right node ends up with a session whose keys it
    does not know, encrypting every frame. Every message before authentication has a fixed
    size (nothing is allocated from an announced length).

    Args:
        identity: This node's identity (b"" for connections not bound to a node, as
            ``tfos.reservation.MessageSocket``'s).

    Returns:
        The connection's :class:`DataSession` (frames from now on are encrypted).

    Raises:
        DataAuthError: The client's proof is wrong (stranger, wrong key, a handshake meant
            for another node: a relay).
        ConnectionError, DeadlineExceededError: The peer went away or was too slow.
    """
    snonce = os.urandom(_CHALLENGE_BYTES)
    sock.sendall(_HELLO.pack(_DATA_MAGIC, snonce))
    answer = recv_exact(sock, _HELLO.size + _MAC_BYTES, deadline)
    magic, cnonce = _HELLO.unpack_from(answer)
    if magic != _DATA_MAGIC:
        raise DataAuthError("data connection: bad handshake magic (not a tfos feed task of this version)")
    proof = answer[_HELLO.size:]
    if not hmac.compare_digest(proof, _bound(key, b" client ", snonce, cnonce, identity)):
        try:  # tells a feed task whose handshake was relayed here which node it reached
            sock.sendall(_bound(key, b" refuse ", snonce, cnonce, identity))
        except OSError:
            pass
        raise DataAuthError(
            "data connection authentication failed: the proof was not made with the cluster key for this node "
            "(a stranger, or a feed task's handshake relayed from another node's data address)"
        )
    sock.sendall(_bound(key, b" server ", snonce, cnonce, identity))
    c2s, s2c = _session_keys(key, snonce, cnonce, identity)
    return DataSession(send_key=s2c, recv_key=c2s)


def client_handshake(sock: socket.socket, key: bytes, deadline: Deadline, identity: bytes = b"",
                     others: Optional[Mapping[bytes, str]] = None) -> DataSession:
    """Client (feed task) half of the handshake (see :func:`server_handshake`).

    Nothing but a fresh nonce and a proof bound to the server's nonce and to the identity
    of the node the task means to reach is sent before the server has proven it is that
    node.

    Args:
        identity: The identity of the node the task means to reach (:func:`node_identity`).
        others: ``{identity: name}`` of the cluster's other nodes: a refusal from one of
            them means the connection was relayed there (:class:`DataRelayError`).

    Returns:
        The connection's :class:`DataSession`.

    Raises:
        DataRelayError: Another node of the cluster answered (it refused the proof): a
            process at this node's address relayed the handshake.
        DataAuthError: The server did not prove it is the node: the process listening on
            the port is not this cluster's node (e.g. it took over a released port).
        ConnectionError, DeadlineExceededError: The server went away or was too slow.
    """
    hello = recv_exact(sock, _HELLO.size, deadline)
    magic, snonce = _HELLO.unpack(hello)
    if magic != _DATA_MAGIC:
        raise DataAuthError("the peer did not start a tfos data handshake (bad magic)")
    cnonce = os.urandom(_CHALLENGE_BYTES)
    sock.sendall(_HELLO.pack(_DATA_MAGIC, cnonce) + _bound(key, b" client ", snonce, cnonce, identity))
    # A peer that closes here is handled as an unreachable node (ConnectionError): a real
    # node under a flood of strangers sheds unauthenticated connections this way.
    proof = recv_exact(sock, _MAC_BYTES, deadline)
    if not hmac.compare_digest(proof, _bound(key, b" server ", snonce, cnonce, identity)):
        for other, name in (others or {}).items():
            if hmac.compare_digest(proof, _bound(key, b" refuse ", snonce, cnonce, other)):
                err = DataRelayError(f"the handshake reached {name}, which refused it: a process in between relayed it there")
                err.reached = name
                raise err
        if hmac.compare_digest(proof, _bound(key, b" refuse ", snonce, cnonce, identity)):
            raise DataAuthError("the node refused the handshake (it does not take this proof)")
        raise DataAuthError("the peer failed to prove it holds the cluster key")
    c2s, s2c = _session_keys(key, snonce, cnonce, identity)
    return DataSession(send_key=c2s, recv_key=s2c)
