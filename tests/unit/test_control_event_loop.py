"""The event-driven control server, the multiplexed client and the typed messages (C20).

No Spark, no TensorFlow: real ControlServers over loopback, a real ClusterHost, real
ControlClients, and raw sockets speaking the protocol through its sessions.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from tfos._common import wire as _wire
from tfos._common.deadline import Deadline
from tfos._control import messages as msg
from tfos._control.client import ControlClient, shared_client
from tfos._control.limits import ControlLimits, event_poll_s, heartbeat_interval_s, start_poll_s
from tfos._control.protocol import Call, ClientSession, FrameReader, LongPoll, client_proof
from tfos._control.server import ControlServer
from tfos._control.host import ClusterHost
from tfos.cluster_template import NodeInfo, build_template, roles_from_template
from tfos.errors import ConfigurationError, ControlProtocolError, NodeFailure

def _send(client, msg_type: str, timeout_s: float = 30.0, retry: bool = True, connect_timeout_s=None, **fields) -> dict:
    """A request of any type, as the protocol carries it (tfos itself sends typed messages,
    ControlClient.call); a type of tfos._control.messages is checked first, as call() does."""
    from tfos._control.messages import message_class

    cls = message_class(msg_type)
    if cls is not None:
        cls.decode(fields)
    return client._request(msg_type, fields, timeout_s, retry, connect_timeout_s)  # send_raw() without a connect budget


def _handle(host, body: dict, peer: str = "127.0.0.1:1") -> dict:
    """One request answered in this thread (a long-poll waited for here)."""
    return host.resolve(host.prepare(body, peer).run())


KEY = _wire.new_key()
CID = "tfos-unit-loop"


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv("TFOS_SERVER_HOST", raising=False)
    monkeypatch.delenv("TFOS_SERVER_PORT", raising=False)


class RawClient:
    """One connection speaking the protocol without the client's reader thread."""

    def __init__(self, port: int, key: bytes = KEY, cluster_id: str = CID):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=20)
        self.sock.sendall(client_proof(key))
        self.frames = FrameReader(key)
        self.session = ClientSession(key, cluster_id, self._next())

    def _next(self) -> dict:
        while (body := self.frames.next()) is None:
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("closed")
            self.frames.feed(data)
        return body

    def send(self, m: msg.Message) -> int:
        frames = self.session.encode(m.TYPE, m.fields())
        self.sock.sendall(b"".join(f for _, f, _ in frames))
        return frames[-1][0]

    def answer(self) -> dict:
        body = self._next()
        self.session.answers(body)
        return body

    def close(self) -> None:
        self.sock.close()


def _state(n: int, timeout_s: float = 15.0) -> ClusterHost:
    return ClusterHost(CID, roles_from_template(build_template(n, 0)), timeout_s)


def _node(eid: int) -> NodeInfo:
    return NodeInfo(eid, "worker", eid, "127.0.0.1", 20000 + eid, 0, 100 + eid)


def _register_all(st: ClusterHost) -> None:
    for eid in range(len(st.core.roles)):
        assert _handle(st, dict(msg.Register(_node(eid)).body(), cluster=CID), "p")["ok"]


# ------------------------------------------------------------------ binding
def test_a_fixed_port_binds_again_right_after_a_shutdown():
    """TFOS_SERVER_PORT with one port: a new cluster's server binds it at once after the
    previous one closed, though the closed server's connections sit in TIME_WAIT (the
    server closed them first); before SO_REUSEADDR this said 'Address already in use'."""
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    for round_ in range(3):
        srv = ControlServer(KEY, lambda b, p: {"ok": True, "round": round_}, "127.0.0.1", str(port))
        try:
            assert srv.port == port
            clients = [ControlClient("127.0.0.1", port, KEY, CID, connect_timeout_s=10) for _ in range(3)]
            assert all(_send(c, "ping")["round"] == round_ for c in clients)
        finally:
            srv.close()  # closes the connections first: TIME_WAIT is on the server's side
        for c in clients:
            c.close()


def test_a_port_another_socket_listens_on_is_still_refused_and_says_why():
    busy = socket.socket()
    busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    try:
        with pytest.raises(ConfigurationError) as ei:
            ControlServer(KEY, lambda b, p: {}, "127.0.0.1", str(port))
        text = str(ei.value)
        assert "Address already in use" in text and "another socket listens there" in text, text
        assert "TFOS_SERVER_HOST / TFOS_SERVER_PORT" in text
    finally:
        busy.close()


# ------------------------------------------------------------ long-polls
def test_long_polls_hold_no_thread_and_are_answered_on_the_change():
    """300 nodes long-poll for directives at once: the server holds them as deferred
    answers (no thread each) and answers every one as soon as the feed closes."""
    n = 300
    st = _state(n)
    _register_all(st)
    srv = ControlServer(KEY, st, "127.0.0.1", num_nodes=n)
    before = threading.active_count()
    clients = [RawClient(srv.port) for _ in range(n)]
    try:
        known = {"stop": False, "feed_closed": False, "abort": "", "failed": False, "stack": 0}
        for eid, c in enumerate(clients):
            c.send(msg.WaitEvent(eid, known, {"rows": eid}, poll_s=5.0))
        Deadline(20, "every poll to be held").wait_for(lambda: srv.stats()["long_polls"] == n)
        assert threading.active_count() - before <= 1, threading.enumerate()
        assert st.core.rows_consumed() == sum(range(n))
        t0 = time.monotonic()
        st.close_feed()
        answers = [c.answer() for c in clients]
        assert time.monotonic() - t0 < 4.0  # on the change, not at the end of the 5 s poll
        assert all(a["feed_closed"] is True for a in answers)
        assert srv.stats()["long_polls"] == 0
    finally:
        for c in clients:
            c.close()
        srv.close()


def test_a_long_poll_is_answered_at_the_end_of_its_poll_time():
    st = _state(2)
    _register_all(st)
    srv = ControlServer(KEY, st, "127.0.0.1")
    c = RawClient(srv.port)
    try:
        t0 = time.monotonic()
        c.send(msg.AwaitCluster(executor_id=0, poll_s=0.3))
        assert c.answer()["ready"] is True  # already formed: at once
        c.send(msg.WaitEvent(0, {"stop": False, "feed_closed": False, "abort": "", "failed": False, "stack": 0}, None, 0.3))
        a = c.answer()
        assert a["stop"] is False and 0.25 <= time.monotonic() - t0 < 3.0
    finally:
        c.close()
        srv.close()


class _SlowRoutes:
    """Routes with one blocking (offloaded) request type and one quick (inline) one."""

    def __init__(self):
        self.release = threading.Event()

    def prepare(self, body, peer):
        if body["type"] == "slow":
            return Call(lambda: (self.release.wait(10), {"slow": True})[1], offload=True)
        if body["type"] == "poll":
            return Call(lambda: LongPoll(("t",), lambda: None, 0.2, lambda: {"polled": True}))
        return Call(lambda: {"fast": True})

    def add_change_listener(self, listener):
        pass


def test_a_blocking_handler_does_not_stall_the_others():
    routes = _SlowRoutes()
    # Another server's handler threads (a cluster an earlier test left running) are not this one's.
    others = {t.ident for t in threading.enumerate()}
    srv = ControlServer(KEY, routes, "127.0.0.1", limits=ControlLimits(handler_threads=2))
    try:
        slow = [ControlClient("127.0.0.1", srv.port, KEY, CID, connect_timeout_s=10) for _ in range(3)]
        threads = [threading.Thread(target=_send, args=(c, "slow"), kwargs={"timeout_s": 20}) for c in slow]
        for t in threads:
            t.start()
        time.sleep(0.3)  # both handler threads block, a third request waits for one
        fast = ControlClient("127.0.0.1", srv.port, KEY, CID, connect_timeout_s=10)
        t0 = time.monotonic()
        for _ in range(20):
            assert _send(fast, "ping")["fast"] is True
        assert _send(fast, "poll")["polled"] is True
        assert time.monotonic() - t0 < 3.0
        routes.release.set()
        for t in threads:
            t.join(20)
        assert sum(1 for t in threading.enumerate() if t.name.startswith("tfos-control-handler") and t.ident not in others) <= 2
    finally:
        routes.release.set()
        srv.close()


# ------------------------------------------------------------- multiplexing
def test_one_connection_serves_every_thread_of_a_process():
    """A directive long-poll of one thread does not hold up another thread's heartbeats:
    both share the process's one connection, answers come in any order."""
    st = _state(2)
    _register_all(st)
    srv = ControlServer(KEY, st, "127.0.0.1")
    c = ControlClient("127.0.0.1", srv.port, KEY, CID, connect_timeout_s=10)
    try:
        known = {"stop": False, "feed_closed": False, "abort": "", "failed": False, "stack": 0}
        out = {}
        poller = threading.Thread(target=lambda: out.setdefault("r", c.call(msg.WaitEvent(1, known, None, 4.0), timeout_s=20)))
        poller.start()
        Deadline(10).wait_for(lambda: srv.stats()["long_polls"] == 1)
        t0 = time.monotonic()
        for _ in range(5):
            assert c.call(msg.Heartbeat(0, pid=1, host="h", rss=1))["stop"] is False
        assert time.monotonic() - t0 < 2.0 and poller.is_alive()
        st.request_stop()
        poller.join(10)
        assert out["r"]["stop"] is True
        assert srv.active_connections == 1
    finally:
        c.close()
        srv.close()


def test_a_request_to_a_closed_connection_reconnects_once_the_driver_closed_it():
    srv = ControlServer(KEY, lambda b, p: {"ok": True}, "127.0.0.1")
    c = ControlClient("127.0.0.1", srv.port, KEY, CID, connect_timeout_s=10)
    try:
        assert _send(c, "ping")["ok"]
        conn = c._conn
        for server_side in list(srv._loop.conns.values()):
            server_side.sock.shutdown(socket.SHUT_RDWR)  # as the server's idle timeout closes it
        Deadline(10).wait_for(lambda: conn.broken is not None)
        assert _send(c, "ping", retry=False)["ok"]  # a fresh connection, not an error
    finally:
        c.close()
        srv.close()


def test_shared_clients_are_one_per_cluster_and_survive_close():
    a = shared_client("127.0.0.1", 1, KEY, "c-a")
    assert shared_client("127.0.0.1", 1, KEY, "c-a") is a
    a.close()
    assert shared_client("127.0.0.1", 1, KEY, "c-a") is a
    assert shared_client("127.0.0.1", 1, KEY, "c-b") is not a
    for i in range(6):
        shared_client("127.0.0.1", 1, KEY, f"c-{i}")
    assert shared_client("127.0.0.1", 1, KEY, "c-a") is not a  # the oldest are closed


# ----------------------------------------------------------- typed messages
def test_messages_validate_when_decoded():
    body = msg.Heartbeat(3, pid=7, host="h", rss=5).body()
    assert body == {"type": "heartbeat", "executor_id": 3, "pid": 7, "host": "h", "rss": 5}
    assert msg.decode(body) == msg.Heartbeat(3, 7, "h", 5)
    f = NodeFailure(1, "worker", 0, "h", "exception", "E", "m")
    status = msg.decode(msg.Status(1, msg.NodeState.FAILED, failure=f).body())
    assert status.state is msg.NodeState.FAILED and status.failure == f
    assert msg.NodeState("running") == "running"
    for bad, text in [
        ({"type": "heartbeat"}, "malformed 'heartbeat' message"),
        ({"type": "heartbeat", "executor_id": "1"}, "expected an int"),
        ({"type": "heartbeat", "executor_id": True}, "expected an int"),
        ({"type": "wait_event", "executor_id": 1, "poll_s": "soon"}, "expected a number"),
        ({"type": "wait_event", "executor_id": 1, "poll_s": 10 ** 400}, "malformed 'wait_event'"),
        ({"type": "wait_event", "executor_id": 1, "counters": {"rows": 1.5}}, "expected an int"),
        ({"type": "status", "executor_id": 1, "state": "dancing"}, "unknown node state 'dancing'"),
        ({"type": "status", "executor_id": 1, "state": "failed"}, "needs its failure"),
        ({"type": "status", "executor_id": 1, "state": "exited"}, "needs its code"),
        ({"type": "log", "executor_id": 1, "lines": ["a", 2]}, "expected a string"),
        ({"type": "epoch_handover", "feed_id": "f", "lo": 5, "hi": 5, "node": "n"}, "bad index range"),
        ({"type": "register", "node": {"executor_id": 0}}, "malformed node record"),
        ({"type": "nope"}, "unknown message type 'nope'"),
    ]:
        with pytest.raises(ControlProtocolError, match=text):
            msg.decode(bad)


def test_a_malformed_typed_message_closes_only_its_connection():
    st = _state(2)
    _register_all(st)
    srv = ControlServer(KEY, st, "127.0.0.1")
    good, bad = RawClient(srv.port), RawClient(srv.port)
    try:
        good.send(msg.Heartbeat(0))
        assert good.answer()["stop"] is False
        frames = bad.session.encode("heartbeat", {"executor_id": "zero"})
        bad.sock.sendall(frames[0][1])
        with pytest.raises(ConnectionError):
            bad.answer()
        Deadline(10).wait_for(lambda: srv.rejected == 1)
        good.send(msg.Heartbeat(1))
        assert good.answer()["stop"] is False
    finally:
        good.close()
        bad.close()
        srv.close()


def test_the_client_refuses_to_send_a_malformed_message():
    c = ControlClient("127.0.0.1", 1, KEY, CID, connect_timeout_s=0.1)
    with pytest.raises(ControlProtocolError, match="expected an int"):
        _send(c, "heartbeat", executor_id="0")  # refused before any connection is tried


# ------------------------------------------------------------------ scaling
def test_caps_and_intervals_scale_with_the_cluster():
    assert ControlLimits.for_nodes(0) == ControlLimits()
    assert ControlLimits.for_nodes(50).max_connections == 512  # the defaults are the least
    big = ControlLimits.for_nodes(2000)
    assert big.max_connections == 16064 and big.max_unauthenticated == 6064 and big.backlog == 6000
    assert big.handler_threads == ControlLimits().handler_threads  # threads do not grow with N
    assert heartbeat_interval_s(3, 15.0) == 1.0 and heartbeat_interval_s(3, 2.0) == 0.5
    assert heartbeat_interval_s(1000, 15.0) == 2.0 and heartbeat_interval_s(2000, 15.0) == 3.75
    assert heartbeat_interval_s(100000, 15.0) == 3.75  # four heartbeats per timeout, always
    assert event_poll_s(10) == 1.0 and event_poll_s(800) == 2.0 and event_poll_s(5000) == 5.0
    # a forming cluster's start tasks: 0.2 s up to 400 nodes, then at most 2,000 questions a second
    assert start_poll_s(2) == 0.2 and start_poll_s(400) == 0.2 and start_poll_s(2000) == 1.0
    assert start_poll_s(100000) == 2.0


def test_a_forming_cluster_opening_three_connections_per_node_at_once_loses_none():
    """Each node of a forming InputMode.SPARK cluster opens its start task's, supervisor's
    and TF process's connections at about the same moment: with all of them accepted and
    none yet authenticated, none is evicted (two per node evicted 36 of these 300)."""
    n = 100
    limits = ControlLimits.for_nodes(n)
    assert limits.max_unauthenticated >= 3 * n and limits.backlog >= 3 * n
    srv = ControlServer(KEY, lambda body, peer: {"ok": True, "eid": body["executor_id"]}, "127.0.0.1", num_nodes=n)
    clients: list[RawClient] = []
    try:
        for _ in range(3 * n):
            clients.append(RawClient(srv.port))  # connected and its hello read, no frame sent yet
        assert srv.stats()["connections"] == 3 * n and srv.stats()["evicted"] == 0, srv.stats()
        for i, c in enumerate(clients):
            c.send(msg.NodeStateQuery(executor_id=i % n))
        assert [c.answer()["eid"] for c in clients] == [i % n for i in range(3 * n)]
        assert srv.rejected == 0 and srv.stats()["evicted"] == 0
    finally:
        for c in clients:
            c.close()
        srv.close()


def test_pipelined_requests_beyond_the_inflight_cap_are_all_answered_in_turn():
    """A peer with more unanswered requests than max_inflight is read no further until
    answers went out (backpressure on that peer only), then served on: every request is
    answered once, long-polls and quick ones alike."""
    st = _state(2)
    _register_all(st)
    srv = ControlServer(KEY, st, "127.0.0.1", limits=ControlLimits(max_inflight=4))
    c, other = RawClient(srv.port), RawClient(srv.port)
    try:
        known = {"stop": False, "feed_closed": False, "abort": "", "failed": False, "stack": 0}
        seqs = [c.send(msg.WaitEvent(0, known, None, 0.3)) for _ in range(6)]
        seqs += [c.send(msg.Heartbeat(0)) for _ in range(200)]
        other.send(msg.Heartbeat(1))
        assert other.answer()["stop"] is False  # the other peer is served meanwhile
        got = []
        while len(got) < len(seqs):
            got.append(c.answer()["re"])
        assert sorted(got) == seqs
        assert srv.rejected == 0
    finally:
        c.close()
        other.close()
        srv.close()


def test_a_node_exit_report_is_served_while_the_interpreter_exits():
    """At interpreter exit concurrent.futures refuses new work (its pool's submit raises
    RuntimeError), while the driver's teardown still waits for the nodes' exit reports:
    the server once closed the reporting node's connection silently, the node's exit went
    unheard, and the healthy node of a failed cluster was declared lost 15 s later. The
    report is served on a thread of its own instead."""
    st = _state(2)
    srv = ControlServer(KEY, st, "127.0.0.1")

    def refuse(*args, **kwargs):
        raise RuntimeError("cannot schedule new futures after interpreter shutdown")

    try:
        _register_all(st)
        srv._loop.pool.submit = refuse
        client = ControlClient("127.0.0.1", srv.port, KEY, CID, connect_timeout_s=10)
        assert client.call(msg.Status(executor_id=1, state=msg.NodeState.EXITED, code=-15), timeout_s=10, retry=False)["ok"] is True
        assert st.core.exit_codes == {1: -15}
        client.close()
    finally:
        srv.close()


# ------------------------------------------------------------------ floods
def test_a_flood_of_strangers_never_evicts_a_key_holder_and_says_who_it_evicted(caplog):
    """Strangers without the key hold the cap of unproven connections and reopen each one
    closed: a key holder proves itself in its first bytes, so its connection is never an
    eviction candidate, however long it then takes to send its first frame; the eviction
    log names the evicted connection's address; the flood report names the port, the
    counts, the source address and the remedy."""
    srv = ControlServer(KEY, lambda body, peer: {"echo": body.get("x")}, "127.0.0.1",
                        limits=ControlLimits(max_connections=512, max_unauthenticated=16))
    strangers: list[socket.socket] = []
    try:
        slow = socket.create_connection(("127.0.0.1", srv.port), timeout=20)
        slow.sendall(client_proof(KEY))  # proven; its first frame comes much later
        for _ in range(48):  # 3x the cap, silent
            strangers.append(socket.create_connection(("127.0.0.1", srv.port), timeout=20))
        Deadline(30, "evictions past the grace period").wait_for(lambda: srv.stats()["evicted"] >= 16,
                                                                 extra=lambda: str(srv.stats()))
        ports = {s.getsockname()[1] for s in strangers}
        evictions = [r.getMessage() for r in caplog.records if "evicted" in r.getMessage()]
        assert evictions and all(int(m.split("from 127.0.0.1:")[1].split(":")[0]) in ports for m in evictions)
        frames = FrameReader(KEY)
        while (hello := frames.next()) is None:
            frames.feed(slow.recv(65536))
        session = ClientSession(KEY, CID, hello)
        slow.sendall(b"".join(f for _, f, _ in session.encode("ping", {"x": 5})))
        while (body := frames.next()) is None:
            frames.feed(slow.recv(65536))
        assert body["echo"] == 5  # served, after 48 strangers came and went
        c = ControlClient("127.0.0.1", srv.port, KEY, CID, connect_timeout_s=30)
        assert c._request("ping", {"x": 6}, 30.0, True, None)["echo"] == 6  # a newcomer gets through during the flood
        c.close()
        report = srv.flood_report()
        assert f"the tfos control port 127.0.0.1:{srv.port}" in report and "127.0.0.1 (" in report
        assert "evicted" in report and "private network" in report and "spark.authenticate" in report
        slow.close()
    finally:
        for s in strangers:
            s.close()
        srv.close()


def test_a_wrong_key_client_is_refused_on_its_first_bytes():
    srv = ControlServer(KEY, lambda body, peer: {"echo": 1}, "127.0.0.1")
    try:
        c = ControlClient("127.0.0.1", srv.port, _wire.new_key(), CID, connect_timeout_s=30)
        t0 = time.monotonic()
        with pytest.raises(ControlProtocolError, match="refused this process's proof of the cluster key"):
            c._request("ping", {}, 30.0, True, None)
        assert time.monotonic() - t0 < 25  # at once, not at the end of the connect budget
        assert srv.stats()["turned_away"] == 1 and srv.flood_report().startswith("the tfos control port")
    finally:
        srv.close()


def test_the_client_backs_off_and_retries_until_the_driver_listens():
    """Connections refused (a driver still starting, or a kernel queue full under a flood)
    are retried with growing pauses until the connect budget ends."""
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    c = ControlClient("127.0.0.1", port, KEY, CID, connect_timeout_s=30)
    box: dict = {}

    def late_server() -> None:
        time.sleep(1.0)
        box["srv"] = ControlServer(KEY, lambda body, peer: {"echo": body.get("x")}, "127.0.0.1", port_spec=str(port))

    t = threading.Thread(target=late_server)
    t.start()
    try:
        assert c._request("ping", {"x": 3}, 30.0, True, None)["echo"] == 3
        assert isinstance(c.last_connect_error, type(None))
    finally:
        t.join(20)
        c.close()
        if "srv" in box:
            box["srv"].close()


def test_a_cluster_error_quotes_the_flood_report():
    from tfos.errors import ClusterFailedError

    err = ClusterFailedError(CID, [NodeFailure(0, "worker", 0, "127.0.0.1", "exited", "RuntimeError",
                                               "exited right after start-up")], "run()")
    assert "meanwhile" not in str(err)
    err.flood = "the tfos control port 127.0.0.1:9 turned away 70 connections ... from 127.0.0.1 (70)"
    first = str(err).splitlines()[0]  # no node failed in main_fun: the flood leads
    assert "most likely because of a flood" in first and first.endswith("turned away 70 connections ... from 127.0.0.1 (70)")
    assert "meanwhile" not in str(err) and "exited right after start-up" in str(err)
    err = ClusterFailedError(CID, [NodeFailure(0, "worker", 0, "127.0.0.1", "exception", "ValueError", "bad shape")], "train()")
    err.flood = "the tfos control port 127.0.0.1:9 turned away 70 connections ... from 127.0.0.1 (70)"
    assert str(err).splitlines()[0].startswith(f"tfos cluster {CID} failed during train(): 1 node(s)")  # main_fun's error leads
    assert str(err).splitlines()[-1] == "- meanwhile the tfos control port 127.0.0.1:9 turned away 70 connections ... from 127.0.0.1 (70)"
