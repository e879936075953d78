"""Row accounting on the driver: per node and feed epoch, rows fed to TensorFlow vs rows trained (driver).

Each fed node counts, per epoch of every ``cluster.train()`` call, the rows its feed handed
to TensorFlow and the rows Keras's ``train_step`` consumed while that epoch was handed out,
and, when the epoch ended, its *gap*: every row handed out so far minus every row trained so
far (:mod:`tfos._data.row_count`); the figures reach the driver with the node's live figures.

Here they are judged. A node's gap is its pipeline's read-ahead plus every row lost so far
(negative: rows trained more than once). A gap of up to :data:`READ_AHEAD_BATCHES` batches
is taken as read-ahead; a larger one as rows lost, except what a later epoch's smaller gap
shows was in flight; the gap after ``main_fun`` returned is exact (nothing is in flight any
more). The rows an epoch lost are the growth of the rows lost during it (:func:`judge_node`);
more than one batch (a last partial batch that ``drop_remainder`` dropped) gives one WARNING
naming the node, the ``train()`` call and epoch, both counts and the likely cause. :func:`judge_node`
and :func:`parse` are pure; :class:`RowAccounting` reads a cluster's state. See
docs/datafeed.md, "Row accounting".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

log = logging.getLogger(__name__)

#: The most batches of read-ahead (tf.data prefetch, the distributed iterator's buffer) a
#: node's gap is taken to hold before the rest counts as rows lost.
READ_AHEAD_BATCHES = 8
_FIELDS = ("fed", "trained", "gap", "batch", "closed", "final")


@dataclass(frozen=True)
class EpochRows:
    """One node's rows in one epoch of one ``train()`` call (driver).

    Attributes:
        executor_id: The node's executor id.
        node: ``job:index (executor N, host H)``.
        train_call: 0-based index of the ``train()`` call (in the order the node was fed).
        epoch: 0-based epoch within that call (``num_epochs`` of ``train()``; not a Keras epoch).
        fed: Rows of the epoch the feed handed to TensorFlow on this node.
        trained: Rows Keras's ``train_step`` consumed on this node while the feed handed
            out this epoch; None when the node never trained with Keras ``fit`` (a custom
            loop: the epoch is not judged).
        gap: Rows handed to TensorFlow on this node minus rows trained, both counted from
            the node's start, when the epoch ended (read-ahead plus rows lost so far).
        closed: The epoch ended on the node (the next one began, or ``main_fun`` returned):
            its figures are final.
        difference: Rows this epoch trained beyond (+) or short of (-) what it was fed,
            read-ahead excluded (0 while open or not judged).
        cause: Empty when the counts agree (or the epoch is open), else the likely cause.
    """

    executor_id: int
    node: str
    train_call: int
    epoch: int
    fed: int
    trained: Optional[int]
    gap: int
    closed: bool
    difference: int
    cause: str

    @property
    def ok(self) -> bool:
        """True unless the epoch ended with rows dropped or repeated."""
        return not self.cause


def parse(counters: dict[str, int]) -> list[tuple[str, int, dict[str, int]]]:
    """``[(feed id, epoch, {fed, trained, gap, batch, closed, final})]`` from one node's
    figures, in the order the node was fed (pure)."""
    found: dict[tuple[str, int], dict[str, int]] = {}
    for name, value in counters.items():
        parts = name.split("/")
        if len(parts) != 3 or not parts[0].startswith("rows_") or parts[0][5:] not in _FIELDS:
            continue
        try:
            key = (parts[1], int(parts[2]))
        except ValueError:
            continue
        found.setdefault(key, dict.fromkeys(_FIELDS, 0))[parts[0][5:]] = int(value)
    return [(f, e, v) for (f, e), v in found.items()]


def cause_of(difference: int, fed: int, trained: int, gap: int, batch: int, workers: int) -> str:
    """The likely cause of an epoch's ``difference`` (``""``: none worth a warning) (pure)."""
    tolerance = max(1, batch)
    if difference < -tolerance:
        if trained == 0:
            return ("nothing trained while this epoch was fed: main_fun does not train it with Keras fit(), "
                    "or its fit() ended before reading this epoch's rows")
        if workers > 1 and abs(trained * workers - fed) <= tolerance * workers:
            return (f"TensorFlow auto-sharded the fed dataset (AutoShardPolicy.DATA): each of the {workers} workers "
                    f"kept 1/{workers} of its own rows; fed rows are already split by Spark: leave the policy at AUTO "
                    "(tfos turns it off for fed datasets) or set OFF (docs/datafeed.md)")
        return ("rows handed to TensorFlow were not trained: a take() or filter() in the pipeline, steps_per_epoch "
                "x batch size below this node's rows, or fit() ended before the feed did")
    if difference > tolerance and gap < -tolerance:
        return "rows trained more than once: a repeat() or cache() over the feed, or steps_per_epoch beyond the fed rows"
    return ""


def judge_node(eid: int, node: str, counters: dict[str, int], calls: dict[str, int], workers: int) -> list[EpochRows]:
    """Every epoch of one node's figures, judged (pure); ``calls`` maps feed ids to
    ``train()`` call indices and is extended with unseen ones.

    Rows lost by the end of a closed epoch: none while its gap is within
    :data:`READ_AHEAD_BATCHES` batches (read-ahead), else the smallest gap of it and of
    every later closed epoch (rows lost stay lost: a later, smaller gap shows how much of
    this one was in flight); after ``main_fun`` returned, the gap itself. An epoch's
    difference is minus the growth of that count.
    """
    epochs = parse(counters)
    keras = "rows_trained" in counters  # Keras's train_step ran on this node
    batch = max([v["batch"] for _, _, v in epochs] or [1])
    read_ahead = READ_AHEAD_BATCHES * batch
    closed = 0
    while closed < len(epochs) and epochs[closed][2]["closed"]:
        closed += 1  # figures after an open epoch are not final either
    gaps = [v["gap"] for _, _, v in epochs[:closed]]
    out, lost_before = [], 0
    for i, (feed, epoch, v) in enumerate(epochs):
        call = calls.setdefault(feed, len(calls))
        difference, cause = 0, ""
        if keras and i < closed:
            if v["final"]:
                lost = v["gap"]
            elif 0 <= v["gap"] <= read_ahead:
                lost = min(lost_before, v["gap"])
            else:
                lost = min(gaps[i:])
            difference, lost_before = lost_before - lost, lost
            cause = cause_of(difference, v["fed"], v["trained"], v["gap"], v["batch"] or batch, workers)
        out.append(EpochRows(eid, node, call, epoch, v["fed"], v["trained"] if keras else None, v["gap"],
                             bool(v["closed"]), difference, cause))
    return out


class RowAccounting:
    """Judges a cluster's row figures and warns once per node and epoch (driver)."""

    def __init__(self, state: Any) -> None:
        self._state = state
        self._warned: set[tuple[int, int, int]] = set()
        self._calls: dict[str, int] = {}

    def table(self) -> list[EpochRows]:
        """Every node's epochs, ordered by ``train()`` call, epoch and executor id."""
        counters = dict(self._state.counters)  # one C-level copy: safe against the control thread
        workers = sum(1 for r in self._state.roles if r.job_name in ("chief", "master", "worker"))
        rows: list[EpochRows] = []
        for eid in sorted(counters):
            node = self._state.node_name(eid)
            rows.extend(judge_node(eid, node, dict(counters[eid]), self._calls, workers))
        return sorted(rows, key=lambda r: (r.train_call, r.epoch, r.executor_id))

    def check(self) -> Optional[list[EpochRows]]:
        """Logs one WARNING for each newly closed epoch whose counts disagree; returns the table."""
        try:
            rows = self.table()
        except Exception:  # noqa: BLE001 - the accounting never fails a training run
            log.debug("row accounting: could not read the figures", exc_info=True)
            return None
        for r in rows:
            key = (r.executor_id, r.train_call, r.epoch)
            if r.closed and not r.ok and key not in self._warned:
                self._warned.add(key)
                log.warning("tfos row accounting: node %s, train() call %d, epoch %d: %d rows fed to TensorFlow, %d "
                            "trained by Keras's train_step (%+d rows, read-ahead excluded); likely cause: %s",
                            r.node, r.train_call, r.epoch, r.fed, r.trained, r.difference, r.cause)
        return rows
