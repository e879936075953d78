"""Accepting and authenticating connections on the control event loop (driver, or the
control host under Spark Connect): the caps on open and unproven connections, eviction,
shedding strangers, and each newcomer's proof of the cluster key before any frame is read.
See :mod:`tfos._control.loop` and the rules in :mod:`tfos._control.server`."""

from __future__ import annotations

import errno
import logging
import selectors
import socket
import time

from tfos._common.admission import PROOF_BYTES, accept_turn
from tfos._control.loop_parts import LoopState, _Conn
from tfos._control.protocol import REFUSED

log = logging.getLogger(__name__)

class Accepting(LoopState):
    """The accepting/authenticating part of :class:`tfos._control.loop.EventLoop` (a mixin:
    it uses the loop's ``listener``, ``sel``, ``conns``, ``unproven``, ``checker``, ``pending``
    and ``flood``, and its ``_readable``/``_flush``/``_close``/``reject``)."""

    def _pause_accepting(self, seconds: float) -> None:
        if not self.accept_paused_until:
            self.sel.unregister(self.listener)
        self.accept_paused_until = time.monotonic() + seconds

    def _resume_accepting(self) -> None:
        if self.accept_paused_until:
            self.accept_paused_until = 0.0
            if not self.closing and self.listener.fileno() >= 0:  # not while the loop shuts down
                self.sel.register(self.listener, selectors.EVENT_READ, None)

    def _shed(self) -> None:
        """Closes unproven connections until they are back at their cap, in the order
        :meth:`Admission.over` gives (oldest first, past a short grace first)."""
        now = time.monotonic()
        victims = self.unproven.over(now)
        if not victims:
            return
        held = len(self.unproven)
        for victim in victims:
            self.evicted += 1
            self.flood.count("evicted", victim.peer.rsplit(":", 1)[0])
            self.reject(victim.peer, f"evicted: it sent no proof of the cluster key in {self.unproven.age(victim, now):.2f} s "
                                     f"while {held} connections without one were open (the cap is {self.unproven.cap})")
            self._close(victim)

    def _accept(self) -> None:
        """One turn of accepting (:func:`tfos._common.admission.accept_turn`): newcomers'
        proofs are read when they are there already, the proofs that arrived during the turn
        before anyone is shed, then unproven connections over their cap are shed."""
        accept_turn(self._accept_one, self._read_proofs, self._shed, lambda: self.closing)

    def _read_proofs(self) -> None:
        """Reads the unproven connections that have bytes waiting (no wait)."""
        for key, mask in self.sel.select(0):
            conn = key.data
            if conn is None or isinstance(conn, str):  # the listener, the wake-up pipe
                continue
            if conn.proof is not None and mask & selectors.EVENT_READ and not conn.closed:
                self._readable(conn)

    def _accept_one(self) -> bool:
        """Accepts one connection; False when the queue is empty (or accepting paused)."""
        try:
            sock, addr = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                # Out of descriptors: stop accepting for a moment (else the listener
                # stays readable and the loop spins); clients retry their connects.
                log.warning("tfos control server cannot accept connections: %s (raise the open-files limit, "
                            "ulimit -n)", exc)
                self._pause_accepting(0.5)
            return False
        peer = f"{addr[0]}:{addr[1]}"
        if len(self.conns) - len(self.unproven) >= self.limits.max_connections:
            self.refused += 1  # proven connections at their cap (unproven ones have a cap of their own)
            self.flood.count("refused", addr[0])
            self.reject(peer, f"too many connections (the cap is {self.limits.max_connections})")
            sock.close()
            return True
        now = time.monotonic()
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(sock, peer, self.key, now)
            self.conns[conn.fd] = conn
            conn.mask = selectors.EVENT_READ
            self.sel.register(sock, conn.mask, conn)
        except Exception as exc:  # noqa: BLE001 - one connection's set-up failure closes it only
            self.conns.pop(sock.fileno(), None)
            self.reject(peer, f"internal error: {exc!r}")
            sock.close()
            return True
        self.peak_connections = max(self.peak_connections, len(self.conns))
        self.unproven.add(conn, addr[0], now)
        self._readable(conn)  # its proof is often there already
        return True

    def _proof(self, conn: _Conn, data: bytes) -> bytes:
        """Takes the first bytes of ``conn`` until they make a proof; returns the bytes
        after it (for the frame reader). Closes ``conn`` on a wrong proof."""
        assert conn.proof is not None
        take = PROOF_BYTES - len(conn.proof)
        conn.proof += data[:take]
        if len(conn.proof) < PROOF_BYTES:
            return b""
        why = self.checker.check(bytes(conn.proof))
        if why is not None:
            self.flood.count("rejected", conn.peer.rsplit(":", 1)[0])
            self.reject(conn.peer, why)
            try:
                conn.sock.send(REFUSED)  # the client says so at once (a key holder with another key)
            except OSError:
                pass
            self._close(conn)
            return b""
        conn.proof = None
        self.unproven.remove(conn)
        self.pending[conn] = time.monotonic()
        conn.out += conn.session.hello(self.key)
        self.frames_out += 1
        self._flush(conn)
        return data[take:]
