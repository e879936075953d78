"""TFoS's ``TFManager``: a multiprocessing manager holding named queues and a key/value
state (TF process, Spark task or test; not used by ``TFCluster.run``). Public path:
:mod:`tfos.TFManager`.

A tfos cluster feeds its nodes over its own authenticated data connections, so
``ctx.mgr`` of a ``TFCluster.run`` node is a feed hub, not a ``TFManager``. This module
keeps TFoS's manager for programs that build one themselves (``TFManager.start(...)``), for
:func:`tfos.TFSparkNode.run` and for ``TFNode.DataFeed``, which reads TFoS's row queues from
it (``None`` ends the feed, :class:`tfos.marker.EndPartition` a partition).

Security: the manager authenticates every connection with ``authkey`` (multiprocessing's
HMAC challenge) before it reads anything else. 'local' managers listen on a Unix socket;
'remote' ones on this host's address (:func:`tfos.util.get_ip_address`), not on every
interface.
"""

from __future__ import annotations

import multiprocessing
import queue
from multiprocessing.managers import BaseManager
from typing import Any, Dict, Optional, Sequence

__all__ = ["TFManager", "start", "connect"]

#: The most recent manager started in this process (TFoS kept it as ``TFManager.mgr``).
mgr: Optional["TFManager"] = None

# Live only in the manager's server process (filled by _init_server).
_queues: Dict[str, "queue.Queue[Any]"] = {}
_state: Dict[str, Any] = {}
#: TFoS's names for the server process's queues by name and its key/value state (the same
#: dicts; empty in every other process).
qdict = _queues
kdict = _state


class TFManager(BaseManager):
    """Manager with ``get_queue(name)``, ``get(key)`` and ``set(key, value)``."""


def _init_server(names: Sequence[str]) -> None:
    _queues.clear()
    _state.clear()
    for name in names:
        _queues[name] = queue.Queue()


def _get_queue(qname: str) -> Optional["queue.Queue[Any]"]:
    return _queues.get(qname)


def _get(key: str) -> Any:
    return _state[key]


def _set(key: str, value: Any) -> None:
    _state[key] = value


TFManager.register("get_queue", callable=_get_queue)
TFManager.register("get", callable=_get)
TFManager.register("set", callable=_set)


def start(authkey: bytes, queues: Sequence[str], mode: str = "local") -> TFManager:
    """Starts a manager process holding one queue per name in ``queues``.

    Args:
        authkey: Secret every client must prove (bytes; e.g. ``uuid.uuid4().bytes``).
        queues: Queue names, e.g. ``['input', 'output', 'error']``.
        mode: 'local' (reachable from this host only, a Unix socket) or 'remote'
            (TCP on this host's address, any free port).

    The manager's server is a spawned Python process (not a fork of the caller, which may
    have loaded TensorFlow); starting it takes a fresh interpreter's start-up, a fraction
    of a second.

    Returns:
        The started manager (also kept as ``tfos.TFManager.mgr``); ``mgr.address`` is what
        :func:`connect` needs. Stop it with ``mgr.shutdown()``.

    Raises:
        ValueError: ``mode`` is neither 'local' nor 'remote'.
    """
    global mgr
    if mode not in ("local", "remote"):
        raise ValueError(f"TFManager mode must be 'local' or 'remote', got {mode!r}")
    # The server process is spawned (a fresh interpreter), not forked: a fork of a process
    # that loaded TensorFlow inherits TF's runtime mid-flight, and its garbage collector
    # then runs TF finalizers there (seen: a segfault in the forked server).
    ctx = multiprocessing.get_context("spawn")
    if mode == "remote":
        from tfos.util import get_ip_address

        m = TFManager(address=(get_ip_address(), 0), authkey=authkey, ctx=ctx)
    else:
        m = TFManager(authkey=authkey, ctx=ctx)
    m.start(initializer=_init_server, initargs=(list(queues),))
    mgr = m
    return m


def connect(address: Any, authkey: bytes) -> TFManager:
    """Connects to a manager started by :func:`start` (same host for 'local' managers).

    Args:
        address: ``mgr.address`` of the started manager.
        authkey: Its ``authkey``.

    Raises:
        multiprocessing.AuthenticationError: Wrong ``authkey``.
        OSError: Nothing listens at ``address``.
    """
    m = TFManager(address, authkey=authkey)
    m.connect()
    return m
