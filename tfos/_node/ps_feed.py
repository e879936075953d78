"""InputMode.SPARK under ParameterServerStrategy: each worker's per-worker dataset reads that
worker's own tfos feed (TF processes: the fed workers and the chief, the coordinator).

A per-worker dataset is a graph the coordinator builds and each worker's TensorFlow runtime
runs; nothing in it calls back into Python, and a ``from_generator`` dataset built on the
coordinator would call the coordinator's generator. So a fed worker that serves
(``server.join()`` or ``ctx.run_server_and_wait()``) registers its feed reader in its own
process under fixed tokens of TensorFlow's Python-function registry (:func:`serve`), and on
the coordinator ``DataFeed.as_dataset(...)`` called while ``model.fit`` builds a per-worker
dataset returns a dataset whose ``PyFunc`` op names that token (:func:`remote_dataset`):
wherever the graph runs, the op reads the feed of the worker that runs it. The reader there is
the feed's tf.data reader (:class:`tfos._data.tfdata.FeedBatches`), with the same batching,
epochs, shuffle and row accounting as on any fed node.

Epochs (docs/parameter_servers.md "InputMode.SPARK"): ``fit`` needs ``steps_per_epoch``; each
step is one batch of the worker that runs it; the fit ends when its steps are done or when a
worker's feed ends (its next step finds no batch: the steps still queued are cancelled, the
ones running finish, the epoch ends short). At the end of such a fit every worker's feed is
ended (``DataFeed.terminate()``: ``train()`` skips the partitions nobody read and returns).
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any, Optional

from tfos._data.worker_feeds import END_TOKEN, READ_TOKEN, TRAINED_TOKEN

log = logging.getLogger(__name__)

#: Longest wait for a worker to end its feed at the end of a fit, in seconds.
END_TIMEOUT_S = 60.0
#: The registered functions (TensorFlow's registry keeps weak references only).
_REGISTERED: list = []
class _WorkerFeed:
    """A fed worker's feed as its per-worker datasets read it (TF process of the worker)."""

    def __init__(self, ctx: Any) -> None:
        self._ctx = ctx
        self._lock = threading.Lock()
        self._key: Optional[str] = None
        self._feed: Any = None
        self._batches: Any = None
        self._empty: list = []
        self._ended = False

    def _name(self) -> str:
        return f"{self._ctx.job_name}:{self._ctx.task_index}"

    def _open(self, key: str) -> None:
        import numpy as np
        import tensorflow as tf

        from tfos._data.chunk_columns import columns_of
        from tfos._data.tfdata import FeedBatches

        p = json.loads(key)
        specs = [tf.TensorSpec([None] + shape, dtype) for dtype, shape in p["signature"]]
        signature = specs[0] if p["single"] else tuple(specs)
        columns, single = columns_of(signature)
        self._feed = self._feed or self._ctx.get_data_feed(train_mode=True, qname_in=p["qname"])
        reader = FeedBatches(self._feed, p["batch_size"], columns, single=single, drop_remainder=p["drop_remainder"],
                             buffer_batches=p["buffer_batches"], steps_per_epoch=p["steps_per_epoch"],
                             shuffle_rows=p["shuffle_rows"], shuffle_seed=p["shuffle_seed"])
        self._batches = iter(reader)
        self._empty = [np.zeros([0] + [d or 0 for d in shape], dtype=tf.as_dtype(dtype).as_numpy_dtype)
                       for dtype, shape in p["signature"]]
        self._key = key
        log.info("tfos node %s: its per-worker dataset reads this node's feed (queue %r)", self._name(), p["qname"])

    def read(self, params: Any) -> list:
        """The next batch of this worker's feed, as one array per column; zero rows at its end."""
        key = params.item().decode() if hasattr(params, "item") else bytes(params).decode()
        with self._lock:
            if self._key is None:
                self._open(key)
            elif key != self._key:
                raise ValueError(
                    f"tfos node {self._name()}: a second per-worker dataset over this worker's feed with other "
                    "settings; a feed has one reader (docs/parameter_servers.md)")
            if self._ended:
                return list(self._empty)
            try:
                batch = next(self._batches)
            except StopIteration:
                self._ended = True
                return list(self._empty)
        return list(batch) if isinstance(batch, tuple) else [batch]

    def trained(self, rows: Any) -> Any:
        """Notes ``rows`` rows trained by a step this worker ran (row accounting)."""
        import numpy as np

        from tfos._data.row_count import ROWS

        ROWS.add_trained(int(rows))
        return np.int64(rows)

    def end(self) -> Any:
        """Ends this worker's feed: ``train()`` skips what nobody read (idempotent)."""
        import numpy as np

        with self._lock:
            if self._feed is None and getattr(self._ctx, "mgr", None) is not None:
                self._feed = self._ctx.get_data_feed(train_mode=True)
            if self._feed is not None and not self._feed.done_feeding:
                self._feed.terminate()
            self._ended = True
        return np.int64(0)


def coordinated(cluster_spec: Any) -> bool:
    """Whether a cluster spec has a chief to coordinate and ps tasks (pure; as
    :func:`tfos._node.ps_serving.coordinated`, which imports this module)."""
    return bool(cluster_spec.get("chief")) and bool(cluster_spec.get("ps"))


def serve(ctx: Any) -> bool:
    """Registers this fed worker's feed reader for the per-worker datasets the coordinator
    builds (TF process of a worker that serves). Returns whether it applies: a worker of a
    cluster with a chief and ps tasks, fed by InputMode.SPARK (``ctx.mgr`` set)."""
    if getattr(ctx, "mgr", None) is None or ctx.job_name != "worker" or not coordinated(ctx.cluster_spec):
        return False
    from tensorflow.python.ops import script_ops

    from tfos._data.row_count import ROWS

    feed = _WorkerFeed(ctx)
    functions = {READ_TOKEN: feed.read, TRAINED_TOKEN: feed.trained, END_TOKEN: feed.end}
    _REGISTERED[:] = [feed, functions]
    ROWS.count_in_python()  # rows trained come from the steps this worker runs
    for token, fn in functions.items():
        script_ops._py_funcs._funcs[token] = fn  # TensorFlow's registry of tf.py_function / numpy_function
    return True


def end_feeds(coordinator: Any, chief_feed: Any = None, timeout_s: float = END_TIMEOUT_S) -> None:
    """Ends every worker's feed at the end of a fit over the workers' feeds (coordinator). A
    worker that does not answer within ``timeout_s`` (lost) is skipped. ``chief_feed``: the
    chief's own feed; rows waiting there were routed to the chief (``train()`` without
    ``feed_chief=False``), which no step reads: a WARNING names it, and it is ended too."""
    _end_chief_feed(chief_feed)
    import tensorflow as tf
    from tensorflow.python.ops import gen_script_ops

    @tf.function
    def end() -> Any:
        return gen_script_ops.py_func(input=[], token=END_TOKEN, Tout=[tf.int64])[0]

    values = coordinator._create_per_worker_resources(end)._values
    for index, value in enumerate(values):
        event = getattr(value, "_status_available_event", None)
        if event is not None and not event.wait(timeout_s):
            log.warning("tfos: worker %d did not end its feed within %g s (lost?)", index, timeout_s)
            continue
        try:
            value.fetch()
        except Exception as exc:  # noqa: BLE001 - a lost worker: its feed ended with its process
            log.info("tfos: worker %d could not end its feed: %s: %s", index, type(exc).__name__, exc)


def _end_chief_feed(feed: Any) -> None:
    hub = getattr(feed, "_hub", None)
    queue = getattr(hub, "queues", {}).get(getattr(feed, "qname_in", "input")) if hub is not None else None
    if queue is None or feed.done_feeding:
        return
    if queue.qsize():
        log.warning("tfos node %s: train() fed this chief, which coordinates model.fit over the workers' feeds and "
                    "reads no feed itself: its partitions are skipped, their rows not trained. Call "
                    "cluster.train(..., feed_chief=False) (docs/parameter_servers.md)", getattr(hub, "node_name", "chief"))
    feed.terminate()
