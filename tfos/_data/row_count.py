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
- ``rows_trained``: every row train_step consumed on this node.

The driver judges them (:mod:`tfos._driver.row_accounting`). See docs/datafeed.md, "Row
accounting".
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Optional

from tfos._data.figures import FIGURES, NodeFigures

log = logging.getLogger(__name__)


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

    def close(self) -> None:
        """Ends the open epoch (``main_fun`` returned): rows still untrained never will be."""
        if not self.enabled:
            return
        trained = self.trained()
        with self._lock:
            self._close_open(trained, final=True)


#: The TF process's row accounting.
ROWS = RowCount()
