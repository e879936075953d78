"""Node output filtering and remote traceback file names (pure parts of C26)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
import traceback

import cloudpickle
import pytest

from tfos._node.tf_noise import is_tf_noise, tf_noise_level

ABSL = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
INFO = "I0000 00:00:1796080592.555864    7250 port.cc:153] oneDNN custom operations are on."
GUARD = "I0000 00:00:1796080592.792159    7250 cpu_feature_guard.cc:227] This TensorFlow binary is optimized"
GUARD2 = "To enable the following instructions: AVX2 AVX512F FMA, in other operations, rebuild TensorFlow"
CUINIT = "E0000 00:00:1796080602.957716    7250 cuda_platform.cc:52] failed call to cuInit: INTERNAL: CUDA error"
WARN = "W0000 00:00:1796080602.957716    7250 some_op.cc:12] something to look at"
ERR = "E0000 00:00:1796080602.957716    7250 some_op.cc:12] a real error"


def test_tf_noise_by_level():
    assert is_tf_noise(ABSL, 1, False) and is_tf_noise(INFO, 1, False) and is_tf_noise(GUARD, 1, False)
    assert is_tf_noise(GUARD2, 1, False, after_dropped=True)
    assert not is_tf_noise(GUARD2, 1, False, after_dropped=False)
    assert not is_tf_noise(WARN, 1, False) and is_tf_noise(WARN, 2, False)
    assert not is_tf_noise(ERR, 1, False) and not is_tf_noise(ERR, 2, True)
    assert not is_tf_noise(INFO, 0, False) and not is_tf_noise(ABSL, 0, False)


def test_generator_dataset_warning_is_noise():
    line = ("W0000 00:00:1796081417.204855   32113 dataset.cc:997] Input of GeneratorDatasetOp::Dataset will "
            "not be optimized because the dataset does not implement the AsGraphDefInternal() method")
    assert is_tf_noise(line, 1, False)


def test_cuinit_is_noise_only_without_an_nvidia_driver():
    assert is_tf_noise(CUINIT, 1, nvidia_driver=False)
    assert not is_tf_noise(CUINIT, 1, nvidia_driver=True)


def test_user_prints_are_never_noise():
    for line in ("epoch 1 loss 0.5", "I0000 is my label", "WARNING: my own warning", ""):
        assert not is_tf_noise(line, 3, False)


def test_traceback_names_the_drivers_file_even_where_it_is_absent(tmp_path):
    """cloudpickle labels by-value code '<dynamic-code>'; the wrapper restores the file
    name and ships the source, so the traceback shows both where the file does not exist."""
    script = tmp_path / "user_train.py"
    payload = tmp_path / "payload.pkl"
    script.write_text(textwrap.dedent(f'''
        import cloudpickle
        from tfos._driver.user_source import with_source

        def helper(x):
            raise ValueError("bad value %s" % x)

        def main_fun(args, ctx):
            helper(args)

        with open({str(payload)!r}, "wb") as f:
            f.write(cloudpickle.dumps((with_source(main_fun), 7)))
    '''))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, str(script)], check=True, env=env, timeout=120)
    script.unlink()  # as on an executor host without the driver's files
    fn, args = pickle.loads(payload.read_bytes())
    try:
        fn(args, None)
    except ValueError:
        text = traceback.format_exc()
    assert f'File "{script}", line 9, in main_fun' in text, text
    assert f'File "{script}", line 6, in helper' in text and 'raise ValueError("bad value %s" % x)' in text, text
    assert "<dynamic-code>" not in text
    assert cloudpickle  # the payload format is cloudpickle's


@pytest.mark.parametrize("cell_name", ["/tmp/ipykernel_4242/2716393459.py", "<ipython-input-3-5d1e2a>"])
def test_traceback_shows_a_notebook_cells_source(tmp_path, cell_name):
    """A main_fun defined in a notebook cell: the cell has no file, IPython keeps its
    source in linecache, and the node's traceback shows the cell's lines from it."""
    script = tmp_path / "kernel.py"
    payload = tmp_path / "payload.pkl"
    cell = textwrap.dedent('''
        def helper(x):
            raise ValueError("bad cell value %s" % x)

        def main_fun(args, ctx):
            helper(args)
    ''')
    script.write_text(textwrap.dedent(f'''
        import linecache, cloudpickle
        from tfos._driver.user_source import with_source

        cell, name = {cell!r}, {cell_name!r}
        # as IPython's compiler does for every cell it runs
        linecache.cache[name] = (len(cell), None, cell.splitlines(True), name)
        ns = {{"__name__": "__main__"}}
        exec(compile(cell, name, "exec"), ns)
        with open({str(payload)!r}, "wb") as f:
            f.write(cloudpickle.dumps((with_source(ns["main_fun"]), 5)))
    '''))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, str(script)], check=True, env=env, timeout=120)
    fn, args = pickle.loads(payload.read_bytes())
    try:
        fn(args, None)
    except ValueError:
        text = traceback.format_exc()
    assert f'File "{cell_name}", line 6, in main_fun\n    helper(args)' in text, text
    assert f'File "{cell_name}", line 3, in helper\n    raise ValueError("bad cell value %s" % x)' in text, text


def test_filter_follows_the_level_in_force_whoever_set_it():
    # tfos's default, and a user's quieter level (2 must never show more than 1): filtered;
    # 0 (every line asked for) turns the filter off; junk falls back to tfos's default.
    assert tf_noise_level(None) == 1
    assert tf_noise_level("2") == 2 and tf_noise_level("3") == 3 and tf_noise_level("7") == 3
    assert tf_noise_level("0") is None
    assert tf_noise_level("loud") == 1
    cuinit = ("E0000 00:00:1796084945.589284   28418 cuda_platform.cc:52] failed call to cuInit: "
              "INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)")
    assert is_tf_noise(cuinit, tf_noise_level("2"), nvidia_driver=False)
    assert is_tf_noise(ABSL, tf_noise_level("2"), nvidia_driver=False)
