"""Why is my job slow, where is it stuck: the driver's answers on local-cluster[2,1,1024].

One cluster (chief:0, worker:0, ``stall_timeout=20``) is fed three times by one
``main_fun``, whose rows say what it does with each batch (docs/status.md):

(a) a slow producer (a ``map`` sleeping 30 ms per row): ``status()`` says ``producer``
    within 30 s of ``train()``'s start, naming both nodes;
(b) fast rows, ``main_fun`` sleeping 0.1 s per batch of 10: ``compute``;
(c) two epochs; worker:0's main_fun blocks on an ``Event`` at the first batch of the
    second epoch: within 40 s the driver logs one WARNING naming worker:0, with the line
    of main_fun that blocks, and chief:0 as waiting; ``cluster.stacks()`` shows the same
    line; the test then releases the Event and the run ends normally, with
    ``cluster.summary()``.

A second, short cluster with ``stall_action="fail"`` (``stall_timeout=8``), whose nodes
both block at their first batch: ``train()`` raises a ClusterFailedError with the stall
report (a ``NodeStalled`` failure).
"""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest

pytest.importorskip("pyspark")

from tfos import TFCluster  # noqa: E402
from tfos.errors import ClusterFailedError  # noqa: E402

pytestmark = pytest.mark.spark

BLOCK_LINE = "blocker.wait()  # the stuck node"


def status_main(args, ctx):
    """Rows are (i, mode): mode > 0 sleeps that long per batch (compute-bound); mode < 0
    makes worker:0 (every node with ``args['block_any']``) block at its first batch of epoch
    ``args['block_epoch']`` or later, until the file ``args['release']`` appears."""
    import os
    import threading
    import time

    feed = ctx.get_data_feed(train_mode=True)
    blocker = threading.Event()

    def watch():
        while not os.path.exists(args["release"]):
            time.sleep(0.2)
        blocker.set()

    threading.Thread(target=watch, name="release-watch", daemon=True).start()
    while not feed.should_stop():
        batch = feed.next_batch(10)
        if not batch:
            continue
        mode = batch[-1][1]
        if mode > 0:
            time.sleep(mode)
        elif (mode < 0 and (ctx.job_name == "worker" or args.get("block_any")) and feed.last_origins[-1][2] >= args["block_epoch"]
              and not blocker.is_set()):
            with open(args["blocked"], "w") as f:
                f.write(str(time.time()))
            blocker.wait()  # the stuck node


def _slow(i):
    import time as _time

    _time.sleep(0.03)
    return (i, 0.0)


def _train_async(cluster, rdd, **kw):
    out: dict = {}

    def run():
        try:
            cluster.train(rdd, **kw)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def _await_verdict(cluster, verdict, timeout_s):
    """The first status() with ``verdict`` while rows flow to the nodes it names."""
    deadline = time.monotonic() + timeout_s
    seen = []
    while time.monotonic() < deadline:
        s = cluster.status()
        seen.append((s["verdict"], s["verdict_nodes"], [(n["rows"], n["feed_wait_share"], n["queue_fill"]) for n in s["nodes"]]))
        flowing = all(n["rows_per_s"] for n in s["nodes"] if n["node"] in s["verdict_nodes"])
        if s["verdict"] == verdict and flowing:
            return s
        time.sleep(1.0)
    raise AssertionError(f"no {verdict!r} verdict within {timeout_s} s: {seen[-10:]}")


def test_status_names_producer_compute_and_a_stalled_node(sc, tmp_path, caplog, no_leftovers):
    caplog.set_level(logging.INFO, logger="tfos")
    args = {"release": str(tmp_path / "release"), "blocked": str(tmp_path / "blocked"), "block_epoch": 1}
    cluster = TFCluster.run(sc, status_main, args, 2, 0, input_mode=TFCluster.InputMode.SPARK, master_node="chief",
                            reservation_timeout=120, stall_timeout=20)
    try:
        s = cluster.status()
        assert [n["node"] for n in s["nodes"]] == ["chief:0", "worker:0"]
        assert s["state"] == "running" and s["verdict"] == "none"

        # (a) a slow producer: 4 partitions of 150 rows, 30 ms a row (4.5 s a partition)
        t, out = _train_async(cluster, sc.parallelize(range(600), 4).map(_slow), feed_timeout=120)
        s = _await_verdict(cluster, "producer", 30)
        assert set(s["verdict_nodes"]) <= {"chief:0", "worker:0"} and s["verdict_nodes"], s
        named = [n for n in s["nodes"] if n["node"] in s["verdict_nodes"]]
        assert all(n["feed_wait_share"] >= 0.5 and n["class"] == "producer" for n in named), named
        t.join(120)
        assert not t.is_alive() and "error" not in out, out

        # (b) main_fun sleeps 0.1 s per batch of 10 rows, rows come at once
        t, out = _train_async(cluster, sc.parallelize([(i, 0.1) for i in range(4000)], 4), feed_timeout=120)
        s = _await_verdict(cluster, "compute", 40)
        named = [n for n in s["nodes"] if n["node"] in s["verdict_nodes"]]
        assert named and all(n["feed_wait_share"] <= 0.2 and n["class"] == "compute" for n in named), s
        t.join(120)
        assert not t.is_alive() and "error" not in out, out
        deadline = time.monotonic() + 10  # the figures are one long-poll old
        while sum(n["rows"] for n in cluster.status()["nodes"]) < 4600 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert sum(n["rows"] for n in cluster.status()["nodes"]) == 4600, cluster.status()["nodes"]

        # (c) worker:0 blocks at its first batch of the second epoch
        caplog.clear()
        # 8 partitions an epoch: Spark hands worker:0's executor some of the second epoch's
        t, out = _train_async(cluster, sc.parallelize([(i, -1.0) for i in range(400)], 8), num_epochs=2, feed_timeout=180)
        deadline = time.monotonic() + 90
        while not os.path.exists(args["blocked"]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert os.path.exists(args["blocked"]), "worker:0 never reached the second epoch"
        blocked_at = time.monotonic()
        warning = None
        while warning is None and time.monotonic() - blocked_at < 40:
            time.sleep(0.5)
            warning = next((r.getMessage() for r in caplog.records
                            if r.levelno == logging.WARNING and "made no progress" in r.getMessage()), None)
        assert warning is not None, f"no stall WARNING within 40 s: {[r.getMessage()[:200] for r in caplog.records]}"
        first = warning.splitlines()[0]
        assert first.startswith("tfos: worker:0 (executor 1") and "stall_timeout 20 s" in first, first
        assert BLOCK_LINE in warning, warning
        assert "Waiting on it: chief:0" in warning, warning
        stacks = cluster.stacks()
        assert set(stacks) == {"chief:0", "worker:0"} and BLOCK_LINE in stacks["worker:0"], stacks
        assert "next_batch" in stacks["chief:0"], stacks["chief:0"]
        assert cluster.status()["last_stall"] == warning
        open(args["release"], "w").close()
        t.join(120)
        assert not t.is_alive() and "error" not in out, out
        cluster.shutdown(timeout=120)
    except BaseException:
        open(args["release"], "w").close()
        cluster.shutdown(timeout=60)
        raise
    summary = cluster.summary()
    assert [n["node"] for n in summary["nodes"]] == ["chief:0", "worker:0"]
    assert sum(n["rows"] for n in summary["nodes"]) == 600 + 4000 + 800, summary
    assert summary["restarts"] == 0 and summary["verdict"] in ("producer", "compute", "none", "skew"), summary
    assert summary["verdicts_held_s"].get("producer", 0) > 0 and summary["verdicts_held_s"].get("compute", 0) > 0, summary
    lines = [r.getMessage() for r in caplog.records if "summary: verdict" in r.getMessage()]
    assert len(lines) == 1 and "chief:0:" in lines[0] and "worker:0:" in lines[0], lines


def test_stall_action_fail_raises_with_the_stall_report(sc, tmp_path, no_leftovers):
    # every node blocks at its first batch: whichever executor Spark gives the partitions to
    # (a run where executor 0 fed both partitions to chief:0 left worker:0 nothing to block on)
    args = {"release": str(tmp_path / "release"), "blocked": str(tmp_path / "blocked"), "block_epoch": 0, "block_any": True}
    cluster = TFCluster.run(sc, status_main, args, 2, 0, input_mode=TFCluster.InputMode.SPARK, master_node="chief",
                            reservation_timeout=120, stall_timeout=8, stall_action="fail")
    try:
        with pytest.raises(ClusterFailedError) as info:
            cluster.train(sc.parallelize([(i, -1.0) for i in range(400)], 2), feed_timeout=120)
    finally:
        open(args["release"], "w").close()
    text = str(info.value)
    stalled = [f for f in info.value.failures if f.error_type == "NodeStalled"]
    assert stalled and stalled[0].kind == "stalled" and f"{stalled[0].job_name}:{stalled[0].task_index}" in ("chief:0", "worker:0"), text
    assert "made no progress" in stalled[0].message and BLOCK_LINE in stalled[0].message, text
    cluster.shutdown(timeout=60)  # the failure was raised: returns
