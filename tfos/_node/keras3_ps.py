"""Keras 3 ``model.fit`` under ``ParameterServerStrategy``: tfos's fix (TF process, coordinator).

Keras 3 dropped parameter-server training (keras-team/keras#18624): its TensorFlow trainer
(``keras/src/backend/tensorflow/trainer.py``) has no ``ClusterCoordinator`` code, distributes
every dataset with ``strategy.experimental_distribute_dataset`` and runs every step in the
calling process, so ``model.fit`` on the coordinator raises ``ValueError: To use this
dataset, you need to pass this dataset to ClusterCoordinator.create_per_worker_dataset.``
(tf_keras, Keras 2, has the coordinator path: ``TF_USE_LEGACY_KERAS=1``).

What this module changes, only when the model's strategy is a ``ParameterServerStrategy``
(``strategy._should_use_with_coordinator``); every other strategy runs Keras's own code:

* ``fit``: the dataset becomes a per-worker dataset (``ClusterCoordinator.create_per_worker_dataset``
  of a ``tf.data.Dataset``, of numpy arrays as Keras batches them, or of a dataset function
  ``fn(input_context) -> tf.data.Dataset`` given as ``x``, distributed with
  ``strategy.distribute_datasets_from_function``); each execution of ``steps_per_execution``
  steps is one closure ``coordinator.schedule``\\ s on whichever worker is free (a closure of a
  lost worker is retried on another, as TensorFlow's coordinator does); every epoch ends with
  ``coordinator.join()``; the epoch's logs are the model's metrics read from their variables
  on the ps tasks, where every worker's steps added to them. Batch-level callbacks get the
  results of the latest step that has finished (read without waiting: nothing serializes the
  workers), ``{}`` before the first. Callbacks run on the coordinator.
* ``evaluate`` and ``predict`` (also ``fit``'s ``validation_data``) run on the coordinator
  itself, reading the variables from the ps tasks: TensorFlow's "inline, direct"
  evaluation, exact (every batch once). A sidecar evaluator needs nothing from here.
* the model is built from the dataset's element spec (Keras would draw a batch).

How it is applied: :func:`tfos._node.keras3_fix.apply` calls :func:`apply` when Keras 3's
trainer is imported in a tfos TF process, with the same version guard (a WARNING for an
untested Keras) and the same off switch (``TFOS_KERAS3_FIX=0``). Delete this module when
Keras supports ``ParameterServerStrategy`` again. See docs/parameter_servers.md.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

log = logging.getLogger(__name__)

#: The names in the trainer module this fix wraps; if any is missing it is not applied.
PATCHED_NAMES = ("TensorFlowTrainer", "TFEpochIterator", "reduce_per_replica")


def is_ps(strategy: Any) -> bool:
    """Whether ``strategy`` is a ``ParameterServerStrategy`` that needs a coordinator."""
    return bool(getattr(strategy, "_should_use_with_coordinator", False))


def apply(trainer: Any) -> bool:
    """Wraps ``fit``/``evaluate``/``predict`` of Keras 3's TensorFlow trainer for
    ``ParameterServerStrategy`` (TF process; idempotent). Returns False when the module lacks
    what this wraps (then Keras runs unchanged)."""
    if getattr(trainer, "_tfos_keras3_ps", False):
        return True
    missing = [name for name in PATCHED_NAMES if not hasattr(trainer, name)]
    if missing:
        # INFO: most programs do not use a ParameterServerStrategy; one that does gets Keras's own error.
        log.info("tfos: Keras's trainer has no %s; model.fit under ParameterServerStrategy is not fixed "
                 "(docs/parameter_servers.md)", ", ".join(missing))
        return False
    _patch(trainer)
    trainer._tfos_keras3_ps = True
    return True


def _patch(trainer: Any) -> None:
    import tensorflow as tf
    from keras.src.trainers.epoch_iterator import EpochIterator as BaseEpochIterator

    Trainer = trainer.TensorFlowTrainer
    keras_fit, keras_evaluate, keras_predict = Trainer.fit, Trainer.evaluate, Trainer.predict
    keras_make_function = Trainer._make_function
    keras_build = Trainer._maybe_symbolic_build
    keras_metrics_or_logs = Trainer._get_metrics_result_or_logs
    KerasEpochIterator = trainer.TFEpochIterator

    def evaluate(self: Any, *args: Any, **kwargs: Any) -> Any:
        with _on_coordinator(self):
            return keras_evaluate(self, *args, **kwargs)

    def predict(self: Any, *args: Any, **kwargs: Any) -> Any:
        with _on_coordinator(self):
            return keras_predict(self, *args, **kwargs)

    @contextlib.contextmanager
    def _on_coordinator(model: Any):
        """Runs evaluate/predict in this process (the coordinator), as Keras does without a
        strategy; the variables stay on the ps tasks and are read from there."""
        strategy = model._distribute_strategy
        if not is_ps(strategy):
            yield
            return
        previous_fit = getattr(model, "_tfos_ps_fit", None)
        model._tfos_ps_fit = None
        model._distribute_strategy = None
        _ACTIVE.append(None)  # fit()'s validation: not a per-worker dataset
        try:
            yield
        finally:
            _ACTIVE.pop()
            model._distribute_strategy = strategy
            model._tfos_ps_fit = previous_fit

    class EpochIterator(KerasEpochIterator):  # type: ignore[valid-type, misc]
        """Keras's epoch iterator over a per-worker dataset while a model fits under a
        ParameterServerStrategy; Keras's own otherwise."""

        def __init__(self, distribute_strategy: Any = None, *args: Any, **kwargs: Any) -> None:
            state = _current_fit_state(distribute_strategy)
            if state is not None and not state.dataset_made:  # fit()'s training data
                state.dataset_made = True
                return _per_worker_init(self, state, distribute_strategy, *args, **kwargs)
            if not is_ps(distribute_strategy):
                return KerasEpochIterator.__init__(self, distribute_strategy, *args, **kwargs)
            # fit()'s validation_data: evaluated here on the coordinator (see evaluate), undistributed.
            BaseEpochIterator.__init__(self, *args, **kwargs)
            self._distribute_strategy = distribute_strategy
            self._distributed_dataset = self.data_adapter.get_tf_dataset()

        def _get_iterator(self) -> Any:
            if getattr(self, "_tfos_state", None) is None:
                return KerasEpochIterator._get_iterator(self)
            return self._distributed_dataset

        def tf_sync(self) -> None:
            state = getattr(self, "_tfos_state", None)
            if state is None:
                return KerasEpochIterator.tf_sync(self)
            state.join()

    def _per_worker_init(it: Any, state: "_FitState", strategy: Any, x: Any = None, y: Any = None,
                         sample_weight: Any = None, batch_size: Any = None, steps_per_epoch: Any = None,
                         shuffle: bool = False, class_weight: Any = None, steps_per_execution: int = 1) -> None:
        coordinator = state.coordinator
        if callable(x) and not isinstance(x, tf.data.Dataset):
            if steps_per_epoch is None:
                raise ValueError(
                    "model.fit(dataset_fn) under ParameterServerStrategy needs steps_per_epoch: each worker reads "
                    "its own dataset, so an epoch is a number of steps (docs/parameter_servers.md)")
            BaseEpochIterator.__init__(  # Keras reads its adapter; a dataset_fn has none: an empty one
                it, x=tf.data.Dataset.range(0), steps_per_epoch=steps_per_epoch, steps_per_execution=steps_per_execution)
            element_spec: list = []

            def per_worker_fn() -> Any:
                ds = strategy.distribute_datasets_from_function(x)
                element_spec[:] = [ds.element_spec]
                return ds

            it._distributed_dataset = coordinator.create_per_worker_dataset(per_worker_fn)
            it._tfos_spec = element_spec[0] if element_spec else it._distributed_dataset.element_spec
        else:
            BaseEpochIterator.__init__(
                it, x=x, y=y, sample_weight=sample_weight, batch_size=batch_size, steps_per_epoch=steps_per_epoch,
                shuffle=shuffle, class_weight=class_weight, steps_per_execution=steps_per_execution)
            if not it.num_batches:
                raise ValueError(
                    "model.fit under ParameterServerStrategy needs steps_per_epoch for a dataset of unknown or "
                    "infinite size: each worker reads its own copy, so an epoch is a number of steps "
                    "(docs/parameter_servers.md)")
            dataset = it.data_adapter.get_tf_dataset()
            it._tfos_spec = dataset.element_spec
            it._distributed_dataset = coordinator.create_per_worker_dataset(dataset)
        it._distribute_strategy = strategy
        it._tfos_state = state

    def _current_fit_state(strategy: Any) -> Any:
        state = _ACTIVE[-1] if _ACTIVE else None
        return state if state is not None and state.strategy is strategy else None

    def _maybe_symbolic_build(self: Any, iterator: Any = None, data_batch: Any = None) -> Any:
        spec = getattr(iterator, "_tfos_spec", None)
        if spec is None:
            return keras_build(self, iterator=iterator, data_batch=data_batch)
        # A per-worker dataset cannot be iterated here: build from its element spec.
        with self.distribute_strategy.scope():
            self._symbolic_build(data_batch=_any_batch(spec))

    def _make_function(self: Any, step_function: Any) -> Any:
        state = getattr(self, "_tfos_ps_fit", None)
        if state is None or step_function != self.train_step:
            return keras_make_function(self, step_function)
        return _scheduled(self, step_function)

    def _scheduled(model: Any, step_function: Any) -> Any:
        strategy = model.distribute_strategy
        steps = int(model.steps_per_execution)

        def one_step(iterator: Any) -> Any:
            outputs = strategy.run(step_function, args=(next(iterator),))
            return trainer.reduce_per_replica(outputs, strategy, reduction="auto")

        def execution(iterator: Any) -> Any:
            outputs = one_step(iterator)
            for _ in tf.range(steps - 1):
                outputs = one_step(iterator)
            # Which worker ran the closure (a closure retried after a worker's loss reports
            # the worker that finished it): counted on the coordinator, see steps_by_worker().
            return outputs, tf.distribute.coordinator.experimental_get_current_worker_index()

        if model.run_eagerly:
            raise ValueError("run_eagerly=True does not work under ParameterServerStrategy: the steps run on the "
                             "workers as tf.functions (docs/parameter_servers.md)")
        execution = tf.function(execution, reduce_retracing=True)

        def function(iterator: Any) -> Any:
            state = model._tfos_ps_fit
            return state.scheduled(state.coordinator.schedule(execution, args=(iterator,)), steps)

        return function

    def _get_metrics_result_or_logs(self: Any, logs: Any) -> Any:
        state = getattr(self, "_tfos_ps_fit", None)
        if state is not None and state.active:
            logs = state.last_logs()  # the epoch's steps all finished (joined)
        return keras_metrics_or_logs(self, logs)

    def _any_batch(spec: Any) -> Any:
        from keras.src import tree

        def one(s: Any) -> Any:
            if not hasattr(s, "shape") and getattr(s, "_value_specs", None):
                s = s._value_specs[0]
            if isinstance(s, tf.TensorSpec) and s.shape.rank:
                return tf.TensorSpec(tf.TensorShape([None]).concatenate(s.shape[1:]), s.dtype)
            return s

        return tree.map_structure(one, spec)

    class _FitState:
        """One fit() under a ParameterServerStrategy: its coordinator and step results."""

        def __init__(self, coordinator: Any) -> None:
            self.coordinator = coordinator
            self.strategy = coordinator.strategy
            self.active = False
            self.dataset_made = False
            self._pending: list = []
            self._logs: dict = {}

        def scheduled(self, remote: Any, steps: int) -> dict:
            self._pending.append((remote, steps))
            return self._ready_logs()

        def _take(self, remote: Any, steps: int) -> None:
            try:
                logs, worker = remote.fetch()
            except Exception:  # noqa: BLE001 - a failed closure: join() raises its error
                return
            self._logs = dict(logs)
            _count_steps(int(worker), steps)

        def _ready_logs(self) -> dict:
            """The results of the latest step that finished, without waiting for any."""
            still = []
            for remote, steps in self._pending:
                if _finished(remote):
                    self._take(remote, steps)
                else:
                    still.append((remote, steps))
            self._pending = still
            return dict(self._logs)

        def join(self) -> None:
            try:
                self.coordinator.join()
            finally:
                pending, self._pending = self._pending, []
            for remote, steps in pending:
                self._take(remote, steps)

        def last_logs(self) -> dict:
            return dict(self._logs)

    def _finished(remote: Any) -> bool:
        event = getattr(remote, "_status_available_event", None)
        return bool(event is not None and event.is_set() and getattr(remote, "_error", None) is None)

    # keras-team/keras#18624: Keras 3 has no ClusterCoordinator path. fit() under a
    # ParameterServerStrategy schedules its steps on the workers (see the module docstring).
    def fit(self: Any, *args: Any, **kwargs: Any) -> Any:
        strategy = self._distribute_strategy
        if not is_ps(strategy):
            return keras_fit(self, *args, **kwargs)
        coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
        state = _FitState(coordinator)
        state.active = True
        previous, self._tfos_ps_fit = getattr(self, "_tfos_ps_fit", None), state
        _ACTIVE.append(state)
        try:
            return keras_fit(self, *args, **kwargs)
        finally:
            _ACTIVE.remove(state)
            self._tfos_ps_fit = previous

    for name, new in (("fit", fit), ("evaluate", evaluate), ("predict", predict),
                      ("_make_function", _make_function), ("_maybe_symbolic_build", _maybe_symbolic_build),
                      ("_get_metrics_result_or_logs", _get_metrics_result_or_logs)):
        new.__wrapped__ = getattr(Trainer, name)  # type: ignore[attr-defined, union-attr]
        setattr(Trainer, name, new)
    trainer.TFEpochIterator = EpochIterator
    trainer.tf = _TensorFlowWithShardedTape(tf)
    _patch_sharded_update()
    _patch_sharded_numpy()


def _patch_sharded_numpy() -> None:
    """``numpy()`` and ``np.asarray`` of a Keras variable read ``value.numpy()`` /
    ``value.__array__``, which a ``ShardedVariable`` lacks (``model.save``, ``get_weights``
    fail with ``AttributeError``); for one, they read the shards and join them."""
    import numpy as np
    from keras.src.backend.tensorflow.core import Variable

    keras_numpy, keras_array = Variable.numpy, Variable.__array__

    def joined(self: Any) -> Any:
        return np.concatenate([shard.numpy() for shard in self.value.variables], axis=0)

    def numpy(self: Any) -> Any:
        return joined(self) if _sharded_value(self._value) else keras_numpy(self)

    def __array__(self: Any, dtype: Any = None, *args: Any, **kwargs: Any) -> Any:
        if not _sharded_value(self._value):
            return keras_array(self, dtype, *args, **kwargs)
        return np.asarray(joined(self), dtype=dtype)

    numpy.__wrapped__, __array__.__wrapped__ = keras_numpy, keras_array  # type: ignore[attr-defined]
    Variable.numpy, Variable.__array__ = numpy, __array__
    _patch_atomic_add(Variable)


def _patch_atomic_add(Variable: Any) -> None:
    """Keras 3's ``Variable.assign_add(v)`` is ``assign(self + v)``: a read, then a write. Under
    a ParameterServerStrategy the workers update the same variables on the ps tasks at once,
    so an update made between another worker's read and write is lost: measured before this,
    an epoch's ``accuracy`` read 0.958 where every prediction was right, and
    ``optimizer.iterations`` counted 69 of 92 steps. For a variable on a ps task the add
    is TensorFlow's own ``assign_add`` / ``assign_sub`` (one atomic operation on the ps)."""
    import tensorflow as tf

    keras_add, keras_sub = Variable.assign_add, Variable.assign_sub

    def assign_add(self: Any, value: Any) -> Any:
        if not _on_ps(self._value):
            return keras_add(self, value)
        return self._value.assign_add(tf.cast(value, self._value.dtype))

    def assign_sub(self: Any, value: Any) -> Any:
        if not _on_ps(self._value):
            return keras_sub(self, value)
        return self._value.assign_sub(tf.cast(value, self._value.dtype))

    assign_add.__wrapped__, assign_sub.__wrapped__ = keras_add, keras_sub  # type: ignore[attr-defined]
    Variable.assign_add, Variable.assign_sub = assign_add, assign_sub


def _on_ps(value: Any) -> bool:
    """Whether a Keras variable's TensorFlow value lives on a ps task (made under a
    ParameterServerStrategy: sharded, a ps-side wrapper, or placed on ``/job:ps``)."""
    if value is None:
        return False
    module = type(value).__module__
    if module.endswith(("distribute.ps_values", "distribute.sharded_variable")):
        return True
    try:
        return "/job:ps/" in (value.device or "")
    except (AttributeError, RuntimeError, ValueError):
        return False


def _patch_sharded_update() -> None:
    """Keras 3's optimizer runs each variable's update under ``strategy.extended.update(var,
    ...)``, which colocates with the variable; a ``ShardedVariable`` has no one device and
    raises ``NotImplementedError: ShardedVariable doesn't support being used as a
    reference``. Its update runs without colocation: each assignment goes to the shards on
    their ps tasks."""
    from keras.src.backend.tensorflow.optimizer import TFOptimizer

    keras_update = TFOptimizer._distributed_tf_update_step

    def _distributed_tf_update_step(self: Any, distribution: Any, grads_and_vars: Any, learning_rate: Any) -> Any:
        grads_and_vars = list(grads_and_vars)
        for grad, var in grads_and_vars:
            if _sharded_value(var):
                self.update_step(grad, var, learning_rate)
        return keras_update(self, distribution, [(g, v) for g, v in grads_and_vars if not _sharded_value(v)], learning_rate)

    _distributed_tf_update_step.__wrapped__ = keras_update  # type: ignore[attr-defined]
    TFOptimizer._distributed_tf_update_step = _distributed_tf_update_step


def _sharded_value(value: Any) -> bool:
    return hasattr(value, "variables") and not hasattr(value, "handle")


def _sharded(variable: Any) -> bool:
    """Whether ``variable`` is a Keras variable whose value a ``variable_partitioner`` split
    into shards (a ``ShardedVariable``)."""
    return _sharded_value(getattr(variable, "value", None))


class _TensorFlowWithShardedTape:
    """TensorFlow as Keras's trainer module sees it, with a ``GradientTape`` that also
    differentiates Keras variables split into shards.

    Under a ``ParameterServerStrategy`` with a ``variable_partitioner`` a large variable (an
    embedding table) is a ``ShardedVariable``, one ``tf.Variable`` per shard on the ps tasks;
    Keras 3's ``train_step`` asks the tape for the gradient of its Keras variable, which
    reads ``variable.value.handle`` and fails (``AttributeError: 'ShardedVariable' object
    has no attribute 'handle'``). The tape here takes the gradient of each shard and joins
    them into the gradient of the whole variable (``IndexedSlices`` stay sparse, with each
    shard's rows offset); Keras's optimizer then updates the shards through the variable.
    Every other source goes to TensorFlow's tape unchanged."""

    def __init__(self, tf: Any) -> None:
        self._tf = tf
        base = tf.GradientTape

        class GradientTape(base):  # type: ignore[misc, valid-type]
            def gradient(self, target: Any, sources: Any, *args: Any, **kwargs: Any) -> Any:
                flat = tf.nest.flatten(sources)
                if not any(_sharded(s) for s in flat):
                    return base.gradient(self, target, sources, *args, **kwargs)
                parts = [list(s.value.variables) if _sharded(s) else [s] for s in flat]
                grads = base.gradient(self, target, [v for p in parts for v in p], *args, **kwargs)
                joined, at = [], 0
                for source, p in zip(flat, parts):
                    shard_grads, at = grads[at:at + len(p)], at + len(p)
                    joined.append(_join(tf, p, shard_grads) if _sharded(source) else shard_grads[0])
                return tf.nest.pack_sequence_as(sources, joined)

        self.GradientTape = GradientTape

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tf, name)


def _join(tf: Any, shards: list, grads: list) -> Any:
    """The gradient of a variable split along its first axis into ``shards``, from theirs."""
    if all(g is None for g in grads):
        return None
    if all(g is None or isinstance(g, tf.IndexedSlices) for g in grads):
        offsets, indices, values = 0, [], []
        for shard, g in zip(shards, grads):
            if g is not None:
                indices.append(tf.cast(g.indices, tf.int64) + offsets)
                values.append(g.values)
            offsets += int(shard.shape[0])
        rows = tf.TensorShape([offsets]).concatenate(shards[0].shape[1:])
        return tf.IndexedSlices(tf.concat(values, 0), tf.concat(indices, 0), tf.constant(rows.as_list(), tf.int64))
    return tf.concat([tf.convert_to_tensor(g) if g is not None else tf.zeros_like(s) for s, g in zip(shards, grads)], 0)


#: The fit() calls under a ParameterServerStrategy in progress in this process (innermost last).
_ACTIVE: list = []
#: Prefix of the node figures (:mod:`tfos._data.figures`) counting the training steps sent to
#: each worker, e.g. ``ps_steps_worker_1``: the coordinator's TF process sends them to the driver.
STEPS_FIGURE = "ps_steps_worker_"


def _count_steps(worker_index: int, steps: int) -> None:
    from tfos._data.figures import FIGURES

    FIGURES.add(f"{STEPS_FIGURE}{worker_index}", steps)


def steps_by_worker() -> dict:
    """Training steps each worker ran so far under ``model.fit`` in this process (the
    coordinator), by worker task index: each closure of ``steps_per_execution`` steps counts
    for the worker that finished it (a closure retried after a worker's loss counts once)."""
    from tfos._data.figures import FIGURES

    return {int(k[len(STEPS_FIGURE):]): v for k, v in FIGURES.snapshot().items() if k.startswith(STEPS_FIGURE)}
