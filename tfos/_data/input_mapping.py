"""TFoS's ``input_mapping``: ``next_batch`` rows -> ``{tensor: [values]}`` (TF process).

Rows that carry column names (DataFrame chunks, ``Row`` objects) give each tensor its column
by name; plain tuples give the i-th mapped column (sorted by name) the i-th value, as in TFoS.
"""

from __future__ import annotations

import logging
from typing import Sequence

__all__ = ["InputMapping", "row_names"]

log = logging.getLogger(__name__)


def row_names(rows: Sequence, pos: int) -> tuple:
    """The column names the rows of a chunk carry: a DataFrame chunk's columns, or the
    fields of a ``Row`` (``df.rdd``); () for plain tuples."""
    names = getattr(rows, "column_names", None)
    if names:
        return tuple(names)
    fields = getattr(rows[pos], "__fields__", None) if pos < len(rows) else None
    return tuple(fields) if fields else ()


class InputMapping:
    """``{column: tensor_name}`` of a ``DataFeed``, sorted by column name.

    Args:
        mapping: ``{column: tensor_name}`` (not empty).
        node: The node's name, for the warning about unnamed columns.
    """

    def __init__(self, mapping: dict, node: str):
        #: ``[(column, tensor)]``, sorted by column name.
        self.pairs = sorted(mapping.items(), key=lambda kv: str(kv[0]))
        self.tensors = [t for _, t in self.pairs]
        self._node = node
        self._idx: dict = {}  # column names of a chunk -> the value index of each mapped column

    def positional(self, rows: Sequence) -> dict[str, list]:
        """``{tensor: [row[i] for row in rows]}`` for the i-th mapped tensor (a TFManager feed)."""
        cols: dict[str, list] = {t: [] for t in self.tensors}
        for row in rows:
            for i, t in enumerate(self.tensors):
                cols[t].append(row[i])
        return cols

    def columns(self, rows: list, segments: list) -> dict[str, list]:
        """``{tensor: [values]}`` of ``rows``, whose runs ``segments`` (``[(first row,
        column names)]``, from :func:`row_names`) name their columns."""
        cols: dict[str, list] = {t: [] for t in self.tensors}
        ends = [start for start, _ in segments[1:]] + [len(rows)]
        for (start, names), end in zip(segments, ends):
            idx = self._idx.get(names)
            if idx is None:
                idx = self._idx[names] = self._value_index(names)
            for row in rows[start:end]:
                for i, t in zip(idx, self.tensors):
                    cols[t].append(row[i])
        return cols

    def _value_index(self, names: tuple) -> list[int]:
        wanted = [str(c) for c, _ in self.pairs]
        if names and all(c in names for c in wanted):
            return [names.index(c) for c in wanted]
        if names:
            missing = [c for c in wanted if c not in names]
            log.warning(
                "node %s: input_mapping columns %s are not among the fed rows' columns %s; pairing the i-th mapped "
                "column (sorted by name: %s) with the i-th value of each row, as TFoS did", self._node,
                missing, list(names), wanted)
        return list(range(len(wanted)))
