#!/usr/bin/env python
"""Failure-detection benchmark: seconds from a fault to the driver's exception.

Runs on a local ``local-cluster[2,1,1024]`` Spark (two executor JVMs), a 2-node
InputMode.SPARK cluster fed by ``cluster.train()``, and injects one fault per run on
worker:1 (executor 1) after it consumed its first batch:

* ``exception``: main_fun raises (fault time: written by main_fun just before raising);
* ``tf-kill``: the bench SIGKILLs the node's TF process (fault time: when the kill is sent);
* ``jvm-kill``: the bench SIGKILLs the Spark executor JVM hosting the node (fault time:
  when the kill is sent). The standalone Worker relaunches a killed executor; when it does
  not come back in time, the bench starts a fresh SparkContext.

The latency is ``time.time()`` when ``train()`` raised minus the fault time (same host, so
one clock). For each fault the bench prints the median and max over ``--runs`` runs and
the ratio to TensorFlowOnSpark's default ``feed_timeout`` (600 s), the time a TFoS feed task
waits on a dead node before it fails.

Usage::

    python scripts/bench_failures.py [--runs 5] [--heartbeat-timeout 10] [--only exception,tf-kill,jvm-kill]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import threading
import time

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ.setdefault("TFOS_PROGRESS", "0")

TFOS_FEED_TIMEOUT_S = 600.0
FAULTS = ("exception", "tf-kill", "jvm-kill")


def main_fun(args, ctx):
    """worker:1 writes its pid after the first batch, then faults (or waits to be killed)."""
    import os
    import time

    feed = ctx.get_data_feed(train_mode=True)
    first = True
    while not feed.should_stop():
        feed.next_batch(10)
        if first and ctx.executor_id == 1:
            first = False
            marker = args["marker"]
            if args["fault"] == "exception":
                with open(marker + ".tmp", "w") as f:
                    f.write(repr(time.time()))
                os.replace(marker + ".tmp", marker)
                raise RuntimeError("injected failure in main_fun")
            with open(marker + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.replace(marker + ".tmp", marker)
        time.sleep(0.02)


def _new_context(name: str):
    from pyspark import SparkConf, SparkContext

    conf = (
        SparkConf()
        .setMaster("local-cluster[2,1,1024]")
        .setAppName(name)
        .set("spark.ui.enabled", "false")
        .set("spark.ui.showConsoleProgress", "false")
        .set("spark.driver.host", "127.0.0.1")
        .set("spark.executor.memory", "768m")
    )
    sc = SparkContext(conf=conf)
    sc.setLogLevel("ERROR")
    return sc


def _wait_file(path: str, timeout_s: float) -> str:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if os.path.exists(path):
            with open(path) as f:
                return f.read()
        time.sleep(0.01)
    raise TimeoutError(f"{path} did not appear in {timeout_s} s")


def _java_ancestor(pid: int):
    import psutil

    for p in psutil.Process(pid).parents():
        if p.name().startswith("java"):
            return p
    raise RuntimeError(f"no java ancestor of pid {pid}")


def one_run(sc, fault: str, hb: float, workdir: str, run: int) -> tuple[float, str]:
    """One cluster, one fault; returns (seconds from fault to exception, first error line)."""
    from tfos import TFCluster
    from tfos.errors import ClusterFailedError

    marker = os.path.join(workdir, f"{fault}-{run}")
    cluster = TFCluster.run(
        sc, main_fun, {"marker": marker, "fault": fault}, 2, 0,
        input_mode=TFCluster.InputMode.SPARK, heartbeat_timeout=hb, progress=False,
    )
    tf_pid = next(n["pid"] for n in cluster.cluster_info if n["executor_id"] == 1)
    victim = None
    if fault == "jvm-kill":
        victim = _java_ancestor(tf_pid)
    fault_at: dict = {}

    def _inject() -> None:
        text = _wait_file(marker, 300.0)
        if fault == "exception":
            fault_at["t"] = float(text)
            return
        fault_at["t"] = time.time()
        if fault == "tf-kill":
            os.kill(int(text), signal.SIGKILL)
        else:
            victim.send_signal(signal.SIGKILL)

    injector = threading.Thread(target=_inject, daemon=True)
    injector.start()
    rdd = sc.parallelize(range(400000), 8)
    try:
        cluster.train(rdd, num_epochs=1, feed_timeout=TFOS_FEED_TIMEOUT_S)
    except ClusterFailedError as exc:
        caught = time.time()
        injector.join(10.0)
        lines = str(exc).splitlines()
        return caught - fault_at["t"], (lines[1] if len(lines) > 1 else lines[0]).strip()
    finally:
        cluster.shutdown()  # no-op when the failure already closed it
    raise RuntimeError(f"{fault}: train() returned without an error")


def _executors_back(sc, n: int, timeout_s: float) -> bool:
    from tfos._spark_checks import live_executors

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if live_executors(sc) >= n:
            return True
        time.sleep(0.5)
    return False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--heartbeat-timeout", type=float, default=10.0)
    ap.add_argument("--only", default=",".join(FAULTS), help="comma-separated subset of " + ", ".join(FAULTS))
    a = ap.parse_args(argv)
    faults = [f for f in a.only.split(",") if f]
    for f in faults:
        if f not in FAULTS:
            ap.error(f"unknown fault {f!r}")

    results: dict[str, list[float]] = {}
    samples: dict[str, str] = {}
    relaunched = 0
    fresh = 0
    sc = _new_context("tfos-bench-failures")
    try:
        with tempfile.TemporaryDirectory(prefix="tfos-bench-") as workdir:
            for fault in faults:
                for run in range(a.runs):
                    if not _executors_back(sc, 2, 90.0):
                        sc.stop()
                        sc = _new_context("tfos-bench-failures")
                        fresh += 1
                    secs, line = one_run(sc, fault, a.heartbeat_timeout, workdir, run)
                    results.setdefault(fault, []).append(secs)
                    samples.setdefault(fault, line)
                    print(f"{fault:10s} run {run + 1}: {secs:6.2f} s   {line[:150]}", flush=True)
                    if fault == "jvm-kill":
                        if _executors_back(sc, 2, 90.0):
                            relaunched += 1
    finally:
        sc.stop()

    targets = {"exception": 5.0, "tf-kill": 2 * a.heartbeat_timeout, "jvm-kill": 2 * a.heartbeat_timeout}
    print()
    print(f"Seconds from fault to the driver's ClusterFailedError ({a.runs} runs each, local-cluster[2,1,1024], "
          f"heartbeat_timeout={a.heartbeat_timeout:g} s, feed_timeout={TFOS_FEED_TIMEOUT_S:g} s)")
    print(f"{'fault':<12}{'median s':>10}{'max s':>10}{'target s':>10}{'met':>6}{'TFoS 600 s / median':>22}")
    for fault in faults:
        xs = results[fault]
        med, mx = statistics.median(xs), max(xs)
        print(f"{fault:<12}{med:>10.2f}{mx:>10.2f}{targets[fault]:>10.0f}{'yes' if mx <= targets[fault] else 'NO':>6}"
              f"{TFOS_FEED_TIMEOUT_S / med:>21.0f}x")
    if "jvm-kill" in faults:
        print(f"executor relaunched by the standalone Worker after {relaunched}/{len(results['jvm-kill'])} JVM kills; "
              f"fresh SparkContexts needed: {fresh}")
    print()
    for fault, line in samples.items():
        print(f"{fault}: {line[:300]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
