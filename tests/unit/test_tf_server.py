"""Tests for tfos.tf_server (TF-process-side server helpers).

TF tests skip when TensorFlow is not installed. The whole file takes well under
a minute: one in-process TF import plus one ps/worker subprocess pair.
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from tfos.errors import TFOSError  # noqa: E402
from tfos.tf_server import (  # noqa: E402
    PortUnavailableError,
    ProtocolUnavailableError,
    node_cluster,
    reservation_compatible,
    run_server_and_wait,
    shard_files,
    start_cluster_server,
    worker_rank,
)


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def _reserve_port(host: str = "") -> socket.socket:
    """A reservation socket like tfos makes: REUSEADDR+REUSEPORT, bound, not listening."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, 0))
    return sock


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _is_listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            return True
    except OSError:
        return False


@dataclass
class FakeCtx:
    """Stand-in for the tfos node context."""

    job_name: str
    task_index: int
    cluster_spec: dict[str, list[str]]
    executor_id: int = 0
    num_workers: int = 1
    reserved_port_socket: socket.socket | None = None
    stop_event: threading.Event | None = None
    release_calls: int = 0
    listening_at_release: list[bool] = field(default_factory=list)

    def release_port(self) -> None:
        self.release_calls += 1
        if self.reserved_port_socket is not None:
            port = self.reserved_port_socket.getsockname()[1]
            self.listening_at_release.append(_is_listening(port))
            self.reserved_port_socket.close()
            self.reserved_port_socket = None


def _single_node_ctx(job: str = "worker", sock: socket.socket | None = None, port: int | None = None) -> FakeCtx:
    if port is None:
        assert sock is not None
        port = sock.getsockname()[1]
    return FakeCtx(job, 0, {job: [f"localhost:{port}"]}, reserved_port_socket=sock)


CLUSTER = {
    "chief": ["h0:1000"],
    "worker": ["h1:1001", "h2:1002", "h3:1003"],
    "ps": ["h4:1004"],
    "evaluator": ["h5:1005"],
}


@pytest.fixture(scope="module")
def tf():
    return pytest.importorskip("tensorflow")


# ---------------------------------------------------------------------------
# worker_rank / node_cluster (no TF)
# ---------------------------------------------------------------------------


def test_worker_rank_chief_first_then_workers_shift_by_one():
    assert worker_rank(FakeCtx("chief", 0, CLUSTER)) == 0
    assert [worker_rank(FakeCtx("worker", i, CLUSTER)) for i in range(3)] == [1, 2, 3]


def test_worker_rank_without_chief_and_with_master():
    spec = {"worker": ["a:1", "b:2"], "ps": ["c:3"]}
    assert [worker_rank(FakeCtx("worker", i, spec)) for i in range(2)] == [0, 1]
    spec = {"master": ["m:1"], "worker": ["a:1", "b:2"]}
    assert worker_rank(FakeCtx("master", 0, spec)) == 0
    assert worker_rank(FakeCtx("worker", 1, spec)) == 2


@pytest.mark.parametrize("job", ["ps", "evaluator"])
def test_worker_rank_rejects_non_data_nodes(job):
    with pytest.raises(ValueError, match="no worker rank"):
        worker_rank(FakeCtx(job, 0, CLUSTER))


def test_worker_rank_rejects_out_of_range_task():
    with pytest.raises(ValueError, match="out of range"):
        worker_rank(FakeCtx("worker", 3, CLUSTER))


def test_node_cluster_excludes_evaluator_for_training_nodes():
    for job in ("chief", "worker", "ps"):
        assert node_cluster(FakeCtx(job, 0, CLUSTER)) == {
            k: v for k, v in CLUSTER.items() if k != "evaluator"
        }
    assert node_cluster(FakeCtx("evaluator", 0, CLUSTER)) == {"evaluator": ["h5:1005"]}


def test_node_cluster_rejects_inconsistent_ctx():
    with pytest.raises(ValueError, match="not in the cluster spec"):
        node_cluster(FakeCtx("master", 0, CLUSTER))
    with pytest.raises(ValueError, match="out of range"):
        node_cluster(FakeCtx("ps", 1, CLUSTER))


def test_module_imports_and_shards_without_tensorflow(tmp_path):
    for i in range(4):
        (tmp_path / f"part-{i}").write_text("x")
    code = textwrap.dedent(
        f"""
        import sys
        sys.modules["tensorflow"] = None  # any import of TF now fails
        sys.path.insert(0, {str(REPO_ROOT)!r})
        from tfos.tf_server import shard_files
        print(",".join(p.rsplit("/", 1)[1] for p in shard_files(1, {str(tmp_path / "part-*")!r}, 2)))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "part-1,part-3"


# ---------------------------------------------------------------------------
# shard_files
# ---------------------------------------------------------------------------


@pytest.fixture()
def files(tmp_path):
    # Created out of order to check sorting.
    names = [f"part-{i:05d}.tfrecord" for i in (3, 0, 6, 1, 4, 2, 5)]
    for name in names:
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "_SUCCESS").write_bytes(b"")
    return tmp_path


def _names(paths):
    return [os.path.basename(p) for p in paths]


@pytest.mark.parametrize("use_tf", [True, False], ids=["tf-gfile", "glob-fallback"])
def test_shard_files_ctx_round_robin_over_sorted_files(files, monkeypatch, use_tf):
    if use_tf:
        pytest.importorskip("tensorflow")
    else:
        monkeypatch.setitem(sys.modules, "tensorflow", None)
    pattern = str(files / "part-*")
    spec = {"chief": ["c:1"], "worker": ["w:1", "w:2"], "ps": ["p:1"]}
    shards = [shard_files(FakeCtx("chief", 0, spec), pattern)]
    shards += [shard_files(FakeCtx("worker", i, spec), pattern) for i in range(2)]
    assert _names(shards[0]) == ["part-00000.tfrecord", "part-00003.tfrecord", "part-00006.tfrecord"]
    assert _names(shards[1]) == ["part-00001.tfrecord", "part-00004.tfrecord"]
    assert _names(shards[2]) == ["part-00002.tfrecord", "part-00005.tfrecord"]
    # Disjoint and complete.
    union = sorted(p for s in shards for p in s)
    assert union == sorted(str(files / f"part-{i:05d}.tfrecord") for i in range(7))


def test_shard_files_int_rank_and_list_input(files, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorflow", None)
    listing = [str(files / "part-00006.tfrecord"), str(files / "part-0000[0-2].tfrecord"), "hdfs://nn/x"]
    # Literal entries are kept verbatim, patterns expanded, then sorted:
    # [.../part-00000, .../part-00001, .../part-00002, .../part-00006, hdfs://nn/x]
    assert _names(shard_files(0, listing, num_workers=2)) == ["part-00000.tfrecord", "part-00002.tfrecord", "x"]
    assert shard_files(0, listing, num_workers=2)[-1] == "hdfs://nn/x"
    assert _names(shard_files(1, listing, num_workers=2)) == ["part-00001.tfrecord", "part-00006.tfrecord"]


def test_shard_files_too_few_files_is_actionable(files, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorflow", None)
    with pytest.raises(ValueError, match=r"only 7 input file\(s\) for 8 workers.*at least as many files"):
        shard_files(0, str(files / "part-*"), num_workers=8)
    with pytest.raises(ValueError, match="no input files match"):
        shard_files(0, str(files / "nothing-*"), num_workers=1)
    with pytest.raises(ValueError, match="needs num_workers"):
        shard_files(0, str(files / "part-*"))
    with pytest.raises(ValueError, match="out of range"):
        shard_files(2, str(files / "part-*"), num_workers=2)


# ---------------------------------------------------------------------------
# Port hand-over (in-process TF servers: TF allows several per process; they
# live until the pytest process exits)
# ---------------------------------------------------------------------------


def test_reservation_compatible():
    sock = _reserve_port()
    assert reservation_compatible(sock)
    sock.listen(1)
    assert not reservation_compatible(sock)  # a listener blocks gRPC's bind
    sock.close()
    assert not reservation_compatible(sock)
    plain = socket.socket()
    plain.bind(("", 0))
    assert not reservation_compatible(plain)  # no SO_REUSEADDR
    plain.close()
    assert not reservation_compatible(None)


@pytest.mark.parametrize("host", ["", "127.0.0.1"])
def test_server_starts_while_reservation_held_then_releases(tf, host):
    sock = _reserve_port(host)
    ctx = _single_node_ctx("worker", sock)
    cluster, server = start_cluster_server(ctx, num_gpus=0)
    # release_port() ran once, and only after TF was already listening: no race window.
    assert ctx.listening_at_release == [True]
    assert ctx.release_calls == 1
    assert sock.fileno() == -1
    assert cluster.as_dict() == ctx.cluster_spec
    with tf.compat.v1.Session(server.target) as sess:
        assert sess.run(tf.constant(20) + 22) == 42


def test_incompatible_reservation_is_swapped_for_placeholder(tf):
    plain = socket.socket()  # no SO_REUSEADDR: gRPC could not bind next to it
    plain.bind(("", 0))
    port = plain.getsockname()[1]
    ctx = _single_node_ctx("ps", plain)
    start_cluster_server(ctx)
    assert ctx.listening_at_release == [False]  # released before the server started
    assert plain.fileno() == -1
    assert _is_listening(port)


def test_tf_raises_not_aborts_when_port_listened_on(tf):
    """Documents TF 2.21: a taken port raises UnknownError; the process survives."""
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        spec = tf.train.ClusterSpec({"worker": [f"localhost:{port}"]})
        with pytest.raises(tf.errors.UnknownError, match="Could not start gRPC server"):
            tf.distribute.Server(spec, job_name="worker", task_index=0, start=True)


def test_tf_grpc_does_not_share_port_via_so_reuseport(tf):
    """Documents TF 2.21: its gRPC listener has SO_REUSEADDR but not SO_REUSEPORT."""
    ctx = _single_node_ctx("worker", _reserve_port())
    port = ctx.reserved_port_socket.getsockname()[1]
    start_cluster_server(ctx)
    for family, addr in ((socket.AF_INET, ""), (socket.AF_INET6, "::")):
        with socket.socket(family) as other:
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            with pytest.raises(OSError):
                other.bind((addr, port))


def test_taken_port_raises_clear_error_after_bounded_retries(tf):
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen(1)
        ctx = _single_node_ctx("worker", port=taken.getsockname()[1])
        start = time.monotonic()
        with pytest.raises(PortUnavailableError, match=r"after 3 attempt\(s\)"):
            start_cluster_server(ctx, max_attempts=3, retry_backoff_s=0.05)
        assert 0.15 <= time.monotonic() - start < 5  # backoff 0.05 + 0.1 s


def test_retry_succeeds_when_port_frees_up(tf):
    taken = socket.socket()
    taken.bind(("", 0))
    taken.listen(1)
    ctx = _single_node_ctx("worker", port=taken.getsockname()[1])
    threading.Timer(0.2, taken.close).start()
    _, server = start_cluster_server(ctx, max_attempts=4, retry_backoff_s=0.3)
    assert _is_listening(int(server.target.rsplit(":", 1)[1]))


def test_rdma_gives_clear_error(tf):
    ctx = _single_node_ctx("worker", _reserve_port())
    with pytest.raises(ProtocolUnavailableError, match="grpc\\+verbs.*not available") as info:
        start_cluster_server(ctx, rdma=True)
    assert "GRPC_SERVER" in str(info.value)  # names what this TF build does have
    assert isinstance(info.value, TFOSError) and isinstance(info.value, RuntimeError)
    again = pickle.loads(pickle.dumps(info.value))  # survives the trip to the driver
    assert type(again) is ProtocolUnavailableError and str(again) == str(info.value)


# ---------------------------------------------------------------------------
# run_server_and_wait
# ---------------------------------------------------------------------------


def test_run_server_and_wait_returns_on_stop_event(tf):
    ctx = _single_node_ctx("ps", _reserve_port())
    port = ctx.reserved_port_socket.getsockname()[1]
    stop = threading.Event()
    seen: list[bool] = []

    def probe_then_stop() -> None:
        seen.append(_is_listening(port))
        stop.set()

    threading.Timer(0.3, probe_then_stop).start()
    start = time.monotonic()
    assert run_server_and_wait(ctx, stop, timeout_s=30, poll_interval_s=0.05) is True
    assert time.monotonic() - start < 5
    assert seen == [True]
    assert ctx.listening_at_release == [True]


def test_run_server_and_wait_defaults_to_ctx_stop_event(tf):
    ctx = _single_node_ctx("worker", _reserve_port())
    ctx.stop_event = threading.Event()
    threading.Timer(0.2, ctx.stop_event.set).start()
    assert run_server_and_wait(ctx, timeout_s=30, poll_interval_s=0.05) is True


def test_run_server_and_wait_times_out(tf):
    ctx = _single_node_ctx("worker", _reserve_port())
    start = time.monotonic()
    assert run_server_and_wait(ctx, threading.Event(), timeout_s=0.3) is False
    assert 0.3 <= time.monotonic() - start < 5


# ---------------------------------------------------------------------------
# TF1-style between-graph ps + worker in two subprocesses
# ---------------------------------------------------------------------------

_NODE_SCRIPT = textwrap.dedent(
    """
    import json, os, socket, sys
    sys.path.insert(0, os.environ["TFOS_REPO"])
    from tfos.tf_server import start_cluster_server

    job, cluster = sys.argv[1], json.loads(sys.argv[2])

    class Ctx:
        executor_id, task_index, num_workers = 0, 0, 1
        job_name, cluster_spec = job, cluster
        def __init__(self):
            port = int(cluster[job][0].rsplit(":", 1)[1])
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            s.bind(("", port))
            self.reserved_port_socket = s
        def release_port(self):
            if self.reserved_port_socket is not None:
                self.reserved_port_socket.close()
                self.reserved_port_socket = None

    import tensorflow as tf
    tf.compat.v1.disable_eager_execution()
    cluster_spec, server = start_cluster_server(Ctx(), num_gpus=0)
    if job == "ps":
        print("PS_READY", flush=True)
        server.join()

    v1 = tf.compat.v1
    with tf.Graph().as_default():
        with v1.device(v1.train.replica_device_setter(
                worker_device="/job:worker/task:0", cluster=cluster_spec)):
            global_step = v1.train.get_or_create_global_step()
            x = v1.placeholder(tf.float32, [None, 1])
            y = v1.placeholder(tf.float32, [None, 1])
            w = v1.get_variable("w", [1, 1], initializer=v1.zeros_initializer())
            b = v1.get_variable("b", [1], initializer=v1.zeros_initializer())
            loss = tf.reduce_mean(tf.square(tf.matmul(x, w) + b - y))
            train_op = v1.train.GradientDescentOptimizer(0.1).minimize(loss, global_step=global_step)
        import numpy as np
        rng = np.random.default_rng(0)
        xs = rng.uniform(-1, 1, (64, 1)).astype("float32")
        ys = 3 * xs + 2
        losses = []
        hooks = [v1.train.StopAtStepHook(last_step=30)]
        with v1.train.MonitoredTrainingSession(master=server.target, is_chief=True, hooks=hooks,
                                               save_checkpoint_secs=None, save_summaries_steps=None,
                                               log_step_count_steps=None) as sess:
            while not sess.should_stop():
                _, l, step = sess.run([train_op, loss, global_step], {x: xs, y: ys})
                losses.append(float(l))
        print("RESULT " + json.dumps({"losses": losses, "step": int(step),
                                      "gs_device": global_step.device, "w_device": w.device}), flush=True)
    os._exit(0)
    """
)


def test_tf1_between_graph_ps_worker_subprocesses(tf, tmp_path):
    script = tmp_path / "node.py"
    script.write_text(_NODE_SCRIPT)
    cluster = {"ps": [f"localhost:{_free_port()}"], "worker": [f"localhost:{_free_port()}"]}
    env = dict(os.environ, TFOS_REPO=str(REPO_ROOT), TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    args = [json.dumps(cluster)]
    ps = subprocess.Popen([sys.executable, str(script), "ps", *args], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        worker = subprocess.run([sys.executable, str(script), "worker", *args], env=env,
                                capture_output=True, text=True, timeout=90)
        assert worker.returncode == 0, worker.stderr[-3000:]
        line = next(l for l in worker.stdout.splitlines() if l.startswith("RESULT "))
        result = json.loads(line[len("RESULT "):])
        assert len(result["losses"]) == 30  # StopAtStepHook(last_step=30) on the ps-held step
        assert result["step"] in (29, 30)  # fetched concurrently with its increment
        assert result["losses"][-1] < 0.1 * result["losses"][0]
        assert "/job:ps/task:0" in result["gs_device"]
        assert "/job:ps/task:0" in result["w_device"]
        assert ps.poll() is None  # the ps serves until killed
    finally:
        ps.kill()  # by PID, via the Popen handle
        ps.wait(timeout=30)
