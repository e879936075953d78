"""Keras 3 ``model.fit`` / ``evaluate`` / ``predict`` across nodes: tfos's fix (TF process).

Keras 3 (the ``keras`` package, and ``tf.keras`` unless ``TF_USE_LEGACY_KERAS=1``) fails
under ``tf.distribute.MultiWorkerMirroredStrategy`` with more than one worker. Two calls in
its TensorFlow trainer (``keras/src/backend/tensorflow/trainer.py``) are at fault:

1. ``TensorFlowTrainer._maybe_symbolic_build`` takes a sample batch of the distributed
   dataset, only to build the model from its shapes and dtypes, with
   ``strategy.reduce("MEAN", batch, axis=None)``; on a nested per-replica batch of a
   multi-worker strategy that raises ``ValueError: Attempt to convert a value
   (PerReplica:{...}) ... to a Tensor`` (keras-team/keras#20585, tensorflow/tensorflow#72388;
   with dict inputs keras-team/keras#20329).
2. ``reduce_per_replica(..., reduction="mean")``, which reduces the metrics every
   ``train_step`` / ``test_step`` returns, calls ``strategy.reduce("MEAN", v, axis=0)`` in
   multi-worker mode, which raises "Invalid reduction dimension 0 for input with 0
   dimensions" on scalar metrics (tensorflow/tensorflow#72388) and would average a
   vector-valued metric over its own first axis.

The fix replaces exactly these two calls, and (but for the one-worker case below) only when
the strategy is a multi-worker ``MultiWorkerMirroredStrategy``; every other strategy and
every other path runs Keras's own code. (1) builds the model from the dataset's element spec (its shapes and dtypes, which is
all the build reads; nothing is iterated and no collective runs, so a dataset that reshuffles
on every iteration keeps the order one process sees). (2) averages each value across the
replicas element by element (``axis=None``), as Keras does for a single worker.

(1) also applies under a ``MultiWorkerMirroredStrategy`` of one worker (a tfos cluster of one
node) and a ``MirroredStrategy``: there Keras's sample batch does not fail, but it is read
from an iterator that ``fit``/``evaluate`` then discard and replace (``epoch_iterator.reset()``),
so on a dataset that cannot be rewound, such as a tfos feed (``DataFeed.as_dataset``), the
batches that iterator read ahead are never trained on, and ``evaluate`` may see none
(keras-team/keras#20394, keras-team/keras#20402). It applies when the element spec holds
what the build reads (the model's layers are built, or every tensor's shape is known beyond
the batch dimension); otherwise Keras builds as it does.

Also applied under a multi-worker strategy (each in a module of its own): numpy/array inputs
that Keras shuffles get one order every worker draws alike (:mod:`tfos._node.keras3_arrays`);
step outputs with no device (a metric returning its variable, Python numbers) pass the
reduction, and on a fed node ``train_step`` counts its rows and Keras's end-of-data warning
is left out at a fed epoch's planned end (:mod:`tfos._node.keras3_outputs`).

How it is applied: :func:`install` (called by the TF process right before ``main_fun``)
registers an import hook, so nothing is imported until ``main_fun`` itself imports Keras 3
(``import keras`` or ``tf.keras``); the hook patches the trainer module as it is loaded,
before any model exists. It is guarded by :data:`TESTED_VERSIONS`: another Keras 3 version
gets the fix and one WARNING that names the tested versions and the off switch. Turn it off
with ``TFOS_KERAS3_FIX=0`` (the driver's value is forwarded to the nodes; a node's own
environment, or ``os.environ`` set in ``main_fun`` before Keras is imported, wins).
Delete this module once Keras fixes the issues above. See docs/keras.md.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Optional, Sequence

from tfos._data.row_count import ROWS
from tfos._node import import_hooks, keras3_arrays, keras3_outputs, keras_steps

log = logging.getLogger(__name__)

#: Environment variable; ``0`` turns the fix off (in the TF process, before Keras is imported).
OFF_SWITCH = "TFOS_KERAS3_FIX"
#: Keras versions (``major.minor``) whose trainer the fix was tested against (tests/spark/test_keras3_*.py).
TESTED_VERSIONS = ("3.15",)
#: The module the fix patches, as it is imported.
TRAINER_MODULE = "keras.src.backend.tensorflow.trainer"
#: What the fix replaces in that module; if any is missing the fix is not applied.
_PATCHED_NAMES = ("TensorFlowTrainer", "reduce_per_replica", "_collective_all_reduce_multi_worker")


def install(driver_value: Optional[str] = None) -> bool:
    """Arranges for the fix to be applied when Keras 3's TensorFlow trainer is imported (TF process).

    Imports neither TensorFlow nor Keras: a ``main_fun`` that never imports Keras pays
    nothing. If the trainer is already imported, the fix is applied at once.

    Args:
        driver_value: The driver's ``TFOS_KERAS3_FIX`` (None when unset there); used when the
            node's own environment does not set the variable.

    Returns:
        True when the hook is registered or the fix applied; False when it is turned off
        (``TFOS_KERAS3_FIX=0``).
    """
    if OFF_SWITCH not in os.environ and driver_value is not None:
        os.environ[OFF_SWITCH] = driver_value
    if not _enabled():
        log.info("the Keras 3 multi-worker fix is off (%s=%s)", OFF_SWITCH, os.environ.get(OFF_SWITCH))
        return False
    import_hooks.when_imported(TRAINER_MODULE, _apply_on_import)
    return True


def _enabled() -> bool:
    return os.environ.get(OFF_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def is_tested(version: str, tested: Sequence[str] = TESTED_VERSIONS) -> bool:
    """Whether Keras ``version`` (e.g. ``"3.15.1"``) is of a tested ``major.minor`` (pure)."""
    return any(version == t or version.startswith(t + ".") for t in tested)


def _keras_version() -> str:
    try:
        from importlib.metadata import version

        return version("keras")
    except Exception:  # noqa: BLE001 - a vendored or renamed Keras: ask the package
        mod = sys.modules.get("keras.src.version")
        return str(getattr(mod, "__version__", "unknown"))


def apply(trainer: Any) -> bool:
    """Patches Keras 3's TensorFlow trainer module ``trainer`` (TF process; idempotent).

    Returns:
        True when the fix is in place; False when it is off or the module lacks what
        it replaces (then a WARNING says so and Keras runs unchanged).
    """
    if not _enabled():
        log.info("the Keras 3 multi-worker fix is off (%s=%s)", OFF_SWITCH, os.environ.get(OFF_SWITCH))
        return False
    if getattr(trainer, "_tfos_keras3_fix", False):
        return True
    version = _keras_version()
    missing = [name for name in _PATCHED_NAMES if not hasattr(trainer, name)]
    if missing:
        log.warning(
            "tfos: Keras %s has no %s in %s; tfos's fix for model.fit under MultiWorkerMirroredStrategy "
            "(tested with Keras %s) is NOT applied. See docs/keras.md.",
            version, ", ".join(missing), TRAINER_MODULE, _tested_text(),
        )
        return False
    if not is_tested(version):
        log.warning(
            "tfos: Keras %s is not a version tfos's fix for model.fit/evaluate/predict under "
            "MultiWorkerMirroredStrategy was tested with (Keras %s); the fix is applied. If training "
            "misbehaves, turn it off with %s=0 (driver or executor environment) and see docs/keras.md.",
            version, _tested_text(), OFF_SWITCH,
        )
    _patch(trainer)
    keras_steps.count_steps(trainer)  # steps/s per node for the driver's status (docs/status.md)
    from tfos._node import keras3_ps  # ParameterServerStrategy: docs/parameter_servers.md

    keras3_ps.apply(trainer)
    trainer._tfos_keras3_fix = True
    log.info("tfos: applied the Keras %s fix for MultiWorkerMirroredStrategy (docs/keras.md)", version)
    return True


def _tested_text() -> str:
    return ", ".join(f"{t}.x" for t in TESTED_VERSIONS)


def _patch(trainer: Any) -> None:
    """Replaces the faulty parts of ``trainer`` and of the file-writing callbacks (see the
    module docstring)."""
    import tensorflow as tf
    from keras.src import tree

    multi_worker = trainer._collective_all_reduce_multi_worker
    keras_reduce_per_replica = trainer.reduce_per_replica
    keras_symbolic_build = trainer.TensorFlowTrainer._maybe_symbolic_build
    keras_make_function = trainer.TensorFlowTrainer._make_function

    def _sample_spec(epoch_iterator: Any) -> Any:
        def any_batch(spec: Any) -> Any:
            if not hasattr(spec, "shape") and getattr(spec, "_value_specs", None):
                spec = spec._value_specs[0]  # a PerReplicaSpec (a dataset the user distributed): one replica's
            if isinstance(spec, tf.TensorSpec) and spec.shape.rank:
                return tf.TensorSpec(tf.TensorShape([None]).concatenate(spec.shape[1:]), spec.dtype)
            return spec

        return tree.map_structure(any_batch, epoch_iterator.data_adapter.get_tf_dataset().element_spec)

    # keras-team/keras#20585, tensorflow/tensorflow#72388, keras-team/keras#20329: Keras takes a
    # batch of the distributed dataset and reduces it across workers with strategy.reduce,
    # which fails on a nested per-replica batch, only to read its shapes and dtypes. The
    # dataset's element spec has them; not iterating also keeps a dataset that reshuffles on
    # every iteration in the order one process sees.
    # keras-team/keras#20394, keras-team/keras#20402: on one worker Keras takes that batch from
    # an iterator that fit/evaluate then discard; a dataset that cannot be rewound (a tfos
    # feed) loses what that iterator read ahead. Built from the spec when it suffices.
    def _maybe_symbolic_build(self: Any, iterator: Any = None, data_batch: Any = None) -> Any:
        strategy = self._distribute_strategy
        if iterator is not None and strategy is not None:
            if multi_worker(strategy):
                data_batch, iterator = _sample_spec(iterator), None
            elif isinstance(strategy, (tf.distribute.MultiWorkerMirroredStrategy, tf.distribute.MirroredStrategy)):
                spec = _sample_spec(iterator)
                if _spec_builds(self, spec):
                    data_batch, iterator = spec, None
        return keras_symbolic_build(self, iterator=iterator, data_batch=data_batch)

    def _spec_builds(model: Any, spec: Any) -> bool:
        """Whether ``spec`` holds all the build reads: the model's layers are built (then only
        the compiled metrics and loss are built from it), or every tensor's shape is known
        beyond the batch dimension."""
        if all(layer.built for layer in model._flatten_layers()):
            return True
        return all(not isinstance(s, tf.TensorSpec) or (s.shape.rank is not None and s.shape[1:].is_fully_defined())
                   for s in tree.flatten(spec))

    # tensorflow/tensorflow#72388: reduction "mean" across workers used axis=0, which fails
    # on scalar metrics; Keras means the element-wise mean across replicas (axis=None).
    # keras-team/keras#19308, tensorflow/tensorflow#58938: values with no device (a metric's
    # own variable, a Python number) failed in strategy.reduce: see keras3_outputs.
    def reduce_per_replica(values: Any, strategy: Any, reduction: str) -> Any:
        if reduction in ("auto", "mean") and multi_worker(strategy):
            return keras3_outputs.reduce_mean_across_workers(values, strategy)
        return keras_reduce_per_replica(values, strategy, reduction)

    _make_function = _unconditional_steps(trainer, keras_make_function, multi_worker)

    _maybe_symbolic_build.__wrapped__ = keras_symbolic_build  # type: ignore[attr-defined]
    reduce_per_replica.__wrapped__ = keras_reduce_per_replica  # type: ignore[attr-defined]
    _make_function.__wrapped__ = keras_make_function  # type: ignore[attr-defined]
    trainer.TensorFlowTrainer._maybe_symbolic_build = _maybe_symbolic_build
    trainer.TensorFlowTrainer._make_function = _make_function
    trainer.reduce_per_replica = reduce_per_replica
    _patch_callbacks(multi_worker)
    keras3_arrays.patch(trainer, multi_worker)
    from keras.src.trainers.epoch_iterator import EpochIterator

    keras3_outputs.quiet_planned_end(EpochIterator, lambda: ROWS.enabled)


def _unconditional_steps(trainer: Any, keras_make_function: Any, multi_worker: Any) -> Any:
    """keras-team/keras#19246: with steps_per_execution > 1 Keras runs each step inside a
    tf.cond, and a step's cross-replica merge (the gradient all-reduce) inside a
    conditional fails ("You must feed a value for placeholder tensor"). The replacement of
    ``TensorFlowTrainer._make_function`` returned here lets the loop's condition check that
    a batch is there, so the steps run unconditionally (multi-worker strategies only)."""
    import tensorflow as tf

    def _make_function(self: Any, step_function: Any) -> Any:
        if ROWS.enabled and getattr(step_function, "__name__", "") == "train_step":
            step_function = keras3_outputs.counting_step(step_function, ROWS.counter())  # docs/datafeed.md
        keras_function = keras_make_function(self, step_function)
        strategy = self.distribute_strategy
        if self.steps_per_execution == 1 or not multi_worker(strategy):
            return keras_function
        steps = int(self.steps_per_execution)

        def one_step(data: Any) -> Any:
            return trainer.reduce_per_replica(strategy.run(step_function, args=(data,)), strategy, reduction="auto")

        def some_steps(data: Any, iterator: Any) -> Any:
            def more(step: Any, outputs: Any, next_data: Any) -> Any:
                return tf.logical_and(step < steps, next_data.has_value())

            def step_on(step: Any, outputs: Any, next_data: Any) -> Any:
                outputs = one_step(next_data.get_value())
                next_data = tf.cond(step + 1 < steps, iterator.get_next_as_optional, lambda: next_data)
                return step + 1, outputs, next_data

            first = (tf.constant(1), one_step(data), iterator.get_next_as_optional())
            return tf.while_loop(more, step_on, first)[1]

        if not self.run_eagerly:
            one_step = tf.function(one_step, reduce_retracing=True, jit_compile=self.jit_compile)
            some_steps = tf.function(some_steps, reduce_retracing=True)
        one_step = self._autoconvert_optionals(one_step)

        def function(iterator: Any) -> Any:
            if not isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)):
                return keras_function(iterator)
            first = iterator.get_next_as_optional()
            if not first.has_value():
                raise StopIteration
            return some_steps(first.get_value(), iterator)

        return function

    return _make_function


def _patch_callbacks(multi_worker: Any) -> None:
    """Keras 3's ModelCheckpoint, BackupAndRestore and TensorBoard write on every worker, to
    the same path: two workers on one host (or on shared storage) collide, h5py's file lock
    fails ("BlockingIOError: ... unable to lock file") or a file is written twice at once,
    and every worker's BackupAndRestore deletes the same directory at the end. tf_keras
    wrote only on the chief. Here a non-chief worker writes to a temporary directory of its
    own, deleted afterwards; it still runs the save (any collective in it stays
    symmetric) and still restores from the real path."""
    import shutil
    import tempfile

    from keras.src.callbacks import BackupAndRestore, ModelCheckpoint, TensorBoard

    def not_chief(model: Any) -> bool:
        strategy = getattr(model, "distribute_strategy", None)
        return bool(strategy is not None and multi_worker(strategy) and not strategy.extended.should_checkpoint)

    def to_temp_dir(method: Any, root_of: Any, path_attrs: Sequence[str]) -> Any:
        """``method`` with the paths ``path_attrs`` (under ``root_of(self)``) moved to a temporary
        directory for the call, on a non-chief worker."""

        def on_worker(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not not_chief(self.model):
                return method(self, *args, **kwargs)
            saved = {name: getattr(self, name) for name in path_attrs}
            root = root_of(self)
            temp = tempfile.mkdtemp(prefix="tfos-keras-worker-")
            try:
                for name, path in saved.items():
                    setattr(self, name, temp + path[len(root):] if path.startswith(root) else os.path.join(temp, os.path.basename(path)))
                return method(self, *args, **kwargs)
            finally:
                for name, path in saved.items():
                    setattr(self, name, path)
                shutil.rmtree(temp, ignore_errors=True)

        on_worker.__wrapped__ = method  # type: ignore[attr-defined]
        return on_worker

    ModelCheckpoint._save_model = to_temp_dir(
        ModelCheckpoint._save_model, lambda cb: os.path.dirname(cb.filepath), ("filepath",))
    BackupAndRestore._save_model = to_temp_dir(
        BackupAndRestore._save_model, lambda cb: cb.backup_dir,
        ("backup_dir", "_weights_path", "_training_metadata_path", "_prev_weights_path", "_prev_training_metadata_path"),
    )
    keras_backup_end = BackupAndRestore.on_train_end

    def backup_on_train_end(self: Any, logs: Any = None) -> Any:
        if not_chief(self.model):  # the chief deletes the backup (delete_checkpoint=True)
            return None
        return keras_backup_end(self, logs)

    keras_set_model = TensorBoard.set_model
    keras_tensorboard_end = TensorBoard.on_train_end

    def set_model(self: Any, model: Any) -> Any:
        if not not_chief(model):
            return keras_set_model(self, model)
        _remove_temp_dir(self)  # of an earlier fit
        log_dir, self.log_dir = self.log_dir, tempfile.mkdtemp(prefix="tfos-keras-worker-")
        self._tfos_temp_dir = self.log_dir
        try:
            return keras_set_model(self, model)
        finally:
            self.log_dir = log_dir

    def tensorboard_on_train_end(self: Any, logs: Any = None) -> Any:
        try:
            return keras_tensorboard_end(self, logs)
        finally:
            _remove_temp_dir(self)

    def _remove_temp_dir(self: Any) -> None:
        temp = getattr(self, "_tfos_temp_dir", None)
        if temp:
            shutil.rmtree(temp, ignore_errors=True)
            self._tfos_temp_dir = None

    BackupAndRestore.on_train_end = backup_on_train_end
    TensorBoard.set_model = set_model
    TensorBoard.on_train_end = tensorboard_on_train_end


def _apply_on_import(trainer: Any) -> None:
    try:
        apply(trainer)
    except Exception:  # noqa: BLE001 - never break the user's import of Keras
        log.warning("tfos: could not apply the Keras 3 multi-worker fix (Keras runs unchanged)", exc_info=True)


def default_legacy_keras(driver_value: Optional[str]) -> None:
    """Forwards the driver's ``TF_USE_LEGACY_KERAS`` before ``main_fun`` imports TensorFlow (TF process).

    The node's own environment (e.g. ``spark.executorEnv.TF_USE_LEGACY_KERAS``) wins, then
    the driver's value. Unset on both, nothing is set: ``tf.keras`` is Keras 3, TensorFlow's
    default, as is ``import keras``; ``TF_USE_LEGACY_KERAS=1`` makes ``tf.keras`` Keras 2
    (``tf_keras``), as TFoS programs expect.
    """
    if "TF_USE_LEGACY_KERAS" not in os.environ and driver_value is not None:
        os.environ["TF_USE_LEGACY_KERAS"] = driver_value
