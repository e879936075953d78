"""Restart bookkeeping for ``TFCluster.run(..., max_restarts=N)`` (pure; driver).

Nothing here touches Spark, sockets or TensorFlow: the driver feeds in what it observed
(each failed attempt's root causes, the feed partitions the nodes consumed, the inference
partitions that returned results) and asks what to do next:

* :class:`RestartPolicy`: restart or stop after a failed attempt (no restart for a failure
  in :data:`NON_RETRYABLE`, nor for the same exceptions at the first step twice in a row,
  compared by :func:`failure_signature`), and the final
  :class:`~tfos.errors.RecoveryFailedError` listing every attempt's root causes.
* :class:`FeedResume`: the epoch a restarted ``train()`` feeds from.
* :class:`InferenceLedger`: the ``inference()`` partitions a restart re-runs.

The rules ("the same" failure, "first step", early stop): docs/reliability.md "Recovery".
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterable, Optional, Sequence

from tfos.errors import NON_RETRYABLE, NodeFailure, RecoveryFailedError, root_causes

__all__ = [
    "NON_RETRYABLE",
    "failure_signature",
    "AttemptOutcome",
    "Decision",
    "RestartPolicy",
    "FeedResume",
    "InferenceLedger",
]


_MASKS: tuple[tuple["re.Pattern[str]", str], ...] = (
    (re.compile(r"tfos-[0-9a-f]{8,}"), "tfos-<id>"),
    (re.compile(r"0x[0-9a-fA-F]+"), "0x<addr>"),
    (re.compile(r"\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b"), "<ip>"),
    (re.compile(r"\blocalhost:\d+\b"), "<ip>"),
    (re.compile(r"\[::1?\](?::\d+)?"), "<ip>"),
    (re.compile(r"/tmp/[^\s'\"),:]*"), "<tmp>"),
    (re.compile(r"\b(pid|executor|task|attempt|port|stage|TID|partition) \d+", re.IGNORECASE), r"\1 <n>"),
)
_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)', re.MULTILINE)


def _mask(message: str) -> str:
    text = message.strip()
    for pattern, repl in _MASKS:
        text = pattern.sub(repl, text)
    return text


def _innermost_frame(traceback: str) -> str:
    frames = _FRAME.findall(traceback or "")
    if not frames:
        return ""
    path, line, func = frames[-1]
    return f"{path.replace(chr(92), '/').rsplit('/', 1)[-1]}:{line}:{func}"


def failure_signature(failure: NodeFailure) -> tuple[str, str, str, str]:
    """What makes two failures "the same" across attempts (pure).

    Args:
        failure: One root cause.

    Returns:
        ``(kind, error_type, masked message, innermost traceback frame)``; the node is not
        part of it (see the module docstring for the masked parts).
    """
    return (failure.kind, failure.error_type, _mask(failure.message), _innermost_frame(failure.traceback))


@dataclasses.dataclass(frozen=True)
class AttemptOutcome:
    """How one attempt of the cluster ended in failure (pure, driver).

    Attributes:
        attempt: 0 for the first attempt, k for the k-th restart.
        failures: Every failure the driver recorded for the attempt (root causes are picked
            with :func:`tfos.errors.root_causes`).
        context: What the driver was doing, e.g. 'run()', 'train()', 'shutdown()'.
        progressed: True when the attempt made progress the driver can see (its nodes
            consumed fed rows), False when it made none, None when the driver cannot tell
            (InputMode.TENSORFLOW).
        cluster_id: The attempt's cluster id (its Spark job group).
    """

    attempt: int
    failures: tuple[NodeFailure, ...]
    context: str = ""
    progressed: Optional[bool] = None
    cluster_id: str = ""

    def __post_init__(self) -> None:
        if self.attempt < 0:
            raise ValueError(f"attempt must be >= 0, got {self.attempt}")
        object.__setattr__(self, "failures", tuple(self.failures))

    @property
    def causes(self) -> list[NodeFailure]:
        """The root causes, one per failed node (see :func:`tfos.errors.root_causes`)."""
        return root_causes(self.failures)

    @property
    def signature(self) -> frozenset[tuple[str, str, str, str]]:
        """The set of the root causes' :func:`failure_signature`."""
        return frozenset(failure_signature(f) for f in self.causes)

    def summary(self) -> str:
        """One line per root cause, e.g. for the driver's WARNING."""
        return "; ".join(f"{f.node_name}: [{f.kind}] {f.error_type}: {f.message.splitlines()[0] if f.message else ''}" for f in self.causes) or "no cause reported"


@dataclasses.dataclass(frozen=True)
class Decision:
    """What to do after a failed attempt.

    Attributes:
        restart: Start attempt ``next_attempt``.
        next_attempt: The number of the attempt to start (when ``restart``).
        reason: Why, in words (logged; the final error's reason when not restarting).
    """

    restart: bool
    next_attempt: int
    reason: str


class RestartPolicy:
    """Decides, after each failed attempt, whether the cluster starts again (pure, driver).

    Args:
        max_restarts: The budget: restarts allowed after the first attempt (0: none).

    Raises:
        ValueError: ``max_restarts`` is not an int >= 0.
    """

    def __init__(self, max_restarts: int):
        if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
            raise ValueError(f"max_restarts must be an int >= 0, got {max_restarts!r}")
        self.max_restarts = max_restarts
        self.outcomes: list[AttemptOutcome] = []

    @property
    def restarts_used(self) -> int:
        """Restarts started so far (failed attempts minus one, at least 0)."""
        return max(0, len(self.outcomes) - 1) if self.outcomes else 0

    def record(self, outcome: AttemptOutcome) -> Decision:
        """Records a failed attempt and decides whether to start another.

        Args:
            outcome: The attempt that failed; attempts must be recorded in order 0, 1, ...

        Returns:
            The :class:`Decision`.

        Raises:
            ValueError: An attempt recorded out of order.
        """
        if outcome.attempt != len(self.outcomes):
            raise ValueError(f"attempt {outcome.attempt} recorded after {len(self.outcomes)} attempt(s)")
        self.outcomes.append(outcome)
        nxt = outcome.attempt + 1
        fatal = sorted({f.error_type for f in outcome.causes if f.error_type in NON_RETRYABLE})
        if fatal:
            return Decision(False, nxt, f"stopped early: {', '.join(fatal)} cannot be fixed by a restart")
        if self.max_restarts == 0:
            return Decision(False, nxt, "restarts are off (max_restarts=0)")
        if len(self.outcomes) >= 2 and self._same_first_step_repeat(self.outcomes[-2], outcome):
            return Decision(
                False, nxt,
                f"stopped early: attempt {outcome.attempt} failed at its first step with the same exception(s) as attempt "
                f"{outcome.attempt - 1} (a deterministic failure; {self.max_restarts - outcome.attempt} restart(s) left unused)",
            )
        if outcome.attempt >= self.max_restarts:
            return Decision(False, nxt, f"the restart budget is spent (max_restarts={self.max_restarts})")
        return Decision(True, nxt, f"restart {nxt} of {self.max_restarts}")

    @staticmethod
    def _same_first_step_repeat(prev: AttemptOutcome, cur: AttemptOutcome) -> bool:
        causes = cur.causes
        if not causes or any(f.kind != "exception" for f in causes):
            return False
        if cur.progressed:
            return False
        return cur.signature == prev.signature

    def error(self, reason: str) -> RecoveryFailedError:
        """The error to raise once no attempt is left: every attempt's root causes.

        Args:
            reason: Why no further attempt is made (a :attr:`Decision.reason`).
        """
        last = self.outcomes[-1].cluster_id if self.outcomes else ""
        return RecoveryFailedError(last, [(o.attempt, list(o.failures), o.context) for o in self.outcomes], reason)


class FeedResume:
    """Where a restarted ``train(data, num_epochs)`` resumes its feed (pure, driver).

    The driver records each ``(epoch, partition)`` whose rows a node's ``DataFeed``
    consumed (the feed task got the node's authenticated acknowledgement). After a failure
    the feed resumes at :meth:`resume_epoch`: the first epoch with a partition not
    consumed, or an earlier epoch when the nodes' last checkpoint is older.

    Delivery guarantee (rows of the training data, per epoch): **none lost, some twice.**
    Every row of every epoch before the resume epoch was consumed by a node in some attempt;
    every row of the resume epoch and of the later ones is fed to the new attempt. Rows fed
    twice are exactly those of the resume epoch and later epochs that the failed attempt
    had already delivered (epochs are fed back to back, so the next epoch's first
    partitions can be among them). Consumed means handed to ``main_fun`` by ``DataFeed``,
    not trained on: a ``main_fun`` that reads ahead of its last checkpoint reports that
    checkpoint (``ctx.report_checkpoint(epochs)``, recorded with :meth:`record_checkpoint`)
    and the feed resumes at ``min(first epoch not consumed, checkpointed epochs)``, so every
    row of every epoch after the checkpoint is fed again.

    Which report counts (:attr:`checkpointed_epochs`): the minimum over every node's
    latest report, where the ``chief`` node (when set) counts as 0 until it has reported.
    Under MultiWorkerMirroredStrategy the chief writes the checkpoint; a worker's report
    can arrive before the chief's file is complete, so the chief's own report is required.

    Args:
        num_epochs: Epochs the ``train()`` call feeds, >= 1.
        parts_per_epoch: Partitions in one epoch, >= 1.

    Raises:
        ValueError: Bad sizes.
    """

    def __init__(self, num_epochs: int, parts_per_epoch: int, chief: Optional[str] = None):
        if num_epochs < 1 or parts_per_epoch < 1:
            raise ValueError(f"need num_epochs >= 1 and parts_per_epoch >= 1, got {num_epochs}, {parts_per_epoch}")
        self.num_epochs = num_epochs
        self.parts_per_epoch = parts_per_epoch
        #: The node whose report is required (e.g. 'chief:0'); None: any node's counts.
        self.chief = chief
        #: The first epoch the current attempt's feed job covers.
        self.first_epoch = 0
        self._consumed: set[tuple[int, int]] = set()
        #: node name ('job:index') -> its latest checkpoint report, over every attempt.
        self._checkpoints: dict[str, int] = {}

    def record_checkpoint(self, node: str, epochs: int) -> None:
        """Records ``node``'s latest checkpoint report: its checkpoint holds the first
        ``epochs`` epochs of this ``train()`` call (a later report of the node replaces it,
        also across attempts).

        Args:
            node: The node's name, ``'job:task_index'`` (the same on every attempt).
            epochs: Epochs checkpointed, an int >= 0 (values above ``num_epochs`` count as
                ``num_epochs``).

        Raises:
            ValueError: ``epochs`` not an int >= 0.
        """
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 0:
            raise ValueError(f"checkpointed epochs must be an int >= 0, got {epochs!r}")
        self._checkpoints[str(node)] = min(epochs, self.num_epochs)

    @property
    def checkpointed_epochs(self) -> Optional[int]:
        """Epochs the nodes' checkpoint holds, from their reports; None when no node reported.

        The minimum over every node's latest report; when :attr:`chief` is set and has not
        reported while others have, 0 (its checkpoint is unknown).
        """
        if not self._checkpoints:
            return None
        if self.chief is not None and self.chief not in self._checkpoints:
            return 0
        return min(self._checkpoints.values())

    def record_index(self, index: int) -> None:
        """Records partition ``index`` of the current feed job as consumed.

        The job of an attempt feeds epochs ``first_epoch .. num_epochs-1`` back to back, so
        job partition ``index`` is partition ``index % parts_per_epoch`` of epoch
        ``first_epoch + index // parts_per_epoch``.

        Raises:
            ValueError: An index outside the current job.
        """
        epoch, part = divmod(index, self.parts_per_epoch)
        self.record(self.first_epoch + epoch, part)

    def record(self, epoch: int, partition: int) -> None:
        """Records ``partition`` of ``epoch`` as consumed by a node.

        Raises:
            ValueError: An epoch or partition out of range.
        """
        if not (0 <= epoch < self.num_epochs and 0 <= partition < self.parts_per_epoch):
            raise ValueError(f"epoch {epoch} partition {partition} outside {self.num_epochs} x {self.parts_per_epoch}")
        self._consumed.add((epoch, partition))

    def epoch_complete(self, epoch: int) -> bool:
        """True when every partition of ``epoch`` was consumed."""
        return all((epoch, p) in self._consumed for p in range(self.parts_per_epoch))

    def first_unconsumed(self) -> int:
        """The first epoch with a partition not consumed (``num_epochs`` when none)."""
        return next((e for e in range(self.num_epochs) if not self.epoch_complete(e)), self.num_epochs)

    def resume_epoch(self, checkpointed_epochs: Optional[int] = None) -> int:
        """The epoch a new attempt's feed starts at (``num_epochs`` when all were consumed).

        Args:
            checkpointed_epochs: Epochs the nodes' last checkpoint holds (training restores
                to the start of this epoch), when known; the feed never resumes later
                than that. Default: :attr:`checkpointed_epochs` (the recorded reports).
        """
        first = self.first_unconsumed()
        if checkpointed_epochs is None:
            checkpointed_epochs = self.checkpointed_epochs
        if checkpointed_epochs is not None:
            first = min(first, max(0, int(checkpointed_epochs)))
        return first

    def restart(self, checkpointed_epochs: Optional[int] = None) -> int:
        """Starts the next attempt's feed: sets :attr:`first_epoch` to :meth:`resume_epoch`
        and forgets what was consumed from that epoch on (it is fed again).

        Returns:
            The new ``first_epoch``; the next job feeds ``num_epochs - first_epoch`` epochs.
        """
        self.first_epoch = self.resume_epoch(checkpointed_epochs)
        self._consumed = {(e, p) for e, p in self._consumed if e < self.first_epoch}
        return self.first_epoch

    @property
    def epochs_left(self) -> int:
        """Epochs the next feed job covers."""
        return self.num_epochs - self.first_epoch


class InferenceLedger:
    """Which partitions of an ``inference()`` returned their results (pure, driver).

    A partition counts once its whole result set (one result per input row) is held by the
    driver's output RDD; a restart re-runs only :meth:`missing`, so every input row gets
    exactly one result in the RDD ``inference()`` returns, whatever the attempts.

    Args:
        num_partitions: Partitions of the input, >= 0.
    """

    def __init__(self, num_partitions: int):
        if num_partitions < 0:
            raise ValueError(f"num_partitions must be >= 0, got {num_partitions}")
        self.num_partitions = num_partitions
        self._done: dict[int, int] = {}

    def record(self, partition: int, results: int, rows: Optional[int] = None) -> None:
        """Records that ``partition`` returned ``results`` results.

        Args:
            partition: The input partition index.
            results: Results held for it.
            rows: Its input rows when known; a mismatch means the partition is incomplete
                and it is not recorded.

        Raises:
            ValueError: A partition out of range.
        """
        if not 0 <= partition < self.num_partitions:
            raise ValueError(f"partition {partition} outside 0..{self.num_partitions - 1}")
        if rows is not None and results != rows:
            return
        self._done[partition] = results

    def record_all(self, partitions: Iterable[int]) -> None:
        """Records whole partitions (their counts unknown)."""
        for p in partitions:
            self.record(p, -1)

    def missing(self) -> list[int]:
        """Partitions to (re-)run, in order."""
        return [p for p in range(self.num_partitions) if p not in self._done]

    @property
    def complete(self) -> bool:
        """True when every partition returned its results."""
        return len(self._done) == self.num_partitions

    def done(self) -> Sequence[int]:
        """Partitions that returned their results, in order."""
        return sorted(self._done)
