"""Fake backends for unit tests of the cluster controller (no Spark, no node processes).

``FakeLauncher`` follows :class:`tfos._driver.backend.Launcher`; each ``launch`` makes a
``FakeBackend`` (:class:`tfos._driver.backend.Backend`) for that attempt. A script says
where an attempt fails: ``fail={(attempt, method): error_type}`` makes that method of that
attempt raise a ``ClusterFailedError`` (a ``main_fun`` exception of worker:1), after
tearing the fake attempt down, as the real backends do. Every call is recorded in
``launcher.calls`` as ``(attempt, method, detail)``. ``default_sigterm`` is an autouse
fixture for modules that import it.
"""

from __future__ import annotations

import signal
from typing import Any, Optional, Sequence

import pytest

from tfos._common.deadline import Deadline
from tfos._driver import open_clusters
from tfos._driver.backend import AttemptReport, ClusterPlan, InferenceCall, TrainCall
from tfos._node.launch import ClusterConfig, NodeSettings
from tfos.cluster_template import InputMode, NodeInfo, build_template, roles_from_template
from tfos.errors import ClusterFailedError, ConfigurationError, NodeFailure


def plan(input_mode: InputMode = InputMode.SPARK, n: int = 2) -> ClusterPlan:
    template = build_template(n, 0)
    return ClusterPlan("tfos-fake", template, tuple(roles_from_template(template)), input_mode, b"",
                       settings=NodeSettings(queues=("input", "output"), heartbeat_timeout_s=15.0))


class FakeBackend:
    sc = None
    nodes_rdd = None
    server = None

    def __init__(self, launcher: "FakeLauncher", attempt: int):
        self.launcher = launcher
        self.attempt = attempt
        p = launcher.plan
        self.config = ClusterConfig(cluster_id=p.cluster_id(attempt), key=b"k" * 32, driver_host="127.0.0.1", driver_port=1,
                                    input_mode=p.input_mode, roles=p.roles, queues=p.settings.queues)
        self._nodes = [NodeInfo(r.executor_id, r.job_name, r.task_index, "127.0.0.1", 2000 + r.executor_id) for r in p.roles]
        self.closed = False
        self.torn_down = False
        self.feed_closed = False
        self.consumed: set[int] = set()
        self.rows = 0

    def _record(self, method: str, detail: Any = None) -> None:
        self.launcher.calls.append((self.attempt, method, detail))
        error_type = self.launcher.fail.get((self.attempt, method))
        if error_type is not None:
            raise self._failed(method, error_type)

    def _failed(self, context: str, error_type: str) -> ClusterFailedError:
        self.teardown(failed=True)
        r = self.launcher.plan.roles[-1]
        failure = NodeFailure(r.executor_id, r.job_name, r.task_index, "127.0.0.1", "exception", error_type,
                              f"{error_type} on attempt {self.attempt}", 'File "main.py", line 3, in main_fun\n')
        return ClusterFailedError(self.config.cluster_id, [failure], f"{context}()")

    def nodes(self) -> list[NodeInfo]:
        return list(self._nodes)

    def check_open(self, what: str) -> None:
        pass

    def clear_checkpoints(self) -> None:
        self.launcher.calls.append((self.attempt, "clear_checkpoints", None))

    def feed(self, call: TrainCall, first_epoch: int, report_done: bool) -> list[tuple[int, str]]:
        parts = call.parts * (call.num_epochs - first_epoch)
        done = self.launcher.consume.get(self.attempt)
        if done is not None:  # the nodes acknowledge the first `done` job partitions, then the attempt fails
            self.consumed = set(range(done))
            self.rows = 10 * done
        self._record("feed", first_epoch)
        self.rows = 10 * parts
        return [(i, "ok") for i in range(parts)]

    def returned_without_terminate(self, executor_ids: Sequence[int], qname: str, wait_s: float) -> list[str]:
        return []

    def infer(self, call: InferenceCall, todo: Sequence[int]) -> Any:
        self._record("infer", list(todo))
        return ("results", self.attempt, tuple(todo))

    def held_results(self, todo: Sequence[int]) -> tuple[Any, set[int]]:
        held = set(self.launcher.held.get(self.attempt, ())) & set(todo)
        return (("kept", self.attempt), held) if held else (None, set())

    def await_workers(self, deadline: Deadline, end_feed: bool) -> None:
        if end_feed:
            self.feed_closed = True
        self._record("await_workers", end_feed)

    def wait_for_failure(self, timeout_s: float) -> bool:
        return False

    def row_accounting(self) -> list:
        return []

    def rows_skipped(self, nodes: Sequence[str]) -> None:
        pass

    def node_states(self) -> dict[int, str]:
        return {n.executor_id: "finished" for n in self._nodes}

    def stop(self) -> None:
        self._record("stop")
        self.teardown(failed=False)

    def teardown(self, failed: bool, reason: str = "") -> None:
        if not self.closed:
            self.launcher.calls.append((self.attempt, "teardown", "abort" if failed else "stop"))
        self.closed = self.torn_down = True

    def join_teardown(self) -> None:
        pass

    def fail(self, context: str) -> ClusterFailedError:
        return self._failed(context, "ValueError")

    def report(self) -> AttemptReport:
        return AttemptReport(self.rows, dict(self.launcher.checkpoints.get(self.attempt, {})), frozenset(self.consumed))

    def tensorboard_url(self, timeout_s: float) -> Optional[str]:
        self._record("tensorboard_url")
        return "http://127.0.0.1:6006/"


class FakeLauncher:
    """Starts FakeBackends.

    Args:
        plan: The cluster plan.
        fail: ``{(attempt, method): error_type}``: that call fails (``'launch'``: forming).
        consume: ``{attempt: n}``: a failing feed of that attempt had its first n job
            partitions acknowledged.
        checkpoints: ``{attempt: {'job:index': epochs}}`` reported by that attempt.
        held: ``{attempt: [units]}``: inference results a failed attempt kept.
    """

    sc = None
    spark = None
    working_dir: Optional[str] = None
    streams = False

    def __init__(self, plan: ClusterPlan, fail: Optional[dict] = None, consume: Optional[dict] = None,
                 checkpoints: Optional[dict] = None, held: Optional[dict] = None):
        self.plan = plan
        self.fail = dict(fail or {})
        self.consume = dict(consume or {})
        self.checkpoints = dict(checkpoints or {})
        self.held = dict(held or {})
        self.calls: list[tuple[int, str, Any]] = []
        self.backends: list[FakeBackend] = []

    def launch(self, attempt: int, restarts_left: int, outer: Optional[Deadline]) -> FakeBackend:
        self.calls.append((attempt, "launch", restarts_left))
        backend = FakeBackend(self, attempt)
        if (attempt, "launch") in self.fail:
            raise backend._failed("run", self.fail[(attempt, "launch")])
        self.backends.append(backend)
        return backend

    def await_executors(self, outer: Optional[Deadline]) -> None:
        self.calls.append((-1, "await_executors", None))

    def train_input(self, data: Any, num_epochs: int, end_of_feed: bool, count: bool) -> tuple[Any, int]:
        if not isinstance(data, list):
            raise ConfigurationError(f"the fake backend feeds lists of partitions, got {type(data).__name__}")
        return data, len(data)

    def inference_input(self, data: Any, schema: Any) -> tuple[Any, int, Any]:
        return data, len(data), schema

    def assemble(self, sources: Sequence[Any], owner: Sequence[int]) -> Any:
        return [sources[o] for o in owner]


@pytest.fixture(autouse=True)
def default_sigterm():
    """Every test starts and ends with SIGTERM's default disposition and no open cluster."""
    old = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    open_clusters.OPEN.sigterm_installed = False
    yield
    for c in open_clusters.OPEN.snapshot():
        open_clusters.OPEN.discard(c)
    signal.signal(signal.SIGTERM, old)
    open_clusters.OPEN.sigterm_installed = False
