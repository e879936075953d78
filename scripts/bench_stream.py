#!/usr/bin/env python
"""Bounded memory of a Structured Streaming feed whose source is faster than the model.

A Spark ``rate`` source produces ``--rate`` rows per second (each row: its value and a
``--width``-float payload, about 8 x width bytes); ``cluster.train(streaming_df)`` feeds
every micro-batch to ``--nodes`` nodes whose main_fun consumes at most ``--model_rate``
rows per second in total (a matrix product per batch, then sleeps to hold that rate: a
model slower than the stream). Spark does not start the next micro-batch before the
nodes acknowledged the current one, so the backlog is an offset range at the source
(growing micro-batches), not rows in memory: the node processes' RSS must stay flat. At
the end the nodes call ``DataFeed.terminate()`` (the running micro-batch holds the whole
backlog) and the cluster is shut down.

Every ``--interval`` seconds the script samples the RSS of the node processes (tfos
supervisors and TF processes of this run, found by an environment marker) and of the
executor JVMs, and prints one line per sample. At the end it prints, after the
``--warmup`` seconds (default: 20 % of the duration, at least 45 s, at most half): min / median / max node RSS, the median of the first and last
third of the samples, and ``RSS flat: yes`` when the last third's median is within
``max(5 %, 20 MiB)`` of the first third's, else ``RSS flat: NO``; and the source rate
against the rows fed per second (from the query's progress), which shows the source
was faster than the model.

Usage::

    python scripts/bench_stream.py                   # 5 minutes
    python scripts/bench_stream.py --duration 60     # shorter
    python scripts/bench_stream.py --json out.json   # samples and summary as JSON

Runs on ``local-cluster[N,1,1024]`` (``--master`` to change). Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

MARK = "TFOS_BENCH_STREAM"


def slow_model_fun(args, ctx):
    """Consumes the feed at most ``model_rate / nodes`` rows per second (TF process)."""
    import os
    import time as _time

    import numpy as _np

    from tfos import TFNode

    feed = TFNode.DataFeed(ctx.mgr, train_mode=True)
    per_node = args["model_rate"] / args["nodes"]
    w = _np.random.default_rng(0).standard_normal((args["width"], 16)).astype(_np.float32)
    start = _time.monotonic()
    n = 0
    while not feed.should_stop():
        if os.path.exists(args["stop_file"]):
            # The running micro-batch holds the whole backlog: skip the rest of it.
            feed.terminate()
            break
        batch = feed.next_batch(256)
        if not batch:
            continue
        x = _np.asarray([r[1] for r in batch], dtype=_np.float32)
        (x @ w).sum()
        n += len(batch)
        ahead = n / per_node - (_time.monotonic() - start)
        if ahead > 0:
            _time.sleep(ahead)


def node_rss(mark: str) -> tuple[int, int]:
    """(bytes of RSS of this run's tfos node processes, bytes of RSS of executor JVMs)."""
    import psutil

    nodes = jvms = 0
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info.get("cmdline") or [])
        try:
            if "tfos._node" in cmd:
                if p.environ().get(MARK) == mark:
                    nodes += p.memory_info().rss
            elif "CoarseGrainedExecutorBackend" in cmd and p.environ().get(MARK) == mark:
                jvms += p.memory_info().rss
        except psutil.Error:
            continue
    return nodes, jvms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of streaming (default 300)")
    ap.add_argument("--interval", type=float, default=5.0, help="seconds between RSS samples")
    ap.add_argument("--warmup", type=float, default=None,
                    help="seconds not judged (default: 20%% of duration, at least 45 s, at most half the duration)")
    ap.add_argument("--rate", type=int, default=20000, help="source rows per second")
    ap.add_argument("--model_rate", type=int, default=4000, help="rows per second the nodes consume, in total")
    ap.add_argument("--width", type=int, default=128, help="floats per row")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--master", default=None)
    ap.add_argument("--json", default=None, help="write the samples and summary to this file")
    args = ap.parse_args()
    # The TF processes grow while their first micro-batches load numpy/TensorFlow code paths.
    warmup = min(max(45.0, 0.2 * args.duration), 0.5 * args.duration) if args.warmup is None else args.warmup
    mark = uuid.uuid4().hex
    os.environ[MARK] = mark  # inherited by the executor JVMs and the node processes

    from pyspark import SparkConf, SparkContext
    from pyspark.sql import SparkSession

    from tfos import TFCluster

    conf = SparkConf().setMaster(args.master or f"local-cluster[{args.nodes},1,1024]").setAppName("tfos-bench-stream")
    conf.set("spark.executorEnv." + MARK, mark).set("spark.ui.showConsoleProgress", "false")
    sc = SparkContext(conf=conf)
    spark = SparkSession(sc)
    tmp = tempfile.mkdtemp(prefix="tfos-bench-stream-")
    samples: list[dict] = []
    consumed = 0
    progress: list[dict] = []
    try:
        stop_file = os.path.join(tmp, "stop")
        cluster = TFCluster.run(sc, slow_model_fun, {"model_rate": args.model_rate, "nodes": args.nodes, "width": args.width,
                                                     "stop_file": stop_file},
                                args.nodes, 0, input_mode=TFCluster.InputMode.SPARK, progress=False)
        sdf = (spark.readStream.format("rate").option("rowsPerSecond", args.rate).option("numPartitions", args.nodes).load()
               .selectExpr("value", f"array_repeat(cast(value as float), {args.width}) as x"))
        query = cluster.train(sdf, checkpointLocation=os.path.join(tmp, "ckpt"), queryName="tfos_bench_stream")
        t0 = time.monotonic()
        while time.monotonic() - t0 < args.duration:
            time.sleep(args.interval)
            nodes, jvms = node_rss(mark)
            t = time.monotonic() - t0
            samples.append({"t_s": round(t, 1), "node_rss_mib": nodes / 2**20, "executor_jvm_rss_mib": jvms / 2**20})
            last = query.lastProgress
            if last:
                progress.append(last)
            sys.stdout.write(f"t={t:6.1f}s  node RSS {nodes / 2**20:8.1f} MiB  executor JVMs {jvms / 2**20:8.1f} MiB  "
                             f"batches {len({p['batchId'] for p in progress})}\n")
            sys.stdout.flush()
            if not query.isActive:
                raise RuntimeError(f"the query ended early: {query.exception()}")
        consumed = cluster._ctl.backend.state.rows_consumed()  # rows the TF processes took from the feed
        open(stop_file, "w").close()  # the nodes call DataFeed.terminate(): the running micro-batch ends
        cluster.shutdown()
    finally:
        sc.stop()
    judged = [s["node_rss_mib"] for s in samples if s["t_s"] >= warmup]
    if len(judged) < 3:
        raise SystemExit(f"too few samples after the warm-up ({len(judged)}): lengthen --duration or shorten --interval")
    third = max(1, len(judged) // 3)
    first, last_ = statistics.median(judged[:third]), statistics.median(judged[-third:])
    flat = last_ - first <= max(0.05 * first, 20.0)
    batches = {p["batchId"]: p for p in progress}
    fed = consumed
    jvm = [s["executor_jvm_rss_mib"] for s in samples if s["t_s"] >= warmup]
    summary = {
        "duration_s": args.duration, "warmup_s": warmup, "samples": len(judged),
        "node_rss_mib": {"min": min(judged), "median": statistics.median(judged), "max": max(judged)},
        "first_third_median_mib": first, "last_third_median_mib": last_, "flat": flat,
        "source_rows_per_s": args.rate, "model_rows_per_s": args.model_rate,
        "rows_consumed": fed, "fed_rows_per_s": fed / args.duration, "micro_batches_started": len(batches),
        "executor_jvm_rss_mib": {"min": min(jvm), "median": statistics.median(jvm), "max": max(jvm)},
    }
    print(f"node RSS after {warmup:.0f} s warm-up, {len(judged)} samples: min {min(judged):.1f} / median "
          f"{statistics.median(judged):.1f} / max {max(judged):.1f} MiB; first third median {first:.1f}, last third {last_:.1f} MiB")
    print(f"source {args.rate} rows/s, model {args.model_rate} rows/s, consumed by the nodes {fed / args.duration:.0f} rows/s "
          f"over {args.duration:.0f} s (micro-batches started: {len(batches)})")
    print(f"executor JVM RSS (not judged: JVM heaps grow to their limit): min {min(jvm):.1f} / median "
          f"{statistics.median(jvm):.1f} / max {max(jvm):.1f} MiB")
    print(f"RSS flat: {'yes' if flat else 'NO'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"samples": samples, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
