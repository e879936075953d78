"""The supervisor-side reader of a TF process's output (tfos._node.output.NodeOutput),
with a real child process that dies at once (no Spark, no TensorFlow)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tfos._node.output import NodeOutput
from tfos._node.start_task import LOG_FD_ENV

CHILD = textwrap.dedent("""
    import logging, os, sys
    from tfos._node.start_task import setup_process_logging
    setup_process_logging()
    logging.getLogger("tfos.tf_process").warning("a tfos log line: executor log only")
    print("stdout line 1")
    print("stderr line 2", file=sys.stderr)
    os.write(2, b"I0000 00:00:1796080592.555864    7250 cpu_feature_guard.cc:210] noise\\n")
    os.write(1, b"last words, no newline")
    os.abort()
""")


class _Client:
    def __init__(self):
        self.lines: list = []

    def request(self, mtype, **fields):
        assert mtype == "log" and fields["executor_id"] == 3
        self.lines += fields["lines"]
        return {"ok": True}


def test_the_last_lines_of_a_process_that_aborts_reach_the_driver(tmp_path):
    """The child prints, then os.abort()s: every line it wrote reaches the driver (the
    partial last one too), TensorFlow's C++ INFO noise does not, and its tfos log lines go
    to the log descriptor only (the executor log), not to the driver."""
    client = _Client()
    log_path = tmp_path / "executor.log"
    out = NodeOutput(client, 3, tee=False, tf_min_level=1)
    with open(log_path, "wb") as executor_log:
        os.dup2(executor_log.fileno(), out.log_fd)  # stands for the executor log
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=out.child_stdout, stderr=out.child_stderr,
                            pass_fds=(out.log_fd,), env=dict(os.environ, **{LOG_FD_ENV: str(out.log_fd)}))
    out.start()
    assert proc.wait(60) == -6  # SIGABRT
    out.close()
    assert sorted(client.lines) == sorted(["stdout line 1", "stderr line 2", "last words, no newline"]), client.lines
    assert "a tfos log line: executor log only" in log_path.read_text()
    out.close()  # idempotent


def test_close_without_start_releases_the_descriptors():
    """The TF process could not be started: close() still closes the pipes and the log copy."""
    out = NodeOutput(None, 0)
    fds = [out.child_stdout, out.child_stderr, out.log_fd]
    out.close()
    for fd in fds:
        try:
            os.fstat(fd)
        except OSError:
            continue
        raise AssertionError(f"descriptor {fd} is still open")


@pytest.mark.parametrize("local_master, on_driver, tee", [(False, False, True), (True, False, False), (False, True, False)])
def test_forwarded_lines_are_not_also_copied_to_the_drivers_terminal(local_master, on_driver, tee):
    """A forwarded node's lines are copied to its own stdout/stderr (the executor log)
    except where that is the driver's terminal: under local[N], and for a ps node the
    driver started on its host (driver_ps_nodes=True); there they showed twice."""
    from tfos._node import supervisor
    from tfos._node.launch import ClusterConfig, NodeLaunch
    from tfos.cluster_template import InputMode, build_template, roles_from_template

    roles = tuple(roles_from_template(build_template(2, num_ps=1)))
    cfg = ClusterConfig(cluster_id="tfos-out", key=b"k" * 32, driver_host="127.0.0.1", driver_port=1,
                        input_mode=InputMode.TENSORFLOW, roles=roles, forward_logs="all", local_master=local_master)
    launch = NodeLaunch(config=cfg, role=roles[0], host="127.0.0.1", executor_key="h/1", watch_pid=0, watch_stdin=False,
                        working_dir="/tmp", python_path=(), fn_payload=b"", on_driver=on_driver)
    out = supervisor.node_output(launch)
    try:
        assert out is not None and out._tee is tee
    finally:
        if out is not None and out._client is not None:
            out._client.close()
