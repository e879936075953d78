"""The cluster controller (tfos._driver.lifecycle) over fake backends: its states and
transitions, the restart loop and its policy, feed resume, inference ledger, SIGTERM and
exit handling. No Spark, no node processes (tests/unit/fake_backends.py)."""

from __future__ import annotations

import logging
import threading

import pytest

from fake_backends import FakeLauncher, default_sigterm, plan  # noqa: F401 - default_sigterm: autouse
from tfos._common.deadline import Deadline
from tfos._driver import open_clusters
from tfos._driver.backend import InferenceCall, TrainCall
from tfos._driver.cluster import TFCluster
from tfos._driver.lifecycle import TRANSITIONS, Controller, Lifecycle
from tfos.cluster_template import InputMode
from tfos.errors import ClusterFailedError, ConfigurationError, RecoveryFailedError, TFOSError

L = Lifecycle


def _controller(max_restarts: int = 1, input_mode: InputMode = InputMode.SPARK, **script) -> tuple[Controller, FakeLauncher]:
    launcher = FakeLauncher(plan(input_mode), **script)
    return Controller(launcher, max_restarts), launcher


def _path(ctl: Controller) -> list[str]:
    return [L.FORMING.value] + [new.value for _old, new in ctl.transitions]


def _train(ctl: Controller, parts: int = 4, epochs: int = 3) -> None:
    ctl.train(TrainCall(list(range(parts)), parts, epochs, 600.0, "input"))


def test_one_enum_with_a_transition_table_that_ends_in_closed_or_failed():
    assert [s.value for s in Lifecycle] == ["forming", "running", "restarting", "shutting down", "closed", "failed"]
    assert set(TRANSITIONS) == set(Lifecycle)
    assert {s for s in Lifecycle if not TRANSITIONS[s]} == {L.CLOSED, L.FAILED} == {s for s in Lifecycle if s.terminal}
    for state, nexts in TRANSITIONS.items():  # every state that is not terminal can end
        assert not nexts or (nexts & {L.CLOSED, L.FAILED})


def test_forming_running_restarting_running_shutting_down_closed(caplog):
    """A node fails during train() on attempt 0: the controller restarts the cluster, the
    feed resumes where the nodes' acknowledgements and checkpoint say, and shutdown()
    closes attempt 1. Each transition is logged once, with its state in the record."""
    caplog.set_level(logging.INFO, logger="tfos._driver")
    ctl, launcher = _controller(fail={(0, "feed"): "ValueError"}, consume={0: 6}, checkpoints={0: {"worker:0": 1, "worker:1": 1}})
    ctl.start()
    assert ctl.state is L.RUNNING and ctl.attempt == 0 and ctl.cluster_id == "tfos-fake"
    _train(ctl)  # 4 partitions x 3 epochs; 6 job partitions acknowledged, checkpoint after epoch 1
    assert ctl.state is L.RUNNING and ctl.attempt == 1 and ctl.cluster_id == "tfos-fake-r1"
    ctl.shutdown(Deadline(60.0, "shutdown"), 0.0)
    assert _path(ctl) == ["forming", "running", "restarting", "running", "shutting down", "closed"]
    # what each attempt was asked, in order
    assert [c for c in launcher.calls if c[1] != "teardown"] == [
        (0, "launch", 1), (0, "clear_checkpoints", None), (0, "feed", 0), (-1, "await_executors", None), (1, "launch", 0),
        (1, "feed", 1), (1, "await_workers", True), (1, "stop", None),
    ]
    assert ("0", "teardown", "abort") not in launcher.calls and (0, "teardown", "abort") in launcher.calls
    states = [r.tfos_state for r in caplog.records if hasattr(r, "tfos_state")]
    assert states == ["forming", "running", "restarting", "running", "shutting down", "closed"]
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "attempt 0 failed during train(): worker:1 (executor 1, host 127.0.0.1): [exception] ValueError" in text
    assert "starting attempt 1 (restart 1 of 1)" in text
    assert "train(): attempt 1 resumes the feed at epoch 1 of 3" in text and "checkpoint reported after 1 epoch(s)" in text
    assert "remote traceback of worker:1" in text
    assert ctl not in open_clusters.OPEN.snapshot()  # closed: no longer open


def test_without_restarts_a_failure_is_raised_and_the_cluster_is_failed():
    ctl, launcher = _controller(max_restarts=0, fail={(0, "feed"): "ValueError"})
    ctl.start()
    with pytest.raises(ClusterFailedError) as info:
        _train(ctl)
    assert not isinstance(info.value, RecoveryFailedError)
    assert _path(ctl) == ["forming", "running", "failed"]
    with pytest.raises(TFOSError, match=r"train\(\): the cluster tfos-fake was already shut down"):
        _train(ctl)
    ctl.shutdown(Deadline(5.0, "shutdown"), 0.0)  # the failure was raised already: returns
    assert [c[1] for c in launcher.calls].count("launch") == 1


def test_the_budget_spent_raises_every_attempts_causes():
    ctl, launcher = _controller(max_restarts=1, input_mode=InputMode.TENSORFLOW,
                                fail={(0, "await_workers"): "OSError", (1, "await_workers"): "KeyError"})
    ctl.start()
    with pytest.raises(RecoveryFailedError) as info:
        ctl.shutdown(Deadline(60.0, "shutdown"), 0.0)
    assert "the restart budget is spent (max_restarts=1)" in str(info.value)
    assert _path(ctl) == ["forming", "running", "shutting down", "restarting", "running", "shutting down", "failed"]
    assert [c for c in launcher.calls if c[1] == "await_workers"] == [(0, "await_workers", False), (1, "await_workers", False)]


def test_a_failure_while_forming_counts_as_the_attempts_failure():
    ctl, launcher = _controller(max_restarts=2, fail={(0, "launch"): "ValueError", (1, "launch"): "OSError"})
    ctl.start()
    assert _path(ctl) == ["forming", "restarting", "restarting", "running"] and ctl.attempt == 2
    ctl, _ = _controller(max_restarts=0, fail={(0, "launch"): "ValueError"})
    with pytest.raises(ClusterFailedError):
        ctl.start()
    assert _path(ctl) == ["forming", "failed"]


def test_inference_runs_again_only_the_units_no_attempt_kept():
    ctl, launcher = _controller(fail={(0, "infer"): "ValueError"}, held={0: [0, 2]})
    ctl.start()
    out = ctl.inference(InferenceCall(["a", "b", "c", "d"], 4, 600.0, "input"))
    assert [c for c in launcher.calls if c[1] == "infer"] == [(0, "infer", [0, 1, 2, 3]), (1, "infer", [1, 3])]
    # unit i is read from the attempt that holds it
    assert out == [("kept", 0), ("results", 1, (1, 3)), ("kept", 0), ("results", 1, (1, 3))]


def test_a_call_in_another_thread_makes_shutdown_wait():
    ctl, launcher = _controller(max_restarts=0)
    ctl.start()
    release = threading.Event()
    entered = threading.Event()

    def slow_feed() -> None:
        with ctl.feeds.running():
            entered.set()
            release.wait(10)

    t = threading.Thread(target=slow_feed)
    t.start()
    entered.wait(10)
    threading.Timer(0.3, release.set).start()
    ctl.shutdown(Deadline(30.0, "shutdown"), 0.0)
    t.join(10)
    assert _path(ctl)[-1] == "closed"


def test_the_program_raising_closes_the_cluster():
    ctl, launcher = _controller(max_restarts=0)
    ctl.start()
    ctl.abort("the driver program raised KeyError inside `with TFCluster.run(...)`")
    assert _path(ctl) == ["forming", "running", "closed"] and (0, "teardown", "abort") in launcher.calls
    ctl.abort("again")  # a no-op once closed
    assert _path(ctl) == ["forming", "running", "closed"]


def test_ctrl_c_during_a_call_tears_down_and_closes():
    ctl, launcher = _controller(max_restarts=1)
    ctl.start()

    def interrupted(backend):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        ctl.call("train()", interrupted)
    assert _path(ctl) == ["forming", "running", "closed"] and (0, "teardown", "abort") in launcher.calls


def test_tfcluster_over_a_controller_checks_arguments_before_asking_it():
    ctl, launcher = _controller(max_restarts=0)
    ctl.start()
    cluster = TFCluster(ctl)
    assert (cluster.sc, cluster.spark, cluster.queues, cluster.attempt, cluster.state) == (None, None, ["input", "output"], 0, L.RUNNING)
    with pytest.raises(ConfigurationError, match=r"got 0 \(TFoS fed 10 epochs for 0: pass num_epochs=10 to keep that\)$"):
        cluster.train([1], num_epochs=0)
    with pytest.raises(ConfigurationError, match="qname 'nope' is not one of the cluster's queues"):
        cluster.train([1], qname="nope")
    with pytest.raises(ConfigurationError, match="feed_timeout must be a finite number of seconds > 0"):
        cluster.inference([1], feed_timeout=0)
    with pytest.raises(ConfigurationError, match=r"streams cannot be fed under Spark Connect"):
        cluster._classic("stop_address()")
    assert cluster.tensorboard_url() is None  # TensorBoard off: the backend is not asked
    cluster.train([1, 2], num_epochs=2)
    assert [c for c in launcher.calls if c[1] == "feed"] == [(0, "feed", 0)]
    cluster.shutdown()
    assert cluster.state is L.CLOSED


def test_interpreter_exit_tears_down_what_is_still_open():
    ctl, launcher = _controller(max_restarts=0)
    ctl.start()
    open_clusters._teardown_at_exit()
    assert _path(ctl) == ["forming", "running", "closed"] and (0, "teardown", "abort") in launcher.calls
    assert not open_clusters.any_open()
