"""tfos._node.keras3_fix without TensorFlow: the import hook, the off switch, the version guard.

What the fix does to Keras 3 is tested against the real Keras in
tests/spark/test_keras3_loopback.py (two MWMS workers vs one process) and on Spark in
tests/spark/test_keras3_spark.py.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import types

import pytest

from tfos._node import keras3_fix

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(code: str, tmp_path, **env: str) -> str:
    """Runs ``code`` in a fresh interpreter (its own sys.modules and sys.meta_path); returns stdout."""
    full_env = {k: v for k, v in os.environ.items() if k != "TFOS_KERAS3_FIX"}
    full_env.update(env, PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT]))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full_env, cwd=str(tmp_path),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.fixture
def fake_keras(tmp_path):
    """A stand-in ``keras`` package whose trainer module has what the fix replaces."""
    trainer = tmp_path / "keras" / "src" / "backend" / "tensorflow"
    trainer.mkdir(parents=True)
    for d in (tmp_path / "keras", tmp_path / "keras" / "src", tmp_path / "keras" / "src" / "backend", trainer):
        (d / "__init__.py").write_text("")
    (trainer / "trainer.py").write_text("class TensorFlowTrainer: pass\ndef reduce_per_replica(v, s, r): return v\n"
                                        "def _collective_all_reduce_multi_worker(s): return False\n")
    return tmp_path


def test_install_imports_nothing_and_patches_the_trainer_when_main_fun_imports_it(fake_keras):
    out = _run("""
        import sys
        from tfos._node import keras3_fix
        seen = []
        keras3_fix.apply = lambda module: seen.append(module.__name__) or True
        assert keras3_fix.install() is True
        assert not any(m == "tensorflow" or m.startswith(("keras", "tensorflow.")) for m in sys.modules), "imported eagerly"
        import keras.src.backend.tensorflow.trainer as trainer
        print(seen, trainer.TensorFlowTrainer.__name__, trainer.__loader__.get_filename().endswith("trainer.py"))
    """, fake_keras)
    assert out.split() == ["['keras.src.backend.tensorflow.trainer']", "TensorFlowTrainer", "True"]


@pytest.mark.parametrize("node_env, driver, installed", [("0", None, False), (None, "0", False), ("1", "0", True), (None, None, True)])
def test_off_switch_node_environment_wins_over_the_drivers_value(fake_keras, node_env, driver, installed):
    env = {} if node_env is None else {"TFOS_KERAS3_FIX": node_env}
    out = _run(f"""
        from tfos._node import import_hooks, keras3_fix
        print(keras3_fix.install({driver!r}), import_hooks.waiting(keras3_fix.TRAINER_MODULE))
    """, fake_keras, **env)
    assert out.split() == [str(installed), str(installed)]


def test_is_tested():
    assert keras3_fix.is_tested("3.15.1", ("3.15",)) and keras3_fix.is_tested("3.15", ("3.15",))
    assert not keras3_fix.is_tested("3.150.0", ("3.15",)) and not keras3_fix.is_tested("3.16.0", ("3.15",))


def _fake_trainer(**missing_none) -> types.ModuleType:
    module = types.ModuleType("keras.src.backend.tensorflow.trainer")
    for name in ("TensorFlowTrainer", "reduce_per_replica", "_collective_all_reduce_multi_worker"):
        if name not in missing_none:
            setattr(module, name, object())
    return module


def test_an_untested_keras_gets_one_warning_naming_the_tested_versions_and_the_off_switch(monkeypatch, caplog):
    monkeypatch.delenv("TFOS_KERAS3_FIX", raising=False)
    monkeypatch.setattr(keras3_fix, "_keras_version", lambda: "3.99.0")
    patched = []
    monkeypatch.setattr(keras3_fix, "_patch", patched.append)
    trainer = _fake_trainer()
    with caplog.at_level(logging.INFO, logger="tfos._node.keras3_fix"):
        assert keras3_fix.apply(trainer) and keras3_fix.apply(trainer)  # applied once
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and patched == [trainer]
    assert "3.99.0" in warnings[0] and "3.15.x" in warnings[0] and "TFOS_KERAS3_FIX=0" in warnings[0]


def test_a_keras_without_what_the_fix_replaces_is_left_unchanged_with_a_warning(monkeypatch, caplog):
    monkeypatch.delenv("TFOS_KERAS3_FIX", raising=False)
    monkeypatch.setattr(keras3_fix, "_keras_version", lambda: "3.15.1")
    monkeypatch.setattr(keras3_fix, "_patch", lambda trainer: pytest.fail("patched"))
    with caplog.at_level(logging.WARNING, logger="tfos._node.keras3_fix"):
        assert not keras3_fix.apply(_fake_trainer(reduce_per_replica=None))
    assert "reduce_per_replica" in caplog.text and "NOT applied" in caplog.text


def test_a_tested_keras_gets_no_warning(monkeypatch, caplog):
    monkeypatch.delenv("TFOS_KERAS3_FIX", raising=False)
    monkeypatch.setattr(keras3_fix, "_keras_version", lambda: "3.15.1")
    monkeypatch.setattr(keras3_fix, "_patch", lambda trainer: None)
    with caplog.at_level(logging.WARNING, logger="tfos._node.keras3_fix"):
        assert keras3_fix.apply(_fake_trainer())
    assert not caplog.records
