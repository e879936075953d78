"""The ``steps_per_epoch`` batching of the tf.data reader: exactly ``S`` batches per epoch
(TF process, the reader thread of :class:`tfos._data.tfdata.FeedBatches`).

Epoch ``e`` of the feed becomes ``S = steps_per_epoch`` batches, handed out in order, so
every node's dataset has the same steps in every epoch whatever share of the partitions
Spark gave it. The first ``S - hold_batches`` batches hold ``batch_size`` rows; the rows of
the epoch after them are held back until the epoch's end is known (the first chunk of a
later epoch, or the end of the feed) and then spread evenly over the epoch's remaining
batches: fewer than ``batch_size`` rows each (down to empty batches) when the node got
fewer than ``S x batch_size`` rows in the epoch, more when it got more. An epoch without
rows on this node is ``S`` empty batches. Epochs are counted from the feed job's first
epoch (a restarted ``train()`` resumes its feed at epoch ``c > 0``: the dataset then holds
``S`` batches for each of the epochs ``c..n-1``, as a ``fit`` resumed after ``c``
checkpointed epochs expects). At the end of the feed the current epoch is completed, and
so is every later epoch of the last feed job this node got rows of (its feed header names
the job's last epoch): ``S`` empty batches each. A node that got no row at all of a later
``train()`` call cannot know that call's epochs.

With ``shuffle_rows = W`` the epoch's rows go into a :class:`~tfos._data.shuffle.RowPool`
instead and each batch is drawn from it at random: the first ``S - hold_batches`` batches
once ``W + batch_size`` rows are pooled (so at least ``W`` rows remain to draw from), the
held ones at the epoch's end as above.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Optional, Sequence

from tfos._data.chunk_columns import Column
from tfos._data.shuffle import RowPool

__all__ = ["EpochSteps", "check_steps"]


class EpochSteps:
    """Cuts the rows of each epoch into exactly ``steps`` batches (see the module docstring).

    Args:
        batch_size: Rows of a full batch.
        steps: Batches per epoch (``S``).
        hold_batches: The last batches of each epoch, cut only at the epoch's end.
        cols: The batches' columns (for empty batches before any row arrived).
        emit: Hands ``(epoch, batch)`` to the consumer; returns False once the reader was
            closed.
        shuffle_rows: The row-level shuffle window (rows; 0: the fed order).
        shuffle_seed: Seed of the shuffle (None: a fresh one from the OS).
    """

    def __init__(self, batch_size: int, steps: int, hold_batches: int, cols: Sequence[Column],
                 emit: Callable[[Any], bool], shuffle_rows: int = 0, shuffle_seed: Optional[int] = None):
        import numpy as np

        self._size = batch_size
        self._steps = steps
        self._free = steps - hold_batches  # batches of an epoch cut before its end is known
        self._cols = cols
        self._emit = emit
        self._window = shuffle_rows
        self._pool = RowPool(np.random.default_rng(shuffle_seed)) if shuffle_rows else None
        self._held: collections.deque = collections.deque()  # column tuples of `epoch`, not yet handed out
        self._have = 0
        self.epoch = 0
        self.started = False  # `epoch` set to the feed job's first epoch (from the first chunk)
        self._emitted = 0  # batches of `epoch` handed out
        self._empty: Optional[tuple] = None  # zero-row columns with the data's row shapes

    def _empty_batch(self) -> tuple:
        import numpy as np

        if self._empty is not None:
            return self._empty
        return tuple(np.empty((0,) + (c.shape or ()), c.dtype) for c in self._cols)

    def _take(self, n: int) -> bool:
        """Hands out the next batch of ``n`` rows of the epoch."""
        import numpy as np

        self._have -= n
        self._emitted += 1
        if self._pool is not None:
            drawn = self._pool.take(n)
            return self._emit((self.epoch, drawn if drawn is not None else self._empty_batch()))
        held = self._held
        pieces: list[tuple] = []
        got = 0
        while got < n:
            piece = held[0]
            m = len(piece[0])
            if m <= n - got:
                pieces.append(held.popleft())
                got += m
            else:
                cut = n - got
                pieces.append(tuple(c[:cut] for c in piece))
                held[0] = tuple(c[cut:] for c in piece)
                got += cut
        if not pieces:
            batch = self._empty_batch()
        elif len(pieces) == 1:
            batch = pieces[0]
        else:
            batch = tuple(np.concatenate(c) for c in zip(*pieces))
        return self._emit((self.epoch, batch))

    def close_epoch(self) -> bool:
        """The end of the epoch is known: spreads its held rows over its remaining batches."""
        while self._emitted < self._steps:
            left = self._steps - self._emitted
            if not self._take(-(-self._have // left)):
                return False
        self.epoch += 1
        self._emitted = 0
        return True

    def add(self, conn: Any, cols: tuple, epoch: int) -> bool:
        """Adds a chunk's columns of dataset epoch ``epoch``; False once the reader was closed."""
        if self._empty is None:
            self._empty = tuple(c[:0] for c in cols)
        if not self.started:
            # A feed resumed after a restart starts at its first epoch, not at 0.
            self.started = True
            self.epoch = conn.first_epoch
        # A later epoch starts (or the next train() call's first one): the epochs before
        # it are complete on this node (EpochOrder handed out their rows first; rows of an
        # earlier epoch that it gave up waiting for count with the current one, after a
        # warning).
        while epoch > self.epoch:
            if not self.close_epoch():
                return False
        if self._pool is not None:
            self._pool.add(cols, conn)
        else:
            self._held.append(cols)
        self._have += len(cols[0])
        while self._emitted < self._free and self._have >= self._size + self._window:
            if not self._take(self._size):
                return False
        return True

    def finish(self, last_epoch: int) -> bool:
        """The end of the feed: completes the current epoch, then every later one up to
        ``last_epoch`` (the last feed job's last epoch) with empty batches."""
        if not self.close_epoch():
            return False
        while self.started and self.epoch <= last_epoch:
            if not self.close_epoch():
                return False
        return True


def check_steps(steps_per_epoch: Optional[int], shuffle_rows: int, per_epoch: bool,
                drop_remainder: bool) -> tuple[Optional[int], int]:
    """``(steps_per_epoch, shuffle_rows)`` checked, as ints (pure).

    Raises:
        ValueError: ``steps_per_epoch`` < 1 or with ``per_epoch``/``drop_remainder``;
            ``shuffle_rows`` < 0, or > 0 without ``steps_per_epoch``.
    """
    if steps_per_epoch is not None:
        if isinstance(steps_per_epoch, bool) or int(steps_per_epoch) != steps_per_epoch or steps_per_epoch < 1:
            raise ValueError(f"steps_per_epoch must be an integer >= 1, got {steps_per_epoch!r}")
        if per_epoch or drop_remainder:
            raise ValueError("steps_per_epoch cuts every epoch into a fixed number of batches; "
                             "it excludes per_epoch=True and drop_remainder=True")
        steps_per_epoch = int(steps_per_epoch)
    if isinstance(shuffle_rows, bool) or int(shuffle_rows) != shuffle_rows or shuffle_rows < 0:
        raise ValueError(f"shuffle_rows must be an integer >= 0, got {shuffle_rows!r}")
    if shuffle_rows and steps_per_epoch is None:
        raise ValueError("shuffle_rows needs steps_per_epoch (without it, shuffle on the TF side: "
                         "ds.unbatch().shuffle(rows).batch(batch_size))")
    return steps_per_epoch, int(shuffle_rows)
