"""The 'serving' node state: ParameterServerStrategy ps/worker nodes that only serve.

A TF2 ParameterServerStrategy 'worker' node is fed nothing and runs no training loop: its
``main_fun`` calls ``ctx.run_server_and_wait()`` until the driver stops the cluster. Such a
node tells the driver it is 'serving', and ``shutdown()`` then waits only for the chief
(it would otherwise wait for the worker forever, while the worker waits for the stop).
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import pytest

from tfos._control.host import ClusterHost
from tfos.cluster_template import NodeInfo, build_template, roles_from_template
from tfos.errors import ControlProtocolError
from tfos.node_context import TFNodeContext

def _handle(host, body: dict, peer: str = "127.0.0.1:1") -> dict:
    """One request answered in this thread (a long-poll waited for here)."""
    return host.resolve(host.prepare(body, peer).run())


CID = "tfos-test-serving"


def _state() -> ClusterHost:
    # ps:0 (executor 0), chief:0 (executor 1), worker:0 (executor 2)
    return ClusterHost(CID, roles_from_template(build_template(3, num_ps=1, master_node="chief")), 15.0)


def _req(st: ClusterHost, mtype: str, **fields) -> dict:
    return _handle(st, dict(fields, type=mtype, cluster=CID), "127.0.0.1:1")


def _register_all(st: ClusterHost) -> None:
    for role in st.core.roles:
        node = NodeInfo(role.executor_id, role.job_name, role.task_index, "10.0.0.1", 2000 + role.executor_id,
                        pid=100 + role.executor_id)
        assert _req(st, "register", node=node.to_dict())["ok"] is True
        assert _req(st, "status", executor_id=role.executor_id, state="running") == {"ok": True}


def test_serving_worker_counts_as_done_for_shutdown_but_chief_is_waited_for():
    st = _state()
    _register_all(st)
    feedable = [r.executor_id for r in st.core.roles if r.feedable]
    assert feedable == [1, 2]  # chief and the PSS worker: what shutdown() waits for
    assert _req(st, "status", executor_id=2, state="serving") == {"ok": True}
    assert st.core.proc_state[2] == "serving"
    assert st.core.is_done(2) is True
    assert st.core.is_done(1) is False  # the chief's main_fun still runs
    assert not all(st.core.is_done(e) for e in feedable)
    _req(st, "status", executor_id=1, state="finished")
    assert all(st.core.is_done(e) for e in feedable)
    assert not st.core.failed


def test_serving_node_finishes_after_stop_without_failure():
    st = _state()
    _register_all(st)
    _req(st, "status", executor_id=2, state="serving")
    _req(st, "status", executor_id=1, state="finished")
    st.request_stop()
    # The stop ends run_server_and_wait(): main_fun returns, the process exits 0.
    _req(st, "status", executor_id=2, state="finished")
    _req(st, "status", executor_id=2, state="exited", code=0)
    assert st.core.proc_state[2] == "finished" and st.core.exit_codes[2] == 0
    assert not st.core.failed


def test_serving_node_dying_before_stop_is_a_failure():
    st = _state()
    _register_all(st)
    _req(st, "status", executor_id=2, state="serving")
    _req(st, "status", executor_id=2, state="exited", code=-9)
    assert st.core.failed
    failure = st.core.failures[0]
    assert (failure.job_name, failure.task_index, failure.kind) == ("worker", 0, "exited")
    assert "killed by SIGKILL" in failure.message


def test_serving_does_not_override_a_failure():
    st = _state()
    _register_all(st)
    st.record_failure(st.core.make_failure(2, "exception", "ValueError", "boom"))
    _req(st, "status", executor_id=2, state="serving")
    assert st.core.proc_state[2] == "failed"


def test_unknown_state_is_still_rejected():
    st = _state()
    _register_all(st)
    with pytest.raises(ControlProtocolError, match="unknown node state 'servin'"):
        _req(st, "status", executor_id=2, state="servin")


def test_node_context_carries_the_on_serving_callback():
    calls = []
    ctx = TFNodeContext(job_name="worker", cluster_spec={"ps": ["h:1"], "chief": ["h:2"], "worker": ["h:3"]},
                        on_serving=lambda: calls.append(1))
    ctx.on_serving()
    assert calls == [1]
    assert TFNodeContext().on_serving is None


# ---------------------------------------------------------------------------- with TF


@dataclass
class _Ctx:
    job_name: str
    task_index: int
    cluster_spec: dict
    executor_id: int = 0
    num_workers: int = 1
    on_serving: Optional[Callable[[], None]] = None
    stop_event: threading.Event = field(default_factory=threading.Event)


def test_run_server_and_wait_reports_serving_once_the_server_listens():
    pytest.importorskip("tensorflow")
    from tfos.tf_server import run_server_and_wait

    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    seen = []

    def on_serving() -> None:
        with socket.socket() as probe:
            probe.settimeout(2.0)
            seen.append(probe.connect_ex(("127.0.0.1", port)) == 0)  # already listening?

    ctx = _Ctx("worker", 0, {"worker": [f"localhost:{port}"]}, on_serving=on_serving)
    threading.Timer(0.3, ctx.stop_event.set).start()
    start = time.monotonic()
    assert run_server_and_wait(ctx, timeout_s=30, poll_interval_s=0.05) is True
    assert time.monotonic() - start < 20
    assert seen == [True]


def test_a_fed_node_that_would_only_serve_fails_at_once():
    """InputMode.SPARK with ParameterServerStrategy: a fed worker (ctx.mgr set) calling
    run_server_and_wait() would never read its feed, and train() waited feed_timeout
    (600 s by default) for it. It raises at once, naming the node and what to do."""
    from tfos.errors import ConfigurationError
    from tfos.tf_server import run_server_and_wait

    ctx = _Ctx("worker", 1, {"worker": ["localhost:1", "localhost:2"]})
    ctx.mgr = object()  # the node's FeedHub
    with pytest.raises(ConfigurationError) as info:
        run_server_and_wait(ctx, timeout_s=30)
    assert str(info.value).startswith("run_server_and_wait() on worker:1: this node is fed by InputMode.SPARK")
    assert "chief and ps tasks" in str(info.value) and "docs/parameter_servers.md" in str(info.value)
