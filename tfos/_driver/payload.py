"""Driver side of what ``main_fun`` uses from Spark: the payload's broadcasts and
accumulators (driver).

* :func:`pickle_payload` pickles ``(main_fun, tf_args)`` and finds the broadcast variables
  and accumulators in it: the broadcasts ride along (:class:`tfos._node.task_world.Payload`)
  so that every start task gets them from Spark; an accumulator whose values tfos cannot
  carry exactly (not a number) is refused before anything starts.
* :class:`AccumulatorInbox` keeps the updates each node's TF process reports once its
  ``main_fun`` returned, and adds them to the driver's accumulators when the cluster shut
  down without a failure, once, as Spark adds a task's updates when the task succeeds. A
  failed attempt's updates are dropped, with a WARNING: a restart runs ``main_fun`` again.

User docs: docs/api.md, "What main_fun can use from Spark".
"""

from __future__ import annotations

import io
import logging
import numbers
import sys
import threading
from typing import Any

from tfos._node.task_world import Payload, decode_accumulator_value
from tfos.errors import ConfigurationError

__all__ = ["pickle_payload", "AccumulatorInbox"]

log = logging.getLogger(__name__)


def pickle_payload(map_fun: Any, tf_args: Any) -> Payload:
    """cloudpickles ``(map_fun, tf_args)`` for the nodes, with the Spark broadcast
    variables it refers to (driver).

    A broadcast (in ``tf_args`` or in ``map_fun``'s closure or globals) is pickled as
    PySpark pickles it for a task, by its id; :attr:`Payload.broadcasts` keeps the driver's
    object so that the start tasks ship it. An accumulator is pickled as PySpark does (its
    id and zero value); its updates come back through the control plane, as JSON numbers.

    Raises:
        ConfigurationError: ``map_fun``/``tf_args`` cannot be pickled, or they refer to an
            accumulator whose value is not an int, float or complex number.
    """
    import cloudpickle

    pyspark = sys.modules.get("pyspark")
    broadcast_cls = getattr(pyspark, "Broadcast", None)
    accumulator_cls = getattr(pyspark, "Accumulator", None)
    found: dict[int, Any] = {}

    class _Pickler(cloudpickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            if broadcast_cls is not None and isinstance(obj, broadcast_cls) and getattr(obj, "_jbroadcast", None) is not None:
                bid = int(obj._jbroadcast.id())
                found[bid] = obj
                # What Broadcast.__reduce__ returns, without adding the broadcast to the
                # SparkContext's registry of this thread (the start tasks' closure does).
                return sys.modules[broadcast_cls.__module__]._from_id, (bid,)
            if accumulator_cls is not None and isinstance(obj, accumulator_cls):
                _check_accumulator(obj)
            return super().reducer_override(obj)

    buf = io.BytesIO()
    try:
        _Pickler(buf, protocol=cloudpickle.DEFAULT_PROTOCOL).dump((_with_source(map_fun), tf_args))
    except ConfigurationError:
        raise
    except Exception as exc:  # noqa: BLE001 - pickling errors come in many types
        raise ConfigurationError(f"map_fun and tf_args must be picklable with cloudpickle to reach the nodes: {exc}") from exc
    payload = Payload(buf.getvalue())
    payload.broadcasts = tuple(found[b] for b in sorted(found))
    if found:
        log.info("tfos: main_fun's payload refers to broadcast variable(s) %s; the start tasks carry them", sorted(found))
    return payload


def _with_source(map_fun: Any) -> Any:
    from tfos._driver.user_source import with_source

    return with_source(map_fun)  # file names and lines in remote tracebacks


def _check_accumulator(acc: Any) -> None:
    zero = acc.accum_param.zero(acc._value)
    if not isinstance(zero, numbers.Number):
        raise ConfigurationError(
            f"main_fun or tf_args refers to accumulator {acc.aid}, whose values are {type(zero).__name__} "
            f"(zero value {zero!r:.100}): tfos brings main_fun's accumulator updates to the driver for int, float and "
            "complex values only (its control plane carries JSON, never a pickle). Use numeric accumulators in "
            "main_fun, or write the values to storage and read them on the driver (docs/api.md, 'What main_fun can "
            "use from Spark')"
        )


class AccumulatorInbox:
    """The accumulator updates of one cluster attempt's nodes, until the attempt ends (driver).

    Thread-safe: the control server's threads :meth:`receive`, the driver thread that tears
    the attempt down calls :meth:`apply` or :meth:`drop`, once.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._updates: dict[int, list[tuple[int, Any]]] = {}
        self._names: dict[int, str] = {}
        self._done = False

    def receive(self, executor_id: int, node_name: str, updates: Any) -> None:
        """Records node ``executor_id``'s updates (a list of ``{"aid", "kind", "value"}``),
        replacing any it sent before: a resent request is not counted twice.

        Raises:
            ValueError: Malformed updates.
        """
        if not isinstance(updates, list):
            raise ValueError("accumulator updates must be a list")
        decoded = []
        for u in updates:
            if not isinstance(u, dict) or isinstance(u.get("aid"), bool) or not isinstance(u.get("aid"), int):
                raise ValueError(f"malformed accumulator update {u!r:.200}")
            decoded.append((int(u["aid"]), decode_accumulator_value(u)))
        with self._lock:
            if self._done:
                log.warning("tfos node %s: accumulator updates arrived after its cluster attempt ended; not applied", node_name)
                return
            self._updates[executor_id] = decoded
            self._names[executor_id] = node_name

    def apply(self, cluster_id: str) -> int:
        """Adds every node's updates to the driver's accumulators (the cluster attempt
        shut down without a failure); returns how many nodes' updates were applied."""
        with self._lock:
            if self._done:
                return 0
            self._done = True
            updates, names = dict(self._updates), dict(self._names)
        if not updates:
            return 0
        from pyspark.accumulators import _accumulatorRegistry

        for eid in sorted(updates):
            for aid, value in updates[eid]:
                acc = _accumulatorRegistry.get(aid)
                if acc is None:
                    log.warning("tfos cluster %s: node %s updated accumulator %d, which this driver does not know; "
                                "its update %r is dropped", cluster_id, names[eid], aid, value)
                    continue
                acc += value
        log.info("tfos cluster %s: added the accumulator updates of %d node(s) to the driver's accumulators", cluster_id, len(updates))
        return len(updates)

    def drop(self, cluster_id: str, why: str) -> None:
        """Forgets the updates (the attempt failed): logs a WARNING naming the nodes whose
        ``main_fun`` had returned, whose updates are then not applied."""
        with self._lock:
            if self._done:
                return
            self._done = True
            names = [self._names[e] for e in sorted(self._updates)]
        if names:
            log.warning("tfos cluster %s: the accumulator updates of %s were not added to the driver's accumulators: %s",
                        cluster_id, ", ".join(names), why)
