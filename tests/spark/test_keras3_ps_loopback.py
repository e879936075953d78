"""Keras 3 ``model.fit`` under ParameterServerStrategy with tfos's fix: 1 ps + 2 workers + a
coordinator on loopback (no Spark).

The ps and workers run ``keras3_ps_cases.py server`` (TensorFlow's PS tutorial: a server and
``join()``); the coordinator first runs with the fix off (``TFOS_KERAS3_FIX=0``: Keras 3's own
error), then with it, against the same servers. One run feeds every test below.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.tf, pytest.mark.timeout(900)]

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import keras3_ps_cases as cases  # noqa: E402

RUN_TIMEOUT_S = 600
#: Accuracy on the 1,024 held-out rows (chance 0.5; a linear model of the ids cannot learn the xor).
MIN_ACCURACY = 0.9
#: Keras 3's own errors without the fix: for a tf.data.Dataset, and for a dataset function.
KERAS_ERROR = "ValueError: To use this dataset, you need to pass this dataset to ClusterCoordinator.create_per_worker_dataset"
KERAS_FN_ERROR = "ValueError: Unrecognized data type: x=<function"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    from tfos._node.tf_process import reserve_port

    out = tmp_path_factory.mktemp("keras3ps")
    held = [reserve_port("127.0.0.1") for _ in range(4)]  # gRPC binds them anyway (see reserve_port)
    addr = [f"127.0.0.1:{s.getsockname()[1]}" for s in held]
    cluster = {"ps": addr[:1], "worker": addr[1:3], "chief": addr[3:]}
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(HERE)), os.environ.get("PYTHONPATH")])))
    env.pop("TF_USE_LEGACY_KERAS", None)

    def start(args, task, index, name, extra=None):
        penv = dict(env, TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": task, "index": index}}), **(extra or {}))
        log = open(out / f"{name}.log", "w")
        return subprocess.Popen([sys.executable, os.path.join(HERE, "keras3_ps_cases.py")] + args, cwd=str(out), env=penv,
                                stdout=log, stderr=subprocess.STDOUT), log

    servers = {name: start(["server"], task, i, name) for name, task, i in (("ps0", "ps", 0), ("worker0", "worker", 0), ("worker1", "worker", 1))}
    results = {}
    try:
        for name, extra in (("off", {"TFOS_KERAS3_FIX": "0"}), ("on", {"KILL_WORKER_PID": str(servers["worker1"][0].pid)})):
            (out / name).mkdir()
            proc, log = start(["coordinator", str(out / name / "result.json")], "chief", 0, f"coordinator-{name}", extra)
            try:
                proc.wait(RUN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
            log.close()
            text = (out / f"coordinator-{name}.log").read_text()
            assert proc.returncode == 0 and (out / name / "result.json").exists(), f"coordinator ({name}) exited with {proc.returncode}:\n{text[-8000:]}"
            results[name] = json.loads((out / name / "result.json").read_text())
            results[name]["log"] = text
    finally:
        for proc, log in servers.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            log.close()
        for sock in held:
            sock.close()
    time.sleep(0)
    return results


def test_without_the_fix_keras3_fit_raises_its_own_error(runs):
    assert runs["off"]["fit_error"].startswith(KERAS_FN_ERROR), runs["off"]
    assert runs["off"]["fit_dataset_error"].startswith(KERAS_ERROR), runs["off"]


def test_a_sharded_embedding_learns_the_task_on_the_ps(runs):
    on = runs["on"]
    assert on["evaluate"]["accuracy"] >= MIN_ACCURACY, on["evaluate"]
    assert on["evaluate_final"]["accuracy"] >= MIN_ACCURACY, on["evaluate_final"]
    history = on["history"]
    assert len(history["loss"]) == cases.EPOCHS and history["loss"][-1] < history["loss"][0], history
    assert set(history) == {"loss", "accuracy", "val_loss", "val_accuracy"}
    # Every variable lives on the ps task; the embedding is split into two shards there.
    embedding = [path for path in on["devices"] if "embedding" in path]
    assert len(embedding) == 1 and len(on["devices"][embedding[0]]) == 2, on["devices"]
    for path, devices in on["devices"].items():
        assert all(d.startswith("/job:ps/replica:0/task:0") for d in devices), (path, devices)


def test_every_worker_ran_steps_and_every_step_counted(runs):
    on = runs["on"]
    total = cases.EPOCHS * cases.STEPS
    assert on["iterations_after_fit"] == total  # every scheduled step updated the ps once
    steps = {int(k): v for k, v in on["steps_by_worker"].items()}
    assert sorted(steps) == [0, 1] and sum(steps.values()) == total and min(steps.values()) > 0, steps
    # The metrics on the ps counted every row of the last fit's epoch (3,072 rows), whatever worker ran it.
    assert on["metric_counts"] == {"loss/count": 3072.0, "accuracy/count": 3072.0}, on["metric_counts"]


def test_a_worker_killed_mid_epoch_does_not_stop_training(runs):
    after = runs["on"]["after_kill"]
    assert runs["on"]["killed_at_step"] == 7  # the batch-end of steps 6-7 (steps_per_execution=2)
    total = cases.EPOCHS * cases.STEPS + cases.STEPS
    assert after["iterations"] == total, after  # every step of the epoch ran, on the worker left
    assert sum(after["steps_by_worker"].values()) >= cases.STEPS and after["steps_by_worker"].get("0", 0) > 0, after


def test_a_finite_dataset_without_steps_per_epoch_is_one_pass(runs):
    assert runs["on"]["dataset_epoch_steps"] == 3072 // 64


def test_save_on_the_coordinator_and_load_anywhere(runs):
    on = runs["on"]
    assert on["saved_vs_live"] < 1e-6
    assert on["saved_accuracy"] == pytest.approx(on["evaluate_final"]["accuracy"], abs=1e-6)


def test_callbacks_on_the_coordinator_and_a_sidecar_evaluation(runs):
    on = runs["on"]
    assert on["files"][:cases.EPOCHS] == [f"epoch-{e}.keras" for e in range(1, cases.EPOCHS + 1)]
    assert on["files"][cases.EPOCHS:] == ["tb", "no-backup"]  # BackupAndRestore deletes its backup at the end
    assert on["sidecar_evaluate"]["accuracy"] == pytest.approx(on["history"]["val_accuracy"][-1], abs=1e-6)
    assert "WARNING" not in on["log"].split("Epoch 1/")[0] or "not a version" not in on["log"]
