"""Admission of connections before they authenticate (pure; the driver's control server and
each node's data server).

A client that holds the cluster key proves it in the first bytes it sends, before it reads
anything (:func:`make_proof`: a random nonce and an HMAC of it, bound to the destination:
a proof made for one node is refused by another). A server reads those bytes first
(:class:`ProofChecker`; a nonce seen before is refused, so a proof captured on the wire
cannot be replayed) and only then spends anything on the connection (a hello, a frame
buffer, a thread). A server never leaves connections in the kernel's accept queue: it
accepts until the queue is empty on every turn of its loop (a full queue drops a key
holder's SYN, and the kernel retries it only after 1, 3, 7 s), and holds the connections
that have not proven themselves yet in an :class:`Admission` with a cap: over the cap it
sheds them, oldest first (those past a short grace first, from the peer address that
holds the most). The cap (:data:`UNPROVEN_CAP`) is sized so that at the highest rate one
process opens connections here an unproven connection lives long enough for a loaded key
holder's proof to arrive; a proven connection is never shed. So a flood of strangers from
one process costs a server at most the cap in sockets and a key holder gets in.

:class:`FloodStats` counts what was refused, evicted and rejected, by source address, for
the error a denied client's driver raises (docs/reliability.md "Floods").
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import os
import time
from typing import Any, Callable, Hashable, Optional

__all__ = ["PROOF_BYTES", "GRACE_S", "UNPROVEN_CAP", "listen_backlog", "make_proof", "ProofChecker", "Admission", "FloodStats", "RejectLog", "REMEDY", "DATA_FLOOD", "data_port_reports", "accept_turn", "ACCEPT_SLICE_S"]

_NONCE_BYTES = 16
_MAC_BYTES = 32
#: Bytes of a proof: magic (4), nonce (16), HMAC-SHA256 (32).
PROOF_BYTES = 4 + _NONCE_BYTES + _MAC_BYTES
#: An unproven connection younger than this (seconds) is shed only when no older one is
#: left: a real client's proof is on its way (a loaded process, a slow link).
GRACE_S = 0.25
#: Most unproven connections one server holds. One process on a 2-core host completes up to
#: about 10,000 connections/s here (scripts/bench_flood.py ``fill``); a server that accepts
#: them all keeps each one for the cap / that rate (0.4 s at 4,096) before shedding it, time
#: for a key holder's 52-byte proof, which follows its connect at once, under load
#: (docs/reliability.md "Floods"). Each costs a socket (no buffer beyond 52 bytes).
UNPROVEN_CAP = 4096
#: Nonces of accepted proofs remembered per server (a replayed proof is refused).
_SEEN_NONCES = 1 << 16
#: Source addresses counted by name in :class:`FloodStats` (the rest are summed).
_ADDRESSES_NAMED = 64
#: What to do about a flood, in every error that reports one.
REMEDY = ("run the cluster on a private network, or firewall the driver's and the executors' ports from "
          "other hosts (and set spark.authenticate so that only your own jobs run on the executors)")


def listen_backlog(want: int) -> int:
    """The listen backlog to ask for: the host's most (``net.core.somaxconn``, read from
    /proc; 4096 when it cannot be read), at least ``want``. The kernel caps it anyway; a
    long queue lets a server that drains it at full speed ride out a burst of SYNs."""
    try:
        with open("/proc/sys/net/core/somaxconn") as f:
            most = int(f.read().strip())
    except (OSError, ValueError):
        most = 4096
    return max(int(want), most)


def _mac(key: bytes, magic: bytes, nonce: bytes, bound: bytes) -> bytes:
    return hmac.new(key, magic + nonce + len(bound).to_bytes(2, "big") + bound, hashlib.sha256).digest()


def make_proof(key: bytes, magic: bytes, bound: bytes = b"") -> bytes:
    """The first bytes a client sends (:data:`PROOF_BYTES`): ``magic``, a fresh nonce and
    ``HMAC-SHA256(key, magic || nonce || len(bound) || bound)``.

    Args:
        key: The cluster key.
        magic: 4 bytes naming the plane (the control and data planes use different ones,
            so a proof for one is refused by the other).
        bound: The destination the proof is for (a node's identity, at most 65,535 bytes):
            a server checking with another ``bound`` refuses it, so a proof captured on the
            way to one node is no use at another node of the cluster.
    """
    nonce = os.urandom(_NONCE_BYTES)
    return magic + nonce + _mac(key, magic, nonce, bound)


class ProofChecker:
    """Checks clients' proofs for one server and refuses replays (pure).

    Args:
        key: The cluster key.
        magic: The plane's 4 magic bytes (as given to :func:`make_proof`).
        bound: This server's destination (as given to :func:`make_proof`), or a callable
            that returns it at check time (a node learns its identity after it listens).
    """

    def __init__(self, key: bytes, magic: bytes, bound: "bytes | Callable[[], bytes]" = b""):
        self._key = key
        self._magic = magic
        self._bound = bound
        self._seen: "collections.OrderedDict[bytes, None]" = collections.OrderedDict()

    def check(self, data: bytes) -> Optional[str]:
        """None when ``data`` (exactly :data:`PROOF_BYTES`) is a fresh, valid proof, else
        why it is refused (no key material in it)."""
        if len(data) != PROOF_BYTES or data[:4] != self._magic:
            return "its first bytes are not a tfos proof of the cluster key (bad magic)"
        nonce = data[4:4 + _NONCE_BYTES]
        bound = self._bound() if callable(self._bound) else self._bound
        mac = _mac(self._key, self._magic, nonce, bound)
        if not hmac.compare_digest(mac, data[4 + _NONCE_BYTES:]):
            return ("its proof of the cluster key failed (another key, a proof made for another node of the "
                    "cluster, or not a tfos process)")
        if nonce in self._seen:
            return "it replayed a proof of the cluster key seen before"
        self._seen[nonce] = None
        if len(self._seen) > _SEEN_NONCES:
            self._seen.popitem(last=False)
        return None


class RejectLog:
    """Which rejections to log: the first :attr:`first` of them, then at most one line every
    ``interval_s`` seconds (a flood of 10,000 connections/s must not write 100 lines a second;
    every line carries the running count).
    """

    first = 20

    def __init__(self, interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._last = -float("inf")

    def due(self, n: int) -> bool:
        """Whether the ``n``-th rejection (from 1) gets a log line."""
        now = self._clock()
        if n <= self.first or now - self._last >= self.interval_s:
            self._last = now
            return True
        return False


#: Most connections accepted in one turn of a server's loop (more than the listen backlog a
#: host usually allows: the queue empties in one turn when nothing refills it).
ACCEPT_BURST = 8192
#: Longest turn of accepting (seconds): a flood that refills the accept queue as fast as a
#: loaded loop drains it must not keep the loop from its proven connections (answers,
#: heartbeats) and from reading newcomers' proofs. The rest of the queue is taken in the
#: next turn, after the loop served its other sockets.
ACCEPT_SLICE_S = 0.05
#: Connections accepted between two reads of the proofs that arrived meanwhile.
READ_EVERY = 256


def accept_turn(accept_one: Callable[[], bool], read_proofs: Callable[[], None], shed: Callable[[], None],
                closing: Callable[[], bool]) -> None:
    """One turn of accepting on a listener (the control loop's and a node's data gate):
    ``accept_one()`` until it returns False (the kernel's queue is empty: a full queue drops
    a key holder's SYN, retried only after 1, 3, 7 s), ``closing()``, or
    :data:`ACCEPT_SLICE_S` passed; ``read_proofs()`` then ``shed()`` every
    :data:`READ_EVERY` connections and at the end, so a connection is never shed before the
    loop read what it sent (docs/reliability.md "Floods")."""
    deadline = time.monotonic() + ACCEPT_SLICE_S
    try:
        for i in range(1, ACCEPT_BURST + 1):
            if closing() or not accept_one():
                return
            if i % READ_EVERY == 0:
                read_proofs()
                shed()  # sockets held stay near the cap during a burst
                if time.monotonic() >= deadline:
                    return  # the loop serves its other sockets, then accepts on
    finally:
        read_proofs()
        shed()


#: Prefix of a node's figures that count its data port's flood (:meth:`FloodStats.counters`).
DATA_FLOOD = "flood_data"


def data_port_reports(counters: dict, where: Callable[[int], str], most: int = 3) -> list[str]:
    """One flood sentence per node whose data port turned connections away, from the
    nodes' latest figures (``{executor id: figures}``; driver, pure); ``where(executor
    id)`` names the port and node. At most ``most`` nodes, then one line for the rest."""
    found = []
    for eid in sorted(counters):
        stats = FloodStats.from_counters(counters[eid], DATA_FLOOD)
        if stats.total:
            found.append((eid, stats))
    out = [stats.summary(where(eid)) for eid, stats in found[:most]]
    if len(found) > most:
        out.append(f"and the data ports of {len(found) - most} more node(s) turned connections away too")
    return out


class FloodStats:
    """What one server refused, evicted and rejected before authentication, by source
    address (pure; not thread-safe: one owner thread writes, others read a copy).

    Attributes:
        refused: Connections closed on accept (a cap of connections).
        evicted: Unproven connections closed to make room for newcomers.
        rejected: Connections closed for a bad or missing proof, or a timeout.
    """

    def __init__(self) -> None:
        self.refused = 0
        self.evicted = 0
        self.rejected = 0
        self.by_address: collections.Counter = collections.Counter()
        self.first_at = 0.0
        self.last_at = 0.0

    def count(self, what: str, address: str) -> None:
        """Counts one ``what`` ("refused", "evicted", "rejected") from ``address``."""
        setattr(self, what, getattr(self, what) + 1)
        now = time.time()
        self.first_at = self.first_at or now
        self.last_at = now
        if address in self.by_address or len(self.by_address) < _ADDRESSES_NAMED:
            self.by_address[address] += 1
        else:
            self.by_address["other addresses"] += 1

    @property
    def total(self) -> int:
        return self.refused + self.evicted + self.rejected

    def counters(self, prefix: str) -> dict[str, int]:
        """The counts as integer figures for a node's long-poll (``{}`` when nothing was
        counted): ``<prefix>/rejected``, ``/evicted``, ``/refused``, ``/since`` (Unix
        seconds) and ``<prefix>_src/<address>`` for the 5 top source addresses (the rest
        summed as ``other addresses``: a long-poll stays small). Safe to
        call from another thread than the owner's (one C-level copy of the addresses)."""
        if not self.total:
            return {}
        out = {f"{prefix}/rejected": self.rejected, f"{prefix}/evicted": self.evicted,
               f"{prefix}/refused": self.refused, f"{prefix}/since": int(self.first_at)}
        named = collections.Counter(dict.copy(self.by_address)).most_common()
        for address, n in named[:5]:  # as many as summary() names; the rest summed
            out[f"{prefix}_src/{address}"] = int(n)
        rest = sum(n for _, n in named[5:])
        if rest:
            out[f"{prefix}_src/other addresses"] = out.get(f"{prefix}_src/other addresses", 0) + int(rest)
        return out

    @classmethod
    def from_counters(cls, counters: dict, prefix: str) -> "FloodStats":
        """The stats :meth:`counters` gave, rebuilt (the driver's side; empty when absent)."""
        stats = cls()
        stats.rejected = int(counters.get(f"{prefix}/rejected", 0))
        stats.evicted = int(counters.get(f"{prefix}/evicted", 0))
        stats.refused = int(counters.get(f"{prefix}/refused", 0))
        stats.first_at = float(counters.get(f"{prefix}/since", 0))
        src = f"{prefix}_src/"
        for name, n in counters.items():
            if name.startswith(src):
                stats.by_address[name[len(src):]] = int(n)
        return stats

    def summary(self, where: str) -> str:
        """One sentence for an error message: ``where`` (e.g. "the control port
        10.0.0.1:41234"), the counts, the top source addresses and :data:`REMEDY`; "" when
        nothing was counted."""
        if not self.total:
            return ""
        top = ", ".join(f"{addr} ({n:,})" for addr, n in self.by_address.most_common(5))
        when = time.strftime("%H:%M:%S", time.localtime(self.first_at))
        return (f"{where} turned away {self.total:,} connections that did not prove they hold the cluster key "
                f"({self.rejected:,} rejected, {self.evicted:,} evicted, {self.refused:,} refused at a cap; since "
                f"{when}) from {top}: a flood of connections by a process without the key can keep this cluster's "
                f"own processes out; {REMEDY}")


class Admission:
    """The unproven connections of one server, in accept order (pure; one thread).

    Args:
        cap: Most unproven connections held at once (:meth:`over` then names whom to shed).
        grace_s: Age under which an unproven connection is shed only when no older one is.
    """

    def __init__(self, cap: int = UNPROVEN_CAP, grace_s: float = GRACE_S):
        if cap < 1:
            raise ValueError(f"cap must be >= 1, got {cap}")
        self.cap = cap
        self.grace_s = grace_s
        self._since: "collections.OrderedDict[Hashable, float]" = collections.OrderedDict()
        self._addr: dict[Hashable, str] = {}
        self._by_addr: collections.Counter = collections.Counter()

    def __len__(self) -> int:
        return len(self._since)

    def __contains__(self, conn: Any) -> bool:
        return conn in self._since

    def add(self, conn: Hashable, address: str, now: float) -> None:
        self._since[conn] = now
        self._addr[conn] = address
        self._by_addr[address] += 1

    def remove(self, conn: Hashable) -> bool:
        """Forgets ``conn`` (proven, or closed); True when it was held."""
        if self._since.pop(conn, None) is None:
            return False
        address = self._addr.pop(conn)
        self._by_addr[address] -= 1
        if self._by_addr[address] <= 0:
            del self._by_addr[address]
        return True

    def full(self) -> bool:
        return len(self._since) >= self.cap

    def over(self, now: float) -> list:
        """The connections to shed now to be back at the cap (empty when at or under it),
        in the order to shed them: of those past the grace period, the address that holds
        the most first, oldest first; then the rest, oldest first (a server that accepted
        a burst sheds its oldest newcomers: it never leaves a newcomer in the kernel's
        accept queue, where a key holder's SYN would be dropped)."""
        n = len(self._since) - self.cap
        if n <= 0:
            return []
        top = self._by_addr.most_common(1)[0][0]
        first, old, young = [], [], []
        for conn, since in self._since.items():
            if now - since < self.grace_s:
                young.append(conn)
            elif self._addr[conn] == top:
                first.append(conn)
            else:
                old.append(conn)
            if len(first) >= n:
                break
        return (first + old + young)[:n]

    def expired(self, now: float, timeout_s: float) -> list:
        """The connections held longer than ``timeout_s``, oldest first."""
        out = []
        for conn, since in self._since.items():
            if now - since <= timeout_s:
                break
            out.append(conn)
        return out

    def age(self, conn: Hashable, now: float) -> float:
        """Seconds since ``conn`` was accepted (0.0 when it is not held)."""
        return now - self._since.get(conn, now)

    def address(self, conn: Hashable) -> str:
        return self._addr.get(conn, "?")
