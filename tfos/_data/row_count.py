"""Row accounting on a fed node: rows fed to TensorFlow vs rows Keras's train_step trained (TF process).

On a node with a feed (InputMode.SPARK), the feed reports every batch it hands to
``main_fun`` (:meth:`RowCount.handed`, with the batch's ``train()`` feed and epoch) and the
patched Keras trainer adds the rows of every local batch its ``train_step`` consumes to a
TensorFlow variable (:meth:`RowCount.counter`; an ``assign_add`` inside the step, so it
also works in an XLA-compiled step). The accounting's epoch is the *feed* epoch: epoch
``e`` of a ``cluster.train(data, num_epochs)`` call (numbered from 0 in each call), not a
Keras epoch. Rows trained are attributed to the feed epoch whose rows the feed was handing
out when they were trained: from the first row of epoch ``e`` handed to TensorFlow to the
first row of the next epoch (or the end of ``main_fun``). At that boundary the node records
the rows handed out but not yet trained. The figures go to the driver in the node's live figures
(:data:`tfos._data.figures.FIGURES`), one counter per name:

- ``rows_fed/<feed>/<epoch>``: rows of that epoch handed to TensorFlow;
- ``rows_trained/<feed>/<epoch>``: rows train_step consumed while that epoch was handed out;
- ``rows_gap/<feed>/<epoch>``: rows handed out on this node so far minus rows trained so far,
  at the epoch's end (the pipeline's read-ahead plus every row dropped so far; negative when
  rows were trained more than once);
- ``rows_batch/<feed>/<epoch>``: the largest batch of that epoch handed out;
- ``rows_closed/<feed>/<epoch>``: 1 once the epoch ended on this node;
- ``rows_final/<feed>/<epoch>``: 1 when it ended because ``main_fun`` returned (nothing more
  will be trained: its gap is exact);
- ``rows_shard/<feed>/<epoch>``: the auto-shard policy in effect when the epoch's first row
  was handed out: that of the dataset last given to ``experimental_distribute_dataset``
  (after tfos's own ``OFF``, :mod:`tfos._node.fed_shard`), as :data:`POLICY_CODES` (0: no
  dataset was distributed that way, e.g. ``distribute_datasets_from_function``);
- ``rows_unread/<feed>/<epoch>``: when ``main_fun`` returned without ``DataFeed.terminate()``,
  rows of that epoch the node had received but ``main_fun`` never took (chunks still queued,
  the rest of a chunk being read);
- ``rows_unended/<feed>/<epoch>``: partitions of that epoch whose connection was still open
  then (not consumed to their end: their remaining rows, and later partitions Spark's tasks
  never sent, are not counted);
- ``rows_trained``: every row train_step consumed on this node.

The driver judges them (:mod:`tfos._driver.row_accounting`). See docs/datafeed.md, "Row
accounting".
"""

from __future__ import annotations

import collections
import logging
import threading
import weakref
from typing import Any, Callable, Optional

from tfos._data.figures import FIGURES, NodeFigures

log = logging.getLogger(__name__)

#: ``tf.data.experimental.AutoShardPolicy`` values as counted (``int(policy) + 2``; 0 unknown).
POLICY_CODES = {"OFF": 1, "AUTO": 2, "FILE": 3, "DATA": 4, "HINT": 5}


class RowCount:
    """One TF process's row accounting (see the module docstring). Thread-safe: the feed
    calls :meth:`handed` from tf.data's reader threads or ``main_fun``'s thread."""

    def __init__(self, figures: NodeFigures = FIGURES) -> None:
        self._figures = figures
        self._lock = threading.Lock()
        self.enabled = False
        self._variable: Any = None
        self._read: Optional[Callable[[], int]] = None
        self._open: Optional[tuple[str, int]] = None
        self._open_trained = 0  # the trained counter when the open epoch began
        self._handed = 0  # rows handed to TensorFlow on this node, every epoch
        self._batch = 0
        self._python_trained = 0
        #: The auto-shard policy code (:data:`POLICY_CODES`) of the dataset last distributed.
        self.policy = 0
        self._readers: Any = weakref.WeakSet()  # the node's DataFeed objects

    def distributed(self, code: int) -> None:
        """Notes the auto-shard policy (:data:`POLICY_CODES`) of a dataset handed to
        ``experimental_distribute_dataset`` (TF process; :mod:`tfos._node.fed_shard`)."""
        self.policy = int(code)

    def reader(self, feed: Any) -> None:
        """Registers a ``DataFeed`` whose unread rows :meth:`close` counts."""
        self._readers.add(feed)

    def enable(self) -> None:
        """Turns the accounting on (TF process of a fed node, before ``main_fun``)."""
        self.enabled = True

    def counter(self) -> Any:
        """The int64 TensorFlow variable train_step adds its local batch's rows to, created
        on first use outside any distribution strategy (a plain local variable: no
        collective, no synchronisation with other workers)."""
        with self._lock:
            if self._variable is None:
                import tensorflow as tf
                from tensorflow.python.ops import resource_variable_ops

                with tf.init_scope():
                    # The constructor itself, not tf.Variable: a strategy's variable creator
                    # (fit called inside strategy.scope()) would make it a distributed one.
                    self._variable = resource_variable_ops.ResourceVariable(
                        0, dtype=tf.int64, trainable=False, name="tfos_rows_trained")
                variable = self._variable
                self._read = lambda: int(variable.read_value().numpy())
            return self._variable

    def count_in_python(self) -> None:
        """Counts rows trained in Python, through :meth:`add_trained`, instead of a variable:
        on a fed ParameterServerStrategy worker the steps are the coordinator's closures, and
        each tells the worker that runs it its batch's rows (:mod:`tfos._node.ps_feed`)."""
        with self._lock:
            self._python_trained = 0
            self._read = lambda: self._python_trained

    def add_trained(self, rows: int) -> None:
        """Adds ``rows`` rows trained (after :meth:`count_in_python`)."""
        with self._lock:
            self._python_trained += int(rows)

    def trained(self) -> int:
        """Rows train_step consumed on this node so far (0 before the first step)."""
        read = self._read
        if read is None:
            return 0
        try:
            return read()
        except Exception:  # noqa: BLE001 - the variable's runtime is gone (interpreter exit)
            log.debug("could not read the rows-trained counter", exc_info=True)
            return 0

    def handed(self, feed_id: str, epoch: int, rows: int) -> None:
        """Notes ``rows`` rows of epoch ``epoch`` of feed ``feed_id`` handed to TensorFlow."""
        if not self.enabled or rows <= 0:
            return
        key = (feed_id or "-", int(epoch))
        with self._lock:
            if key != self._open:
                trained = self.trained()
                self._close_open(trained)
                self._open, self._open_trained, self._batch = key, trained, 0
                if self.policy:
                    self._figures.set(f"rows_shard/{key[0]}/{key[1]}", self.policy)
            self._handed += rows
            name = f"{key[0]}/{key[1]}"
            self._figures.add(f"rows_fed/{name}", rows)
            if rows > self._batch:
                self._batch = rows
                self._figures.set(f"rows_batch/{name}", rows)

    def _close_open(self, trained: int, final: bool = False) -> None:
        if self._open is None:
            return
        name = f"{self._open[0]}/{self._open[1]}"
        if self._read is not None:  # Keras's train_step counts (main_fun trains with fit)
            self._figures.set(f"rows_trained/{name}", trained - self._open_trained)
            self._figures.set(f"rows_gap/{name}", self._handed - trained)
            self._figures.set("rows_trained", trained)
        if final:
            self._figures.set(f"rows_final/{name}", 1)
        self._figures.set(f"rows_closed/{name}", 1)
        self._open = None

    def close(self, hub: Any = None) -> None:
        """Ends the open epoch (``main_fun`` returned): rows still untrained never will be.

        Args:
            hub: The node's ``FeedHub``; when given, the rows it received that ``main_fun``
                never took are counted per epoch (:func:`unread_rows`; none for a queue
                ``main_fun`` terminated: dropping those is what ``terminate()`` is for).
        """
        if not self.enabled:
            return
        trained = self.trained()
        unread, unended = unread_rows(hub, list(self._readers)) if hub is not None else ({}, {})
        with self._lock:
            self._close_open(trained, final=True)
            for (feed, epoch) in sorted(set(unread) | set(unended), key=lambda k: (k[0], k[1])):
                name = f"{feed}/{epoch}"
                self._figures.set(f"rows_unread/{name}", unread.get((feed, epoch), 0))
                self._figures.set(f"rows_unended/{name}", unended.get((feed, epoch), 0))
                self._figures.set(f"rows_final/{name}", 1)
                self._figures.set(f"rows_closed/{name}", 1)


def _chunk_rows(chunk: Any) -> int:
    from tfos._data.framing import decode_chunk

    try:
        return len(decode_chunk(chunk.conn.kind, chunk.payload))
    except Exception:  # noqa: BLE001 - a chunk that does not decode: counted as unknown
        return 0


def unread_rows(hub: Any, readers: list) -> tuple[dict, dict]:
    """Rows the node received for training that ``main_fun`` never took, and partitions not
    consumed to their end, per ``(feed id, epoch)`` (TF process, when ``main_fun`` returned).

    Counts the rest of each ``DataFeed``'s current chunk, its peeked chunk, the ready batches
    of each ``as_dataset`` reader, and every chunk still on the hub's queues (decoded to count them: at most the queue's bound), for queues
    ``main_fun`` did not terminate. Rows of partitions still being sent, or never sent, are
    not known here (the driver reports them as "at least").
    """
    from tfos._data.feed_connection import Chunk

    terminated = set(getattr(hub, "terminated", ()))
    rows: collections.Counter = collections.Counter()
    parts: collections.Counter = collections.Counter()

    def key(conn: Any) -> Optional[tuple[str, int]]:
        if conn is None or getattr(conn, "mode", "") != "train" or conn.qname in terminated:
            return None
        return (conn.feed_id or "-", int(conn.epoch))

    for r in readers:
        ready = getattr(r, "_out", None)
        if ready is not None and hasattr(r, "epoch_keys"):  # an as_dataset reader: (dataset epoch, batch) items
            if getattr(r._feed, "qname_in", None) in terminated:
                continue
            with ready.mutex:
                batches = [item for item, _ in ready.queue if isinstance(item, tuple)]
            for use_epoch, batch in batches:
                if use_epoch in r.epoch_keys and len(batch):
                    fid, epoch = r.epoch_keys[use_epoch]
                    rows[(fid or "-", int(epoch))] += len(batch[0])
            continue
        k = key(getattr(r, "_conn", None))
        left = len(getattr(r, "_rows", ())) - getattr(r, "_pos", 0)
        if k is not None and left > 0:
            rows[k] += left
        peeked = getattr(r, "_peeked", None)
        if isinstance(peeked, Chunk) and key(peeked.conn) is not None:
            rows[key(peeked.conn)] += _chunk_rows(peeked)
    for q in list(getattr(hub, "queues", {}).values()):
        with q.mutex:
            items = list(q.queue)
        for item in items:
            if isinstance(item, Chunk) and key(item.conn) is not None:
                rows[key(item.conn)] += _chunk_rows(item)
    for conn in list(getattr(hub, "_conns", ())):
        if key(conn) is not None:
            parts[key(conn)] += 1
    return dict(rows), dict(parts)


#: The TF process's row accounting.
ROWS = RowCount()
