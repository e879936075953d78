"""Parameter servers both ways, on real Spark and real MNIST digits.

* TF1 between-graph (``examples/mnist/tf1/mnist_ps.py``): ps nodes ``server.join()``,
  workers train asynchronously under ``replica_device_setter`` with
  ``MonitoredTrainingSession``; the chief exports a SavedModel that the driver scores.
* TF2 ``ParameterServerStrategy`` (``examples/mnist/keras/mnist_ps.py``): ps/worker nodes
  ``ctx.run_server_and_wait()``, the chief coordinates a custom loop with
  ``ClusterCoordinator``; the driver scores the saved ``model.keras``.
* ``driver_ps_nodes=True`` with an evaluator node, on the shared 2-executor cluster.

The examples are imported from their files and their ``run(sc, args)`` is called with the
test's SparkContext; their functions ship to the executors by value. Each test asserts
test-set accuracy well above chance (0.1), that the variables lived on ``/job:ps/task:0``,
and that no tfos process (ps included) is left after shutdown.

This file switches SparkContext configurations, so its name sorts after the shared tests.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("pyspark")
pytest.importorskip("tensorflow")

import tfos._driver.classic  # noqa: E402

from conftest import DEFAULT_MASTER, assert_no_tfos_processes  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.tf, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "mnist"
NUM_TRAIN = 4000
NUM_TEST = 1000
#: Accuracy after a few hundred steps on 4,000 digits is ~0.9 (chance: 0.1).
MIN_ACCURACY = 0.85
PS_DEVICE = "/job:ps/replica:0/task:0"


def _load_example(relpath: str, name: str):
    """Imports an example script as a module whose functions cloudpickle ships by value."""
    import cloudpickle
    from pyspark import cloudpickle as spark_cloudpickle

    spec = importlib.util.spec_from_file_location(name, EXAMPLES / relpath)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    cloudpickle.register_pickle_by_value(module)  # tfos ships main_fun with cloudpickle
    spark_cloudpickle.register_pickle_by_value(module)  # PySpark ships RDD functions with its copy
    return module


@pytest.fixture(scope="module")
def tf1_example():
    return _load_example("tf1/mnist_ps.py", "mnist_ps_tf1_example")


@pytest.fixture(scope="module")
def keras_example():
    return _load_example("keras/mnist_ps.py", "mnist_ps_keras_example")


@pytest.fixture(scope="module")
def mnist_tfr(tmp_path_factory) -> Path:
    """Real MNIST digits as TFRecords: 4 train and 4 test part files (made once per module)."""
    out = tmp_path_factory.mktemp("mnist")
    cmd = [
        sys.executable, str(EXAMPLES / "mnist_data_setup.py"), "--output", str(out), "--format", "tfr",
        "--master", "local[2]", "--num_partitions", "4",
        "--num_train", str(NUM_TRAIN), "--num_test", str(NUM_TEST),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=480, cwd=str(REPO))
    assert proc.returncode == 0, f"mnist_data_setup.py failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    train = out / "tfr" / "train"
    assert len(list(train.glob("part-*.tfrecord"))) == 4
    assert len(list((out / "tfr" / "test").glob("part-*.tfrecord"))) == 4
    return train


def _common_args(mnist_tfr: Path, tmp_path: Path, steps: int) -> list[str]:
    return [
        "--images", str(mnist_tfr), "--model_dir", str(tmp_path / "model"), "--export_dir", str(tmp_path / "export"),
        "--steps", str(steps), "--batch_size", "100", "--log_steps", "100", "--checkpoint_steps", "200",
    ]


# --------------------------------------------------------------------------- TF1 style


def test_tf1_async_ps_trains_mnist(spark_manager, mnist_tfr, tmp_path, tf1_example):
    """(a) 1 ps + 2 async workers on local-cluster[3]: accuracy, variables on the ps."""
    sc = spark_manager.get("local-cluster[3,1,1024]")
    assert_no_tfos_processes()
    steps = 600
    args = tf1_example.parse_args(
        _common_args(mnist_tfr, tmp_path, steps) + ["--cluster_size", "3", "--num_ps", "1", "--mode", "monitored", "--epochs", "30"]
    )
    summary = tf1_example.run(sc, args)

    assert summary["num_test"] == NUM_TEST
    assert summary["test_accuracy"] >= MIN_ACCURACY, summary
    workers = summary["workers"]
    assert sorted(workers) == ["worker:0", "worker:1"]
    assert workers["worker:0"]["is_chief"] and not workers["worker:1"]["is_chief"]
    for name, stats in workers.items():
        # replica_device_setter put the global step and the weights on the ps, the input on the worker.
        assert "/job:ps/task:0" in stats["devices"]["global_step"], (name, stats["devices"])
        variables = stats["devices"]["variables"]
        assert sorted(variables) == ["hid_b", "hid_w", "sm_b", "sm_w"]
        assert all("/job:ps/task:0" in d for d in variables.values()), (name, variables)
        assert stats["devices"]["x"].startswith(f"/job:worker/task:{stats['task']}"), stats["devices"]
        assert stats["local_steps"] >= 50 and stats["steps_per_sec"] > 0, (name, stats)
        assert stats["windows"][-1]["accuracy"] > 0.8, (name, stats["windows"])
    # Asynchronous: both workers advanced the one global step on the ps.
    assert sum(s["local_steps"] for s in workers.values()) >= steps - 2
    # A worker's last fetched global step is read while the other worker may be applying its
    # update (asynchronous), so it can lag the final step by a step or two; the chief's final
    # checkpoint records where the global step on the ps ended: StopAtStepHook stops only
    # once a fresh read shows >= steps.
    assert max(s["last_global_step"] for s in workers.values()) >= steps - 1 - len(workers)
    import tensorflow as tf

    final = tf.train.latest_checkpoint(str(tmp_path / "model"))
    assert final is not None and int(final.rsplit("-", 1)[1]) >= steps, final
    assert (tmp_path / "export" / "saved_model.pb").exists()
    assert_no_tfos_processes()  # (d) the ps (blocked in server.join()) was stopped too


# --------------------------------------------------------------------------- TF2 style


def test_keras_parameter_server_strategy_trains_mnist(spark_manager, mnist_tfr, tmp_path, keras_example):
    """(b) ParameterServerStrategy: 1 ps (on the driver) + chief + 2 workers on local-cluster[3]."""
    sc = spark_manager.get("local-cluster[3,1,1024]")
    assert_no_tfos_processes()
    steps = 600
    args = keras_example.parse_args(
        _common_args(mnist_tfr, tmp_path, steps) + ["--cluster_size", "4", "--num_ps", "1", "--driver_ps_nodes"]
    )
    started = time.monotonic()
    summary = keras_example.run(sc, args)
    elapsed = time.monotonic() - started

    chief = summary["chief"]
    assert chief["num_workers"] == 2
    assert chief["variable_devices"] == [f"{PS_DEVICE}/device:CPU:0"]
    assert chief["steps"] == steps and chief["steps_per_sec"] > 0
    assert [w["step"] for w in chief["windows"]] == [100, 200, 300, 400, 500, 600]
    assert chief["windows"][-1]["loss"] < chief["windows"][0]["loss"]
    assert summary["num_test"] == NUM_TEST
    # Scored on the driver from model.keras, and by the chief before saving: the same model.
    assert summary["test_accuracy"] >= MIN_ACCURACY, summary
    assert summary["test_accuracy"] == pytest.approx(chief["chief_test_accuracy"], abs=1e-6)
    assert (tmp_path / "export" / "model.keras").exists()
    # The ps/worker nodes only served: shutdown() did not wait for them (no deadlock).
    assert elapsed < 400
    assert_no_tfos_processes()


# --------------------------------------------------------------------------- driver ps + evaluator


def test_tf1_driver_ps_nodes_with_evaluator(spark_manager, mnist_tfr, tmp_path, tf1_example, monkeypatch):
    """(c) driver_ps_nodes=True on the shared 2-executor cluster: the ps runs on the driver
    host, an evaluator node scores every checkpoint, one worker trains."""
    sc = spark_manager.get(DEFAULT_MASTER)
    assert_no_tfos_processes()
    local = []
    real_launch = tfos._driver.classic.launch_local_node

    def spy(config, executor_id, payload, cwd, *rest):  # rest: the attempt (issue 14)
        local.append(executor_id)
        return real_launch(config, executor_id, payload, cwd, *rest)

    monkeypatch.setattr(tfos._driver.classic, "launch_local_node", spy)
    steps = 400
    args = tf1_example.parse_args(
        _common_args(mnist_tfr, tmp_path, steps)
        + ["--cluster_size", "3", "--num_ps", "1", "--driver_ps_nodes", "--eval", "--epochs", "30"]
    )
    summary = tf1_example.run(sc, args)

    assert local == [0]  # executor id 0 is the ps: launched on the driver, not on an executor
    assert sorted(summary["workers"]) == ["worker:0"]
    worker = summary["workers"]["worker:0"]
    assert "/job:ps/task:0" in worker["devices"]["global_step"]
    assert worker["last_global_step"] >= steps - 1
    assert summary["test_accuracy"] >= MIN_ACCURACY, summary
    evals = summary["eval"]
    steps_seen = [e["global_step"] for e in evals]
    assert steps_seen == sorted(steps_seen) and len(evals) >= 2, evals
    # The chief waited for the evaluator to score the final checkpoint, which is the export.
    assert worker["final_checkpoint_evaluated"] is True
    assert steps_seen[-1] == steps, evals
    assert evals[-1]["accuracy"] == pytest.approx(summary["test_accuracy"], abs=1e-6)
    assert evals[0]["accuracy"] < evals[-1]["accuracy"]
    assert_no_tfos_processes()
