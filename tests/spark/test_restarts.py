"""Restarts after a lost node, on the shared local-cluster[2,1,1024].

The chaos helper (tests/spark/chaos.py) finds a node's executor JVM from the node's own
registration and kills it by PID. Spark's local-cluster worker starts a replacement
executor, which the restarted cluster uses; the next test's ``spark_manager.get()`` waits
for it (tests/conftest.py), so the shared context serves the chaos tests too.
"""

from __future__ import annotations

import inspect
import os
import re
import time

import pytest

from chaos import ExecutorKiller, executor_jvm
from conftest import assert_no_tfos_processes
from tfos import TFCluster
from tfos.errors import ClusterFailedError

pytestmark = pytest.mark.spark

_HAS_RESTARTS = "max_restarts" in inspect.signature(TFCluster.run).parameters
needs_restarts = pytest.mark.skipif(not _HAS_RESTARTS, reason="TFCluster.run(..., max_restarts) is not in this build yet")

TENSORFLOW = TFCluster.InputMode.TENSORFLOW
SPARK = TFCluster.InputMode.SPARK


def _idle_until_file(args, ctx):
    import os
    import time

    end = time.monotonic() + 300
    while not os.path.exists(args["release"]) and time.monotonic() < end:
        time.sleep(0.1)


def _dead(proc, timeout_s: float = 30.0) -> bool:
    import psutil

    end = time.monotonic() + timeout_s
    while True:
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        if time.monotonic() >= end:
            return False
        time.sleep(0.1)


def test_chaos_helper_finds_each_nodes_executor_jvm(spark_manager, tmp_path):
    sc = spark_manager.get()  # the shared context: Spark replaces the killed executor, the next get() waits for it
    assert_no_tfos_processes()
    release = tmp_path / "release"
    hb = 8.0
    cluster = TFCluster.run(sc, _idle_until_file, {"release": str(release)}, 2, 0, input_mode=TENSORFLOW, heartbeat_timeout=hb)
    try:
        jvms = {eid: executor_jvm(cluster, eid) for eid in (0, 1)}
        assert jvms[0].pid != jvms[1].pid
        assert os.getpid() not in {j.pid for j in jvms.values()}  # never the driver
        killer = ExecutorKiller(cluster, 1).start()
        t_kill = killer.join()
        assert killer.pid == jvms[1].pid and _dead(jvms[1])
        assert not _dead(jvms[0], timeout_s=0)
        with pytest.raises(ClusterFailedError) as ei:
            cluster.shutdown(timeout=120)
        assert time.monotonic() - t_kill < 2 * hb + 10
        text = str(ei.value)
        assert "worker:1 (executor 1" in text, text
        assert any(f.executor_id == 1 and f.kind == "lost" for f in ei.value.failures), text
    finally:
        release.touch()
    assert_no_tfos_processes(60.0)


# ------------------------------------------------------------------ restarts (max_restarts)
ROWS = 12000
PARTS = 4
EPOCHS = 3


def _logging_trainer(args, ctx):
    """Reads the feed; after every batch appends ``epoch row row ...`` lines to its own log
    (one file per attempt and node), so the rows of every acknowledged partition are on disk
    even when the node is killed right after."""
    import os
    import time

    feed = ctx.get_data_feed(train_mode=True)
    path = os.path.join(args["out"], f"rows-{ctx.attempt}-{ctx.executor_id}.log")
    with open(path, "a") as log:
        while not feed.should_stop():
            batch = feed.next_batch(100)
            if not batch:
                continue
            origins = feed.last_origins + [(len(batch), -1, -1, 0)]
            for (start, _part, epoch, _first), (end, *_rest) in zip(origins, origins[1:]):
                log.write(f"{epoch} " + " ".join(str(r) for r in batch[start:end]) + "\n")
            log.flush()
            time.sleep(args["sleep_s"])


def _read_rows(out) -> dict:
    """``{(attempt, executor): {epoch: [rows]}}`` from the nodes' logs."""
    found: dict = {}
    for f in out.glob("rows-*.log"):
        _, attempt, eid = f.stem.split("-")
        per = found.setdefault((int(attempt), int(eid)), {})
        lines = f.read_text().split("\n")[:-1]  # a last line without its newline was cut by the kill
        for line in lines:
            epoch, *rows = line.split()
            per.setdefault(int(epoch), []).extend(int(r) for r in rows)
    return found


def _epoch_rows(found: dict, attempt: int, epoch: int) -> list:
    return [r for (a, _e), per in found.items() if a == attempt for r in per.get(epoch, [])]


@needs_restarts
@pytest.mark.timeout(1200)
def test_executor_killed_mid_training_restarts_and_accounts_for_every_row(spark_manager, tmp_path, caplog):
    """The local-cluster chaos test: worker:1's executor JVM is SIGKILLed in the second epoch;
    with max_restarts=1 train() resumes the feed at the failed epoch on a fresh cluster,
    and every row of every epoch is accounted for (count and checksum)."""
    import logging

    sc = spark_manager.get()  # the shared context: Spark replaces the killed executor, the next get() waits for it
    assert_no_tfos_processes()
    caplog.set_level(logging.WARNING, logger="tfos")
    args = {"out": str(tmp_path), "sleep_s": 0.01}
    cluster = TFCluster.run(sc, _logging_trainer, args, 2, 0, input_mode=SPARK, heartbeat_timeout=8.0,
                            max_restarts=1, reservation_timeout=600, executor_wait_s=300)

    def _victim_in_epoch_1() -> bool:
        # Each feed task feeds the node on its own executor, and Spark hands the next task to
        # whichever executor is free: worker:1 can be in epoch 1 while worker:0 still reads a
        # partition of epoch 0. Epoch 0 must be acknowledged in full (to the driver, by the
        # feed tasks) before the kill, or the restart rightly resumes at epoch 0.
        # driver: job partition indices acknowledged, per feed id
        done = cluster._ctl.backend.host.read(lambda core: {f: core.ledger.partitions_done(f) for f in core.ledger.done})
        if not any(set(range(PARTS)) <= parts for parts in done.values()):
            return False
        rows = _read_rows(tmp_path).get((0, 1), {})
        return len(rows.get(1, [])) >= 300

    killer = ExecutorKiller(cluster, 1, _victim_in_epoch_1, timeout_s=600).start()
    cluster.train(sc.parallelize(range(ROWS), PARTS), num_epochs=EPOCHS, feed_timeout=600)
    cluster.shutdown(timeout=600)
    killer.join()

    found = _read_rows(tmp_path)
    assert {a for a, _ in found} == {0, 1}, sorted(found)
    resumed = min(e for e in range(EPOCHS) if _epoch_rows(found, 1, e))
    assert resumed >= 1, "the feed restarted from epoch 0: nothing was kept"
    expected_sum = ROWS * (ROWS - 1) // 2
    for epoch in range(EPOCHS):
        # The attempt that finished the epoch fed it whole: count and checksum exact.
        attempt = 0 if epoch < resumed else 1
        rows = _epoch_rows(found, attempt, epoch)
        assert len(rows) == ROWS and sum(rows) == expected_sum, (epoch, attempt, len(rows))
        assert len(set(rows)) == ROWS
    assert not _epoch_rows(found, 1, resumed - 1)  # nothing before the resume epoch was fed again
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "attempt 0" in r.getMessage()]
    assert warnings and "worker:1 (executor 1" in warnings[0], warnings
    assert_no_tfos_processes(60.0)


def _always_raises(args, ctx):
    raise ValueError(f"bad hyper-parameter lr={args['lr']} (attempt {ctx.attempt})")


@needs_restarts
def test_same_exception_on_every_attempt_stops_early_with_every_cause(sc, no_leftovers):
    from tfos.errors import RecoveryFailedError

    t0 = time.monotonic()
    with pytest.raises(RecoveryFailedError) as ei:
        cluster = TFCluster.run(sc, _always_raises, {"lr": -1}, 2, 0, input_mode=TENSORFLOW, max_restarts=5)
        cluster.shutdown(timeout=300)
    err = ei.value
    text = str(err)
    assert [a for a, _, _ in err.attempts] == [0, 1], text  # stopped after the repeat, not after 6 attempts
    assert "stopped early" in text and "same exception" in text, text
    assert "attempt 0" in text and "attempt 1" in text
    assert text.count("ValueError: bad hyper-parameter lr=-1") >= 2, text
    assert time.monotonic() - t0 < 600


def _tf_mode_trainer(args, ctx):
    """InputMode.TENSORFLOW: a checkpointed counter of 'epochs'; attempt 0 dies mid-way
    on worker:1 (its TF process is killed)."""
    import json
    import os
    import signal
    import time

    ckpt = os.path.join(args["out"], f"ckpt-{ctx.executor_id}.json")
    start = json.load(open(ckpt))["epoch"] if os.path.exists(ckpt) else 0
    with open(os.path.join(args["out"], f"start-{ctx.attempt}-{ctx.executor_id}"), "w") as f:
        f.write(str(start))
    for epoch in range(start, args["epochs"]):
        if ctx.attempt == 0 and ctx.executor_id == 1 and epoch == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.3)
        with open(ckpt + ".tmp", "w") as f:
            json.dump({"epoch": epoch + 1}, f)
        os.replace(ckpt + ".tmp", ckpt)


@needs_restarts
def test_tensorflow_mode_restart_is_transparent(sc, tmp_path, no_leftovers, caplog):
    import json
    import logging

    caplog.set_level(logging.WARNING, logger="tfos")
    cluster = TFCluster.run(sc, _tf_mode_trainer, {"out": str(tmp_path), "epochs": 6}, 2, 0, input_mode=TENSORFLOW,
                            max_restarts=2)
    cluster.shutdown(timeout=600)  # returns: attempt 1 finished
    assert cluster.attempt == 1
    for eid in (0, 1):
        assert json.loads((tmp_path / f"ckpt-{eid}.json").read_text()) == {"epoch": 6}
    assert (tmp_path / "start-1-1").read_text() == "2"  # attempt 1 resumed worker:1 at its checkpoint
    text = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "attempt 0 failed" in text and "worker:1 (executor 1" in text and "SIGKILL" in text, text


def _raises_once(args, ctx):
    if ctx.attempt == 0 and ctx.executor_id == 1:
        raise ValueError("bad shard on the first attempt")


@needs_restarts
def test_a_recovered_exception_logs_its_remote_traceback(sc, no_leftovers, caplog):
    """A main_fun exception that a restart recovers is raised nowhere: the driver's
    WARNING for the restart is followed by one with the remote traceback."""
    import logging

    caplog.set_level(logging.WARNING, logger="tfos")
    cluster = TFCluster.run(sc, _raises_once, {}, 2, 0, input_mode=TENSORFLOW, max_restarts=1)
    cluster.shutdown(timeout=600)
    assert cluster.attempt == 1
    text = "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    # run() had a restart left: the failure is a WARNING, and nothing of the recovered run is an ERROR
    assert "tfos node failed: worker:1 (executor 1, host " in text and "(run() has 1 restart(s) left" in text, text
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert re.search(r"attempt 0, remote traceback of worker:1 \(executor 1, host [^)]+\):\nTraceback \(most recent call last\):\n"
                     r"(.*\n)*  File \"[^\"]*test_restarts\.py\", line \d+, in _raises_once\n(.*\n)*"
                     r"ValueError: bad shard on the first attempt", text), text


def _infer_main(args, ctx):
    import os
    import signal

    from tfos import TFNode

    feed = TFNode.DataFeed(ctx.mgr, train_mode=False)
    seen = 0
    while not feed.should_stop():
        batch = feed.next_batch(50)
        if not batch:
            continue
        seen += len(batch)
        if ctx.attempt == 0 and ctx.executor_id == 1 and seen > 600:
            os.kill(os.getpid(), signal.SIGKILL)
        feed.batch_results([(ctx.attempt, x * 2) for x in batch])


@needs_restarts
def test_inference_reruns_only_missing_partitions(sc, no_leftovers):
    cluster = TFCluster.run(sc, _infer_main, {}, 2, 0, input_mode=SPARK, max_restarts=1)
    try:
        rdd = sc.parallelize(range(2000), 8)
        out = cluster.inference(rdd)
        parts = out.glom().collect()
    finally:
        cluster.shutdown(timeout=300)
    assert cluster.attempt == 1
    assert len(parts) == 8
    values = [v for p in parts for (_, v) in p]
    assert values == [2 * x for x in range(2000)]  # one result per row, in input order
    by_attempt = [{a for (a, _) in p} for p in parts]
    assert all(len(s) == 1 for s in by_attempt), by_attempt  # a partition comes from one attempt
    assert {0} in by_attempt and {1} in by_attempt, by_attempt  # some kept, some re-run


# ----------------------------------------------- checkpoint reports (ctx.report_checkpoint)
CK_ROWS = 8000
CK_PARTS = 4
CK_EPOCHS = 7
CK_AHEAD = 3  # the trainer trains epoch e once it has read rows of epoch e + CK_AHEAD


def _read_ahead_trainer(args, ctx):
    """ps:0 waits to be stopped. worker:0 is one model that reads the feed CK_AHEAD epochs
    ahead of its training (as as_dataset's prefetch does, exaggerated): it buffers rows by
    their epoch, "trains" epoch e (appends its rows to trained-<attempt>.log) only when it
    reads rows of epoch e + CK_AHEAD (or at the end of the feed), then checkpoints
    (ckpt.json holds the epochs trained) and reports it with ctx.report_checkpoint. A
    restarted attempt restores the checkpoint; rows of epochs already in it are counted
    as 'stale' (there should be none: the feed resumes at the checkpoint)."""
    import json
    import os
    import time

    if ctx.job_name == "ps":
        ctx.stop_event.wait(900)
        return
    out = args["out"]
    ckpt = os.path.join(out, "ckpt.json")
    done = json.load(open(ckpt))["epochs"] if os.path.exists(ckpt) else 0
    with open(os.path.join(out, f"start-{ctx.attempt}"), "w") as f:
        f.write(str(done))
    feed = ctx.get_data_feed(train_mode=True)
    buffered: dict = {}
    stale = 0

    def _train_through(last: int) -> int:
        nonlocal done
        while done <= last:
            with open(os.path.join(out, f"trained-{ctx.attempt}.log"), "a") as log:
                log.write(f"{done} " + " ".join(str(r) for r in buffered.pop(done, [])) + "\n")
            with open(ckpt + ".tmp", "w") as f:  # save, then report (the callback's order)
                json.dump({"epochs": done + 1}, f)
            os.replace(ckpt + ".tmp", ckpt)
            ctx.report_checkpoint(done + 1)
            done += 1
        return done

    with open(os.path.join(out, f"read-{ctx.attempt}.log"), "a") as log:
        while not feed.should_stop():
            batch = feed.next_batch(100)
            if not batch:
                continue
            origins = feed.last_origins + [(len(batch), -1, -1, 0)]
            for (start, _part, epoch, _first), (end, *_rest) in zip(origins, origins[1:]):
                rows = batch[start:end]
                log.write(f"{epoch} " + " ".join(str(r) for r in rows) + "\n")
                if epoch < done:
                    stale += len(rows)
                else:
                    buffered.setdefault(epoch, []).extend(rows)
                _train_through(epoch - CK_AHEAD)
            log.flush()
            time.sleep(args["sleep_s"])
    _train_through(args["epochs"] - 1)
    with open(os.path.join(out, f"stale-{ctx.attempt}"), "w") as f:
        f.write(str(stale))


def _epoch_lines(path) -> dict:
    """``{epoch: [rows]}`` from a read/trained log (a last line without newline was cut)."""
    per: dict = {}
    if path.exists():
        for line in path.read_text().split("\n")[:-1]:
            epoch, *rows = line.split()
            per.setdefault(int(epoch), []).extend(int(r) for r in rows)
    return per


@needs_restarts
@pytest.mark.timeout(1200)
def test_restart_resumes_the_feed_at_the_reported_checkpoint(spark_manager, tmp_path, caplog):
    """A trainer that reads 3 epochs ahead of its checkpoint loses its executor JVM mid-epoch;
    with max_restarts=1 the feed resumes at the checkpointed epoch (not at the first epoch
    not consumed), and every row of every epoch after the checkpoint is trained in attempt 1
    (count, checksum, uniqueness); training completes."""
    import json
    import logging
    import re

    sc = spark_manager.get()  # the shared context: Spark replaces the killed executor, the next get() waits for it
    assert_no_tfos_processes()
    caplog.set_level(logging.WARNING, logger="tfos")
    args = {"out": str(tmp_path), "sleep_s": 0.01, "epochs": CK_EPOCHS}
    cluster = TFCluster.run(sc, _read_ahead_trainer, args, 2, 1, input_mode=SPARK, heartbeat_timeout=8.0,
                            max_restarts=1, reservation_timeout=600, executor_wait_s=300)
    worker = [n["executor_id"] for n in cluster.cluster_info if n["job_name"] == "worker"][0]

    def _mid_epoch_4_with_checkpoint_2() -> bool:
        # Checkpoint after 2 epochs while epochs 2 and 3 were read in full (read ahead).
        if not (tmp_path / "ckpt.json").exists() or json.loads((tmp_path / "ckpt.json").read_text())["epochs"] != 2:
            return False
        read = _epoch_lines(tmp_path / "read-0.log")
        return len(read.get(3, [])) == CK_ROWS and len(read.get(4, [])) >= 300

    killer = ExecutorKiller(cluster, worker, _mid_epoch_4_with_checkpoint_2, timeout_s=600).start()
    cluster.train(sc.parallelize(range(CK_ROWS), CK_PARTS), num_epochs=CK_EPOCHS, feed_timeout=600)
    cluster.shutdown(timeout=600)
    killer.join()
    assert cluster.attempt == 1

    restored = int((tmp_path / "start-1").read_text())
    read0, read1 = _epoch_lines(tmp_path / "read-0.log"), _epoch_lines(tmp_path / "read-1.log")
    trained0, trained1 = _epoch_lines(tmp_path / "trained-0.log"), _epoch_lines(tmp_path / "trained-1.log")
    assert restored >= 2, restored
    # The feed resumed exactly at the checkpoint: attempt 1 read nothing before it...
    assert min(read1) == restored, sorted(read1)
    assert (tmp_path / "stale-1").read_text() == "0"
    # ... although attempt 0 had read that epoch (and the next) in full: without the report
    # the feed would have resumed later and those rows would never have been trained.
    for e in (restored, restored + 1):
        assert sorted(read0.get(e, [])) == list(range(CK_ROWS)), (e, len(read0.get(e, [])))
    expected_sum = CK_ROWS * (CK_ROWS - 1) // 2
    for epoch in range(CK_EPOCHS):
        rows = (trained0 if epoch < restored else trained1).get(epoch, [])
        assert len(rows) == CK_ROWS and sum(rows) == expected_sum and len(set(rows)) == CK_ROWS, (epoch, restored, len(rows))
    assert json.loads((tmp_path / "ckpt.json").read_text()) == {"epochs": CK_EPOCHS}  # training completed
    text = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    m = re.search(r"attempt 1 resumes the feed at epoch (\d+) of 7 \(epochs numbered from 0; every row of (\d+) epoch\(s\) consumed; "
                  r"checkpoint reported after (\d+) epoch\(s\)\)", text)
    assert m, text
    assert int(m.group(1)) == int(m.group(3)) == restored and int(m.group(2)) > restored, m.group(0)
    assert_no_tfos_processes(60.0)
