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
* InputMode.SPARK: ``DataFeed.as_dataset`` in the dataset function reads the feed of the
  worker that runs each step (:mod:`tfos._data.worker_feeds`, :mod:`tfos._node.ps_feed`); the
  first worker whose dataset ends ends the fit, and every worker's feed is ended when it returns.
* variables on ps tasks (sharded gradients and updates, atomic ``assign_add``):
  :mod:`tfos._node.keras3_ps_vars`.

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


#: Keras's originals this fix wraps, and Keras's trainer module (set by :func:`_patch`).
_KERAS: dict = {}


def _patch(trainer: Any) -> None:
    """Wraps the trainer's methods and epoch iterator (see the module docstring)."""
    from tfos._node import keras3_ps_vars

    Trainer = trainer.TensorFlowTrainer
    _KERAS.update(trainer=trainer, EpochIterator=trainer.TFEpochIterator)
    for name, new in (("fit", _fit), ("evaluate", _evaluate), ("predict", _predict),
                      ("_make_function", _make_function), ("_maybe_symbolic_build", _maybe_symbolic_build),
                      ("_get_metrics_result_or_logs", _get_metrics_result_or_logs)):
        _KERAS[name] = getattr(Trainer, name)
        new.__wrapped__ = _KERAS[name]  # type: ignore[attr-defined, union-attr]
        setattr(Trainer, name, new)
    trainer.TFEpochIterator = _epoch_iterator_class(trainer.TFEpochIterator)
    trainer.tf = keras3_ps_vars._TensorFlowWithShardedTape(_tf())
    keras3_ps_vars.patch()


def _tf() -> Any:
    import tensorflow as tf

    return tf


# keras-team/keras#18624: Keras 3 has no ClusterCoordinator path. fit() under a
# ParameterServerStrategy schedules its steps on the workers (see the module docstring).
def _fit(self: Any, *args: Any, **kwargs: Any) -> Any:
    strategy = self._distribute_strategy
    if not is_ps(strategy):
        return _KERAS["fit"](self, *args, **kwargs)
    coordinator = _tf().distribute.coordinator.ClusterCoordinator(strategy)
    state = _FitState(coordinator, self)
    previous, self._tfos_ps_fit = getattr(self, "_tfos_ps_fit", None), state
    _ACTIVE.append(state)
    try:
        return _KERAS["fit"](self, *args, **kwargs)
    finally:
        _ACTIVE.remove(state)
        self._tfos_ps_fit = previous
        if state.fed:  # the workers' feeds: train() skips what this fit did not read
            from tfos._node import ps_feed

            ps_feed.end_feeds(coordinator, state.chief_feed)


def _evaluate(self: Any, *args: Any, **kwargs: Any) -> Any:
    with _on_coordinator(self):
        return _KERAS["evaluate"](self, *args, **kwargs)


def _predict(self: Any, *args: Any, **kwargs: Any) -> Any:
    with _on_coordinator(self):
        return _KERAS["predict"](self, *args, **kwargs)


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


def _epoch_iterator_class(KerasEpochIterator: Any) -> Any:
    from keras.src.trainers.epoch_iterator import EpochIterator as BaseEpochIterator

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

    return EpochIterator


def _per_worker_init(it: Any, state: "_FitState", strategy: Any, x: Any = None, y: Any = None,
                     sample_weight: Any = None, batch_size: Any = None, steps_per_epoch: Any = None,
                     shuffle: bool = False, class_weight: Any = None, steps_per_execution: int = 1) -> None:
    from keras.src.trainers.epoch_iterator import EpochIterator as BaseEpochIterator

    tf = _tf()
    coordinator = state.coordinator
    if callable(x) and not isinstance(x, tf.data.Dataset):
        if steps_per_epoch is None:
            raise ValueError(
                "model.fit(dataset_fn) under ParameterServerStrategy needs steps_per_epoch: each worker reads "
                "its own dataset, so an epoch is a number of steps (docs/parameter_servers.md)")
        BaseEpochIterator.__init__(  # Keras reads its adapter; a dataset_fn has none: an empty one
            it, x=tf.data.Dataset.range(0), steps_per_epoch=steps_per_epoch, steps_per_execution=steps_per_execution)
        it._distributed_dataset, it._tfos_spec = _per_worker_dataset_of_fn(state, strategy, x)
    else:
        if getattr(x, "tfos_batches", None) is not None:
            raise ValueError(
                "model.fit(feed.as_dataset(...)) under ParameterServerStrategy: the dataset would read the chief's "
                "feed; pass a dataset function, model.fit(lambda ctx: feed.as_dataset(...), steps_per_epoch=...), "
                "so that each worker reads its own (docs/parameter_servers.md)")
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


def _per_worker_dataset_of_fn(state: "_FitState", strategy: Any, dataset_fn: Any) -> tuple:
    """``(per-worker dataset, element spec)`` of a dataset function ``fn(input_context)``; a
    ``DataFeed.as_dataset`` in it reads each worker's own feed (:mod:`tfos._data.worker_feeds`)."""
    from tfos._data import worker_feeds

    element_spec: list = []

    def per_worker_fn() -> Any:
        with worker_feeds.building(state):
            ds = strategy.distribute_datasets_from_function(dataset_fn)
        element_spec[:] = [ds.element_spec]
        return ds

    dataset = state.coordinator.create_per_worker_dataset(per_worker_fn)
    return dataset, element_spec[0] if element_spec else dataset.element_spec


def _current_fit_state(strategy: Any) -> Any:
    state = _ACTIVE[-1] if _ACTIVE else None
    return state if state is not None and state.strategy is strategy else None


def _maybe_symbolic_build(self: Any, iterator: Any = None, data_batch: Any = None) -> Any:
    spec = getattr(iterator, "_tfos_spec", None)
    if spec is None:
        return _KERAS["_maybe_symbolic_build"](self, iterator=iterator, data_batch=data_batch)
    # A per-worker dataset cannot be iterated here: build from its element spec.
    with self.distribute_strategy.scope():
        self._symbolic_build(data_batch=_any_batch(spec))


def _make_function(self: Any, step_function: Any) -> Any:
    state = getattr(self, "_tfos_ps_fit", None)
    if state is None or step_function != self.train_step:
        return _KERAS["_make_function"](self, step_function)
    if self.run_eagerly:
        raise ValueError("run_eagerly=True does not work under ParameterServerStrategy: the steps run on the "
                         "workers as tf.functions (docs/parameter_servers.md)")
    return _scheduled(self, _execution(self, step_function, state.fed))


def _execution(model: Any, step_function: Any, fed: bool) -> Any:
    """One closure: up to ``steps_per_execution`` steps on the worker that runs it. Returns
    the last step's logs, the worker's index (a closure retried after a worker's loss reports
    the worker that finished it), the steps run and the rows trained; on a fed worker each
    step also tells its row accounting (:func:`tfos._data.worker_feeds.count_trained`).

    The first step reads with ``next()``: a worker whose dataset has ended fails the closure
    (``OutOfRangeError``) before any step ran. The others read with ``get_next_as_optional``
    and the loop stops at the end of the data, so a closure never applies steps it does not
    report."""
    tf = _tf()
    strategy = model.distribute_strategy
    steps = int(model.steps_per_execution)
    reduce_per_replica = _KERAS["trainer"].reduce_per_replica

    def one_step(data: Any) -> Any:
        outputs = reduce_per_replica(strategy.run(step_function, args=(data,)), strategy, reduction="auto")
        rows = _rows(tf, data)
        if fed:
            with tf.control_dependencies(tf.nest.flatten(outputs)):
                rows = _feed().count_trained(rows)
        return outputs, rows

    def execution(iterator: Any) -> Any:
        outputs, rows = one_step(next(iterator))
        worker = tf.distribute.coordinator.experimental_get_current_worker_index()
        if steps == 1:
            return outputs, worker, tf.constant(1, tf.int64), rows

        def more(step: Any, outputs: Any, rows: Any, next_data: Any) -> Any:
            return tf.logical_and(step < steps, next_data.has_value())

        def step_on(step: Any, outputs: Any, rows: Any, next_data: Any) -> Any:
            outputs, more_rows = one_step(next_data.get_value())
            next_data = tf.cond(step + 1 < steps, iterator.get_next_as_optional, lambda: next_data)
            return step + 1, outputs, rows + more_rows, next_data

        step, outputs, rows, _ = tf.while_loop(more, step_on, (tf.constant(1, tf.int64), outputs, rows,
                                                                iterator.get_next_as_optional()))
        return outputs, worker, step, rows

    return tf.function(execution, reduce_retracing=True)


def _feed() -> Any:
    from tfos._data import worker_feeds

    return worker_feeds


def _rows(tf: Any, data: Any) -> Any:
    """The rows of a batch (int64 scalar): the first dimension of its first tensor."""
    first = tf.nest.flatten(data, expand_composites=False)[0]
    if isinstance(first, tf.SparseTensor):
        return first.dense_shape[0]
    if isinstance(first, tf.RaggedTensor):
        return first.nrows(out_type=tf.int64)
    return tf.cast(tf.shape(first)[0], tf.int64)


def _scheduled(model: Any, execution: Any) -> Any:
    def function(iterator: Any) -> Any:
        state = model._tfos_ps_fit
        try:
            remote = state.coordinator.schedule(execution, args=(iterator,))
        except _tf().errors.OutOfRangeError as exc:  # a worker's dataset (its feed) ended
            state.ran_out(exc)
            return state.last_logs()
        return state.scheduled(remote)

    return function


def _get_metrics_result_or_logs(self: Any, logs: Any) -> Any:
    state = getattr(self, "_tfos_ps_fit", None)
    if state is not None:
        logs = state.last_logs()  # the epoch's steps all finished (joined)
    return _KERAS["_get_metrics_result_or_logs"](self, logs)


def _any_batch(spec: Any) -> Any:
    from keras.src import tree

    tf = _tf()

    def one(s: Any) -> Any:
        if not hasattr(s, "shape") and getattr(s, "_value_specs", None):
            s = s._value_specs[0]
        if isinstance(s, tf.TensorSpec) and s.shape.rank:
            return tf.TensorSpec(tf.TensorShape([None]).concatenate(s.shape[1:]), s.dtype)
        return s

    return tree.map_structure(one, spec)


class _FitState:
    """One fit() under a ParameterServerStrategy: its coordinator and step results.

    Attributes:
        fed: Its dataset reads the workers' tfos feeds (InputMode.SPARK).
        ended_by: The error that ended the fit early: a worker's dataset ran out.
    """

    #: Most joins while draining the closures in flight after a worker's dataset ran out.
    MAX_DRAIN_JOINS = 64

    def __init__(self, coordinator: Any, model: Any) -> None:
        self.coordinator = coordinator
        self.strategy = coordinator.strategy
        self.model = model
        self.dataset_made = False
        self.fed = False
        self.chief_feed: Any = None
        self.ended_by: Any = None
        self._pending: list = []
        self._logs: dict = {}

    def scheduled(self, remote: Any) -> dict:
        self._pending.append(remote)
        return self._ready_logs()

    def _take(self, remote: Any) -> None:
        try:
            logs, worker, steps, rows = remote.fetch()
        except Exception:  # noqa: BLE001 - a failed or cancelled closure: join() raises its error
            return
        self._logs = dict(logs)
        _count_steps(int(worker), int(steps), int(rows))

    def _ready_logs(self) -> dict:
        """The results of the latest step that finished, without waiting for any."""
        still = []
        for remote in self._pending:
            if _finished(remote):
                self._take(remote)
            else:
                still.append(remote)
        self._pending = still
        return dict(self._logs)

    def join(self) -> None:
        """The epoch's end: waits for every closure scheduled (``coordinator.join()``)."""
        tf = _tf()
        try:
            self.coordinator.join()
        except tf.errors.OutOfRangeError as exc:
            self.ran_out(exc)
        finally:
            pending, self._pending = self._pending, []
            for remote in pending:
                self._take(remote)

    def ran_out(self, exc: Any) -> None:
        """A worker's dataset ended (its feed, or a finite dataset without ``repeat``): the
        closures still queued were cancelled; waits for those in flight and ends the fit
        after this epoch (``model.stop_training``)."""
        tf = _tf()
        if self.ended_by is None:
            self.ended_by = exc
            log.info("tfos: a worker's dataset ended (%s); model.fit ends with this epoch, after the steps in "
                     "flight (docs/parameter_servers.md)", str(exc).splitlines()[0][:200])
        self.model.stop_training = True
        for _ in range(self.MAX_DRAIN_JOINS):
            try:
                self.coordinator.join()
                break
            except tf.errors.OutOfRangeError:
                continue

    def last_logs(self) -> dict:
        return dict(self._logs)


def _finished(remote: Any) -> bool:
    event = getattr(remote, "_status_available_event", None)
    return bool(event is not None and event.is_set() and getattr(remote, "_error", None) is None)


#: The fit() calls under a ParameterServerStrategy in progress in this process (innermost last).
_ACTIVE: list = []
#: Prefix of the node figures (:mod:`tfos._data.figures`) counting the training steps sent to
#: each worker, e.g. ``ps_steps_worker_1``: the coordinator's TF process sends them to the driver.
STEPS_FIGURE = "ps_steps_worker_"
#: Prefix of the node figures counting the rows each worker trained, e.g. ``ps_rows_worker_1``.
ROWS_FIGURE = "ps_rows_worker_"


def _count_steps(worker_index: int, steps: int, rows: int = 0) -> None:
    from tfos._data.figures import FIGURES

    FIGURES.add(f"{STEPS_FIGURE}{worker_index}", steps)
    if rows:
        FIGURES.add(f"{ROWS_FIGURE}{worker_index}", rows)


def _by_worker(prefix: str) -> dict:
    from tfos._data.figures import FIGURES

    return {int(k[len(prefix):]): v for k, v in FIGURES.snapshot().items() if k.startswith(prefix)}


def steps_by_worker() -> dict:
    """Training steps each worker ran so far under ``model.fit`` in this process (the
    coordinator), by worker task index: each closure of ``steps_per_execution`` steps counts
    for the worker that finished it (a closure retried after a worker's loss counts once)."""
    return _by_worker(STEPS_FIGURE)


def rows_by_worker() -> dict:
    """Rows (batch rows, summed) each worker trained so far under ``model.fit`` in this process
    (the coordinator), by worker task index, counted like :func:`steps_by_worker`."""
    return _by_worker(ROWS_FIGURE)
