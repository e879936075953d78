"""The control event loop's small parts (pure; the driver's control server): its deadlines,
one connection's state, a deferred answer and how a handler's result is carried back.
See :mod:`tfos._control.loop`."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import selectors
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Hashable, Optional, Union

from tfos._common import wire as _wire
from tfos._common.admission import Admission, FloodStats, ProofChecker
from tfos._control.limits import ControlLimits
from tfos._control.protocol import Call, FrameReader, LongPoll, ServerSession
from tfos.errors import ControlProtocolError

__all__ = ["Timeouts"]


@dataclasses.dataclass(frozen=True)
class Timeouts:
    """The loop's deadlines, in seconds (read from the server at every check).

    Attributes:
        first_frame_s: For a new connection to send its first frame.
        frame_s: To finish a frame once its first byte arrived (slow-loris defence).
        idle_s: An authenticated connection may stay idle (no request open) this long.
        write_s: A peer may leave an answer unread this long.
    """

    first_frame_s: float
    frame_s: float
    idle_s: float
    write_s: float


class _Conn:
    """One connection's state on the loop."""

    __slots__ = ("sock", "fd", "peer", "reader", "session", "out", "out_since", "last_rx", "frame_since",
                 "inflight", "polls", "closed", "mask", "proof")

    def __init__(self, sock: socket.socket, peer: str, key: bytes, now: float):
        self.sock = sock
        self.fd = sock.fileno()
        self.peer = peer
        self.reader = FrameReader(key, _wire.MAX_FIRST_FRAME_BYTES)
        self.session = ServerSession()
        self.out = bytearray()
        self.out_since = 0.0
        self.last_rx = now
        self.frame_since: Optional[float] = None
        self.inflight = 0
        self.polls: set[_Poll] = set()
        self.closed = False
        self.mask = 0
        #: The first bytes received until they make a proof of the key (None once proven).
        self.proof: Optional[bytearray] = bytearray()


class _Poll:
    """A deferred answer on the loop."""

    __slots__ = ("conn", "seq", "lp", "done")

    def __init__(self, conn: _Conn, seq: int, lp: LongPoll):
        self.conn, self.seq, self.lp, self.done = conn, seq, lp, False


class _Reject:
    """A pooled handler's refusal, carried back to the loop."""

    __slots__ = ("why",)

    def __init__(self, why: str):
        self.why = why


def _malformed(body: dict, exc: BaseException) -> str:
    return f"malformed {str(body.get('type'))[:40]!r} message: {type(exc).__name__}: {str(exc)[:200]}"


def _run_call(call: Call, body: dict) -> Any:
    """Runs a decoded request's handler (the loop thread, or a handler thread when the call
    may block); a refusal or a malformed message becomes the reply's rejection."""
    try:
        return call.run()
    except ControlProtocolError as exc:
        return _Reject(str(exc))
    except Exception as exc:  # noqa: BLE001 - a malformed message from a key holder
        return _Reject(_malformed(body, exc))


class LoopState:
    """What the event loop's parts share (:class:`tfos._control.loop.EventLoop` sets it all
    in its ``__init__``): the attributes and the methods one part calls in another."""

    key: bytes
    limits: ControlLimits
    listener: socket.socket
    sel: selectors.BaseSelector
    prepare: Callable[[dict, str], Call]
    conns: dict[int, _Conn]
    unproven: Admission
    checker: ProofChecker
    flood: FloodStats
    pending: dict[_Conn, float]
    partial: set[_Conn]
    topics: dict[Hashable, set[_Poll]]
    poll_heap: list[tuple[float, int, _Poll]]
    _poll_ids: itertools.count
    dirty: set[Hashable]
    done: collections.deque
    pool: ThreadPoolExecutor
    closing: bool
    accept_paused_until: float
    _lock: threading.Lock
    refused: int
    evicted: int
    frames_in: int
    frames_out: int
    peak_connections: int

    def wake(self) -> None:
        raise NotImplementedError

    def reject(self, peer: str, why: str) -> None:
        raise NotImplementedError

    def _readable(self, conn: _Conn) -> None:
        raise NotImplementedError

    def _flush(self, conn: _Conn) -> None:
        raise NotImplementedError

    def _close(self, conn: _Conn) -> None:
        raise NotImplementedError

    def _answer(self, conn: _Conn, seq: int, reply: dict) -> None:
        raise NotImplementedError

    def _start_poll(self, conn: _Conn, seq: int, lp: LongPoll) -> None:
        raise NotImplementedError

    def _resume_accepting(self) -> None:
        raise NotImplementedError

    def _complete(self, conn: _Conn, seq: int, result: Union[dict, LongPoll, _Reject]) -> None:
        raise NotImplementedError
