#!/usr/bin/env python
"""What the status figures cost, piece by piece (no Spark, no TensorFlow).

Measured, each as the median of ``--repeat`` rounds:

1. node, per batch handed to main_fun: ``FIGURES.wait_begin`` + ``wait_end`` (next_batch and
   the tf.data generator pay this once per call), and ``FIGURES.add`` (a Keras train-function
   call), in microseconds;
2. node, per long-poll: ``live_snapshot`` (every figure plus the gauges), in microseconds;
3. driver, per long-poll: decoding a ``wait_event`` frame's JSON body into its message with
   the row counter only (before) and with a real node's figures (after), in microseconds,
   and the bodies' sizes in bytes;
4. driver, per second: the status monitor's ``tick`` (one read of every node's figures, the
   stall watch; the verdict every 2 s, or every N/200 s above 400 nodes) over 40 s of
   figures of N nodes that all changed every second (the worst case: real nodes poll every
   1-5 s), CPU milliseconds per tick (median and the verdict ticks' max), and one
   ``status()`` call.

Usage::

    .venv/bin/python scripts/bench_status_cost.py [--nodes 100 2000] [--repeat 5]

Figures: docs/performance.md "Status figures: cost".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import timeit

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tfos._control import messages as _msg  # noqa: E402
from tfos._control.messages import NodeState  # noqa: E402
from tfos._driver.monitor import StatusMonitor  # noqa: E402
from tfos._data.figures import NodeFigures, live_snapshot  # noqa: E402
from tfos.cluster_template import NodeRole  # noqa: E402

KNOWN = {"stop": False, "feed_closed": False, "abort": "", "failed": False, "stack": 0, "report": 0}


class _Hub:
    rows_taken = 123456
    queues: dict = {}


class _State:
    """What the monitor reads of the driver's control host and core, for N running workers."""

    def __init__(self, n: int) -> None:
        self.cluster_id = "tfos-bench"
        self.roles = [NodeRole(i, "worker", i) for i in range(n)]
        self.proc_state = {i: NodeState.RUNNING for i in range(n)}
        self.counters: dict = {}
        self.rss = {i: 1 << 28 for i in range(n)}
        self.last_heartbeat = {i: time.monotonic() for i in range(n)}
        self.hosts = {i: "10.0.0.1" for i in range(n)}

    @property
    def core(self) -> "_State":  # the monitor reads the control core through its host
        return self

    def node_name(self, eid: int) -> str:
        return f"worker:{eid} (executor {eid}, host 10.0.0.1)"


def per_call_us(fn, number: int = 200_000) -> float:
    return timeit.timeit(fn, number=number) / number * 1e6


def monitor_cost(n: int) -> dict:
    state = _State(n)
    mon = StatusMonitor(state, stall_timeout_s=600)
    ticks = []
    for s in range(40):
        for i in range(n):
            state.counters[i] = {"rows": 100 * s, "clock_ms": 1000 * s + i % 7, "cpu_ms": 500 * s, "feed_wait_ms": 300 * s,
                                 "feed_wait_since_ms": 0, "queue_chunks": 2, "queue_capacity": 4, "keras_steps": 3 * s}
        t0 = time.process_time()
        mon.tick(now=100.0 + s)
        ticks.append((time.process_time() - t0) * 1000)
    t0 = time.process_time()
    mon.status()
    return {"tick_ms_median": statistics.median(ticks), "tick_ms_max": max(ticks),
            "ms_per_s": sum(ticks) / len(ticks), "status_ms": (time.process_time() - t0) * 1000}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[100, 2000])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    figures = NodeFigures()
    small = {"rows": 123456}
    big = live_snapshot(_Hub())
    big.update(feed_wait_ms=41152263, feed_wait_since_ms=0, queue_chunks=2, queue_capacity=4, keras_steps=385)
    rounds: dict[str, list[float]] = {}
    for _ in range(a.repeat):
        def wait() -> None:
            figures.wait_begin("feed_wait")
            figures.wait_end("feed_wait")
        rounds.setdefault("node_wait_us", []).append(per_call_us(wait))
        rounds.setdefault("node_add_us", []).append(per_call_us(lambda: figures.add("keras_steps", 1)))
        rounds.setdefault("node_snapshot_us", []).append(per_call_us(lambda: live_snapshot(_Hub()), 50_000))
        for name, c in (("before", small), ("after", big)):
            raw = json.dumps(dict(_msg.WaitEvent(executor_id=5, known=KNOWN, counters=c, poll_s=5.0).body(), cluster="tfos-0123456789ab")).encode()
            rounds.setdefault(f"driver_decode_{name}_us", []).append(per_call_us(lambda: _msg.decode(json.loads(raw)), 20_000))
            rounds[f"body_{name}_bytes"] = [len(raw)]
    out = {k: statistics.median(v) for k, v in rounds.items()}
    for n in a.nodes:
        runs = [monitor_cost(n) for _ in range(max(1, a.repeat // 2))]
        out[f"monitor_{n}"] = {k: round(statistics.median(r[k] for r in runs), 2) for k in runs[0]}
    print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in out.items()}, indent=1))
    print(f"# load average {os.getloadavg()[0]:.1f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
