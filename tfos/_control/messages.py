"""Typed control messages and the node state (pure; runs anywhere).

Every request a node process, a Spark task or a Spark Connect client sends to the control
server is one frozen dataclass below. A message is built and validated on construction
(:meth:`Message.decode` on the server, the constructor on the sender) and travels as the
same JSON body as before: ``{"type": <TYPE>, <field>: <value>, ...}`` inside an
authenticated frame (:mod:`tfos._common.wire`); the frame's envelope fields (``cluster``,
``sn``, ``cn``, ``seq``) are added by the client session (:mod:`tfos._control.protocol`).

A body that does not decode (a missing field, a string where an int belongs, a bool where
a number belongs, an unknown node state) raises :class:`~tfos.errors.ControlProtocolError`,
which closes only the sender's connection. Fields a message does not declare are ignored.

Answers stay JSON objects (dicts); each message's docstring says what it gets back.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import typing
from typing import Any, Callable, ClassVar, Mapping, Optional, TypeVar, Union

from tfos.cluster_template import NodeInfo
from tfos.errors import ControlProtocolError, NodeFailure

__all__ = [
    "NodeState", "TERMINAL_STATES", "Message", "decode", "message_class", "MESSAGE_TYPES",
    "Register", "AwaitCluster", "Heartbeat", "WaitEvent", "Status", "NodeStack", "Stack",
    "FeedError", "NodeStateQuery", "Log", "Accumulators", "TensorBoard", "PartitionSent", "PartitionDone",
    "PartitionSkipped", "Checkpoint", "ClaimPartition", "EpochHandover", "ClientWait",
    "ClientControl", "ClientTeardown", "ClientReturned", "ClientRelease", "StopRequest",
]


class NodeState(enum.StrEnum):
    """A node's state as the driver sees it (and as nodes report it in ``status``).

    ``pending -> registered -> running -> finished | failed | stopped``; ``serving`` for a
    node that only serves until stopped (``ctx.run_server_and_wait()``). ``exited`` is
    only ever *reported* (by the supervisor, with the TF process's exit code): the driver
    records the code, not a state. Members compare equal to their text (``"running"``).
    """

    PENDING = "pending"
    REGISTERED = "registered"
    RUNNING = "running"
    SERVING = "serving"
    FINISHED = "finished"
    FAILED = "failed"
    STOPPED = "stopped"
    EXITED = "exited"


class WaitUntil(enum.StrEnum):
    """What a Spark Connect client's :class:`ClientWait` waits for (cluster conditions,
    not node states)."""

    NOW = "now"
    ALL_REGISTERED = "all_registered"
    WORKERS_DONE = "workers_done"
    ALL_EXITED = "all_exited"
    CLUSTER_FAILED = "cluster_failed"
    TENSORBOARD = "tensorboard"


#: States after which main_fun no longer runs on the node.
TERMINAL_STATES = frozenset({NodeState.FINISHED, NodeState.FAILED, NodeState.STOPPED})


# ------------------------------------------------------------------ field checks
def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an int, got {type(value).__name__}")
    return value


def _float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"expected a number, got {type(value).__name__}")
    number = float(value)  # OverflowError for an int beyond a float's range
    if not math.isfinite(number):
        raise ValueError("expected a finite number")
    return number


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {type(value).__name__}")
    return value


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"expected true or false, got {type(value).__name__}")
    return value


def _dict(value: Any) -> dict:
    if not isinstance(value, dict):
        raise TypeError(f"expected an object, got {type(value).__name__}")
    return value


def _list(value: Any) -> list:
    if not isinstance(value, list):
        raise TypeError(f"expected a list, got {type(value).__name__}")
    return value


def _state(value: Any) -> NodeState:
    try:
        return NodeState(_str(value))
    except ValueError:
        raise ControlProtocolError(f"unknown node state {value!r}") from None


def _tuple_of(item: Callable[[Any], Any]) -> Callable[[Any], tuple]:
    def check(value: Any) -> tuple:
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"expected a list, got {type(value).__name__}")
        return tuple(item(v) for v in value)

    return check


def _counters(value: Any) -> dict:
    return {_str(k): _int(v) for k, v in _dict(value).items()}


_CHECKS: dict[Any, Callable[[Any], Any]] = {
    int: _int, float: _float, str: _str, bool: _bool, dict: _dict, list: _list, NodeState: _state,
    NodeInfo: lambda v: NodeInfo.from_dict(_dict(v)),
    NodeFailure: lambda v: NodeFailure.from_dict(_dict(v)),
    tuple[str, ...]: _tuple_of(_str), tuple[int, ...]: _tuple_of(_int),
    dict[str, int]: _counters,
}


def _check_for(hint: Any) -> tuple[Callable[[Any], Any], bool]:
    """(checker, optional) for a field's type hint."""
    if typing.get_origin(hint) is Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return _CHECKS[args[0]], True
    return _CHECKS[hint], False


def _to_json(value: Any) -> Any:
    if isinstance(value, (NodeInfo, NodeFailure)):
        return value.to_dict()
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple):
        return list(value)
    return value


M = TypeVar("M", bound="Message")


class Message:
    """Base of the typed control messages (each a frozen dataclass with a ``TYPE``)."""

    TYPE: ClassVar[str] = ""
    _spec: ClassVar[tuple] = ()

    def fields(self) -> dict:
        """The message's JSON body without ``type`` (fields left at None are omitted)."""
        out = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if value is not None:
                out[f.name] = _to_json(value)
        return out

    def body(self) -> dict:
        """The message's JSON body with its ``type``."""
        return dict(self.fields(), type=self.TYPE)

    @classmethod
    def decode(cls: type[M], body: Mapping) -> M:
        """Validates ``body`` (a decoded JSON object) and builds the message.

        Raises:
            ControlProtocolError: A missing or mistyped field, or a value out of range.
        """
        kwargs = {}
        try:
            for name, check, optional, required in cls._spec:
                if name not in body:
                    if required:
                        raise KeyError(name)
                    continue
                value = body[name]
                kwargs[name] = None if value is None and optional else check(value)
            return cls(**kwargs)
        except ControlProtocolError:
            raise
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise ControlProtocolError(f"malformed {cls.TYPE!r} message: {exc!r}") from None


#: message type -> class
MESSAGE_TYPES: dict[str, type[Message]] = {}


def _message(type_name: str) -> Callable[[type[M]], type[M]]:
    """Class decorator of a message dataclass: registers it under ``type_name``."""

    def wrap(cls: type[M]) -> type[M]:
        cls.TYPE = type_name
        hints = typing.get_type_hints(cls)
        spec = []
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            check, optional = _check_for(hints[f.name])
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            spec.append((f.name, check, optional, required))
        cls._spec = tuple(spec)
        MESSAGE_TYPES[type_name] = cls
        return cls

    return wrap


def message_class(msg_type: Any) -> Optional[type[Message]]:
    """The message class of ``msg_type``, or None for a type this module does not know."""
    return MESSAGE_TYPES.get(msg_type) if isinstance(msg_type, str) else None


def decode(body: Mapping) -> Message:
    """The typed message of a request body.

    Raises:
        ControlProtocolError: An unknown ``type``, or fields that do not validate.
    """
    cls = message_class(body.get("type"))
    if cls is None:
        raise ControlProtocolError(f"unknown message type {body.get('type')!r}")
    return cls.decode(body)


def _check(ok: bool, text: str) -> None:
    if not ok:
        raise ValueError(text)


# ============================================================ outside -> driver
@_message("STOP")
@dataclasses.dataclass(frozen=True)
class StopRequest(Message):
    """Asks a streaming cluster waiting in ``shutdown(ssc)`` to stop its streams and shut
    down (``python -m tfos.streaming stop HOST PORT``; TFoS's
    ``reservation.Client((host, port)).request_stop()`` sends the same type, so TFoS
    programs stop a tfos cluster unchanged). Answer: ``{"data": "OK"}``."""


# ======================================================== node processes -> driver
@_message("register")
@dataclasses.dataclass(frozen=True)
class Register(Message):
    """The TF process registers its node. Answer: ``{"ok": true, "shared_executor": [ids]}``
    or ``{"ok": false, "abort": reason}``."""

    node: NodeInfo


@_message("await_cluster")
@dataclasses.dataclass(frozen=True)
class AwaitCluster(Message):
    """Long-poll (up to ``poll_s``, at most 5 s) for the full cluster. Answer:
    ``{"ready": true, "nodes": [...]}``, ``{"ready": false, "missing": [ids]}`` or
    ``{"ready": false, "abort": reason}``."""

    executor_id: Optional[int] = None
    poll_s: float = 5.0

    def __post_init__(self) -> None:
        _check(self.poll_s >= 0, "poll_s must be >= 0")


@_message("heartbeat")
@dataclasses.dataclass(frozen=True)
class Heartbeat(Message):
    """The supervisor's heartbeat (with the TF process tree's RSS in bytes). Answer: the
    directives ``{"stop", "feed_closed", "abort", "failed"}``."""

    executor_id: int
    pid: int = 0
    host: Optional[str] = None
    rss: Optional[int] = None


@_message("wait_event")
@dataclasses.dataclass(frozen=True)
class WaitEvent(Message):
    """The TF process's long-poll (up to ``poll_s``, at most 5 s) for directives that differ
    from ``known``; carries its figures (:func:`tfos._data.figures.live_snapshot`).
    Answer: the directives plus ``stack`` (stack requests so far), ``stack_all`` (the
    last one asks for every thread) and ``report`` (counter reports asked for so far)."""

    executor_id: int
    known: dict = dataclasses.field(default_factory=dict)
    counters: Optional[dict[str, int]] = None
    poll_s: float = 1.0

    def __post_init__(self) -> None:
        _check(self.poll_s >= 0, "poll_s must be >= 0")


@_message("status")
@dataclasses.dataclass(frozen=True)
class Status(Message):
    """A node's state report. ``failed`` carries ``failure``; ``exited`` (supervisor) carries
    the exit ``code`` (negative: the signal), the last ``rss``, ``unprompted`` (the
    supervisor did not end the process) and a ``hint`` for the error text (an address-space
    limit in force); ``finished`` the queues main_fun ``terminated``.
    Answer: ``{"ok": true}``."""

    executor_id: int
    state: NodeState
    failure: Optional[NodeFailure] = None
    code: Optional[int] = None
    rss: Optional[int] = None
    unprompted: bool = False
    terminated: tuple[str, ...] = ()
    hint: str = ""

    def __post_init__(self) -> None:
        _check(self.state not in (NodeState.PENDING, NodeState.REGISTERED), f"a node does not report the state {self.state.value!r}")
        _check(self.state != NodeState.FAILED or self.failure is not None, "a 'failed' report needs its failure")
        _check(self.state != NodeState.EXITED or self.code is not None, "an 'exited' report needs its code")


@_message("node_stack")
@dataclasses.dataclass(frozen=True)
class NodeStack(Message):
    """A feed task asks for the stack of main_fun's thread on a node (the driver, with
    ``all_threads``, for every thread's), waiting up to ``wait_s`` (at most 10 s).
    Answer: ``{"stack": text}`` ('' when none came)."""

    executor_id: int
    wait_s: float = 3.0
    all_threads: bool = False


@_message("stack")
@dataclasses.dataclass(frozen=True)
class Stack(Message):
    """A node's answer to stack request number ``seq``. Answer: ``{"ok": true}``."""

    executor_id: int
    seq: int
    text: str


@_message("feed_error")
@dataclasses.dataclass(frozen=True)
class FeedError(Message):
    """A feed task's report of a failure on a node's data. Answer: ``{"ok": true}``."""

    failure: NodeFailure


@_message("node_state")
@dataclasses.dataclass(frozen=True)
class NodeStateQuery(Message):
    """What the driver knows of a node. Answer: ``{"state", "exit_code", "failure",
    "cluster_failed"}`` and ``terminated`` (queues main_fun terminated) when any."""

    executor_id: int


@_message("log")
@dataclasses.dataclass(frozen=True)
class Log(Message):
    """Output lines of a node forwarded to the driver's stderr. Answer: ``{"ok": true}``."""

    executor_id: int
    lines: tuple[str, ...] = ()


@_message("accumulators")
@dataclasses.dataclass(frozen=True)
class Accumulators(Message):
    """What main_fun added to its payload's accumulators: ``updates`` is a list of
    ``{"aid", "kind", "value"}`` (checked by :class:`tfos._driver.payload.AccumulatorInbox`).
    Answer: ``{"ok": true}``."""

    executor_id: int
    updates: list


@_message("tensorboard")
@dataclasses.dataclass(frozen=True)
class TensorBoard(Message):
    """The TensorBoard ``url`` of the lead node, or its start-up ``error``. Answer:
    ``{"ok": true}``."""

    executor_id: Optional[int] = None
    url: str = ""
    error: str = ""

    def __post_init__(self) -> None:
        _check(bool(self.url) or bool(self.error), "a tensorboard report needs a url or an error")


# ================================================================= feed tasks -> driver
@_message("partition_sent")
@dataclasses.dataclass(frozen=True)
class PartitionSent(Message):
    """Partition ``index`` of feed ``feed_id`` was handed to a node. Answer: ``{"ok": true}``."""

    feed_id: str
    index: int


@_message("partition_done")
@dataclasses.dataclass(frozen=True)
class PartitionDone(Message):
    """A node acknowledged partition ``index`` of feed ``feed_id``. Answer: ``{"ok": true}``."""

    feed_id: str
    index: int


@_message("partition_skipped")
@dataclasses.dataclass(frozen=True)
class PartitionSkipped(Message):
    """Partition ``index`` of feed ``feed_id`` went to no node. Answer: ``{"ok": true}``."""

    feed_id: str
    index: int


@_message("checkpoint")
@dataclasses.dataclass(frozen=True)
class Checkpoint(Message):
    """The node's checkpoint holds the first ``epochs`` epochs of the running train().
    Answer: ``{"ok": true}``."""

    executor_id: int
    epochs: int

    def __post_init__(self) -> None:
        _check(self.epochs >= 0, f"checkpoint from executor {self.executor_id}: epochs must be an int >= 0, got {self.epochs!r}")


@_message("claim_partition")
@dataclasses.dataclass(frozen=True)
class ClaimPartition(Message):
    """A feed task claims partition ``index`` of feed ``feed_id`` for ``node``; ``token``
    makes a resent claim the same claim. Answer: ``{"granted": true}`` or
    ``{"granted": false, "node": name}``."""

    feed_id: str
    index: int
    node: str = ""
    token: str = ""


@_message("data_intrusion")
@dataclasses.dataclass(frozen=True)
class DataIntrusion(Message):
    """A feed task found a process that is not the node at node ``executor_id``'s data
    address (it failed the handshake, or relayed it to another node); ``text`` says what it
    saw (at most 2000 characters). Answer: ``{"ok": true}``."""

    executor_id: int
    text: str

    def __post_init__(self) -> None:
        _check(len(self.text) <= 2000, f"data_intrusion text of {len(self.text)} characters exceeds 2000")


@_message("epoch_handover")
@dataclasses.dataclass(frozen=True)
class EpochHandover(Message):
    """Were partitions ``lo..hi-1`` of feed ``feed_id`` all claimed or skipped, and which
    went to ``node``? Answer: ``{"settled": count, "mine": [indices]}``."""

    feed_id: str
    lo: int
    hi: int
    node: str

    def __post_init__(self) -> None:
        _check(0 <= self.lo < self.hi and self.hi - self.lo <= 10_000_000, f"bad index range {self.lo}..{self.hi}")


# ================================================ Spark Connect client -> control host
@_message("client_wait")
@dataclasses.dataclass(frozen=True)
class ClientWait(Message):
    """Optionally a control ``action`` first, then long-poll (up to ``poll_s``) until
    ``until`` (a :class:`WaitUntil`) holds. Answer: the cluster status with ``done``."""

    until: str = "now"
    poll_s: float = 10.0
    action: str = ""
    reason: str = ""

    def __post_init__(self) -> None:
        _check(self.poll_s >= 0, "poll_s must be >= 0")


@_message("client_control")
@dataclasses.dataclass(frozen=True)
class ClientControl(Message):
    """Close the feed, stop or abort the nodes, forget their checkpoint reports (a
    ``train()`` starts), or close the feed once ``total`` partitions of ``feed_id`` were
    handed over. Answer: ``{"ok": true}``."""

    action: str
    reason: str = ""
    feed_id: str = ""
    total: int = 0


@_message("client_teardown")
@dataclasses.dataclass(frozen=True)
class ClientTeardown(Message):
    """Stop (or ``abort``) every node and wait up to ``poll_s`` for their exit. Answer: the
    cluster status with ``done``, and what the nodes got done for a restart: rows consumed,
    checkpoint reports and the partitions of feed ``feed_id`` they acknowledged."""

    abort: bool
    attribution_s: float = 0.0
    poll_s: float = 10.0
    release: bool = False
    feed_id: str = ""


@_message("client_returned")
@dataclasses.dataclass(frozen=True)
class ClientReturned(Message):
    """Which of ``executors`` returned from main_fun without terminating ``qname``
    (waiting up to ``wait_s``). Answer: ``{"names": [...]}``."""

    executors: tuple[int, ...]
    qname: str
    wait_s: float = 0.0


@_message("client_release")
@dataclasses.dataclass(frozen=True)
class ClientRelease(Message):
    """The Connect client is done with the control host. Answer: ``{"ok": true}``."""
