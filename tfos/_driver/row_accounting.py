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
_FIELDS = ("fed", "trained", "gap", "batch", "closed", "final", "shard", "unread", "unended")
#: Auto-shard policy names by the code a node counts (:data:`tfos._data.row_count.POLICY_CODES`).
POLICIES = {1: "OFF", 2: "AUTO", 3: "FILE", 4: "DATA", 5: "HINT"}


@dataclass(frozen=True)
class EpochRows:
    """One node's rows in one epoch of one ``train()`` call (driver).

    Attributes:
        executor_id: The node's executor id.
        node: ``job:index (executor N, host H)``.
        train_call: 0-based index of the ``train()`` call (in the order the node was fed).
        epoch: 0-based epoch within that call (``num_epochs`` of ``train()``; not a Keras epoch).
        fed: Rows of the epoch Spark fed this node that reached it: those the feed handed
            to TensorFlow plus ``unread``.
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
        unread: Rows of the epoch the node received but ``main_fun`` never took (it returned
            without ``DataFeed.terminate()``).
        at_least: ``fed`` is a lower bound: a partition of the epoch was not consumed to its
            end, and Spark's tasks may have had more rows for the node that never reached it.
        policy: The auto-shard policy the epoch's dataset was distributed with (``OFF``,
            ``AUTO``, ``FILE``, ``DATA``, ``HINT``; ``""`` when unknown, e.g. a dataset made
            by ``distribute_datasets_from_function``, which is never auto-sharded).
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
    unread: int = 0
    at_least: bool = False
    policy: str = ""

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


def cause_of(difference: int, fed: int, trained: int, gap: int, batch: int, workers: int, policy: str = "",
             unread: int = 0, read_ahead: int = 0) -> str:
    """The likely cause of an epoch's ``difference`` (``""``: none worth a warning) (pure).

    Allowed without a warning: one batch (a last partial batch ``drop_remainder`` dropped)
    plus ``read_ahead`` (in the epoch that ended with ``main_fun``: the rows handed to
    TensorFlow and not trained, up to :data:`READ_AHEAD_BATCHES` batches; rows ``main_fun``
    never read get no allowance); never an epoch with rows fed and none trained. The cause follows what the
    node knows: an auto-shard policy that shards (``DATA``, ``FILE``, ``AUTO``, ``HINT``)
    is named only when the epoch's dataset had one; with ``OFF`` (tfos's default for fed
    datasets) or no auto-shard at all, the pipeline or ``main_fun`` is.
    """
    tolerance = max(1, batch) + max(0, read_ahead)
    if difference < 0 and fed > 0 and trained == 0:
        if unread:
            return (f"main_fun stopped reading the feed before this epoch's rows ({unread} rows received were never "
                    "read): a take() in the pipeline, steps_per_epoch x batch size below the fed rows, or fit() "
                    "ending early (docs/datafeed.md \"Row accounting\")")
        return ("nothing trained while this epoch was fed: main_fun does not train it with Keras fit(), its fit() "
                "ended before reading this epoch's rows, or steps_per_epoch covers fewer fed epochs (with a "
                "dataset given to fit() directly, steps = rows of all nodes / batch: docs/datafeed.md \"steps_per_epoch for each fed form\")")
    if difference < -tolerance:
        if workers > 1 and policy in ("DATA", "FILE", "AUTO", "HINT"):
            share = (f": each of the {workers} workers kept about 1/{workers} of its own rows"
                     if abs(trained * workers - fed) <= max(1, batch) * workers else "")
            fallback = ", which falls back to DATA on a dataset that reads no files" if policy == "AUTO" else ""
            return (f"TensorFlow auto-sharded the fed dataset (AutoShardPolicy.{policy}{fallback}){share}; fed rows "
                    "are already split by Spark: do not set a policy on a dataset over the feed (tfos sets OFF) "
                    "or set OFF (docs/datafeed.md \"Auto-shard policy\")")
        if unread:
            return (f"main_fun stopped reading the feed (e.g. a take() in the pipeline or fit() ending early): {unread} "
                    "rows this node received were never read, besides rows handed to TensorFlow and not trained")
        shard = f" (auto-shard was {policy}: not the cause)" if policy == "OFF" else ""
        return (f"rows handed to TensorFlow were not trained{shard}: a filter() or take() in the pipeline, "
                "steps_per_epoch x batch size below this node's rows, or fit() ended before the feed did")
    if difference > tolerance and gap < -tolerance:
        return "rows trained more than once: a repeat() or cache() over the feed, or steps_per_epoch beyond the fed rows"
    return ""


def judge_node(eid: int, node: str, counters: dict[str, int], calls: dict[str, int], workers: int,
               skipped: bool = False) -> list[EpochRows]:
    """Every epoch of one node's figures, judged (pure); ``calls`` maps feed ids to
    ``train()`` call indices and is extended with unseen ones; ``skipped``: partitions for
    the node were skipped after its ``main_fun`` returned (its last epochs' ``fed`` is a
    lower bound).

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
    out, lost_before, unread, gap = [], 0, 0, 0
    for i, (feed, epoch, v) in enumerate(epochs):
        call = calls.setdefault(feed, len(calls))
        difference, cause = 0, ""
        unread += v["unread"]
        gap = v["gap"] if v["fed"] else gap  # an epoch only received, never handed out: the last gap
        if keras and i < closed:
            if v["final"]:
                lost = gap + unread  # exact but for rows never received (at_least)
            elif 0 <= v["gap"] <= read_ahead:
                lost = min(lost_before, v["gap"])
            else:
                lost = min(gaps[i:])
            # after main_fun returned, what it left handed out and untrained is its read-ahead
            allowance = min(max(0, gap - lost_before), read_ahead) if v["final"] else 0
            difference, lost_before = lost_before - lost, lost
            cause = cause_of(difference, v["fed"] + v["unread"], v["trained"], v["gap"], v["batch"] or batch, workers,
                             POLICIES.get(v["shard"], ""), v["unread"], allowance)
        out.append(EpochRows(eid, node, call, epoch, v["fed"] + v["unread"], v["trained"] if keras else None, v["gap"],
                             bool(v["closed"]), difference, cause, v["unread"], bool(v["unended"] or (skipped and v["final"])),
                             POLICIES.get(v["shard"], "")))
    return out


def fed_text(r: EpochRows) -> str:
    """``"320 rows fed to TensorFlow"``, or with rows never read, ``"at least 1024 rows fed
    to the node (704 never read by main_fun)"`` (pure)."""
    if not r.unread and not r.at_least:
        return f"{r.fed} rows fed to TensorFlow"
    return f"{'at least ' if r.at_least else ''}{r.fed} rows fed to the node ({r.unread} never read by main_fun)"


def earlier_text(r: EpochRows) -> str:
    """``", of which 160 rows of earlier epochs, taken as read-ahead when they ended"`` when an
    epoch's difference holds rows lost in earlier epochs (their gap was within the read-ahead
    allowance then), else ``""`` (pure)."""
    if r.trained is None or r.difference >= 0:
        return ""
    earlier = (r.fed - r.trained) + r.difference  # negative: rows lost before this epoch
    if earlier >= 0:
        return ""
    return f", of which {-earlier} rows of earlier epochs, taken as read-ahead when they ended"


class RowAccounting:
    """Judges a cluster's row figures and warns once per node and epoch (driver)."""

    def __init__(self, state: Any) -> None:
        self._state = state
        self._warned: set[tuple[int, int, int]] = set()
        self._calls: dict[str, int] = {}
        self._skipped: set[str] = set()

    def note_skipped(self, nodes: Any) -> None:
        """Nodes (by name) whose ``main_fun`` returned before partitions fed to them
        (:meth:`tfos._driver.backend.Backend.rows_skipped`)."""
        self._skipped.update(nodes)

    def table(self) -> list[EpochRows]:
        """Every node's epochs, ordered by ``train()`` call, epoch and executor id."""
        counters = dict(self._state.counters)  # one C-level copy: safe against the control thread
        workers = sum(1 for r in self._state.roles if r.job_name in ("chief", "master", "worker"))
        rows: list[EpochRows] = []
        for eid in sorted(counters):
            node = self._state.node_name(eid)
            rows.extend(judge_node(eid, node, dict(counters[eid]), self._calls, workers, node in self._skipped))
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
                log.warning("tfos row accounting: node %s, train() call %d, epoch %d: %s, %d trained by Keras's "
                            "train_step (%+d rows, read-ahead excluded%s); likely cause: %s",
                            r.node, r.train_call, r.epoch, fed_text(r), r.trained, r.difference, earlier_text(r), r.cause)
        return rows
