"""Chaos helpers for Spark tests: kill one node's Spark executor JVM mid-training (issue 14).

The JVM is found from the node's own registration with the driver (``cluster.cluster_info``:
``executor_key`` is ``"<host>/<pid of the executor JVM>"``, worked out by the start task as
the nearest java ancestor of its Python worker) and checked before anything is signalled:
it must be a live ``CoarseGrainedExecutorBackend`` of *this* Spark application, an ancestor
of the node's TF process, and on this machine. It is then killed by that PID only (never
by name), so no other program's process can be hit. Under ``local[N]`` there is no executor
JVM (the driver's JVM hosts the tasks) and the helpers refuse.

Used by the local-cluster chaos test and ``scripts/bench_failures.py``; no pytest needed.
"""

from __future__ import annotations

import signal
import socket
import threading
import time
from typing import Any, Callable, Optional

import psutil

__all__ = ["node_record", "executor_jvm", "ExecutorKiller"]


def node_record(cluster: Any, executor_id: int) -> dict:
    """The registration of node ``executor_id`` (a ``cluster.cluster_info`` entry).

    Raises:
        LookupError: No registered node has that id.
    """
    found = [n for n in cluster.cluster_info if n["executor_id"] == executor_id]
    if not found:
        raise LookupError(f"no registered node with executor id {executor_id}: {cluster.cluster_info}")
    return found[0]


def executor_jvm(cluster: Any, executor_id: int, app_id: Optional[str] = None) -> psutil.Process:
    """The executor JVM hosting node ``executor_id``, checked (see the module docstring).

    Args:
        cluster: A running ``TFCluster``.
        executor_id: The node's executor id.
        app_id: The Spark application id the JVM must belong to (``sc.applicationId``);
            default: the cluster's SparkContext's.

    Raises:
        LookupError: The node is not registered, or runs on another host.
        AssertionError: The PID is not this application's executor JVM hosting the node.
    """
    node = node_record(cluster, executor_id)
    host, _, pid_text = str(node["executor_key"]).rpartition("/")
    if host != socket.gethostname():
        raise LookupError(f"node {executor_id} runs on host {host}, not here ({socket.gethostname()})")
    if not pid_text.isdigit() or int(pid_text) == 0:
        raise AssertionError(f"node {executor_id}'s executor key {node['executor_key']!r} names no executor JVM")
    jvm = psutil.Process(int(pid_text))
    cmd = " ".join(jvm.cmdline())
    app = app_id or cluster.sc.applicationId
    if not jvm.name().startswith("java") or "CoarseGrainedExecutorBackend" not in cmd:
        raise AssertionError(f"pid {jvm.pid} is not a Spark executor JVM: {cmd[:200]}")
    if app not in cmd:
        raise AssertionError(f"pid {jvm.pid} is an executor of another application (not {app})")
    tf_pid = int(node.get("pid") or 0)
    if tf_pid and jvm.pid not in {p.pid for p in psutil.Process(tf_pid).parents()}:
        raise AssertionError(f"pid {jvm.pid} is not an ancestor of node {executor_id}'s TF process {tf_pid}")
    return jvm


class ExecutorKiller:
    """Kills node ``executor_id``'s executor JVM (SIGKILL, by PID) once ``when()`` is true.

    Runs in a daemon thread started by :meth:`start`, polling ``when`` every 0.1 s for at
    most ``timeout_s`` seconds. After the kill, :attr:`pid` is the JVM's PID and
    :attr:`killed_at` the ``time.monotonic()`` of the signal.

    Args:
        cluster: A running ``TFCluster`` (the node must be registered).
        executor_id: The node whose executor to kill.
        when: Condition polled before the kill (e.g. "the node has read N rows").
        timeout_s: Longest wait for ``when``; no kill after it.
    """

    def __init__(self, cluster: Any, executor_id: int, when: Callable[[], bool] = lambda: True, timeout_s: float = 300.0):
        self.jvm = executor_jvm(cluster, executor_id)  # resolved and checked now, while the node runs
        self.pid = 0
        self.killed_at: Optional[float] = None
        self.error: Optional[BaseException] = None
        self._when = when
        self._timeout_s = timeout_s
        self._thread = threading.Thread(target=self._run, name=f"chaos-kill-executor-{executor_id}", daemon=True)

    def start(self) -> "ExecutorKiller":
        self._thread.start()
        return self

    def _run(self) -> None:
        end = time.monotonic() + self._timeout_s
        try:
            while time.monotonic() < end:
                if self._when():
                    self.killed_at = time.monotonic()
                    self.pid = self.jvm.pid
                    self.jvm.send_signal(signal.SIGKILL)  # psutil checks the PID was not reused
                    return
                time.sleep(0.1)
        except BaseException as exc:  # noqa: BLE001 - reported by join()
            self.error = exc

    def join(self, timeout_s: float = 30.0) -> float:
        """Waits for the thread; returns the kill time.

        Raises:
            AssertionError: The JVM was not killed (condition never true, or an error).
        """
        self._thread.join(timeout_s)
        if self.error is not None:
            raise AssertionError(f"the executor kill failed: {self.error!r}") from self.error
        if self.killed_at is None:
            raise AssertionError("the executor JVM was never killed (the condition never held)")
        return self.killed_at
