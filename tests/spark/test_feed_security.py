"""C21 on local-cluster: a process without the key squats a node's released data port.

Node 0's ``main_fun`` reads 5 rows and returns, which closes its data listener. A separate
process that never had the cluster key binds the freed port and answers every feed task
that connects: it sends a made-up handshake, a made-up proof, then frames holding a pickle
whose unpickling would write a marker file. The feed tasks must send it nothing but a nonce
and a proof bound to its nonce, fail over to node 1 (a real node), and nothing it sent may
be unpickled anywhere.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("pyspark")

from tfos import TFCluster  # noqa: E402
from tfos.errors import TFOSError  # noqa: E402

pytestmark = pytest.mark.spark

SPARK = TFCluster.InputMode.SPARK

_SQUATTER = textwrap.dedent(
    r'''
    import os, pickle, socket, struct, sys, threading, time
    host, port, log_path, marker, stop_path = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]

    class Boom:
        def __reduce__(self):
            return (open, (marker, "w"))

    evil = pickle.dumps([Boom()])
    lst = socket.socket()
    lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    end = time.monotonic() + 240
    while time.monotonic() < end and not os.path.exists(stop_path):
        try:
            lst.bind((host, port))
            break
        except OSError:
            time.sleep(0.005)
    else:
        sys.exit(0)
    lst.listen(64)
    lst.settimeout(0.2)
    with open(log_path, "a") as f:
        f.write("bound\n")

    def serve(c):
        got = 0
        try:
            c.settimeout(5)
            c.sendall(b"TFD2" + os.urandom(32))
            while True:
                b = c.recv(65536)
                if not b:
                    break
                got += len(b)
                if got >= 68:
                    # a made-up proof, then a "status ok", an "ack" and "results" frames
                    c.sendall(os.urandom(32))
                    for t, p in ((b"S", b'{"state":"ok"}'), (b"A", b'{"rows":1000}'), (b"R", evil)):
                        c.sendall(t + struct.pack(">Q", len(p)) + p + os.urandom(16))
        except OSError:
            pass
        finally:
            c.close()
            with open(log_path, "a") as f:
                f.write(f"conn {got}\n")

    while not os.path.exists(stop_path) and time.monotonic() < end:
        try:
            c, _ = lst.accept()
        except socket.timeout:
            continue
        threading.Thread(target=serve, args=(c,), daemon=True).start()
    '''
)


def _touch(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _early_return_or_count(args, ctx):
    feed = ctx.get_data_feed(train_mode=True)
    if ctx.executor_id == 0:
        rows = feed.next_batch(5)
        _touch(os.path.join(args["out"], "rows0"), str(len(rows)))
        # give the squatter time to take the port before feed tasks of executor 0 arrive
        return
    seen: list = []
    while not feed.should_stop():
        seen.extend(feed.next_batch(100))
        if len(seen) >= args["need"]:
            break
        time.sleep(0.02)  # a slower consumer spreads the feed tasks over seconds: the squatter has time to bind
    _touch(os.path.join(args["out"], "rows1"), f"{len(seen)} {len(set(seen))}")


def _squat_once(sc, tmp_path):
    """One cluster whose node 0 returns after 5 rows while a squatter takes its released data
    port; returns what the squatter logged (it may lose the race for the port under load)."""
    marker = tmp_path / "unpickled-by-someone"
    log_path = tmp_path / "squatter.log"
    stop = tmp_path / "stop"
    script = tmp_path / "squatter.py"
    script.write_text(_SQUATTER)
    n, parts = 24000, 24
    cluster = TFCluster.run(sc, _early_return_or_count, {"out": str(tmp_path), "need": n}, 2, 0, input_mode=SPARK)
    squatter = None
    try:
        [node0] = [i for i in cluster.cluster_info if i["executor_id"] == 0]
        env = {k: v for k, v in os.environ.items() if not k.startswith("TFOS")}
        squatter = subprocess.Popen(
            [sys.executable, str(script), node0["host"], str(node0["data_port"]), str(log_path), str(marker), str(stop)],
            env=env,
        )
        rdd = sc.parallelize(range(n), parts)
        try:
            cluster.train(rdd, num_epochs=1, feed_timeout=120)
            raised = None
        except TFOSError as exc:  # allowed: an error naming the node and why
            raised = str(exc)
        if raised is not None:
            assert "worker:0" in raised and "authenticate" in raised, raised
        cluster.shutdown(timeout=120)
    finally:
        _touch(str(stop), "")
        if squatter is not None:
            squatter.wait(30)
    lines = log_path.read_text().splitlines() if log_path.exists() else []
    return lines, [int(x.split()[1]) for x in lines if x.startswith("conn ")], marker, n // parts


def test_squatter_on_released_data_port_gets_nothing(sc, no_leftovers, tmp_path):
    # The squatter must win the race for node 0's released port before the feed tasks of
    # executor 0 are done; on a loaded machine it can lose it, and then the run proves
    # nothing: try again (at most 3 clusters), every run's security assertions still hold.
    for attempt in range(3):
        run_dir = tmp_path / f"run{attempt}"
        run_dir.mkdir()
        lines, conns, marker, per_part = _squat_once(sc, run_dir)
        assert not marker.exists()  # nothing the squatter sent was unpickled, in any run
        if "bound" in lines and conns:
            break
    assert "bound" in lines, "the squatter never got the released port in 3 runs; the test did not exercise C21"
    assert conns, "no feed task reached the squatter in 3 runs; the test did not exercise C21"
    # every feed task sent the squatter a nonce and a proof bound to its nonce (68 bytes), nothing else
    assert set(conns) == {68}, conns
    # nothing the squatter sent was unpickled anywhere (driver, executors, TF processes)
    assert not marker.exists()
    # the partitions the squatter was offered went to the real node 1, each row once
    assert (run_dir / "rows0").read_text() == "5"
    got, distinct = (int(x) for x in (run_dir / "rows1").read_text().split())
    assert got == distinct, "a row was fed twice"
    assert got >= len(conns) * per_part


def _count_rows(args, ctx):
    feed = ctx.get_data_feed(train_mode=True)
    seen: list = []
    while not feed.should_stop():
        seen.extend(feed.next_batch(10))
        _touch(os.path.join(args["out"], f"seen{ctx.executor_id}"), " ".join(map(str, seen)))


def test_rerun_of_delivered_partition_is_refused(sc, no_leftovers, tmp_path):
    """Spark running a feed task again for a partition already delivered for the same feed
    (a stage resubmission starts again at attempt 0) is refused by the node's record."""
    from tfos._data.feed_tasks import make_feed_fn
    from tfos.errors import ClusterFailedError

    cluster = TFCluster.run(sc, _count_rows, {"out": str(tmp_path)}, 2, 0, input_mode=SPARK)
    rdd = sc.parallelize(range(100), 2)
    from tfos._driver.backend import feed_plan

    backend = cluster._ctl.backend
    plan = feed_plan(backend.config, backend.nodes(), "train", "input", 120.0, None, 2)
    try:
        assert sorted(rdd.mapPartitionsWithIndex(make_feed_fn(plan)).collect()) == [(0, "ok"), (1, "ok")]
        with pytest.raises(Exception) as ei:  # Py4J/Spark wraps the task's FeedError
            rdd.mapPartitionsWithIndex(make_feed_fn(plan)).collect()
        err = str(ei.value)
        assert any(t in err for t in ("already received partition index", "already handed to", "Spark retried")), err
    finally:
        with pytest.raises(ClusterFailedError) as failed:
            cluster.shutdown(timeout=120)
    text = str(failed.value)
    # refused by the node's own record (same node) or by the driver's (another node)
    assert "already received partition index" in text or "was already handed to worker:" in text, text
    assert "Spark re-ran its feed task" in text
    seen = []
    for name in ("seen0", "seen1"):
        path = tmp_path / name
        if path.exists():
            seen.extend(int(x) for x in path.read_text().split())
    assert sorted(seen) == list(range(100))  # every row once, none twice


def _drain(args, ctx):
    feed = ctx.get_data_feed()
    n = 0
    while not feed.should_stop():
        n += len(feed.next_batch(50))
    with open(os.path.join(args["out"], f"rows-{ctx.executor_id}"), "w") as f:
        f.write(str(n))


def test_key_stays_out_of_py4j_debug_log(sc, tmp_path):
    """With DEBUG logging, py4j logs every command sent to the JVM, including the base64
    task closures of tfos's start and feed jobs, which hold the cluster key (found by an
    attacker test). While a cluster is open those commands are elided; other py4j records
    and the logging itself stay."""
    import base64
    import io
    import logging

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setLevel(logging.DEBUG)
    loggers = [logging.getLogger(n) for n in ("py4j.clientserver", "py4j.java_gateway")]
    old = [(lg.level, lg.propagate) for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.DEBUG)
    try:
        cluster = TFCluster.run(sc, _drain, {"out": str(tmp_path)}, 2, 0, input_mode=SPARK)
        key = cluster._ctl.backend.config.key
        cluster.train(sc.parallelize(range(400), 4), num_epochs=1)
        cluster.shutdown()
        during = stream.getvalue()
    finally:
        for lg, (level, prop) in zip(loggers, old):
            lg.removeHandler(handler)
            lg.setLevel(level)
            lg.propagate = prop
    assert sum(int((tmp_path / f"rows-{e}").read_text()) for e in (0, 1)) == 400
    for form in (key.hex(), base64.b64encode(key).decode(), base64.urlsafe_b64encode(key).decode().rstrip("=")):
        assert form not in during
    # the key in a base64 pickle blob need not start on a 3-byte boundary: check every alignment
    for shift in range(3):
        probe = base64.b64encode(b"\0" * shift + key).decode()[4 * ((shift + 2) // 3) + 2: -4]
        assert probe not in during, f"key (base64 shift {shift}) in the py4j DEBUG log"
    assert "characters elided by tfos while a cluster is open" in during
    assert "Answer received" in during  # the rest of py4j's DEBUG log is kept
