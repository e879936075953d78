#!/usr/bin/env python
"""tfos against TensorFlowOnSpark (TFoS), side by side in one run: feed, inference, start, stop.

Both libraries run the same ``main_fun`` (one function; ``args['lib']`` names the package
whose ``TFNode.DataFeed`` it uses) on one ``local-cluster[2,1,1024]`` SparkContext, over the
same cached RDD of MNIST-shaped rows ``(numpy float32[784], int label)`` (the data of
``scripts/bench_feed.py``). Every repeat measures, for each library (the order alternates
between repeats, so a drift of the machine's load does not favour one):

* ``start``: seconds for ``TFCluster.run(sc, fun, args, 2, 0, False, InputMode.SPARK)`` to
  return and both nodes' ``main_fun`` to start (a file each writes);
* ``train``: rows/s of ``cluster.train(rdd, 1)`` into a ``main_fun`` draining
  ``DataFeed.next_batch(1000)`` (wall time of ``train()``), and its ratio to a plain Spark
  pass over the same cached RDD (``rdd.mapPartitions`` unpickling and counting every row),
  measured right before;
* ``stop``: seconds for ``cluster.shutdown()`` after that ``train()``;
* ``infer``: rows/s of ``cluster.inference(rdd)`` read by one Spark action that counts the
  results and sums their labels, with an identity ``main_fun`` (every row answered with
  itself), and its ratio to the plain pass.

Exact delivery is checked for both libraries in every repeat: the rows the nodes consumed
and the sum of their labels equal the RDD's; the inference result RDD has as many rows as
the input and the same label sum. A mismatch ends the run with exit status 1.

TFoS is not a dependency of tfos and nothing is downloaded: give the script a TFoS checkout
(e.g. ``git clone https://github.com/yahoo/TensorFlowOnSpark`` at tag v2.2.5); its
directory is put on the driver's and the executors' ``PYTHONPATH``. TFoS 2.2.5 imports
``pkg_resources`` (setuptools < 82) and ``packaging``. Each phase has a deadline
(``--phase-timeout-s``, 600 s): TFoS waits on a stuck node until its ``feed_timeout``, so
the script reports which phase overran and exits 3 rather than hang.

Usage::

    .venv/bin/python scripts/bench_vs_tfos.py /path/to/TensorFlowOnSpark [--rows 50000]
        [--partitions 8] [--repeat 3]

Figures and how they were measured: docs/performance.md ("tfos against TensorFlowOnSpark").
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# Importing bench_feed also sets the environment both benchmarks run with (PYSPARK_PYTHON,
# SPARK_LOCAL_IP, TFOS_PROGRESS=0, ...), before pyspark is imported.
from bench_feed import _count_rows, make_rdd  # noqa: E402 - the same data as bench_feed.py

LIBS = ("tensorflowonspark", "tfos")
NAMES = {"tensorflowonspark": "TFoS", "tfos": "tfos"}


def drain_fun(args, ctx):
    """Drains the feed (train) or answers every row with itself (inference); writes the
    node's row count and label sum when the feed ends. Runs in the node's TF process."""
    import importlib
    import json as _json
    import os as _os

    import numpy  # noqa: F401 - the rows are numpy arrays

    TFNode = importlib.import_module(args["lib"] + ".TFNode")
    name = f"{args['tag']}-{ctx.job_name}{ctx.task_index}"
    feed = TFNode.DataFeed(ctx.mgr, train_mode=not args["infer"])
    with open(_os.path.join(args["out"], name + ".ready"), "w") as f:
        f.write(_os.path.dirname(importlib.import_module(args["lib"]).__file__))
    n = 0
    label_sum = 0
    while not feed.should_stop():
        batch = feed.next_batch(args["batch"])
        if not batch:
            continue
        n += len(batch)
        label_sum += sum(int(row[1]) for row in batch)
        if args["infer"]:
            feed.batch_results(batch)
    with open(_os.path.join(args["out"], name + ".json"), "w") as f:
        _json.dump({"rows": n, "label_sum": label_sum}, f)


def _label_sum(it):
    yield sum(int(row[1]) for row in it)


def _count_and_label_sum(it):
    n = label_sum = 0
    for row in it:
        n += 1
        label_sum += int(row[1])
    yield n, label_sum


def _wait_files(out: str, tag: str, suffix: str, n: int, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while len(glob.glob(os.path.join(out, f"{tag}-*{suffix}"))) < n:
        if time.monotonic() > end:
            raise RuntimeError(f"cluster {tag!r}: {n} '{suffix}' files not written within {timeout_s:g} s")
        time.sleep(0.02)


def _node_sums(out: str, tag: str) -> tuple[int, int]:
    rows = label_sum = 0
    for p in glob.glob(os.path.join(out, f"{tag}-*.json")):
        d = json.load(open(p))
        rows += d["rows"]
        label_sum += d["label_sum"]
    return rows, label_sum


class Watchdog:
    """Ends the script (exit 3, naming the phase) when a phase overruns its deadline."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._phase = ""
        self._end = float("inf")
        self._lock = threading.Lock()
        threading.Thread(target=self._loop, name="bench-watchdog", daemon=True).start()

    def phase(self, name: str) -> None:
        with self._lock:
            self._phase, self._end = name, time.monotonic() + self.timeout_s

    def _loop(self) -> None:
        while True:
            time.sleep(1.0)
            with self._lock:
                late = time.monotonic() > self._end
                phase = self._phase
            if late:
                print(f"\nphase {phase!r} did not end within {self.timeout_s:g} s; giving up", file=sys.stderr, flush=True)
                os._exit(3)


def _fmt(xs: list[float], spec: str) -> str:
    return f"{min(xs):{spec}} {statistics.median(xs):{spec}} {max(xs):{spec}}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tfos_checkout", help="a TensorFlowOnSpark checkout (the directory holding tensorflowonspark/)")
    ap.add_argument("--rows", type=int, default=50_000)
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1000, help="next_batch() size on the nodes")
    ap.add_argument("--master", default="local-cluster[2,1,1024]")
    ap.add_argument("--phase-timeout-s", type=float, default=600.0)
    a = ap.parse_args(argv)

    checkout = os.path.abspath(a.tfos_checkout)
    if not os.path.isfile(os.path.join(checkout, "tensorflowonspark", "TFCluster.py")):
        print(f"{checkout}: no tensorflowonspark/TFCluster.py (give the root of a TensorFlowOnSpark checkout)", file=sys.stderr)
        return 2
    sys.path.insert(0, checkout)
    # The executors import tensorflowonspark from the checkout, and bench_feed (the data's
    # generator functions are pickled by reference) from this directory.
    paths = [checkout, os.path.dirname(os.path.abspath(__file__))] + list(filter(None, [os.environ.get("PYTHONPATH")]))
    os.environ["PYTHONPATH"] = os.pathsep.join(paths)
    try:
        import tensorflowonspark
        from tensorflowonspark import TFCluster as TFoSCluster
    except ImportError as exc:
        print(f"cannot import TensorFlowOnSpark from {checkout}: {exc} (TFoS 2.2.5 needs setuptools < 82 for "
              "pkg_resources, and packaging)", file=sys.stderr)
        return 2
    from pyspark import SparkConf, SparkContext, StorageLevel

    from tfos import TFCluster as TfosCluster

    cluster_mod = {"tensorflowonspark": TFoSCluster, "tfos": TfosCluster}
    dog = Watchdog(a.phase_timeout_s)
    load_start = os.getloadavg()
    conf = (
        SparkConf().setMaster(a.master).setAppName("tfos-bench-vs-tfos")
        .set("spark.ui.enabled", "false").set("spark.ui.showConsoleProgress", "false")
        .set("spark.driver.host", "127.0.0.1").set("spark.locality.wait", "0")
    )
    sc = SparkContext(conf=conf)
    sc.setLogLevel("ERROR")
    out = tempfile.mkdtemp(prefix="tfos-bench-vs-tfos-")
    rows, parts = a.rows, a.partitions
    times: dict[str, list[float]] = {}
    ratios: dict[str, list[float]] = {}
    ok = True

    def add(d: dict, key: str, v: float) -> None:
        d.setdefault(key, []).append(v)

    dog.phase("generating and caching the data")
    print(f"TFoS {getattr(tensorflowonspark, '__version__', '?')} from {os.path.dirname(tensorflowonspark.__file__)}; "
          f"generating {rows:,} rows in {parts} partitions ...", flush=True)
    rdd = make_rdd(sc, rows, parts).persist(StorageLevel.MEMORY_AND_DISK)
    assert rdd.count() == rows
    want_labels = sum(rdd.mapPartitions(_label_sum).collect())
    rdd.mapPartitions(_count_rows).collect()  # warm the Python workers

    def plain_pass() -> float:
        t0 = time.perf_counter()
        n = sum(rdd.mapPartitions(_count_rows).collect())
        dt = time.perf_counter() - t0
        assert n == rows, n
        return dt

    try:
        for rep in range(a.repeat):
            order = LIBS if rep % 2 == 0 else LIBS[::-1]
            for lib in order:
                mod = cluster_mod[lib]
                who = NAMES[lib]
                for infer in (False, True):
                    kind = "infer" if infer else "train"
                    tag = f"{kind}-{lib}-{rep}"
                    args = {"lib": lib, "tag": tag, "out": out, "batch": a.batch, "infer": infer}
                    dog.phase(f"{who} {kind}: plain pass")
                    plain = plain_pass()
                    dog.phase(f"{who} {kind}: TFCluster.run")
                    t0 = time.perf_counter()
                    cluster = mod.run(sc, drain_fun, args, 2, 0, False, mod.InputMode.SPARK)
                    _wait_files(out, tag, ".ready", 2, a.phase_timeout_s)
                    start = time.perf_counter() - t0
                    dog.phase(f"{who} {kind}: {'inference()' if infer else 'train()'}")
                    t0 = time.perf_counter()
                    if infer:
                        # One action: TFoS's result RDD is not persisted, a second action would
                        # feed the nodes again.
                        per_part = cluster.inference(rdd).mapPartitions(_count_and_label_sum).collect()
                        n_out, out_labels = sum(p[0] for p in per_part), sum(p[1] for p in per_part)
                    else:
                        cluster.train(rdd, 1)
                    feed = time.perf_counter() - t0
                    dog.phase(f"{who} {kind}: shutdown()")
                    t0 = time.perf_counter()
                    cluster.shutdown()
                    stop = time.perf_counter() - t0
                    _wait_files(out, tag, ".json", 2, 60.0)
                    fed, labels = _node_sums(out, tag)
                    checks = [("rows consumed by the nodes", fed, rows), ("label sum on the nodes", labels, want_labels)]
                    if infer:
                        checks += [("result rows", n_out, rows), ("result label sum", out_labels, want_labels)]
                    bad = [f"{what} {got:,} != {exp:,}" for what, got, exp in checks if got != exp]
                    ok = ok and not bad
                    add(times, f"{lib} start", start)
                    add(times, f"{lib} {kind}", feed)
                    add(ratios, f"{lib} {kind}", plain / feed)
                    if not infer:
                        add(times, f"{lib} stop", stop)
                    print(f"repeat {rep + 1} {who:<5} {kind}: start {start:5.2f} s, {kind} {feed:6.2f} s "
                          f"({rows / feed:9,.0f} rows/s, {plain / feed:.3f} of the plain pass's {rows / plain:,.0f} rows/s), "
                          f"shutdown {stop:5.2f} s; {'exact: ' + ', '.join(f'{w} {g:,}' for w, g, _ in checks) if not bad else 'MISMATCH: ' + '; '.join(bad)}",
                          flush=True)
    finally:
        dog.phase("stopping Spark")
        sc.stop()
    load_end = os.getloadavg()
    print()
    print(f"{rows:,} rows, {parts} partitions, {a.repeat} repeats, {a.master}; machine: {os.cpu_count()} CPUs, "
          f"load average {load_start[0]:.1f} at the start, {load_end[0]:.1f} at the end")
    print(f"{'':<28}{'TFoS (min median max)':>26}{'tfos (min median max)':>26}{'tfos/TFoS (medians)':>22}")
    for kind in ("train", "infer"):
        a_, b_ = ratios["tensorflowonspark " + kind], ratios["tfos " + kind]
        print(f"{kind + ' / plain pass':<28}{_fmt(a_, '8.3f'):>26}{_fmt(b_, '8.3f'):>26}"
              f"{statistics.median(b_) / statistics.median(a_):>21.1f}x")
    for what in ("start", "stop"):
        a_, b_ = times["tensorflowonspark " + what], times["tfos " + what]
        print(f"{what + ' (s)':<28}{_fmt(a_, '8.2f'):>26}{_fmt(b_, '8.2f'):>26}"
              f"{statistics.median(a_) / statistics.median(b_):>21.1f}x")
    print("exact delivery (row counts and label sums, both libraries, every repeat): " + ("yes" if ok else "NO"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
