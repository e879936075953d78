"""The Spark task's world in the TF process, without a Spark cluster (tfos._node.task_world,
tfos._driver.payload): the payload's broadcasts and accumulators, their set-up in a TF
process (SparkFiles, TaskContext, broadcasts from a file and from an in-memory file),
accumulator updates carried as exact JSON and applied once, and the address-space limit:
raised where the hard limit allows, named where it kills a node."""

from __future__ import annotations

import json
import math
import os
import pickle
import subprocess
import sys
import textwrap
import time

import cloudpickle
import pytest

from tfos._driver.payload import AccumulatorInbox, pickle_payload
from tfos._node import task_world as tw
from tfos.errors import ConfigurationError, TFOSError

def _handle(host, body: dict, peer: str = "127.0.0.1:1") -> dict:
    """One request answered in this thread (a long-poll waited for here)."""
    return host.resolve(host.prepare(body, peer).run())


GiB = 2**30


# ------------------------------------------------------------------------ accumulator values
@pytest.mark.parametrize("value", [0, -7, 3**200, True, 0.1, -0.0, 1e308, math.inf, -math.inf, 2.5 + 1e-300j, complex(0.1, -3)])
def test_accumulator_values_round_trip_exactly(value):
    enc = tw.encode_accumulator_value(value)
    back = tw.decode_accumulator_value(json.loads(json.dumps(enc, allow_nan=False)))
    assert type(back) is {bool: int}.get(type(value), type(value))
    assert back == value and repr(back) == repr({bool: int}.get(type(value), type(value))(value))


def test_nan_and_numpy_numbers_are_carried():
    np = pytest.importorskip("numpy")
    assert math.isnan(tw.decode_accumulator_value(tw.encode_accumulator_value(math.nan)))
    assert tw.decode_accumulator_value(tw.encode_accumulator_value(np.int64(2**62))) == 2**62
    assert tw.decode_accumulator_value(tw.encode_accumulator_value(np.float32(0.1))) == float(np.float32(0.1))


@pytest.mark.parametrize("value", ["3", [1, 2], None, b"x"])
def test_other_accumulator_values_are_refused(value):
    with pytest.raises(TypeError, match="is not an int, float or complex number"):
        tw.encode_accumulator_value(value)


@pytest.mark.parametrize("data", [{"kind": "int", "value": 3}, {"kind": "int", "value": "9" * 10001}, {"kind": "float", "value": "x"},
                                  {"kind": "complex", "value": ["0x1p0"]}, {"kind": "pickle", "value": "gASV"}])
def test_malformed_updates_are_refused(data):
    with pytest.raises(ValueError):
        tw.decode_accumulator_value(data)


# --------------------------------------------------------------------------- driver's inbox
def _driver_accumulators(*zeros):
    """Driver-side accumulators, as sc.accumulator makes them (registered by id)."""
    from pyspark.accumulators import (COMPLEX_ACCUMULATOR_PARAM, FLOAT_ACCUMULATOR_PARAM, INT_ACCUMULATOR_PARAM, Accumulator,
                                      _accumulatorRegistry)

    params = {int: INT_ACCUMULATOR_PARAM, float: FLOAT_ACCUMULATOR_PARAM, complex: COMPLEX_ACCUMULATOR_PARAM}
    first = max(_accumulatorRegistry, default=1000) + 1
    return [Accumulator(first + i, z, params[type(z)]) for i, z in enumerate(zeros)]


def test_inbox_applies_each_nodes_last_report_once():
    a, f = _driver_accumulators(5, 0.0)
    inbox = AccumulatorInbox()
    inbox.receive(0, "worker:0", [{"aid": a.aid, **tw.encode_accumulator_value(10)}, {"aid": f.aid, **tw.encode_accumulator_value(0.5)}])
    inbox.receive(0, "worker:0", [{"aid": a.aid, **tw.encode_accumulator_value(10)}, {"aid": f.aid, **tw.encode_accumulator_value(0.5)}])  # a resend
    inbox.receive(1, "worker:1", [{"aid": a.aid, **tw.encode_accumulator_value(2**70)}])
    assert a.value == 5  # nothing before the attempt ends
    assert inbox.apply("c1") == 2
    assert a.value == 5 + 10 + 2**70 and f.value == 0.5
    assert inbox.apply("c1") == 0 and a.value == 5 + 10 + 2**70  # once


def test_inbox_of_a_failed_attempt_is_dropped_with_a_warning(caplog):
    (a,) = _driver_accumulators(0)
    inbox = AccumulatorInbox()
    inbox.receive(2, "worker:1 (executor 2, host h)", [{"aid": a.aid, **tw.encode_accumulator_value(7)}])
    inbox.drop("c2", "the cluster attempt failed")
    assert "the accumulator updates of worker:1 (executor 2, host h) were not added" in caplog.text
    inbox.receive(2, "worker:1 (executor 2, host h)", [{"aid": a.aid, **tw.encode_accumulator_value(7)}])  # late
    assert inbox.apply("c2") == 0 and a.value == 0


@pytest.mark.parametrize("updates", [{"aid": 1}, [{"aid": "1", "kind": "int", "value": "1"}], [{"aid": True, "kind": "int", "value": "1"}], [3]])
def test_inbox_refuses_malformed_reports(updates):
    with pytest.raises(ValueError):
        AccumulatorInbox().receive(0, "worker:0", updates)


def test_control_message_reaches_the_inbox_and_a_dead_node_names_its_address_space_limit():
    """The driver's ClusterHost: an 'accumulators' report goes to the attempt's inbox; a
    ProcessDied exit carries the supervisor's hint (the address-space limit in force)."""
    from tfos._control.host import ClusterHost
    from tfos.cluster_template import build_template, roles_from_template

    (a,) = _driver_accumulators(0)
    inbox = AccumulatorInbox()
    st = ClusterHost("c3", roles_from_template(build_template(1, 0)), 10.0,
                     on_accumulators=lambda u: inbox.receive(u.executor_id, u.node_name, u.updates))
    assert _handle(st, {"cluster": "c3", "type": "accumulators", "executor_id": 0,
                      "updates": [{"aid": a.aid, **tw.encode_accumulator_value(4)}]}, "peer") == {"ok": True}
    inbox.apply("c3")
    assert a.value == 4
    _handle(st, {"cluster": "c3", "type": "status", "executor_id": 0, "state": "exited", "code": -6, "hint": "; limit text"}, "peer")
    assert st.core.failures[0].message == "the TF process died (killed by SIGABRT) before main_fun returned; limit text"


# ----------------------------------------------------------------------------- the payload
class _FakeJBroadcast:
    def __init__(self, bid: int) -> None:
        self.bid = bid

    def id(self) -> int:
        return self.bid


def _fake_driver_broadcast(bid: int):
    from pyspark import Broadcast

    bc = object.__new__(Broadcast)
    bc._jbroadcast = _FakeJBroadcast(bid)
    return bc


def test_payload_carries_the_broadcasts_it_refers_to():
    from pyspark import Broadcast

    registry = sys.modules[Broadcast.__module__]._broadcastRegistry
    in_args, in_closure = _fake_driver_broadcast(901), _fake_driver_broadcast(902)

    def main_fun(args, ctx):
        return args["bc"], in_closure

    payload = pickle_payload(main_fun, {"bc": in_args})
    assert isinstance(payload, tw.Payload) and payload.broadcasts == (in_args, in_closure)
    assert type(bytes(payload)) is bytes and bytes(payload) == payload
    registry[901], registry[902] = "value 901", "value 902"  # what a TF process registers
    try:
        fn, args = cloudpickle.loads(payload)
        assert fn(args, None) == ("value 901", "value 902")
    finally:
        del registry[901], registry[902]


def test_payload_refuses_an_accumulator_that_is_not_a_number():
    from pyspark.accumulators import Accumulator, AccumulatorParam, _accumulatorRegistry

    class ListParam(AccumulatorParam):
        def zero(self, value):
            return []

        def addInPlace(self, v1, v2):  # noqa: N802 - PySpark's name
            return v1 + v2

    numbers = _driver_accumulators(0)[0]
    pickle_payload(lambda args, ctx: numbers.add(1), None)  # accepted
    acc = Accumulator(max(_accumulatorRegistry) + 1, [], ListParam())
    with pytest.raises(ConfigurationError, match=f"refers to accumulator {acc.aid}, whose values are list"):
        pickle_payload(lambda args, ctx: acc.add([1]), None)


def test_unpicklable_payload_is_a_configuration_error():
    import threading

    with pytest.raises(ConfigurationError, match="must be picklable with cloudpickle"):
        pickle_payload(lambda a, c: None, {"lock": threading.Lock()})


# ---------------------------------------------------------------- set-up in a TF process
_TF_PROCESS = textwrap.dedent('''
    import json, os, pickle, sys
    from tfos._node import task_world as tw
    from tfos.errors import TFOSError
    world = pickle.loads(bytes.fromhex(sys.argv[1]))
    fd = os.memfd_create("test")
    with os.fdopen(os.dup(fd), "wb") as f:
        pickle.dump({"secret": "from memory"}, f)
    world = tw.TaskWorld(world.task, world.spark_files_dir, world.broadcast_paths, ((12, fd),))
    tw.install(world)
    assert "pyspark" not in sys.modules  # nothing imported until main_fun (or the payload) does
    from pyspark import Broadcast, BarrierTaskContext, SparkFiles, TaskContext
    _from_id = sys.modules[Broadcast.__module__]._from_id  # pyspark.core.broadcast (4.x), pyspark.broadcast (3.5)
    tc = TaskContext.get()
    try:
        BarrierTaskContext.get().allGather("x")
        gathered = "returned"
    except TFOSError as exc:
        gathered = str(exc)
    print(json.dumps({
        "file": SparkFiles.get("data.txt"), "root": SparkFiles.getRootDirectory(),
        "bc11": _from_id(11).value, "bc12": _from_id(12).value,
        "partition": tc.partitionId(), "stage": tc.stageId(), "attempt": tc.attemptNumber(), "tid": tc.taskAttemptId(),
        "cpus": tc.cpus(), "gpus": tc.resources()["gpu"].addresses, "prop": tc.getLocalProperty("k"),
        "barrier": isinstance(tc, BarrierTaskContext), "infos": [i.address for i in BarrierTaskContext.get().getTaskInfos()],
        "gathered": gathered,
    }))
''')


def test_tf_process_sets_up_spark_files_task_context_and_broadcasts(tmp_path):
    bc_file = tmp_path / "broadcast_11"
    with open(bc_file, "wb") as f:
        pickle.dump([1, 2, 3], f)
    info = tw.SparkTaskInfo(stage_id=7, partition_id=1, attempt_number=2, task_attempt_id=99, cpus=1,
                            resources=(("gpu", ("3",)),), local_properties=(("k", "v"), ("addresses", "h1:1,h2:2")))
    world = tw.TaskWorld(task=info, spark_files_dir=str(tmp_path), broadcast_paths=((11, str(bc_file)),))
    out = subprocess.run([sys.executable, "-c", _TF_PROCESS, pickle.dumps(world).hex()], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert seen["file"] == str(tmp_path / "data.txt") and seen["root"] == str(tmp_path)
    assert seen["bc11"] == [1, 2, 3] and seen["bc12"] == {"secret": "from memory"}
    assert (seen["partition"], seen["stage"], seen["attempt"], seen["tid"], seen["cpus"]) == (1, 7, 2, 99, 1)
    assert seen["gpus"] == ["3"] and seen["prop"] == "v" and seen["barrier"] is True and seen["infos"] == ["h1:1", "h2:2"]
    assert seen["gathered"].startswith("BarrierTaskContext.allGather() is not available in main_fun")


def test_task_info_is_validated():
    with pytest.raises(ValueError, match="partition_id"):
        tw.SparkTaskInfo(stage_id=1, partition_id=-1, attempt_number=0, task_attempt_id=0)
    with pytest.raises(ValueError, match="absolute"):
        tw.TaskWorld(spark_files_dir="relative/dir")


# --------------------------------------------------------------------------- memory limits
_LIMITED = textwrap.dedent('''
    import json, resource, sys
    soft, hard = int(sys.argv[1]), int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    from tfos._node import address_space as asp
    left = asp.raise_address_space_limit()
    try:
        raise ImportError("libtensorflow_cc.so.2: failed to map segment from shared object")
    except ImportError as exc:
        note = asp.memory_limit_note(exc)
    print(json.dumps({"left": left, "now": resource.getrlimit(resource.RLIMIT_AS), "note": note,
                      "plain": asp.memory_limit_note(ValueError("bad label")), "exit": asp.memory_limit_exit_hint(-6),
                      "kill": asp.memory_limit_exit_hint(-9)}))
''')


def _limited(soft: int, hard: int, **env: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _LIMITED, str(soft), str(hard)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **env})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_soft_address_space_limit_is_raised_to_the_hard_one():
    import resource

    seen = _limited(8 * GiB, resource.RLIM_INFINITY)
    assert seen["left"] is None and seen["now"] == [resource.RLIM_INFINITY, resource.RLIM_INFINITY]
    assert seen["note"] == "" and seen["exit"] == ""
    seen = _limited(6 * GiB, 8 * GiB)
    assert seen["left"] == 8 * GiB and seen["now"] == [8 * GiB, 8 * GiB]


def test_a_limit_spark_set_is_named_with_its_setting_and_fix():
    seen = _limited(8 * GiB, 8 * GiB, PYSPARK_EXECUTOR_MEMORY_MB="8192")
    for text in (seen["note"], seen["exit"]):
        assert "address-space limit (RLIMIT_AS) of 8.0 GiB" in text
        assert "spark.executor.pyspark.memory (8192 MiB)" in text
        assert "leave spark.executor.pyspark.memory unset" in text
    assert seen["plain"] == ""  # an error that is not about memory gets no note
    assert seen["kill"] == ""  # a SIGKILL keeps the memory killer's hint
    seen = _limited(8 * GiB, 8 * GiB, PYSPARK_EXECUTOR_MEMORY_MB="")
    assert "set outside Spark (ulimit -v" in seen["note"]


def abort_main(args, ctx):
    import os

    os.abort()


def test_a_node_killed_under_a_limit_is_reported_with_it(tmp_path):
    """A real supervisor and TF process started by a process under an 8 GiB RLIMIT_AS (as
    a PySpark worker with spark.executor.pyspark.memory=8g): main_fun aborts, and the
    driver's ProcessDied failure names the limit, the setting and the fix."""
    from tfos._common import wire as _wire
    from tfos._control.server import ControlServer
    from tfos._control.host import ClusterHost
    from tfos._node.launch import ClusterConfig, NodeLaunch
    from tfos.cluster_template import InputMode, build_template, roles_from_template

    roles = roles_from_template(build_template(1, 0))
    state = ClusterHost("tfos-unit-rlimit", roles, 30.0)
    key = _wire.new_key()
    server = ControlServer(key, state, host="127.0.0.1")
    try:
        cfg = ClusterConfig(cluster_id="tfos-unit-rlimit", key=key, driver_host="127.0.0.1", driver_port=server.port,
                            input_mode=InputMode.TENSORFLOW, roles=tuple(roles), heartbeat_interval_s=0.5,
                            heartbeat_timeout_s=30.0, reservation_timeout_s=60.0, forward_logs="none")
        launch = NodeLaunch(config=cfg, role=roles[0], host="127.0.0.1", executor_key="h/1", watch_pid=0, watch_stdin=False,
                            working_dir=str(tmp_path), python_path=tuple(p for p in sys.path if p),
                            fn_payload=cloudpickle.dumps((abort_main, {})))
        (tmp_path / "launch.pkl").write_bytes(pickle.dumps(launch))
        starter = textwrap.dedent(f'''
            import pickle, resource
            resource.setrlimit(resource.RLIMIT_AS, ({8 * GiB}, {8 * GiB}))
            from tfos._node.start_task import spawn_supervisor
            spawn_supervisor(pickle.loads(open({str(tmp_path / "launch.pkl")!r}, "rb").read())).wait(120)
        ''')
        proc = subprocess.run([sys.executable, "-c", starter], timeout=150, capture_output=True, text=True,
                              env={**os.environ, "PYSPARK_EXECUTOR_MEMORY_MB": "8192"})
        assert proc.returncode == 0, proc.stderr
        deadline = time.monotonic() + 30
        while not state.core.failures and time.monotonic() < deadline:
            time.sleep(0.1)
        (failure,) = state.core.failures
        assert failure.error_type == "ProcessDied"
        assert failure.message.startswith("the TF process died (killed by SIGABRT) before main_fun returned; the node ran under "
                                          "an address-space limit (RLIMIT_AS) of 8.0 GiB"), failure.message
        assert "spark.executor.pyspark.memory (8192 MiB)" in failure.message
    finally:
        server.close()


def test_task_world_needs_no_pyspark_to_import():
    out = subprocess.run([sys.executable, "-c", "import sys, tfos._node.tf_process, tfos._node.supervisor; print('pyspark' in sys.modules)"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


def test_capture_refuses_a_broadcast_pyspark_did_not_load(monkeypatch):
    class NotLoaded:
        pass

    with pytest.raises(TFOSError, match="broadcast variable 5 that main_fun's payload refers to was not loaded"):
        tw.capture([(5, NotLoaded())])


def test_only_the_payloads_accumulators_are_sent(monkeypatch):
    """PySpark's own accumulators (negative ids, e.g. its UDF profiler's) and any other
    accumulator the TF process holds are not main_fun's: only those the payload
    deserialized are sent, with what main_fun added to them."""
    from pyspark.accumulators import FLOAT_ACCUMULATOR_PARAM, INT_ACCUMULATOR_PARAM, Accumulator, AccumulatorParam
    from pyspark.accumulators import _accumulatorRegistry

    class DictParam(AccumulatorParam):
        def zero(self, value):
            return {}

        def addInPlace(self, a, b):
            a.update(b)
            return a

    monkeypatch.setattr(tw, "_payload_accumulators", None)
    saved = dict(_accumulatorRegistry)
    try:
        _accumulatorRegistry.clear()
        Accumulator(-2, {}, DictParam())  # registers itself, as PySpark's profiler accumulator does
        assert tw.accumulator_updates() == []  # a negative id is PySpark's, never sent
        payload = pickle.dumps((Accumulator(7, 5, INT_ACCUMULATOR_PARAM), "args"))  # as the driver pickles it
        del _accumulatorRegistry[7]  # the TF process has not seen it yet
        Accumulator(8, 1.0, FLOAT_ACCUMULATOR_PARAM)  # in the process before the payload: not main_fun's
        acc, args = tw.load_payload(payload)
        assert acc.aid == 7 and acc._value == 0 and args == "args"  # deserialized at its zero value, as in a worker
        acc.add(3)
        assert tw.accumulator_updates() == [{"aid": 7, **tw.encode_accumulator_value(3)}]
    finally:
        _accumulatorRegistry.clear()
        _accumulatorRegistry.update(saved)
