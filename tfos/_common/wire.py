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
sequence number (:class:`DataSession` in :mod:`tfos._common.data_session`, framing in
:mod:`tfos._data.framing`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import struct
from typing import Any, Mapping, Optional, Protocol, Union

from tfos._common.admission import PROOF_BYTES, ProofChecker, make_proof
from tfos._common.data_session import DataAuthError, DataRelayError, DataSession
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
    "DATA_PROOF_MAGIC",
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


_DATA_MAGIC = b"TFD3"
#: The magic of a feed task's proof of the key, its first bytes on a data connection
#: (:func:`tfos._common.admission.make_proof`).
DATA_PROOF_MAGIC = b"TFA1"
#: What a node sends instead of its hello when a feed task's proof of the key failed.
DATA_REFUSED = b"TFDX" + bytes(_CHALLENGE_BYTES)
_REFUSED_MAGIC = b"TFDR"


def data_refusal(key: bytes, proof: bytes, identity: bytes) -> bytes:
    """What a node sends instead of its hello when a feed task's first bytes (``proof``) are
    refused (:data:`DATA_REFUSED`'s size): ``"TFDR" | HMAC(key, "refuse0" proof-nonce
    identity)`` when ``proof`` has a proof's shape, so that a feed task whose proof was made
    for another node (a relay took its node's address) learns which node it reached;
    :data:`DATA_REFUSED` otherwise."""
    if len(proof) != PROOF_BYTES or proof[:4] != DATA_PROOF_MAGIC:
        return DATA_REFUSED
    return _REFUSED_MAGIC + _bound(key, b" refuse0 ", proof[4:4 + 16], b"", identity)
_HELLO = struct.Struct(">4s32s")  # magic, nonce
_IDENTITY_LEN = struct.Struct(">H")


def _bound(key: bytes, label: bytes, snonce: bytes, cnonce: bytes, identity: bytes) -> bytes:
    """HMAC of one handshake message: the direction label, both nonces and the node's
    identity (length-prefixed)."""
    return _mac(key, _DATA_AUTH_CONTEXT, label, snonce, cnonce, _IDENTITY_LEN.pack(len(identity)), identity)


def _session_keys(key: bytes, snonce: bytes, cnonce: bytes, identity: bytes) -> tuple[bytes, bytes]:
    """(client->server key, server->client key) of one data connection."""
    return (_bound(key, b" key c2s ", snonce, cnonce, identity), _bound(key, b" key s2c ", snonce, cnonce, identity))


def server_handshake(sock: socket.socket, key: bytes, deadline: Deadline, identity: bytes = b"",
                     proven: bool = False) -> DataSession:
    """Server (node) half of the mutual data-connection handshake.

    0. client -> server, right after it connected: a proof that it holds the key
       (:data:`DATA_PROOF_MAGIC`, a nonce, an HMAC of both; read by the node's accept loop,
       :mod:`tfos._data.feed_gate`, before it spends a thread on the connection);
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
        proven: The caller already read and checked step 0 (else it is read here).

    Returns:
        The connection's :class:`DataSession` (frames from now on are encrypted).

    Raises:
        DataAuthError: The client's proof is wrong (stranger, wrong key, a handshake meant
            for another node: a relay).
        ConnectionError, DeadlineExceededError: The peer went away or was too slow.
    """
    if not proven:
        first = recv_exact(sock, PROOF_BYTES, deadline)
        why = ProofChecker(key, DATA_PROOF_MAGIC, identity).check(first)
        if why is not None:
            try:
                sock.sendall(data_refusal(key, first, identity))
            except OSError:
                pass
            raise DataAuthError(f"data connection authentication failed: {why}")
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

    Nothing but a proof of the key (step 0), a fresh nonce and a proof bound to the
    server's nonce and to the identity of the node the task means to reach is sent before
    the server has proven it is that node.

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
    first = make_proof(key, DATA_PROOF_MAGIC, identity)
    sock.sendall(first)  # first; bound to the node (refused by any other)
    hello = recv_exact(sock, _HELLO.size, deadline)
    if hello[:4] == DATA_PROOF_MAGIC:  # the peer speaks first as a client too: no hello will come
        recv_exact(sock, PROOF_BYTES - _HELLO.size, deadline)
        hello = recv_exact(sock, _HELLO.size, deadline)  # ends at the deadline, as with a silent server
    if hello[:4] == _REFUSED_MAGIC:
        for other, name in (others or {}).items():
            if hmac.compare_digest(hello, data_refusal(key, first, other)):
                err = DataRelayError(f"the handshake reached {name}, which refused it: a process in between relayed it there")
                err.reached = name
                raise err
        hello = DATA_REFUSED
    if hello == DATA_REFUSED:
        raise DataAuthError("the node refused this feed task's proof of the cluster key (another key: a feed task "
                            "of another cluster, or not this cluster's node at that address)")
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
