#!/usr/bin/env python
"""CPU cost of protecting data-plane frames: AES-GCM encryption (what tfos uses), AES-GMAC
tags alone (what tfos used before it encrypted) and HMAC-SHA256.

Times, on one core, sealing (sender) plus opening (receiver) of frames of the sizes the
feed sends (a PySpark pickled batch of MNIST rows is about 98 KB, an Arrow chunk about
1 MB): with :class:`tfos._common.wire.DataSession` (AES-GCM: the sender encrypts into its
send buffer, the receiver decrypts in place; one copy of the frame stands in for the
wire), with ``cryptography``'s AESGCM over the payload as associated data (GMAC: a tag,
no encryption), and HMAC-SHA256 over the same bytes (``hmac.new(...).update`` on a
memoryview, no copy) twice. Prints GB/s (min / median / max of ``--repeat`` runs) and the
CPU seconds both ends spend per 100,000 MNIST rows (784 float32 + label, about 3.1 KB each).

Usage::

    .venv/bin/python scripts/bench_frame_tags.py --repeat 7
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import statistics
import struct
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
    print("| frame | AES-GCM encrypt + decrypt GB/s | GMAC tag + check GB/s | HMAC-SHA256 x2 GB/s "
          "| AES-GCM CPU s per 100k rows | GMAC | HMAC |")
    print("|---|---|---|---|---|---|---|")
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    for size in (98 * 1024, 1 << 20):
        payload = bytearray(os.urandom(size))
        tx, rx = DataSession(key, key), DataSession(key, key)
        head = struct.pack(">BQ", 0x44, size)
        wire = bytearray(size + DataSession.TAG_BYTES)
        aead = AESGCM(key)
        nonce = os.urandom(12)

        def gcm() -> None:
            wire[:] = tx.seal(0x44, head, payload)
            rx.open(0x44, head, wire)
            wire.extend(bytes(DataSession.TAG_BYTES))  # back to its size (open truncated the tag)

        def gmac() -> None:
            aead.decrypt(nonce, aead.encrypt(nonce, b"", payload), payload)

        def hmac2() -> None:
            for _ in range(2):
                hmac.new(key, memoryview(payload), hashlib.sha256).digest()

        per = 100_000 * ROW_BYTES / 1e9
        rates = [_rate(fn, size, args.repeat) for fn in (gcm, gmac, hmac2)]
        print(f"| {size // 1024} KB | " + " | ".join(f"{min(r):.2f} / {statistics.median(r):.2f} / {max(r):.2f}" for r in rates)
              + " | " + " | ".join(f"{per / statistics.median(r):.3f}" for r in rates) + " |")


if __name__ == "__main__":
    main()
