#!/usr/bin/env python
"""Failure-detection benchmark: seconds from a fault to the driver's exception.

Runs on a local ``local-cluster[2,1,1024]`` Spark (two executor JVMs), a 2-node
InputMode.SPARK cluster fed by ``cluster.train()``. The healthy node (executor 0) is busy
when the fault comes: in TF compute (``--busy compute``: a TensorFlow matmul loop that
never looks at its feed) or reading a slow feed (``--busy slow-feed``: 2 s per batch).
One fault per run is injected on worker:1 (executor 1) after it consumed its first batch:

* ``exception``: main_fun raises (fault time: written by main_fun just before raising);
* ``tf-kill``: the bench SIGKILLs the node's TF process (fault time: when the kill is sent);
* ``jvm-kill``: the bench SIGKILLs the Spark executor JVM hosting the node (fault time:
  when the kill is sent). The standalone Worker relaunches a killed executor; when it does
  not come back in time, the bench starts a fresh SparkContext.

* ``driver-kill``: a driver program (this script with ``--as-driver``, its own
  local-cluster) is SIGKILLed while it feeds; the time is until every node process and
  every process main_fun started (found by command line) is gone. Its nodes print a line
  every 20 ms, as a Keras progress bar does, so their supervisors are forwarding output
  to the driver when it dies;
* ``driver-term``: the same with SIGTERM; the time is until the driver exited (after its
  teardown) and every such process is gone.

* ``slow-producer-50ms`` / ``slow-producer-100ms``: the fed RDD's rows come slowly, as
  from an upstream decoder or a remote read: 200 rows per partition, one every 0.05 s or
  0.1 s (10 s and 20 s partitions). Each node notes how long its first row took from being
  produced to ``main_fun`` (``next_batch(1)``); worker:1 raises after 10 rows, the healthy
  node is busy after its first row. Fault time: when worker:1's 10th row was produced (the
  moment the data that makes main_fun fail exists; main_fun raises as soon as it has it).
  Also printed: seconds from ``train()``'s call to the error, and from main_fun's raise to
  the error.

* ``restart``: restart time, failure to resumed training (``TFCluster.run(...,
  max_restarts=1)``, InputMode.SPARK, ``train()`` over 3 epochs): the bench SIGKILLs the
  executor JVM of worker:1 once it consumed its first batch; the time is until every
  node of the new attempt (``ctx.attempt == 1``, on whatever executors Spark offers: the
  standalone Worker relaunches the killed one) has read its first batch of the resumed
  feed. It includes failure detection, the teardown, Spark relaunching the executor,
  the new barrier stage, node start-up and registration.
* ``restart-tf``: the same in InputMode.TENSORFLOW; the time is until ``main_fun`` of
  attempt 1 started on every node.

For the first three, the latency is ``time.time()`` when ``train()`` raised minus the fault
time (same host, so one clock). For each fault the bench prints the median and max over ``--runs`` runs and
the ratio to TensorFlowOnSpark's default ``feed_timeout`` (600 s), the time a TFoS feed task
waits on a dead node before it fails.

Usage::

    python scripts/bench_failures.py [--runs 5] [--heartbeat-timeout 10] [--busy compute|slow-feed]
        [--only exception,tf-kill,jvm-kill,slow-producer-50ms,slow-producer-100ms,driver-kill,driver-term,restart,restart-tf]
        [--driver-runs 3]
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
FAULTS = ("exception", "tf-kill", "jvm-kill", "slow-producer-50ms", "slow-producer-100ms", "driver-kill", "driver-term", "restart",
          "restart-tf")
SLOW = {"slow-producer-50ms": 0.05, "slow-producer-100ms": 0.1}
SLOW_ROWS_PER_PART = 200
RESTARTS = ("restart", "restart-tf")
CHILD_TAG = "tfos-bench-child-of-main-fun"


def _busy(kind: str) -> None:
    """The healthy node's work after its first batch: TF compute that never reads the
    feed (until killed), or a slow feed reader."""
    import time

    if kind == "compute":
        import tensorflow as tf

        x = tf.random.normal((512, 512))
        while True:
            x = tf.linalg.matmul(x, x)
            x = x / (tf.norm(x) + 1.0)
    time.sleep(2.0)


def main_fun(args, ctx):
    """worker:1 writes its pid after the first batch, then faults (or waits to be killed);
    executor 0 is busy (TF compute or a slow feed)."""
    import os
    import subprocess
    import sys
    import time

    child = None
    if args.get("child"):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)", CHILD_TAG])
    if args.get("chatty"):
        import threading

        def _progress() -> None:  # output the supervisor forwards to the driver
            step = 0
            while True:
                step += 1
                print(f"{ctx.job_name}:{ctx.task_index} step {step}", flush=True)
                time.sleep(0.02)

        threading.Thread(target=_progress, daemon=True).start()
    feed = ctx.get_data_feed(train_mode=True)
    first = True
    while not feed.should_stop():
        feed.next_batch(10)
        if ctx.executor_id == 0 and args.get("busy"):
            _busy(args["busy"])
            continue
        if first and ctx.executor_id == 1 and args.get("fault"):
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
    del child


def slow_main(args, ctx):
    """The ``slow-producer-*`` node: notes its first row's lag (rows carry their production
    time); executor 0 then keeps busy, worker:1 raises after 10 rows."""
    import json
    import os
    import time

    feed = ctx.get_data_feed(train_mode=True)
    rows = feed.next_batch(1)
    first_lag = time.time() - rows[0][1]
    if ctx.executor_id == 0:
        with open(args["marker"] + "-lag0", "w") as f:
            f.write(repr(first_lag))
        _busy(args["busy"])
        while not feed.should_stop():  # a slow-feed reader (compute never returns)
            feed.next_batch(10)
            _busy(args["busy"])
        return
    while len(rows) < 10:
        rows.extend(feed.next_batch(10 - len(rows)))
    marker = args["marker"]
    with open(marker + ".tmp", "w") as f:
        json.dump({"fault": time.time(), "first_lag": first_lag, "tenth": rows[9][1]}, f)
    os.replace(marker + ".tmp", marker)
    raise RuntimeError("injected failure in main_fun after 10 rows of a slow producer")


def _slow_rows(every_s: float):
    def _produce(i):
        import time

        time.sleep(every_s)
        return (i, time.time())  # the row and when it was produced

    return _produce


def slow_run(sc, fault: str, hb: float, workdir: str, run: int, busy: str) -> tuple[float, str, dict]:
    """One cluster fed by a slow producer; returns (seconds from the production of
    worker:1's 10th row to the exception, first error line, {"call": s from train() to the
    exception, "raise": s from main_fun's raise, "lag1"/"lag0": first-row lags of the nodes})."""
    import json

    from tfos import TFCluster
    from tfos.errors import ClusterFailedError

    every_s = SLOW[fault]
    marker = os.path.join(workdir, f"{fault}-{run}")
    cluster = TFCluster.run(
        sc, slow_main, {"marker": marker, "busy": busy}, 2, 0,
        input_mode=TFCluster.InputMode.SPARK, heartbeat_timeout=hb, progress=False,
        executor_wait_s=300, reservation_timeout=300,
    )
    rdd = sc.parallelize(range(4 * SLOW_ROWS_PER_PART), 4).map(_slow_rows(every_s))
    called = time.time()
    try:
        cluster.train(rdd, num_epochs=1, feed_timeout=TFOS_FEED_TIMEOUT_S)
    except ClusterFailedError as exc:
        caught = time.time()
        rec = json.loads(_wait_file(marker, 10.0))
        lag0 = float(_wait_file(marker + "-lag0", 10.0)) if os.path.exists(marker + "-lag0") else float("nan")
        lines = str(exc).splitlines()
        extra = {"call": caught - called, "raise": caught - rec["fault"], "lag1": rec["first_lag"], "lag0": lag0}
        return caught - rec["tenth"], (lines[1] if len(lines) > 1 else lines[0]).strip(), extra
    finally:
        cluster.shutdown()
    raise RuntimeError(f"{fault}: train() returned without an error")


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


def one_run(sc, fault: str, hb: float, workdir: str, run: int, busy: str) -> tuple[float, str]:
    """One cluster, one fault; returns (seconds from fault to exception, first error line)."""
    from tfos import TFCluster
    from tfos.errors import ClusterFailedError

    marker = os.path.join(workdir, f"{fault}-{run}")
    cluster = TFCluster.run(
        sc, main_fun, {"marker": marker, "fault": fault, "busy": busy}, 2, 0,
        input_mode=TFCluster.InputMode.SPARK, heartbeat_timeout=hb, progress=False,
        executor_wait_s=300, reservation_timeout=300,
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


def _stamp(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def restart_main(args, ctx):
    """The ``restart``/``restart-tf`` node: stamps when this attempt resumed (first batch
    read, or main_fun started in InputMode.TENSORFLOW), then trains slowly; worker:1 of
    attempt 0 writes its TF process's pid for the bench to find its executor JVM."""
    import os
    import time

    out = args["out"]
    tag = f"{ctx.attempt}-{ctx.executor_id}"
    if args["mode"] == "tf":
        _stamp(os.path.join(out, f"resumed-{tag}"), repr(time.time()))
        if ctx.attempt == 0 and ctx.executor_id == 1:
            _stamp(os.path.join(out, "victim"), str(os.getpid()))
        end = time.monotonic() + args["train_s"]
        while time.monotonic() < end:
            time.sleep(0.05)
        return
    feed = ctx.get_data_feed(train_mode=True)
    first = True
    while not feed.should_stop():
        batch = feed.next_batch(100)
        if first and batch:
            first = False
            _stamp(os.path.join(out, f"resumed-{tag}"), repr(time.time()))
            if ctx.attempt == 0 and ctx.executor_id == 1:
                _stamp(os.path.join(out, "victim"), str(os.getpid()))
        time.sleep(0.01)


def restart_run(sc, fault: str, hb: float, workdir: str, run: int) -> tuple[float, str]:
    """One ``max_restarts=1`` cluster, one executor JVM killed; returns (seconds from the
    kill to every node of attempt 1 resumed, the WARNING-style summary line)."""
    from tfos import TFCluster

    out = os.path.join(workdir, f"{fault}-{run}")
    os.makedirs(out)
    mode = "tf" if fault == "restart-tf" else "spark"
    args = {"out": out, "mode": mode, "train_s": 20.0}
    input_mode = TFCluster.InputMode.TENSORFLOW if mode == "tf" else TFCluster.InputMode.SPARK
    cluster = TFCluster.run(
        sc, restart_main, args, 2, 0, input_mode=input_mode, heartbeat_timeout=hb, progress=False,
        executor_wait_s=300, reservation_timeout=300, max_restarts=1,
    )
    killed: dict = {}

    def _kill() -> None:
        pid = int(_wait_file(os.path.join(out, "victim"), 300.0))
        jvm = _java_ancestor(pid)
        if "CoarseGrainedExecutorBackend" not in " ".join(jvm.cmdline()):
            raise RuntimeError(f"pid {jvm.pid} is not an executor JVM")
        killed["t"] = time.time()
        jvm.send_signal(signal.SIGKILL)

    killer = threading.Thread(target=_kill, daemon=True)
    killer.start()
    try:
        if mode == "spark":
            cluster.train(sc.parallelize(range(200000), 8), num_epochs=3, feed_timeout=TFOS_FEED_TIMEOUT_S)
        cluster.shutdown(timeout=600)
    finally:
        killer.join(10.0)
    stamps = [float(_wait_file(os.path.join(out, f"resumed-1-{e}"), 10.0)) for e in (0, 1)]
    return max(stamps) - killed["t"], f"attempt 1 resumed on both nodes ({mode} mode)"


def _marked(mark: str) -> list:
    """Node processes and main_fun children of the driver program tagged ``mark``."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info.get("cmdline") or [])
        if not any(s in cmd for s in ("tfos._node.supervisor", "tfos._node.tf_process", CHILD_TAG)):
            continue
        try:
            if p.environ().get("TFOS_BENCH_DRIVER_MARK") != mark:
                continue
        except psutil.Error:
            continue
        found.append(p.info["pid"])
    return found


def as_driver(out: str, hb: float, busy: str) -> int:
    """The driver program of the driver-kill/driver-term runs (a subprocess)."""
    from tfos import TFCluster

    sc = _new_context("tfos-bench-driver")
    cluster = TFCluster.run(
        sc, main_fun, {"child": True, "busy": busy, "chatty": True}, 2, 0, input_mode=TFCluster.InputMode.SPARK,
        heartbeat_timeout=hb, progress=False, executor_wait_s=300, reservation_timeout=300,
    )

    def _ready() -> None:
        while len(cluster._ctl.backend.state.counters) < 2:  # both nodes took data: training is under way
            time.sleep(0.1)
        with open(out + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(out + ".tmp", out)

    threading.Thread(target=_ready, daemon=True).start()
    cluster.train(sc.parallelize(range(20_000_000), 40), feed_timeout=TFOS_FEED_TIMEOUT_S)
    cluster.shutdown()
    return 0


def driver_run(fault: str, hb: float, workdir: str, run: int, busy: str) -> tuple[float, str]:
    """Starts a driver program, kills it (SIGKILL or SIGTERM) while it feeds; returns the
    seconds until the driver and every node process and main_fun child are gone."""
    import subprocess
    import uuid

    mark = uuid.uuid4().hex
    ready = os.path.join(workdir, f"{fault}-{run}.ready")
    err_path = os.path.join(workdir, f"{fault}-{run}.err")
    env = dict(os.environ, TFOS_BENCH_DRIVER_MARK=mark)
    with open(err_path, "wb") as err:
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--as-driver", ready,
                                 "--heartbeat-timeout", str(hb), "--busy", busy],
                                env=env, stdout=subprocess.DEVNULL, stderr=err)
    _wait_file(ready, 900.0)
    time.sleep(1.0)
    before = len(_marked(mark))
    if proc.poll() is not None:  # not a measurement: the driver ended before the fault
        with open(err_path, errors="replace") as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"the {fault} driver exited on its own (status {proc.returncode}) before the signal; its stderr ends:\n{tail}")
    t0 = time.monotonic()
    proc.send_signal(signal.SIGKILL if fault == "driver-kill" else signal.SIGTERM)
    proc.wait(300)
    while _marked(mark) and time.monotonic() - t0 < 300:
        time.sleep(0.05)
    took = time.monotonic() - t0
    left = _marked(mark)
    with open(err_path, errors="replace") as f:
        said = [ln.strip() for ln in f if "SIGTERM" in ln]
    line = f"{before} processes before, {len(left)} left; driver exit status {proc.returncode}"
    if said:
        line += f"; driver said: {said[0][:160]}"
    return took, line


def _min_med_max(xs: list, digits: int = 2) -> str:
    return f"{min(xs):.{digits}f} / {statistics.median(xs):.{digits}f} / {max(xs):.{digits}f}"


def _executors_back(sc, n: int, timeout_s: float) -> bool:
    from tfos._driver.spark_checks import live_executors

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
    ap.add_argument("--busy", default="compute", choices=("compute", "slow-feed"), help="what the healthy node does")
    ap.add_argument("--driver-runs", type=int, default=3, help="runs of driver-kill and driver-term (each starts a Spark)")
    ap.add_argument("--as-driver", default="", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.as_driver:
        return as_driver(a.as_driver, a.heartbeat_timeout, a.busy)
    faults = [f for f in a.only.split(",") if f]
    for f in faults:
        if f not in FAULTS:
            ap.error(f"unknown fault {f!r}")

    results: dict[str, list[float]] = {}
    samples: dict[str, str] = {}
    slow: dict[str, list[dict]] = {}
    relaunched = 0
    fresh = 0
    sc = _new_context("tfos-bench-failures") if any(not f.startswith("driver") for f in faults) else None
    try:
        with tempfile.TemporaryDirectory(prefix="tfos-bench-") as workdir:
            for fault in faults:
                for run in range(a.driver_runs if fault.startswith("driver") else a.runs):
                    if fault.startswith("driver"):
                        secs, line = driver_run(fault, a.heartbeat_timeout, workdir, run, a.busy)
                        results.setdefault(fault, []).append(secs)
                        samples.setdefault(fault, line)
                        print(f"{fault:11s} run {run + 1}: {secs:6.2f} s   {line[:150]}", flush=True)
                        continue
                    if not _executors_back(sc, 2, 90.0):
                        sc.stop()
                        sc = _new_context("tfos-bench-failures")
                        fresh += 1
                    if fault in RESTARTS:
                        secs, line = restart_run(sc, fault, a.heartbeat_timeout, workdir, run)
                    elif fault in SLOW:
                        secs, line, extra = slow_run(sc, fault, a.heartbeat_timeout, workdir, run, a.busy)
                        slow.setdefault(fault, []).append(extra)
                        line = (f"train() call to error {extra['call']:.2f} s, main_fun's raise to error {extra['raise']:.2f} s, "
                                f"first row lag {extra['lag1']:.3f} / {extra['lag0']:.3f} s; {line}")
                    else:
                        secs, line = one_run(sc, fault, a.heartbeat_timeout, workdir, run, a.busy)
                    results.setdefault(fault, []).append(secs)
                    samples.setdefault(fault, line)
                    print(f"{fault:19s} run {run + 1}: {secs:6.2f} s   {line[:150]}", flush=True)
                    if fault == "jvm-kill" or fault in RESTARTS:
                        if _executors_back(sc, 2, 90.0):
                            relaunched += 1
    finally:
        if sc is not None:
            sc.stop()

    hb = a.heartbeat_timeout
    targets = {"exception": 5.0, "tf-kill": 5.0, "jvm-kill": 5.0, "slow-producer-50ms": 5.0, "slow-producer-100ms": 5.0,
               "driver-kill": hb + 5.0, "driver-term": hb + 5.0}
    load = os.getloadavg()
    print()
    print(f"machine: {os.cpu_count()} CPUs, load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1 / 5 / 15 min) at the end")
    restarts = [f for f in faults if f in RESTARTS]
    faults = [f for f in faults if f not in RESTARTS]
    if restarts:
        print(f"Restart time: seconds from the executor JVM kill to every node of attempt 1 resumed "
              f"(max_restarts=1, local-cluster[2,1,1024], heartbeat_timeout={hb:g} s)")
        print(f"{'mode':<13}{'runs':>5}{'median s':>10}{'min s':>8}{'max s':>8}")
        for fault in restarts:
            xs = results[fault]
            print(f"{fault:<13}{len(xs):>5}{statistics.median(xs):>10.2f}{min(xs):>8.2f}{max(xs):>8.2f}")
        print()
    if not faults:
        return 0
    print(f"Seconds from fault to the driver's ClusterFailedError (driver-*: to every node process gone), "
          f"local-cluster[2,1,1024], healthy node busy: {a.busy}, heartbeat_timeout={hb:g} s, "
          f"feed_timeout={TFOS_FEED_TIMEOUT_S:g} s; target met by the median")
    print(f"{'fault':<21}{'runs':>5}{'median s':>10}{'min s':>8}{'max s':>8}{'target s':>10}{'met':>6}{'TFoS 600 s / median':>22}")
    for fault in faults:
        xs = results[fault]
        med, mn, mx = statistics.median(xs), min(xs), max(xs)
        print(f"{fault:<21}{len(xs):>5}{med:>10.2f}{mn:>8.2f}{mx:>8.2f}{targets[fault]:>10.0f}{'yes' if med <= targets[fault] else 'NO':>6}"
              f"{TFOS_FEED_TIMEOUT_S / med:>21.0f}x")
    if slow:
        print()
        print(f"Slow producer: {SLOW_ROWS_PER_PART} rows per partition; min / median / max over the runs (the table above: "
              "from the 10th row's production); targets: error <= 5 s after train()'s call, first row <= 0.5 s after it "
              "was produced")
        print(f"{'fault':<21}{'partition s':>12}{'train() to error s':>24}{'raise to error s':>22}"
              f"{'first row lag s (both nodes)':>32}{'met':>6}")
        for fault, recs in slow.items():
            lags = [r["lag1"] for r in recs] + [r["lag0"] for r in recs if r["lag0"] == r["lag0"]]
            calls = [r["call"] for r in recs]
            met = statistics.median(calls) <= 5.0 and statistics.median(lags) <= 0.5
            print(f"{fault:<21}{SLOW[fault] * SLOW_ROWS_PER_PART:>12.0f}{_min_med_max(calls):>24}"
                  f"{_min_med_max([r['raise'] for r in recs]):>22}{_min_med_max(lags, 3):>32}{'yes' if met else 'NO':>6}")
    if "jvm-kill" in results:
        print(f"executor relaunched by the standalone Worker after {relaunched}/{len(results['jvm-kill'])} JVM kills; "
              f"fresh SparkContexts needed: {fresh}")
    print()
    for fault, line in samples.items():
        print(f"{fault}: {line[:300]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
