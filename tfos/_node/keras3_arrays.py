"""Keras 3 ``fit`` on numpy/array inputs across workers: one common order per epoch (TF process).

Keras 3 shuffles array inputs (``model.fit(x, y)``, default ``shuffle=True``) with an
unseeded ``tf.random.shuffle`` inside the dataset it builds
(``keras/src/trainers/data_adapters/array_data_adapter.py``) and then lets
``MultiWorkerMirroredStrategy`` shard that dataset by batch (``AutoShardPolicy.DATA``): each
worker draws an order of its own and takes its share of every global batch of *that*
order, so per epoch some rows are trained twice and others never, with no error
(tensorflow/tensorflow#42146, #48317, #47583).

Here, under a multi-worker ``MultiWorkerMirroredStrategy`` only, a shuffled array dataset
is built with an order every worker draws alike: a permutation of all rows from a stateless
shuffle whose seed comes from a per-iteration random stream seeded with
:func:`cluster_seed` (the same on every worker of the cluster) and the number of shuffled
array datasets this process built before (the same in every worker, which run the same
program). A new iteration of the dataset (a new epoch) draws a new order, as one process
does. ``shuffle="batch"`` (shuffle within each batch) is drawn the same way. Each worker
then takes its share of every global batch of the common order: every row is trained
exactly once per epoch. Unshuffled arrays (``shuffle=False``, ``validation_data``,
``validation_split``, ``evaluate``, ``predict``) already have one order and run Keras's
own code. See docs/keras.md, "Numpy and array inputs".
"""

from __future__ import annotations

import contextvars
import hashlib
import json
import os
import threading
from typing import Any

#: The strategy of the Keras epoch iterator being built in this thread (None outside one).
_BUILDING: contextvars.ContextVar = contextvars.ContextVar("tfos_keras_epoch_strategy", default=None)
_count_lock = threading.Lock()
_datasets_built = 0


def cluster_seed(tf_config: str = "") -> int:
    """A 31-bit seed every worker of one cluster computes alike (pure).

    From the cluster spec of ``TF_CONFIG`` (``tf_config``, or the environment's): every
    worker holds the same spec; two clusters (other ports) draw other orders, as two runs
    of one process do. ``TFOS_ARRAY_SHUFFLE_SEED`` (an integer) overrides it, for a
    reproducible order.
    """
    fixed = os.environ.get("TFOS_ARRAY_SHUFFLE_SEED", "").strip()
    if fixed:
        return int(fixed) & 0x7FFFFFFF
    text = tf_config or os.environ.get("TF_CONFIG", "")
    try:
        cluster = json.loads(text).get("cluster", {}) if text else {}
    except ValueError:
        cluster = {}
    digest = hashlib.sha256(json.dumps(cluster, sort_keys=True).encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def dataset_seed(index: int) -> int:
    """The seed of the ``index``-th shuffled array dataset a worker builds (0-based; pure
    but for the environment, see :func:`cluster_seed`)."""
    return (cluster_seed() * 1_000_003 + index) & 0x7FFFFFFF


def _next_dataset_index() -> int:
    global _datasets_built
    with _count_lock:
        _datasets_built += 1
        return _datasets_built - 1


def common_order_dataset(adapter: Any, seed: int) -> Any:
    """The batches of a shuffling Keras ``ArrayDataAdapter``, in an order drawn from ``seed``
    that every worker draws alike (TF process).

    Each iteration (epoch) draws a new permutation of all ``num_samples`` rows (or, with
    ``shuffle="batch"``, of the rows within each batch): a stateless shuffle keyed by
    ``seed`` and the next value of a random stream seeded with ``seed`` that moves on with
    every iteration. Batches hold ``batch_size`` rows but the last. The dataset carries
    ``AutoShardPolicy.DATA``, as Keras's does: each worker takes its share of every global
    batch.

    Args:
        adapter: A ``keras.src.trainers.data_adapters.array_data_adapter.ArrayDataAdapter``.
        seed: The cluster's seed (:func:`cluster_seed`) mixed with the dataset's index.

    Returns:
        A ``tf.data.Dataset`` of batches with the structure Keras's own dataset has.
    """
    import tensorflow as tf
    from keras.src import tree
    from keras.src.trainers.data_adapters import array_slicing

    n, batch_size, mode = int(adapter._num_samples), int(adapter._batch_size), adapter._shuffle
    inputs = tree.lists_to_tuples(array_slicing.convert_to_sliceable(adapter._inputs, target_backend="tensorflow"))
    op_seed = tf.constant(seed, tf.int64)

    def draw(stream_value: Any) -> Any:
        key = tf.stack([stream_value, op_seed])
        rows = tf.range(n, dtype=tf.int64)
        if mode == "batch":
            return rows, key
        return tf.random.experimental.stateless_shuffle(rows, seed=key), key

    def batches(order: Any, key: Any) -> Any:
        index_batches = tf.data.Dataset.from_tensor_slices(order).batch(batch_size)
        if mode != "batch":
            return index_batches
        keys = tf.data.Dataset.range(n).map(lambda i: key + tf.stack([i + 1, tf.constant(0, tf.int64)]))
        return tf.data.Dataset.zip((index_batches, keys)).map(
            lambda idx, k: tf.random.experimental.stateless_shuffle(idx, seed=k))

    def grab(indices: Any, data: Any) -> Any:
        def one(x: Any) -> Any:
            if isinstance(x, array_slicing.TensorflowSparseWrapper):
                return array_slicing.slice_tensorflow_sparse_wrapper(x, indices)
            if isinstance(x, (list, tuple, dict)):
                return None
            return tf.gather(x, indices, axis=0) if tf.is_tensor(x) else x

        return tree.traverse(one, data)

    stream = tf.data.Dataset.random(seed=seed, rerandomize_each_iteration=True).take(1)
    index_batches = stream.map(draw).flat_map(batches)
    # The arrays enter as one dataset element (tensors), as in Keras's own dataset.
    dataset = tf.data.Dataset.zip((index_batches, tf.data.Dataset.from_tensors(inputs).repeat()))
    dataset = dataset.map(grab, num_parallel_calls=tf.data.AUTOTUNE)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    options.experimental_optimization.apply_default_optimizations = False
    return dataset.with_options(options).prefetch(tf.data.AUTOTUNE)


def patch(trainer: Any, multi_worker: Any) -> None:
    """Makes the shuffled array datasets of ``trainer``'s epoch iterators common to every
    worker under a multi-worker strategy (TF process; called by :mod:`keras3_fix`)."""
    from keras.src.trainers.data_adapters.array_data_adapter import ArrayDataAdapter

    keras_init = trainer.TFEpochIterator.__init__
    keras_dataset = ArrayDataAdapter.get_tf_dataset

    def __init__(self: Any, distribute_strategy: Any = None, *args: Any, **kwargs: Any) -> None:
        token = _BUILDING.set(distribute_strategy)
        try:
            keras_init(self, distribute_strategy, *args, **kwargs)
        finally:
            _BUILDING.reset(token)

    def get_tf_dataset(self: Any) -> Any:
        strategy = _BUILDING.get()
        if not self._shuffle or strategy is None or not multi_worker(strategy):
            return keras_dataset(self)
        return common_order_dataset(self, dataset_seed(_next_dataset_index()))

    __init__.__wrapped__ = keras_init  # type: ignore[attr-defined]
    get_tf_dataset.__wrapped__ = keras_dataset  # type: ignore[attr-defined]
    trainer.TFEpochIterator.__init__ = __init__
    ArrayDataAdapter.get_tf_dataset = get_tf_dataset
