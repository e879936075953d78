"""Spark Connect pieces that need no Spark: failure encoding, result batches, the control host."""

from __future__ import annotations

import threading
import time

import pytest

from tfos._common import wire as _wire
from tfos._connect.control_host import ControlHost, HostLaunch
from tfos._connect.tasks import decode_failures, encode_failures, results_to_batch
from tfos._control.client import ControlClient
from tfos.cluster_template import NodeInfo, build_template, roles_from_template
from tfos.errors import ConfigurationError, ControlProtocolError, DeadlineExceededError, NodeFailure, TFOSError

def _send(client, msg_type: str, timeout_s: float = 30.0, retry: bool = True, connect_timeout_s=None, **fields) -> dict:
    """A request of any type, as the protocol carries it (tfos itself sends typed messages,
    ControlClient.call); a type of tfos._control.messages is checked first, as call() does."""
    from tfos._control.messages import message_class

    cls = message_class(msg_type)
    if cls is not None:
        cls.decode(fields)
    return client._request(msg_type, fields, timeout_s, retry, connect_timeout_s)  # send_raw() without a connect budget



def _failure(eid: int = 1) -> NodeFailure:
    return NodeFailure(eid, "worker", 0, "10.0.0.5", "exception", "ValueError", "bad value\nsecond line", "Traceback...\n  File x")


def test_failures_survive_a_spark_error_text():
    fs = [_failure(1), _failure(2)]
    text = "org.apache.spark.api.python.PythonException: ...\ntfos.errors.TFOSError: tfos cluster c failed\n" + encode_failures(fs) + "\n SQLSTATE: 38000"
    assert decode_failures(text) == fs
    assert decode_failures("no marker here") == []
    assert decode_failures("TFOS-FAILURES:!!notbase64") == []


def test_results_to_batch_by_value_position_and_name():
    pa = pytest.importorskip("pyarrow")
    one = pa.schema([("result", pa.float64())])
    assert results_to_batch([1.5, 2, None], one).column(0).to_pylist() == [1.5, 2.0, None]
    two = pa.schema([("x", pa.int64()), ("sq", pa.int64())])
    b = results_to_batch([(1, 1), [2, 4], {"sq": 9, "x": 3}], two)
    assert b.to_pydict() == {"x": [1, 2, 3], "sq": [1, 4, 9]}
    np = pytest.importorskip("numpy")
    vec = pa.schema([("v", pa.list_(pa.float32()))])
    assert results_to_batch([np.array([1.0, 2.0], np.float32)], vec).column(0).to_pylist() == [[1.0, 2.0]]
    with pytest.raises(TFOSError, match="does not fit the result schema"):
        results_to_batch([(1, 2, 3)], two)
    with pytest.raises(TFOSError, match="do not fit the result schema"):
        results_to_batch(["text"], two.remove(1))


def test_timestamp_results_are_local_times_as_pyspark_reads_them(berlin_time):
    # A TimestampType result column: PySpark's to_arrow_schema refused it without a zone
    # (AssertionError in every inference task), and pa.array read a naive datetime as UTC.
    import datetime

    pa = pytest.importorskip("pyarrow")
    from pyspark.sql.types import ArrayType, MapType, StringType, StructField, StructType, TimestampNTZType, TimestampType

    from tfos._connect.tasks import result_arrow_schema

    struct = StructType([
        StructField("t", TimestampType()), StructField("ntz", TimestampNTZType()),
        StructField("ts", ArrayType(TimestampType())),
        StructField("s", StructType([StructField("a", TimestampType()), StructField("n", StringType())])),
        StructField("m", MapType(StringType(), TimestampType())),
    ])
    schema = result_arrow_schema(struct)
    assert schema.field("t").type == pa.timestamp("us", tz="UTC") and schema.field("ntz").type == pa.timestamp("us")
    # 2023-10-29 02:30 in Berlin happens twice: fold 0 is 00:30Z (CEST), fold 1 is 01:30Z (CET)
    first, second = datetime.datetime(2023, 10, 29, 2, 30), datetime.datetime(2023, 10, 29, 2, 30, fold=1)
    aware = datetime.datetime(2024, 5, 1, 12, 0, tzinfo=datetime.timezone.utc)
    wall = datetime.datetime(2024, 1, 1, 12, 0, 0, 250)
    b = results_to_batch([
        (first, wall, [first, second, None], {"a": second, "n": "x"}, {"k": second}),
        {"t": second, "ntz": None, "ts": None, "s": (aware, "y"), "m": None},
        (aware, None, [aware], None, {"k": None}),
        (None, None, [], {"n": "z"}, {}),
    ], schema)
    us = lambda d: int(d.timestamp() * 1_000_000)  # noqa: E731
    assert b.column("t").cast(pa.int64()).to_pylist() == [1698539400000000, 1698543000000000, us(aware), None]
    assert b.column("t").cast(pa.int64()).to_pylist()[:2] == [us(first), us(second)]
    assert b.column("ntz").to_pylist() == [wall, None, None, None]  # wall-clock time, no zone
    assert pa.compute.list_flatten(b.column("ts")).cast(pa.int64()).to_pylist() == [us(first), us(second), None, us(aware)]
    s = b.column("s").to_pylist()
    assert [x and x["a"] for x in s] == [datetime.datetime.fromtimestamp(us(second) / 1e6, datetime.timezone.utc), aware, None, None]
    assert [x and x["n"] for x in s] == ["x", "y", None, "z"]
    assert b.column("m").to_pylist()[0][0][1] == datetime.datetime(2023, 10, 29, 1, 30, tzinfo=datetime.timezone.utc)


def _host(client_timeout_s: float = 600.0) -> ControlHost:
    roles = tuple(roles_from_template(build_template(2, 0, None, False)))
    return ControlHost(HostLaunch("c1", _wire.new_key(), roles, "127.0.0.1", 15.0, client_timeout_s, 0))


def test_host_launch_validates():
    roles = tuple(roles_from_template(build_template(1, 0, None, False)))
    with pytest.raises(ConfigurationError):
        HostLaunch("c1", b"short", roles, "127.0.0.1", 15.0, 600.0, 0)
    launch = HostLaunch("c1", b"k" * 32, roles, "127.0.0.1", 15.0, 600.0, 0)
    assert "kkkk" not in repr(launch)


def test_host_launch_record_roundtrip_and_type_check():
    import io

    from tfos._connect.control_host import read_host_launch, write_host_launch

    roles = tuple(roles_from_template(build_template(2, 0, None, False)))
    launch = HostLaunch("c1", b"k" * 32, roles, "127.0.0.1", 15.0, 600.0, 0)
    buf = io.BytesIO()
    write_host_launch(buf, launch)
    assert read_host_launch(io.BytesIO(buf.getvalue())) == launch
    with pytest.raises(EOFError, match="truncated launch record"):
        read_host_launch(io.BytesIO(buf.getvalue()[:-1]))
    other = io.BytesIO()
    write_host_launch(other, ("not", "a", "launch"))  # type: ignore[arg-type]
    with pytest.raises(EOFError, match="did not carry a HostLaunch"):
        read_host_launch(io.BytesIO(other.getvalue()))


def test_control_host_registry_failures_and_teardown():
    host = _host()
    key = host.launch.key
    try:
        c = ControlClient("127.0.0.1", host.server.port, key, "c1", connect_timeout_s=5.0)
        st = _send(c, "client_wait", until="all_registered", poll_s=0.2)
        assert st["done"] is False and st["missing"] == [0, 1]
        for eid in (0, 1):
            node = NodeInfo(eid, "worker", eid, "127.0.0.1", 4000 + eid, 5000 + eid, 100 + eid, f"h/{eid}")
            assert _send(c, "register", node=node.to_dict())["ok"]
        st = _send(c, "client_wait", until="all_registered", poll_s=0.2)
        assert st["done"] is True and [n["executor_id"] for n in st["nodes"]] == [0, 1]
        # A node failure aborts the cluster; the client gets it with its traceback.
        _send(c, "status", executor_id=1, state="failed", failure=_failure(1).to_dict())
        st = _send(c, "client_wait", until="workers_done", poll_s=5.0)
        assert st["abort"] and [NodeFailure.from_dict(f) for f in st["failures"]] == [_failure(1)]
        # Teardown: answered once every node exited, and releases the host.
        def exit_later() -> None:
            time.sleep(0.3)
            c2 = ControlClient("127.0.0.1", host.server.port, key, "c1", connect_timeout_s=5.0)
            for eid in (0, 1):
                _send(c2, "status", executor_id=eid, state="exited", code=0)
            c2.close()

        threading.Thread(target=exit_later, daemon=True).start()
        st = _send(c, "client_teardown", abort=True, attribution_s=0.0, poll_s=5.0, timeout_s=20.0)
        assert st["done"] is True and st["exit_codes"] == {"0": 0, "1": 0}
        assert host.released.is_set()
        with pytest.raises(ControlProtocolError):
            host._dispatch({"type": "client_bogus", "cluster": "c1"}, "peer")
        with pytest.raises(ControlProtocolError, match="another cluster"):
            host._dispatch({"type": "client_wait", "cluster": "other"}, "peer")
        c.close()
    finally:
        host.server.close()


def test_control_host_refuses_a_wrong_key():
    host = _host()
    try:
        bad = ControlClient("127.0.0.1", host.server.port, _wire.new_key(), "c1", connect_timeout_s=1.0)
        with pytest.raises((ConnectionError, ControlProtocolError, DeadlineExceededError)):
            _send(bad, "client_wait", until="now", poll_s=0.0, timeout_s=2.0, retry=False)
        bad.close()
    finally:
        host.server.close()


def test_control_host_ends_the_cluster_without_a_client():
    host = _host(client_timeout_s=1.0)
    t0 = time.monotonic()
    assert host.serve() == 0  # no client operation for 1 s: abort and exit (no node registered)
    assert time.monotonic() - t0 < 30.0
    assert "no client operation" in host.host.core.abort_reason


def test_run_hands_a_connect_session_to_the_connect_path():
    from tfos import TFCluster
    from tfos._driver.connect_backend import is_connect_session

    class FakeConnectSession:  # looks like pyspark.sql.connect.session.SparkSession
        pass

    FakeConnectSession.__module__ = "pyspark.sql.connect.session"
    assert is_connect_session(FakeConnectSession()) and not is_connect_session(object())
    import pyspark

    # PySpark 3.5 (scripts/compat_matrix.sh) refuses Connect before looking at the arguments.
    expected = ("driver_ps_nodes=True is not available under Spark Connect"
                if int(pyspark.__version__.split(".")[0]) >= 4 else r"tfos on Spark Connect needs PySpark >= 4\.0")
    with pytest.raises(ConfigurationError, match=expected):
        TFCluster.run(FakeConnectSession(), lambda args, ctx: None, {}, 2, 1, driver_ps_nodes=True)


def test_control_host_ends_the_feed_once_every_partition_was_sent():
    host = _host()
    try:
        assert host._dispatch({"type": "client_control", "cluster": "c1", "action": "close_feed_when_sent", "feed_id": "f", "total": 2}, "p") == {"ok": True}
        for index in (0, 1):
            assert host.host.core.feed_closed is False
            host._dispatch({"type": "partition_sent", "cluster": "c1", "feed_id": "f", "index": index}, "p")
        assert host.host.core.feed_closed is True
    finally:
        host.server.close()


def test_control_host_long_polls_for_tensorboard():
    host = _host()
    try:
        c = ControlClient("127.0.0.1", host.server.port, host.launch.key, "c1", connect_timeout_s=5.0)
        st = _send(c, "client_wait", until="tensorboard", poll_s=0.1)
        assert st["done"] is False and st["tensorboard_url"] is None

        def report_later() -> None:
            time.sleep(0.3)
            c2 = ControlClient("127.0.0.1", host.server.port, host.launch.key, "c1", connect_timeout_s=5.0)
            _send(c2, "tensorboard", executor_id=0, url="http://127.0.0.1:6006/")
            c2.close()

        reporter = threading.Thread(target=report_later, daemon=True)
        reporter.start()
        t0 = time.monotonic()
        st = _send(c, "client_wait", until="tensorboard", poll_s=9.0, timeout_s=30.0)
        assert st["done"] is True and st["tensorboard_url"] == "http://127.0.0.1:6006/"
        assert time.monotonic() - t0 < 8.5  # answered on the report, not at the end of the poll
        c.close()
        reporter.join(20)  # its own answer may still be on its way when the wait was answered
    finally:
        host.server.close()


@pytest.mark.parametrize("master, example", [
    ("local[2]", "local[3]"),
    ("local-cluster[2,1,1024]", "local-cluster[3,1,1024]"),
    ("local-cluster[1, 2, 2048]", "local-cluster[2,2,2048]"),
])
def test_too_few_slots_suggests_a_master_of_the_same_kind(master, example):
    """A Connect server with too few task slots is refused with an example master of the
    kind it runs (a local-cluster server is not told to use local[N])."""
    from tfos._driver.connect_start import _check_local_slots
    from tfos.errors import ConfigurationError

    with pytest.raises(ConfigurationError) as info:
        _check_local_slots(master, {}, 3)
    assert str(info.value).endswith(f"start the server with more slots (e.g. {example}) or ask for fewer nodes")
    _check_local_slots(master, {}, 2)


# ---------------------------------------------------------------- client timeout
@pytest.mark.parametrize("text, want", [(None, 600.0), ("", 600.0), ("20", 20.0), ("45.5", 45.5), ("3600", 3600.0)])
def test_client_timeout_from_env(monkeypatch, text, want):
    from tfos._driver.connect_start import client_timeout_from_env

    if text is None:
        monkeypatch.delenv("TFOS_CONNECT_CLIENT_TIMEOUT_S", raising=False)
    else:
        monkeypatch.setenv("TFOS_CONNECT_CLIENT_TIMEOUT_S", text)
    assert client_timeout_from_env() == want


@pytest.mark.parametrize("text", ["19.9", "0", "-5", "ten", "nan", "inf"])
def test_client_timeout_below_the_keepalive_floor_is_refused(monkeypatch, text):
    # 20 s and less killed a live client's cluster: the keep-alive ran every 30 s (new-user helper)
    from tfos._driver.connect_start import client_timeout_from_env

    monkeypatch.setenv("TFOS_CONNECT_CLIENT_TIMEOUT_S", text)
    with pytest.raises(ConfigurationError, match=r"TFOS_CONNECT_CLIENT_TIMEOUT_S=.*a number >= 20 \(default 600\)"):
        client_timeout_from_env()


def test_idle_client_sends_keepalives_within_a_quarter_of_a_short_timeout():
    """With TFOS_CONNECT_CLIENT_TIMEOUT_S=20 the idle client's keep-alive control jobs come
    every 5 s (a quarter), not every 30 s, which outlived the timeout."""
    from tfos._driver.connect_backend import ConnectBackend
    from tfos._node.launch import ClusterConfig
    from tfos.cluster_template import InputMode

    jobs: list = []

    class _Frame:
        def mapInArrow(self, fn, schema):
            return self

        def collect(self):
            jobs.append(time.monotonic())
            return [{"reply": "{}"}]

    class _Spark:
        def range(self, *a):
            return _Frame()

    roles = tuple(roles_from_template(build_template(2, 0, None, False)))
    config = ClusterConfig(cluster_id="c1", key=_wire.new_key(), driver_host="127.0.0.1", driver_port=1,
                           input_mode=InputMode.SPARK, roles=roles)
    t0 = time.monotonic()
    cluster = ConnectBackend(_Spark(), config, [], client_timeout_s=20.0)
    try:
        deadline = time.monotonic() + 15
        while len(jobs) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        cluster._closed = True
        cluster._keepalive_stop.set()
    assert len(jobs) >= 2, jobs
    assert jobs[0] - t0 < 8.0 and jobs[1] - jobs[0] < 8.0, [j - t0 for j in jobs]


@pytest.mark.parametrize("entry", ["inference_stream", "train_stream", "stop_address", "request_stop"])
def test_streaming_entry_points_refuse_a_connect_cluster(entry):
    """tfos.streaming.inference_stream/train_stream (docs audit helper) and stop_address/
    request_stop (break helper) on a Spark Connect cluster raised AttributeError; they
    refuse it as train()/inference() refuse a streaming DataFrame."""
    from types import SimpleNamespace

    from tfos._driver import streaming as stream_feeds  # tfos.streaming exports inference_stream
    from tfos._driver.cluster import TFCluster

    cluster = object.__new__(TFCluster)  # no session needed: refused before any use
    cluster._ctl = SimpleNamespace(launcher=SimpleNamespace(streams=False))  # a Connect cluster's launcher feeds no streams
    call = getattr(stream_feeds, entry)
    args = {"inference_stream": (cluster, None, lambda df, results, batch_id: None), "train_stream": (cluster, None)}.get(entry, (cluster,))
    with pytest.raises(ConfigurationError, match=r"\): streams cannot be fed under Spark Connect"):
        call(*args)
