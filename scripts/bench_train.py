#!/usr/bin/env python
"""Fed training against in-memory training: the MNIST Keras model on the same 2-node cluster.

One run, one ``local-cluster[2,1,1024]`` SparkContext. Every repeat starts a tfos cluster
of 2 nodes (chief + worker, InputMode.SPARK) per data source; on that cluster, side by
side, both nodes join a ``MultiWorkerMirroredStrategy`` and train the MLP of
``examples/mnist/keras`` (tf_keras, ``TF_USE_LEGACY_KERAS=1``, 784-256-128-10, Adam) for
``--epochs`` epochs:

(b) memory: on in-memory numpy arrays (each node generates its half of the rows,
    ``from_tensor_slices(...).batch(batch).repeat().prefetch(2)``);
(a) fed: on the rows that ``cluster.train(data, epochs, end_of_feed=True)`` feeds it,
    through ``DataFeed.as_dataset(batch, ..., steps_per_epoch=S)`` (the tf.data fast path,
    ``tfos/_data/tfdata.py``), from a cached RDD of ``(float32[784], int)`` rows (``rdd``:
    PySpark pickled batches) or a cached DataFrame ``image array<float>, label long``
    (``df``: Arrow chunks).

Both modes train with one ``model.fit(ds, epochs, steps_per_epoch=S)``, ``S =
DataFeed.steps_per_epoch(rows, batch, 2)``, the dataset handed to Keras through
``strategy.distribute_datasets_from_function`` (each node's batch is its step).
``--fit per-epoch`` runs the earlier form: fed, one ``fit`` per epoch on
``as_dataset(global batch, per_epoch=True)``; memory, ``fit(epochs)`` on ``.batch(global
batch)``.

The same rows (deterministic, generated on the executors), the same batch size, no
shuffling in either mode. Rows/s is measured on the chief: from the end of the first
step (which traces the model) to the end of ``fit``, over all the rows both nodes trained
minus the first step's. It prints every repeat, min/median/max of rows/s per mode, the
fed/memory ratio per repeat and over the medians (target >= 0.9), the longest gap between
two epochs, the seconds TensorFlow waited for fed data (and for the first batch), the CPU
seconds each kind of process used during ``train()``, each node's fed rows per epoch (Spark
decides which executor, hence which node, feeds a partition), at how many epoch boundaries
and for how long each node held a later epoch back until the earlier one was complete
(``tfos._data.epoch_order.EpochOrder``), the chief's count of
``train_function`` traces, median step time and steps over 20 median steps in each mode,
and the load average.

Exact delivery, asserted in every mode and repeat: the rows each node handed to
TensorFlow, summed over the nodes, equal the rows fed (``rows x epochs``), and the float64
sums of the pixels and of the labels handed to TensorFlow equal those of the data
(computed on the driver with Spark, and by the nodes for the memory mode).

Usage::

    .venv/bin/python scripts/bench_train.py --rows 60000 --epochs 3 --repeat 3

``--sources rdd,df`` picks the fed sources; ``--batch`` is the batch per worker (the
example's default, 128); ``--json FILE`` also writes the figures.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ.setdefault("TFOS_PROGRESS", "0")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples", "mnist", "keras"))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import mnist_common as common  # noqa: E402 - shipped by value to the nodes (main())
from bench_cpu import cpu_by_class, cpu_delta  # noqa: E402 - driver side only

IMAGE = 784
TARGET = 0.9


# ------------------------------------------------------------------------------- data
def partition_arrays(index: int, rows: int):
    """``(images float32[rows, 784], labels int64[rows])`` of partition ``index`` (anywhere).

    Deterministic, so the RDD, the DataFrame and the in-memory arrays hold the same values.
    """
    import numpy as np

    rng = np.random.default_rng(4321 + index)
    return rng.random((rows, IMAGE), dtype=np.float32), rng.integers(0, 10, rows).astype(np.int64)


def split(rows: int, parts: int) -> list[int]:
    return [rows // parts + (1 if i < rows % parts else 0) for i in range(parts)]


def make_rdd(sc, rows: int, parts: int):
    per = split(rows, parts)

    def gen(index, _it):
        x, y = partition_arrays(index, per[index])
        for j in range(len(y)):
            yield (x[j], int(y[j]))

    return sc.parallelize(range(parts), parts).mapPartitionsWithIndex(gen)


def make_df(spark, rows: int, parts: int):
    per = split(rows, parts)

    def gen(batches):
        import numpy as np
        import pyarrow as pa

        for b in batches:
            for index in b.column(0).to_pylist():
                x, y = partition_arrays(index, per[index])
                for s in range(0, len(y), 5000):
                    xs, ys = x[s : s + 5000], y[s : s + 5000]
                    offsets = pa.array(np.arange(0, (len(ys) + 1) * IMAGE, IMAGE, dtype=np.int32))
                    image = pa.ListArray.from_arrays(offsets, pa.array(xs.reshape(-1)))
                    yield pa.RecordBatch.from_arrays([image, pa.array(ys)], ["image", "label"])

    return spark.range(0, parts, 1, numPartitions=parts).mapInArrow(gen, "image array<float>, label long")


# ---------------------------------------------------------------------------- main_fun
def main_fun(args, ctx):
    """Memory mode, then fed mode, on the same MWMS cluster; the chief writes the timings."""
    import numpy as np

    tf, keras = common.import_tf_keras()
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    workers = strategy.num_replicas_in_sync
    global_batch = args["batch"] * workers
    epochs = args["epochs"]
    name = f"{ctx.job_name}{ctx.task_index}"
    me = 0 if ctx.job_name == "chief" else 1 + ctx.task_index
    chief = me == 0
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF

    class Timer(keras.callbacks.Callback):
        first_end = None
        _last = None

        def on_train_begin(self, logs=None):
            self.steps = getattr(self, "steps", 0)
            self.gaps = getattr(self, "gaps", [])

        def on_epoch_begin(self, epoch, logs=None):
            self._epoch_steps = 0

        def on_train_batch_begin(self, batch, logs=None):
            self._step_began = time.monotonic()
            if self._epoch_steps == 0 and self._last is not None:
                self.gaps.append(time.monotonic() - self._last)

        def on_train_batch_end(self, batch, logs=None):
            self.step_s = getattr(self, "step_s", [])
            self.step_s.append(time.monotonic() - self._step_began)
            self.steps += 1
            self._epoch_steps += 1
            self._last = time.monotonic()
            if self.first_end is None:
                self.first_end = self._last

        def on_train_end(self, logs=None):
            self.end = time.monotonic()

    steps = args["steps"]  # the same on every node: DataFeed.steps_per_epoch(rows, batch, nodes)

    def fit(ds, per_epoch_calls):
        with strategy.scope():
            model = common.build_model(keras)
        timer = Timer()
        began = time.monotonic()
        cpu0 = time.process_time()  # CPU of the whole TF process: TF's threads and the feed's
        if per_epoch_calls:  # --fit per-epoch, fed: one fit per epoch (as_dataset(per_epoch=True))
            for e in range(epochs):
                model.fit(ds, initial_epoch=e, epochs=e + 1, verbose=0, callbacks=[timer])
        elif args["fit"] == "steps":  # one fit, one iterator, every epoch `steps` batches on each node
            model.fit(ds, epochs=epochs, steps_per_epoch=steps, verbose=0, callbacks=[timer])
        else:
            model.fit(ds, epochs=epochs, verbose=0, callbacks=[timer])
        fn = model.train_function
        traces = fn.experimental_get_tracing_count() if hasattr(fn, "experimental_get_tracing_count") else -1
        return {"fit_s": timer.end - began, "timed_s": timer.end - timer.first_end, "steps": timer.steps,
                "cpu_s": time.process_time() - cpu0,
                "max_gap_s": max(timer.gaps) if timer.gaps else 0.0, "gaps_s": timer.gaps, "traces": traces,
                "step_s": timer.step_s}

    # (b) in-memory numpy: this node's share of the partitions (round robin).
    per = split(args["rows"], args["parts"])
    blocks = [partition_arrays(i, per[i]) for i in range(me, args["parts"], workers)]
    x = np.concatenate([b[0] for b in blocks])
    y = np.concatenate([b[1] for b in blocks])
    del blocks
    if args["fit"] == "steps":
        # Each node's batches of --batch rows are its steps (not split again by MWMS).
        assert -(-len(y) // args["batch"]) == steps, (len(y), steps)
        local = tf.data.Dataset.from_tensor_slices((x, y)).batch(args["batch"]).repeat().prefetch(2)
        mem_ds = strategy.distribute_datasets_from_function(lambda _ctx: local)
    else:
        mem_ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch).prefetch(2).with_options(options)
    mem = fit(mem_ds, False)
    mem.update(rows=len(y) * epochs, sums=[float(x.sum(dtype=np.float64)) * epochs, float(y.sum()) * epochs])
    del mem_ds, x, y
    with open(os.path.join(args["out"], f"{args['tag']}-{name}.memdone"), "w") as f:
        f.write("1")

    # (a) fed by cluster.train(): the tf.data fast path, one epoch per dataset iteration.
    feed = ctx.get_data_feed(train_mode=True)
    sig = (tf.TensorSpec((None, IMAGE), tf.float32), tf.TensorSpec((None,), tf.int64))
    if args["feed"] == "once":
        # Fed once (the driver calls cluster.train(data, 1, end_of_feed=True)): the first
        # epoch reads the feed and tf.data caches its S batches in memory; the later
        # epochs replay them (the same batches in the same order).
        ds = feed.as_dataset(args["batch"], sig, steps_per_epoch=steps, buffer_batches=args["buffer_batches"])
        reader = ds.tfos_batches
        reader.track_sums = True
        cached = ds.cache().repeat()
        fed = fit(strategy.distribute_datasets_from_function(lambda _ctx: cached), False)
    elif args["fit"] == "steps":
        ds = feed.as_dataset(args["batch"], sig, steps_per_epoch=steps, buffer_batches=args["buffer_batches"])
        reader = ds.tfos_batches
        reader.track_sums = True
        fed = fit(strategy.distribute_datasets_from_function(lambda _ctx: ds), False)
    else:
        ds = feed.as_dataset(global_batch, sig, per_epoch=True)
        reader = ds.tfos_batches
        reader.track_sums = True
        fed = fit(ds, True)
    while not reader.ended:  # normally nothing: the last epoch ended at the end of the feed
        for _ in reader:
            pass
    sums = [0.0, 0.0]
    for s in reader.sums.values():
        sums = [a + b for a, b in zip(sums, s)]
    fed.update(rows=sum(reader.rows.values()), rows_per_epoch=dict(reader.rows), sums=sums, wait_s=reader.wait_s, first_wait_s=reader.first_wait_s,
               buffer_bytes=reader.buffer_bytes, order_waits=reader.order.waits if reader.order else 0,
               order_boundaries=reader.order.boundaries if reader.order else 0,
               order_wait_s=reader.order.wait_s if reader.order else 0.0)
    with open(os.path.join(args["out"], f"{args['tag']}-{name}.json"), "w") as f:
        json.dump({"chief": chief, "memory": mem, "fed": fed, "global_batch": global_batch}, f)


# ------------------------------------------------------------------------------- main
def _wait(pattern: str, n: int, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while len(glob.glob(pattern)) < n:
        if time.monotonic() > end:
            raise RuntimeError(f"{pattern}: {len(glob.glob(pattern))} of {n} files after {timeout_s:g} s")
        time.sleep(0.2)


def _count_rows(it):
    n = 0
    for _ in it:
        n += 1
    yield (n,)


def _count_arrow(batches):
    import pyarrow as pa

    n = 0
    for b in batches:
        n += b.num_rows
    yield pa.RecordBatch.from_arrays([pa.array([n], pa.int64())], ["n"])


def _spread(values: list[float]) -> str:
    return f"{min(values):>9,.0f} {statistics.median(values):>9,.0f} {max(values):>9,.0f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=60_000, help="rows per epoch (all nodes)")
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch", type=int, default=128, help="rows per step on each worker")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--sources", default="rdd,df", help="comma list of: rdd, df")
    ap.add_argument("--master", default="local-cluster[2,1,1024]")
    ap.add_argument("--executor-memory", default="1024m")
    ap.add_argument("--locality-wait", default="0",
                    help="spark.locality.wait (Spark's default is 3s; see docs/performance.md)")
    ap.add_argument("--fit", choices=("steps", "per-epoch"), default="steps",
                    help="steps: one model.fit(epochs=n, steps_per_epoch=S) in both modes, the fed dataset from "
                         "as_dataset(steps_per_epoch=S) (default); per-epoch: one fit per epoch on "
                         "as_dataset(per_epoch=True), the memory mode one fit(epochs=n) (the earlier version)")
    ap.add_argument("--buffer-batches", type=int, default=None,
                    help="as_dataset(buffer_batches=) of the fed mode (default: about 32 MB)")
    ap.add_argument("--feeds", default="epochs,once",
                    help="comma list of: epochs (cluster.train(data, epochs): Spark feeds every epoch), once "
                         "(cluster.train(data, 1): the nodes cache the fed epoch with tf.data and replay it)")
    ap.add_argument("--json", default="", help="also write the figures to this JSON file")
    a = ap.parse_args()
    sources = [s for s in a.sources.split(",") if s]
    assert set(sources) <= {"rdd", "df"}, sources
    feeds = [f for f in a.feeds.split(",") if f]
    assert set(feeds) <= {"epochs", "once"} and feeds, feeds
    if "once" in feeds and a.fit != "steps":
        ap.error("--feeds once needs --fit steps")
    variants = [(src, fd) for src in sources for fd in feeds]

    def key(src: str, fd: str) -> str:
        return src if fd == "epochs" else f"{src}+cache"

    import numpy as np
    from pyspark import SparkConf, SparkContext, StorageLevel
    from pyspark.sql import SparkSession

    from tfos import TFCluster
    from tfos.datafeed import DataFeed

    common.ship_by_value(common)
    load_start = os.getloadavg()
    conf = (
        SparkConf().setMaster(a.master).setAppName("tfos-bench-train")
        .set("spark.ui.enabled", "false").set("spark.ui.showConsoleProgress", "false")
        .set("spark.driver.host", "127.0.0.1").set("spark.executor.memory", a.executor_memory)
        .set("spark.locality.wait", a.locality_wait)
    )
    sc = SparkContext(conf=conf)
    sc.setLogLevel("ERROR")
    spark = SparkSession(sc)
    out = tempfile.mkdtemp(prefix="tfos-bench-train-")
    rows, parts, epochs = a.rows, a.partitions, a.epochs
    data = {}
    print(f"generating {rows:,} rows in {parts} partitions ...", flush=True)
    if "rdd" in sources:
        data["rdd"] = make_rdd(sc, rows, parts).persist(StorageLevel.MEMORY_AND_DISK)
    if "df" in sources:
        data["df"] = make_df(spark, rows, parts).persist(StorageLevel.MEMORY_AND_DISK)
    expect = {}
    for src, d in data.items():
        r = d.rdd if src == "df" else d
        got = r.map(lambda row: (1, float(np.asarray(row[0], np.float32).sum(dtype=np.float64)), int(row[1]))) \
               .reduce(lambda p, q: (p[0] + q[0], p[1] + q[1], p[2] + q[2]))
        assert got[0] == rows, (src, got)
        expect[src] = (rows * epochs, got[1] * epochs, float(got[2]) * epochs)
    mem_expect = (0, 0.0, 0.0)
    per = split(rows, parts)
    for i in range(parts):
        x, y = partition_arrays(i, per[i])
        mem_expect = (mem_expect[0] + len(y) * epochs, mem_expect[1] + float(x.sum(dtype=np.float64)) * epochs,
                      mem_expect[2] + float(y.sum()) * epochs)
    for src in expect:  # the fed data are the very rows the nodes generate in memory
        assert expect[src][0] == mem_expect[0] and abs(expect[src][1] - mem_expect[1]) <= 1e-9 * mem_expect[1], (src, expect, mem_expect)

    steps = DataFeed.steps_per_epoch(rows, a.batch, 2)
    if a.fit == "steps":
        node_rows = [sum(per[i] for i in range(me, parts, 2)) for me in range(2)]
        if any(-(-n // a.batch) != steps for n in node_rows):
            ap.error(f"--fit steps: the memory mode needs {steps} batches of {a.batch} rows on each node, but the nodes "
                     f"hold {node_rows} rows; pick --rows/--partitions that split evenly")
    results: dict = {key(src, fd): [] for src, fd in variants}
    passes: dict = {src: [] for src in sources}  # a plain Spark pass over the data: CPU s per epoch
    loads: list[float] = []
    try:
        for r in range(a.repeat):
            for src, fd in variants:
                tag = f"{src}{fd}{r}"
                fed_epochs = epochs if fd == "epochs" else 1
                args = dict(out=out, tag=tag, rows=rows, parts=parts, epochs=epochs, batch=a.batch, fit=a.fit,
                            steps=steps, buffer_batches=a.buffer_batches, feed=fd)
                t0 = time.monotonic()
                cluster = TFCluster.run(sc, main_fun, args, 2, 0, False, TFCluster.InputMode.SPARK,
                                        master_node="chief", progress=False)
                try:
                    _wait(os.path.join(out, f"{tag}-*.memdone"), 2, 900)
                    cpu0 = cpu_by_class()
                    t1 = time.monotonic()
                    cluster.train(data[src], fed_epochs, end_of_feed=True)
                    train_s = time.monotonic() - t1
                    cpu = cpu_delta(cpu0, cpu_by_class())
                    cluster.shutdown(timeout=600)
                finally:
                    cluster = None
                total_s = time.monotonic() - t0
                loads.append(os.getloadavg()[0])
                nodes = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(out, f"{tag}-*.json")))]
                assert len(nodes) == 2, nodes
                chief = next(n for n in nodes if n["chief"])
                row = {"train_s": train_s, "cluster_s": total_s, "load": loads[-1], "train_cpu_s": cpu}
                fed_expect = expect[src] if fd == "epochs" else tuple(x / epochs if i else rows for i, x in enumerate(expect[src]))
                for mode, exp in (("memory", mem_expect), ("fed", fed_expect)):
                    n_rows = sum(n[mode]["rows"] for n in nodes)
                    px = sum(n[mode]["sums"][0] for n in nodes)
                    lab = sum(n[mode]["sums"][1] for n in nodes)
                    assert n_rows == exp[0], f"{tag} {mode}: the nodes trained on {n_rows:,} rows, expected {exp[0]:,}"
                    assert abs(px - exp[1]) <= 1e-9 * abs(exp[1]), f"{tag} {mode}: pixel sum {px!r}, expected {exp[1]!r}"
                    assert lab == exp[2], f"{tag} {mode}: label sum {lab!r}, expected {exp[2]!r}"
                    c = chief[mode]
                    timed_rows = n_rows - chief["global_batch"]
                    med_step = statistics.median(c["step_s"])
                    if mode == "fed" and fd == "once":
                        # every epoch replays the fed one: the rows trained are epochs x the rows fed
                        assert c["steps"] == epochs * steps, f"{tag}: the chief ran {c['steps']} steps, expected {epochs * steps}"
                        timed_rows = n_rows * epochs - chief["global_batch"]
                    row[mode] = {"rows_s": timed_rows / c["timed_s"], "fit_s": c["fit_s"], "timed_s": c["timed_s"],
                                 "tf_cpu_s": [n[mode]["cpu_s"] for n in nodes],
                                 "steps": c["steps"], "max_gap_s": c["max_gap_s"], "gaps_s": c["gaps_s"], "rows": n_rows,
                                 "traces": c["traces"], "median_step_s": med_step,
                                 # steps after the first taking over 20 median steps (e.g. a retrace)
                                 "slow_steps": [(i, round(t, 3)) for i, t in enumerate(c["step_s"]) if i and t > 20 * med_step]}
                row["fed"]["wait_s"] = [n["fed"]["wait_s"] for n in nodes]
                row["fed"]["first_wait_s"] = [n["fed"]["first_wait_s"] for n in nodes]
                row["fed"]["rows_per_node"] = [n["fed"]["rows"] for n in nodes]
                # times a node held a later epoch back (Spark fed it first) and the seconds it took
                row["fed"]["order_waits"] = [n["fed"].get("order_waits", 0) for n in nodes]
                row["fed"]["order_boundaries"] = [n["fed"].get("order_boundaries", 0) for n in nodes]
                row["fed"]["order_wait_s"] = [n["fed"].get("order_wait_s", 0.0) for n in nodes]
                # {epoch: rows} of each node (Spark decides which executor, hence node, feeds a partition)
                row["fed"]["rows_per_node_epoch"] = [[n["fed"]["rows_per_epoch"].get(str(e), 0) for e in range(epochs)]
                                                     for n in nodes]
                row["ratio"] = row["fed"]["rows_s"] / row["memory"]["rows_s"]
                results[key(src, fd)].append(row)
                print(f"repeat {r + 1}/{a.repeat} {key(src, fd)}: memory {row['memory']['rows_s']:,.0f} rows/s, "
                      f"fed {row['fed']['rows_s']:,.0f} rows/s, ratio {row['ratio']:.2f}; max gap between epochs "
                      f"memory {row['memory']['max_gap_s']:.3f} s, fed {row['fed']['max_gap_s']:.3f} s; fed rows per node "
                      f"{row['fed']['rows_per_node']} (per epoch {row['fed']['rows_per_node_epoch']}), TF waited {', '.join(f'{w:.1f}' for w in row['fed']['wait_s'])} s "
                      f"for data ({', '.join(f'{w:.1f}' for w in row['fed']['first_wait_s'])} s of it for the first "
                      f"batch; later epochs held back at {row['fed']['order_waits']} of {row['fed']['order_boundaries']} "
                      f"epoch boundaries, "
                      f"{', '.join(f'{w:.2f}' for w in row['fed']['order_wait_s'])} s); train() {train_s:.1f} s; verified {row['fed']['rows']:,} rows + checksums; "
                      f"load {loads[-1]:.1f}; CPU s during train(): "
                      + ", ".join(f"{k} {v:.1f}" for k, v in sorted(cpu.items()))
                      + "; TF-process CPU s (both nodes) memory "
                      + f"{sum(row['memory']['tf_cpu_s']):.1f}, fed {sum(row['fed']['tf_cpu_s']):.1f}"
                      + "; chief's train_function traces, median step ms, slow steps (index, s): "
                      + "; ".join(f"{m} {row[m]['traces']}, {1000 * row[m]['median_step_s']:.1f}, {row[m]['slow_steps']}"
                                  for m in ("memory", "fed")), flush=True)
            for src in sources:
                # What Spark itself spends to read the cached data once, with no tfos and no
                # TensorFlow: one plain pass (every row reaches Python), CPU s per process class.
                pass_fn = (lambda d=data[src]: d.mapInArrow(_count_arrow, "n long").collect()) if src == "df" \
                    else (lambda d=data[src]: d.mapPartitions(_count_rows).collect())
                cpu0 = cpu_by_class()
                t1 = time.monotonic()
                counted = sum(int(x[0]) for x in pass_fn())
                pass_s = time.monotonic() - t1
                cpu = cpu_delta(cpu0, cpu_by_class())
                assert counted == rows, (src, counted, rows)
                passes[src].append({"wall_s": pass_s, "cpu_s": sum(cpu.values()), "cpu_by_class": cpu})
                print(f"repeat {r + 1}/{a.repeat} {src}: one plain Spark pass over the cached data ({rows:,} rows counted in "
                      f"Python): {pass_s:.2f} s, CPU s " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(cpu.items())), flush=True)
    finally:
        sc.stop()

    load_end = os.getloadavg()
    print()
    print(f"tfos training benchmark: MNIST MLP (tf_keras), MWMS on 2 nodes (chief + worker), {a.master}; "
          f"{rows:,} rows x {epochs} epochs, batch {a.batch} per worker, {parts} partitions, repeat {a.repeat}, "
          f"spark.locality.wait={a.locality_wait}, --fit {a.fit}")
    print(f"{'source':<9} {'mode':<8} {'min rows/s':>10} {'median':>9} {'max':>9}   {'max gap between epochs (s)':>26}")
    figures: dict = {}
    keys = [key(src, fd) for src, fd in variants]
    for k in keys:
        rs = results[k]
        for mode in ("memory", "fed"):
            rates = [x[mode]["rows_s"] for x in rs]
            gaps = [x[mode]["max_gap_s"] for x in rs]
            figures[f"{k}/{mode}"] = {"rows_s": rates, "max_gap_s": gaps}
            print(f"{k:<9} {mode:<8} {_spread(rates)}   {' '.join(f'{g:.3f}' for g in gaps):>26}")
    print()
    print("CPU bound of the ratio on this machine, per repeat: M / (M + n x P), M the TF processes' CPU s in the memory\n"
          "mode, P the CPU s of one plain Spark pass over the same cached data (all classes), n the epochs Spark\n"
          "reads (the epochs, or 1 with +cache); a bound only while the memory mode keeps the CPUs busy (its use\n"
          "of the CPUs is printed)")
    bounds: dict = {}
    for src, fd in variants:
        k = key(src, fd)
        n_read = epochs if fd == "epochs" else 1
        b, use = [], []
        for x, p in zip(results[k], passes[src]):
            m = sum(x["memory"]["tf_cpu_s"])
            b.append(m / (m + n_read * p["cpu_s"]))
            use.append(m / (x["memory"]["fit_s"] * (os.cpu_count() or 1)))
        bounds[k] = b
        figures[f"{k}/cpu_bound"] = {"per_repeat": b, "memory_cpu_use": use,
                                     "pass_cpu_s": [p["cpu_s"] for p in passes[src]]}
        pass_cpu = " ".join(f"{p['cpu_s']:.2f}" for p in passes[src])
        print(f"{k:<9} bound {' '.join(f'{v:.2f}' for v in b)} (median {statistics.median(b):.2f}); plain pass CPU s "
              f"{pass_cpu} per epoch; memory mode used "
              f"{' '.join(f'{u:.0%}' for u in use)} of the {os.cpu_count()} CPUs")
    print()
    print(f"{'ratio fed/memory':<18} {'median/median':>13} {'per repeat (min median max)':>30}  target  (CPU bound, median)")
    for k in keys:
        rs = results[k]
        med = statistics.median(x["fed"]["rows_s"] for x in rs) / statistics.median(x["memory"]["rows_s"] for x in rs)
        per_rep = [x["ratio"] for x in rs]
        figures[f"{k}/ratio"] = {"median_of_medians": med, "per_repeat": per_rep}
        ok = "ok" if med >= TARGET else "MISSED"
        print(f"{k:<18} {med:>13.2f} {min(per_rep):>10.2f} {statistics.median(per_rep):>9.2f} {max(per_rep):>9.2f}  "
              f">= {TARGET} {ok:<6}  ({statistics.median(bounds[k]):.2f})")
    print(f"\nload average (1 min): start {load_start[0]:.1f}, end {load_end[0]:.1f}, after each run "
          f"min {min(loads):.1f} / median {statistics.median(loads):.1f} / max {max(loads):.1f}; {os.cpu_count()} CPUs")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "figures": figures, "runs": results, "plain_passes": passes,
                       "load": {"start": load_start, "end": load_end, "after_runs": loads}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
