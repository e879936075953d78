"""Every public name of TFoS 2.2.5 exists in tfos (module-level names, public methods of its
classes), and the names added for that work: module loggers, TFManager's qdict/kdict,
pipeline's model globals, and reservation.MessageSocket (authenticated, never pickles)."""

from __future__ import annotations

import importlib
import inspect
import os
import socket
import threading

import pytest

from tfos import TFManager, pipeline, reservation
from tfos._common.wire import DataAuthError
from tfos.errors import ConfigurationError

# The public top-level names of each TFoS 2.2.5 module (read from its sources at tag v2.2.5),
# with the public methods of its classes.
TFOS_225 = {
    "TFCluster": {"InputMode": [], "TFCluster": ["inference", "shutdown", "tensorboard_url", "train"], "logger": None,
                  "run": None, "tf_status": None},
    "TFManager": {"TFManager": [], "connect": None, "kdict": None, "mgr": None, "qdict": None, "start": None},
    "TFNode": {"DataFeed": ["batch_results", "next_batch", "should_stop", "terminate"], "batch_results": None,
               "export_saved_model": None, "hdfs_path": None, "logger": None, "next_batch": None, "release_port": None,
               "start_cluster_server": None, "terminate": None},
    "TFParallel": {"logger": None, "run": None},
    "TFSparkNode": {"TFNodeContext": ["absolute_path", "export_saved_model", "get_data_feed", "release_port",
                                      "start_cluster_server"],
                    "TFSparkNode": [], "inference": None, "logger": None, "run": None, "shutdown": None, "train": None},
    "compat": {"disable_auto_shard": None, "export_saved_model": None, "is_gpu_available": None},
    "dfutil": {"fromTFExample": None, "infer_schema": None, "isLoadedDF": None, "loadTFRecords": None, "loadedDF": None,
               "saveAsTFRecords": None, "toTFExample": None},
    "gpu_info": {"AS_LIST": None, "AS_STRING": None, "MAX_RETRIES": None, "get_gpus": None, "is_gpu_available": None,
                 "logger": None},
    "marker": {"EndPartition": [], "Marker": []},
    "pipeline": {
        **{f"Has{p}": [f"get{p}", f"set{p}"] for p in (
            "BatchSize", "ClusterSize", "Epochs", "ExportDir", "GraceSecs", "InputMapping", "InputMode", "MasterNode",
            "ModelDir", "OutputMapping", "Protocol", "Readers", "SignatureDefKey", "Steps", "TFRecordDir", "TagSet",
            "Tensorboard")},
        "HasNumPS": ["getDriverPSNodes", "getNumPS", "setDriverPSNodes", "setNumPS"],
        "Namespace": [], "TFEstimator": [], "TFModel": [], "TFParams": ["merge_args_params"], "TFTypeConverters": ["toDict"],
        "get_meta_graph_def": None, "global_args": None, "global_model": None, "global_sess": None, "logger": None,
        "pred_fn": None, "single_node_env": None, "yield_batch": None,
    },
    "reservation": {"BUFSIZE": None, "Client": ["await_reservations", "close", "get_reservations", "register", "request_stop"],
                    "MAX_RETRIES": None, "MessageSocket": ["receive", "send"],
                    "Reservations": ["add", "done", "get", "remaining"],
                    "Server": ["await_reservations", "get_server_ip", "get_server_ports", "start", "start_listening_socket",
                               "stop"],
                    "TFOS_SERVER_HOST": None, "TFOS_SERVER_PORT": None, "logger": None},
    "util": {"find_in_path": None, "get_ip_address": None, "logger": None, "read_executor_id": None,
             "single_node_env": None, "write_executor_id": None},
}


def test_every_tfos_2_2_5_public_name_exists():
    missing = []
    for mod_name, names in TFOS_225.items():
        mod = importlib.import_module(f"tfos.{mod_name}")
        for name, methods in names.items():
            if not hasattr(mod, name):
                missing.append(f"{mod_name}.{name}")
                continue
            missing += [f"{mod_name}.{name}.{m}" for m in methods or [] if not hasattr(getattr(mod, name), m)]
    assert missing == []


def test_module_loggers_are_the_modules_loggers():
    from tfos import TFCluster, TFNode, TFParallel, TFSparkNode, gpu_info, util

    for mod in (TFNode, TFSparkNode, gpu_info, pipeline, reservation, util):
        assert mod.logger.name == mod.__name__
    # the cluster's logs come from the driver plane: its parent logger
    assert TFCluster.logger.name == TFParallel.logger.name == "tfos._driver"
    import logging

    assert logging.getLogger("tfos._driver.cluster").parent is TFCluster.logger


def test_tfmanager_qdict_kdict_are_the_server_dicts():
    assert TFManager.qdict is TFManager._queues and TFManager.kdict is TFManager._state
    TFManager._init_server(["input", "output"])
    try:
        assert sorted(TFManager.qdict) == ["input", "output"]
        TFManager._set("state", "running")
        assert TFManager.kdict == {"state": "running"}
    finally:
        TFManager._init_server([])
    assert TFManager.qdict == {} and TFManager.kdict == {}


def test_pipeline_model_globals_start_empty():
    import subprocess
    import sys

    code = "from tfos import pipeline as p; print((p.pred_fn, p.global_sess, p.global_args, p.global_model))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "(None, None, None, None)", out.stderr[-2000:]


@pytest.mark.tf
def test_pipeline_model_globals_name_the_last_loaded_signature(tmp_path, monkeypatch):
    import tensorflow as tf

    class Plus1(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, 2], tf.float32)])
        def serve(self, x):
            return {"y": x + 1.0}

    m = Plus1()
    tf.saved_model.save(m, str(tmp_path), signatures={"serving_default": m.serve})
    from tfos._pipeline import runner

    monkeypatch.setattr(runner, "_model_cache", {})
    fn = runner._load_signature(str(tmp_path), "serve", "serving_default")
    assert pipeline.pred_fn is fn and pipeline.global_model is not None
    assert pipeline.global_model.signatures["serving_default"] is fn
    rows = list(runner.run_model(iter([([1.0, 2.0],), ([3.0, 4.0],)]), {
        "export_dir": str(tmp_path), "tag_set": "serve", "signature_def_key": "serving_default", "inputs": ["x"],
        "outputs": ["y"], "batch_size": 2}))
    assert [list(map(float, r[0])) for r in rows] == [[2.0, 3.0], [4.0, 5.0]]
    assert pipeline.global_args["export_dir"] == str(tmp_path)


# ------------------------------------------------------------------ MessageSocket
def _serve(ms, sock, out):
    try:
        msg = ms.receive(sock)
        out.append(msg)
        ms.send(sock, {"got": msg})
    except Exception as exc:  # noqa: BLE001 - the test reads it
        out.append(exc)
    finally:
        sock.close()


def test_message_socket_request_reply_json():
    key = os.urandom(32)
    a, b = socket.socketpair()
    out: list = []
    t = threading.Thread(target=_serve, args=(reservation.MessageSocket(key, timeout_s=10), b, out))
    t.start()
    cli = reservation.MessageSocket(key, timeout_s=10)
    cli.send(a, ("register", {"host": "h1", "port": 2222, "x": 1.5}))
    assert cli.receive(a) == {"got": ["register", {"host": "h1", "port": 2222, "x": 1.5}]}
    t.join(10)
    assert out == [["register", {"host": "h1", "port": 2222, "x": 1.5}]]
    a.close()


def test_message_socket_refuses_a_wrong_key_before_reading_a_message():
    a, b = socket.socketpair()
    out: list = []
    t = threading.Thread(target=_serve, args=(reservation.MessageSocket(os.urandom(32), timeout_s=10), b, out))
    t.start()
    with pytest.raises(DataAuthError, match="did not prove it holds the key"):  # the server refuses the proof
        reservation.MessageSocket(os.urandom(32), timeout_s=10).send(a, "hello")
    t.join(10)
    assert len(out) == 1 and isinstance(out[0], DataAuthError)
    a.close()


def test_message_socket_refuses_a_replayed_frame():
    """A frame recorded from one connection and sent again (same connection or another)
    fails its tag; nothing of it is parsed."""
    key = os.urandom(32)
    a, b = socket.socketpair()
    tap: list = []
    real_sendall = a.sendall  # the handshake

    class Tap:
        def __getattr__(self, name):
            return getattr(a, name)

        def sendall(self, data):
            tap.append(bytes(data))
            return real_sendall(data)

        def send(self, data):
            n = a.send(data)
            tap.append(bytes(data[:n]))
            return n

    out: list = []

    def serve_two():
        ms = reservation.MessageSocket(key, timeout_s=5)
        try:
            out.append(ms.receive(b))
            out.append(ms.receive(b))
        except Exception as exc:  # noqa: BLE001
            out.append(exc)
        finally:
            b.close()

    t = threading.Thread(target=serve_two)
    t.start()
    cli = reservation.MessageSocket(key, timeout_s=5)
    cli.send(Tap(), {"n": 1})  # handshake answer and the frame go through the tap
    a.sendall(tap[-1])  # the same frame again
    t.join(10)
    assert out[0] == {"n": 1} and isinstance(out[1], DataAuthError), out
    a.close()


def test_message_socket_needs_a_key_and_json():
    with pytest.raises(ConfigurationError, match="unauthenticated pickle transport is not offered"):
        reservation.MessageSocket()
    with pytest.raises(ConfigurationError):
        reservation.MessageSocket(b"short")
    a, b = socket.socketpair()
    with pytest.raises(TypeError):
        reservation.MessageSocket(os.urandom(32), timeout_s=1).send(a, object())
    with pytest.raises(ValueError, match="max_bytes"):
        reservation.MessageSocket(os.urandom(32), timeout_s=1, max_bytes=10).send(a, "x" * 100)
    a.close()
    b.close()


def test_message_socket_receive_has_a_deadline():
    from tfos.errors import DeadlineExceededError

    a, b = socket.socketpair()
    with pytest.raises(DeadlineExceededError):
        reservation.MessageSocket(os.urandom(32), timeout_s=0.5).receive(b)  # the peer never answers the handshake
    a.close()
    b.close()


def test_message_socket_signature_keeps_tfos_method_names():
    assert list(inspect.signature(reservation.MessageSocket.send).parameters) == ["self", "sock", "msg"]
    assert list(inspect.signature(reservation.MessageSocket.receive).parameters) == ["self", "sock"]


def test_tf1_export_names_a_signature_without_inputs_or_outputs(tmp_path):
    from tfos import TFNode

    with pytest.raises(ValueError, match="at least one signature"):
        TFNode.export_saved_model(None, str(tmp_path / "m"), "serve", {})
    with pytest.raises(ValueError, match=r"signature 'predict' needs 'inputs' as a dict"):
        TFNode.export_saved_model(None, str(tmp_path / "m"), "serve", {"predict": {"outputs": {}}})
    with pytest.raises(ValueError, match=r"signature 'p' needs 'inputs' and 'outputs'"):
        TFNode.export_saved_model(None, str(tmp_path / "m"), "serve", {"p": {}})


def _pair_after_first_message(key: bytes, timeout_s: float = 5.0, server_max: int = 1 << 20):
    """A socketpair whose MessageSocket handshake is done (one message each way)."""
    a, b = socket.socketpair()
    cli = reservation.MessageSocket(key, timeout_s=timeout_s)
    srv = reservation.MessageSocket(key, timeout_s=timeout_s, max_bytes=server_max)
    t = threading.Thread(target=lambda: srv.receive(b))
    t.start()
    cli.send(a, "hello")
    t.join(10)
    return a, b, cli, srv


def test_message_socket_send_keeps_its_deadline_for_large_messages():
    """A peer that stops reading holds send() no longer than timeout_s, whatever the size."""
    import time

    from tfos.errors import DeadlineExceededError

    a, b, cli, srv = _pair_after_first_message(os.urandom(32), timeout_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceededError, match="sent"):
        cli.send(a, "x" * 900_000)  # far more than the socket buffers hold; nobody reads
    assert time.monotonic() - t0 < 3.0
    with pytest.raises(ConnectionError, match="unusable after an earlier error"):
        cli.send(a, "again")  # half a frame went out: the connection is done
    a.close()
    b.close()


def test_message_socket_connection_is_unusable_after_a_refused_frame():
    a, b, cli, srv = _pair_after_first_message(os.urandom(32), server_max=100)
    cli.send(a, "y" * 200)
    with pytest.raises(ConnectionError, match="exceeds the cap of 100 bytes"):
        srv.receive(b)
    cli.send(a, "small")
    with pytest.raises(ConnectionError, match="unusable after an earlier error"):
        srv.receive(b)  # never reads the rest of the stream as a new frame
    a.close()
    b.close()


def test_message_socket_refuses_messages_json_would_change_and_stays_usable():
    a, b, cli, srv = _pair_after_first_message(os.urandom(32))
    with pytest.raises(TypeError, match="dict keys must be str"):
        cli.send(a, {1: "int", "1": "str"})
    deep: list = []
    for _ in range(100):
        deep = [deep]
    with pytest.raises(ValueError, match="nests deeper"):
        cli.send(a, deep)
    with pytest.raises(ValueError):
        cli.send(a, float("nan"))
    cli.send(a, {"ok": [1, 2.5, None, True, "s"]})  # nothing was sent for the refused ones
    assert srv.receive(b) == {"ok": [1, 2.5, None, True, "s"]}
    a.close()
    b.close()


def test_message_socket_both_ends_sending_first_end_at_the_deadline_and_say_why():
    from tfos.errors import DeadlineExceededError

    key = os.urandom(32)
    a, b = socket.socketpair()
    errs: list = []
    t = threading.Thread(target=lambda: errs.append(pytest.raises(DeadlineExceededError, reservation.MessageSocket(key, timeout_s=1).send, b, 1)))
    t.start()
    with pytest.raises(DeadlineExceededError, match=r"both ends calling send\(\) first"):
        reservation.MessageSocket(key, timeout_s=1).send(a, 1)
    t.join(10)
    a.close()
    b.close()


def test_message_socket_no_deadline_and_bad_settings():
    import math

    a, b, cli, srv = _pair_after_first_message(os.urandom(32))
    inf_cli = reservation.MessageSocket(os.urandom(32), timeout_s=math.inf)
    assert inf_cli.timeout_s == math.inf
    cli.timeout_s = math.inf  # an existing connection, no deadline: no OverflowError from settimeout
    cli.send(a, 7)
    assert srv.receive(b) == 7
    for kwargs in ({"timeout_s": 0}, {"timeout_s": -1}, {"max_bytes": 0}, {"max_bytes": 15}):
        with pytest.raises(ConfigurationError):
            reservation.MessageSocket(os.urandom(32), **kwargs)
    a.close()
    b.close()


def test_message_socket_keeps_no_key_bytes_in_its_attributes():
    key = os.urandom(32)
    ms = reservation.MessageSocket(key)
    dumped = repr(vars(ms)) + repr(ms)
    import hashlib
    import hmac

    derived = hmac.new(key, reservation.MessageSocket._CONTEXT, hashlib.sha256).digest()
    assert key.hex() not in dumped and repr(key) not in dumped and repr(derived) not in dumped


def _fork_child_send(before_fork: str) -> str:
    """Runs, in a fresh interpreter: a handshaken MessageSocket pair, ``before_fork`` in the
    parent, then a fork whose child sends on the parent's connection; returns what the child
    reported ("sent" or "refused: <message>")."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        """
        import os, socket, threading, time
        from tfos import reservation
        from tfos.errors import TFOSError
        key = os.urandom(32)
        a, b = socket.socketpair()
        cli, srv = reservation.MessageSocket(key, timeout_s=5), reservation.MessageSocket(key, timeout_s=5)
        t = threading.Thread(target=lambda: srv.receive(b)); t.start()
        cli.send(a, "parent"); t.join()
        BEFORE_FORK
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                cli.send(a, "child")
                os.write(w, b"sent")
            except TFOSError as exc:
                os.write(w, ("refused: " + str(exc)).encode())
            os._exit(0)
        os.waitpid(pid, 0)
        print(os.read(r, 4096).decode())
        """
    ).replace("BEFORE_FORK", before_fork)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    return out.stdout + out.stderr[-2000:]


def test_message_socket_connection_belongs_to_its_process():
    """A forked child must not reuse the parent's session (AES-GCM nonce reuse)."""
    out = _fork_child_send("pass")
    assert out.startswith("refused: MessageSocket: this connection was set up before a fork"), out


def test_message_socket_waits_whole_deadlines_longer_than_one_socket_timeout(monkeypatch):
    """Deadlines past one socket-timeout slice (one hour; 0.2 s here) are waited in full."""
    import time

    from tfos._common import wire

    monkeypatch.setattr(wire, "RECV_SLICE_S", 0.2)
    a, b, cli, srv = _pair_after_first_message(os.urandom(32))
    srv.timeout_s = 3.0
    t = threading.Thread(target=lambda: (time.sleep(0.8), cli.send(a, "late")))
    t.start()
    assert srv.receive(b) == "late"
    t.join(10)
    a.close()
    b.close()


def test_message_socket_calls_on_one_socket_take_turns_and_restore_its_timeout():
    import time

    key = os.urandom(32)
    a, b, cli, srv = _pair_after_first_message(key)
    a.settimeout(None)
    got: list = []
    reader = threading.Thread(target=lambda: got.append(cli.receive(a)))
    reader.start()  # waits for the server's message, holding the socket
    time.sleep(0.2)
    sender = threading.Thread(target=lambda: cli.send(a, "request"))
    sender.start()  # waits its turn (within its deadline)
    time.sleep(0.2)
    srv.send(b, "reply")
    reader.join(10)
    sender.join(10)
    assert got == ["reply"] and srv.receive(b) == "request"
    assert a.gettimeout() is None  # the user's blocking socket stays blocking
    a.close()
    b.close()


def test_message_socket_interrupted_handshake_leaves_the_connection_unusable(monkeypatch):
    from tfos._common import wire

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    a, b = socket.socketpair()
    ms = reservation.MessageSocket(os.urandom(32), timeout_s=1)
    monkeypatch.setattr(wire, "client_handshake", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ms.send(a, 1)
    monkeypatch.undo()
    with pytest.raises(ConnectionError, match="unusable"):
        ms.send(a, 1)
    a.close()
    b.close()


def test_message_socket_fork_while_another_thread_holds_the_socket():
    """The child neither deadlocks on the parent's lock nor reuses the parent's session."""
    # a thread of the parent holds the socket's lock, waiting for a reply, when it forks
    out = _fork_child_send("holder = threading.Thread(target=lambda: cli.receive(a), daemon=True); holder.start(); time.sleep(0.2)")
    assert out.startswith("refused: MessageSocket: this connection was set up before a fork"), out


def test_message_socket_settings_are_checked():
    import math

    assert reservation.MessageSocket(os.urandom(32), timeout_s=None).timeout_s == math.inf
    for kwargs in ({"timeout_s": "5"}, {"timeout_s": True}, {"timeout_s": math.nan}, {"max_bytes": math.inf},
                   {"max_bytes": 16.9}, {"max_bytes": "64"}, {"max_bytes": 1 << 31}):
        with pytest.raises(ConfigurationError):
            reservation.MessageSocket(os.urandom(32), **kwargs)
