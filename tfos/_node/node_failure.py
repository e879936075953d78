"""What a TF process reports when its node fails: the failure, named after the node, with
the tfos error behind a TensorFlow wrapper and the memory-limit hint (TF process)."""

from __future__ import annotations

import dataclasses
import traceback

from tfos._node.address_space import memory_limit_note
from tfos._node.launch import NodeLaunch
from tfos.errors import NodeFailure

__all__ = ["after_abort", "exc_text", "node_failure"]

_MAX_TRACEBACK_CHARS = 60000


def exc_text(exc: BaseException) -> str:
    """``str(exc)``, or what Python's traceback module shows when that raises (pure)."""
    try:
        return str(exc)
    except Exception:  # noqa: BLE001 - a broken __str__ must not lose the failure report
        return f"<exception str() failed> (its {type(exc).__name__}.__str__ raised)"


def node_failure(launch: NodeLaunch, exc: BaseException) -> NodeFailure:
    """The failure report of ``exc``, raised in this node's main_fun or by tfos (TF process)."""
    r = launch.role
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    if len(tb) > _MAX_TRACEBACK_CHARS:
        tb = tb[: _MAX_TRACEBACK_CHARS // 2] + "\n...\n" + tb[-_MAX_TRACEBACK_CHARS // 2 :]
    # A tfos error raised by the feed inside tf.data reaches main_fun wrapped in a
    # TensorFlow error (InvalidArgumentError, with TF's function names and blank lines
    # around it): the node reports the tfos error; the traceback keeps both.
    from tfos._data.tfdata import unwrap_tf_data_error

    shown = unwrap_tf_data_error(exc) or exc
    msg = exc_text(shown)
    if len(msg) > 4000:
        msg = msg[:4000] + "... [truncated]"
    msg += memory_limit_note(exc)  # names RLIMIT_AS and spark.executor.pyspark.memory when they caused it
    return NodeFailure(r.executor_id, r.job_name, r.task_index, launch.host, "exception", type(shown).__name__, msg, tb)


def after_abort(failure: NodeFailure, reason: str) -> NodeFailure:
    """What a ``main_fun`` failing after the driver's abort cut its feed off reports (TF
    process): a ``FeedAbortedError``, a consequence of the abort and never a root cause that
    would hide the failure that caused it. ``tf.data`` wraps the feed's FeedAbortedError in
    a ``tf.errors.UnknownError``, and a ``main_fun`` may catch it and raise its own error;
    the message keeps what was raised, the traceback is unchanged."""
    if failure.error_type == "FeedAbortedError":
        return failure
    return dataclasses.replace(
        failure, error_type="FeedAbortedError",
        message=f"after the cluster aborted ({reason}), main_fun raised {failure.error_type}: {failure.message}",
    )
