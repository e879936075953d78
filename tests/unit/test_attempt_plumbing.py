"""The attempt number reaches ``main_fun`` as ``ctx.attempt`` (issue 14): node context, launch
record, start task and TF process, each with a default of 0."""

from __future__ import annotations

import io

import pytest

import tfos._node.start_task as node_task
from tfos._common import wire as _wire
from tfos._control.host import ClusterHost
from tfos._control.server import ControlServer
from tfos._node.launch import ClusterConfig, NodeLaunch
from tfos._node.tf_process import run_node
from tfos.cluster_template import InputMode, build_template, roles_from_template
from tfos.errors import ConfigurationError
from tfos.node_context import TFNodeContext


def _config(mode: InputMode = InputMode.TENSORFLOW, n: int = 1, port: int = 1, key: bytes = b"k" * 32) -> ClusterConfig:
    roles = tuple(roles_from_template(build_template(n, 0)))
    return ClusterConfig(cluster_id="tfos-attempt", key=key, driver_host="127.0.0.1", driver_port=port,
                         input_mode=mode, roles=roles, reservation_timeout_s=30.0, forward_logs="none")


def _launch(cfg: ClusterConfig, tmp: str, **kw) -> NodeLaunch:
    return NodeLaunch(config=cfg, role=cfg.roles[0], host="127.0.0.1", executor_key="h/1", watch_pid=0,
                      watch_stdin=False, working_dir=tmp, python_path=(), fn_payload=b"", **kw)


def test_context_attempt_defaults_to_zero_and_is_validated():
    assert TFNodeContext().attempt == 0
    ctx = TFNodeContext(job_name="worker", attempt=2)
    assert ctx.attempt == 2
    assert "attempt 2" in repr(ctx)
    assert "attempt" not in repr(TFNodeContext(job_name="worker"))
    for bad in (-1, True, 1.0, "1"):
        with pytest.raises(ValueError):
            TFNodeContext(attempt=bad)  # type: ignore[arg-type]


def test_launch_record_carries_the_attempt(tmp_path):
    cfg = _config()
    assert _launch(cfg, str(tmp_path)).attempt == 0
    launch = _launch(cfg, str(tmp_path), attempt=3)
    buf = io.BytesIO()
    node_task.write_launch(buf, launch)
    buf.seek(0)
    assert node_task.read_launch(buf).attempt == 3
    with pytest.raises(ConfigurationError):
        _launch(cfg, str(tmp_path), attempt=-1)


class _Proc:
    def wait(self, timeout=None) -> int:
        return 0


@pytest.mark.parametrize("attempt", [None, 0, 4])
def test_start_task_passes_the_attempt_to_the_node(tmp_path, monkeypatch, attempt):
    cfg = _config()
    seen: list[NodeLaunch] = []
    monkeypatch.setattr(node_task, "spawn_supervisor", lambda launch: seen.append(launch) or _Proc())
    kwargs = {} if attempt is None else {"attempt": attempt}
    fn = node_task.make_start_task(cfg, [0], b"payload", **kwargs)
    assert list(fn(0, iter(()))) == [(0, "exited 0")]
    assert [launch.attempt for launch in seen] == [attempt or 0]


def _record_attempt(args, ctx):
    with open(args["out"], "w") as f:
        f.write(f"{ctx.attempt} {ctx.job_name}:{ctx.task_index}")


def test_tf_process_hands_the_attempt_to_main_fun(tmp_path):
    import cloudpickle

    key = _wire.new_key()
    roles = roles_from_template(build_template(1, 0))
    state = ClusterHost("tfos-attempt", roles, 15.0)
    server = ControlServer(key, state, host="127.0.0.1")
    try:
        cfg = _config(port=server.port, key=key)
        out = tmp_path / "attempt.txt"
        payload = cloudpickle.dumps((_record_attempt, {"out": str(out)}))
        launch = NodeLaunch(config=cfg, role=cfg.roles[0], host="127.0.0.1", executor_key="h/1", watch_pid=0,
                            watch_stdin=False, working_dir=str(tmp_path), python_path=(), fn_payload=payload, attempt=2)
        assert run_node(launch) == 0
        assert out.read_text() == "2 worker:0"
    finally:
        server.close()
