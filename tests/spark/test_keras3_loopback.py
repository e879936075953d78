"""Keras 3 under MultiWorkerMirroredStrategy with tfos's fix: two workers on loopback vs one process.

No Spark: ``keras3_cases.py`` runs as two MWMS worker processes (TF_CONFIG with two 127.0.0.1
ports; each installs the fix as a tfos TF process does), as one MWMS worker alone (a one-node
cluster) and as one reference process on the same global batches. One run feeds every test
below. Weights, losses, metrics and predictions must agree within 1e-5 (relative, over each
whole result). With the fix off (``TFOS_KERAS3_FIX=0``) every test fails: ``fit`` raises on
the workers (and the worker alone loses the batches Keras read to build the model).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

pytestmark = [pytest.mark.tf, pytest.mark.timeout(900)]

HERE = os.path.dirname(os.path.abspath(__file__))
RTOL = 1e-5
#: Longest wait for the three processes (TensorFlow start-up and tracing on a loaded machine).
RUN_TIMEOUT_S = 600


def _held_ports(n: int) -> list:
    """``n`` bound, not listening sockets on 127.0.0.1 (SO_REUSEADDR): they keep other programs
    off the ports while the workers start, and TensorFlow's gRPC server binds them anyway
    (as tfos's TF process does, see ``reserve_port``)."""
    from tfos._node.tf_process import reserve_port

    return [reserve_port("127.0.0.1") for _ in range(n)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Runs worker 0, worker 1 and the reference at once; returns their results by name."""
    out = tmp_path_factory.mktemp("keras3")
    held = _held_ports(2)
    cluster = {"worker": [f"127.0.0.1:{s.getsockname()[1]}" for s in held]}
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(HERE)), os.environ.get("PYTHONPATH")])))
    env["TFOS_ARRAY_SHUFFLE_SEED"] = "4242"  # keras3_cases.common_orders draws the workers' orders from it
    env.pop("TF_CONFIG", None)
    env.pop("TF_USE_LEGACY_KERAS", None)
    procs = {}
    for name in ("worker0", "worker1", "reference", "single"):
        penv = dict(env)
        if name.startswith("worker"):
            penv["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": int(name[-1])}})
        log = open(out / f"{name}.log", "w")
        procs[name] = (subprocess.Popen([sys.executable, os.path.join(HERE, "keras3_cases.py"), str(out / f"{name}.json"),
                                         "worker" if name.startswith("worker") else name],
                                        cwd=str(out), env=penv, stdout=log, stderr=subprocess.STDOUT), log)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        for name, (proc, log) in procs.items():
            try:
                proc.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass  # reported below, with the stacks the process prints
    finally:
        for proc, log in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGUSR1)  # keras3_cases.py prints every thread's stack
                time.sleep(2.0)
                proc.kill()
                proc.wait()
            log.close()
        for sock in held:
            sock.close()
    results = {}
    for name, (proc, _) in procs.items():
        text = (out / f"{name}.log").read_text()
        assert proc.returncode == 0 and (out / f"{name}.json").exists(), (
            f"{name} exited with {proc.returncode} (negative: killed after {RUN_TIMEOUT_S} s):\n{text[-8000:]}")
        results[name] = json.loads((out / f"{name}.json").read_text())
    results["logs"] = {name: (out / f"{name}.log").read_text() for name in procs}
    return results


def _flat(value) -> np.ndarray:
    if isinstance(value, dict):
        return np.concatenate([_flat(value[k]) for k in sorted(value)]) if value else np.zeros(0)
    if isinstance(value, list) and value and isinstance(value[0], (list, dict)):
        return np.concatenate([_flat(v) for v in value])
    return np.ravel(np.asarray(value, dtype=np.float64))


def _close(got, want, what: str) -> None:
    a, b = _flat(got), _flat(want)
    assert a.shape == b.shape, f"{what}: shape {a.shape} != {b.shape}"
    err = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
    assert err <= RTOL, f"{what}: relative difference {err:.2e} > {RTOL:g}\n got {got}\nwant {want}"


def _case(runs: dict, case: str, reference: str = "one_replica") -> tuple:
    """``(worker0, worker1, reference)`` results of ``case``; a failed one fails the test."""
    found = []
    for name, group in (("worker0", "workers"), ("worker1", "workers"), ("reference", reference)):
        result = runs[name].get(group, {}).get(case)
        assert result is not None, f"{name} did not run {case} (an earlier case failed?):\n{runs['logs'][name][-4000:]}"
        assert "error" not in result, f"{case} failed on {name}:\n{result['error']}"
        found.append(result)
    return tuple(found)


def _same_training(runs: dict, case: str, reference: str = "one_replica", keys=("weights", "history", "evaluate")) -> tuple:
    w0, w1, ref = _case(runs, case, reference)
    for key in keys:
        if key in ref:
            _close(w0[key], ref[key], f"{case}: worker 0 {key} vs {reference}")
    assert w0["weights"] == w1["weights"], f"{case}: the workers' weights differ"
    assert w0.get("history") == w1.get("history"), f"{case}: the workers' histories differ"
    return w0, w1, ref


def test_fit_with_metrics_and_validation_then_evaluate_and_predict(runs):
    w0, w1, ref = _same_training(runs, "fit_evaluate_predict")
    assert set(ref["history"]) == {"loss", "accuracy", "auc", "val_loss", "val_accuracy", "val_auc"} == set(w0["history"])
    assert set(w0["evaluate"]) == {"loss", "accuracy", "auc"}
    for worker in (w0, w1):
        # Every row predicted once, in the input's order (251 rows: the last batch splits 14 + 13).
        for key in ("predict", "predict_numpy"):
            assert len(worker[key]) == 251
            _close(worker[key], ref[key], key)
    assert runs["worker0"]["keras"] == runs["reference"]["keras"]


@pytest.mark.parametrize("case", ["one_shot_source", "one_shot_unbuilt"])
def test_a_dataset_that_cannot_be_rewound_is_trained_on_once(runs, case):
    # fit and evaluate on one-shot sources (each batch handed out once, as a tfos feed does)
    # on one MWMS worker alone (a one-node cluster), where Keras 3 builds the model from a
    # batch of an iterator it then discards (the batches it read ahead were lost); a model
    # with keras.Input, and one that fit builds.
    ref = runs["reference"]["one_replica"][case]
    single = runs["single"].get("single_worker", {}).get(case)
    assert single is not None and "error" not in single, (single or {}).get("error", runs["logs"]["single"][-4000:])
    for key in ("weights", "history", "evaluate"):
        _close(single[key], ref[key], f"{case}: one worker {key} vs one process")
    for result in (ref, single):
        assert result["handed"] == [8, 4], result["handed"]  # every batch handed out once


def test_steps_per_execution(runs):
    w0, w1, ref = _same_training(runs, "steps_per_execution")
    _close(w0["predict"], ref["predict"], "predict")


def test_dict_inputs(runs):
    w0, w1, ref = _same_training(runs, "dict_inputs")
    _close(w0["predict"], ref["predict"], "predict")


def test_synchronized_batchnorm_equals_one_process(runs):
    _same_training(runs, "batchnorm_synchronized")


def test_dropout_and_batchnorm_equal_two_replicas_in_one_process(runs):
    # Dropout draws its mask per replica and BatchNormalization(synchronized=False) normalizes
    # over each replica's rows, and keeps each replica's moving statistics: worker k ends
    # as replica k of Keras on one machine with two devices.
    w0, w1, ref = _case(runs, "dropout_batchnorm", reference="two_replicas")
    for key in ("history", "evaluate"):
        _close(w0[key], ref[key], key)
    assert w0["history"] == w1["history"]
    for k, worker in enumerate((w0, w1)):
        _close(worker["weights"], ref["replica_weights"][k], f"worker {k} vs replica {k}")
    for i in ref["trainable"]:
        assert w0["weights"][i] == w1["weights"][i], f"trainable variable {i} differs between the workers"


@pytest.mark.parametrize("policy, optimizer", [("mixed_bfloat16", "SGD"), ("mixed_float16", "LossScaleOptimizer")])
def test_mixed_precision(runs, policy, optimizer):
    w0, _, ref = _same_training(runs, policy, reference="two_replicas")
    assert w0["optimizer"] == ref["optimizer"] == optimizer
    assert w0["compute_dtype"] == policy.split("_")[1]


def _files(result: dict) -> list:
    return sorted(re.sub(r"events\.out\.tfevents\..*", "events.out.tfevents.*", f) for f in result["files"])


def test_callbacks_on_shared_paths_and_resume_after_a_failure(runs):
    w0, w1, ref = _same_training(runs, "callbacks_and_restart")
    for result in (w0, w1, ref):
        assert result["failed"] == "injected failure after epoch 2"
        # BackupAndRestore resumed after epoch 2; EarlyStopping ended the run.
        assert result["epochs"][0] == 2 and len(result["epochs"]) < 3, result["epochs"]
    assert w0["epochs"] == ref["epochs"]
    # One set of files, written by the chief alone: one TensorBoard event file, no
    # temporary directory, and the backup deleted at the end, as in one process.
    assert _files(w0) == _files(w1) == _files(ref)
    assert sum("tfevents" in f for f in w0["files"]) == 1
    assert not any(f.startswith("backup") for f in w0["files"])
    _close(w0["last_checkpoint"], w0["weights"], "last ModelCheckpoint vs final weights")
    _close(w0["best_loss"], ref["best_loss"], "best.keras loss")


def test_chief_saves_keras_file_and_savedmodel_for_inference(runs):
    w0, w1, ref = _same_training(runs, "save_and_load")
    assert "loaded_diff" in w0 and "loaded_diff" not in w1  # the chief saved, the other worker did not
    assert w0["loaded_diff"] == 0.0
    assert w0["served_diff"] < 1e-6
    _close(w0["predict"], ref["predict"], "predict of the saved model")


def test_the_fix_is_applied_on_the_workers_without_a_warning(runs):
    # Applied by the import hook when the program imported Keras; a tested version: no WARNING.
    for name in ("worker0", "worker1", "single"):
        assert runs[name]["fix_applied"], f"{name}: the fix is not applied (TFOS_KERAS3_FIX={os.environ.get('TFOS_KERAS3_FIX')})"
        assert "tfos: Keras" not in runs["logs"][name], runs["logs"][name][-3000:]
    assert not runs["reference"]["fix_applied"]  # the reference is plain Keras


def test_numpy_fit_with_default_shuffle_trains_every_row_once_per_epoch(runs):
    # model.fit(x, y) on numpy with Keras's default shuffle=True and no seed: each worker
    # used to draw its own order and take its half of every batch of that order. A
    # subclassed two-input model (dict of arrays) with a custom train_step that counts the
    # rows it trains; validation_split, evaluate and predict on numpy.
    w0, w1, ref = _case(runs, "numpy_default_shuffle")
    rows = len(w0["per_epoch"][0])
    for epoch in range(len(ref["per_epoch"])):
        both = np.asarray(w0["per_epoch"][epoch]) + np.asarray(w1["per_epoch"][epoch])
        assert both.tolist() == [1] * rows, (
            f"epoch {epoch}: {int((both == 0).sum())} rows never trained, {int((both > 1).sum())} trained more than once")
        assert sum(w0["per_epoch"][epoch]) == sum(w1["per_epoch"][epoch]) == rows // 2
        assert ref["per_epoch"][epoch] == [1] * rows
    _same_training(runs, "numpy_default_shuffle")
    for key in ("split", "predict"):
        _close(w0[key], ref[key], f"numpy: worker 0 {key} vs one process")


def test_custom_metric_returning_its_variable_and_custom_steps_with_plain_values(runs):
    # A metric whose result() returns its own variable (Keras's Metric docstring example);
    # train_step/test_step returning a Python number, a variable and an int tensor.
    w0, w1, ref = _same_training(runs, "custom_metric_and_steps")
    assert {"positives", "scale", "iterations", "seven"} <= set(w0["history"])
    assert w0["history"]["scale"] == [0.5] * 2 and w0["history"]["seven"] == [7] * 2
    assert w0["evaluate"]["scale"] == 2.0 and w0["evaluate"]["seven"] == 7
