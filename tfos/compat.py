"""TensorFlow 2 compatibility helpers (TensorFlowOnSpark's ``compat`` module).

These functions are meant to be called from the user's TensorFlow code, i.e.
inside the TF process that ``tfos`` starts on each Spark executor.  TensorFlow
(and Keras) are imported lazily, so importing this module does not need them.

Both Keras flavours are supported: Keras 3 (the ``keras`` package, which is
``tf.keras`` from TensorFlow 2.16 on) and the legacy Keras 2 API (``tf_keras``,
or ``keras`` < 3 with older TensorFlow).
"""

from __future__ import annotations

import inspect
import logging
import shutil
import tempfile
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["export_saved_model", "disable_auto_shard", "is_gpu_available", "checkpoint_callback"]


def _is_keras3_model(model: Any) -> bool:
    """Tells whether ``model`` is a Keras 3 model.

    Args:
        model: Any object.

    Returns:
        True if the ``keras`` package is version 3 or later and ``model`` is a
        ``keras.Model``.
    """
    try:
        import keras
    except ImportError:
        return False
    major = str(getattr(keras, "__version__", "0")).split(".", 1)[0]
    return major.isdigit() and int(major) >= 3 and isinstance(model, keras.Model)


def _is_legacy_keras_model(model: Any) -> bool:
    """Tells whether ``model`` is a Keras 2 model (``tf_keras`` or ``keras`` < 3).

    Args:
        model: Any object.

    Returns:
        True for ``tf_keras.Model`` instances and for other ``tf.Module``
        objects that have a Keras 2 style ``save`` method.
    """
    try:
        import tf_keras

        if isinstance(model, tf_keras.Model):
            return True
    except ImportError:
        pass
    import tensorflow as tf

    return isinstance(model, tf.Module) and callable(getattr(model, "save", None)) and hasattr(model, "compile")


def _save(model: Any, export_dir: str, verbose: bool) -> None:
    """Saves ``model`` as a TensorFlow SavedModel in ``export_dir``.

    Args:
        model: A Keras 3 model, a Keras 2 (``tf_keras``) model or a ``tf.Module``.
        export_dir: Destination directory or URI.
        verbose: Whether Keras 3 may print the exported endpoints.

    Raises:
        TypeError: If ``model`` is none of the supported types.
    """
    if _is_keras3_model(model):
        # Keras 3: inference-only SavedModel with a "serve" endpoint and a
        # "serving_default" signature.
        kwargs = {"verbose": verbose} if "verbose" in inspect.signature(model.export).parameters else {}
        model.export(export_dir, format="tf_saved_model", **kwargs)
    elif _is_legacy_keras_model(model):
        # tf_keras / Keras 2: full SavedModel that tf_keras.models.load_model can restore.
        model.save(export_dir, save_format="tf")
    else:
        import tensorflow as tf

        if not isinstance(model, tf.Module):
            raise TypeError(
                f"cannot export a {type(model).__module__}.{type(model).__qualname__}; expected a Keras 3 "
                "model, a tf_keras model or a tf.Module"
            )
        tf.saved_model.save(model, export_dir)


def export_saved_model(model: Any, export_dir: str, is_chief: bool = False) -> None:
    """Exports a model as a TensorFlow SavedModel, collectively across workers.

    Runs in the TF process on every worker.  Under
    ``tf.distribute.MultiWorkerMirroredStrategy`` saving involves collective
    operations, so *every* worker must call this function: the chief writes the
    SavedModel to ``export_dir`` while the other workers write to a private
    temporary local directory that is deleted afterwards.

    The format depends on the model:

    * Keras 3 model: ``model.export(export_dir)``, an inference-only SavedModel
      (endpoint ``serve`` and signature ``serving_default``); reload it with
      ``tf.saved_model.load`` (or ``keras.layers.TFSMLayer``).
    * ``tf_keras`` (Keras 2) model: ``model.save(export_dir, save_format="tf")``;
      reload with ``tf_keras.models.load_model`` or ``tf.saved_model.load``.
    * Any other ``tf.Module``: ``tf.saved_model.save(model, export_dir)``.

    Args:
        model: The (built) model to export.
        export_dir: Destination directory: a local path or a URI supported by
            TensorFlow's file systems (e.g. ``hdfs://`` where available).  Only
            used by the chief.
        is_chief: True on the chief worker (the one whose export is kept).

    Raises:
        TypeError: If ``model`` is not a Keras 3 model, a Keras 2 model or a
            ``tf.Module``.
        ValueError: From Keras, e.g. if the model has not been built yet.
    """
    if is_chief:
        logger.info("exporting SavedModel to %s", export_dir)
        _save(model, export_dir, verbose=False)
        return
    temp_dir = tempfile.mkdtemp(prefix="tfos_worker_model_")
    logger.debug("non-chief worker: exporting SavedModel to temporary dir %s", temp_dir)
    try:
        _save(model, f"{temp_dir}/model", verbose=False)
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)


def disable_auto_shard(options: Any) -> Any:
    """Turns off automatic sharding of a ``tf.data`` pipeline.

    Runs in the TF process.  Use it when the input is already sharded, e.g.
    because each worker reads its own Spark partitions.

    Args:
        options: A ``tf.data.Options`` object; modified in place.

    Returns:
        The same ``options`` object, so the call can be used inline:
        ``dataset.with_options(disable_auto_shard(tf.data.Options()))``.
    """
    import tensorflow as tf

    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    return options


def is_gpu_available() -> bool:
    """Tells whether TensorFlow can see at least one GPU.

    Runs in the TF process (or anywhere TensorFlow is installed).

    Returns:
        True if ``tf.config.list_physical_devices("GPU")`` is not empty.
    """
    import tensorflow as tf

    return len(tf.config.list_physical_devices("GPU")) > 0


def checkpoint_callback(report: Any, keras: Any = None) -> Any:
    """A Keras callback that reports every finished epoch's checkpoint to the driver (TF process).

    Its ``on_epoch_end(epoch)`` calls ``report(epoch + 1)``: "the checkpoint holds the
    first ``epoch + 1`` epochs". Usually reached as ``ctx.checkpoint_callback()``, which
    passes ``ctx.report_checkpoint`` (see :meth:`tfos.node_context.TFNodeContext.report_checkpoint`
    for what the driver does with it).

    Ordering: Keras runs the callbacks of ``fit(callbacks=[...])`` in list order, so put
    this callback **after** the ``BackupAndRestore`` (or ``ModelCheckpoint``) that saves the
    epoch: the report must follow the save it describes, never precede it. A failure
    between the save and the report then only makes the feed resume one epoch early
    (rows fed again, none lost). Use it with ``BackupAndRestore``'s default
    ``save_freq="epoch"``; with ``fit(initial_epoch=...)`` the epochs are counted from 0 of
    the ``train()`` call, as Keras counts them.

    Args:
        report: Called with the epochs checkpointed, an int >= 1.
        keras: The Keras module whose ``callbacks.Callback`` to subclass (``tf_keras`` or
            ``keras``); default ``tf.keras`` (Keras 3, or ``tf_keras`` when
            ``TF_USE_LEGACY_KERAS=1``: docs/migration.md "Keras").

    Returns:
        A ``keras.callbacks.Callback`` instance.
    """
    if keras is None:
        import tensorflow as tf

        keras = tf.keras

    class _ReportCheckpoint(keras.callbacks.Callback):  # type: ignore[misc, name-defined]
        """Reports ``epoch + 1`` at every epoch end (after the callbacks listed before it)."""

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            report(int(epoch) + 1)

    return _ReportCheckpoint()
