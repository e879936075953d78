#!/usr/bin/env python
"""Feed throughput benchmark: tfos train()/inference() against plain Spark passes.

Everything is measured in one run, on one ``local-cluster[2,1,1024]`` SparkContext, over the
same MNIST-shaped data (rows ``(numpy float32[784], int label)``), cached in executor memory
before anything is timed. Each repeat measures the plain-Spark ceiling and the tfos
numbers side by side, so the ratios compare runs made under the same machine load.

Measured (rows per second, best and median of ``--repeat`` runs):

1. ceiling (RDD): ``rdd.mapPartitions`` that unpickles and counts every row in Python;
2. tfos train (RDD): ``cluster.train(rdd, 1)`` into a main_fun draining
   ``DataFeed.next_batch(batch)`` (2 nodes, InputMode.SPARK; train() wall time only);
3. ceiling (DataFrame): ``df.mapInArrow`` that counts rows;
4. tfos train (DataFrame): ``cluster.train(df, 1)`` (Arrow path), same main_fun;
5. tfos inference (RDD): ``cluster.inference(rdd)`` with an identity main_fun;
5b. the same with label results (one int per row), for comparison;
1p, 1q. Spark's own ``rdd.map(identity)`` / ``rdd.map(label)`` with the output persisted
   ``MEMORY_AND_DISK_DESER`` and computed with a JVM-side count, as ``inference()`` stores
   and computes its results: the same work without tfos (ratios 5/1p, 5b/1q, 1p/1 and 1q/1 are
   printed for information; the targets compare with the plain pass 1);
6. ceiling (C24 DataFrame): ``mapInArrow`` count over a DataFrame of the C24 column kinds
   (``array<array<float>>``, ML vector, struct, ``array<bigint>`` with nulls, label);
7. tfos train (C24 DataFrame): its main_fun checks every row's values (sums compared with
   Spark SQL's) and the Python types of each batch; 7/6 is the cost of exactness (>= 0.73).

It verifies every count (node row counts after shutdown, result RDD counts and label sums),
samples the RSS of the TF processes (every 0.1 s) and compares the growth over the pre-feed
baseline with ``(queue_chunks + 2) x chunk bytes``, and prints the load average. Figures and
their explanation: docs/performance.md.

Usage::

    .venv/bin/python scripts/bench_feed.py --rows 200000 --partitions 8 --repeat 3

It also times the first ``train()`` of a newly started cluster in every repeat (2f: RDD,
4f: DataFrame; those nodes' main_fun does not import pyarrow itself), prints
min/median/max rows/s over the repeats and the peak RSS of the node processes, checks
exact delivery in every mode (row counts and label sums: train nodes, first-train
clusters, inference results, C24 sums), and checks that a node's memory stays bounded while
the rows fed grow (``--scale 25000,400000``: uncached inputs of those sizes, fed to the
``next_batch`` train cluster as RDDs and to an ``as_dataset`` (tf.data) cluster as RDDs and
DataFrames; the bound is printed with PASS/FAIL per run; the exit status is 1 on a FAIL).

``--profile DIR`` runs the nodes' main_fun under cProfile and writes
``DIR/<cluster>-<node>.prof`` (read with ``python -m pstats``); ``--skip df,infer,small,first,c24,tfdata``
leaves measurements out; ``--json FILE`` also writes the figures as JSON.
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

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ.setdefault("TFOS_PROGRESS", "0")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cpu import cpu_by_class, cpu_delta  # noqa: E402 - driver side only

IMAGE = 784
SEED = 1234
GEN_BLOCK = 1000


# ------------------------------------------------------------------------------- data
def _partition_blocks(index: int, rows_per_part: int):
    """Yields ``(images float32[k, 784], labels int64[k])`` blocks of partition ``index``.

    Deterministic: the RDD and the DataFrame get exactly the same values.
    """
    import numpy as np

    rng = np.random.default_rng(SEED + index)
    left = rows_per_part
    while left > 0:
        k = min(GEN_BLOCK, left)
        yield rng.random((k, IMAGE), dtype=np.float32), rng.integers(0, 10, k)
        left -= k


def make_rdd(sc, rows: int, parts: int):
    """An RDD of ``(float32[784], int)`` tuples, generated on the executors (driver)."""
    per = _split(rows, parts)

    def gen(index, _it):
        for imgs, labels in _partition_blocks(index, per[index]):
            for j in range(len(labels)):
                yield (imgs[j].copy(), int(labels[j]))

    return sc.parallelize(range(parts), parts).mapPartitionsWithIndex(gen)


def make_df(spark, rows: int, parts: int):
    """A DataFrame ``image array<float>, label long`` with the same rows as :func:`make_rdd`."""
    per = _split(rows, parts)

    def gen(batches):
        import numpy as np
        import pyarrow as pa

        for b in batches:
            for index in b.column(0).to_pylist():
                for imgs, labels in _partition_blocks(index, per[index]):
                    k = len(labels)
                    offsets = pa.array(np.arange(0, (k + 1) * IMAGE, IMAGE, dtype=np.int32))
                    image = pa.ListArray.from_arrays(offsets, pa.array(imgs.reshape(-1)))
                    yield pa.RecordBatch.from_arrays([image, pa.array(labels.astype(np.int64))], ["image", "label"])

    base = spark.range(0, parts, 1, numPartitions=parts)
    return base.mapInArrow(gen, "image array<float>, label long")


def make_c24_df(spark, rows: int, parts: int):
    """A DataFrame of the C24 column kinds (issue 17): ``img array<array<float>>`` (28 x 28),
    ``vec`` a dense Spark ML vector (4), ``st struct<a double, b long>``, ``ints
    array<bigint>`` with a null and a value above 2**53 in every 7th row, ``label long``."""
    from pyspark.ml.functions import array_to_vector

    base = spark.range(0, rows, 1, numPartitions=parts)
    df = base.selectExpr(
        "transform(sequence(0, 27), i -> transform(sequence(0, 27), "
        "j -> cast(((id * 7 + i * 28 + j) % 1000) / 1000.0 as float))) as img",
        "array(cast(id as double), cast(id % 13 as double), 0.5D, cast(id % 3 as double)) as vec",
        "named_struct('a', cast(id as double) / 2, 'b', id * 3) as st",
        "case when id % 7 = 0 then array(1152921504606846977L + id, cast(null as bigint)) else array(id, id + 1) end as ints",
        "id % 10 as label",
    )
    return df.withColumn("vec", array_to_vector("vec"))


#: Modulus of the checksum of the ``ints`` column of :func:`make_c24_df` (its values exceed 2**53).
C24_MOD = 1_000_003


def c24_expected(df) -> dict:
    """The checksums a node computes over :func:`make_c24_df` rows, computed by Spark (driver)."""
    r = df.selectExpr(
        "count(*) as rows", "sum(label) as label_sum",
        f"sum(aggregate(ints, 0L, (acc, x) -> acc + coalesce(x % {C24_MOD}, 0L))) as int_sum",
        "sum(size(filter(ints, x -> x is null))) as nulls", "sum(st.b) as st_sum",
    ).collect()[0]
    return {k: int(r[k]) for k in ("rows", "label_sum", "int_sum", "nulls", "st_sum")}


def _split(rows: int, parts: int) -> list[int]:
    return [rows // parts + (1 if i < rows % parts else 0) for i in range(parts)]


# ---------------------------------------------------------------------------- main_funs
def train_fun(args, ctx):
    """Drains the feed as fast as possible; writes the node's row count at the end of feed."""
    import cProfile
    import json as _json

    import numpy  # noqa: F401 - imported before the baseline RSS is taken

    if args.get("import_arrow", True):
        import pyarrow  # noqa: F401 - not for first-train clusters: tfos imports it during start-up

    from tfos import TFNode

    name = f"{args['tag']}-{ctx.job_name}{ctx.task_index}"
    feed = TFNode.DataFeed(ctx.mgr, train_mode=True)
    prof = cProfile.Profile() if args.get("profile") else None
    import tfos as _tfos

    with open(os.path.join(args["out"], name + ".ready"), "w") as f:
        f.write(os.path.dirname(_tfos.__file__))
    if prof:
        prof.enable()
    n = 0
    label_sum = 0
    c24 = {"int_sum": 0, "nulls": 0, "st_sum": 0, "bad": 0} if args.get("c24") else None
    while not feed.should_stop():
        batch = feed.next_batch(args["batch"])
        n += len(batch)
        if c24 is None:
            label_sum += sum(row[1] for row in batch)  # the checksum of exact delivery
            continue
        # C24 rows: (img ndarray (28, 28) float32, DenseVector, Row(a, b), [int or None], label)
        for img, vec, st, ints, label in batch:
            label_sum += label
            c24["st_sum"] += st.b
            for x in ints:
                if x is None:
                    c24["nulls"] += 1
                else:
                    c24["int_sum"] += x % args["c24_mod"]
        if batch:
            img, vec, st, ints, _ = batch[0]
            ok = (getattr(img, "shape", None) == (28, 28) and str(img.dtype) == "float32"
                  and type(vec).__name__ == "DenseVector" and type(st).__name__ == "Row" and isinstance(ints, list))
            c24["bad"] += 0 if ok else 1
    if prof:
        prof.disable()
        prof.dump_stats(os.path.join(args["profile"], name + ".prof"))
    with open(os.path.join(args["out"], name + ".json"), "w") as f:
        _json.dump(dict({"rows": n, "label_sum": int(label_sum)}, **(c24 or {})), f)


def tfdata_fun(args, ctx):
    """Consumes the feed through ``DataFeed.as_dataset`` (tf.data, whole batches) until the
    end of the feed; writes the node's row count, label sum and ``FeedBatches.buffer_bytes``."""
    import json as _json

    import numpy  # noqa: F401
    import pyarrow  # noqa: F401
    import tensorflow as tf

    from tfos import TFNode

    name = f"{args['tag']}-{ctx.job_name}{ctx.task_index}"
    feed = TFNode.DataFeed(ctx.mgr, train_mode=True)
    ds = feed.as_dataset(args["tf_batch"], (tf.TensorSpec((None, IMAGE), tf.float32), tf.TensorSpec((None,), tf.int64)))
    it = iter(ds)
    import tfos as _tfos

    with open(os.path.join(args["out"], name + ".ready"), "w") as f:
        f.write(os.path.dirname(_tfos.__file__))
    n = 0
    label_sum = 0
    for _x, y in it:
        n += int(y.shape[0])
        label_sum += int(tf.reduce_sum(y))
    with open(os.path.join(args["out"], name + ".json"), "w") as f:
        _json.dump({"rows": n, "label_sum": label_sum, "buffer_bytes": int(ds.tfos_batches.buffer_bytes)}, f)


def infer_fun(args, ctx):
    """Identity inference: answers every batch with its own rows (or, with
    ``args['labels_only']``, with each row's label: a small result per row)."""
    import cProfile
    import json as _json

    import numpy  # noqa: F401

    from tfos import TFNode

    name = f"{args['tag']}-{ctx.job_name}{ctx.task_index}"
    feed = TFNode.DataFeed(ctx.mgr, train_mode=False)
    prof = cProfile.Profile() if args.get("profile") else None
    import tfos as _tfos

    with open(os.path.join(args["out"], name + ".ready"), "w") as f:
        f.write(os.path.dirname(_tfos.__file__))
    if prof:
        prof.enable()
    n = 0
    while not feed.should_stop():
        batch = feed.next_batch(args["batch"])
        if batch:
            feed.batch_results(batch if not args.get("labels_only") else [row[1] for row in batch])
            n += len(batch)
    if prof:
        prof.disable()
        prof.dump_stats(os.path.join(args["profile"], name + ".prof"))
    with open(os.path.join(args["out"], name + ".json"), "w") as f:
        _json.dump({"rows": n}, f)


# --------------------------------------------------------------------------- RSS sampler
class RssSampler:
    """Samples the RSS of a set of pids every ``interval`` seconds in a driver thread.

    ``phase(label)`` starts attributing samples to ``label``; ``peak[label]`` is the largest
    per-process RSS seen in it, ``before[label]`` the RSS right before it started.
    """

    def __init__(self, interval: float = 0.1):
        import psutil

        self._psutil = psutil
        self.interval = interval
        self.procs: dict[int, object] = {}
        self.label: str | None = None
        self._pids = None
        self.peak: dict[str, int] = {}
        self.before: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rss-sampler", daemon=True)
        self._thread.start()

    def add(self, pids) -> None:
        with self._lock:
            for pid in pids:
                self.procs[pid] = self._psutil.Process(pid)

    def sample(self, pids=None) -> int:
        """Largest RSS (bytes) over ``pids`` (all tracked processes by default)."""
        best = 0
        with self._lock:
            procs = [p for pid, p in self.procs.items() if pids is None or pid in pids]
        for p in procs:
            try:
                best = max(best, p.memory_info().rss)
            except self._psutil.Error:
                pass
        return best

    def phase(self, label: str | None, pids=None) -> None:
        if label is not None:
            now = self.sample(pids)
            self.before[label] = max(self.before.get(label, 0), now)
        with self._lock:
            self.label = label
            self._pids = pids

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            label, pids = self.label, self._pids
            if label is None:
                continue
            rss = self.sample(pids)
            self.peak[label] = max(self.peak.get(label, 0), rss)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2.0)


# ---------------------------------------------------------------------------- helpers
def _identity(row):
    return row


def _label(row):
    return row[1]


def _persisted(out):
    """``out`` persisted MEMORY_AND_DISK_DESER and computed, counted in the JVM (driver)."""
    from pyspark import StorageLevel

    out.persist(StorageLevel.MEMORY_AND_DISK_DESER)
    out._jrdd.count()
    return out


def _count_rows(it):
    n = 0
    for _ in it:
        n += 1
    yield n


def _count_arrow(batches):
    import pyarrow as pa

    n = 0
    for b in batches:
        n += b.num_rows
    yield pa.RecordBatch.from_pydict({"n": pa.array([n], pa.int64())})


def _wait_ready(out: str, tag: str, n: int, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while len(glob.glob(os.path.join(out, f"{tag}-*.ready"))) < n:
        if time.monotonic() > end:
            raise RuntimeError(f"main_fun of cluster {tag!r} did not start within {timeout:g} s")
        time.sleep(0.1)


def _node_tfos(out: str, tag: str) -> set:
    """The tfos package directories the nodes of cluster ``tag`` imported."""
    return {open(p).read() for p in glob.glob(os.path.join(out, f"{tag}-*.ready"))}


def _node_rows(out: str, tag: str) -> int:
    return sum(json.load(open(p))["rows"] for p in glob.glob(os.path.join(out, f"{tag}-*.json")))


def _node_label_sum(out: str, tag: str) -> int:
    return sum(json.load(open(p)).get("label_sum", 0) for p in glob.glob(os.path.join(out, f"{tag}-*.json")))


def _node_sums(out: str, tag: str) -> dict:
    """Every count the nodes of cluster ``tag`` wrote, summed over the nodes."""
    tot: dict = {}
    for p in glob.glob(os.path.join(out, f"{tag}-*.json")):
        for k, v in json.load(open(p)).items():
            tot[k] = tot.get(k, 0) + v
    return tot


def _new_train_cluster(sc, TFCluster, common: dict, tag: str, queue_chunks: int):
    """Starts a 2-node train cluster and waits until both main_funs run (driver).

    Its main_fun does not import pyarrow itself (as a user's would not): the first
    DataFrame chunk finds it imported only if tfos did so during start-up."""
    c = TFCluster.run(sc, train_fun, dict(common, tag=tag, import_arrow=False), 2, 0, False, TFCluster.InputMode.SPARK,
                      progress=False, queue_chunks=queue_chunks)
    _wait_ready(common["out"], tag, 2)
    return c


_last_cpu: dict = {}


class Results:
    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {}
        self.cpu: dict[str, list[dict]] = {}  # CPU s per process class of each timed run
        self.loads: list[float] = []

    def add(self, key: str, seconds: float) -> None:
        self.times.setdefault(key, []).append(seconds)
        self.cpu.setdefault(key, []).append(dict(_last_cpu))
        self.loads.append(os.getloadavg()[0])

    def rate(self, key: str, rows: int, how: str) -> float:
        ts = self.times[key]
        t = min(ts) if how == "best" else statistics.median(ts)
        return rows / t


def timed(fn):
    """``(seconds, fn())``; the CPU s each process class used meanwhile go to ``_last_cpu``."""
    before = cpu_by_class()
    t0 = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    _last_cpu.clear()
    _last_cpu.update(cpu_delta(before, cpu_by_class()))
    return dt, out


# ------------------------------------------------------------------------------- main
#: Parts of the benchmark ``--skip`` can leave out.
SKIPPABLE = frozenset({"df", "infer", "small", "first", "c24", "tfdata"})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1000, help="next_batch() size on the nodes")
    ap.add_argument("--queue-chunks", type=int, default=4)
    ap.add_argument("--master", default="local-cluster[2,1,1024]")
    ap.add_argument("--executor-memory", default="1024m")
    ap.add_argument("--skip", default="",
                    help="comma list of: df,infer,small,first,c24,tfdata (for quick checks)")
    ap.add_argument("--profile", default="", help="directory for cProfile dumps of the nodes' main_fun")
    ap.add_argument("--json", default="", help="also write the figures to this JSON file")
    ap.add_argument("--scale", default="25000,400000",
                    help="row counts of the memory-bound check: uncached RDDs fed to the train cluster ('' to skip)")
    ap.add_argument("--slack-mb", type=float, default=16.0,
                    help="fixed allowance of the memory bound (allocator arenas, first use of code paths), MB")
    ap.add_argument("--tf-batch", type=int, default=128, help="as_dataset batch size of the memory check's tf.data nodes")
    a = ap.parse_args()
    skip = set(filter(None, a.skip.split(",")))
    unknown = skip - SKIPPABLE
    if unknown:
        ap.error(f"--skip: unknown part(s) {', '.join(sorted(unknown))}; choose from {','.join(sorted(SKIPPABLE))}")

    from pyspark import SparkConf, SparkContext, StorageLevel
    from pyspark.sql import SparkSession

    from tfos import TFCluster
    from tfos._data.spark_rawio import raw_records

    load_start = os.getloadavg()
    conf = (
        SparkConf().setMaster(a.master).setAppName("tfos-bench-feed")
        .set("spark.ui.enabled", "false").set("spark.ui.showConsoleProgress", "false")
        .set("spark.driver.host", "127.0.0.1").set("spark.executor.memory", a.executor_memory)
    )
    sc = SparkContext(conf=conf)
    sc.setLogLevel("ERROR")
    spark = SparkSession(sc)
    out = tempfile.mkdtemp(prefix="tfos-bench-")
    if a.profile:
        os.makedirs(a.profile, exist_ok=True)
    rows, parts = a.rows, a.partitions
    res = Results()
    rss = RssSampler(0.1)
    clusters = []
    report: dict = {"args": vars(a)}
    try:
        # ---------------------------------------------------------------- data (RDD)
        print(f"generating {rows:,} rows in {parts} partitions ...", flush=True)
        rdd = make_rdd(sc, rows, parts).persist(StorageLevel.MEMORY_AND_DISK)
        assert rdd.count() == rows
        raw = raw_records(rdd)
        sizes = raw.rdd.map(len).collect()
        rdd_batch = statistics.mean(sizes)
        # Feed tasks pack PySpark's batches into frames that close at the batch reaching
        # PACK_BYTES: a node's chunk is at most PACK_BYTES plus one batch (and its prefix).
        from tfos._data import feed_tasks as _ftasks

        pack = getattr(_ftasks, "PACK_BYTES", 0)
        rdd_chunk = (pack + max(sizes) + 4) if pack else max(sizes)
        print(f"RDD cached: {len(sizes)} PySpark batches, {rows / len(sizes):.1f} rows and {rdd_batch / 1024:.0f} KB "
              f"each (max {max(sizes) / 1024:.0f} KB), raw kind {raw.kind}; fed in chunks of up to {rdd_chunk / 1024:.0f} KB"
              + (f" (batches packed into frames of >= {pack / 2**20:.0f} MiB)" if pack else ""), flush=True)
        # warm the Python workers
        rdd.mapPartitions(_count_rows).collect()

        common = dict(out=out, batch=a.batch, profile=a.profile)
        train_c = TFCluster.run(sc, train_fun, dict(common, tag="train"), 2, 0, False, TFCluster.InputMode.SPARK,
                                progress=False, queue_chunks=a.queue_chunks)
        clusters.append(train_c)
        _wait_ready(out, "train", 2)
        import tfos as _tfos

        print(f"tfos: driver {os.path.dirname(_tfos.__file__)}, nodes {sorted(_node_tfos(out, 'train'))}", flush=True)
        train_pids = [n["pid"] for n in train_c.cluster_info]
        infer_c = None
        infer_pids: list[int] = []
        if "infer" not in skip:
            infer_c = TFCluster.run(sc, infer_fun, dict(common, tag="infer"), 2, 0, False, TFCluster.InputMode.SPARK,
                                    progress=False, queue_chunks=a.queue_chunks)
            clusters.append(infer_c)
            _wait_ready(out, "infer", 2)
            infer_pids = [n["pid"] for n in infer_c.cluster_info]
        small_c = None
        if "small" not in skip:
            small_c = TFCluster.run(sc, infer_fun, dict(common, tag="small", labels_only=True), 2, 0, False,
                                    TFCluster.InputMode.SPARK, progress=False, queue_chunks=a.queue_chunks)
            clusters.append(small_c)
            _wait_ready(out, "small", 2)
        scale = [int(x) for x in a.scale.split(",") if x]
        tfd_c = None
        tfd_pids: list[int] = []
        if scale and "tfdata" not in skip:
            # as_dataset consumers (TensorFlow imported in main_fun) for the memory check.
            tfd_c = TFCluster.run(sc, tfdata_fun, dict(common, tag="tfd", tf_batch=a.tf_batch), 2, 0, False,
                                  TFCluster.InputMode.SPARK, progress=False, queue_chunks=a.queue_chunks)
            clusters.append(tfd_c)
            _wait_ready(out, "tfd", 2, timeout=300.0)
            tfd_pids = [n["pid"] for n in tfd_c.cluster_info]
        c24_c = None
        if "c24" not in skip and "df" not in skip:
            c24_c = TFCluster.run(sc, train_fun, dict(common, tag="c24", c24=True, c24_mod=C24_MOD), 2, 0, False,
                                  TFCluster.InputMode.SPARK, progress=False, queue_chunks=a.queue_chunks)
            clusters.append(c24_c)
            _wait_ready(out, "c24", 2)
        time.sleep(1.0)
        rss.add(train_pids + infer_pids + tfd_pids)
        base_train = rss.sample(train_pids)
        base_infer = rss.sample(infer_pids) if infer_pids else 0
        fed_train = 0
        fed_labels = 0
        label_sum = rdd.map(lambda x: x[1]).sum()

        for r in range(a.repeat):
            dt, counts = timed(lambda: rdd.mapPartitions(_count_rows).collect())
            assert sum(counts) == rows, counts
            res.add("ceil_rdd", dt)
            rss.phase(f"train_rdd#{r}", train_pids)
            dt, _ = timed(lambda: train_c.train(rdd, 1))
            rss.phase(None)
            res.add("train_rdd", dt)
            fed_train += rows
            fed_labels += label_sum
            if "first" not in skip:
                # The first train() of a freshly started cluster (nodes ready, nothing fed yet).
                tag = f"first{r}"
                fc = _new_train_cluster(sc, TFCluster, common, tag, a.queue_chunks)
                clusters.append(fc)
                dt, _ = timed(lambda: fc.train(rdd, 1))
                res.add("first_train", dt)
                fc.shutdown(timeout=300)
                clusters.remove(fc)
                got_f, got_l = _node_rows(out, tag), _node_label_sum(out, tag)
                assert (got_f, got_l) == (rows, label_sum), f"first train: {got_f} rows, label sum {got_l}; fed {rows}, {label_sum}"
            if infer_c is not None:
                # Spark's own identity map with its output persisted as inference() persists
                # results, materialized in the JVM as inference() does (no second Python pass).
                dt, out_rdd = timed(lambda: _persisted(rdd.map(_identity)))
                res.add("persist_rdd", dt)
                assert out_rdd.count() == rows
                out_rdd.unpersist()
                rss.phase(f"infer#{r}", infer_pids)
                dt, res_rdd = timed(lambda: infer_c.inference(rdd))
                rss.phase(None)
                res.add("infer", dt)
                n = res_rdd.count()
                assert n == rows, (n, rows)
                got = res_rdd.map(lambda x: int(x[1])).sum()  # identity: the labels come back unchanged
                assert got == label_sum, (got, label_sum)
                res_rdd.unpersist()
            if small_c is not None:
                dt, out_rdd = timed(lambda: _persisted(rdd.map(_label)))
                res.add("persist_labels", dt)
                assert out_rdd.sum() == label_sum
                out_rdd.unpersist()
                dt, res_rdd = timed(lambda: small_c.inference(rdd))
                res.add("infer_small", dt)
                n = res_rdd.count()
                assert n == rows, (n, rows)
                assert res_rdd.sum() == label_sum
                res_rdd.unpersist()
            print(f"repeat {r + 1}/{a.repeat} (RDD): " + ", ".join(
                f"{k} {rows / res.times[k][-1]:,.0f} rows/s" for k in ("ceil_rdd", "train_rdd", "persist_rdd", "infer", "persist_labels", "infer_small") if k in res.times
            ) + f"; load {os.getloadavg()[0]:.1f}", flush=True)

        # --------------------------------------------------------------- DataFrame
        df_chunk = 0.0
        if "df" not in skip:
            rdd.unpersist()  # both caches do not fit the executors' storage memory at once
            df = make_df(spark, rows, parts).persist(StorageLevel.MEMORY_AND_DISK)
            assert df.count() == rows
            assert df.rdd.getNumPartitions() == parts
            df.mapInArrow(_count_arrow, "n long").collect()
            max_rec = int(spark.conf.get("spark.sql.execution.arrow.maxRecordsPerBatch", "10000"))
            spark_batch_rows = min(max_rec, max(_split(rows, parts)))
            row_bytes = IMAGE * 4 + 8 + 4
            try:  # tfos slices Spark's Arrow batches into chunks of about ARROW_CHUNK_BYTES
                from tfos._data.arrow_chunks import ARROW_CHUNK_BYTES
                df_rows_per_chunk = max(1, min(spark_batch_rows, ARROW_CHUNK_BYTES // row_bytes))
            except ImportError:
                df_rows_per_chunk = spark_batch_rows
            df_chunk = df_rows_per_chunk * row_bytes
            print(f"DataFrame cached: Spark Arrow batches of up to {spark_batch_rows} rows, fed as chunks of "
                  f"{df_rows_per_chunk} rows, ~{df_chunk / 2**20:.2f} MB each", flush=True)
            for r in range(a.repeat):
                dt, counts = timed(lambda: df.mapInArrow(_count_arrow, "n long").collect())
                assert sum(c[0] for c in counts) == rows, counts
                res.add("ceil_df", dt)
                rss.phase(f"train_df#{r}", train_pids)
                dt, _ = timed(lambda: train_c.train(df, 1))
                rss.phase(None)
                res.add("train_df", dt)
                fed_train += rows
                fed_labels += label_sum
                if "first" not in skip:
                    # The first train(df) of a freshly started cluster: its first Arrow chunk.
                    tag = f"dfirst{r}"
                    fc = _new_train_cluster(sc, TFCluster, common, tag, a.queue_chunks)
                    clusters.append(fc)
                    dt, _ = timed(lambda: fc.train(df, 1))
                    res.add("first_train_df", dt)
                    fc.shutdown(timeout=300)
                    clusters.remove(fc)
                    got_f, got_l = _node_rows(out, tag), _node_label_sum(out, tag)
                    assert (got_f, got_l) == (rows, label_sum), f"first train(df): {got_f} rows, label sum {got_l}; fed {rows}, {label_sum}"
                print(f"repeat {r + 1}/{a.repeat} (DataFrame): " + ", ".join(
                    f"{k} {rows / res.times[k][-1]:,.0f} rows/s" for k in ("ceil_df", "train_df", "first_train_df") if k in res.times
                ) + f"; load {os.getloadavg()[0]:.1f}", flush=True)
            df.unpersist()

        # ------------------------------------------- C24 column kinds (issue 17)
        c24_want: dict = {}
        if c24_c is not None:
            cdf = make_c24_df(spark, rows, parts).persist(StorageLevel.MEMORY_AND_DISK)
            c24_want = c24_expected(cdf)
            assert c24_want["rows"] == rows, c24_want
            cdf.mapInArrow(_count_arrow, "n long").collect()
            print(f"C24 DataFrame cached: {cdf.schema.simpleString()}; expected sums {c24_want}", flush=True)
            for r in range(a.repeat):
                dt, counts = timed(lambda: cdf.mapInArrow(_count_arrow, "n long").collect())
                assert sum(c[0] for c in counts) == rows, counts
                res.add("ceil_c24", dt)
                dt, _ = timed(lambda: c24_c.train(cdf, 1))
                res.add("train_c24", dt)
                print(f"repeat {r + 1}/{a.repeat} (C24 DataFrame): " + ", ".join(
                    f"{k} {rows / res.times[k][-1]:,.0f} rows/s" for k in ("ceil_c24", "train_c24")
                ) + f"; load {os.getloadavg()[0]:.1f}", flush=True)
            cdf.unpersist()

        # ------------------------------------------------------- memory bound vs rows
        fed_tfd = 0
        fed_tfd_labels = 0
        if tfd_c is not None:
            # Warm-up: the first batches through tf.data allocate TensorFlow's runtime buffers.
            warm = 4000
            tfd_c.train(make_rdd(sc, warm, parts), 1)
            fed_tfd += warm
            fed_tfd_labels += sum(int(lab.sum()) for i, k in enumerate(_split(warm, parts)) for _, lab in _partition_blocks(i, k))
        scale_inputs = [("scale", train_c, train_pids, "rdd")]
        if tfd_c is not None:
            scale_inputs += [("tfdrdd", tfd_c, tfd_pids, "rdd"), ("tfddf", tfd_c, tfd_pids, "df")]
        for n in scale:
            labels = sum(int(lab.sum()) for i, k in enumerate(_split(n, parts)) for _, lab in _partition_blocks(i, k))
            for key, cl, pids, how in scale_inputs:
                # not cached: generated while it is fed
                big = make_rdd(sc, n, parts) if how == "rdd" else make_df(spark, n, parts)
                rss.phase(f"{key}{n}", pids)
                dt, _ = timed(lambda: cl.train(big, 1))
                rss.phase(None)
                if cl is train_c:
                    fed_train += n
                    fed_labels += labels
                else:
                    fed_tfd += n
                    fed_tfd_labels += labels
                print(f"memory check ({key}): fed {n:,} rows in {dt:.1f} s; TF-process RSS peak "
                      f"{rss.peak.get(f'{key}{n}', 0) / 2**20:.1f} MB (before: {rss.before[f'{key}{n}'] / 2**20:.1f} MB)",
                      flush=True)

        # ------------------------------------------------------------------ verify
        for c in clusters:
            c.shutdown(timeout=300)
        clusters.clear()
        got = _node_rows(out, "train")
        assert got == fed_train, f"train nodes counted {got:,} rows, fed {fed_train:,}"
        got_l = _node_label_sum(out, "train")
        assert got_l == fed_labels, f"train nodes summed labels to {got_l:,}, fed {fed_labels:,}"
        for tag, c in (("infer", infer_c), ("small", small_c)):
            if c is not None:
                got_i = _node_rows(out, tag)
                assert got_i == rows * a.repeat, f"{tag} inference nodes counted {got_i:,} rows, fed {rows * a.repeat:,}"
        print(f"verified: the train nodes counted {got:,} rows = rows fed, label sum {got_l:,} = fed", flush=True)
        tfd_buffer = 0
        if tfd_c is not None:
            got_t = _node_sums(out, "tfd")
            assert (got_t["rows"], got_t["label_sum"]) == (fed_tfd, fed_tfd_labels), (
                f"as_dataset nodes counted {got_t}, fed {fed_tfd:,} rows with label sum {fed_tfd_labels:,}")
            tfd_buffer = max(json.load(open(p)).get("buffer_bytes", 0) for p in glob.glob(os.path.join(out, "tfd-*.json")))
            print(f"verified: the as_dataset nodes counted {got_t['rows']:,} rows = rows fed, label sum "
                  f"{got_t['label_sum']:,} = fed", flush=True)
        if c24_c is not None:
            got_c = _node_sums(out, "c24")
            want = {k: v * a.repeat for k, v in c24_want.items()}
            assert got_c.get("bad", 1) == 0, f"C24 nodes saw rows of the wrong Python types: {got_c}"
            assert {k: got_c.get(k) for k in want} == want, f"C24 nodes counted {got_c}, fed {want}"
            print(f"verified: the C24 nodes counted {got_c['rows']:,} rows, label, int (with {got_c['nulls']:,} nulls) "
                  f"and struct sums = fed; every batch's row types as df.rdd's", flush=True)
    finally:
        rss.stop()
        for c in clusters:
            try:
                c.shutdown(timeout=60)
            except Exception as exc:  # noqa: BLE001 - report, then stop Spark
                print(f"shutdown failed: {exc}", file=sys.stderr)
        sc.stop()

    # ------------------------------------------------------------------- table
    load_end = os.getloadavg()
    labels = [
        ("1", "ceiling (RDD): mapPartitions count", "ceil_rdd"),
        ("2", "tfos train (RDD)", "train_rdd"),
        ("2f", "tfos first train() on a new cluster", "first_train"),
        ("3", "ceiling (DataFrame): mapInArrow count", "ceil_df"),
        ("4", "tfos train (DataFrame, Arrow)", "train_df"),
        ("4f", "tfos first train(df) on a new cluster", "first_train_df"),
        ("6", "ceiling (C24 DataFrame): mapInArrow", "ceil_c24"),
        ("7", "tfos train (C24 DataFrame)", "train_c24"),
        ("1p", "Spark map(identity).persist(DESER)", "persist_rdd"),
        ("5", "tfos inference (RDD), identity", "infer"),
        ("1q", "Spark map(label).persist(DESER)", "persist_labels"),
        ("5b", "tfos inference (RDD), label results", "infer_small"),
    ]
    print()
    print(f"tfos feed benchmark: {rows:,} rows x (float32[784], int) in {parts} partitions, {a.master}, "
          f"2 nodes, batch {a.batch}, queue_chunks {a.queue_chunks}, repeat {a.repeat}")
    print(f"{'#':<3} {'measurement':<40} {'min rows/s':>11} {'median':>9} {'max':>9} {'median s':>9}")
    figures: dict = {}
    for num, text, key in labels:
        if key not in res.times:
            continue
        best, med = res.rate(key, rows, "best"), res.rate(key, rows, "median")
        worst = rows / max(res.times[key])
        figures[key] = {"best": best, "median": med, "min": worst, "seconds": res.times[key]}
        print(f"{num:<3} {text:<40} {worst:>11,.0f} {med:>9,.0f} {best:>9,.0f} {statistics.median(res.times[key]):>9.2f}")
    print()
    ratios = [("2/1", "train_rdd", "ceil_rdd", 0.85), ("2f/1", "first_train", "ceil_rdd", 0.85),
              ("4/3", "train_df", "ceil_df", 0.9), ("4f/3", "first_train_df", "ceil_df", 0.9),
              ("7/6", "train_c24", "ceil_c24", 0.73), ("5/1", "infer", "ceil_rdd", 0.5),
              ("5b/1", "infer_small", "ceil_rdd", 0.8), ("5/1p", "infer", "persist_rdd", None),
              ("5b/1q", "infer_small", "persist_labels", None), ("1p/1", "persist_rdd", "ceil_rdd", None),
              ("1q/1", "persist_labels", "ceil_rdd", None)]
    print(f"{'ratio':<6} {'median':>7} {'best':>6} {'per-repeat':>22} {'target':>7}")
    for name, num, den, target in ratios:
        if num not in figures or den not in figures:
            continue
        med = figures[num]["median"] / figures[den]["median"]
        best = figures[num]["best"] / figures[den]["best"]
        pair = [t_d / t_n for t_n, t_d in zip(res.times[num], res.times[den])]
        figures[name] = {"median": med, "best": best, "per_repeat": pair, "target": target}
        ok = "(info)" if target is None else ("ok" if med >= target else "MISSED")
        goal = "-" if target is None else ">= %.2f" % target
        print(f"{name:<6} {med:>7.2f} {best:>6.2f} {' '.join(f'{x:.2f}' for x in pair):>22} {goal:>7} {ok}")
    print("(per-repeat: ceiling time / tfos time of the same repeat; 2f/1 and 4f/3 compare each new cluster's first\n"
          " train() with the ceiling measured just before it; 5/1p and 5b/1q compare inference with Spark's own map\n"
          " whose output is persisted like inference()'s results)")
    print()
    # Where the CPU goes: on 2 CPUs every job here is bound by the CPU it needs in total.
    classes = ("executor JVMs", "driver JVM", "Python workers", "TF processes")
    print("CPU s per run by process class (median over the repeats; a ceiling has no TF processes):")
    print(f"{'#':<3} {'measurement':<40} " + " ".join(f"{c:>14}" for c in classes) + f" {'total':>7} {'/ ceiling':>9}")
    ceilings = {"train_rdd": "ceil_rdd", "first_train": "ceil_rdd", "infer": "ceil_rdd", "infer_small": "ceil_rdd",
                "persist_rdd": "ceil_rdd", "persist_labels": "ceil_rdd",
                "train_df": "ceil_df", "first_train_df": "ceil_df", "train_c24": "ceil_c24"}
    cpu_fig: dict = {}
    for num, text, key in labels:
        runs = res.cpu.get(key)
        if not runs:
            continue
        med = {c: statistics.median(r.get(c, 0.0) for r in runs) for c in classes}
        total = statistics.median(sum(r.values()) for r in runs)
        cpu_fig[key] = {"by_class": med, "total": total, "runs": runs}
        den = cpu_fig.get(ceilings.get(key, ""), {}).get("total")
        print(f"{num:<3} {text:<40} " + " ".join(f"{med[c]:>14.2f}" for c in classes) + f" {total:>7.2f}"
              + (f" {total / den:>9.2f}" if den else f" {'':>9}"))
    figures["cpu_s"] = cpu_fig
    print()
    mb = 2**20
    print(f"TF-process RSS (max over the 2 nodes of each cluster, sampled every 0.1 s):")
    print(f"{'phase':<10} {'baseline MB':>11} {'peak MB':>8} {'growth MB':>9} {'chunk KB':>9} {'bound MB':>9}  (bound = (queue_chunks + 2) x chunk)")
    mem: dict = {}
    batch_mb = a.batch * (IMAGE * 4 + 100) / mb
    for phase, base, chunk in (("train_rdd", base_train, rdd_chunk), ("infer", base_infer, rdd_chunk), ("train_df", base_train, df_chunk)):
        runs = [k for k in rss.peak if k.startswith(phase + "#")]
        if not runs:
            continue
        peak = max(rss.peak[k] for k in runs)
        per_run = [(rss.peak[k] - rss.before[k]) / mb for k in sorted(runs)]
        bound = (a.queue_chunks + 2) * chunk
        mem[phase] = {"baseline": base, "peak": peak, "growth": peak - base, "chunk": chunk, "bound": bound,
                      "growth_per_run_mb": per_run}
        print(f"{phase:<10} {base / mb:>11.1f} {peak / mb:>8.1f} {(peak - base) / mb:>9.1f} {chunk / 1024:>9.0f} {bound / mb:>9.1f}"
              f"  growth - bound = {(peak - base - bound) / mb:+.1f} MB; growth over the RSS right before each run: "
              + " ".join(f"{x:.1f}" for x in per_run) + " MB")
    print(f"(the consumer's own next_batch({a.batch}) list of rows is another {batch_mb:.1f} MB, not in the bound)")
    exceeded = False
    from tfos._data import feed_tasks as _ft

    arrow_chunk = getattr(_ft, "ARROW_CHUNK_BYTES", 1 << 20) + 64 * 1024  # slices overshoot by < 1 row + metadata
    rdd_frame = rdd_chunk  # PACK_BYTES plus one batch
    checks = [
        ("scale", "next_batch consumer, RDD input", (a.queue_chunks + 2) * rdd_frame + 2 * a.batch * (IMAGE * 4 + 100),
         f"(queue_chunks + 2) x {rdd_frame / 1024:.0f} KB chunk + 2 x next_batch({a.batch}) rows"),
        ("tfdrdd", "as_dataset consumer, RDD input", (a.queue_chunks + 2) * rdd_frame + tfd_buffer,
         f"(queue_chunks + 2) x {rdd_frame / 1024:.0f} KB chunk + FeedBatches.buffer_bytes {tfd_buffer / mb:.1f} MB"),
        ("tfddf", "as_dataset consumer, DataFrame input", (a.queue_chunks + 2) * arrow_chunk + tfd_buffer,
         f"(queue_chunks + 2) x {arrow_chunk / 1024:.0f} KB chunk + FeedBatches.buffer_bytes {tfd_buffer / mb:.1f} MB"),
    ]
    mem["scale"] = {}
    for key, what, base_bound, how in checks:
        runs = sorted((int(k[len(key):]), k) for k in rss.peak if k.startswith(key) and k[len(key):].isdigit())
        if not runs:
            continue
        bound = base_bound + a.slack_mb * mb
        print(f"memory bound of a node ({what}), independent of the rows fed: peak RSS growth of its TF process "
              f"(data server included) over the RSS before the train() <= {how} + {a.slack_mb:g} MB slack "
              f"= {bound / mb:.1f} MB")
        for n, k in runs:
            growth = rss.peak[k] - rss.before[k]
            ok = growth <= bound
            exceeded |= not ok
            mem["scale"][k] = {"rows": n, "peak": rss.peak[k], "before": rss.before[k], "growth": growth, "bound": bound, "ok": ok}
            print(f"  {n:>9,} rows: peak {rss.peak[k] / mb:.1f} MB, growth {growth / mb:+.1f} MB -> {'PASS' if ok else 'FAIL'}")
    print()
    loads = res.loads
    print(f"load average (1 min): start {load_start[0]:.1f}, end {load_end[0]:.1f}, during measurements "
          f"min {min(loads):.1f} / median {statistics.median(loads):.1f} / max {max(loads):.1f}; {os.cpu_count()} CPUs")
    report.update(figures=figures, rss=mem, load={"start": load_start, "end": load_end, "samples": loads},
                  rdd_chunk_bytes=rdd_chunk, df_chunk_bytes=df_chunk)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    print(f"memory bound: {'FAIL' if exceeded else 'PASS'}")
    return 1 if exceeded else 0


if __name__ == "__main__":
    sys.exit(main())
