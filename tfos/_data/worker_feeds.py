"""The coordinator's side of per-worker datasets over the workers' tfos feeds (TF process of
the chief under ParameterServerStrategy; the worker's side is :mod:`tfos._node.ps_feed`).

While ``model.fit`` builds its per-worker dataset (:func:`building`), ``DataFeed.as_dataset``
returns :func:`remote_dataset`: a dataset whose ``PyFunc`` op names a token each fed worker
registered in its own process, so that wherever the graph runs it reads the feed of the worker
that runs it. See docs/parameter_servers.md "InputMode.SPARK".
"""

from __future__ import annotations

import contextlib
import json
from typing import Any, Optional

#: The tokens a fed worker registers in TensorFlow's Python-function registry.
READ_TOKEN = "tfos_ps_feed_read"
TRAINED_TOKEN = "tfos_ps_feed_trained"
END_TOKEN = "tfos_ps_feed_end"
#: The fit whose per-worker dataset is being built (TensorFlow may trace the dataset function
#: in one of its own threads, so this is not thread-local; fit() calls do not overlap).
_BUILDING: list = []


@contextlib.contextmanager
def building(state: Any):
    """While ``model.fit`` (:mod:`tfos._node.keras3_ps`) builds its per-worker dataset on the
    coordinator: ``DataFeed.as_dataset`` then returns :func:`remote_dataset` and marks ``state``
    fed (``state.fed = True``)."""
    _BUILDING.append(state)
    try:
        yield
    finally:
        _BUILDING.remove(state)


def building_state() -> Any:
    """The fit whose per-worker dataset is being built in this process, or None."""
    return _BUILDING[-1] if _BUILDING else None


def workers_dataset(feed: Any, batch_size: int, output_signature: Any, per_epoch: bool, **options: Any) -> Any:
    """``DataFeed.as_dataset`` while ``model.fit`` builds its per-worker dataset: marks the fit
    fed (``state.fed``, ``state.chief_feed``: the chief's own ``feed``, which no step reads) and
    returns :func:`remote_dataset` over the workers' feeds of queue ``feed.qname_in`` (coordinator).

    Raises:
        ValueError: For ``per_epoch=True`` (a fit's epochs are ``steps_per_epoch`` here).
    """
    if per_epoch:
        raise ValueError("as_dataset(per_epoch=True) does not fit ParameterServerStrategy: give fit() "
                         "steps_per_epoch (docs/parameter_servers.md)")
    state = building_state()
    if state is not None:
        state.fed, state.chief_feed = True, feed
    return remote_dataset(getattr(feed, "qname_in", "input"), batch_size, output_signature, **options)


def remote_dataset(qname: str, batch_size: int, output_signature: Any, *, drop_remainder: bool = False,
                   prefetch: int = 2, buffer_batches: Optional[int] = None, steps_per_epoch: Optional[int] = None,
                   shuffle_rows: int = 0, shuffle_seed: Optional[int] = None) -> Any:
    """A ``tf.data.Dataset`` of the batches of the feed of the worker that runs it (built on the
    coordinator; see the module docstring). Arguments as ``DataFeed.as_dataset``.

    Raises:
        TypeError, ValueError: As ``DataFeed.as_dataset`` for a bad signature or batch size;
            ValueError for ``per_epoch`` (not offered here) is raised by the caller.
    """
    import tensorflow as tf
    from tensorflow.python.ops import gen_script_ops

    from tfos._data.chunk_columns import check_batch_dims, columns_of

    columns_of(output_signature)
    check_batch_dims(output_signature, batch_size)
    single = isinstance(output_signature, tf.TensorSpec)
    specs = [output_signature] if single else list(output_signature)
    params = json.dumps({
        "qname": qname, "batch_size": int(batch_size), "single": single, "drop_remainder": bool(drop_remainder),
        "signature": [[s.dtype.name, [d for d in s.shape.as_list()[1:]]] for s in specs],
        "buffer_batches": buffer_batches, "steps_per_epoch": steps_per_epoch, "shuffle_rows": int(shuffle_rows),
        "shuffle_seed": shuffle_seed}, sort_keys=True)

    def read(p: Any) -> Any:
        out = gen_script_ops.py_func(input=[p], token=READ_TOKEN, Tout=[s.dtype for s in specs])
        out = [tf.ensure_shape(t, s.shape) for t, s in zip(out, specs)]
        return out[0] if single else tuple(out)

    ds = tf.data.Dataset.from_tensors(tf.constant(params)).repeat().map(read)
    ds = ds.take_while(lambda *batch: tf.shape(batch[0])[0] > 0)  # zero rows: the end of the worker's feed
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    ds = ds.with_options(options)
    return ds.prefetch(prefetch) if prefetch else ds


def count_trained(rows: Any) -> Any:
    """In a step that runs on a fed worker: tells that worker's row accounting ``rows`` rows
    were trained (an op; returns ``rows`` as int64)."""
    import tensorflow as tf
    from tensorflow.python.ops import gen_script_ops

    return gen_script_ops.py_func(input=[tf.cast(rows, tf.int64)], token=TRAINED_TOKEN, Tout=[tf.int64])[0]


