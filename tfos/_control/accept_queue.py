"""Evidence that a listener's own accept queue overflowed (Linux): the queue's length and
its limit from ``TCP_INFO`` on the listening socket, and the host's TcpExt ListenDrops
counter read only while this queue was seen full. The host counter alone counts drops at
every listener of the host (another program's, a port scan elsewhere): tfos speaks of a
flood on its port only with evidence on that port (docs/reliability.md "Floods")."""

from __future__ import annotations

import socket
import struct
from typing import Optional

# struct tcp_info: 8 one-byte fields, then u32 rto, ato, snd_mss, rcv_mss, unacked, sacked.
# For a listening socket the kernel reports unacked = its accept queue's length now and
# sacked = the queue's limit (the listen() backlog).
_TCP_INFO_HEAD = struct.Struct("8B6I")


def listen_drops() -> int:
    """The host's count of connection attempts dropped at a full accept queue (Linux
    ``/proc/net/netstat`` TcpExt ListenDrops; 0 elsewhere), every listener of the host."""
    try:
        with open("/proc/net/netstat") as f:
            lines = [ln.split() for ln in f if ln.startswith("TcpExt:")]
        names, values = lines[0], lines[1]
        return int(values[names.index("ListenDrops")])
    except (OSError, IndexError, ValueError):
        return 0


def accept_queue(listener: socket.socket) -> Optional[tuple[int, int]]:
    """``(length, limit)`` of ``listener``'s accept queue now, or None where ``TCP_INFO``
    does not say (not Linux, a closed socket)."""
    opt = getattr(socket, "TCP_INFO", None)
    if opt is None:
        return None
    try:
        raw = listener.getsockopt(socket.IPPROTO_TCP, opt, _TCP_INFO_HEAD.size)
    except OSError:
        return None
    if len(raw) < _TCP_INFO_HEAD.size:
        return None
    fields = _TCP_INFO_HEAD.unpack(raw)
    return fields[12], fields[13]


class QueueWatch:
    """Counts the times one listener's accept queue was found full and the host's
    ListenDrops rise over the spans it stayed full (one owner thread: the event loop).

    Args:
        listener: The listening socket.
        read_queue: ``accept_queue`` (tests pass a fake).
        read_drops: ``listen_drops`` (tests pass a fake).
    """

    def __init__(self, listener: socket.socket, read_queue=accept_queue, read_drops=listen_drops):
        self._listener = listener
        self._read_queue = read_queue
        self._read_drops = read_drops
        self.full_seen = 0  # samples that found the queue full
        self.limit = 0
        self.drops = 0  # host ListenDrops rise over the spans this queue was full
        self._drops_at: Optional[int] = None  # the counter when the current full span began

    def sample(self) -> None:
        """Reads the queue; opens or closes a span of fullness (cheap: one getsockopt,
        and a read of /proc only at a span's edges)."""
        q = self._read_queue(self._listener)
        if q is None:
            return
        length, limit = q
        self.limit = limit
        if limit and length >= limit:
            self.full_seen += 1
            if self._drops_at is None:
                self._drops_at = self._read_drops()
        elif self._drops_at is not None:
            self.drops += max(0, self._read_drops() - self._drops_at)
            self._drops_at = None

    def summary(self) -> str:
        """A clause for the flood report; "" when this queue was never found full."""
        if not self.full_seen:
            return ""
        drops = self.drops
        if self._drops_at is not None:
            drops += max(0, self._read_drops() - self._drops_at)
        text = f"its accept queue was found full ({self.limit} connections waiting) {self.full_seen:,} times"
        if drops:
            text += (f", and the kernel dropped {drops:,} connection attempts to full accept queues while it was "
                     f"(TcpExt ListenDrops)")
        return text
