"""The tfos exception hierarchy (pure; used on the driver, in Spark tasks and in TF processes).

Every error is picklable, so it survives the trip from a Spark task or a TF process
back to the driver, and every node-related error names the node: executor id, role
(job name), task index and host.

Hierarchy::

    TFOSError
    ├── ConfigurationError        (also ValueError): bad arguments or Spark configuration
    ├── ReservationTimeoutError   (also TimeoutError): not every node registered in time
    ├── DeadlineExceededError     (also TimeoutError): any other bounded wait expired
    ├── FeedTimeoutError          (also TimeoutError): a node accepted no data for feed_timeout
    ├── ControlProtocolError      : a rejected control-plane frame (bad MAC, size, replay)
    ├── FeedError                 : a feed task could not deliver its partition
    │   └── FeedAbortedError      : the cluster aborted while main_fun read its feed
    ├── MalformedRowError         (also ValueError): a fed row does not match the signature
    ├── InferenceResultError      (also ValueError): main_fun returned too few/many results
    ├── TFServerError             (also RuntimeError): a node's TF server could not start
    │   ├── PortUnavailableError  : another process holds the node's port
    │   └── ProtocolUnavailableError: the server protocol is not in this TF build
    ├── NodeFailedError           : one node failed (exception, lost, or killed)
    └── ClusterFailedError        : the aggregate raised to the user on the driver
        └── RecoveryFailedError   : every attempt of a cluster with max_restarts failed
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

__all__ = [
    "TFOSError",
    "ConfigurationError",
    "ReservationTimeoutError",
    "DeadlineExceededError",
    "FeedTimeoutError",
    "FeedError",
    "ControlProtocolError",
    "MalformedRowError",
    "InferenceResultError",
    "NodeFailedError",
    "ClusterFailedError",
    "RecoveryFailedError",
    "FeedAbortedError",
    "NodeFailure",
    "TFServerError",
    "PortUnavailableError",
    "ProtocolUnavailableError",
    "is_root_cause",
    "root_causes",
]


class TFOSError(Exception):
    """Base class of every error raised by tfos.

    Subclasses keep their constructor arguments in ``self.args`` so that they pickle and
    unpickle unchanged (Spark ships task errors to the driver by pickling them).
    """


class ConfigurationError(TFOSError, ValueError):
    """Bad arguments to a tfos call, or a Spark configuration tfos cannot run on.

    Raised on the driver, mostly by ``TFCluster.run`` before anything is launched, also by
    calls on a running cluster given bad arguments (``train()`` after ``shutdown()`` or
    with a bad ``num_epochs``, an unknown ``qname``, streaming calls); the message says
    which setting or argument to change.
    """


def check_num_epochs(num_epochs: object, streaming: bool = False) -> None:
    """Checks ``num_epochs`` of ``train()`` (driver or Spark Connect client).

    Args:
        num_epochs: The argument; must be an ``int`` >= 1 (not a ``bool``).
        streaming: The feed is a DStream or a streaming DataFrame (an epoch is one pass
            over a micro-batch).

    Raises:
        ConfigurationError: Otherwise; for 0 the message says what TFoS did with it and
            which value keeps that (TFoS fed 10 epochs of an RDD, one pass of a DStream).
    """
    if isinstance(num_epochs, bool) or not isinstance(num_epochs, int) or num_epochs < 1:
        unit = "passes over each micro-batch" if streaming else "one epoch = one pass over every partition"
        hint = ""
        if num_epochs == 0 and not isinstance(num_epochs, bool):
            hint = (" (TFoS fed each micro-batch once whatever num_epochs said: pass num_epochs=1 to keep that)" if streaming
                    else " (TFoS fed 10 epochs for 0: pass num_epochs=10 to keep that)")
        raise ConfigurationError(f"num_epochs must be an integer >= 1 ({unit}), got {num_epochs!r}{hint}")


class ReservationTimeoutError(TFOSError, TimeoutError):
    """Not every node registered with the driver before ``reservation_timeout`` seconds.

    Raised on the driver by ``TFCluster.run``; the message lists the executor ids that did
    not register, the Spark jobs or executors holding the slots they need (when any), and
    the likely causes.
    """


class DeadlineExceededError(TFOSError, TimeoutError):
    """A bounded wait expired; the message says what was awaited and the likely causes."""


class FeedTimeoutError(TFOSError, TimeoutError):
    """A node accepted no data (or returned no results) for ``feed_timeout`` seconds.

    Raised in a Spark feed task and re-raised on the driver; names the partition and node.
    The message goes on with the current stack of the node's ``main_fun`` thread (innermost
    call last, from ``main_fun`` inward), which the feed task asks the node for through the
    driver (up to 3 s); it is left out when the node does not answer in that time.
    """


class FeedError(TFOSError):
    """A feed or inference task could not deliver its partition: the node failed, died,
    returned from ``main_fun`` early or stopped reading.

    Raised in a Spark feed task (``train()``/``inference()``) and re-raised on the driver
    inside a :class:`ClusterFailedError`; the message names the node (executor id, role,
    task index, host) and the partition.
    """


class FeedAbortedError(FeedError):
    """The driver aborted the cluster while ``main_fun`` was reading its feed: a node
    failed or was lost, a Spark job of the cluster failed, or the driver program was
    interrupted (Ctrl-C, SIGTERM) or tore the cluster down after an error.

    Raised in the TF process by ``DataFeed.next_batch()`` (on this and every later call) and
    by the iterators of ``batches()``/``as_dataset()`` instead of an end of feed, so that
    ``main_fun`` never takes a cut-off feed for a complete one (and, e.g., saves a final
    checkpoint). Through ``tf.data`` (``model.fit(feed.as_dataset(...))``) it arrives
    wrapped in a ``tf.errors.UnknownError`` whose message contains this one. The message
    names the node and the abort's reason. It is a consequence of what caused the abort:
    the driver raises (or restarts on) that root cause, never on this error; whatever
    ``main_fun`` raises after the abort is reported to the driver as a FeedAbortedError.
    """


class ControlProtocolError(TFOSError):
    """A control-plane frame was rejected: wrong key, tampered, oversize, replayed or stale.

    The message never contains key material.
    """


class MalformedRowError(TFOSError, ValueError):
    """A row fed in InputMode.SPARK does not fit the declared signature.

    Raised in the TF process; the message names the partition, the row index within the
    partition, the column and what was expected.
    """


class InferenceResultError(TFOSError, ValueError):
    """``batch_results`` got a number of results different from the batch it answers,
    or ``main_fun`` ended while rows were still waiting for results."""


class TFServerError(TFOSError, RuntimeError):
    """A TensorFlow server for a tfos node could not be created or started."""


class PortUnavailableError(TFServerError):
    """The node's port is held by another process, so the server cannot bind it."""


class ProtocolUnavailableError(TFServerError):
    """The requested server protocol (e.g. ``grpc+verbs``) is not in this TF build."""


@dataclasses.dataclass(frozen=True)
class NodeFailure:
    """What the driver knows about one failed node (pure, picklable, JSON-friendly).

    Attributes:
        executor_id: The node's executor id (0-based index in the cluster template).
        job_name: The node's role: 'ps', 'chief', 'master', 'worker' or 'evaluator'.
        task_index: The node's index within its job.
        host: The host the node ran on, or '' when it never registered.
        kind: 'exception' (main_fun raised), 'exited' (process ended with a non-zero code
            or a signal), 'lost' (no heartbeat within the timeout), 'feed' (a feed task
            failed on this node's data), 'spark' (the Spark job itself failed), or
            'stalled' (no progress for ``stall_timeout`` with ``stall_action="fail"``).
        error_type: The exception class name, e.g. 'ValueError'.
        message: The exception message or a description of the loss.
        traceback: The remote traceback text ('' when there is none).
    """

    executor_id: int
    job_name: str
    task_index: int
    host: str
    kind: str
    error_type: str
    message: str
    traceback: str = ""

    @property
    def node_name(self) -> str:
        """A short name like ``worker:1 (executor 2, host 10.0.0.5)``."""
        host = self.host or "unknown host"
        return f"{self.job_name}:{self.task_index} (executor {self.executor_id}, host {host})"

    def to_dict(self) -> dict:
        """The failure as a JSON-serialisable dict (for the control plane)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "NodeFailure":
        """Builds a failure from :meth:`to_dict` output.

        Raises:
            ControlProtocolError: When a field is missing or has the wrong type.
        """
        try:
            return cls(
                executor_id=int(data["executor_id"]),
                job_name=str(data["job_name"]),
                task_index=int(data["task_index"]),
                host=str(data.get("host", "")),
                kind=str(data["kind"]),
                error_type=str(data["error_type"]),
                message=str(data["message"]),
                traceback=str(data.get("traceback", "")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ControlProtocolError(f"malformed node failure report: {exc!r}") from None


class NodeFailedError(TFOSError):
    """One node failed. Raised in the TF process or Spark task that saw it.

    Args:
        failure: The structured description of the failure.
    """

    def __init__(self, failure: NodeFailure):
        super().__init__(failure)
        self.failure = failure

    def __str__(self) -> str:
        f = self.failure
        text = f"{f.node_name}: {f.error_type}: {f.message}"
        if f.traceback:
            text += "\n" + f.traceback.rstrip()
        return text


_KIND_ORDER = {"exception": 0, "exited": 1, "lost": 2}

#: Error types that only ever follow another failure: tfos (or Spark) killing or
#: cancelling work because the cluster already failed, or a connection broken by it.
#: Exception type names no restart can fix: the same input or code fails the same way.
NON_RETRYABLE = frozenset({"ConfigurationError", "MalformedRowError", "InferenceResultError", "SyntaxError", "IndentationError"})

_CONSEQUENCE_TYPES = frozenset({"SparkTaskKilled", "TaskKilled", "TaskCancelled", "CancelledError", "JobCancelled", "FeedAbortedError"})


def is_root_cause(failure: NodeFailure) -> bool:
    """True when ``failure`` can be the cause of a cluster failure, False when it is only a
    consequence of another failure (pure).

    Root causes: ``main_fun`` raised ('exception'), a node process died ('exited'), a node
    or its executor was lost ('lost'), a Spark job failed with no node report ('spark'), or
    the driver found the node stalled with ``stall_action="fail"`` ('stalled').
    Consequences: feed tasks that saw a node fail or stop ('feed': FeedError,
    FeedTimeoutError, broken connections) and tasks killed or cancelled by the teardown.
    """
    if failure.error_type in _CONSEQUENCE_TYPES:
        return False
    return failure.kind in ("exception", "exited", "lost", "spark", "stalled")


def root_causes(failures: Sequence[NodeFailure]) -> list[NodeFailure]:
    """One root cause per failed node, in the order recorded (pure).

    Of a node's root causes the one of the highest-ranked kind wins: a ``main_fun``
    exception ('exception') over a process exit ('exited') over a lost node or executor
    ('lost') over a failed Spark job ('spark'); among equal kinds, the first recorded. When no failure at all is a root
    cause (e.g. only a FeedTimeoutError: a node stopped reading), every failure is kept,
    since then the consequence is the best description there is.

    Args:
        failures: Every failure recorded, in order.

    Returns:
        The failures to report as causes.
    """
    best: dict[int, NodeFailure] = {}
    for f in failures:
        if not is_root_cause(f):
            continue
        old = best.get(f.executor_id)
        if old is None or (_KIND_ORDER.get(f.kind, 3) < _KIND_ORDER.get(old.kind, 3)):
            best[f.executor_id] = f
    if not best:
        seen: dict[int, NodeFailure] = {}
        for f in failures:
            seen.setdefault(f.executor_id, f)
        return list(seen.values())
    order = {id(f): i for i, f in enumerate(failures)}
    return sorted(best.values(), key=lambda f: order[id(f)])


def _group_failures(failures: Sequence[NodeFailure]) -> list[list[NodeFailure]]:
    groups: dict[tuple[str, str, str], list[NodeFailure]] = {}
    for f in failures:
        groups.setdefault((f.kind, f.error_type, f.message), []).append(f)
    # Root causes (exceptions with tracebacks, deaths) first, consequences (feed, spark) last.
    return sorted(groups.values(), key=lambda g: _KIND_ORDER.get(g[0].kind, 3))


class ClusterFailedError(TFOSError):
    """One or more nodes of a tfos cluster failed; raised on the driver.

    Only root causes are listed, one per failed node (see :func:`root_causes`):
    consequences of them (feed errors, tasks tfos cancelled, broken connections) are kept
    in :attr:`consequences` but never reported as causes. Identical failures (same kind,
    type and message) from several nodes are grouped, so a bug that crashes every worker
    is reported once, with the list of nodes. The first remote traceback of each group is
    included.

    Args:
        cluster_id: The cluster's id (also its Spark job group name).
        failures: Every node failure recorded, in the order the driver saw them.
        context: What the driver was doing, e.g. 'train()' or 'shutdown()'.

    Attributes:
        failures: The root causes (:class:`NodeFailure`), one per failed node.
        consequences: The other failures recorded (not causes), for inspection.
        flood: "" or what the driver's control port turned away meanwhile (connections
            without the cluster key: a flood that may have kept nodes out), with the remedy.
            It leads the message when no node failed in main_fun or stalled (nodes lost
            or gone at start-up: the flood is the likely cause); else it ends it.
    """

    flood: str = ""

    def __init__(self, cluster_id: str, failures: Iterable[NodeFailure], context: str = ""):
        recorded = list(failures)
        super().__init__(cluster_id, recorded, context)
        self.cluster_id = cluster_id
        self.failures = root_causes(recorded)
        kept = {id(f) for f in self.failures}
        self.consequences = [f for f in recorded if id(f) not in kept]
        self.context = context

    def __str__(self) -> str:
        groups = _group_failures(self.failures)
        nodes = {(f.executor_id, f.job_name) for f in self.failures}
        where = f" during {self.context}" if self.context else ""
        lines = [
            f"tfos cluster {self.cluster_id} failed{where}: {len(nodes)} node(s) reported "
            f"{len(groups)} distinct error(s)"
        ]
        flood_first = self.flood and not any(f.kind in ("exception", "stalled") for f in self.failures)
        if flood_first:  # nodes lost or gone at start-up while strangers flooded the port: the likely cause
            lines = [f"tfos cluster {self.cluster_id} failed{where}, most likely because of a flood of connections "
                     f"without the cluster key: {self.flood}",
                     f"{len(nodes)} node(s) reported {len(groups)} distinct error(s) (consequences of the flood, most "
                     "likely; docs/reliability.md \"Floods\")"]
        for group in groups:
            first = group[0]
            names = ", ".join(f.node_name for f in group)
            lines.append(f"- [{first.kind}] {names}: {first.error_type}: {first.message}")
            if first.traceback:
                lines.extend("    " + ln for ln in first.traceback.rstrip().splitlines())
        if self.flood and not flood_first:
            lines.append(f"- meanwhile {self.flood}")
        return "\n".join(lines)


class RecoveryFailedError(ClusterFailedError):
    """A cluster started with ``max_restarts`` failed on its last attempt; raised on the driver.

    Either the restart budget is spent, or tfos stopped early because no restart can fix the
    failure (see :mod:`tfos._driver.restart`). A :class:`ClusterFailedError`, so code that catches
    that keeps working: :attr:`failures` are the *last* attempt's root causes, and
    :attr:`attempts` holds every attempt's.

    Args:
        cluster_id: The id of the cluster's last attempt.
        attempts: One ``(attempt, root causes, context)`` per failed attempt, in order; the
            context says what the driver was doing (e.g. 'train()').
        reason: Why no further attempt was made, e.g. 'the restart budget (2) is spent'.

    Attributes:
        attempts: As given (lists of :class:`NodeFailure`).
        reason: As given.
    """

    def __init__(self, cluster_id: str, attempts: Sequence[tuple[int, Sequence[NodeFailure], str]], reason: str):
        recorded = [(int(a), list(fs), str(c)) for a, fs, c in attempts]
        last = recorded[-1] if recorded else (0, [], "")
        super().__init__(cluster_id, last[1], last[2])
        self.args = (cluster_id, recorded, reason)
        self.attempts = recorded
        self.reason = reason

    def __str__(self) -> str:
        n = len(self.attempts)
        lines = [f"tfos cluster {self.cluster_id} failed on all {n} attempt(s); {self.reason}"]
        shown: set[tuple[str, str, str]] = set()
        for attempt, failures, context in self.attempts:
            causes = root_causes(failures)
            where = f" during {context}" if context else ""
            lines.append(f"attempt {attempt}{where}: {len(causes)} root cause(s)")
            for group in _group_failures(causes):
                first = group[0]
                names = ", ".join(f.node_name for f in group)
                lines.append(f"- [{first.kind}] {names}: {first.error_type}: {first.message}")
                sig = (first.kind, first.error_type, first.message)
                if first.traceback and sig not in shown:  # each distinct traceback once
                    shown.add(sig)
                    lines.extend("    " + ln for ln in first.traceback.rstrip().splitlines())
        return "\n".join(lines)
