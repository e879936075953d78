"""Keras 3 step outputs, row counting and the end-of-data warning across workers (TF process).

Parts of tfos's Keras 3 fix (:mod:`tfos._node.keras3_fix`, docs/keras.md):

- :func:`reduce_mean_across_workers`: the ``reduce_per_replica(..., "mean")`` Keras applies
  to what ``train_step``/``test_step`` return. Keras reduces every value across the workers
  with ``strategy.reduce``, which fails on a value with no device, such as a metric whose
  ``result()`` returns its own variable (the example in Keras's ``Metric`` docstring) or a
  Python number in a custom step's dict (``ValueError ... doesn't have device set``;
  keras-team/keras#19308, tensorflow/tensorflow#58938). Here a floating-point tensor is
  averaged across the replicas element by element, as before; a variable's value is read as
  the strategy reads it in cross-replica context (a mirrored variable: its value; a
  sync-on-read one, as Keras's metrics are: its aggregate over every replica), the value
  one process would return; Python numbers, and tensors of other dtypes (integer counts,
  booleans, strings), pass through unchanged, as Keras passes a non-replica value on one
  worker.
- :func:`counting_step`: on a fed node, adds the rows of every local batch ``train_step``
  consumes to the row accounting's counter (:mod:`tfos._data.row_count`).
- :func:`quiet_planned_end`: Keras warns "Your input ran out of data; interrupting
  training" whenever a dataset ends inside an epoch, also where that end is the epoch's
  planned end: on a fed node without ``steps_per_epoch``, a feed epoch ends when its rows
  do. There the warning is left out (logged at DEBUG) when the epoch trained at least one
  step; it stays when ``steps_per_epoch`` was given (the data truly ran short of it) and
  when an epoch found no data at all.
"""

from __future__ import annotations

import logging
import numbers
from typing import Any

log = logging.getLogger(__name__)


def reduce_mean_across_workers(values: Any, strategy: Any) -> Any:
    """``values`` (a step's outputs) averaged across the replicas of a multi-worker
    ``strategy`` as described in the module docstring (TF process, cross-replica context)."""
    import tensorflow as tf
    from keras.src import tree

    def one(v: Any) -> Any:
        if v is None or isinstance(v, (numbers.Number, str, bytes)) or (hasattr(v, "dtype") and not hasattr(v, "shape")):
            return v
        value = getattr(v, "value", None) if _is_keras_variable(v) else None
        if value is not None:
            v = value  # a keras.Variable: its backend variable
        if isinstance(v, tf.Variable):
            return tf.convert_to_tensor(v)  # cross-replica read: the aggregate of a sync-on-read variable
        if isinstance(v, tf.Tensor) or _is_distributed(v):
            if not (v.dtype.is_floating or v.dtype.is_complex):
                return v if isinstance(v, tf.Tensor) else strategy.experimental_local_results(v)[0]
            return strategy.reduce("MEAN", v, axis=None)
        return v

    return tree.map_structure(one, values)


def _is_keras_variable(v: Any) -> bool:
    try:
        from keras.src.backend.common.variables import Variable
    except ImportError:  # pragma: no cover - another Keras layout: no keras.Variable to unwrap
        return False
    return isinstance(v, Variable)


def _is_distributed(v: Any) -> bool:
    import tensorflow as tf

    return isinstance(v, tf.distribute.DistributedValues)


def local_rows(data: Any) -> Any:
    """The number of rows (the leading dimension) of one local batch, an int64 scalar tensor."""
    import tensorflow as tf
    from keras.src import tree

    for leaf in tree.flatten(data):
        if isinstance(leaf, tf.SparseTensor):
            return tf.cast(leaf.dense_shape[0], tf.int64)
        if isinstance(leaf, tf.RaggedTensor):
            return tf.cast(leaf.nrows(), tf.int64)
        if tf.is_tensor(leaf) and leaf.shape.rank:
            return tf.cast(tf.shape(leaf)[0], tf.int64)
    return tf.constant(0, tf.int64)


def counting_step(step_function: Any, counter: Any) -> Any:
    """``step_function`` (a model's ``train_step``) that first adds its batch's rows to the
    int64 variable ``counter`` (TF process; runs inside the step, XLA-compatible)."""

    def step(data: Any) -> Any:
        counter.assign_add(local_rows(data))
        return step_function(data)

    step.__wrapped__ = step_function  # type: ignore[attr-defined]
    return step


def quiet_planned_end(epoch_iterator_cls: Any, fed: Any) -> None:
    """Leaves Keras's "Your input ran out of data" warning out where the end is planned
    (see the module docstring); ``fed()`` says whether this TF process reads a feed."""
    keras_warning = epoch_iterator_cls._interrupted_warning

    def _interrupted_warning(self: Any) -> Any:
        steps_per_execution = max(1, int(getattr(self, "steps_per_execution", 1) or 1))
        if fed() and self.steps_per_epoch is None and self._steps_seen > steps_per_execution:
            log.debug("the fed dataset ended after %d step(s): the planned end of a feed epoch", self._steps_seen - steps_per_execution)
            return None
        return keras_warning(self)

    _interrupted_warning.__wrapped__ = keras_warning  # type: ignore[attr-defined]
    epoch_iterator_cls._interrupted_warning = _interrupted_warning
