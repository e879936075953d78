#!/usr/bin/env python
"""CPU cost of the feed's hop from the Spark task to the TF process, per data frame.

A train feed task forwards each PySpark pickled batch (about 98 KB: 32 MNIST rows of
784 float32 and a label) unchanged to the node's TF process over a Unix-domain socket
(same host) or TCP; the TF process unpickles it. A plain Spark pass (the ceiling of
``bench_feed.py``) unpickles the same batch in the Python worker and sends nothing. This
script times, in one process (both ends; CPU time, all threads), for one frame:

- ``tfos frame``: ``send_frame`` + ``recv_frame`` (GMAC tag, header, ``sendmsg``, receive,
  tag check) over a loopback TCP connection (a feed task on another host, or one whose
  node has no Unix socket) and over a Unix-domain socket (a feed task on the node's host);
- ``bare socket``: the same bytes through the same kind of connection with ``sendall`` and
  ``recv_into`` into one reused buffer (no tfos: the kernel's two copies);
- ``GMAC``: tag plus check alone (:class:`tfos._common.wire.DataSession`);
- ``unpickle``: ``pickle.loads`` of the batch (the per-frame work both paths share).

It prints microseconds per frame (min / median / max of ``--repeat`` runs) and the CPU
seconds per 100,000 rows. The difference between ``tfos frame`` and ``bare socket`` is
what tfos adds to moving the bytes; ``bare socket`` is what any process hop costs.

Usage::

    .venv/bin/python scripts/bench_frame_hop.py --repeat 7
"""

from __future__ import annotations

import argparse
import os
import pickle
import socket
import statistics
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
    args = ap.parse_args()

    import numpy as np

    rng = np.random.default_rng(0)
    batch = [(rng.random(784, dtype=np.float32), int(i % 10)) for i in range(ROWS_PER_FRAME)]
    payload = pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
    n = len(payload)
    k1, k2 = os.urandom(32), os.urandom(32)

    results: dict[str, list[float]] = {
        "tfos frame, TCP": [], "tfos frame, Unix": [], "bare socket, TCP": [], "bare socket, Unix": [],
        "GMAC": [], "unpickle": [],
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
        c0 = time.process_time()
        for _ in range(args.frames):
            r.check(FrameType.DATA.value[0], payload, s.seal(FrameType.DATA.value[0], payload))
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


if __name__ == "__main__":
    main()
