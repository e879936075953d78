"""A TensorBoard that fails to start is reported to the driver with its stderr (issue 10)."""

from __future__ import annotations

import threading
import time

import tfos._node.tensorboard as tfp
from tfos._node.launch import ClusterConfig, NodeLaunch
from tfos.cluster_template import InputMode, build_template, roles_from_template


class _FakeClient:
    def __init__(self) -> None:
        self.requests: list[tuple[str, dict]] = []
        self.got = threading.Event()

    def call(self, msg, **kw):  # a typed message, as ControlClient.call takes it
        return self.request(msg.TYPE, **msg.fields(), **kw)

    def request(self, msg_type: str, **fields) -> dict:
        self.requests.append((msg_type, fields))
        self.got.set()
        return {"ok": True}


def test_tensorboard_start_failure_reports_its_stderr(tmp_path, monkeypatch):
    monkeypatch.setattr(tfp, "_TENSORBOARD_MODULE", "tfos_no_such_tensorboard_module")
    roles = tuple(roles_from_template(build_template(1, 0)))
    cfg = ClusterConfig(cluster_id="tfos-t", key=b"k" * 32, driver_host="127.0.0.1", driver_port=1,
                        input_mode=InputMode.TENSORFLOW, roles=roles, tensorboard=True, log_dir=str(tmp_path))
    launch = NodeLaunch(config=cfg, role=roles[0], host="127.0.0.1", executor_key="h/1", watch_pid=0, watch_stdin=False,
                        working_dir=str(tmp_path), python_path=(), fn_payload=b"")
    client = _FakeClient()
    t0 = time.monotonic()
    proc = tfp.start_tensorboard(launch, None, client)  # type: ignore[arg-type]
    assert proc is not None
    assert client.got.wait(60), "no report"
    msg_type, fields = client.requests[0]
    assert msg_type == "tensorboard" and fields["url"] == ""
    assert "exited with 1" in fields["error"]
    assert "No module named tfos_no_such_tensorboard_module" in fields["error"], fields["error"]
    assert time.monotonic() - t0 < tfp._TENSORBOARD_START_S  # not the whole start timeout
