"""A key-less process that keeps a server's kernel accept queue full (non-blocking connects
from many loopback source addresses, scripts/bench_flood.py ``fill``): the control server
and a node's data server empty their queues on every turn and shed strangers over the cap,
so a key holder still gets in (docs/reliability.md "Floods"). Also the admission rules
themselves (pure) and proofs bound to the destination node."""

from __future__ import annotations

import importlib.util
import os
import socket
import time

import pytest

from tfos._common import wire as _wire
from tfos._common.admission import Admission, ProofChecker, make_proof
from tfos._common.deadline import Deadline
from tfos._common.wire import DataAuthError
from tfos._control.client import ControlClient
from tfos._control.server import ControlServer
from tfos._data.feed_hub import FeedHub

_BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "bench_flood.py")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("_bench_flood_for_tests", _BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _filled(bench, port: int, tmp: str):
    """Starts the filler (20,000 held, 3,000 SYNs in flight, 500 source addresses) and waits
    until it has completed connections."""
    proc, ready, stop = bench._attack("127.0.0.1", port, 20000, "fill:3000:200:500", tmp)
    deadline = Deadline(60, "the filler's first connections")
    deadline.wait_for(lambda: os.path.exists(ready), extra=lambda: "no ready file")
    time.sleep(1.5)
    return proc, ready, stop


def test_over_the_cap_the_oldest_strangers_are_shed_first_and_newcomers_last():
    adm = Admission(cap=3, grace_s=0.25)
    for i, (addr, t) in enumerate([("a", 0.0), ("b", 0.1), ("a", 0.2), ("c", 0.9), ("d", 0.95)]):
        adm.add(i, addr, t)
    assert adm.over(1.0) == [0, 2]  # past the grace, the address holding the most, oldest first
    adm.add(5, "e", 1.0)
    adm.add(6, "e", 1.0)
    assert adm.over(1.0) == [0, 2, 1, 3]  # then the other old ones, then the youngest
    assert Admission(cap=8).over(0.0) == []


def test_a_proof_is_bound_to_its_destination_node():
    key = _wire.new_key()
    for_a = make_proof(key, _wire.DATA_PROOF_MAGIC, b"node-a")
    assert ProofChecker(key, _wire.DATA_PROOF_MAGIC, lambda: b"node-a").check(for_a) is None
    why = ProofChecker(key, _wire.DATA_PROOF_MAGIC, lambda: b"node-b").check(for_a)  # replayed at node b
    assert why is not None and "another node" in why
    assert ProofChecker(key, _wire.DATA_PROOF_MAGIC).check(make_proof(key, _wire.DATA_PROOF_MAGIC)) is None


def test_a_feed_task_bound_to_another_node_is_refused_at_once():
    key = _wire.new_key()
    hub = FeedHub("127.0.0.1", key, ("input",), 8, "worker:1 (executor 1, test)", local_socket=False)
    hub.identity = b"executor 1"
    try:
        with socket.create_connection(("127.0.0.1", hub.port), timeout=20) as s:
            with pytest.raises(DataAuthError, match="refused this feed task's proof"):
                _wire.client_handshake(s, key, Deadline(20, "handshake"), identity=b"executor 0")
    finally:
        hub.close("main_fun_returned", "test over")


def test_a_key_holder_gets_into_the_control_server_while_a_filler_keeps_its_queue_busy(bench, tmp_path):
    srv = ControlServer(bench.KEY, lambda body, peer: {"echo": body.get("x")}, "127.0.0.1", num_nodes=2)
    proc, ready, stop = _filled(bench, srv.port, str(tmp_path))
    try:
        for i in range(5):
            c = ControlClient("127.0.0.1", srv.port, bench.KEY, bench.CID, connect_timeout_s=60)
            assert c._request("ping", {"x": i}, 60.0, True, None)["echo"] == i
            c.close()
        st = srv.stats()
        assert st["evicted"] > 0 and st["unproven"] <= srv.limits.max_unauthenticated + 512  # read mid-burst: shed every 512
        assert len(srv._loop.flood.by_address) >= 10  # strangers from many source addresses, named
        assert srv.limits.backlog >= 1024
    finally:
        tail = bench._stop(proc, ready, stop)
        srv.close()
    assert int(tail.split()[1]) > 1000, tail  # the filler completed connections (held, completed, /s, SYNs/s)


def test_a_feed_task_gets_into_a_node_while_a_filler_keeps_its_queue_busy(bench, tmp_path):
    hub = FeedHub("127.0.0.1", bench.KEY, ("input",), 1 << 20, "worker:0 (executor 0, test)", local_socket=False)
    proc, ready, stop = _filled(bench, hub.port, str(tmp_path))
    try:
        for i in range(5):
            bench._try_data(hub, i + 1, 60.0)
        assert hub.gate.flood.evicted > 0 and len(hub.gate.unproven) <= hub.gate.unproven.cap + 512
    finally:
        tail = bench._stop(proc, ready, stop)
        hub.close("main_fun_returned", "test over")
    assert int(tail.split()[1]) > 1000, tail


def test_a_client_whose_connects_time_out_names_a_flood():
    """A control port whose accept queue stays full (nothing accepts it: the kernel drops the
    SYNs, as under a flood) times the client's connects out: its error says a flood may be
    why, besides the usual causes."""
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(0)
    port = lst.getsockname()[1]
    held = []
    try:
        for _ in range(4):  # fill the queue (a backlog of 0 holds one or two)
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            held.append(s)
        time.sleep(0.2)
        c = ControlClient("127.0.0.1", port, _wire.new_key(), "tfos-unit", connect_timeout_s=2)
        with pytest.raises(ConnectionError, match="a flood of connections to the driver's control port"):
            c._request("ping", {}, 2.0, True, None)
        c.close()
    finally:
        for s in held:
            s.close()
        lst.close()


def test_rejections_are_logged_first_twenty_then_once_per_interval():
    """A flood of 10,000 connections/s wrote a WARNING every 100th rejection (100 lines a
    second); now the first 20, then one line per 10 s, each with the running count."""
    from tfos._common.admission import RejectLog

    now = [0.0]
    rl = RejectLog(10.0, clock=lambda: now[0])
    logged = []
    for n in range(1, 200_001):
        now[0] = n / 8192  # 8,192 rejections a second (exact in binary) for 24 s
        if rl.due(n):
            logged.append(n)
    # the first 20, then one line 10 s after the 20th, then 10 s after that one
    assert logged == list(range(1, 21)) + [20 + 81_920, 20 + 2 * 81_920]


def test_a_nodes_data_port_flood_reaches_the_drivers_error(bench):
    """Connections without the key that a node's data port turned away travel with the
    node's figures, and the driver's flood report (the one its ClusterFailedError quotes)
    names that data port, the node, the counts and the sources."""
    from tfos._common.admission import FloodStats
    from tfos._control.host import ClusterHost
    from tfos._data.figures import live_snapshot
    from tfos.cluster_template import NodeInfo, build_template, roles_from_template

    hub = FeedHub("127.0.0.1", bench.KEY, ("input",), 1 << 20, "worker:0 (executor 1, test)", local_socket=False)
    try:
        for _ in range(3):  # a proof of the right length made with another key
            with socket.create_connection(("127.0.0.1", hub.port), timeout=10) as s:
                s.sendall(make_proof(b"k" * 32, b"TFA1")[:52])
                s.settimeout(10)
                try:
                    s.recv(64)
                except OSError:
                    pass
        Deadline(30, "the gate's count").wait_for(lambda: hub.gate.flood.rejected >= 3)
        snap = live_snapshot(hub)
    finally:
        hub.close("main_fun_returned", "test over")
    assert snap["flood_data/rejected"] >= 3 and snap["flood_data_src/127.0.0.1"] >= 3
    assert FloodStats.from_counters(snap, "flood_data").total == FloodStats.from_counters(snap, "flood_data").rejected

    host = ClusterHost("tfos-flood", roles_from_template(build_template(2, num_ps=0)), 15.0)
    host.core.nodes[1] = NodeInfo(1, "worker", 1, "10.0.0.7", 2001, data_port=hub.port)
    host.core.counters[1] = snap
    report = host.flood_report()
    assert report.startswith(f"the tfos data port 10.0.0.7:{hub.port} of node {host.core.node_name(1)} turned away ")
    assert host.core.node_name(1).startswith("worker:1 (executor 1")
    assert "turned away" in report and "127.0.0.1 (" in report and "spark.authenticate" in report
    host.core.counters[1] = {"rows": 5}
    assert host.flood_report() == ""
