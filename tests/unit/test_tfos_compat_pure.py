"""TFoS compatibility without Spark: path mapping, TFManager queues + DataFeed, reservation
server/client, util, gpu_info (with a fake nvidia-smi), pipeline helpers, Keras default."""

from __future__ import annotations

import getpass
import logging
import os
import pickle
import queue
import stat
import sys
import threading

import numpy as np
import pytest

from tfos import TFManager, TFNode, TFSparkNode, gpu_info, marker, pipeline, reservation, util
from tfos.errors import ConfigurationError, TFOSError
from tfos.node_context import TFNodeContext, absolute_path, normalize_default_fs

USER = getpass.getuser()
WD = "/drv/cwd"


# ------------------------------------------------------------------ path mapping
@pytest.mark.parametrize(
    "fs, path, expected",
    [
        # TFoS 2.2.5's own table (its test_hdfs_path), working_dir = WD
        ("file://", "hdfs://foo/bar", "hdfs://foo/bar"),
        ("hdfs://", "viewfs://foo/bar", "viewfs://foo/bar"),
        ("viewfs://", "file://foo/bar", "file://foo/bar"),
        ("file://", "/foo/bar", "file:///foo/bar"),
        ("hdfs://", "/foo/bar", "hdfs:///foo/bar"),
        ("viewfs://", "/foo/bar", "viewfs:///foo/bar"),
        ("file://", "foo/bar", f"file://{WD}/foo/bar"),
        ("hdfs://", "foo/bar", f"hdfs:///user/{USER}/foo/bar"),
        ("viewfs://", "foo/bar", f"viewfs:///user/{USER}/foo/bar"),
        # defaultFS with a host, with and without a trailing slash
        ("hdfs://nn:8020", "/m", "hdfs://nn:8020/m"),
        ("hdfs://nn:8020/", "m", f"hdfs://nn:8020/user/{USER}/m"),
        ("viewfs://cluster/", "/m", "viewfs://cluster/m"),
        # file: spellings Hadoop accepts
        ("file:///", "m", f"file://{WD}/m"),
        ("file:/", "/m", "file:///m"),
        # schemes TFoS did not list: returned unchanged
        ("hdfs://nn:8020", "gs://b/m", "gs://b/m"),
        ("file://", "abfss://c@a.dfs.core.windows.net/m", "abfss://c@a.dfs.core.windows.net/m"),
        ("file://", "s3a://bucket/m", "s3a://bucket/m"),
        ("file://", "custom+x://h/m", "custom+x://h/m"),
        # object-store defaultFS: absolute paths under it, relative ones at its root (as TFoS)
        ("s3a://bucket", "/m", "s3a://bucket/m"),
        ("gs://bucket/", "m", "gs://bucket/m"),
    ],
)
def test_absolute_path_matches_tfos_rules(fs, path, expected):
    assert absolute_path(path, fs, WD) == expected
    ctx = TFNodeContext(defaultFS=fs, working_dir=WD)
    assert ctx.absolute_path(path) == expected
    assert TFNode.hdfs_path(ctx, path) == expected


@pytest.mark.parametrize(
    "raw, norm", [("file:", "file://"), ("file:///", "file://"), ("hdfs://", "hdfs://"), ("hdfs://nn:8020/", "hdfs://nn:8020"), ("viewfs:", "viewfs://")]
)
def test_normalize_default_fs(raw, norm):
    assert normalize_default_fs(raw) == norm


def test_ctx_tfos_attributes():
    ctx = TFNodeContext(executor_id=3, job_name="worker", task_index=1, cluster_spec={"chief": ["a:1"], "worker": ["b:1", "c:1"]})
    assert ctx.worker_num == 3 and ctx.num_workers == 3


def test_release_port_function(caplog):
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    ctx = TFNodeContext(tmp_socket=s)
    TFNode.release_port(ctx)
    assert ctx.tmp_socket is None and s.fileno() == -1
    with caplog.at_level(logging.WARNING, logger="tfos.TFNode"):
        TFNode.release_port(ctx)
    assert "release_port() invoked with no bound socket" in caplog.text


def test_export_saved_model_argument_forms():
    ctx = TFNodeContext(job_name="chief")
    with pytest.raises(TypeError, match="TF1 form is export_saved_model"):
        ctx.export_saved_model(object(), "/tmp/x", tag_set="serve")
    with pytest.raises(TypeError, match="needs a model"):
        ctx.export_saved_model(export_dir="/tmp/x")


# ----------------------------------------------------------- TFManager + DataFeed
@pytest.fixture
def mgr():
    m = TFManager.start(os.urandom(16), ["input", "output"], "local")
    yield m
    m.shutdown()


def test_tfmanager_server_is_spawned_not_forked(mgr):
    # A fork of a process that loaded TensorFlow (this test process has) inherits TF's
    # runtime; its garbage collector ran TF finalizers in the forked server and crashed it
    # (a segfault in this fixture, seen under load). A spawned server is a fresh interpreter.
    import psutil

    cmd = " ".join(psutil.Process(mgr._process.pid).cmdline())
    assert "multiprocessing.spawn import spawn_main" in cmd, cmd
    assert psutil.Process(mgr._process.pid).ppid() == os.getpid()


def test_tfmanager_queues_and_state(mgr):
    mgr.set("state", "running")
    assert str(mgr.get("state")) == "'running'"  # a proxy, as in TFoS
    other = TFManager.connect(mgr.address, mgr._authkey)
    other.get_queue("input").put(41)
    assert mgr.get_queue("input").get(timeout=5) == 41
    assert TFManager.mgr is mgr


def test_tfmanager_wrong_key_is_refused(mgr):
    import multiprocessing

    with pytest.raises(multiprocessing.AuthenticationError):
        TFManager.connect(mgr.address, b"not the key")


def test_datafeed_on_tfmanager_train(mgr):
    q = mgr.get_queue("input")
    for i in range(10):
        q.put(i)
    q.put(None)
    feed = TFNode.DataFeed(mgr)
    assert feed.mgr is mgr and feed.queue_in is not None and feed.queue_out is not None
    assert feed.next_batch(2) == [0, 1] and not feed.done_feeding
    assert feed.next_batch(4) == [2, 3, 4, 5]
    assert feed.next_batch(10) == [6, 7, 8, 9]
    assert feed.should_stop()


def test_datafeed_on_tfmanager_inference_numpy_rows(mgr):
    q = mgr.get_queue("input")
    for row in ([1, 2], [3, 4], marker.EndPartition(), [5, 6]):
        q.put(row)
    q.put(None)
    feed = TFNode.DataFeed(mgr, train_mode=False)
    batch = feed.next_batch(10)
    assert batch == [[1, 2], [3, 4]]  # stops at the end of the partition
    feed.batch_results(np.square(np.array(batch)))
    out = mgr.get_queue("output")
    r0, r1 = out.get(timeout=5), out.get(timeout=5)
    assert isinstance(r0, np.ndarray) and r0.tolist() == [1, 4] and r1.tolist() == [9, 16]
    assert feed.next_batch(10) == [[5, 6]] and feed.should_stop()


def test_datafeed_on_tfmanager_input_mapping_and_terminate(mgr):
    q = mgr.get_queue("input")
    q.put((1.0, "a"))
    q.put((2.0, "b"))
    feed = TFNode.DataFeed(mgr, input_mapping={"x": "t_x", "y": "t_y"})
    assert feed.next_batch(2) == {"t_x": [1.0, 2.0], "t_y": ["a", "b"]}
    q.put((3.0, "c"))
    feed.terminate()
    assert feed.should_stop() and q.empty()
    assert str(mgr.get("state")) == "'terminating'"


class _FakeHub:
    def __init__(self):
        self.queues = {"input": queue.Queue()}
        self.aborted = ""
        self.node_name = "worker:0 (executor 0, host 127.0.0.1)"


def test_datafeed_on_tfos_hub_has_no_row_queues():
    feed = TFNode.DataFeed(_FakeHub())
    assert isinstance(feed.mgr, _FakeHub)
    with pytest.raises(TFOSError, match="next_batch"):
        feed.queue_in
    with pytest.raises(TFOSError, match="batch_results"):
        feed.queue_out


def test_result_items_keep_numpy():
    from tfos._data.results import result_items as _result_items

    rows = _result_items(np.arange(6).reshape(3, 2))
    assert [type(r) for r in rows] == [np.ndarray] * 3 and rows[2].tolist() == [4, 5]
    scalars = _result_items(np.array([1.5, 2.5], dtype=np.float32))
    assert [type(s) for s in scalars] == [np.float32, np.float32]
    assert _result_items(("a", 1)) == ["a", 1]


# ------------------------------------------------------------------- reservation
def test_reservation_round_trip_and_stop():
    s = reservation.Server(2)
    addr = s.start()
    try:
        assert repr(addr) == repr((addr[0], addr[1]))  # the key never shows
        shipped = pickle.loads(pickle.dumps(addr))  # e.g. in a Spark closure
        c1, c2 = reservation.Client(shipped), reservation.Client((addr[0], addr[1]))
        assert c1.register({"executor_id": 0, "addr": ("h", 1)}) == "OK"
        assert s.reservations.remaining() == 1
        t = threading.Thread(target=lambda: c2.register({"executor_id": 1}))
        t.start()
        got = c1.await_reservations(timeout=30, poll_s=0.1)
        t.join(10)
        assert sorted(r["executor_id"] for r in got) == [0, 1]
        assert got[0]["addr"] == ["h", 1] or got[1].get("addr") is None  # JSON: tuples become lists
        assert s.await_reservations(timeout=5) == c1.get_reservations()
        assert c1.request_stop() == "OK" and s.done
        c1.close()
        c2.close()
    finally:
        s.stop()


def test_reservation_client_needs_the_key():
    with pytest.raises(ConfigurationError, match="Server.start"):
        reservation.Client(("127.0.0.1", 1))


def test_reservation_wrong_key_is_refused():
    s = reservation.Server(1)
    addr = s.start()
    try:
        forged = reservation.ServerAddress((addr[0], addr[1]), os.urandom(32), addr.server_id)
        c = reservation.Client(forged)
        c._client._connect_timeout_s = 2.0
        with pytest.raises((ConnectionError, TFOSError)):
            c.register({"x": 1})
        assert s.reservations.remaining() == 1
    finally:
        s.stop()


def test_reservation_await_fails_on_status_error_and_timeout():
    s = reservation.Server(1)
    with pytest.raises(TFOSError, match="boom"):
        s.await_reservations(status={"error": "boom"}, timeout=5)
    with pytest.raises(reservation.ReservationTimeoutError, match="1 of 1 missing"):
        s.await_reservations(timeout=0.2)


# -------------------------------------------------------------------------- util
def test_util_helpers(tmp_path, monkeypatch):
    (tmp_path / "bin").mkdir()
    tool = tmp_path / "bin" / "tool"
    tool.write_text("x")
    assert util.find_in_path(f"/nonexistent{os.pathsep}{tmp_path / 'bin'}", "tool") == str(tool)
    assert util.find_in_path(str(tmp_path), "tool") is False
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="executor_id"):
        util.read_executor_id()
    util.write_executor_id(7)
    assert util.read_executor_id() == 7
    monkeypatch.setenv("TFOS_NODE_HOST", "10.1.2.3")
    assert util.get_ip_address() == "10.1.2.3"


@pytest.fixture
def fake_smi(tmp_path, monkeypatch):
    """A fake nvidia-smi with 3 GPUs; GPU 1 busy."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\n"
        'case "$*" in\n'
        '  *--list-gpus*) echo "GPU 0: Fake (UUID: GPU-a)"; echo "GPU 1: Fake (UUID: GPU-b)"; echo "GPU 2: Fake (UUID: GPU-c)";;\n'
        '  *--query-gpu=index,uuid*) printf "0, GPU-a\\n1, GPU-b\\n2, GPU-c\\n";;\n'
        '  *--query-compute-apps=gpu_uuid,pid*) echo "gpu_uuid, pid"; echo "GPU-b, 42";;\n'
        '  *--query-compute-apps=gpu_uuid*) echo "GPU-b";;\n'
        "esac\n"
    )
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    return smi


def test_gpu_info_with_fake_nvidia_smi(fake_smi, monkeypatch):
    assert gpu_info.is_gpu_available()
    assert gpu_info.get_gpus(2, 0, format=gpu_info.AS_LIST) == ["0", "2"]
    assert gpu_info.get_gpus(1, 1) == "2"
    assert gpu_info.get_gpus(1, 2) == "0"  # wraps around the free GPUs
    assert gpu_info.get_gpus(1, -1, format=gpu_info.AS_STRING) in ("0", "2")
    monkeypatch.setattr(gpu_info, "MAX_RETRIES", 1)
    with pytest.raises(RuntimeError, match="unable to find 3 free GPU"):
        gpu_info.get_gpus(3)
    with pytest.raises(ValueError, match="unknown GPU format"):
        gpu_info.get_gpus(1, format="tuple")


def test_gpu_info_without_nvidia_smi(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert not gpu_info.is_gpu_available()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    util.single_node_env(num_gpus=1)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""


def test_single_node_env_spreads_gpus(fake_smi, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    util.single_node_env(1, worker_index=2, nodes=["h1:1", "h2:1", "h1:2"])  # 2nd node of h1
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2"


# ---------------------------------------------------------------------- pipeline
def test_pipeline_helpers(monkeypatch, tmp_path):
    # bytearray values become str() as in TFoS (its Python 2 heritage: "bytearray(b'b')")
    got = list(pipeline.yield_batch([(1, "a"), (2, bytearray(b"b")), (3, "c")], 2, num_tensors=2))
    assert got == [[[1, 2], ["a", "bytearray(b'b')"]], [[3], ["c"]]]
    assert list(pipeline.yield_batch([(1,), None, (2,)], 5)) == [[[1]]]
    monkeypatch.setattr(sys, "argv", ["x"])
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi: CPU
    pipeline.single_node_env(["prog", "--a", "1"])
    assert sys.argv == ["prog", "--a", "1"] and os.environ["CUDA_VISIBLE_DEVICES"] == ""
    pipeline.single_node_env(pipeline.Namespace({"argv": ["p2"], "num_gpus": 0}))
    assert sys.argv == ["p2"]


def test_has_num_ps_driver_ps_nodes():
    class P(pipeline.HasNumPS):
        pass

    p = P()
    p.setNumPS(2).setDriverPSNodes(True)
    assert p.getNumPS() == 2 and p.getDriverPSNodes() is True


# ------------------------------------------------------------------- TFSparkNode
@pytest.mark.parametrize("name", ["train", "inference", "shutdown"])
def test_tfsparknode_feeding_functions_point_to_tfcluster(name):
    with pytest.raises(TFOSError, match=f"cluster.{name}"):
        getattr(TFSparkNode, name)([], {})


def test_tfsparknode_cluster_spec():
    spec = TFSparkNode._get_cluster_spec(
        [{"executor_id": 0, "job_name": "chief", "host": "a", "port": 1}, {"executor_id": 1, "job_name": "worker", "host": "b", "port": 2}]
    )
    assert spec == {"chief": ["a:1"], "worker": ["b:2"]}
    with pytest.raises(TFOSError, match="duplicate"):
        TFSparkNode._get_cluster_spec([{"executor_id": 0, "job_name": "w", "host": "a", "port": 1}] * 2)


# --------------------------------------------------------------------- Keras default
@pytest.mark.parametrize(
    "node_env, driver, expected",
    [(None, None, None), ("0", None, "0"), (None, "0", "0"), (None, "1", "1"), ("1", "0", "1")],
)
def test_keras_default(monkeypatch, node_env, driver, expected):
    # Keras 3 unless TF_USE_LEGACY_KERAS is chosen: the node's own value wins, then the driver's.
    from tfos._node.keras3_fix import default_legacy_keras as _default_legacy_keras

    if node_env is None:
        monkeypatch.delenv("TF_USE_LEGACY_KERAS", raising=False)
    else:
        monkeypatch.setenv("TF_USE_LEGACY_KERAS", node_env)
    _default_legacy_keras(driver)
    assert os.environ.get("TF_USE_LEGACY_KERAS") == expected


def test_empty_results_answer_an_empty_batch():
    from tfos._data.feed_connection import END_OF_FEED
    from tfos.errors import InferenceResultError

    hub = _FakeHub()
    hub.terminated = set()
    hub.rows_taken = 0
    hub.queues["input"].put(END_OF_FEED)
    feed = TFNode.DataFeed(hub, train_mode=False, timeout_s=5)
    assert feed.next_batch(10) == [] and feed.should_stop()
    feed.batch_results(np.zeros((0, 1)))  # TFoS's loop answers the last, empty batch: no-op
    with pytest.raises(InferenceResultError, match="no inference batch is waiting"):
        feed.batch_results([1])


def test_reservation_non_json_register_leaves_the_connection_in_step(caplog):
    """A reservation that is not JSON raises TypeError on the client and sends nothing: the
    next request on the same connection is answered (no 'replayed or out-of-order' alarm)."""
    s = reservation.Server(1)
    addr = s.start()
    try:
        c = reservation.Client(addr)
        assert c.get_reservations() == []
        with pytest.raises(TypeError):
            c.register({"executor_id": 0, "raw": b"bytes"})
        caplog.set_level(logging.WARNING, logger="tfos")
        assert c.register({"executor_id": 0}) == "OK"
        assert c.get_reservations() == [{"executor_id": 0}]
        assert not [r for r in caplog.records if "out-of-order" in r.getMessage() or "replayed" in r.getMessage()]
        c.close()
    finally:
        s.stop()


@pytest.mark.parametrize("bad, text", [(None, "got NoneType"), ("xxxx", "got str (a string would give one result per character)"),
                                       (b"xx", "got bytes (a string"), (3, "got int, which is not iterable")])
def test_result_items_refuse_what_is_not_one_result_per_row(bad, text):
    """batch_results(None) raised a bare TypeError and batch_results("xxxx") answered one
    row per character; both are InferenceResultError now, saying what was passed."""
    from tfos._data.results import result_items as _result_items
    from tfos.errors import InferenceResultError

    with pytest.raises(InferenceResultError) as info:
        _result_items(bad)
    assert str(info.value).startswith("batch_results() needs one result per input row (a list, tuple, numpy array or tf.Tensor), ")
    assert text in str(info.value)
