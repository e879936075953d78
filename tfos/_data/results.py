"""Inference results of a TF process: what ``DataFeed.batch_results`` accepts, and the
frames they go back in (pure; TF process)."""

from __future__ import annotations

import pickle
from typing import Any, Optional

from tfos.errors import InferenceResultError

__all__ = ["RESULT_FRAME_BYTES", "result_frames", "result_items"]

#: Target size of one inference results frame, in bytes. Bigger answers are split into
#: several frames (same rows, same order): the executor JVM persists every frame as one
#: byte array, and arrays of half a G1 heap region (512 KB with a 1 GB heap) or more are
#: "humongous" objects that make persisting the results slower (docs/performance.md).
RESULT_FRAME_BYTES = 256 * 1024


def result_frames(items: list, limit: Optional[int] = None) -> list[bytes]:
    """Pickles inference results into frames of about ``limit`` bytes (pure; TF process).

    The number of results per frame is estimated from the pickled size of the first
    result, so every result is pickled once.

    Args:
        items: The results of one batch, in order.
        limit: Target frame size in bytes (default :data:`RESULT_FRAME_BYTES`); a single
            result larger than that gets a frame of its own.

    Returns:
        Pickled lists whose concatenation is ``items``.
    """
    limit = RESULT_FRAME_BYTES if limit is None else limit
    proto = pickle.HIGHEST_PROTOCOL
    if len(items) > 1:
        per = max(1, limit // (len(pickle.dumps(items[0], protocol=proto)) + 1))
        if per < len(items):
            return [pickle.dumps(items[i : i + per], protocol=proto) for i in range(0, len(items), per)]
    return [pickle.dumps(items, protocol=proto)]


def result_items(results: Any) -> list:
    """One item per row, as TFoS returned them: numpy rows stay numpy, scalars stay scalars.

    Args:
        results: A list, tuple, numpy array, ``tf.Tensor`` or any iterable.

    Returns:
        ``list(results)``; a ``tf.Tensor`` is first converted with ``.numpy()``.

    Raises:
        InferenceResultError: For None, a string/bytes, or anything not iterable.
    """
    if type(results).__module__.startswith("tensorflow") and callable(getattr(results, "numpy", None)):
        results = results.numpy()
    if isinstance(results, (str, bytes, bytearray)) or results is None:
        # list("abc") would answer one row per character: never what main_fun meant.
        raise InferenceResultError(
            f"batch_results() needs one result per input row (a list, tuple, numpy array or tf.Tensor), got "
            f"{type(results).__name__}{'' if results is None else ' (a string would give one result per character)'}"
        )
    try:
        return list(results)
    except TypeError:
        raise InferenceResultError(
            f"batch_results() needs one result per input row (a list, tuple, numpy array or tf.Tensor), got "
            f"{type(results).__name__}, which is not iterable"
        ) from None
