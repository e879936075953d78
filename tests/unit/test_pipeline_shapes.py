"""TFModel's shape coercion of Spark's flat arrays to a signature input (pure; TFoS did the
same: a 784-value row feeds a (None, 28, 28, 1) input)."""
from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from tfos._pipeline.runner import _fit_shape  # noqa: E402


def S(*dims):
    return tf.TensorShape(dims)


def test_flat_rows_are_reshaped_to_a_fully_known_input_shape():
    a = np.arange(5 * 784, dtype=np.float32).reshape(5, 784)
    got = _fit_shape(a, S(None, 28, 28, 1), "image", "conv_input")
    assert got.shape == (5, 28, 28, 1)
    np.testing.assert_array_equal(got.reshape(5, 784), a)  # row order and values kept
    assert _fit_shape(np.zeros(5), S(None, 1), "x", "x").shape == (5, 1)  # scalar rows


def test_matching_or_open_shapes_are_left_alone():
    a = np.zeros((5, 784), np.float32)
    assert _fit_shape(a, S(None, 784), "c", "x") is a
    assert _fit_shape(a, S(None, None), "c", "x") is a
    assert _fit_shape(a, tf.TensorShape(None), "c", "x") is a
    assert _fit_shape(np.zeros(5), S(None), "c", "x").shape == (5,)


def test_a_wrong_element_count_names_the_column_the_input_and_both_shapes():
    a = np.zeros((5, 784), np.float32)
    with pytest.raises(ValueError, match=r"^TFModel: column 'c' holds rows of shape \(784,\) \(784 values\), "
                                         r"but signature input 'x' takes rows of shape \(10,\)"):
        _fit_shape(a, S(None, 10), "c", "x")
    with pytest.raises(ValueError, match=r"takes rows of shape \(None, 28\)"):  # not fully known: no reshape
        _fit_shape(a, S(None, None, 28), "c", "x")
