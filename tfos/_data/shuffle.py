"""The row-level shuffle of ``as_dataset(steps_per_epoch=..., shuffle_rows=W)`` (TF process,
the tf.data reader thread): the rows of one epoch in a pool, drawn from at random."""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["RowPool"]


class RowPool:
    """The rows of one epoch held for the row-level shuffle (reader thread of FeedBatches).

    Rows are copied into preallocated numpy columns (grown by doubling, never shrunk);
    :meth:`take` draws ``k`` rows uniformly at random without replacement and moves the
    pool's last rows into the holes, so a draw costs ``O(k)`` rows whatever the pool holds.
    """

    def __init__(self, rng: Any):
        self._rng = rng
        self._cols: Optional[list] = None
        self.n = 0

    def add(self, cols: tuple, conn: Any) -> None:
        """Appends a chunk's columns (copied).

        Raises:
            MalformedRowError: A column's row shape differs from the pooled rows'.
        """
        import numpy as np

        from tfos.errors import MalformedRowError

        m = len(cols[0])
        if self._cols is None:
            self._cols = [np.empty((max(m, 1024),) + c.shape[1:], c.dtype) for c in cols]
        for i, (dst, src) in enumerate(zip(self._cols, cols)):
            if src.shape[1:] != dst.shape[1:]:
                raise MalformedRowError(
                    f"partition {conn.partition} (epoch {conn.epoch}): column {i}: rows of shape "
                    f"{src.shape[1:]} cannot be shuffled with rows of shape {dst.shape[1:]} "
                    f"(shuffle_rows needs one row shape per column)")
        need = self.n + m
        if need > len(self._cols[0]):
            cap = max(need, 2 * len(self._cols[0]))
            grown = []
            for c in self._cols:
                g = np.empty((cap,) + c.shape[1:], c.dtype)
                g[: self.n] = c[: self.n]
                grown.append(g)
            self._cols = grown
        for dst, src in zip(self._cols, cols):
            dst[self.n : need] = src
        self.n = need

    def take(self, k: int) -> Optional[tuple]:
        """``k`` (<= held) random rows as new arrays, in random order; None when nothing was pooled yet."""
        import numpy as np

        if self._cols is None:
            return None
        n = self.n
        if k == 0:
            return tuple(c[:0].copy() for c in self._cols)
        idx = self._rng.choice(n, size=k, replace=False)
        out = tuple(c[idx] for c in self._cols)
        rest = n - k
        holes = idx[idx < rest]
        if len(holes):
            keep = np.ones(k, bool)
            keep[idx[idx >= rest] - rest] = False
            sources = np.arange(rest, n)[keep]
            for c in self._cols:
                c[holes] = c[sources]
        self.n = rest
        return out

