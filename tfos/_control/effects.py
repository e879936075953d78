"""What the control-plane core asks its host to do (pure; runs anywhere).

The core (:mod:`tfos._control.registry`, :mod:`tfos._control.ledger`) changes state and
returns effects; it never logs, waits, reads the clock or touches a socket. Its host
(:mod:`tfos._control.host`) carries them out: :class:`Notify` under its lock (it wakes the
waiters and the control server's long-polls), the rest after releasing it. See
docs/architecture.md "The control-plane core".
"""

from __future__ import annotations

import dataclasses
from typing import Any, Hashable, Union

from tfos.errors import NodeFailure

__all__ = ["Notify", "Note", "FirstFailure", "NodeLines", "AccumulatorUpdates", "Effect"]


@dataclasses.dataclass(frozen=True)
class Notify:
    """The state changed on ``topics`` (:class:`tfos._control.protocol.Topic` members or
    :func:`~tfos._control.protocol.node_topic` keys; every change is also ``Topic.ANY``)."""

    topics: tuple[Hashable, ...] = ()


@dataclasses.dataclass(frozen=True)
class Note:
    """A line for the cluster's log: ``level`` is a :mod:`logging` level."""

    level: int
    text: str


@dataclasses.dataclass(frozen=True)
class FirstFailure:
    """The cluster's first failure was recorded (the host aborts the nodes and, in the
    driver, cancels the cluster's Spark jobs)."""

    failure: NodeFailure


@dataclasses.dataclass(frozen=True)
class NodeLines:
    """Output lines a node forwarded, for the driver's console (``node``: ``job:index``)."""

    node: str
    lines: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class AccumulatorUpdates:
    """What a node's ``main_fun`` added to its payload's accumulators (applied by the
    driver when the attempt ends well, see :mod:`tfos._driver.payload`)."""

    executor_id: int
    node_name: str
    updates: Any


#: What the core returns.
Effect = Union[Notify, Note, FirstFailure, NodeLines, AccumulatorUpdates]
