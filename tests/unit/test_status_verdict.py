"""The driver's reading of the nodes' figures: windows, verdicts, stalls, summary, scalars
(pure and with a fake cluster state; no Spark, no TF)."""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest

from tfos._control.messages import NodeState
from tfos._driver import status as st
from tfos._driver.monitor import StatusMonitor, check_stall_args, summary_text
from tfos._data.figures import NodeFigures, live_snapshot
from tfos.cluster_template import NodeRole
from tfos.errors import ConfigurationError


def samples(n=16, every_ms=1000, rows_per_s=0, wait_share=0.0, queue=0, cap=4, cpu_share=0.5, steps_per_s=None,
            waiting_since=None):
    """``n`` samples one ``every_ms`` apart of a node taking ``rows_per_s`` rows a second."""
    out = []
    for i in range(n):
        t = 100_000 + i * every_ms
        s = {"clock_ms": t, "rows": int(rows_per_s * i * every_ms / 1000), "feed_wait_ms": int(wait_share * i * every_ms),
             "cpu_ms": int(cpu_share * i * every_ms), "queue_chunks": queue, "queue_capacity": cap}
        if steps_per_s is not None:
            s["keras_steps"] = int(steps_per_s * i * every_ms / 1000)
        if waiting_since is not None:
            s["feed_wait_since_ms"] = waiting_since
        out.append(s)
    return out


def test_window_rates_and_shares_come_from_the_nodes_own_clock():
    w = st.window_of(samples(rows_per_s=200, wait_share=0.75, queue=0, cpu_share=0.25, steps_per_s=5))
    assert w.span_s == st.WINDOW_S
    assert w.rows_per_s == pytest.approx(200, rel=0.01)
    assert w.feed_wait_share == pytest.approx(0.75, abs=0.01)
    assert w.queue_empty_share == 1.0 and w.queue_fill == 0.0
    assert w.cpu_share == pytest.approx(0.25, abs=0.01)
    assert w.steps_per_s == pytest.approx(5, rel=0.01) and w.steps == 75


def test_a_wait_that_never_ends_counts_while_it_lasts():
    # main_fun entered next_batch at clock 100 s and never came back: feed_wait_ms stays 0
    w = st.window_of(samples(wait_share=0.0, waiting_since=100_000))
    assert w.feed_wait_share == 1.0
    assert w.waiting_s == 15.0  # since clock 100 s, last sample at 115 s


def test_too_short_a_window_says_nothing():
    assert st.window_of(samples(n=3)) is None
    assert st.window_of(samples(n=1)) is None


@pytest.mark.parametrize("kw,expected", [
    (dict(rows_per_s=100, wait_share=0.9, queue=0), st.Verdict.PRODUCER),
    (dict(rows_per_s=100, wait_share=0.9, queue=3), st.Verdict.FEED),
    (dict(rows_per_s=100, wait_share=0.05, queue=4), st.Verdict.COMPUTE),
    (dict(rows_per_s=100, wait_share=0.3, queue=2), st.Verdict.NONE),
    (dict(rows_per_s=100, wait_share=0.05, queue=0), st.Verdict.NONE),  # rows arrive just in time
])
def test_node_class(kw, expected):
    assert st.node_class(st.window_of(samples(**kw))) is expected


def test_verdict_names_the_nodes_it_blames():
    slow = st.window_of(samples(rows_per_s=100, wait_share=0.95, queue=0))
    busy = st.window_of(samples(rows_per_s=100, wait_share=0.02, queue=4))
    kind, nodes, text = st.judge({"chief:0": slow, "worker:0": slow})
    assert kind is st.Verdict.PRODUCER and nodes == ["chief:0", "worker:0"]
    assert "95%" in text and "Spark tasks produce rows" in text
    kind, nodes, _ = st.judge({"chief:0": busy, "worker:0": busy})
    assert kind is st.Verdict.COMPUTE and nodes == ["chief:0", "worker:0"]
    # synchronous training: one node starved, the other waits for it with a full queue
    kind, nodes, _ = st.judge({"chief:0": busy, "worker:0": slow})
    assert kind is st.Verdict.PRODUCER and nodes == ["worker:0"]


def test_skew_names_the_node_far_behind():
    fast = st.window_of(samples(rows_per_s=1000, wait_share=0.02, queue=4))
    behind = st.window_of(samples(rows_per_s=100, wait_share=0.9, queue=0))
    kind, nodes, text = st.judge({"chief:0": fast, "worker:0": fast, "worker:1": behind})
    assert kind is st.Verdict.SKEW and nodes == ["worker:1"]
    assert "100 rows/s" in text and "1,000 rows/s" in text


def test_a_node_neither_taking_nor_awaiting_rows_while_others_wait_is_far_behind():
    starved = st.window_of(samples(rows_per_s=0, wait_share=1.0, queue=0))
    stuck = st.window_of([dict(s, rows=300) for s in samples(rows_per_s=0, wait_share=0.0, cpu_share=0.0)])
    kind, nodes, text = st.judge({"chief:0": starved, "worker:0": stuck})
    assert kind is st.Verdict.SKEW and nodes == ["worker:0"] and "while chief:0 waited for rows" in text
    # nobody waits: the idle node is left out
    busy = st.window_of(samples(rows_per_s=100, wait_share=0.02, queue=4))
    assert st.judge({"chief:0": busy, "worker:0": stuck})[:2] == (st.Verdict.COMPUTE, ["chief:0"])


def test_no_verdict_before_enough_evidence():
    """A tiny job's first seconds: no verdict flaps (skew, then producer) before every
    node sent VERDICT_SPAN_S seconds of figures and the rates rest on enough rows."""
    starved = st.window_of(samples(rows_per_s=0, wait_share=1.0, queue=0))
    building = st.window_of(samples(rows_per_s=0, wait_share=0.0, cpu_share=1.0))  # no first row yet: its model
    assert st.judge({"chief:0": starved, "worker:0": building})[0] is st.Verdict.PRODUCER  # not skew: worker:0
    young = st.window_of(samples(n=6, rows_per_s=100, wait_share=0.9, queue=0))  # 5 s of figures
    old = st.window_of(samples(rows_per_s=100, wait_share=0.9, queue=0))
    kind, nodes, text = st.judge({"chief:0": old, "worker:0": young})
    assert (kind, nodes) == (st.Verdict.NONE, []) and text.startswith("too few figures yet: worker:0")
    # 2 rows/s against 0.6 rows/s: 20 and 6 rows in 10 s say nothing of a rate
    few = st.window_of(samples(rows_per_s=2, wait_share=0.02, queue=4))
    fewer = st.window_of(samples(rows_per_s=0.6, wait_share=0.1, queue=4))
    assert st.judge({"chief:0": few, "worker:0": fewer})[0] is st.Verdict.NONE
    many = st.window_of(samples(rows_per_s=20, wait_share=0.02, queue=4))
    behind = st.window_of(samples(rows_per_s=6, wait_share=0.1, queue=4))
    assert st.judge({"chief:0": many, "worker:0": behind})[:2] == (st.Verdict.SKEW, ["worker:0"])


def test_no_feed_no_verdict():
    idle = st.window_of(samples(rows_per_s=0, wait_share=0.0))
    assert st.judge({"chief:0": idle})[0] is st.Verdict.NONE
    assert st.judge({})[0] is st.Verdict.NONE


def test_idle_means_no_cpu_and_not_in_the_feed():
    assert st.idle(samples(cpu_share=0.001))
    assert not st.idle(samples(cpu_share=0.5))
    assert not st.idle(samples(cpu_share=0.0, waiting_since=100_000))  # waiting for rows is not stuck


def test_figures_waits_and_live_snapshot():
    f = NodeFigures()
    f.wait_begin("feed_wait")
    assert f.get("feed_wait_since_ms") > 0
    time.sleep(0.02)
    f.wait_end("feed_wait")
    assert f.get("feed_wait_since_ms") == 0 and 15 <= f.get("feed_wait_ms") < 2000
    f.wait_end("feed_wait")  # no wait open: nothing added
    assert f.get("feed_wait_ms") < 2000

    class Hub:
        rows_taken = 42
        queues = {"input": __import__("queue").Queue(maxsize=4)}

    Hub.queues["input"].put(1)
    snap = live_snapshot(Hub())
    assert snap["rows"] == 42 and snap["queue_chunks"] == 1 and snap["queue_capacity"] == 4
    assert snap["clock_ms"] > 0 and snap["cpu_ms"] >= 0


def test_stall_args_are_checked_once():
    assert check_stall_args(0, "warn") == (0.0, "warn")
    assert check_stall_args(20, "fail") == (20.0, "fail")
    for bad in (-1, float("inf"), float("nan"), "10", True, None):
        with pytest.raises(ConfigurationError, match="stall_timeout"):
            check_stall_args(bad, "warn")
    with pytest.raises(ConfigurationError, match="stall_action"):
        check_stall_args(10, "kill")


class FakeState:
    """What the monitor uses of a ClusterHost (and reads of its core)."""

    cluster_id = "tfos-test"

    def __init__(self, n=2):
        self.roles = [NodeRole(i, "chief" if i == 0 else "worker", 0 if i == 0 else i - 1) for i in range(n)]
        self.proc_state = {r.executor_id: NodeState.RUNNING for r in self.roles}
        self.counters: dict = {}
        self.rss = {0: 100 << 20, 1: 200 << 20}
        self.last_heartbeat = {0: time.monotonic(), 1: time.monotonic()}
        self.hosts = {0: "h0", 1: "h1"}
        self.failures: list = []
        self.stack_asks: list = []

    def node_name(self, eid):
        r = self.roles[eid]
        return f"{r.job_name}:{r.task_index} (executor {eid}, host {self.hosts[eid]})"

    @property
    def core(self) -> "FakeState":
        return self

    def apply(self, msg):
        body = dict(msg.body(), executor_id=msg.executor_id)
        self.stack_asks.append(body)
        assert body["type"] == "node_stack" and body["all_threads"] is True
        return {"stack": f"Threads of the TF process on node {body['executor_id']}:\n  File \"main.py\", line 7, in main_fun\n    blocker.wait()"}

    def resolve(self, reply):
        return reply

    def make_failure(self, eid, kind, error_type, message):
        return (eid, kind, error_type, message)

    def record_failure(self, failure):
        self.failures.append(failure)


def feed(monitor, state, t, figures_by_eid):
    for eid, fig in figures_by_eid.items():
        state.counters[eid] = fig
    monitor.tick(now=t)


def test_monitor_reports_a_stall_once_with_stacks_and_the_waiting_node(caplog):
    state = FakeState()
    mon = StatusMonitor(state, stall_timeout_s=20, stall_action="warn")
    caplog.set_level(logging.WARNING, logger="tfos._driver.monitor")
    # worker:0 (eid 1) took rows until t=10, then blocked outside the feed, no CPU;
    # chief:0 (eid 0) waits in next_batch from t=12 on.
    for i in range(60):
        t = 1000.0 + i
        clock = 500_000 + i * 1000
        rows1 = min(i, 10) * 50
        cpu1 = min(i, 10) * 500 + i  # 1 ms a second after the block
        f1 = {"clock_ms": clock, "rows": rows1, "cpu_ms": cpu1, "queue_chunks": 4, "queue_capacity": 4}
        f0 = {"clock_ms": clock, "rows": min(i, 12) * 50, "cpu_ms": min(i, 12) * 500 + i,
              "queue_chunks": 0, "queue_capacity": 4, "feed_wait_since_ms": 500_000 + 12_000 if i >= 12 else 0}
        feed(mon, state, t, {0: f0, 1: f1})
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    text = warnings[0]
    assert text.startswith("tfos: worker:0 (executor 1, host h1) made no progress for")
    assert "blocker.wait()" in text and "last took a row" in text and "500 rows so far" in text
    assert "Waiting on it: chief:0 (executor 0, host h0): main_fun waiting for rows" in text
    assert [a["executor_id"] for a in state.stack_asks] == [1]
    assert not state.failures
    assert mon.last_stall == text
    # a CPU blip (answering the stack request) is not progress that re-arms the report
    for i in range(60, 100):
        clock = 500_000 + i * 1000
        f1 = {"clock_ms": clock, "rows": 500, "cpu_ms": 5000 + i + (3000 if i == 62 else 0), "queue_chunks": 4, "queue_capacity": 4}
        f0 = {"clock_ms": clock, "rows": 600, "cpu_ms": 6000 + i, "queue_chunks": 0, "queue_capacity": 4, "feed_wait_since_ms": 512_000}
        feed(mon, state, 1000.0 + i, {0: f0, 1: f1})
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    # rows again, then stuck again: a second report
    for i in range(100, 140):
        clock = 500_000 + i * 1000
        f1 = {"clock_ms": clock, "rows": 510, "cpu_ms": 9000 + i, "queue_chunks": 4, "queue_capacity": 4}
        f0 = {"clock_ms": clock, "rows": 600, "cpu_ms": 6000 + i, "queue_chunks": 0, "queue_capacity": 4, "feed_wait_since_ms": 512_000}
        feed(mon, state, 1000.0 + i, {0: f0, 1: f1})
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 2


def test_monitor_fail_action_records_a_stalled_failure():
    state = FakeState()
    mon = StatusMonitor(state, stall_timeout_s=5, stall_action="fail")
    for i in range(20):
        f = {"clock_ms": 1000 * i, "rows": 10, "cpu_ms": 5, "queue_chunks": 4, "queue_capacity": 4}
        feed(mon, state, 100.0 + i, {0: dict(f), 1: dict(f)})
    assert len(state.failures) == 2 or len(state.failures) == 1
    eid, kind, error_type, message = state.failures[0]
    assert kind == "stalled" and error_type == "NodeStalled" and "made no progress" in message


def test_ps_and_finished_nodes_never_stall():
    state = FakeState()
    state.roles[1] = NodeRole(1, "ps", 0)
    state.proc_state[0] = NodeState.FINISHED
    mon = StatusMonitor(state, stall_timeout_s=5)
    for i in range(20):
        f = {"clock_ms": 1000 * i, "rows": 0, "cpu_ms": 0}
        feed(mon, state, 100.0 + i, {0: dict(f), 1: dict(f)})
    assert mon.last_stall == ""


def test_status_summary_and_mark():
    state = FakeState()
    mon = StatusMonitor(state, stall_timeout_s=0)
    for i in range(20):
        f = {"clock_ms": 1000 * i, "rows": 100 * i, "cpu_ms": 900 * i, "feed_wait_ms": 950 * i, "queue_chunks": 0,
             "queue_capacity": 4, "keras_steps": 3 * i}
        feed(mon, state, 100.0 + i, {0: dict(f), 1: dict(f)})
    s = mon.status()
    assert s["verdict"] == "producer" and s["verdict_nodes"] == ["chief:0", "worker:0"]
    n0 = s["nodes"][0]
    assert n0["node"] == "chief:0" and n0["rows"] == 1900 and n0["rows_per_s"] == pytest.approx(100, rel=0.01)
    assert n0["feed_wait_share"] == pytest.approx(0.95, abs=0.01) and n0["steps"] == 57
    assert n0["rss_bytes"] == 100 << 20 and n0["class"] == "producer"
    assert mon.mark() == "producer"
    summary = mon.summary()
    assert summary["verdict"] == "producer" and summary["nodes"][1]["rows"] == 1900
    assert summary["nodes"][1]["rows_per_s"] == pytest.approx(100, rel=0.01)
    line = summary_text(summary)
    assert line.startswith("tfos cluster tfos-test summary: verdict producer") and "worker:0: 1,900 rows" in line


def read_events(run_dir):
    """The scalar values of a run's event files, {tag: [values]} (TFRecord framing read here:
    tensorboard's own readers import TensorFlow, which the unit tier does not)."""
    import glob
    import struct

    from tensorboard.compat.proto import event_pb2

    out: dict = {}
    for path in glob.glob(os.path.join(run_dir, "events.out.tfevents.*")):
        data = open(path, "rb").read()
        pos = 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos:pos + 8])
            ev = event_pb2.Event.FromString(data[pos + 12:pos + 12 + n])
            pos += 12 + n + 4
            for v in ev.summary.value:
                out.setdefault(v.tag, []).append((ev.step, v.simple_value))
    return out


def test_scalars_are_written_as_tensorboard_events(tmp_path):
    pytest.importorskip("tensorboard")
    from tfos._driver.tb_scalars import ScalarWriter, scalar_dir

    assert scalar_dir("logs", "file://", str(tmp_path)) == os.path.join(str(tmp_path), "logs", "tfos")
    assert scalar_dir("hdfs://nn/logs", "hdfs://nn", str(tmp_path)) is None
    state = FakeState()
    mon = StatusMonitor(state, stall_timeout_s=0, scalars=ScalarWriter(str(tmp_path / "tfos")))
    for i in range(12):
        f = {"clock_ms": 1000 * i, "rows": 100 * i, "cpu_ms": 500 * i, "queue_chunks": 2, "queue_capacity": 4, "keras_steps": 2 * i}
        feed(mon, state, 100.0 + i, {0: dict(f), 1: dict(f)})
        mon.scalars._last.clear()  # every tick due
    mon.stop()
    events = read_events(str(tmp_path / "tfos" / "worker_0"))
    assert {"tfos/rows_per_s", "tfos/feed_wait_pct", "tfos/steps_per_s", "tfos/cpu_pct", "tfos/rss_mib", "tfos/queue_fill_pct"} <= set(events)
    assert events["tfos/rows_per_s"][-1][1] == pytest.approx(100, rel=0.01)
    assert events["tfos/steps_per_s"][-1][1] == pytest.approx(2, rel=0.01)
    assert events["tfos/rss_mib"][-1][1] == pytest.approx(200)
    assert events["tfos/queue_fill_pct"][-1][1] == pytest.approx(50)
    assert "tfos/rows_per_s" in read_events(str(tmp_path / "tfos" / "chief_0"))


def test_monitor_thread_starts_and_stops():
    state = FakeState()
    mon = StatusMonitor(state, stall_timeout_s=0, tick_s=0.05).start()
    assert any(t.name == "tfos-test-status" for t in threading.enumerate())
    mon.stop()
    assert not any(t.name == "tfos-test-status" for t in threading.enumerate())


def test_keras_steps_are_counted_per_train_function_call():
    import types

    from tfos._node import keras_steps
    from tfos._data.figures import FIGURES

    class Trainer:
        steps_per_execution = 4
        train_function = None

        def make_train_function(self, force=False):
            if self.train_function is None or force:
                self.train_function = lambda iterator: "logs"
            return self.train_function

    module = types.SimpleNamespace(TensorFlowTrainer=Trainer)
    keras_steps.count_steps(module)
    keras_steps.count_steps(module)  # idempotent: one wrapper
    before = FIGURES.get("keras_steps")
    t = Trainer()
    t.make_train_function()
    t.make_train_function()  # the counted function is kept, not wrapped twice
    assert t.train_function(None) == "logs" and t.train_function(None) == "logs"
    assert FIGURES.get("keras_steps") - before == 8
    keras_steps.count_steps(types.SimpleNamespace())  # no trainer class: nothing done


class CollectiveState(FakeState):
    """chief:0 blocked in a collective (TensorFlow's frame innermost), worker:0 in user code."""

    def apply(self, msg):
        body = dict(msg.body(), executor_id=msg.executor_id)
        self.stack_asks.append(body)
        if body["executor_id"] == 0:
            inner = ('  File "/venv/lib/python3.11/site-packages/tensorflow/python/eager/execute.py", line 53, in quick_execute\n'
                     "    tensors = pywrap_tfe.TFE_Py_Execute(ctx._handle, device_name, op_name,")
        else:
            inner = ('  File "/venv/lib/python3.11/threading.py", line 327, in wait\n    waiter.acquire()')
        return {"stack": f"Threads of the TF process on node {body['executor_id']}:\n"
                         f"main_fun's stack on node:\n  File \"main.py\", line 7, in main_fun\n    model.fit(ds)\n{inner}\n"
                         "Thread other (daemon):\n  File \"/venv/lib/python3.11/site-packages/tensorflow/x.py\", line 1, in f\n    g()"}


def test_a_node_blocked_in_a_collective_waits_for_the_one_stuck_in_its_own_code(caplog):
    state = CollectiveState()
    mon = StatusMonitor(state, stall_timeout_s=10, stall_action="warn")
    caplog.set_level(logging.WARNING, logger="tfos._driver.monitor")
    for i in range(40):  # both stop at once (the same tick): the Keras collective case
        f = {"clock_ms": 1000 * i, "rows": min(i, 5) * 10, "cpu_ms": min(i, 5) * 600, "keras_steps": min(i, 5)}
        feed(mon, state, 100.0 + i, {0: dict(f), 1: dict(f)})
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    text = warnings[0]
    assert text.startswith("tfos: worker:0 (executor 1, host h1) made no progress") and "5 Keras steps" in text
    assert "chief:0 (executor 0, host h0): main_fun blocked inside TensorFlow" in text and "in quick_execute" in text
    assert "made no progress" not in text.split("Waiting on it")[1], text  # chief:0 is not reported as stuck
    assert sorted(a["executor_id"] for a in state.stack_asks) == [0, 1]


def test_innermost_frame_of_main_fun():
    stack = ('main_fun\'s stack:\n  File "m.py", line 3, in main_fun\n    x()\n'
             '  File "/site-packages/tensorflow/python/eager/execute.py", line 53, in quick_execute\n    y\n'
             'Thread t:\n  File "threading.py", line 1, in run\n    z')
    assert st.innermost_of_main(stack).endswith("in quick_execute") and st.in_tensorflow(stack)
    assert not st.in_tensorflow(stack.replace("/tensorflow/", "/mine/")) and not st.in_tensorflow("")
    # MultiWorkerMirroredStrategy's all-reduce waits in multiprocessing.pool and threading:
    # the standard library's frames say where the wait is, TensorFlow's frame who waits
    reduce = ('main_fun\'s stack:\n  File "m.py", line 3, in main_fun\n    model.fit(ds)\n'
              '  File "/v/lib/python3.11/site-packages/tensorflow/python/distribute/cross_device_ops.py", line 1208, '
              'in _all_reduce_per_replica_values\n    outputs_by_device = pool.map(thread_fn, list(range(num_devices)))\n'
              '  File "/py/lib/python3.11/multiprocessing/pool.py", line 367, in map\n    return self._map_async()\n'
              '  File "/py/lib/python3.11/threading.py", line 327, in wait\n    waiter.acquire()')
    assert st.in_tensorflow(reduce) and "cross_device_ops.py" in st.innermost_of_main(reduce)
    callback = reduce.replace('/v/lib/python3.11/site-packages/tensorflow/python/distribute/cross_device_ops.py', '/job/train.py')
    assert not st.in_tensorflow(callback) and st.innermost_of_main(callback).startswith('File "/job/train.py"')


def test_rows_by_epoch_of_the_latest_train_call():
    sample = {"rows_fed/f1/0": 100, "rows_trained/f1/0": 100, "rows_closed/f1/0": 1,
              "rows_fed/f2/0": 60, "rows_trained/f2/0": 58, "rows_closed/f2/0": 1, "rows_fed/f2/1": 20, "rows": 180}
    assert st.epochs_of(sample) == {0: {"fed": 60, "trained": 58, "closed": 1}, 1: {"fed": 20, "trained": None, "closed": 0}}
    assert st.epochs_of({"rows": 3}) == {}


def test_the_progress_line_says_starting_before_the_first_rows(monkeypatch):
    """No `0 rows, 0 rows/s` (nor a verdict) before main_fun took its first rows."""
    import io
    from types import SimpleNamespace

    from tfos._driver.runtime import Progress

    taken = {"n": 0}
    core = SimpleNamespace(rows_consumed=lambda: taken["n"])
    tracker = SimpleNamespace(getJobIdsForGroup=lambda g: [])
    monkeypatch.setattr("sys.stderr", io.StringIO())
    p = Progress(tracker, SimpleNamespace(core=core), "g", 4, 4, 5, "tfos train", verdict=lambda: "skew: worker:0")
    try:
        assert p._bar.postfix == "epoch 1/5, starting"  # the first line drawn
        p._show(0)
        assert p._bar.postfix == "epoch 1/5, starting"
        taken["n"] = 1234
        p._show(0)
        assert p._bar.postfix.startswith("epoch 1/5, 1,234 rows, ") and p._bar.postfix.endswith(" rows/s, skew: worker:0")
    finally:
        p._bar.close()
        p._console.stop()
