#!/usr/bin/env python
"""CPU cost of the feed's hop from the Spark task to the TF process, per data frame.

A train feed task forwards each PySpark pickled batch (about 98 KB: 32 MNIST rows of
784 float32 and a label) unchanged to the node's TF process over a Unix-domain socket
(same host) or TCP; the TF process unpickles it. A plain Spark pass (the ceiling of
``bench_feed.py``) unpickles the same batch in the Python worker and sends nothing. This
script times, in one process (both ends; CPU time, all threads), for one frame:

- ``tfos frame``: ``send_frame`` + ``recv_frame`` (AES-GCM encryption into the session's
  send buffer, header, ``sendmsg``, receive, decryption and tag check in place) over a
  loopback TCP connection (a feed task on another host, or one whose node has no Unix
  socket) and over a Unix-domain socket (a feed task on the node's host);
- ``bare socket``: the same bytes through the same kind of connection with ``sendall`` and
  ``recv_into`` into one reused buffer (no tfos: the kernel's two copies);
- ``AES-GCM``: encryption plus decryption alone (:class:`tfos._common.wire.DataSession`);
- ``GMAC``: a tag plus its check alone, without encryption (what frames carried before
  they were encrypted; ``cryptography``'s AESGCM over the payload as associated data);
- ``unpickle``: ``pickle.loads`` of the batch (the per-frame work both paths share).

It prints microseconds per frame (min / median / max of ``--repeat`` runs) and the CPU
seconds per 100,000 rows. The difference between ``tfos frame`` and ``bare socket`` is
what tfos adds to moving the bytes; ``bare socket`` is what any process hop costs.

It then times the whole path of 100,000 rows through a node, both ends in this process
(CPU s, all threads; min / median / max, the two modes interleaved in each repeat): a feed
task's sends over a Unix-domain socket, the node's reader thread (``FeedHub``: receive,
tag check, bounded queue) and ``DataFeed.next_batch(1000)`` in the main thread (unpickling),
with each PySpark batch sent as its own frame (``one batch per frame``) and with the
batches packed into frames of ``PACK_BYTES`` (``packed``, what feed tasks send). The
row count and the label sum are checked in every run.

Usage::

    .venv/bin/python scripts/bench_frame_hop.py --repeat 7
"""

from __future__ import annotations

import argparse
import os
import pickle
import socket
import statistics
import struct
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tfos._common.deadline import Deadline  # noqa: E402
from tfos._common.wire import DataSession  # noqa: E402
from tfos._data.framing import FrameType, recv_frame, send_frame  # noqa: E402

ROWS_PER_FRAME = 32


def _pair(family: str = "tcp") -> tuple[socket.socket, socket.socket]:
    if family == "unix":  # a same-host feed task's connection to its node
        return socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    a = socket.create_connection(srv.getsockname())
    b, _ = srv.accept()
    srv.close()
    return a, b


def _per_frame_us(send_one, recv_one, frames: int) -> float:
    """CPU microseconds of the whole process per frame, a sender thread and this receiver."""
    done = threading.Event()

    def sender() -> None:
        for _ in range(frames):
            send_one()
        done.set()

    t = threading.Thread(target=sender, daemon=True)
    c0 = time.process_time()
    t.start()
    for _ in range(frames):
        recv_one()
    t.join()
    return (time.process_time() - c0) / frames * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--frames", type=int, default=2000, help="frames per run")
    ap.add_argument("--no-path", action="store_true", help="skip the feed-path comparison (one batch per frame / packed)")
    args = ap.parse_args()

    import numpy as np

    rng = np.random.default_rng(0)
    batch = [(rng.random(784, dtype=np.float32), int(i % 10)) for i in range(ROWS_PER_FRAME)]
    payload = pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
    n = len(payload)
    k1, k2 = os.urandom(32), os.urandom(32)

    results: dict[str, list[float]] = {
        "tfos frame, TCP": [], "tfos frame, Unix": [], "bare socket, TCP": [], "bare socket, Unix": [],
        "AES-GCM": [], "GMAC": [], "unpickle": [],
    }
    for _ in range(args.repeat):
        for family, label in (("tcp", "TCP"), ("unix", "Unix")):
            a, b = _pair(family)
            tx, rx = DataSession(k1, k2), DataSession(k2, k1)
            results[f"tfos frame, {label}"].append(_per_frame_us(
                lambda: send_frame(a, tx, FrameType.DATA, payload),
                lambda: recv_frame(b, rx, Deadline(30.0, "bench frame")), args.frames))
            a.close()
            b.close()

            a, b = _pair(family)
            view = memoryview(bytearray(n))

            def recv_bare() -> None:
                got = 0
                while got < n:
                    got += b.recv_into(view[got:], n - got)

            results[f"bare socket, {label}"].append(_per_frame_us(lambda: a.sendall(payload), recv_bare, args.frames))
            a.close()
            b.close()

        s, r = DataSession(k1, k2), DataSession(k2, k1)
        head = struct.pack(">BQ", FrameType.DATA.value[0], n)
        buf = bytearray(n + DataSession.TAG_BYTES)
        c0 = time.process_time()
        for _ in range(args.frames):
            buf[:] = s.seal(FrameType.DATA.value[0], head, payload)  # (the copy stands in for the wire)
            r.open(FrameType.DATA.value[0], head, buf)
        results["AES-GCM"].append((time.process_time() - c0) / args.frames * 1e6)

        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        gmac = AESGCM(k1)
        c0 = time.process_time()
        for i in range(args.frames):
            nonce = i.to_bytes(12, "big")
            gmac.decrypt(nonce, gmac.encrypt(nonce, b"", payload), payload)
        results["GMAC"].append((time.process_time() - c0) / args.frames * 1e6)

        c0 = time.process_time()
        for _ in range(args.frames):
            pickle.loads(payload)
        results["unpickle"].append((time.process_time() - c0) / args.frames * 1e6)

    print(f"load average {os.getloadavg()[0]:.1f}; one frame = a PySpark pickled batch of {ROWS_PER_FRAME} MNIST rows, "
          f"{n / 1024:.0f} KB; CPU us per frame (both ends), min / median / max of {args.repeat} runs of {args.frames} frames")
    print(f"{'':<18} {'min':>8} {'median':>8} {'max':>8}   CPU s per 100,000 rows (median)")
    for name, xs in results.items():
        med = statistics.median(xs)
        print(f"{name:<18} {min(xs):>8.1f} {med:>8.1f} {max(xs):>8.1f}   {med * 1e-6 * 100_000 / ROWS_PER_FRAME:.3f}")
    if not args.no_path:
        feed_path(payload, sum(r[1] for r in batch), args.repeat)


def _feed_path_cpu(payload: bytes, frames: int, packed: bool, labels_per_frame: int) -> float:
    """CPU s of one partition of ``frames`` PySpark batches through a node's feed path
    (feed task sends, FeedHub reader thread, DataFeed consumer), both ends in this process.

    Raises:
        AssertionError: The consumer did not get every row exactly once.
    """
    from tfos._common import wire
    from tfos._data.feed_connection import FeedConnection
    from tfos._data.feed_hub import FeedHub
    from tfos._data.feed_tasks import _Packing
    from tfos._data.framing import ChunkKind, send_frame_parts
    from tfos.datafeed import DataFeed

    key = os.urandom(32)
    hub = FeedHub("127.0.0.1", key, ("input",), 4, "bench", local_socket=False)
    a, peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        out: dict = {}
        hs = threading.Thread(target=lambda: out.setdefault("s", wire.client_handshake(peer, key, Deadline(10.0))))
        hs.start()
        server = wire.server_handshake(a, key, Deadline(10.0))
        hs.join()
        tx = out["s"]
        header = {"partition": 0, "epoch": 0, "mode": "train", "kind": "pickled_batches" if packed else "pickled_batch",
                  "qname": "input", "feed_timeout": 60, "feed_id": "bench", "index": 0}
        conn = FeedConnection(a, server, header)
        with hub._lock:
            hub._conns.add(conn)
        answer: list = []

        def feed_task() -> None:
            if packed:  # the feed task's reader thread fills the Outbox, its sender sends (feed_tasks._stream)
                packing = _Packing(ChunkKind.PICKLED_BATCHES)
                outbox = packing.outbox(0.05)

                def _send() -> None:
                    while (items := outbox.take()) is not None:
                        send_frame_parts(peer, tx, FrameType.DATA, packing.payload(items, outbox))

                sender = threading.Thread(target=_send, daemon=True)
                sender.start()
                for _ in range(frames):
                    outbox.put(payload, packing.size(payload))
                outbox.end()
                sender.join(60)
            else:
                for _ in range(frames):
                    send_frame(peer, tx, FrameType.DATA, payload)
            send_frame(peer, tx, FrameType.END, b"")
            answer.append(recv_frame(peer, tx, Deadline(60.0, "the ACK"))[0])

        c0 = time.process_time()
        sender = threading.Thread(target=feed_task, daemon=True)
        reader = threading.Thread(target=hub._read_partition, args=(conn, hub.queues["input"]), daemon=True)
        sender.start()
        reader.start()
        feed = DataFeed(hub, timeout_s=60)
        rows = label_sum = 0
        while rows < frames * ROWS_PER_FRAME:
            batch = feed.next_batch(1000)
            rows += len(batch)
            label_sum += sum(r[1] for r in batch)
        reader.join(60)
        hub.close_feed()
        assert feed.next_batch(1) == [] and feed.should_stop()
        sender.join(60)
        cpu = time.process_time() - c0
        assert answer == [FrameType.ACK], answer
        assert (rows, label_sum) == (frames * ROWS_PER_FRAME, frames * labels_per_frame), (rows, label_sum)
        return cpu
    finally:
        hub.close()
        a.close()
        peer.close()


def feed_path(payload: bytes, labels_per_frame: int, repeat: int) -> None:
    """Prints the CPU s per 100,000 rows of the node's feed path, one batch per frame
    against packed frames (see the module docstring)."""
    from tfos._data.feed_tasks import PACK_BYTES

    frames = 100_000 // ROWS_PER_FRAME
    res: dict[str, list[float]] = {"one batch per frame": [], "packed": []}
    for _ in range(repeat):
        for packed, name in ((False, "one batch per frame"), (True, "packed")):
            res[name].append(_feed_path_cpu(payload, frames, packed, labels_per_frame))
    print(f"\nfeed path of {frames * ROWS_PER_FRAME:,} rows through a node (Unix socket, FeedHub, DataFeed.next_batch(1000)), "
          f"packed frames of >= {PACK_BYTES / 2**20:.0f} MiB; CPU s, min / median / max of {repeat} interleaved runs; "
          "row count and label sum checked")
    print(f"{'':<20} {'min':>8} {'median':>8} {'max':>8}")
    for name, xs in res.items():
        print(f"{name:<20} {min(xs):>8.3f} {statistics.median(xs):>8.3f} {max(xs):>8.3f}")
    one, pk = statistics.median(res["one batch per frame"]), statistics.median(res["packed"])
    print(f"packed / one batch per frame: {pk / one:.2f} (median / median); per repeat "
          + " ".join(f"{p / o:.2f}" for o, p in zip(res["one batch per frame"], res["packed"])))


if __name__ == "__main__":
    main()
