"""What a feed task is handed (built on the driver, captured by value in the Spark closure)
and which node it feeds (pure)."""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Optional

from tfos._data.framing import ChunkKind
from tfos._data.outbox import feed_linger_s
from tfos.cluster_template import NodeInfo
from tfos.errors import ConfigurationError, TFOSError

__all__ = ["FEED_TIMEOUT_S", "FeedPlan", "check_feed_timeout", "choose_node"]

#: Default ``feed_timeout`` of ``train()``/``inference()``, in seconds: the longest a node may
#: accept no data (or return no results) before its feed fails.
FEED_TIMEOUT_S = 600.0


def check_feed_timeout(value: Any, where: str = "feed_timeout") -> float:
    """``value`` as seconds (pure; driver, and the node reading a feed header).

    Raises:
        ConfigurationError: ``value`` is not a finite number of seconds > 0 (names ``where``).
    """
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(float(value)) and float(value) > 0
    if not ok:
        raise ConfigurationError(f"{where} must be a finite number of seconds > 0, got {value!r}")
    return float(value)


@dataclasses.dataclass(frozen=True)
class FeedPlan:
    """Everything a feed task needs, captured by value in the Spark closure.

    Attributes:
        cluster_id: The cluster id.
        key: The cluster key (never logged).
        driver_host, driver_port: The control server.
        nodes: The feedable nodes (chief/master/worker), ordered by executor id.
        qname: The node queue to feed.
        mode: 'train' or 'inference'.
        kind: The chunk encoding of the input (None: rows re-pickled in the task).
        parts_per_epoch: Partitions in one epoch of the input.
        feed_timeout_s: Longest time a node may accept no data (or return no results).
        feed_id: Id of this feed job (its Spark job group).
        report_sent: Tell the driver when each partition has been handed over (sent or
            skipped), so it can end the feed of every node as soon as all are
            (``train(..., end_of_feed=True)``).
        first_epoch: Epoch number of the job's first epoch (a feed resumed after a
            restart starts at the failed epoch; rows keep their epoch numbers).
        report_done: Tell the driver each partition the node acknowledged (consumed or
            skipped after ``terminate()``), so a restart knows where to resume
            (``max_restarts``).
        last_epoch: Epoch number of the job's last epoch (-1: not known, e.g. a stream's
            feed), so a node that gets no row of the last epochs still knows they exist
            (``as_dataset(steps_per_epoch=S)`` gives ``S`` batches for each).
        linger_s: Longest time a row read by the task waits to be sent, in seconds
            (default: the driver's ``TFOS_FEED_LINGER_MS``, else 0.05; see
            :mod:`tfos._data.outbox` and docs/datafeed.md "Latency: the linger time").
    """

    cluster_id: str
    key: bytes = dataclasses.field(repr=False)
    driver_host: str = ""
    driver_port: int = 0
    nodes: tuple[NodeInfo, ...] = ()
    qname: str = "input"
    mode: str = "train"
    kind: Optional[ChunkKind] = None
    parts_per_epoch: int = 1
    feed_timeout_s: float = FEED_TIMEOUT_S
    feed_id: str = ""
    report_sent: bool = False
    first_epoch: int = 0
    report_done: bool = False
    last_epoch: int = -1
    linger_s: float = dataclasses.field(default_factory=feed_linger_s)

    def __post_init__(self) -> None:
        if not self.nodes:
            raise TFOSError("the cluster has no chief/master/worker node to feed")
        if self.mode not in ("train", "inference"):
            raise ValueError(f"bad feed mode {self.mode!r}")
        check_feed_timeout(self.feed_timeout_s, "FeedPlan.feed_timeout_s")
        if not 0 <= self.linger_s <= 60:
            raise ValueError(f"linger_s must be 0 to 60 seconds, got {self.linger_s!r}")


def choose_node(nodes: tuple[NodeInfo, ...], index: int, executor_key: str, host: str) -> tuple[NodeInfo, str]:
    """Picks the node that receives partition ``index`` (pure).

    Nodes on the task's own executor come first (under ``local[N]`` all nodes share one
    executor, and partitions are spread over them by index, so no node steals another's
    data); then nodes on the same host; then any node (the task runs on an executor that
    hosts no feedable node, e.g. a ps executor or a spare one: docs/datafeed.md "Which node
    gets which partition").

    Returns:
        ``(node, how)`` where how is 'executor', 'host' or 'remote'.
    """
    for how, group in (
        ("executor", [n for n in nodes if n.executor_key == executor_key]),
        ("host", [n for n in nodes if n.host == host]),
        ("remote", list(nodes)),
    ):
        if group:
            return group[index % len(group)], how
    raise TFOSError("no node to feed")
