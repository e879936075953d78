"""C23: the driver program dies (SIGKILL) or is sent SIGTERM while its nodes train and a
main_fun started a child process. Runs a real driver program in a subprocess
(tests/spark/driver_program.py) with its own local-cluster."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.spark

HEARTBEAT_TIMEOUT_S = 6.0
PROGRAM = Path(__file__).with_name("driver_program.py")


def _marked(mark: str) -> list[tuple[int, str]]:
    """Node processes and main_fun children of the driver program tagged ``mark``, found by
    command line (and the environment they all inherit from the driver)."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info.get("cmdline") or [])
        if not any(s in cmd for s in ("tfos._node.supervisor", "tfos._node.tf_process", "tfos-test-child-of-main-fun")):
            continue
        try:
            if p.environ().get("TFOS_DRIVER_DEATH_MARK") != mark:
                continue
        except psutil.Error:
            continue
        found.append((p.info["pid"], cmd))
    return found


def _start_driver(tmp_path: Path):
    mark = uuid.uuid4().hex
    env = dict(os.environ, TFOS_DRIVER_DEATH_MARK=mark, TFOS_PROGRESS="0")
    err = open(tmp_path / "driver.err", "wb")
    proc = subprocess.Popen([sys.executable, str(PROGRAM), str(tmp_path), str(HEARTBEAT_TIMEOUT_S)],
                            env=env, stdout=subprocess.DEVNULL, stderr=err)
    deadline = time.monotonic() + 600
    while not (tmp_path / "ready").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"driver program did not get ready (exit {proc.poll()}):\n{(tmp_path / 'driver.err').read_text()[-5000:]}")
        time.sleep(0.2)
    time.sleep(1.0)  # the feed is running
    procs = _marked(mark)
    kinds = " ".join(c for _, c in procs)
    assert kinds.count("tfos._node.supervisor") == 2 and kinds.count("tfos._node.tf_process") == 2, procs
    assert kinds.count("tfos-test-child-of-main-fun") == 2, procs
    return proc, mark


def _wait_gone(mark: str, timeout_s: float) -> tuple[float, list]:
    t0 = time.monotonic()
    left = _marked(mark)
    while left and time.monotonic() - t0 < timeout_s:
        time.sleep(0.1)
        left = _marked(mark)
    return time.monotonic() - t0, left


def test_driver_sigkill_leaves_no_node_process_or_child(tmp_path, no_leftovers):
    proc, mark = _start_driver(tmp_path)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    took, left = _wait_gone(mark, HEARTBEAT_TIMEOUT_S + 5.0)
    assert not left, f"left {took:.1f} s after the driver's SIGKILL: {left}"


def test_driver_sigterm_tears_down_like_ctrl_c_and_says_so(tmp_path, no_leftovers):
    proc, mark = _start_driver(tmp_path)
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(120)
    err = (tmp_path / "driver.err").read_text()
    assert code == 128 + signal.SIGTERM, err[-3000:]
    assert "the driver received SIGTERM; tearing down cluster(s) tfos-" in err, err[-3000:]
    assert "as for Ctrl-C, then exiting" in err
    # the teardown ran before the exit: nothing is left at once (no heartbeat_timeout wait)
    took, left = _wait_gone(mark, 3.0)
    assert not left, f"left {took:.1f} s after the driver exited: {left}"
