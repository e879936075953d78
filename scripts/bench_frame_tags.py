#!/usr/bin/env python
"""CPU cost of authenticating data-plane frames: AES-GMAC (what tfos uses) against HMAC-SHA256.

Times, on one core, tagging (sender) plus checking (receiver) of frames of the sizes the
feed sends (a PySpark pickled batch of MNIST rows is about 98 KB, an Arrow chunk about
1 MB), with :class:`tfos._common.wire.DataSession`, and HMAC-SHA256 over the same bytes
(``hmac.new(...).update`` on a memoryview, no copy) for comparison. Prints GB/s (min /
median / max of ``--repeat`` runs) and the CPU seconds both ends spend per 100,000 MNIST
rows (784 float32 + label, about 3.1 KB each).

Usage::

    .venv/bin/python scripts/bench_frame_tags.py --repeat 7
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tfos._common.wire import DataSession  # noqa: E402

ROW_BYTES = 784 * 4 + 16


def _rate(fn, nbytes: int, repeat: int, target_s: float = 0.3) -> list:
    loops = 1
    while True:  # calibrate to about target_s per measurement
        t0 = time.process_time()
        for _ in range(loops):
            fn()
        if time.process_time() - t0 > target_s / 4 or loops > 1 << 16:
            break
        loops *= 2
    out = []
    for _ in range(repeat):
        t0 = time.process_time()
        for _ in range(loops):
            fn()
        out.append(loops * nbytes / 1e9 / max(time.process_time() - t0, 1e-9))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    key = os.urandom(32)
    print(f"load average {os.getloadavg()[0]:.1f}; GB/s of CPU time, min / median / max of {args.repeat}")
    print("| frame | GMAC tag + check GB/s | HMAC-SHA256 x2 GB/s | GMAC CPU s per 100k rows | HMAC CPU s per 100k rows |")
    print("|---|---|---|---|---|")
    for size in (98 * 1024, 1 << 20):
        payload = bytearray(os.urandom(size))
        tx, rx = DataSession(key, key), DataSession(key, key)

        def gmac() -> None:
            rx.check(0x44, payload, tx.seal(0x44, payload))

        def hmac2() -> None:
            for _ in range(2):
                hmac.new(key, memoryview(payload), hashlib.sha256).digest()

        g = _rate(gmac, size, args.repeat)
        h = _rate(hmac2, size, args.repeat)
        per = 100_000 * ROW_BYTES / 1e9
        print(f"| {size // 1024} KB | {min(g):.2f} / {statistics.median(g):.2f} / {max(g):.2f} "
              f"| {min(h):.2f} / {statistics.median(h):.2f} / {max(h):.2f} "
              f"| {per / statistics.median(g):.3f} | {per / statistics.median(h):.3f} |")


if __name__ == "__main__":
    main()
