"""C21 on local-cluster: a process without the key takes a node's released data port.

Node 0's ``main_fun`` reads 5 rows and returns, which closes its data listener. A separate
process that never had the cluster key (``tests/unit/intruders.py``) binds the freed port:

* a squatter answers every feed task that connects like a node: a made-up handshake, a
  made-up proof, then frames holding a pickle whose unpickling would write a marker file.
  The feed tasks must send it nothing but their proof of the key, a nonce and a proof bound
  to its nonce, fail over
  to node 1 (a real node), and nothing it sent may be unpickled anywhere;
* a relay passes every connection on to node 1: node 1 refuses the handshakes (they name
  node 0), the relay reads no row, and the driver logs a WARNING naming node 0 and the
  intruding connection.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("pyspark")

from tfos import TFCluster  # noqa: E402
from tfos._common import wire as _wire  # noqa: E402
from tfos.errors import TFOSError  # noqa: E402

pytestmark = pytest.mark.spark

SPARK = TFCluster.InputMode.SPARK

#: The squatter and the relay: separate processes without the cluster key.
INTRUDERS = Path(__file__).resolve().parents[1] / "unit" / "intruders.py"
BENCH_FLOOD = Path(__file__).resolve().parents[2] / "scripts" / "bench_flood.py"


def _touch(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _early_return_or_collect(args, ctx):
    feed = ctx.get_data_feed(train_mode=True)
    if ctx.executor_id == 0:
        rows = feed.next_batch(5)
        _touch(os.path.join(args["out"], "rows0"), str(len(rows)))
        return  # releases the data port: the intruder takes it before feed tasks of executor 0 arrive
    seen: list = []
    while not feed.should_stop():
        seen.extend(r.decode() for r in feed.next_batch(100))
        if len(seen) >= args["need"]:
            break
        time.sleep(0.02)  # a slower consumer spreads the feed tasks over seconds: the intruder has time to bind
    _touch(os.path.join(args["out"], "rows1"), " ".join(seen))


#: Rows fed by the intruder tests, and how many partitions they fill.
ROWS, PARTS = 12000, 24


def _intrude_once(sc, tmp_path, mode: str, *extra: str) -> None:
    """One cluster whose node 0 returns after 5 rows while an intruder (``intruders.py
    mode``, no key) takes its released data port; it may lose the race for the port under
    load. ``train()`` may raise only an error naming node 0 and why."""
    stop = tmp_path / "stop"
    cluster = TFCluster.run(sc, _early_return_or_collect, {"out": str(tmp_path), "need": ROWS}, 2, 0, input_mode=SPARK)
    intruder = None
    try:
        nodes = {i["executor_id"]: i for i in cluster.cluster_info}
        env = {k: v for k, v in os.environ.items() if not k.startswith("TFOS")}
        args = [a.format(node1_port=nodes[1]["data_port"]) for a in extra]
        intruder = subprocess.Popen(
            [sys.executable, str(INTRUDERS), mode, "--listen", f"{nodes[0]['host']}:{nodes[0]['data_port']}",
             "--stop", str(stop), *args], env=env, stdout=subprocess.DEVNULL,
        )
        rdd = sc.parallelize([b"row-secret-%06d" % i for i in range(ROWS)], PARTS)
        try:
            cluster.train(rdd, num_epochs=1, feed_timeout=120)
        except TFOSError as exc:  # allowed: an error naming the node and why
            assert "worker:0" in str(exc) and ("authenticate" in str(exc) or "relayed" in str(exc)), str(exc)
        (tmp_path / "node0").write_text(f"{nodes[0]['host']}:{nodes[0]['data_port']}")
    finally:
        cluster.shutdown(timeout=120)
        _touch(str(stop), "")
        if intruder is not None:
            intruder.wait(30)


def _intrude(sc, tmp_path, mode: str, log_name: str, *extra: str) -> tuple:
    """:func:`_intrude_once` until the intruder took the port and a feed task reached it (at
    most 3 clusters: on a loaded machine it can lose the race, and then a run proves
    nothing); returns (the run's directory, its log lines, its "conn" lines)."""
    for attempt in range(3):
        run_dir = tmp_path / f"run{attempt}"
        run_dir.mkdir()
        _intrude_once(sc, run_dir, mode, *[a.format(run=run_dir, node1_port="{node1_port}") for a in extra])
        log = run_dir / log_name
        lines = log.read_text().splitlines() if log.exists() else []
        conns = [x for x in lines if x.startswith("conn ")]
        if "bound" in lines and conns:
            break
    assert "bound" in lines, f"the {mode} intruder never got the released port in 3 runs; the test did not exercise it"
    assert conns, f"no feed task reached the {mode} intruder in 3 runs; the test did not exercise it"
    # every row reached a node once: the partitions the intruder was offered went to node 1
    assert (run_dir / "rows0").read_text() == "5"
    got = (run_dir / "rows1").read_text().split()
    assert len(got) == len(set(got)), "a row was fed twice"
    assert len(got) >= len(conns) * (ROWS // PARTS)
    return run_dir, lines, conns


def test_squatter_on_released_data_port_gets_nothing(sc, no_leftovers, tmp_path):
    """A squatter answers like a node, with a made-up proof and frames holding a pickle whose
    unpickling would write a marker: every feed task sent it 120 bytes (its proof of the key,
    then a nonce and a proof bound to the squatter's nonce), nothing it sent was unpickled
    anywhere, and its partitions went to node 1."""
    marker = tmp_path / "unpickled-by-someone"
    run_dir, lines, conns = _intrude(sc, tmp_path, "squat", "squatter.log", "--log", "{run}/squatter.log",
                                     "--marker", str(marker), "--magic", _wire._DATA_MAGIC.decode())
    # every feed task sent the squatter its proof of the key (52 bytes), a nonce and a proof bound to
    # its nonce (68 bytes), nothing else
    assert {int(x.split()[1]) for x in conns} == {52 + 68}, conns
    # nothing the squatter sent was unpickled anywhere (driver, executors, TF processes)
    assert not marker.exists()


def test_relay_on_released_data_port_reads_no_row(sc, no_leftovers, tmp_path, caplog):
    """Node 0's main_fun returns; a local process without the key takes its data port and
    relays every connection to node 1. Feed tasks meant for node 0 reach node 1 through
    it, which refuses their proof (bound to node 0; the refusal names node 1); they fail over to node 1
    directly. The relay reads no row, and the driver logs a WARNING naming node 0 and the
    intruding connection."""
    with caplog.at_level(logging.WARNING, logger="tfos._driver.runtime"):
        run_dir, lines, conns = _intrude(sc, tmp_path, "relay", "relay.log", "--to", "{node1_port}",
                                         "--capture", "{run}/relay")
    to_node = (run_dir / "relay.to-node").read_bytes()
    to_task = (run_dir / "relay.to-task").read_bytes() if (run_dir / "relay.to-task").exists() else b""
    # 0 rows readable: each task sent the relay its proof of the key bound to node 0 (52 bytes),
    # which node 1 refused, naming itself; nothing more
    assert len(to_node) == 52 * len(conns), (len(to_node), len(conns))
    assert b"row-secret" not in to_node and b"row-secret" not in to_task
    # the driver's WARNING names node 0, its address, the connection and where it led
    addr = (run_dir / "node0").read_text()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "tfos._driver.runtime"]
    relayed = [w for w in warnings if "relayed the handshake to worker:1" in w and f"data address {addr}" in w]
    assert relayed, warnings
    assert "worker:0 (executor 0" in relayed[0], relayed[0]
    assert f"-> {addr}" in relayed[0] and "listener uid" in relayed[0], relayed[0]


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
    from tfos._driver.backend import TrainCall

    plan = feed_plan(backend.config, backend.nodes(), TrainCall(rdd, 2, 1, 120.0, "input"), None, 2)
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


def _count_and_sum(args, ctx):
    feed = ctx.get_data_feed(train_mode=True)
    n = total = 0
    while not feed.should_stop():
        batch = feed.next_batch(100)
        n += len(batch)
        total += sum(int(r) for r in batch)
    _touch(os.path.join(args["out"], f"rows{ctx.executor_id}"), f"{n} {total}")


def _filler(host: str, port: int, tmp: Path, name: str) -> subprocess.Popen:
    """The kernel-queue filler of scripts/bench_flood.py (one key-less process: 6,000 silent
    connections held, more than the cap of unproven ones, 300 non-blocking connects always in
    flight from 500 loopback source addresses)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_bench_flood", BENCH_FLOOD)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TFOS")}
    ready, stop = str(tmp / f"{name}.ready"), str(tmp / "stop")
    return subprocess.Popen([sys.executable, "-c", bench._ATTACKER, host, str(port), "6000", "fill:300:200:500",
                             ready, stop], env=env)


def test_run_and_train_succeed_under_a_flood_without_the_key(sc, no_leftovers, tmp_path, monkeypatch):
    """Key-less processes flood the driver's control port from before run() (a kernel-queue
    filler holding more connections than the cap of unproven ones, from many source
    addresses, plus half-sent and silent connections reopened when closed and churn), a
    second filler starts on it right after run() returned, and the nodes' data ports are
    flooded too: run() succeeds, train() feeds every row exactly once, and heartbeats stay
    on time (the cluster is not declared lost). The flood report counts what was turned
    away."""
    host = sc.getConf().get("spark.driver.host", "127.0.0.1")
    probe = socket.socket()
    probe.bind((host, 0))
    port = probe.getsockname()[1]
    probe.close()
    monkeypatch.setenv("TFOS_SERVER_PORT", str(port))
    stop = tmp_path / "stop"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TFOS")}
    flooders = [subprocess.Popen([sys.executable, str(INTRUDERS), "flood", "--listen", f"{host}:{port}", "--hold", "150",
                                  "--stop", str(stop), "--log", str(tmp_path / "flood.log")], env=env),
                _filler(host, port, tmp_path, "fill-before")]
    cluster = None
    try:
        cluster = TFCluster.run(sc, _count_and_sum, {"out": str(tmp_path)}, 2, 0, input_mode=SPARK)
        flooders.append(_filler(host, port, tmp_path, "fill-after"))  # right after run() returned
        targets = ",".join(f"{i['host']}:{i['data_port']}" for i in cluster.cluster_info)
        flooders.append(subprocess.Popen([sys.executable, str(INTRUDERS), "flood", "--listen", targets, "--hold", "150",
                                          "--stop", str(stop), "--log", str(tmp_path / "flood.log")], env=env))
        rows = 4000
        cluster.train(sc.parallelize(range(rows), 8), num_epochs=1)
        report = cluster.server.flood_report()
        evicted = cluster.server.stats()["evicted"]
        cluster.shutdown()
        cluster = None
        got = [(tmp_path / f"rows{e}").read_text().split() for e in (0, 1)]
        assert sum(int(n) for n, _ in got) == rows and sum(int(s) for _, s in got) == rows * (rows - 1) // 2
        assert f"{port}" in report and "turned away" in report, report
        assert evicted > 0  # the fillers went beyond the cap of unproven connections
        assert (tmp_path / "fill-before.ready").exists() and (tmp_path / "fill-after.ready").exists()
    finally:
        stop.touch()
        for f in flooders:
            try:
                f.wait(60)
            except subprocess.TimeoutExpired:
                f.kill()
        if cluster is not None:
            cluster.shutdown()
