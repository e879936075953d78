#!/usr/bin/env python
"""Unauthenticated-connection flood against the real control server and data server.

Loopback only. For each plane (the driver's :class:`tfos._control.server.ControlServer` and a
node's :class:`tfos._data.feed_hub.FeedHub`, both in this process) and each flood size, a separate
attacker process (no key) opens N connections and keeps them open, reopening every one the
server closes, for the whole measurement. On the control plane every flood connection
announces a maximal frame (magic + 1 MiB length) and then stalls: the attack that used to
make the driver allocate 1 MiB per connection ("control"), or connects and stays silent
("control-idle"). On the data plane it connects and stays silent (the attack that used to
cost a thread per connection).

Measured, per plane and flood size (``--repeat`` runs, min / median / max):

* RSS of this process (the server side) and its thread count, before and under the flood;
* seconds for a legitimate client to get an answer during the flood: a ControlClient
  request on the control plane; a full mutual handshake + header + status on the data plane.

Usage::

    .venv/bin/python scripts/bench_flood.py --sizes 500,5000 --repeat 3 [--json FILE]

Figures and their reading: docs/reliability.md ("Flood figures").
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import psutil

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tfos._common import wire as _wire  # noqa: E402
from tfos._control.client import ControlClient  # noqa: E402
from tfos._control.server import ControlServer  # noqa: E402
from tfos._data.framing import FrameType, recv_json, send_json  # noqa: E402
from tfos._common.deadline import Deadline  # noqa: E402
from tfos._data.feed_hub import FeedHub  # noqa: E402

_ATTACKER = textwrap.dedent(
    r'''
    import os, resource, select, socket, struct, sys, time
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    host, port, n, mode, ready, stop = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6]
    first = b"TFO1" + struct.pack(">I", 1 << 20) if mode == "control" else b""
    def open_one():
        s = socket.socket()
        s.setblocking(True)
        s.settimeout(5)
        try:
            s.connect((host, port))
            if first:
                s.sendall(first)
            s.setblocking(False)
            return s
        except OSError:
            s.close()
            return None
    socks = [s for s in (open_one() for _ in range(n)) if s is not None]
    with open(ready, "w") as f:
        f.write(str(len(socks)))
    reopened = 0
    end = time.monotonic() + 600
    poller = select.poll()  # select() cannot watch descriptors above 1024
    by_fd = {}
    for s in socks:
        poller.register(s, select.POLLIN)
        by_fd[s.fileno()] = s
    while not os.path.exists(stop) and time.monotonic() < end:
        for fd, _ in poller.poll(50):
            s = by_fd.pop(fd)
            try:
                data = s.recv(65536)
            except OSError:
                data = b""
            if data:
                by_fd[fd] = s
                continue
            poller.unregister(fd)
            s.close()
            t = open_one()
            if t is not None:
                poller.register(t, select.POLLIN)
                by_fd[t.fileno()] = t
                reopened += 1
    socks = list(by_fd.values())
    with open(ready, "w") as f:
        f.write(f"{len(socks)} {reopened}")
    '''
)

#: control: each connection announces a 1 MiB frame and stalls; control-idle: connects and
#: stays silent; data: connects to the node's data server and stays silent.
PLANES = ("control", "control-idle", "data")
KEY = _wire.new_key()
CID = "bench-flood"


def _rss_mb() -> float:
    return psutil.Process().memory_info().rss / 1e6


def _legit_control(srv: ControlServer) -> float:
    t0 = time.monotonic()
    c = ControlClient(srv.host, srv.port, KEY, CID, connect_timeout_s=60)
    try:
        assert c._request("ping", {"x": 1}, 60.0, True, None)["echo"] == 1  # a raw request to a plain-function server
    finally:
        c.close()
    return time.monotonic() - t0


def _legit_data(hub: FeedHub, index: int) -> float:
    t0 = time.monotonic()
    deadline = Deadline(60, "a legitimate data handshake during the flood")
    while True:  # as a feed task does: retry when the node sheds the connection
        s = socket.create_connection(("127.0.0.1", hub.port), timeout=60)
        try:
            session = _wire.client_handshake(s, KEY, deadline)
            send_json(s, session, FrameType.HEADER, {"qname": "input", "mode": "train", "partition": index,
                                                    "kind": "pickled_batch", "feed_id": "bench", "index": index})
            ftype, status = recv_json(s, session, deadline)
            assert ftype is FrameType.STATUS and status["state"] == "ok", status
            return time.monotonic() - t0
        except ConnectionError:
            if deadline.expired():
                raise
        finally:
            s.close()


def _flood(host: str, port: int, n: int, mode: str, tmp: str):
    ready = os.path.join(tmp, f"ready-{mode}-{n}-{time.monotonic_ns()}")
    stop = ready + ".stop"
    proc = subprocess.Popen([sys.executable, "-c", _ATTACKER, host, str(port), str(n), mode, ready, stop])
    end = time.monotonic() + 300
    while not os.path.exists(ready) and time.monotonic() < end and proc.poll() is None:
        time.sleep(0.05)
    opened = int(open(ready).read().split()[0]) if os.path.exists(ready) else 0
    return proc, ready, stop, opened


def _stop(proc: subprocess.Popen, ready: str, stop: str) -> str:
    open(stop, "w").close()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
    return open(ready).read() if os.path.exists(ready) else ""


def measure(plane: str, n: int, tmp: str, legit_tries: int) -> dict:
    if plane.startswith("control"):
        srv = ControlServer(KEY, lambda body, peer: {"echo": body.get("x")}, "127.0.0.1")
        host, port = srv.host, srv.port
        legit = lambda i: _legit_control(srv)  # noqa: E731
        close = srv.close
    else:
        hub = FeedHub("127.0.0.1", KEY, ("input",), 4, "bench node")
        host, port = "127.0.0.1", hub.port
        legit = lambda i: _legit_data(hub, i)  # noqa: E731
        close = lambda: hub.close("finished", "bench over")  # noqa: E731
    time.sleep(0.5)
    base_rss, base_threads = _rss_mb(), threading.active_count()
    proc, ready, stop, opened = _flood(host, port, n, plane, tmp)
    time.sleep(2.0)  # let the server take (and shed) the flood
    peak_rss, peak_threads = _rss_mb(), threading.active_count()
    times = [legit(i) for i in range(legit_tries)]
    peak_rss = max(peak_rss, _rss_mb())
    peak_threads = max(peak_threads, threading.active_count())
    tail = _stop(proc, ready, stop)
    close()
    return {
        "plane": plane, "flood": n, "opened": opened, "attacker_end": tail,
        "rss_mb_before": round(base_rss, 1), "rss_mb_flood": round(peak_rss, 1),
        "threads_before": base_threads, "threads_flood": peak_threads,
        "legit_s": [round(t, 4) for t in times],
    }


def _spread(values: list) -> str:
    return f"{min(values):.3g} / {statistics.median(values):.3g} / {max(values):.3g}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="500,5000")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--legit", type=int, default=5, help="legitimate requests timed per run")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    sizes = [int(x) for x in args.sizes.split(",")]
    if max(sizes) + 200 > hard:
        sys.exit(f"ulimit -n hard limit {hard} is too small for a flood of {max(sizes)}")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for plane in PLANES:
            for n in sizes:
                for _ in range(args.repeat):
                    r = measure(plane, n, tmp, args.legit)
                    results.append(r)
                    print(json.dumps(r), flush=True)
    print()
    print(f"load average {os.getloadavg()[0]:.1f}; min / median / max of {args.repeat} runs")
    print("| plane | flood | runs | RSS before MB | RSS in flood MB | threads before | threads in flood | legit client s |")
    print("|---|---|---|---|---|---|---|---|")
    for plane in PLANES:
        for n in sizes:
            rs = [r for r in results if r["plane"] == plane and r["flood"] == n]
            print(f"| {plane} | {n} | {len(rs)} | {_spread([r['rss_mb_before'] for r in rs])} | {_spread([r['rss_mb_flood'] for r in rs])} "
                  f"| {_spread([r['threads_before'] for r in rs])} | {_spread([r['threads_flood'] for r in rs])} "
                  f"| {_spread([t for r in rs for t in r['legit_s']])} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
