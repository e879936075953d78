"""An InputMode.SPARK start task keeps its executor slot only until its node registered (no
fixed start-up hold), and fails when the supervisor dies first (issue 10)."""

from __future__ import annotations

import subprocess
import sys
import threading

from tfos._common import wire as _wire
from tfos._control.host import ClusterHost
from tfos._control.server import ControlServer
from tfos._node.launch import ClusterConfig
from tfos._node.start_task import _await_registration
from tfos.cluster_template import InputMode, NodeInfo, build_template, roles_from_template

def _handle(host, body: dict, peer: str = "127.0.0.1:1") -> dict:
    """One request answered in this thread (a long-poll waited for here)."""
    return host.resolve(host.prepare(body, peer).run())



def _setup():
    roles = roles_from_template(build_template(2, 0))
    state = ClusterHost("tfos-unit-hold", roles, 15.0)
    key = _wire.new_key()
    server = ControlServer(key, state, host="127.0.0.1")
    cfg = ClusterConfig(cluster_id="tfos-unit-hold", key=key, driver_host="127.0.0.1", driver_port=server.port,
                        input_mode=InputMode.SPARK, roles=tuple(roles), reservation_timeout_s=60.0)
    return state, server, cfg


def test_start_task_returns_once_its_node_registered():
    state, server, cfg = _setup()
    sup = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        done = threading.Event()
        result: list = []

        def _task() -> None:
            result.append(_await_registration(cfg, 1, sup))
            done.set()

        threading.Thread(target=_task, daemon=True).start()
        assert not done.wait(1.0)  # still pending: the slot is held while the node starts
        _handle(state, {"type": "register", "cluster": "tfos-unit-hold",
                      "node": NodeInfo(1, "worker", 1, "127.0.0.1", 2001, 3001, 42, "h/1").to_dict()}, "p")
        assert done.wait(30.0)  # the other node (executor 0) has not registered: no need to wait for it
        assert result == [None]
    finally:
        sup.kill()
        sup.wait()
        server.close()


def test_start_task_fails_when_the_supervisor_dies_first():
    state, server, cfg = _setup()
    sup = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    try:
        assert _await_registration(cfg, 0, sup) == 3
    finally:
        server.close()
