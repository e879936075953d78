"""What a user sees on the driver (C26): a plain driver program, no logging set-up.

The driver runs as a subprocess on local-cluster (separate executor JVMs, so node output
reaches the driver only through tfos), with tfos's and TensorFlow's defaults (neither
TFOS_PROGRESS nor TF_CPP_MIN_LOG_LEVEL set) and Spark's default log level.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.spark, pytest.mark.tf]

DRIVER = textwrap.dedent('''
    import logging, sys
    from pyspark.sql import SparkSession
    from tfos import TFCluster, TFNode
    from tfos.errors import ClusterFailedError

    def main_fun(args, ctx):
        import tensorflow as tf  # its C++ start-up lines must not reach the driver
        feed = TFNode.DataFeed(ctx.mgr, train_mode=True)
        total = 0
        while not feed.should_stop():
            batch = feed.next_batch(16)
            total += int(tf.reduce_sum(tf.constant([int(x) for x in batch], tf.int64)).numpy()) if batch else 0
        print(f"node {ctx.job_name}:{ctx.task_index} summed {total}")
        print(f"stderr line of {ctx.job_name}:{ctx.task_index}", file=sys.stderr)

    def failing_main(args, ctx):
        if ctx.job_name == "worker":
            print("stdout before the raise")
            print("stderr before the raise", file=sys.stderr, end="")  # no newline yet
            raise RuntimeError("bad input 42")

    def dying_main(args, ctx):
        import os
        if ctx.job_name == "worker":
            print("last words of worker:0")
            os.write(2, b"F0000 00:00:1796080592.555864    7250 check.cc:12] Check failed: x == y\\n")
            os.abort()  # no flush of anything, no atexit: only what reached the pipe

    # Only the driver's "main_fun finished" lines (INFO) join the output, to check their order.
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(lambda r: "main_fun finished" in r.getMessage())
    logging.getLogger("tfos._driver.runtime").addHandler(handler)
    logging.getLogger("tfos._driver.runtime").setLevel(logging.INFO)
    spark = (SparkSession.builder.master("local-cluster[2,1,1024]").appName("node-output")
             .config("spark.driver.host", "127.0.0.1").config("spark.executor.memory", "768m").getOrCreate())
    sc = spark.sparkContext
    cluster = TFCluster.run(sc, main_fun, None, 2, 0, input_mode=TFCluster.InputMode.SPARK, master_node="chief",
                            reservation_timeout=180)
    cluster.train(sc.parallelize(range(1000), 4), num_epochs=1)
    cluster.shutdown(timeout=120)
    try:
        TFCluster.run(sc, failing_main, None, 2, 0, master_node="chief", reservation_timeout=180).shutdown(timeout=120)
    except ClusterFailedError as exc:
        print("FAILED:", exc)
        print("CAUGHT the failure of failing_main", file=sys.stderr, flush=True)
    try:
        TFCluster.run(sc, dying_main, None, 2, 0, master_node="chief", reservation_timeout=180).shutdown(timeout=120)
    except ClusterFailedError as exc:
        print("DIED:", exc)
    spark.stop()
''')


def _env() -> dict:
    env = dict(os.environ)
    for name in ("PYSPARK_GATEWAY_PORT", "PYSPARK_GATEWAY_SECRET", "TFOS_PROGRESS", "TF_CPP_MIN_LOG_LEVEL"):
        env.pop(name, None)
    env.update(PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable, SPARK_LOCAL_IP="127.0.0.1")
    return env


def test_node_output_reaches_driver_stderr_quietly(tmp_path, no_leftovers):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    proc = subprocess.run([sys.executable, str(script)], cwd=str(tmp_path), env=_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, timeout=600)
    out, err = proc.stdout, proc.stderr
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-6000:]}"
    # Every node's print() and stderr lines, once each, with one short prefix.
    sums = {}
    for node in ("chief:0", "worker:0"):
        found = re.findall(rf"^\[{node}\] node {node} summed (\d+)$", err, re.MULTILINE)
        assert len(found) == 1, err[-6000:]
        sums[node] = int(found[0])
        assert len(re.findall(rf"^\[{node}\] stderr line of {node}$", err, re.MULTILINE)) == 1, err[-6000:]
    assert sum(sums.values()) == sum(range(1000)), sums
    # The driver says main_fun finished after the node's last lines (its supervisor reports
    # the return after them).
    for node in ("chief:0", "worker:0"):
        done = [m.start() for m in re.finditer(rf"^tfos node {node} \(executor \d, host [^)]+\): main_fun finished$", err, re.MULTILINE)]
        # (chief:0 finishes in all three clusters; the first is the summing one)
        assert done and done[0] < err.index("CAUGHT the failure of failing_main"), err[-6000:]
        assert err.index(f"[{node}] node {node} summed") < done[0] and err.index(f"[{node}] stderr line of {node}") < done[0], err[-6000:]
    # Quiet: no TensorFlow C++ start-up lines, no WARNs from tfos's own jobs.
    for noise in ("cuInit", "oneDNN custom operations", "absl::InitializeLog", "cpu_feature_guard",
                  "task of very large size", "Failed to cancel job group"):
        assert noise not in err, f"{noise!r} on the driver's stderr:\n{err[-6000:]}"
    # The remote traceback names the driver script and shows the failing line.
    assert "FAILED:" in out and "bad input 42" in out, out[-3000:]
    line = next(i for i, ln in enumerate(DRIVER.splitlines(), 1) if 'raise RuntimeError("bad input 42")' in ln)
    assert f'File "{script}", line {line}, in failing_main' in out, out[-3000:]
    assert "<dynamic-code>" not in out
    # The failed node's last lines reach the driver before the error is raised there (its
    # supervisor reports the failure after them), also a line without its newline.
    caught = err.index("CAUGHT the failure of failing_main")
    for last in ("stdout before the raise", "stderr before the raise"):
        found = [m.start() for m in re.finditer(rf"^\[worker:0\] {last}$", err, re.MULTILINE)]
        assert len(found) == 1 and found[0] < caught, (last, err[-6000:])
    assert "tfos-mark" not in err and "tfos-failure" not in err, err[-6000:]
    # A TF process that dies at once (os.abort, as a TensorFlow "Check failed" does): its
    # last lines still reach the driver (its supervisor reads its output), before the error.
    assert "DIED:" in out and "killed by SIGABRT" in out, out[-3000:]
    assert len(re.findall(r"^\[worker:0\] last words of worker:0$", err, re.MULTILINE)) == 1, err[-6000:]
    assert len(re.findall(r"^\[worker:0\] F0000 \S+ +\d+ check\.cc:12\] Check failed: x == y$", err, re.MULTILINE)) == 1, err[-6000:]
