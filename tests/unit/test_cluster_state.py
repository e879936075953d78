"""Unit tests of the control-plane core (tfos._control.core, registry, ledger) fed through its host, tfos._control.host.ClusterHost."""

from __future__ import annotations

import io
import logging
import sys
import threading
import time

import pytest

import tfos._control.host as cs_mod
from tfos._control.host import ClusterHost
from tfos._control.registry import describe_exit, kill_hint
from tfos._common.deadline import Deadline
from tfos.cluster_template import NodeInfo, build_template, roles_from_template
from tfos.errors import ClusterFailedError, ControlProtocolError, DeadlineExceededError, NodeFailure

def _handle(host, body: dict, peer: str = "127.0.0.1:1") -> dict:
    """One request answered in this thread (a long-poll waited for here)."""
    return host.resolve(host.prepare(body, peer).run())


CID = "tfos-test-1"


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def monotonic(self) -> float:
        return self.t


def _state(on_failure=None, n=3, num_ps=1, timeout=15.0) -> ClusterHost:
    from tfos._node import output

    # ps:0 (executor 0), worker:0 (executor 1), worker:1 (executor 2)
    return ClusterHost(CID, roles_from_template(build_template(n, num_ps=num_ps)), timeout, on_failure,
                       on_lines=lambda node, lines: output.emit(node, lines))


def _node(eid: int, pid: int = 100, host: str = "10.0.0.1", ekey: str = "") -> NodeInfo:
    job, idx = ("ps", 0) if eid == 0 else ("worker", eid - 1)
    return NodeInfo(eid, job, idx, host, 2000 + eid, data_port=0 if eid == 0 else 3000 + eid, pid=pid + eid,
                    executor_key=ekey or f"{host}/{500 + eid}")


def _req(cs: ClusterHost, mtype: str, /, **fields) -> dict:
    return _handle(cs, dict(fields, type=mtype, cluster=CID), "127.0.0.1:1")


def _register(state: ClusterHost, node: NodeInfo) -> dict:
    return _req(state, "register", node=node.to_dict())


def _register_all(state: ClusterHost) -> None:
    for eid in range(len(state.core.roles)):
        assert _register(state, _node(eid))["ok"] is True


# ----------------------------------------------------------------- registration
def test_registration_and_await_cluster():
    st = _state()
    assert st.core.missing() == [0, 1, 2]
    assert _register(st, _node(0)) == {"ok": True, "shared_executor": []}
    assert st.core.proc_state[0] == "registered"
    r = _req(st, "await_cluster", poll_s=0.05)
    assert r == {"ready": False, "missing": [1, 2]}
    _register(st, _node(2))
    _register(st, _node(1))
    assert st.core.all_registered()
    r = _req(st, "await_cluster", poll_s=0.05)
    assert r["ready"] is True
    # every node gets the cluster spec (encoded once for all of them), not every node record
    assert r["cluster_spec"] == st.core.cluster_spec() == {"ps": ["10.0.0.1:2000"], "worker": ["10.0.0.1:2001", "10.0.0.1:2002"]}
    assert st.core.node_name(2) == "worker:1 (executor 2, host 10.0.0.1)"


def test_await_cluster_wakes_on_registration():
    st = _state()
    _register(st, _node(0))
    _register(st, _node(1))
    out = {}

    def waiter():
        out["r"] = _req(st, "await_cluster", poll_s=30)

    t = threading.Thread(target=waiter)
    start = time.monotonic()
    t.start()
    time.sleep(0.2)
    _register(st, _node(2))
    t.join(20)
    assert not t.is_alive()
    assert out["r"]["ready"] is True
    assert time.monotonic() - start < 5.5  # poll is capped at 5 s and a registration wakes it earlier


def test_duplicate_executor_id_from_other_pid_refused():
    st = _state()
    first = _node(1, pid=100)
    assert _register(st, first)["ok"] is True
    again = _register(st, first)  # a retry from the same process is idempotent
    assert again["ok"] is True
    dup = _register(st, _node(1, pid=900, host="10.0.0.9"))
    assert dup["ok"] is False
    assert "executor id 1 is already taken by pid 101 on 10.0.0.1" in dup["abort"]
    assert st.core.nodes[1].pid == 101


def test_register_with_wrong_role_refused():
    st = _state()
    bad = NodeInfo(1, "ps", 0, "h", 2001)
    with pytest.raises(ControlProtocolError, match=r"executor 1 registered as ps:0, template says worker:0"):
        _register(st, bad)


def test_register_shared_executor_reported():
    st = _state()
    _register(st, _node(1, ekey="h/1"))
    r = _register(st, _node(2, ekey="h/1"))
    assert r == {"ok": True, "shared_executor": [1]}


def test_register_after_abort_refused():
    st = _state()
    st.abort("run() failed: bad config")
    r = _register(st, _node(0))
    assert r == {"ok": False, "abort": "run() failed: bad config"}
    assert _req(st, "await_cluster", poll_s=0.05) == {"ready": False, "abort": "run() failed: bad config"}


# -------------------------------------------------------------------- liveness
def test_heartbeats_and_lost_node(monkeypatch):
    clock = FakeClock(1000.0)
    monkeypatch.setattr(cs_mod, "time", clock)
    st = _state(timeout=15.0)
    _register_all(st)
    for eid in range(3):
        d = _req(st, "heartbeat", executor_id=eid)
        assert d == {"stop": False, "feed_closed": False, "abort": "", "failed": False}
    clock.t = 1010.0
    _req(st, "heartbeat", executor_id=0)
    _req(st, "heartbeat", executor_id=2)
    st.check_liveness(now=1012.0)
    assert st.core.failures == []
    st.check_liveness(now=1020.0)
    assert len(st.core.failures) == 1
    f = st.core.failures[0]
    assert (f.executor_id, f.job_name, f.task_index, f.kind, f.error_type) == (1, "worker", 0, "lost", "NodeLost")
    assert f.message.startswith("no heartbeat for 20.0 s (timeout 15 s)")
    assert f.host == "10.0.0.1"
    assert st.core.proc_state[1] == "failed"
    # a lost node is reported once, however often liveness is checked
    st.check_liveness(now=2000.0)
    assert [x.executor_id for x in st.core.failures] == [1, 0, 2]
    assert [x.kind for x in st.core.failures] == ["lost"] * 3
    st.check_liveness(now=3000.0)
    assert len(st.core.failures) == 3


def _three_nodes_heard_at_1000(monkeypatch):
    """``(clock, state)``: a fake clock at 1000, 3 registered nodes that each sent a
    heartbeat then (timeout 15 s), and the driver's liveness check at 1000.5."""
    clock = FakeClock(1000.0)
    monkeypatch.setattr(cs_mod, "time", clock)
    st = _state(timeout=15.0)
    _register_all(st)
    for eid in range(3):
        _req(st, "heartbeat", executor_id=eid)
    st.check_liveness(now=1000.5)
    return clock, st


def test_lost_node_after_a_driver_stall_names_the_stall(monkeypatch):
    # The driver's liveness thread ran at 1000, then not again until 1035 (SIGSTOP for
    # 35 s): the message says the driver did not run, not only that the node died.
    clock, st = _three_nodes_heard_at_1000(monkeypatch)
    st.check_liveness(now=1035.5)
    assert [f.executor_id for f in st.core.failures] == [0, 1, 2]
    msg = st.core.failures[0].message
    assert msg.startswith("no heartbeat for 35.5 s (timeout 15 s): this driver did not run for about 35.0 s")
    assert "a node ends itself when the driver does not answer it for 15 s" in msg
    # a check on time (every second) keeps the plain message
    st2 = _state(timeout=15.0)
    _register_all(st2)
    clock.t = 2000.0
    for eid in range(3):
        _req(st2, "heartbeat", executor_id=eid)
    for t in range(2001, 2017):
        st2.check_liveness(now=float(t))
    assert len(st2.core.failures) == 3
    assert "this driver did not run" not in st2.core.failures[0].message
    assert "died without a report (executor JVM killed" in st2.core.failures[0].message


def test_lost_node_after_a_shorter_driver_stall_still_names_the_stall(monkeypatch):
    # A 20 s stop (timeout 15 s): the nodes gave up 15 s into it, but the heartbeats they
    # had sent were taken from the sockets right after SIGCONT and looked fresh, so the
    # loss came 15 s later with the plain message (break helper, 2 of 2 runs).
    clock, st = _three_nodes_heard_at_1000(monkeypatch)
    clock.t = 1020.6
    for eid in range(3):  # queued during the stop, handled at once after it
        _req(st, "heartbeat", executor_id=eid)
    for t in range(21, 37):
        st.check_liveness(now=1000.5 + t)
    assert [f.executor_id for f in st.core.failures] == [0, 1, 2]
    msg = st.core.failures[0].message
    assert msg.startswith("no heartbeat for 15.9 s (timeout 15 s): this driver did not run for about 21.0 s "
                          "until 15.0 s before this check"), msg


def test_liveness_ignores_finished_nodes_after_stop(monkeypatch):
    clock = FakeClock(0.0)
    monkeypatch.setattr(cs_mod, "time", clock)
    st = _state()
    _register_all(st)
    for eid in range(3):
        _req(st, "heartbeat", executor_id=eid)
    _req(st, "status", executor_id=1, state="finished")
    _req(st, "status", executor_id=2, state="exited", code=0)
    st.request_stop()
    st.check_liveness(now=100.0)
    # The cluster is stopping: no silent node is lost (executor 2's processes exited; the
    # others are taken as stopped with the cluster, and no longer awaited).
    assert st.core.failures == []
    assert st.core.proc_state[0] == "stopped" and st.core.proc_state[1] == "finished"
    assert st.core.alive_nodes() == [] and st.core.all_exited()


def test_no_heartbeat_verdict_for_a_node_the_cluster_is_tearing_down(monkeypatch):
    """After a first failure the cluster aborts: a healthy node that then goes silent (its
    Spark task was killed with the teardown) is stopped, never 'NodeLost'."""
    clock = FakeClock(0.0)
    monkeypatch.setattr(cs_mod, "time", clock)
    st = _state()
    _register_all(st)
    _req(st, "status", executor_id=1, state="running")
    _req(st, "status", executor_id=2, state="running")
    st.record_failure(st.core.make_failure(1, "exception", "ValueError", "boom"))
    st.abort("the cluster failed")
    _req(st, "status", executor_id=1, state="exited", code=1)
    st.check_liveness(now=100.0)
    assert [(f.executor_id, f.error_type) for f in st.core.failures] == [(1, "ValueError")]
    assert st.core.proc_state[2] == "stopped" and st.core.proc_state[0] == "stopped"
    assert st.wait_until_exited([0, 1, 2], 0.0) == []


def test_heartbeat_records_host():
    st = _state()
    _req(st, "heartbeat", executor_id=2, host="10.1.1.1")
    assert st.core.node_name(2) == "worker:1 (executor 2, host 10.1.1.1)"
    assert 2 in st.core.last_heartbeat


# ---------------------------------------------------------------- exits/failures
@pytest.mark.parametrize("code, text", [(-9, "killed by SIGKILL"), (-15, "killed by SIGTERM"), (3, "exit code 3"), (-200, "killed by signal 200")])
def test_describe_exit(code, text):
    assert describe_exit(code) == text


def test_sigkill_names_the_memory_limit_and_the_last_rss():
    text = kill_hint(-9, rss_bytes=3 * 1024**3 // 2)
    assert "OOM killer" in text and "YARN/Kubernetes" in text and "memory limit" in text
    assert "last sampled RSS of the TF process and its children: 1.5 GiB" in text
    assert kill_hint(-15) == "" and kill_hint(3) == ""


def test_sigkilled_node_reports_its_last_heartbeat_rss():
    st = _state()
    _register_all(st)
    _handle(st, {"type": "heartbeat", "cluster": "tfos-test-1", "executor_id": 2, "rss": 700 * 1024**2}, "p")
    _handle(st, {"type": "status", "cluster": "tfos-test-1", "executor_id": 2, "state": "exited", "code": -9}, "p")
    text = str(st.core.error("train()"))
    assert "worker:1 (executor 2, host 10.0.0.1): ProcessDied: the TF process died (killed by SIGKILL) before main_fun returned; " in text
    assert "memory limit" in text and "700.0 MiB" in text


def test_exited_minus_9_is_a_failure():
    st = _state()
    _register_all(st)
    _req(st, "status", executor_id=2, state="running")
    assert _req(st, "status", executor_id=2, state="exited", code=-9) == {"ok": True}
    assert len(st.core.failures) == 1
    f = st.core.failures[0]
    assert (f.executor_id, f.kind, f.error_type) == (2, "exited", "ProcessDied")
    assert "killed by SIGKILL" in f.message
    assert "before main_fun returned" in f.message
    assert st.core.exit_codes[2] == -9
    assert st.core.is_done(2)
    text = str(st.core.error("train()"))
    assert "worker:1 (executor 2, host 10.0.0.1): ProcessDied: the TF process died (killed by SIGKILL)" in text


@pytest.mark.parametrize("prior", ["finished", "stopped"])
def test_nonzero_exit_after_normal_end_is_not_a_failure(prior):
    st = _state()
    _register_all(st)
    _req(st, "status", executor_id=1, state=prior)
    _req(st, "status", executor_id=1, state="exited", code=1)
    assert st.core.failures == []


def test_exit_while_stopping_is_not_a_failure():
    st = _state()
    _register_all(st)
    st.request_stop()
    _req(st, "status", executor_id=0, state="exited", code=-15, unprompted=False)
    assert st.core.failures == []
    assert st.core.exit_codes[0] == -15


def test_a_death_of_its_own_while_stopping_is_a_failure():
    """A peer's error (the consequence) aborted the cluster before the supervisor of a
    SIGKILLed node reported its exit: that exit, which its supervisor did not cause, is
    recorded, so the error names the node that died (under MWMS the peer's gRPC error
    often reaches the driver first)."""
    st = _state()
    _register_all(st)
    _req(st, "status", executor_id=0, state="running")
    _req(st, "status", executor_id=1, state="running")
    peer = st.core.make_failure(1, "exception", "UnavailableError", "recvmsg: Connection reset by peer")
    _req(st, "status", executor_id=1, state="failed", failure=peer.to_dict())
    st.abort("the cluster failed")
    _req(st, "status", executor_id=0, state="exited", code=-9, unprompted=True, rss=5 << 30)
    assert [(f.executor_id, f.kind, f.error_type) for f in st.core.failures] == [(1, "exception", "UnavailableError"), (0, "exited", "ProcessDied")]
    assert "killed by SIGKILL" in str(st.core.error("shutdown()"))


def test_exception_then_exit_is_one_failure_and_callback_fires_once():
    seen = []
    st = _state(on_failure=seen.append)
    _register_all(st)
    _req(st, "status", executor_id=1, state="running")
    exc = st.core.make_failure(1, "exception", "ValueError", "bad lr", "Traceback...\nValueError: bad lr")
    _req(st, "status", executor_id=1, state="failed", failure=exc.to_dict())
    _req(st, "status", executor_id=1, state="exited", code=1)
    st.record_failure(st.core.make_failure(1, "lost", "NodeLost", "no heartbeat"))
    _req(st, "feed_error", failure=st.core.make_failure(1, "feed", "FeedError", "partition 0 broke").to_dict())
    assert st.core.failures == [exc]
    # a second node's failure is kept, but the callback only fired for the first one
    _req(st, "status", executor_id=2, state="exited", code=-9)
    assert [f.executor_id for f in st.core.failures] == [1, 2]
    assert seen == [exc]
    # status 'running' after failure does not resurrect the node
    _req(st, "status", executor_id=1, state="running")
    assert st.core.proc_state[1] == "failed"
    r = _req(st, "node_state", executor_id=1)
    assert r == {"state": "failed", "exit_code": 1, "failure": "ValueError: bad lr", "cluster_failed": True}


@pytest.mark.parametrize("restarts_left, error_type, level", [
    (0, "ValueError", logging.ERROR),            # no restart left: the failure is final
    (1, "ValueError", logging.WARNING),          # a restart may recover it
    (2, "ConfigurationError", logging.ERROR),    # no restart can fix it (NON_RETRYABLE)
])
def test_failure_log_level_follows_the_restart_budget(caplog, restarts_left, error_type, level):
    st = _state()
    st.core.restarts_left = restarts_left
    caplog.set_level(logging.INFO, logger="tfos")
    st.record_failure(st.core.make_failure(1, "exception", error_type, "bad lr"))
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if "tfos node failed" in r.getMessage()]
    assert len(lines) == 1 and lines[0][0] == level, lines
    assert lines[0][1].startswith(f"tfos node failed: worker:0 (executor 1, host unknown host): {error_type}: bad lr"), lines
    assert ("restart(s) left" in lines[0][1]) == (level == logging.WARNING)


def test_register_after_failure_refused():
    st = _state()
    st.record_failure(st.core.make_failure(1, "exception", "RuntimeError", "boom"))
    r = _register(st, _node(0))
    assert r == {"ok": False, "abort": "the cluster has already failed"}
    assert _req(st, "await_cluster", poll_s=0.05) == {"ready": False, "abort": "another node failed"}


def test_error_aggregates():
    st = _state()
    _register_all(st)
    for eid in (1, 2):
        st.record_failure(st.core.make_failure(eid, "exception", "ValueError", "bad lr", "tb line"))
    err = st.core.error("train()")
    assert isinstance(err, ClusterFailedError)
    assert len(err.failures) == 2
    lines = str(err).splitlines()
    assert lines[0] == f"tfos cluster {CID} failed during train(): 2 node(s) reported 1 distinct error(s)"
    assert lines[1] == (
        "- [exception] worker:0 (executor 1, host 10.0.0.1), worker:1 (executor 2, host 10.0.0.1): ValueError: bad lr"
    )


# ------------------------------------------------------------------- directives
def test_directives():
    st = _state()
    _register_all(st)
    assert _req(st, "heartbeat", executor_id=1) == {"stop": False, "feed_closed": False, "abort": "", "failed": False}
    st.close_feed()
    assert _req(st, "heartbeat", executor_id=1) == {"stop": False, "feed_closed": True, "abort": "", "failed": False}
    st.request_stop(feed_closed=False)
    assert _req(st, "heartbeat", executor_id=1) == {"stop": True, "feed_closed": True, "abort": "", "failed": False}
    st.abort("user interrupt")
    assert _req(st, "heartbeat", executor_id=1)["abort"] == "user interrupt"

    st2 = _state()
    st2.request_stop()
    assert _req(st2, "heartbeat", executor_id=0) == {"stop": True, "feed_closed": True, "abort": "", "failed": False}
    st3 = _state()
    st3.request_stop(feed_closed=False)
    assert _req(st3, "heartbeat", executor_id=0)["feed_closed"] is False
    st3.record_failure(st3.core.make_failure(0, "exception", "E", "m"))
    assert _req(st3, "heartbeat", executor_id=0)["failed"] is True


def test_wait_event_returns_on_change_and_records_counters():
    st = _state()
    _register_all(st)
    known = {"stop": False, "feed_closed": False, "abort": "", "failed": False, "stack": 0}
    t0 = time.monotonic()
    r = _req(st, "wait_event", executor_id=1, known=known, poll_s=0.1, counters={"rows": 40})
    assert r == known
    assert time.monotonic() - t0 >= 0.09
    assert st.core.rows_consumed() == 40
    _req(st, "wait_event", executor_id=2, known={}, poll_s=0.1, counters={"rows": 2})
    assert st.core.rows_consumed() == 42

    out = {}

    def waiter():
        out["r"] = _req(st, "wait_event", executor_id=1, known=known, poll_s=30)

    th = threading.Thread(target=waiter)
    t0 = time.monotonic()
    th.start()
    time.sleep(0.2)
    st.close_feed()
    th.join(20)
    assert not th.is_alive()
    assert out["r"]["feed_closed"] is True
    assert time.monotonic() - t0 < 5.5


def test_node_stack_request_reaches_only_that_node_and_returns_its_answer():
    """A feed task's ``node_stack`` request wakes that node's wait_event (its ``stack``
    directive counts up; the other node's does not) and returns the text the node sends
    back with the same request number; an older answer does not count."""
    st = _state()
    _register_all(st)
    known = {"stop": False, "feed_closed": False, "abort": "", "failed": False, "stack": 0}
    out: dict = {}

    def node(eid):
        out[eid] = _req(st, "wait_event", executor_id=eid, known=known, poll_s=3.0)
        if eid == 1:
            _req(st, "stack", executor_id=1, seq=0, text="stale")  # ignored: not the request's number
            _req(st, "stack", executor_id=1, seq=out[1]["stack"], text="main_fun's stack on worker:0 ...")

    threads = [threading.Thread(target=node, args=(eid,)) for eid in (1, 2)]
    for th in threads:
        th.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    r = _req(st, "node_stack", executor_id=1, wait_s=5.0)
    assert r == {"stack": "main_fun's stack on worker:0 ..."}
    assert time.monotonic() - t0 < 2.0
    for th in threads:
        th.join(10)
    assert out[1]["stack"] == 1 and out[2]["stack"] == 0


def test_node_stack_request_gives_up_after_its_wait():
    """No answer (the node's event loop cannot run): an empty stack after wait_s; a node
    that has ended is not waited for at all; a stack text is cut to its bound."""
    from tfos._control import registry as state_mod

    st = _state()
    _register_all(st)
    t0 = time.monotonic()
    assert _req(st, "node_stack", executor_id=1, wait_s=0.3) == {"stack": ""}
    assert 0.25 <= time.monotonic() - t0 < 2.0
    _req(st, "status", executor_id=2, state="finished")
    t0 = time.monotonic()
    assert _req(st, "node_stack", executor_id=2, wait_s=5.0) == {"stack": ""}
    assert time.monotonic() - t0 < 1.0
    _req(st, "stack", executor_id=1, seq=5, text="x" * (state_mod.MAX_STACK_CHARS + 10))
    assert len(st.core.stacks[1][1]) == state_mod.MAX_STACK_CHARS
    with pytest.raises(ControlProtocolError, match="unknown executor id 7"):
        _req(st, "node_stack", executor_id=7, wait_s=0.1)


def test_wait_helper():
    st = _state()
    assert st.wait(lambda: True, Deadline(1)) is True
    with pytest.raises(DeadlineExceededError, match="timed out after 0.2 s waiting for nodes"):
        st.wait(lambda: False, Deadline(0.2, "nodes"), poll_s=0.05)
    threading.Timer(0.2, lambda: st.record_failure(st.core.make_failure(0, "exception", "E", "m"))).start()
    assert st.wait(lambda: False, Deadline(20), poll_s=5) is False


# ------------------------------------------------------------------- handle()
def test_handle_rejects_foreign_cluster():
    st = _state()
    with pytest.raises(ControlProtocolError, match="frame is for another cluster"):
        _handle(st, {"type": "heartbeat", "cluster": "other", "executor_id": 0}, "p")
    with pytest.raises(ControlProtocolError, match="frame is for another cluster"):
        _handle(st, {"type": "heartbeat", "executor_id": 0}, "p")


@pytest.mark.parametrize("mtype", ["nope", "directives", "", None, "_directives"])
def test_handle_rejects_unknown_types(mtype):
    st = _state()
    with pytest.raises(ControlProtocolError, match="unknown message type"):
        _handle(st, {"type": mtype, "cluster": CID}, "p")


def test_handle_rejects_bad_fields():
    st = _state()
    with pytest.raises(ControlProtocolError, match=r"malformed 'heartbeat' message"):
        _req(st, "heartbeat")
    with pytest.raises(ControlProtocolError, match=r"malformed 'heartbeat' message"):
        _req(st, "heartbeat", executor_id="x")
    with pytest.raises(ControlProtocolError, match=r"unknown executor id 7"):
        _req(st, "heartbeat", executor_id=7)
    with pytest.raises(ControlProtocolError, match=r"unknown executor id -1"):
        _req(st, "status", executor_id=-1, state="running")
    with pytest.raises(ControlProtocolError, match=r"unknown node state 'dancing'"):
        _req(st, "status", executor_id=1, state="dancing")
    with pytest.raises(ControlProtocolError, match="malformed node record"):
        _req(st, "register", node={"executor_id": 0})
    with pytest.raises(ControlProtocolError, match="malformed node failure report"):
        _req(st, "feed_error", failure={"executor_id": 0})
    assert st.core.failures == []


def test_log_lines_reach_stderr_with_one_short_prefix(capsys):
    """C26: without any logging set-up, node lines are on the driver's stderr."""
    st = _state()
    _register_all(st)
    _req(st, "log", executor_id=1, lines=["epoch 1 loss 0.5", "x" * 5000])
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "[worker:0] epoch 1 loss 0.5"
    assert err[1] == "[worker:0] " + "x" * 2000


class _Tty(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("spark_bar,tty,starts", [
    (True, True, "\r\x1b[2K[worker:0] epoch 1"),   # erases Spark's unfinished bar line first
    (True, False, "[worker:0] epoch 1"),             # a file or pipe: no escape codes
    (False, True, "[worker:0] epoch 1"),             # no Spark bar: nothing to erase
])
def test_log_lines_erase_sparks_progress_bar_on_a_terminal(monkeypatch, spark_bar, tty, starts):
    from tfos._node import output
    err = _Tty() if tty else io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(output, "_spark_bar", False)
    output.note_spark_bar(spark_bar)
    st = _state()
    _register_all(st)
    _req(st, "log", executor_id=1, lines=["epoch 1", "epoch 2"])
    assert err.getvalue() == starts + "\n[worker:0] epoch 2\n"


@pytest.mark.parametrize("tty", [False, True])
def test_escape_codes_reach_only_a_terminal(monkeypatch, tty):
    """Keras's progress bar colours its lines: a file or a pipe gets them plain."""
    from tfos._node import output
    err = _Tty() if tty else io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(output, "_spark_bar", False)
    st = _state()
    _register_all(st)
    keras = "\x1b[1m70/70\x1b[0m \x1b[32m━━━━━━━━━━━━━━━━━━━━\x1b[0m\x1b[37m\x1b[0m \x1b[1m1s\x1b[0m 9ms/step - loss: 0.2"
    _req(st, "log", executor_id=1, lines=[keras, "\x1b]0;title\x07plain \x1b7x\x1b[?25l"])
    if tty:
        assert err.getvalue() == f"[worker:0] {keras}\n[worker:0] \x1b]0;title\x07plain \x1b7x\x1b[?25l\n"
    else:
        assert err.getvalue() == "[worker:0] 70/70 ━━━━━━━━━━━━━━━━━━━━ 1s 9ms/step - loss: 0.2\n[worker:0] plain x\n"


def test_spark_bar_is_noted_from_the_spark_conf():
    from tfos._node import output

    class Conf:
        def __init__(self, v):
            self.v = v

        def get(self, key, default):
            return self.v if key == "spark.ui.showConsoleProgress" else default

    class Sc:
        def __init__(self, v):
            self.conf = Conf(v)

        def getConf(self):
            return self.conf

    assert output.spark_shows_progress(Sc("true")) is True
    assert output.spark_shows_progress(Sc("false")) is False
    assert output.spark_shows_progress(object()) is False


def test_log_lines_to_the_tfos_node_logger_when_it_has_a_handler(caplog, capsys):
    st = _state()
    _register_all(st)
    node_logger = logging.getLogger("tfos.node")
    node_logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="tfos.node"):
            _req(st, "log", executor_id=1, lines=["epoch 1 loss 0.5"])
    finally:
        node_logger.removeHandler(caplog.handler)
    recs = [r.getMessage() for r in caplog.records if r.name == "tfos.node"]
    assert recs and set(recs) == {"[worker:0] epoch 1 loss 0.5"}
    assert "epoch 1" not in capsys.readouterr().err


def test_tensorboard_url():
    st = _state()
    assert _req(st, "tensorboard", url="http://h:6006") == {"ok": True}
    assert st.core.tensorboard_url == "http://h:6006"


def test_failure_roundtrip_through_status():
    st = _state()
    f = NodeFailure(2, "worker", 1, "h", "exception", "KeyError", "'x'", "tb")
    _req(st, "status", executor_id=2, state="failed", failure=f.to_dict())
    assert st.core.failures == [f]
    assert st.core.failed


# ------------------------------------------------- attribution and driver waits (issue 10)
def _fail(st, eid, kind, etype, msg):
    f = st.core.make_failure(eid, kind, etype, msg)
    _req(st, "status", executor_id=eid, state="failed", failure=f.to_dict()) if kind == "exception" else \
        _req(st, "feed_error", failure=f.to_dict())


def test_memory_error_and_its_feed_error_on_one_node_give_one_cause():
    st = _state()
    _register_all(st)
    _fail(st, 2, "feed", "FeedError", "lost the data connection while feeding partition 3")
    assert not st.core.failed_nodes_reported()  # worker:1 has not reported its own cause yet
    _fail(st, 2, "exception", "MemoryError", "cannot allocate")
    assert st.core.failed_nodes_reported()
    err = st.core.error("train()")
    assert [(f.executor_id, f.error_type) for f in err.failures] == [(2, "MemoryError")]
    text = str(err)
    assert "1 node(s) reported 1 distinct error(s)" in text and "MemoryError: cannot allocate" in text
    assert "FeedError" not in text
    assert [f.error_type for f in err.consequences] == ["FeedError"]


def test_value_error_and_the_other_nodes_feed_error_give_one_cause():
    st = _state()
    _register_all(st)
    _fail(st, 1, "feed", "FeedTimeoutError", "worker:0 accepted no data for 1 s")
    _fail(st, 2, "exception", "ValueError", "bad value")
    # worker:0 itself never reported a cause, but its process exit ends the wait
    assert not st.core.failed_nodes_reported()
    _req(st, "status", executor_id=1, state="exited", code=-15)
    assert st.core.failed_nodes_reported()
    err = st.core.error("train()")
    text = str(err)
    assert [(f.executor_id, f.error_type) for f in err.failures] == [(2, "ValueError")]
    assert "FeedTimeoutError" not in text and "ValueError: bad value" in text and "worker:1 (executor 2" in text


def test_only_consequences_are_reported_when_there_is_no_root_cause():
    st = _state()
    _register_all(st)
    _fail(st, 1, "feed", "FeedTimeoutError", "worker:0 accepted no data for 1 s")
    err = st.core.error("train()")
    assert [f.error_type for f in err.failures] == ["FeedTimeoutError"]


def test_wait_until_registered_answers_each_outcome():
    st = _state()
    dl = Deadline(5.0, "registration")
    assert st.wait_until_registered(dl, lambda: False, tick_s=0.05) == "tick"
    assert st.wait_until_registered(dl, lambda: True, tick_s=0.05) == "stop_asked"
    threading.Timer(0.1, lambda: _register_all(st)).start()
    t0 = time.monotonic()
    assert st.wait_until_registered(dl, lambda: False, tick_s=5.0) == "all_registered"
    assert time.monotonic() - t0 < 4.0  # woken by the registration, not by the tick
    assert ClusterHost(CID, st.core.roles, 15.0).wait_until_registered(Deadline(0.0, "x"), lambda: False) == "expired"


def test_wait_until_exited_wakes_on_exit_reports():
    st = _state()
    _register_all(st)
    assert st.core.alive_nodes() == [0, 1, 2]
    threading.Timer(0.1, lambda: [_req(st, "status", executor_id=e, state="exited", code=0) for e in (0, 1, 2)]).start()
    t0 = time.monotonic()
    assert st.wait_until_exited([0, 1, 2], 10.0) == []
    assert time.monotonic() - t0 < 5.0
    assert st.wait_until_exited([0], 0.01) == []


def test_wait_for_counters_needs_a_fresh_report():
    st = _state()
    _register_all(st)
    _req(st, "wait_event", executor_id=1, known={}, counters={"rows": 5}, poll_s=0)
    assert not st.wait_for_counters([1], 0.05)
    threading.Timer(0.05, lambda: _req(st, "wait_event", executor_id=1, known={}, counters={"rows": 9}, poll_s=0)).start()
    assert st.wait_for_counters([1], 5.0)
    assert st.core.rows_consumed() == 9


def test_tensorboard_failure_is_recorded_with_its_stderr(caplog):
    st = _state()
    with caplog.at_level(logging.WARNING, logger="tfos._control.host"):
        _req(st, "tensorboard", executor_id=1, url="", error="ModuleNotFoundError: No module named 'tensorboard'")
    assert st.core.tensorboard_url is None
    assert "No module named 'tensorboard'" in st.core.tensorboard_error
    assert any("failed to start" in r.getMessage() and "No module named" in r.getMessage() for r in caplog.records)


def test_a_killed_task_waits_for_the_silent_host_to_be_named(monkeypatch):
    """A host crashes with its node supervisor: Spark kills the other node's barrier task
    first (a consequence); the silent node is the root cause once declared lost."""
    clock = FakeClock(1000.0)
    monkeypatch.setattr(cs_mod, "time", clock)
    st = _state(n=2, num_ps=0, timeout=6.0)  # worker:0 (executor 0), worker:1 (executor 1)
    for eid in range(2):
        assert _register(st, NodeInfo(eid, "worker", eid, f"10.77.0.{11 + eid}", 2000 + eid, executor_key=f"h{eid}/1"))["ok"]
        _req(st, "heartbeat", executor_id=eid)
    clock.t = 1001.0  # executor 1's host dies here; executor 0's task is killed by Spark
    _fail(st, 0, "lost", "SparkTaskKilled", "the Spark task hosting the node ended")
    since = clock.t
    assert not st.core.has_root_cause()
    assert st.core.heard_from_live_nodes_since(since) is False  # executor 1 is silent
    clock.t = 1008.0
    st.check_liveness()
    assert st.core.has_root_cause()
    err = st.core.error("shutdown()")
    assert [(f.executor_id, f.error_type) for f in err.failures] == [(1, "NodeLost")]
    assert "worker:1 (executor 1, host 10.77.0.12)" in str(err)


def test_live_nodes_heard_from_ends_the_wait_for_a_root_cause():
    st = _state()
    _register_all(st)
    since = time.monotonic()
    assert not st.core.heard_from_live_nodes_since(since)
    _fail(st, 1, "feed", "FeedTimeoutError", "worker:0 accepted no data for 1 s")
    _req(st, "status", executor_id=0, state="exited", code=0)
    assert not st.core.heard_from_live_nodes_since(since)  # executor 2 not heard from yet
    _req(st, "heartbeat", executor_id=2)
    assert st.core.heard_from_live_nodes_since(since)


def test_only_root_causes_are_logged_as_errors(caplog):
    # A consequence (a feed task's FeedError) reported before its node's cause is kept for
    # the error but logged at INFO: the driver's log shows the cause once, as an ERROR.
    st = _state(n=2, num_ps=0)
    with caplog.at_level(logging.INFO, logger="tfos._control.host"):
        st.record_failure(st.core.make_failure(0, "feed", "FeedError", "partition 3: the node failed"))
        st.record_failure(st.core.make_failure(0, "exception", "RuntimeError", "boom"))
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(errors) == 1 and "RuntimeError: boom" in errors[0]
    assert any("FeedError: partition 3: the node failed" in m for m in infos)


# ------------------------------------------------------ driver questions (issue 13)
def test_registered_feedable_and_exited_ids():
    st = _state()  # ps:0 (executor 0), worker:0 (1), worker:1 (2)
    assert sorted(st.core.nodes) == [] and st.core.all_exited()  # nobody registered: nothing to wait for
    assert st.core.feedable_ids() == [1, 2]
    _register(st, _node(2))
    _register(st, _node(0))
    assert sorted(st.core.nodes) == [0, 2]
    assert not st.core.all_exited()
    _req(st, "status", executor_id=0, state="exited", code=0)
    assert not st.core.all_exited()
    st.record_failure(st.core.make_failure(2, "lost", "NodeLost", "no heartbeat for 16 s"))
    assert st.core.all_exited()  # a lost node counts as gone


def test_wait_for_failure_is_woken_by_the_report_and_times_out_without_one():
    st = _state()
    _register_all(st)
    assert st.wait_for_failure(0.05) is False
    threading.Timer(0.1, lambda: _fail(st, 2, "exception", "ValueError", "bad value")).start()
    t0 = time.monotonic()
    assert st.wait_for_failure(30.0) is True
    assert time.monotonic() - t0 < 20.0  # woken by the report, not by the 30 s timeout


def test_wait_for_event_or_failure_answers_whether_the_event_is_set():
    st = _state()
    _register_all(st)
    done = threading.Event()
    assert st.wait_for_event_or_failure(done, 0.05) is False

    def end_job():
        done.set()
        st.poke()

    threading.Timer(0.1, end_job).start()
    t0 = time.monotonic()
    assert st.wait_for_event_or_failure(done, 30.0) is True
    assert time.monotonic() - t0 < 20.0
    other = threading.Event()
    threading.Timer(0.1, lambda: _fail(st, 1, "exception", "RuntimeError", "boom")).start()
    assert st.wait_for_event_or_failure(other, 30.0) is False  # ended by the failure
    assert st.core.failed


def test_wait_for_root_causes_returns_once_the_failed_node_reported():
    st = _state()
    _register_all(st)
    _fail(st, 2, "feed", "FeedError", "lost the data connection while feeding partition 3")
    threading.Timer(0.1, lambda: _fail(st, 2, "exception", "MemoryError", "cannot allocate")).start()
    t0 = time.monotonic()
    assert st.wait_for_root_causes(30.0, 30.0) is True
    assert time.monotonic() - t0 < 20.0
    assert [f.error_type for f in st.core.error("train()").failures] == ["MemoryError"]


def test_wait_for_root_causes_gives_up_after_its_bounds():
    st = _state()
    _register_all(st)
    _fail(st, 1, "feed", "FeedTimeoutError", "worker:0 accepted no data for 1 s")
    t0 = time.monotonic()
    # worker:0 never reports and the other nodes send no heartbeat: both bounds expire
    assert st.wait_for_root_causes(0.1, 0.1) is False
    assert time.monotonic() - t0 >= 0.2
    assert [f.error_type for f in st.core.error("train()").failures] == ["FeedTimeoutError"]


@pytest.mark.parametrize("settle_s, listed", [(0.0, [1]), (2.0, [1, 2])])
def test_nodes_failing_at_about_the_same_moment_are_all_in_the_error(settle_s, listed):
    """Both workers raise the same error 50 ms apart: with the settle window both are in
    the error (grouped as one distinct error); without it only the first one."""
    st = _state()
    _register_all(st)
    _fail(st, 1, "exception", "ValueError", "identical failure on every node")
    threading.Timer(0.05, lambda: _fail(st, 2, "exception", "ValueError", "identical failure on every node")).start()
    assert st.wait_for_root_causes(5.0, 5.0, settle_s) is True
    err = st.core.error("shutdown()")
    assert [f.executor_id for f in err.failures] == listed
    if len(listed) == 2:
        assert "2 node(s)" in str(err) and "1 distinct error(s)" in str(err), str(err)
    time.sleep(0.1)  # the timer fired in every case
    assert [f.executor_id for f in st.core.failures] == [1, 2]


def test_the_settle_window_ends_once_every_node_ended():
    st = _state()
    _register_all(st)
    _fail(st, 1, "exception", "ValueError", "bad lr")
    for eid in (0, 2):
        _req(st, "status", executor_id=eid, state="exited", code=0)
    t0 = time.monotonic()
    assert st.wait_for_root_causes(5.0, 5.0, 30.0) is True
    assert time.monotonic() - t0 < 20.0  # not the 30 s window: nothing more can fail


def test_wait_until_workers_done_ignores_the_ps_and_raises_at_the_deadline():
    st = _state()
    _register_all(st)
    with pytest.raises(DeadlineExceededError, match="workers"):
        st.wait_until_workers_done(Deadline(0.05, "workers to finish"))
    _req(st, "status", executor_id=1, state="finished")
    threading.Timer(0.1, lambda: _req(st, "status", executor_id=2, state="finished")).start()
    assert st.wait_until_workers_done(Deadline(30.0, "workers to finish")) is True
    assert st.core.proc_state[0] == "registered"  # the ps still serves
    st2 = _state()
    _register_all(st2)
    threading.Timer(0.1, lambda: _fail(st2, 1, "exception", "ValueError", "bad value")).start()
    assert st2.wait_until_workers_done(Deadline(30.0, "workers to finish")) is False


def test_workers_done_timeout_names_the_running_nodes_with_main_funs_stack():
    """shutdown(timeout=T) expiring names the nodes whose main_fun has not returned and
    shows where main_fun waits (new-user trial, session 17: a TF1 chief waited in
    CreateSession and the error named no node)."""
    st = _state()
    _register_all(st)
    _req(st, "status", executor_id=2, state="finished")

    def answer() -> None:  # the node's event loop sees the request and answers
        deadline = time.monotonic() + 5
        while st.core.stack_asked.get(1, 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        _req(st, "stack", executor_id=1, seq=1, text="main_fun's stack on worker:0: in CreateSession")

    threading.Thread(target=answer, daemon=True).start()
    with pytest.raises(DeadlineExceededError) as info:
        st.wait_until_workers_done(Deadline(0.05, "main_fun to return on every chief/master/worker node"))
    assert str(info.value).startswith("timed out after 0.05 s waiting for main_fun to return on every chief/master/worker node")
    assert "; main_fun had not returned on worker:0 (executor 1, host 10.0.0.1)\nmain_fun's stack on worker:0: in CreateSession" in str(info.value)
    assert "worker:1" not in str(info.value)


def test_wait_for_tensorboard_url_or_error():
    st = _state()
    threading.Timer(0.1, lambda: _req(st, "tensorboard", executor_id=1, url="http://10.0.0.1:6006/")).start()
    assert st.wait_for_tensorboard(Deadline(30.0, "TensorBoard to start")) is True
    assert st.core.tensorboard_url == "http://10.0.0.1:6006/"
    st2 = _state()
    _req(st2, "tensorboard", executor_id=1, url="", error="ModuleNotFoundError: No module named 'tensorboard'")
    assert st2.wait_for_tensorboard(Deadline(30.0, "TensorBoard to start")) is True
    with pytest.raises(DeadlineExceededError):
        _state().wait_for_tensorboard(Deadline(0.05, "TensorBoard to start"))


def test_status_is_a_json_ready_snapshot():
    st = _state()
    _register(st, _node(1))
    _req(st, "status", executor_id=1, state="exited", code=0)
    st.close_feed()
    s = st.core.status()
    assert s["registered"] is False and s["missing"] == [0, 2]
    assert [n["executor_id"] for n in s["nodes"]] == [1]
    assert s["states"] == {"0": "pending", "1": "registered", "2": "pending"}
    assert s["exit_codes"] == {"1": 0}
    assert s["failures"] == [] and s["tensorboard_url"] is None
    assert (s["feed_closed"], s["stop_requested"], s["abort"]) == (True, False, "")


def test_epoch_handover_counts_claimed_and_skipped_partitions_and_names_the_nodes_own():
    """The epoch-aware readers' question (tfos._data.epoch_order.EpochOrder): are the job
    partitions lo..hi-1 of a feed all handed to a node or skipped, and which went to me?"""
    cs = _state()
    a, b = "worker:0 (executor 1, host h)", "worker:1 (executor 2, host h)"
    for index, node in ((0, a), (1, b), (3, a), (5, b)):
        assert _req(cs, "claim_partition", feed_id="f1", index=index, node=node) == {"granted": True}
    assert _req(cs, "epoch_handover", feed_id="f1", lo=0, hi=3, node=a) == {"settled": 2, "mine": [0]}
    assert _req(cs, "partition_skipped", feed_id="f1", index=2) == {"ok": True}
    assert _req(cs, "epoch_handover", feed_id="f1", lo=0, hi=3, node=a) == {"settled": 3, "mine": [0]}
    assert _req(cs, "epoch_handover", feed_id="f1", lo=3, hi=6, node=b) == {"settled": 2, "mine": [5]}
    assert _req(cs, "epoch_handover", feed_id="other", lo=0, hi=3, node=a) == {"settled": 0, "mine": []}
    with pytest.raises(ControlProtocolError, match="bad index range 3..3"):
        _req(cs, "epoch_handover", feed_id="f1", lo=3, hi=3, node=a)


def test_a_resent_claim_is_the_same_claim_and_a_rerun_is_refused():
    """claim_partition carries a token per claim: the control client resends a request once
    when its connection broke, possibly after the driver recorded it, and that resend is
    granted again; another task's claim (another token, or none) is refused."""
    cs = _state()
    a = "worker:0 (executor 1, host h)"
    assert _req(cs, "claim_partition", feed_id="f1", index=3, node=a, token="t1") == {"granted": True}
    assert _req(cs, "claim_partition", feed_id="f1", index=3, node=a, token="t1") == {"granted": True}
    assert _req(cs, "claim_partition", feed_id="f1", index=3, node=a, token="t2") == {"granted": False, "node": a}
    assert _req(cs, "claim_partition", feed_id="f1", index=3, node=a) == {"granted": False, "node": a}
    assert _req(cs, "claim_partition", feed_id="f1", index=4, node=a) == {"granted": True}  # no token: once
    assert _req(cs, "claim_partition", feed_id="f1", index=4, node=a, token="") == {"granted": False, "node": a}


def test_the_claim_survives_an_answer_lost_after_the_driver_recorded_it():
    """Through a real control server whose first answer to a claim is lost after the
    driver recorded it (the connection drops): the feed task's _claim resends it and is
    granted, once, instead of failing as a re-run task."""
    from tfos._common import wire
    from tfos._control.server import ControlServer
    from tfos._data.feed_link import claim as _claim
    from tfos._data.feed_plan import FeedPlan

    cs = _state()
    seen: list = []

    def dispatch(body, peer):
        resp = _handle(cs, body, peer)
        if body.get("type") == "claim_partition":
            seen.append(body.get("token"))
            if len(seen) == 1:
                raise ControlProtocolError("simulated: the answer is lost after the claim was recorded")
        return resp

    key = wire.new_key()
    srv = ControlServer(key, dispatch, "127.0.0.1")
    try:
        node = _node(1)
        plan = FeedPlan(CID, key, "127.0.0.1", srv.port, (node,), feed_id="f1")
        _claim(plan, node, 3, "partition 3 (epoch 0) -> worker:0")  # raises FeedError if refused
        assert len(seen) == 2 and seen[0] == seen[1] and len(seen[0]) == 32
        assert cs.core.ledger.claimed["f1"] == {3: node.name}
    finally:
        srv.close()


def test_the_driver_keeps_the_records_of_the_newest_feeds_only():
    """A streaming job feeds every micro-batch as its own feed: the driver's per-partition
    record (claims, skips, acknowledgements, hand-overs) is kept for the newest
    MAX_FEEDS_KEPT feeds, so its memory does not grow with the number of micro-batches."""
    cs = _state()
    from tfos._control.ledger import MAX_FEEDS_KEPT
    n = MAX_FEEDS_KEPT
    for f in range(n + 10):
        fid = f"feed{f}"
        cs.close_feed_when_sent(fid, 100)
        for index in range(4):
            assert _req(cs, "claim_partition", feed_id=fid, index=index, node="w", token=f"t{index}") == {"granted": True}
            _req(cs, "partition_done", feed_id=fid, index=index)
        _req(cs, "partition_skipped", feed_id=fid, index=9)
    for record in (cs.core.ledger.sent, cs.core.ledger.done, cs.core.ledger.claimed, cs.core.ledger.claim_tokens, cs.core.ledger.skipped):
        assert sorted(record) == sorted(f"feed{f}" for f in range(10, n + 10))
    assert cs.core.ledger.partitions_done(f"feed{n + 9}") == {0, 1, 2, 3}
    assert cs.core.ledger.partitions_done("feed0") == set()


def test_a_resent_failure_report_is_recorded_once():
    """A node's or feed task's report resent after a broken connection (the control
    client resends once) does not show the same failure twice in the driver's error."""
    st = _state()
    _register_all(st)
    f = NodeFailure(1, "worker", 0, "10.0.0.1", "feed", "FeedTimeoutError", "worker:0 accepted no data for 3 s")
    for _ in range(2):
        assert _req(st, "feed_error", failure=f.to_dict()) == {"ok": True}
    assert st.core.failures == [f]
    assert str(st.core.error("train()")).count("accepted no data for 3 s") == 1


def test_python_error_of_a_spark_task_error_text():
    """The Python exception inside Spark's task error text: type, message, traceback
    (without Spark's Java frames and SQLSTATE line); None when there is none."""
    from tfos._driver.runtime import python_error_of

    text = ("org.apache.spark.api.python.PythonException: [PYTHON_EXCEPTION] An exception was thrown from the "
            "Python worker: Traceback (most recent call last):\n  File \"/x/worker.py\", line 1, in main\n"
            "    raise ValueError(\"corrupt: a: b\")\nValueError: corrupt: a: b\n SQLSTATE: 38000\n"
            "\tat org.apache.spark.api.python.BasePythonRunner.foo(PythonRunner.scala:1)\n")
    etype, message, tb = python_error_of(text)
    assert (etype, message) == ("ValueError", "corrupt: a: b")
    assert tb.startswith("Traceback (most recent call last):") and tb.endswith("ValueError: corrupt: a: b")
    assert python_error_of(text.replace("ValueError", "pyspark.errors.PySparkRuntimeError"))[0] == "PySparkRuntimeError"
    assert python_error_of("ExecutorLostFailure (executor 1 exited)") is None


def test_a_cluster_where_every_worker_only_served_is_warned_about(caplog):
    """ParameterServerStrategy without master_node='chief': every worker serves, nobody
    trains, shutdown() returns cleanly; a WARNING says that nothing was trained."""
    import logging

    from tfos._driver.lifecycle import _warn_if_nobody_trained

    st = _state()
    _register_all(st)
    caplog.set_level(logging.WARNING, logger="tfos._driver")
    for r in st.core.roles:
        _req(st, "status", executor_id=r.executor_id, state="serving")
    _warn_if_nobody_trained("tfos-test-1", st.core.roles, st.core.proc_state)
    assert [rec.getMessage() for rec in caplog.records if "none ran a training loop" in rec.getMessage()], caplog.records
    caplog.clear()
    worker = next(r.executor_id for r in st.core.roles if not r.is_background)
    _req(st, "status", executor_id=worker, state="finished")
    _warn_if_nobody_trained("tfos-test-1", st.core.roles, st.core.proc_state)
    assert not caplog.records


def test_a_node_ending_with_feed_aborted_after_the_abort_is_not_a_death_of_its_own():
    """After the abort, a healthy node's main_fun raises FeedAbortedError (a consequence,
    not listed) and its TF process exits 1 by itself: that exit is not a ProcessDied."""
    st = _state()
    _register_all(st)
    _req(st, "status", executor_id=0, state="running")
    root = st.core.make_failure(1, "exception", "ValueError", "boom")
    _req(st, "status", executor_id=1, state="failed", failure=root.to_dict())
    st.abort("the cluster failed")
    aborted = st.core.make_failure(0, "exception", "FeedAbortedError", "the cluster aborted")
    _req(st, "status", executor_id=0, state="failed", failure=aborted.to_dict())
    _req(st, "status", executor_id=0, state="exited", code=1, unprompted=True)
    assert st.core.failures == [root]


def test_a_failed_spark_job_with_no_node_cause_says_so(monkeypatch):
    """A Spark job of the cluster failed and no node reported a cause (e.g. the driver JVM
    ran out of memory collecting results): the error is listed under the first node, and
    its text says it may not be that node's doing."""
    import tfos._driver.runtime as rt

    monkeypatch.setattr(rt, "ATTRIBUTION_S", 0.05)
    runtime = object.__new__(rt.ClusterRuntime)
    runtime.cluster_id, runtime.host, runtime._closed, runtime.jobs = CID, _state(), False, []
    runtime.sc = None  # no failed Spark task to read (failed_task_errors gives [])
    runtime.teardown_async = lambda: None

    class FailedJob:
        done = threading.Event()
        error = RuntimeError("An error occurred while calling o123.collectToPython.\n"
                             ": java.lang.OutOfMemoryError: Java heap space")
        result = None

    FailedJob.done.set()
    with pytest.raises(ClusterFailedError) as info:
        runtime.await_job(FailedJob(), "inference()")
    (f,) = info.value.failures
    assert (f.kind, f.job_name, f.task_index, f.error_type) == ("spark", "ps", 0, "RuntimeError")
    assert f.message == ("An error occurred while calling o123.collectToPython. java.lang.OutOfMemoryError: Java heap "
                         "space (the Spark job of inference() failed "
                         "and no node reported a cause: it may lie on the driver or in Spark itself; listed under "
                         "the first node, ps:0)"), f.message


@pytest.mark.parametrize("when, status, cancels", [
    ("submitted", "RUNNING", 1),   # Spark had the job: the one cancellation reached it
    ("later", "RUNNING", 2),       # submitted after the cancellation: cancelled again
    ("later", "FAILED", 1),        # ...unless it already ended (Spark would WARN
])                                 # 'Failed to cancel job group', seen under CPU load)
def test_job_group_is_cancelled_again_only_while_a_job_runs(when, status, cancels):
    import tfos._driver.runtime as rt

    class Info:
        def __init__(self, status):
            self.status = status

    class Sc:
        def __init__(self):
            self.ids, self.cancelled = ([7] if when == "submitted" else []), []

        def statusTracker(self):
            return self

        def getJobIdsForGroup(self, group):
            return list(self.ids)

        def getJobInfo(self, jid):
            return Info(status)

        def cancelJobGroup(self, group):
            self.cancelled.append(group)

    job = object.__new__(rt.JobThread)
    job.sc, job.group, job.done, job.cancelled = Sc(), "tfos-x-start-1", threading.Event(), False
    job.cancel()
    job.sc.ids = [7]  # the job thread submits its job now
    deadline = time.monotonic() + 5.0
    while len(job.sc.cancelled) < cancels and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.6)  # a few polls of the re-cancel thread
    job.done.set()
    assert job.sc.cancelled == ["tfos-x-start-1"] * cancels
