"""The control protocol without I/O (pure; runs anywhere).

The same code speaks the protocol in the driver's event loop
(:mod:`tfos._control.server`), in every node process (:mod:`tfos._control.client`) and
in the cluster simulator (``scripts/sim_cluster.py``):

* a client's first bytes are a proof that it holds the key (:func:`client_proof`), read
  by the server before it sends its ``hello``;
* :class:`FrameReader` cuts authenticated frames out of the bytes of a stream, refusing an
  oversize length prefix before the body arrives and checking each MAC before decoding;
* :class:`ServerSession` / :class:`ClientSession` hold one connection's nonces and sequence
  numbers: every client frame carries the server's nonce (``sn``, from the ``hello``), the
  client's own (``cn``) and the next sequence number (``seq``); every answer carries both
  nonces and the number it answers (``re``). A client may send several requests before
  the answers come (one connection serves every thread of a process); the server may
  answer them in any order, each exactly once.

It also holds what a request handler gives back to the server: an answer (a dict), a
:class:`LongPoll` (an answer deferred until the cluster state changes or its poll time
ends) and, for the server, a :class:`Call` (whether the handler may block and so runs off
the event loop).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import struct
from typing import Any, Callable, Hashable, Iterable, Optional, Protocol, Union

from tfos._common import wire as _wire
from tfos._common.admission import make_proof
from tfos.errors import ControlProtocolError

__all__ = [
    "FrameReader", "ServerSession", "ClientSession", "LongPoll", "Call", "Routes", "Topic",
    "node_topic", "Reply", "RawJSON", "PROOF_MAGIC", "REFUSED", "client_proof",
]

_HEADER = struct.Struct(">4sI")
#: The magic of a control client's proof of the key (:func:`client_proof`).
PROOF_MAGIC = b"TFP1"
#: What the server sends instead of its hello to a client whose proof failed: a frame
#: header no frame can have (a length over every cap), so the client fails at once.
REFUSED = _wire.MAGIC + b"\xff\xff\xff\xff"


def client_proof(key: bytes) -> bytes:
    """The first bytes a control client sends, right after it connected and before it reads
    the server's hello: proof that it holds the cluster key
    (:func:`tfos._common.admission.make_proof`), so the server never evicts its connection
    for a stranger's (docs/reliability.md "Floods")."""
    return make_proof(key, PROOF_MAGIC)
_MAC_BYTES = 32
#: Client nonces are this many hex characters (16 random bytes).
CNONCE_CHARS = 32


class FrameReader:
    """Incremental reader of control frames from a byte stream (pure).

    Args:
        key: The cluster's HMAC key.
        max_bytes: Cap on a frame body; may be raised between frames (a connection's
            first frame has a smaller cap, :data:`tfos._common.wire.MAX_FIRST_FRAME_BYTES`).
    """

    __slots__ = ("_key", "max_bytes", "_buf")

    def __init__(self, key: bytes, max_bytes: int = _wire.MAX_CONTROL_FRAME_BYTES):
        self._key = key
        self.max_bytes = max_bytes
        self._buf = bytearray()

    def feed(self, data: Union[bytes, bytearray, memoryview]) -> None:
        """Appends bytes received from the stream."""
        self._buf += data

    @property
    def in_frame(self) -> bool:
        """True while part of a frame has arrived (a started frame must finish in time)."""
        return bool(self._buf)

    @property
    def buffered(self) -> int:
        """Bytes received and not yet consumed."""
        return len(self._buf)

    def next(self) -> Optional[dict]:
        """The next complete frame's authenticated JSON body, or None until it has arrived.

        Raises:
            ControlProtocolError: Bad magic, a length prefix over :attr:`max_bytes`
                (before the body is read), a MAC mismatch, or a body that is not a JSON
                object (with NaN/Infinity refused).
        """
        buf = self._buf
        if len(buf) < _HEADER.size:
            return None
        magic, length = _HEADER.unpack_from(buf)
        if magic != _wire.MAGIC:
            raise ControlProtocolError("bad frame magic: not a tfos control frame")
        if length > self.max_bytes:
            raise ControlProtocolError(f"frame length prefix {length} exceeds the cap of {self.max_bytes} bytes")
        end = _HEADER.size + _MAC_BYTES + length
        if len(buf) < end:
            return None
        mac_end = _HEADER.size + _MAC_BYTES
        body = _wire.decode_frame(self._key, bytes(buf[:_HEADER.size]), bytes(buf[_HEADER.size:mac_end]), bytes(buf[mac_end:end]))
        del buf[:end]
        return body


class ServerSession:
    """The server half of one control connection's replay protection (pure).

    Attributes:
        snonce: The server nonce sent in the ``hello`` (32 hex characters).
        seq: The sequence number of the last accepted client frame (0: none yet).
        cnonce: The client's nonce, fixed by its first frame (None before).
    """

    __slots__ = ("snonce", "seq", "cnonce")

    def __init__(self) -> None:
        self.snonce = os.urandom(16).hex()
        self.seq = 0
        self.cnonce: Optional[str] = None

    def hello(self, key: bytes) -> bytes:
        """The connection's first frame (server to client)."""
        return _wire.encode_frame(key, {"type": "hello", "sn": self.snonce})

    def accept(self, body: dict) -> int:
        """Checks a client frame's envelope; returns its sequence number.

        Raises:
            ControlProtocolError: A frame of another connection (nonce), replayed or out
                of order (sequence number), or without this connection's client nonce.
        """
        if body.get("sn") != self.snonce or body.get("seq") != self.seq + 1:
            raise ControlProtocolError("replayed or out-of-order frame")
        cn = body.get("cn")
        if not isinstance(cn, str) or len(cn) != CNONCE_CHARS or (self.cnonce is not None and cn != self.cnonce):
            raise ControlProtocolError("frame without this connection's client nonce")
        self.cnonce = cn
        self.seq += 1
        return self.seq

    def answer(self, key: bytes, seq: int, reply: dict) -> bytes:
        """The frame answering request ``seq`` with ``reply`` (:class:`RawJSON` values are
        spliced in as they are).

        Raises:
            TypeError, ValueError, ControlProtocolError: ``reply`` is not JSON or too big.
        """
        body = dict(reply, re=seq, sn=self.snonce, cn=self.cnonce)
        raw = [k for k, v in body.items() if isinstance(v, RawJSON)]
        if not raw:
            return _wire.encode_frame(key, body)
        text = json.dumps({k: v for k, v in body.items() if k not in raw}, separators=(",", ":"), allow_nan=False)
        spliced = "".join(f",{json.dumps(k)}:{body[k].text}" for k in raw)
        return _wire.frame_of_payload(key, (text[:-1] + spliced + "}").encode("utf-8"))


class ClientSession:
    """The client half of one control connection (pure).

    Args:
        key: The cluster's HMAC key.
        cluster_id: Sent in every frame; the server checks it.
        hello: The server's authenticated ``hello`` body.

    Raises:
        ControlProtocolError: ``hello`` is not a hello.
    """

    __slots__ = ("_key", "_cluster_id", "snonce", "cnonce", "seq")

    def __init__(self, key: bytes, cluster_id: str, hello: dict):
        if hello.get("type") != "hello" or not isinstance(hello.get("sn"), str):
            raise ControlProtocolError("unexpected first frame from the control server")
        self._key = key
        self._cluster_id = cluster_id
        self.snonce: str = hello["sn"]
        self.cnonce = os.urandom(16).hex()
        self.seq = 0

    def _frame(self, msg_type: str, fields: dict, seq: int) -> bytes:
        body = dict(fields, type=msg_type, cluster=self._cluster_id, sn=self.snonce, cn=self.cnonce, seq=seq)
        return _wire.encode_frame(self._key, body)

    def encode(self, msg_type: str, fields: dict) -> list[tuple[int, bytes, bool]]:
        """The frames that send one request: ``[(seq, frame, is_hi), ...]``.

        A connection's first frame is capped (:data:`tfos._common.wire.MAX_FIRST_FRAME_BYTES`);
        a larger first request goes after a small ``hi`` frame, whose answer the caller
        discards. Sequence numbers are taken only once the request encodes, so a message
        that is not JSON leaves no gap the server would read as a replay.

        Raises:
            TypeError, ValueError: ``fields`` is not JSON (NaN/Infinity refused).
            ControlProtocolError: The body exceeds the frame cap.
        """
        seq = self.seq + 1
        frame = self._frame(msg_type, fields, seq)
        if seq == 1 and len(frame) > _wire.MAX_FIRST_FRAME_BYTES:
            hi = self._frame("hi", {}, 1)
            frame = self._frame(msg_type, fields, 2)
            self.seq = 2
            return [(1, hi, True), (2, frame, False)]
        self.seq = seq
        return [(seq, frame, False)]

    def answers(self, body: dict) -> int:
        """Checks that ``body`` answers a request of this connection; returns its ``re``.

        Raises:
            ControlProtocolError: Another connection's (or server's) answer, or one to a
                request never sent.
        """
        re = body.get("re")
        if (body.get("sn") != self.snonce or body.get("cn") != self.cnonce or isinstance(re, bool)
                or not isinstance(re, int) or not 1 <= re <= self.seq):
            raise ControlProtocolError("control response does not answer this request")
        return re


# ------------------------------------------------------------- handler results
class RawJSON:
    """A value of an answer that is JSON text already (encoded once for many answers,
    e.g. the cluster spec every node awaits).

    Attributes:
        text: The JSON text of the value.
    """

    __slots__ = ("text",)

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return f"RawJSON({self.text[:60]!r})"


class Topic(enum.Enum):
    """What changed in a cluster state (a long-poll is checked again on the topics it
    watches; every change also counts as :attr:`ANY`)."""

    ANY = "any"
    #: Every node registered.
    FORMED = "formed"
    #: A directive changed: stop, feed_closed, abort, failed, or a counter report asked.
    DIRECTIVES = "directives"


def node_topic(executor_id: int) -> tuple[str, int]:
    """The topic of one node's own changes (its state, its stack request and answer)."""
    return ("node", executor_id)


@dataclasses.dataclass(eq=False)
class LongPoll:
    """An answer deferred until the state changes or ``timeout_s`` passes.

    The server first subscribes to ``topics``, then calls ``ready()``; it calls it again
    after every change of one of the topics. The first dict ``ready()`` returns is the
    answer; when ``timeout_s`` passes first, ``expire()`` gives it. Both run on the
    server's event loop: they must not block (take the state lock, read, return).

    Attributes:
        topics: :class:`Topic` members or :func:`node_topic` keys.
        ready: The answer once the awaited condition holds, else None.
        timeout_s: The poll time, in seconds.
        expire: The answer at the end of the poll time.
    """

    topics: tuple[Hashable, ...]
    ready: Callable[[], Optional[dict]]
    timeout_s: float
    expire: Callable[[], dict]


#: What a request handler returns.
Reply = Union[dict, LongPoll]


@dataclasses.dataclass(frozen=True)
class Call:
    """One validated request, ready to run.

    Attributes:
        run: Computes the answer (or a :class:`LongPoll`).
        offload: True when ``run`` may block (Spark calls on a failure, writing to the
            driver's stderr): the server runs it on its small handler pool, never on
            the event loop.
    """

    run: Callable[[], Reply]
    offload: bool = False


class Routes(Protocol):
    """The request side of a cluster state, as the control server uses it."""

    def prepare(self, body: dict, peer: str) -> Call:
        """Validates an authenticated request body (cluster id, type, fields).

        Raises:
            ControlProtocolError: The request is not valid; its connection is closed.
        """
        ...

    def add_change_listener(self, listener: Callable[[Iterable[Hashable]], None]) -> None:
        """Calls ``listener(topics)`` on every state change (from any thread, possibly
        under the state's lock: it must only take note and return)."""
        ...


def is_routes(obj: Any) -> bool:
    """True for an object that implements :class:`Routes`."""
    return callable(getattr(obj, "prepare", None)) and callable(getattr(obj, "add_change_listener", None))
