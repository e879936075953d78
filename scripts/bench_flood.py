#!/usr/bin/env python
"""Floods of connections without the key against the real control server and data server.

Loopback only; the server (a real :class:`tfos._control.server.ControlServer` or a real
node :class:`tfos._data.feed_hub.FeedHub`) runs in this process, each flood in a separate
attacker process that holds no key. Two measurements:

``--table`` (the default): how often a real client gets through. For each flood and each
client delay, ``--tries`` real clients, one after the other, each with a budget of
``--budget-s`` seconds (a ControlClient request ``ping`` on the control plane; a feed
task's handshake + header + status on the data plane, retried as a feed task does); the
delay is how long the client waits between the server's hello and its own next bytes (a
loaded TF process takes 50-200 ms there; a slow link as long). Floods:

* ``none``;
* ``half``: ``--cap`` connections (the server's cap of connections that have not
  authenticated) that each send half of a first message, then stall; every one the server
  closes is opened again at once;
* ``idle``: the same with silent connections;
* ``churn``: connect and close at the highest rate one process reaches;
* ``idle5000``: 5,000 silent connections, reopened when closed;
* ``fill[:PENDING[:STALE_MS[:NSRC]]]``: the kernel-queue filler (one process, epoll):
  ``PENDING`` (3,000) non-blocking connects always in flight from ``NSRC`` (2,000)
  loopback source addresses 127.0.x.y, each unanswered after ``STALE_MS`` (200) replaced
  by a fresh SYN, up to 20,000 connected silent sockets held (reopened when closed, the
  rest reset): it keeps a server's accept queue full when the server leaves connections
  there, so a key holder's SYN is dropped (retried after 1, 3, 7 s).

Printed: answered of ``--tries`` per cell, and the median / max seconds of an answered
try per flood; the attacker's rate (connections completed per second; for ``fill`` also
SYNs sent per second).

``--resources``: RSS and threads of this process before and under floods of ``--sizes``
silent connections (as before), and a legitimate client's time.

Usage::

    .venv/bin/python scripts/bench_flood.py --planes control,data --tries 20 [--json FILE]
    .venv/bin/python scripts/bench_flood.py --tree /path/to/other/checkout ...   # measure another version

Figures and their reading: docs/reliability.md ("Floods").
"""

from __future__ import annotations

import argparse
import json
import logging
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


def _tree_arg() -> str:
    for i, a in enumerate(sys.argv):
        if a == "--tree" and i + 1 < len(sys.argv):
            return os.path.abspath(sys.argv[i + 1])
        if a.startswith("--tree="):
            return os.path.abspath(a.split("=", 1)[1])
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


sys.path.insert(0, _tree_arg())

import psutil  # noqa: E402

import tfos  # noqa: E402
from tfos._common import wire as _wire  # noqa: E402
from tfos._common.deadline import Deadline  # noqa: E402
from tfos._control import client as _client_mod  # noqa: E402
from tfos._control.client import ControlClient  # noqa: E402
from tfos._control.limits import ControlLimits  # noqa: E402
from tfos._control.server import ControlServer  # noqa: E402
from tfos._data import feed_hub as _hub_mod  # noqa: E402
from tfos._data.feed_hub import FeedHub  # noqa: E402
from tfos._data.framing import FrameType, recv_json, send_json  # noqa: E402

_ATTACKER = textwrap.dedent(
    r'''
    import os, resource, select, socket, struct, sys, time
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    host, port, n, mode, ready, stop = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6]
    # half: half of a first message (a control frame's header and part of its MAC; part of a proof)
    first = {"half": b"TFO1" + struct.pack(">I", 200) + os.urandom(18), "big": b"TFO1" + struct.pack(">I", 1 << 20)}.get(mode, b"")
    end = time.monotonic() + 900
    def note(text):
        with open(ready + ".tmp", "w") as f:
            f.write(text)
        os.replace(ready + ".tmp", ready)
    if mode == "churn":
        made = 0
        t0 = time.monotonic()
        note("0")
        while not os.path.exists(stop) and time.monotonic() < end:
            for _ in range(200):
                s = socket.socket()
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                try:
                    s.connect((host, port))
                    made += 1
                except OSError:
                    pass
                s.close()
        note(f"0 {made} {made / max(1e-9, time.monotonic() - t0):.0f}")
        sys.exit(0)
    if mode.startswith("fill"):
        # fill[:PENDING[:STALE_MS[:NSRC]]]: hold up to n connected silent sockets, and keep PENDING
        # non-blocking connects in flight from NSRC loopback source addresses (127.0.x.y), a
        # SYN_SENT older than STALE_MS replaced by a fresh one: it keeps a server's kernel accept
        # queue full when the server leaves connections there.
        parts = mode.split(":")
        want = int(parts[1]) if len(parts) > 1 else 3000
        stale = (float(parts[2]) if len(parts) > 2 else 200.0) / 1000.0
        nsrc = int(parts[3]) if len(parts) > 3 else 2000
        srcs = [f"127.0.{2 + i // 254}.{1 + i % 254}" for i in range(nsrc)]
        ep = select.epoll()
        pend, held = {}, {}  # fd -> (socket, since) / socket
        made = syns = 0
        t0 = time.monotonic()
        si = 0
        note("0")
        def drop(fd, s):
            try:
                ep.unregister(fd)
            except OSError:
                pass
            s.close()
        while not os.path.exists(stop) and time.monotonic() < end:
            now = time.monotonic()
            while len(pend) < want:
                s = socket.socket()
                s.setblocking(False)
                s.setsockopt(socket.SOL_IP, 24, 1)  # IP_BIND_ADDRESS_NO_PORT: many sources, few ports each
                try:
                    s.bind((srcs[si % nsrc], 0))
                except OSError:
                    s.close()
                    break
                si += 1
                try:
                    s.connect((host, port))
                except BlockingIOError:
                    pass
                except OSError:
                    s.close()
                    continue
                syns += 1
                pend[s.fileno()] = (s, now)
                ep.register(s.fileno(), select.EPOLLOUT | select.EPOLLIN | select.EPOLLRDHUP)
            for fd, ev in ep.poll(0.01):
                if fd in pend:
                    s, _ = pend.pop(fd)
                    if ev & (select.EPOLLERR | select.EPOLLHUP) or s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                        drop(fd, s)
                        continue
                    made += 1
                    if len(held) >= n:
                        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                        drop(fd, s)
                        continue
                    held[fd] = s
                    ep.modify(fd, select.EPOLLIN | select.EPOLLRDHUP)
                elif fd in held:
                    drop(fd, held.pop(fd))  # the server closed it: reopened by the loop above
            now = time.monotonic()
            for fd, (s, since) in list(pend.items()):
                if now - since > stale:
                    del pend[fd]
                    drop(fd, s)
        dt = max(1e-9, time.monotonic() - t0)
        note(f"{len(held)} {made} {made / dt:.0f} {syns / dt:.0f}")
        sys.exit(0)
    def open_one():
        s = socket.socket()
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
    poller = select.poll()  # select() cannot watch descriptors above 1024
    by_fd = {}
    def add(s):
        poller.register(s, select.POLLIN)
        by_fd[s.fileno()] = s
    t0 = time.monotonic()
    reopened = 0
    for _ in range(n):
        s = open_one()
        if s is not None:
            add(s)
        if os.path.exists(stop):
            break
    note(str(len(by_fd)))
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
                add(t)
                reopened += 1
        while len(by_fd) < n and not os.path.exists(stop):
            t = open_one()
            if t is None:
                break
            add(t)
            reopened += 1
    note(f"{len(by_fd)} {reopened} {reopened / max(1e-9, time.monotonic() - t0):.0f}")
    '''
)

KEY = _wire.new_key()
CID = "bench-flood"
FLOODS = ("none", "half", "idle", "churn", "idle5000")


class _SlowSocket(socket.socket):
    """A client socket that waits ``delay_s`` before its first send after it received bytes
    (between the server's hello and the client's next message)."""

    delay_s = 0.0

    def _mark(self) -> None:
        self._read_since_send = True

    def recv(self, *a, **k):  # noqa: D401
        self._mark()
        return super().recv(*a, **k)

    def recv_into(self, *a, **k):
        self._mark()
        return super().recv_into(*a, **k)

    def _wait(self) -> None:
        if getattr(self, "_read_since_send", False):
            self._read_since_send = False
            if self.delay_s:
                time.sleep(self.delay_s)

    def sendall(self, *a, **k):
        self._wait()
        return super().sendall(*a, **k)

    def send(self, *a, **k):
        self._wait()
        return super().send(*a, **k)


_orig_create = socket.create_connection
_delay = threading.local()


def _slow_create(address, timeout=socket._GLOBAL_DEFAULT_TIMEOUT, *a, **k):
    s = _orig_create(address, timeout, *a, **k)
    slow = _SlowSocket(s.family, s.type, s.proto, fileno=s.detach())
    slow.settimeout(None if timeout is socket._GLOBAL_DEFAULT_TIMEOUT else timeout)
    slow.delay_s = getattr(_delay, "s", 0.0)
    return slow


socket.create_connection = _slow_create


def _try_control(srv: ControlServer, budget_s: float) -> float:
    t0 = time.monotonic()
    c = ControlClient(srv.host, srv.port, KEY, CID, connect_timeout_s=budget_s)
    try:
        assert c._request("ping", {"x": 1}, budget_s, True, None)["echo"] == 1  # a raw request to a plain-function server
    finally:
        c.close()
    return time.monotonic() - t0


def _try_data(hub: FeedHub, index: int, budget_s: float) -> float:
    t0 = time.monotonic()
    deadline = Deadline(budget_s, "a feed task's data handshake during the flood")
    while True:  # as a feed task does: retry when the node sheds the connection
        s = None
        try:
            s = socket.create_connection(("127.0.0.1", hub.port), timeout=max(0.1, deadline.remaining()))
            session = _wire.client_handshake(s, KEY, deadline)
            send_json(s, session, FrameType.HEADER, {"qname": "input", "mode": "train", "partition": index,
                                                    "kind": "pickled_batch", "feed_id": f"bench-{os.getpid()}-{t0}",
                                                    "index": index, "feed_timeout_s": 60.0,
                                                    "feed_timeout": 60.0})  # (the key's name before it was renamed)
            ftype, status = recv_json(s, session, deadline)
            assert ftype is FrameType.STATUS and status["state"] == "ok", status
            return time.monotonic() - t0
        except (ConnectionError, OSError):
            if deadline.expired():
                raise
            time.sleep(min(0.2, max(0.0, deadline.remaining())))
        finally:
            if s is not None:
                s.close()


def _attack(host: str, port: int, n: int, mode: str, tmp: str):
    ready = os.path.join(tmp, f"ready-{mode}-{n}-{time.monotonic_ns()}")
    stop = ready + ".stop"
    proc = subprocess.Popen([sys.executable, "-c", _ATTACKER, host, str(port), str(n), mode, ready, stop])
    end = time.monotonic() + 120
    while not os.path.exists(ready) and time.monotonic() < end and proc.poll() is None:
        time.sleep(0.05)
    return proc, ready, stop


def _stop(proc: subprocess.Popen, ready: str, stop: str) -> str:
    open(stop, "w").close()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
    return open(ready).read() if os.path.exists(ready) else ""


def _server(plane: str):
    """(host, port, cap, try_fn(index, budget), close, stats) of a fresh server."""
    if plane == "control":
        srv = ControlServer(KEY, lambda body, peer: {"echo": body.get("x")}, "127.0.0.1", num_nodes=2)
        cap = srv.limits.max_unauthenticated
        return srv.host, srv.port, cap, lambda i, b: _try_control(srv, b), srv.close, srv.stats
    hub = FeedHub("127.0.0.1", KEY, ("input",), 1 << 20, "bench node", local_socket=False)
    cap = getattr(_hub_mod, "MAX_HANDSHAKES", None) or getattr(_hub_mod, "MAX_UNPROVEN", 0)
    try:
        from tfos._data import feed_gate as _gate  # the version with a proof first

        cap = _gate.MAX_UNPROVEN
    except ImportError:
        pass

    def close() -> None:
        hub.close("main_fun_returned", "bench over")

    return "127.0.0.1", hub.port, cap, lambda i, b: _try_data(hub, i, b), close, lambda: {"rejected": hub.rejected}


def table(plane: str, floods: list, delays: list, tries: int, budget_s: float, tmp: str) -> list:
    rows = []
    for flood in floods:
        host, port, cap, try_fn, close, stats = _server(plane)
        n = {"half": cap, "idle": cap, "idle5000": 5000}.get(flood, 20000 if flood.startswith("fill") else 0)
        proc = ready = stop = None
        if flood != "none":
            proc, ready, stop = _attack(host, port, n, flood, tmp)
            time.sleep(2.0)  # the flood is on
        cells, times = {}, []
        index = 0
        for delay in delays:
            _delay.s = delay / 1000.0
            ok = 0
            for _ in range(tries):
                index += 1
                try:
                    times.append(try_fn(index, budget_s))
                    ok += 1
                except Exception as exc:  # noqa: BLE001 - a try that did not get through
                    last = f"{type(exc).__name__}: {str(exc)[:160]}"
                    print(f"  {plane} {flood} {delay} ms: failed: {last}", flush=True)
            cells[delay] = ok
            print(f"{plane} {flood} {delay} ms: {ok}/{tries}", flush=True)
        _delay.s = 0.0
        tail = _stop(proc, ready, stop) if proc is not None else ""
        st = stats()
        close()
        rate = tail.split()[2] if len(tail.split()) > 2 else ""
        rows.append({"plane": plane, "flood": flood, "n": n, "cap": cap, "cells": cells,
                     "median_s": round(statistics.median(times), 3) if times else None,
                     "max_s": round(max(times), 3) if times else None,
                     "attacker": tail, "attacker_rate_per_s": rate, "server": st})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _rss_mb() -> float:
    return psutil.Process().memory_info().rss / 1e6


def resources(plane: str, n: int, tmp: str, legit_tries: int) -> dict:
    host, port, cap, try_fn, close, _ = _server(plane)
    time.sleep(0.5)
    base_rss, base_threads = _rss_mb(), threading.active_count()
    proc, ready, stop = _attack(host, port, n, "idle", tmp)
    time.sleep(2.0)
    peak_rss, peak_threads = _rss_mb(), threading.active_count()
    cpu0 = psutil.Process().cpu_times()
    t0 = time.monotonic()
    times = [try_fn(i + 1, 60.0) for i in range(legit_tries)]
    cpu1 = psutil.Process().cpu_times()
    wall = time.monotonic() - t0
    peak_rss = max(peak_rss, _rss_mb())
    peak_threads = max(peak_threads, threading.active_count())
    tail = _stop(proc, ready, stop)
    close()
    return {"plane": plane, "flood": n, "attacker_end": tail, "rss_mb_before": round(base_rss, 1),
            "rss_mb_flood": round(peak_rss, 1), "threads_before": base_threads, "threads_flood": peak_threads,
            "server_cpu_share": round((cpu1.user + cpu1.system - cpu0.user - cpu0.system) / max(1e-9, wall), 2),
            "legit_s": [round(t, 4) for t in times]}


def _spread(values: list) -> str:
    return f"{min(values):.3g} / {statistics.median(values):.3g} / {max(values):.3g}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", default="", help="the tfos checkout to measure (default: this one)")
    ap.add_argument("--planes", default="control,data")
    ap.add_argument("--floods", default=",".join(FLOODS))
    ap.add_argument("--delays-ms", default="0,5,20,50,100,200,500")
    ap.add_argument("--tries", type=int, default=20)
    ap.add_argument("--budget-s", type=float, default=10.0, help="seconds one try may take (connect and answer)")
    ap.add_argument("--resources", action="store_true", help="measure RSS/threads under --sizes floods instead")
    ap.add_argument("--sizes", default="500,5000")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--legit", type=int, default=5)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    logging.getLogger("tfos").setLevel(logging.ERROR)  # thousands of rejections would be logged
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if hard < 5300:
        sys.exit(f"ulimit -n hard limit {hard} is too small for a flood of 5,000")
    print(f"tfos from {os.path.dirname(tfos.__file__)}; control cap for 2 nodes "
          f"{ControlLimits.for_nodes(2).max_unauthenticated}", flush=True)
    planes = args.planes.split(",")
    out: list = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.resources:
            for plane in planes:
                for n in (int(x) for x in args.sizes.split(",")):
                    for _ in range(args.repeat):
                        out.append(resources(plane, n, tmp, args.legit))
                        print(json.dumps(out[-1]), flush=True)
            print("| plane | flood | runs | RSS before MB | RSS in flood MB | threads before | threads in flood | "
                  "server CPU share | legit client s |")
            print("|---|---|---|---|---|---|---|---|---|")
            for plane in planes:
                for n in (int(x) for x in args.sizes.split(",")):
                    rs = [r for r in out if r["plane"] == plane and r["flood"] == n]
                    print(f"| {plane} | {n} | {len(rs)} | {_spread([r['rss_mb_before'] for r in rs])} | "
                          f"{_spread([r['rss_mb_flood'] for r in rs])} | {_spread([r['threads_before'] for r in rs])} | "
                          f"{_spread([r['threads_flood'] for r in rs])} | {_spread([r['server_cpu_share'] for r in rs])} | "
                          f"{_spread([t for r in rs for t in r['legit_s']])} |")
        else:
            delays = [int(x) for x in args.delays_ms.split(",")]
            for plane in planes:
                out += table(plane, args.floods.split(","), delays, args.tries, args.budget_s, tmp)
            print(f"\nload average {os.getloadavg()[0]:.1f}; answered of {args.tries} tries "
                  f"(budget {args.budget_s:g} s each) by the client's delay; seconds of an answered try")
            print("| plane | flood | " + " | ".join(f"{d} ms" for d in delays) + " | median s | max s | attacker conn/s |")
            print("|---|---|" + "---|" * (len(delays) + 3))
            for r in out:
                print(f"| {r['plane']} | {r['flood']}{' ' + str(r['n']) if r['n'] else ''} | "
                      + " | ".join(str(r["cells"][d]) for d in delays)
                      + f" | {r['median_s']} | {r['max_s']} | {r['attacker_rate_per_s']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
