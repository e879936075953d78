"""The door of a node's data server: accepting and proof checking (TF process, InputMode.SPARK).

One thread serves the node's listeners (its TCP port and its Unix-domain socket) with
:mod:`selectors`: it accepts connections, reads each one's first bytes, which must be a
proof that the feed task holds the cluster key (:func:`tfos._common.admission.make_proof`,
sent by :func:`tfos._common.wire.client_handshake` before it reads anything), and only then
hands the connection to the hub (a thread of its own, the mutual handshake, the frames).
A connection without a proof costs a socket and 52 bytes, never a thread. The gate empties
its listeners' kernel queues on every turn (a stranger never waits there in a feed task's
way), holds at most :data:`MAX_UNPROVEN` unproven connections and sheds the oldest over
that (:class:`tfos._common.admission.Admission`), so a feed task's proof, which follows
its connect at once, is read before a flood of strangers from one process could shed it
(docs/reliability.md "Floods"). A proof is bound to the node's identity: one captured on
the way to another node of the cluster is refused here.
"""

from __future__ import annotations

import errno
import logging
import selectors
import socket
import threading
import time
from typing import Callable, cast

from tfos._common.admission import (
    PROOF_BYTES,
    UNPROVEN_CAP,
    Admission,
    FloodStats,
    ProofChecker,
    RejectLog,
    accept_turn,
)
from tfos._common.wire import DATA_PROOF_MAGIC, data_refusal

__all__ = ["FeedGate", "MAX_UNPROVEN"]

log = logging.getLogger(__name__)

#: Most connections held at once before they proved they hold the key.
MAX_UNPROVEN = UNPROVEN_CAP
#: Seconds a connection may take to send its proof.
PROOF_TIMEOUT_S = 10.0
_SWEEP_S = 0.25


class _Pending:
    __slots__ = ("sock", "peer", "got")

    def __init__(self, sock: socket.socket, peer: tuple):
        self.sock, self.peer, self.got = sock, peer, bytearray()


class FeedGate:
    """Accepts on ``listeners`` and passes each connection that proved it holds the key to
    ``admit(sock, peer)`` (a blocking socket; runs on the gate's thread, must not block).

    Args:
        listeners: Bound, listening sockets.
        key: The cluster key.
        admit: Takes a proven connection.
        node_name: For log messages.
        on_reject: Called once per connection turned away (the hub's counter).
        address: The TCP listener's ``host:port``, for the flood report.
        identity: Returns the node's identity (:func:`tfos._common.wire.node_identity`;
            b"" until it is known), to which a feed task binds its proof.
    """

    def __init__(self, listeners: list, key: bytes, admit: Callable[[socket.socket, tuple], None], node_name: str,
                 on_reject: Callable[[], None], address: str = "", identity: Callable[[], bytes] = lambda: b""):
        self.node_name = node_name
        self.address = address
        self._admit = admit
        self._on_reject = on_reject
        self._key = key
        self._identity = identity
        self._checker = ProofChecker(key, DATA_PROOF_MAGIC, identity)
        self.unproven = Admission(MAX_UNPROVEN)
        self.flood = FloodStats()
        self._listeners = [s for s in listeners if s is not None]
        self._sel = selectors.DefaultSelector()
        for lst in self._listeners:
            lst.setblocking(False)
            self._sel.register(lst, selectors.EVENT_READ, None)
        self._paused_until = 0.0
        self._closing = False
        self._logged = 0
        self._reject_log = RejectLog()
        self.thread = threading.Thread(target=self._run, name="tfos-feed-accept", daemon=True)
        self.thread.start()

    def close(self) -> None:
        """Stops the gate (the hub closes the listeners); unproven connections are closed.
        Logs a WARNING with :meth:`report` when connections were turned away."""
        self._closing = True
        if self.flood.evicted or self.flood.refused:
            log.warning("%s", self.report())

    # ---------------------------------------------------------------- the loop
    def _run(self) -> None:
        next_sweep = time.monotonic()
        try:
            while not self._closing:
                now = time.monotonic()
                if self._paused_until and now >= self._paused_until:
                    self._resume()
                accept = []
                try:
                    events = self._sel.select(max(0.0, min(_SWEEP_S, next_sweep - now)))
                except (OSError, ValueError):
                    if self._closing:
                        return
                    raise
                for key, _ in events:
                    if key.data is None:
                        accept.append(cast(socket.socket, key.fileobj))
                    else:
                        self._read(key.data)
                for lst in accept:  # after the reads: a proof that arrived is seen before any eviction
                    self._accept(lst)
                now = time.monotonic()
                if now >= next_sweep:
                    for p in self.unproven.expired(now, PROOF_TIMEOUT_S):
                        self._reject(p, f"no proof of the cluster key in {PROOF_TIMEOUT_S:g} s")
                    next_sweep = now + _SWEEP_S
        except Exception:  # noqa: BLE001 - logged; the node then serves no new feed task
            if not self._closing:
                log.exception("node %s: the data server's accept loop failed", self.node_name)
        finally:
            for p in list(self._held()):
                self._drop(p)
            self._sel.close()

    def _held(self) -> list:
        return [key.data for key in self._sel.get_map().values() if key.data is not None]

    def _pause(self, seconds: float) -> None:
        if not self._paused_until:
            for lst in self._listeners:
                try:
                    self._sel.unregister(lst)
                except (KeyError, ValueError):
                    pass
        self._paused_until = time.monotonic() + seconds

    def _resume(self) -> None:
        if self._paused_until:
            self._paused_until = 0.0
            for lst in self._listeners:
                if not self._closing and lst.fileno() >= 0:  # not once the hub closed them
                    self._sel.register(lst, selectors.EVENT_READ, None)

    def _accept(self, lst: socket.socket) -> None:
        """One turn of accepting on ``lst`` (:func:`tfos._common.admission.accept_turn`):
        newcomers' proofs are read when they are there already, the proofs that arrived
        during the turn before anyone is shed, then unproven connections over their cap."""
        accept_turn(lambda: self._accept_one(lst), self._read_proofs, self._shed, lambda: self._closing)

    def _read_proofs(self) -> None:
        """Reads the unproven connections that have bytes waiting (no wait)."""
        try:
            events = self._sel.select(0)
        except (OSError, ValueError):
            return
        for key, _ in events:
            if key.data is not None:
                self._read(key.data)

    def _accept_one(self, lst: socket.socket) -> bool:
        try:
            sock, peer = lst.accept()
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as exc:
            if self._closing:
                return False
            log.warning("node %s: accepting a data connection failed: %s", self.node_name, exc)
            if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                self._pause(0.5)
            return False
        if sock.family not in (socket.AF_INET, socket.AF_INET6):
            peer = ("local", "unix")
        p = _Pending(sock, peer)
        try:
            sock.setblocking(False)
            self._sel.register(sock, selectors.EVENT_READ, p)
        except (OSError, ValueError):
            sock.close()
            return True
        self.unproven.add(p, str(peer[0]), time.monotonic())
        self._read(p)  # the proof is often there already
        return True

    def _shed(self) -> None:
        """Closes unproven connections until they are back at their cap, in the order
        :meth:`Admission.over` gives (oldest first, past a short grace first)."""
        now = time.monotonic()
        victims = self.unproven.over(now)
        held = len(self.unproven)
        for victim in victims:
            self.flood.count("evicted", str(victim.peer[0]))
            self._reject(victim, f"evicted: no proof of the cluster key in {self.unproven.age(victim, now):.2f} s "
                                 f"while {held} connections without one were open (the cap is {self.unproven.cap})",
                         count=False)

    def _read(self, p: _Pending) -> None:
        try:
            data = p.sock.recv(PROOF_BYTES - len(p.got))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:  # reset before its proof (connect/close churn): counted, not logged
            self._reject(p, f"connection failed before its proof: {exc}", log_it=False)
            return
        if not data:
            self._reject(p, "closed before its proof of the cluster key", log_it=bool(p.got))
            return
        p.got += data
        if len(p.got) < PROOF_BYTES:
            return
        why = self._checker.check(bytes(p.got))
        if why is not None:
            try:
                # a feed task with another key fails at once; one whose proof was for another node learns which
                p.sock.send(data_refusal(self._key, bytes(p.got), self._identity()))
            except OSError:
                pass
            self._reject(p, why)
            return
        self._drop(p, close=False)
        try:
            p.sock.setblocking(True)
            self._admit(p.sock, p.peer)
        except Exception as exc:  # noqa: BLE001 - one connection's failure closes it only
            log.warning("node %s: could not serve a data connection from %s: %r", self.node_name, p.peer[0], exc)
            p.sock.close()

    def _drop(self, p: _Pending, close: bool = True) -> None:
        self.unproven.remove(p)
        try:
            self._sel.unregister(p.sock)
        except (KeyError, ValueError):
            pass
        if close:
            try:
                p.sock.close()
            except OSError:
                pass
        if self._paused_until and not self.unproven.full() and time.monotonic() >= self._paused_until:
            self._resume()

    def _reject(self, p: _Pending, why: str, count: bool = True, log_it: bool = True) -> None:
        self._drop(p)
        if count:
            self.flood.count("rejected", str(p.peer[0]))
        self._on_reject()
        if log_it:
            self._logged += 1
            n = self._logged
            if self._reject_log.due(n):
                log.warning("node %s rejected a data connection from %s:%s: %s (%d so far)",
                            self.node_name, p.peer[0], p.peer[1], why, n)

    def report(self) -> str:
        """The flood sentence for a log or an error (``""`` when nothing was turned away):
        the data port, the counts, the source addresses, the remedy."""
        return self.flood.summary(f"the tfos data port {self.address} of node {self.node_name}")

