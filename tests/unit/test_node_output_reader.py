"""The supervisor-side reader of a TF process's output (tfos._node.output.NodeOutput),
with a real child process that dies at once (no Spark, no TensorFlow)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from tfos._node.output import NodeOutput
from tfos._node.start_task import LOG_FD_ENV

CHILD = textwrap.dedent("""
    import logging, os, sys
    from tfos._node.start_task import setup_process_logging
    setup_process_logging()
    logging.getLogger("tfos._node.tf_process").warning("a tfos log line: executor log only")
    print("stdout line 1")
    print("stderr line 2", file=sys.stderr)
    os.write(2, b"I0000 00:00:1796080592.555864    7250 cpu_feature_guard.cc:210] noise\\n")
    os.write(1, b"last words, no newline")
    os.abort()
""")


class _Client:
    def __init__(self):
        self.lines: list = []

    def call(self, msg, **kw):  # a typed message, as ControlClient.call takes it
        return self.request(msg.TYPE, **msg.fields(), **kw)

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


def _run_marked_child(code: str, client, unbuffered: str = "1") -> NodeOutput:
    """Runs ``code`` as a forwarded TF process would run (its descriptors 1 and 2 the pipes
    of a NodeOutput for executor 3, with its marker token), until it exits with 0."""
    out = NodeOutput(client, 3, tee=False)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=out.child_stdout, stderr=out.child_stderr,
                            env=dict(os.environ, PYTHONUNBUFFERED=unbuffered, TFOS_OUTPUT_MARK=out.mark))
    out.start()
    assert proc.wait(60) == 0
    return out


FAILING_CHILD = textwrap.dedent("""
    import os, sys, time
    from tfos._node.output import OUTPUT_MARK_ENV, write_failure_marks
    token = os.environ.pop(OUTPUT_MARK_ENV)
    print("stdout 1")
    sys.stdout.write("stdout partial")  # still in Python's buffer: write_failure_marks flushes it
    print("stderr 1", file=sys.stderr)
    print("\\x1etfos-failure 0000 {\\"forged\\": 1}", file=sys.stderr)  # another token: a plain line
    assert write_failure_marks(token, {"executor_id": 3, "job_name": "worker", "task_index": 0, "kind": "exception", "error_type": "E", "message": "boom \\u00e9"})
    time.sleep(0.3)  # lines written after the markers may be sent with those before them
    print("after the failure")
    time.sleep(0.5)
""")


class _OrderClient:
    def __init__(self):
        self.calls: list = []

    def call(self, msg, **kw):  # a typed message, as ControlClient.call takes it
        return self.request(msg.TYPE, **msg.fields(), **kw)

    def request(self, mtype, **fields):
        assert fields["executor_id"] == 3
        self.calls.append((mtype, fields.get("lines") or fields.get("failure")))
        return {"ok": True}


def test_a_failure_is_reported_after_the_lines_written_before_it():
    """The TF process hands its failure to the supervisor in line with its output: the
    driver gets every line written before the failure (stdout and stderr, a partial one
    too), then the failure (once, unchanged), then later lines; marker lines are never
    shown, and a marker with another token stays an ordinary line."""
    client = _OrderClient()
    out = NodeOutput(client, 3, tee=False)
    assert len(out.mark) == 16
    proc = subprocess.Popen([sys.executable, "-c", FAILING_CHILD], stdout=out.child_stdout, stderr=out.child_stderr,
                            env=dict(os.environ, PYTHONUNBUFFERED="0", TFOS_OUTPUT_MARK=out.mark))
    out.start()
    assert proc.wait(60) == 0
    out.close()
    out.close()
    statuses = [i for i, (mtype, _) in enumerate(client.calls) if mtype == "status"]
    assert len(statuses) == 1, client.calls
    assert client.calls[statuses[0]][1]["message"] == "boom \u00e9"  # unchanged
    before = [ln for mtype, lines in client.calls[:statuses[0]] if mtype == "log" for ln in lines]
    after = [ln for mtype, lines in client.calls[statuses[0] + 1:] if mtype == "log" for ln in lines]
    assert sorted(before) == sorted(["stdout 1", "stdout partial", "stderr 1", '\x1etfos-failure 0000 {"forged": 1}']), client.calls
    assert after == ["after the failure"], client.calls


FINISHING_CHILD = textwrap.dedent("""
    import os, sys, time
    from tfos._node.output import OUTPUT_MARK_ENV, write_failure_marks, write_finished_marks
    token = os.environ.pop(OUTPUT_MARK_ENV)
    print("last stdout line of main_fun")
    sys.stdout.write("partial")  # still in Python's buffer: write_finished_marks flushes it
    print("last stderr line of main_fun", file=sys.stderr)
    assert write_finished_marks(token, ["input"])
    time.sleep(0.3)  # lines written after the markers may be sent with those before them
    print("serving")
    time.sleep(0.3)
    print("before the failure")
    assert write_failure_marks(token, {"executor_id": 3, "job_name": "worker", "task_index": 0, "kind": "exception", "error_type": "E", "message": "late"})
""")


class _StatusClient:
    def __init__(self):
        self.calls: list = []

    def call(self, msg, **kw):  # a typed message, as ControlClient.call takes it
        return self.request(msg.TYPE, **msg.fields(), **kw)

    def request(self, mtype, **fields):
        assert fields["executor_id"] == 3
        if mtype == "log":
            self.calls.extend(("line", ln) for ln in fields["lines"])
        else:
            self.calls.append((fields["state"], fields.get("terminated") or fields.get("failure")))
        return {"ok": True}


def test_main_funs_return_is_reported_after_its_last_lines():
    """The report that main_fun returned travels in line with the output, like a
    failure: the driver gets main_fun's last lines (a partial one too) first, then one
    'finished' status with the terminated queues; a later failure still follows the
    lines written before it (each marker pairs with its own stdout marker)."""
    client = _StatusClient()
    out = _run_marked_child(FINISHING_CHILD, client, unbuffered="0")
    out.close()
    states = [c for c in client.calls if c[0] != "line"]
    assert [(st, x if st == "finished" else x["message"]) for st, x in states] == [("finished", ["input"]), ("failed", "late")], client.calls
    fin, fail = client.calls.index(states[0]), client.calls.index(states[1])
    assert sorted(ln for _, ln in client.calls[:fin]) == ["last stderr line of main_fun", "last stdout line of main_fun", "partial"]
    assert [ln for _, ln in client.calls[fin + 1:fail]] == ["serving", "before the failure"], client.calls


CHATTY_CHILD = textwrap.dedent("""
    import os, sys, time
    from tfos._node.output import OUTPUT_MARK_ENV, write_failure_marks
    token = os.environ.pop(OUTPUT_MARK_ENV)
    for i in range(200):
        print(f"step {i}")
        time.sleep(0.005)
    assert write_failure_marks(token, {"executor_id": 3, "job_name": "worker", "task_index": 0, "kind": "exception", "error_type": "E", "message": "the driver went away"})
""")


class _DeadDriverClient:
    """A driver that is gone: each request tries to connect for its whole connect timeout
    (the client's default: the heartbeat timeout), then fails as refused."""

    def __init__(self):
        self.calls: list = []
        self.last_connect_error = None

    def call(self, msg, **kw):  # a typed message, as ControlClient.call takes it
        return self.request(msg.TYPE, **msg.fields(), **kw)

    def request(self, mtype, timeout_s=10.0, retry=True, connect_timeout_s=None, **fields):
        self.calls.append((mtype, retry, connect_timeout_s))
        time.sleep(min(connect_timeout_s if connect_timeout_s is not None else 15.0, 15.0) * (2 if retry else 1))
        self.last_connect_error = ConnectionRefusedError(111, "Connection refused")
        raise ConnectionError("no connection to the tfos driver (last error: ConnectionRefusedError(111, 'Connection refused'))")


def test_output_to_a_dead_driver_costs_seconds_not_minutes():
    """The driver was SIGKILLed while a node printed: the supervisor must end within
    heartbeat_timeout + 5 s. Each request of the output sender gives up connecting after
    2 s (not the client's default, twice), and once the supervisor gave up on the driver
    (abandon()) nothing more is sent: close() returns within seconds, the lines stay in
    the executor log."""
    client = _DeadDriverClient()
    out = _run_marked_child(CHATTY_CHILD, client, unbuffered="1")
    time.sleep(1.0)  # the sender is now in the middle of a request to the dead driver
    out.abandon()
    t0 = time.monotonic()
    out.close()
    assert time.monotonic() - t0 < 6.0, client.calls
    assert client.calls and all(c == 2.0 for _, _, c in client.calls), client.calls
    assert all(not retry for mtype, retry, _ in client.calls if mtype == "log"), client.calls


def test_a_refused_connection_ends_the_sending():
    """The executor JVM died with the driver (local-cluster), so the supervisor ends the
    node without deciding the driver is gone, while the TF process reported a failure:
    the first refused connection stops all sending, so close() returns within seconds
    instead of spending every flush deadline on a closed port."""
    client = _DeadDriverClient()
    out = _run_marked_child(CHATTY_CHILD, client, unbuffered="1")
    t0 = time.monotonic()
    out.close()
    assert time.monotonic() - t0 < 5.0, client.calls
    assert len(client.calls) <= 2, client.calls


def test_without_forwarding_there_is_no_marker_token():
    """A node whose lines are not forwarded has no token: its TF process reports its
    failure to the driver itself (write_failure_marks returns False and writes nothing)."""
    from tfos._node.output import write_failure_marks

    out = NodeOutput(None, 0, tf_min_level=1)
    try:
        assert out.mark == ""
        assert write_failure_marks("", {"executor_id": 0}) is False
    finally:
        out.close()


def test_no_marker_is_written_to_a_redirected_stderr(tmp_path):
    """main_fun (or a library) pointed descriptor 2 elsewhere: the failure would not reach
    the supervisor that way, so nothing is written and the caller reports it directly."""
    code = textwrap.dedent(f"""
        import os, sys
        from tfos._node.output import std_fds_identity, write_failure_marks
        ident = std_fds_identity()
        os.dup2(os.open({str(tmp_path / "elsewhere")!r}, os.O_WRONLY | os.O_CREAT), 2)
        sys.exit(0 if write_failure_marks("abc", {{"executor_id": 0}}, ident) is False else 1)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert b"tfos-" not in proc.stdout and (tmp_path / "elsewhere").read_bytes() == b""
