"""The Spark task's world in the TF process: broadcasts, SparkFiles, TaskContext,
accumulators and the address-space limit (start task, node processes).

PySpark builds per-task state in its Python worker before it calls a task's function:
it loads the broadcast variables the function refers to, points ``SparkFiles`` at the
executor's files, sets the ``TaskContext``, starts an empty accumulator registry (sent to
the driver at task end) and, with ``spark.executor.pyspark.memory``, limits the worker's
address space (``RLIMIT_AS``). A tfos node's ``main_fun`` runs in a TF process that the
start task's supervisor starts (``python -m tfos._node.tf_process``), so none of that
exists there unless it is handed over. This module does that:

* :func:`capture` (the Spark start task) records what PySpark set up for the start task:
  the :class:`SparkTaskInfo`, the SparkFiles root, where each broadcast of ``main_fun``'s
  payload is (the executor's broadcast file, or, with ``spark.io.encryption.enabled``,
  an in-memory file the value is written to, never a file on disk);
  :func:`capture_on_driver` does the same for nodes on the driver host.
* :func:`install` (the TF process, before the payload is unpickled) raises the soft
  ``RLIMIT_AS`` to the hard limit, and sets up the same state in this process's PySpark
  modules when they are first imported (a node that never imports PySpark pays nothing).
* :func:`accumulator_updates` (the TF process, after ``main_fun``) reads what
  ``main_fun`` added to the accumulators of its payload, for the driver (see
  :mod:`tfos._driver.payload`).

The address-space limit itself is :mod:`tfos._node.address_space`'s.

User docs: docs/api.md, "What main_fun can use from Spark".
"""

from __future__ import annotations

import dataclasses
import importlib.abc
import importlib.machinery
import logging
import os
import sys
from typing import Any, Iterable, Optional, Sequence

from tfos._control import messages as _msg
from tfos.errors import TFOSError

__all__ = [
    "Payload", "SparkTaskInfo", "TaskWorld", "capture", "capture_on_driver", "install", "load_payload",
    "accumulator_updates",
    "send_accumulator_updates",
    "encode_accumulator_value", "decode_accumulator_value",
]

log = logging.getLogger(__name__)


class Payload(bytes):
    """The cloudpickled ``(main_fun, tf_args)`` a node receives, with the Spark broadcast
    variables it refers to (driver; built by :func:`tfos._driver.payload.pickle_payload`).

    The bytes are what the TF process unpickles. :attr:`broadcasts` holds the driver's
    ``Broadcast`` objects: the start task's closure captures them, so PySpark ships them
    with every start task (each attempt, after a restart too), and holding them keeps
    Spark's cleaner from removing them while the cluster runs. ``bytes(payload)`` is the
    plain payload (what crosses a process pipe).
    """

    broadcasts: tuple = ()


def payload_broadcasts(payload: bytes) -> tuple:
    """The driver ``Broadcast`` objects a payload refers to (() for plain bytes)."""
    return tuple(getattr(payload, "broadcasts", ()))


def broadcast_id(bc: Any) -> int:
    """The id of a driver-side ``Broadcast`` (driver)."""
    return int(bc._jbroadcast.id())


@dataclasses.dataclass(frozen=True)
class SparkTaskInfo:
    """What ``TaskContext.get()`` returned in a node's start task (start task -> TF process).

    Attributes:
        stage_id: The start stage's id.
        partition_id: The start task's partition (the node's index among the Spark-hosted nodes).
        attempt_number: The Spark attempt of the start task (0 first).
        task_attempt_id: Spark's unique id of the start task's attempt.
        cpus: CPUs of the task (``spark.task.cpus``).
        resources: ``(name, addresses)`` of each resource Spark gave the task (e.g. GPUs).
        local_properties: ``(key, value)`` of each local property of the start job: those
            the driver thread that called ``TFCluster.run`` had set, and Spark's own.
        barrier: The start stage is a barrier stage (always, for tfos's start stages).
    """

    stage_id: int
    partition_id: int
    attempt_number: int
    task_attempt_id: int
    cpus: int = 1
    resources: tuple[tuple[str, tuple[str, ...]], ...] = ()
    local_properties: tuple[tuple[str, str], ...] = ()
    barrier: bool = True

    def __post_init__(self) -> None:
        for name in ("stage_id", "partition_id", "attempt_number", "task_attempt_id", "cpus"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"SparkTaskInfo.{name} must be an int >= 0, got {value!r}")
        if not all(isinstance(k, str) and all(isinstance(a, str) for a in v) for k, v in self.resources):
            raise ValueError("SparkTaskInfo.resources must be (name, addresses) string pairs")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in self.local_properties):
            raise ValueError("SparkTaskInfo.local_properties must be (key, value) string pairs")

    @classmethod
    def from_task_context(cls, tc: Any) -> "SparkTaskInfo":
        """Reads a PySpark ``TaskContext`` (Spark task side)."""
        from pyspark import BarrierTaskContext

        try:
            resources = tuple(sorted((str(k), tuple(str(a) for a in v.addresses)) for k, v in (tc.resources() or {}).items()))
        except Exception:  # noqa: BLE001 - resources() is best effort on old Sparks
            resources = ()
        props = getattr(tc, "_localProperties", None) or {}
        return cls(
            stage_id=int(tc.stageId()), partition_id=int(tc.partitionId()), attempt_number=int(tc.attemptNumber()),
            task_attempt_id=int(tc.taskAttemptId()), cpus=int(getattr(tc, "_cpus", None) or 1), resources=resources,
            local_properties=tuple(sorted((str(k), str(v)) for k, v in props.items() if v is not None)),
            barrier=isinstance(tc, BarrierTaskContext),
        )


@dataclasses.dataclass(frozen=True)
class TaskWorld:
    """What a node's TF process needs of its start task's PySpark state (start task ->
    supervisor -> TF process, inside :class:`tfos._node.launch.NodeLaunch`).

    Attributes:
        task: The start task's context (None for a node the driver started on its own host).
        spark_files_dir: Absolute path of the directory ``SparkFiles.get`` resolves names in
            (files of ``sc.addFile``, unpacked ``sc.addArchive``); "" when unknown.
        broadcast_paths: ``(broadcast id, file)`` of each broadcast the payload refers to:
            the executor's own pickled copy (PySpark's ``Broadcast(path=...)``).
        broadcast_fds: ``(broadcast id, descriptor)`` of each broadcast the start task
            received decrypted (``spark.io.encryption.enabled``): an anonymous in-memory
            file (``memfd``) holding the pickled value, inherited by the node processes.
    """

    task: Optional[SparkTaskInfo] = None
    spark_files_dir: str = ""
    broadcast_paths: tuple[tuple[int, str], ...] = ()
    broadcast_fds: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if self.spark_files_dir and not os.path.isabs(self.spark_files_dir):
            raise ValueError(f"TaskWorld.spark_files_dir must be absolute, got {self.spark_files_dir!r}")
        for bid, fd in self.broadcast_fds:
            if not isinstance(fd, int) or fd < 0:
                raise ValueError(f"TaskWorld: bad descriptor {fd!r} for broadcast {bid}")

    @property
    def inherited_fds(self) -> tuple[int, ...]:
        """Descriptors the node processes must inherit (``pass_fds``)."""
        return tuple(fd for _, fd in self.broadcast_fds)

    def close(self) -> None:
        """Closes this process's copies of :attr:`broadcast_fds`, once the supervisor that
        inherits them started (start task, driver); their memory goes with the last one."""
        for _, fd in self.broadcast_fds:
            try:
                os.close(fd)
            except OSError:
                pass


# --------------------------------------------------------------------- capture (start task)
def capture(broadcasts: Iterable[tuple[int, Any]] = ()) -> TaskWorld:
    """Records the PySpark state of the running Spark task (the start task).

    Args:
        broadcasts: ``(broadcast id, Broadcast)`` of each broadcast ``main_fun``'s payload
            refers to, as PySpark loaded them for this task: from the executor's file, or
            (``spark.io.encryption.enabled``) already decrypted and loaded.

    Raises:
        TFOSError: A broadcast was neither a file nor loaded (PySpark did not ship it), or
            a decrypted one cannot be handed over (no ``memfd_create``).
        OSError: An in-memory file for a decrypted broadcast could not be made.
    """
    from pyspark import SparkFiles, TaskContext

    sources: list[tuple[int, Optional[str], Any]] = []
    for bid, bc in broadcasts:
        path = getattr(bc, "_path", None)
        if isinstance(path, str) and os.path.isfile(path):
            sources.append((int(bid), path, None))  # no copy: the TF process reads this file when main_fun asks
        elif "_value" in vars(bc):
            sources.append((int(bid), None, bc))
        else:
            raise TFOSError(f"broadcast variable {bid} that main_fun's payload refers to was not loaded in the start task")
    tc = TaskContext.get()
    root = SparkFiles._root_directory if SparkFiles._is_running_on_worker else None
    paths, fds = _broadcast_sources(sources)
    return TaskWorld(
        task=SparkTaskInfo.from_task_context(tc) if tc is not None else None,
        spark_files_dir=os.path.abspath(root) if root else "",
        broadcast_paths=paths, broadcast_fds=fds,
    )


def capture_on_driver(broadcasts: Sequence[Any]) -> TaskWorld:
    """The same for a node the driver starts on its own host (``driver_ps_nodes=True``):
    no task context; the driver's SparkFiles directory; the driver's broadcast files, or
    their values when ``spark.io.encryption.enabled`` (the driver's file is encrypted).

    Raises:
        TFOSError, OSError: As :func:`capture`.
    """
    from pyspark import SparkFiles

    sources: list[tuple[int, Optional[str], Any]] = []
    for bc in broadcasts:
        sc = getattr(bc, "_sc", None)
        encrypted = bool(sc is not None and getattr(sc, "_encryption_enabled", False))
        sources.append((broadcast_id(bc), None if encrypted else bc._path, bc if encrypted else None))
    paths, fds = _broadcast_sources(sources)
    try:
        root = SparkFiles.getRootDirectory()
    except Exception:  # noqa: BLE001 - no active SparkContext
        root = ""
    return TaskWorld(task=None, spark_files_dir=os.path.abspath(root) if root else "", broadcast_paths=paths, broadcast_fds=fds)


def _broadcast_sources(sources: Sequence[tuple[int, Optional[str], Any]]) -> tuple[tuple[tuple[int, str], ...], tuple[tuple[int, int], ...]]:
    """Splits ``(id, path or None, Broadcast whose value to hand over)`` into the file
    paths and the in-memory files written for the values."""
    paths: list[tuple[int, str]] = []
    fds: list[tuple[int, int]] = []
    try:
        for bid, path, bc in sources:
            if path is not None:
                paths.append((bid, path))
            else:
                fds.append((bid, _value_in_memory(bid, bc)))
    except BaseException:
        TaskWorld(broadcast_fds=tuple(fds)).close()
        raise
    return tuple(paths), tuple(fds)


def _value_in_memory(bid: int, bc: Any) -> int:
    """Writes a decrypted broadcast's value, pickled as PySpark does, to an anonymous
    in-memory file (never to disk: the broadcast is encrypted at rest); returns its
    descriptor (close-on-exec; ``pass_fds`` hands it to the node processes)."""
    import pickle

    from pyspark.serializers import pickle_protocol

    if not hasattr(os, "memfd_create"):
        raise TFOSError(f"broadcast variable {bid}: handing a decrypted broadcast (spark.io.encryption.enabled) to the "
                        "TF process needs memfd_create (Linux); pass the value in tf_args instead")
    value = bc._value if "_value" in vars(bc) else bc.value
    fd = os.memfd_create(f"tfos-broadcast-{bid}")
    try:
        with os.fdopen(os.dup(fd), "wb", buffering=1 << 20) as f:
            pickle.dump(value, f, pickle_protocol)
    except BaseException:
        os.close(fd)
        raise
    return fd


# ------------------------------------------------------------------------ install (TF process)
def install(world: Optional[TaskWorld]) -> None:
    """Sets up the start task's PySpark state in this TF process (before the payload is
    unpickled): raises the soft ``RLIMIT_AS`` to the hard limit
    (:func:`tfos._node.address_space.raise_address_space_limit`), then, when PySpark is
    first imported (by the payload's unpickling or by ``main_fun``), sets SparkFiles'
    root directory and worker flag, registers the broadcasts and sets the TaskContext."""
    from tfos._node.address_space import raise_address_space_limit

    raise_address_space_limit()
    if world is None:
        return
    for _, fd in world.broadcast_fds:
        try:
            os.set_inheritable(fd, False)  # main_fun's subprocesses need not hold the memory
        except OSError:
            pass
    if "pyspark" in sys.modules:
        _apply(world)
    else:
        sys.meta_path.insert(0, _AfterImport("pyspark", lambda: _apply(world)))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``then()`` right after the package ``name`` was imported, once (TF process)."""

    def __init__(self, name: str, then: Any) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        try:
            sys.meta_path.remove(self)
        except ValueError:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _ThenLoader(spec.loader, self.then)
        return spec


class _ThenLoader(importlib.abc.Loader):
    def __init__(self, inner: Any, then: Any) -> None:
        self.inner, self.then = inner, then

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        module.__spec__.loader = module.__loader__ = self.inner  # the package's own loader from now on
        self.inner.exec_module(module)
        try:
            self.then()
        except Exception:  # noqa: BLE001 - main_fun then meets PySpark's own error, named in the log first
            log.exception("tfos: could not set up the Spark task's state (broadcasts, SparkFiles, TaskContext) in the TF process")


def _apply(world: TaskWorld) -> None:
    from pyspark import Broadcast, SparkFiles, TaskContext

    if world.spark_files_dir:
        SparkFiles._root_directory = world.spark_files_dir
        SparkFiles._is_running_on_worker = True
    registry = sys.modules[Broadcast.__module__]._broadcastRegistry  # type: ignore[attr-defined]
    for bid, path in world.broadcast_paths:
        registry[bid] = Broadcast(path=path)  # loaded when main_fun reads .value, as in a PySpark worker
    for bid, fd in world.broadcast_fds:
        registry[bid] = Broadcast(path=f"/proc/self/fd/{fd}")
    if world.task is not None:
        TaskContext._setTaskContext(_task_context(world.task))


_barrier_cls: Any = None


def _node_barrier_class() -> Any:
    """A ``BarrierTaskContext`` whose ``barrier()``/``allGather()`` raise ``TFOSError``
    and whose ``getTaskInfos()`` reads the start stage's
    task addresses (made once, when PySpark is imported)."""
    global _barrier_cls
    if _barrier_cls is None:
        from pyspark import BarrierTaskContext
        from pyspark.taskcontext import BarrierTaskInfo

        def _unavailable(name: str) -> TFOSError:
            return TFOSError(
                f"BarrierTaskContext.{name}() is not available in main_fun: main_fun runs in the node's TF process, "
                "not in the Spark task of the start stage (in InputMode.SPARK that task has already returned). "
                "Synchronise the nodes through TensorFlow instead (the cluster's collectives, or ctx.cluster_spec); "
                "see docs/api.md, 'What main_fun can use from Spark'"
            )

        class NodeBarrierTaskContext(BarrierTaskContext):
            """The start task's barrier context, as ``main_fun`` sees it (TF process)."""

            def barrier(self) -> None:
                raise _unavailable("barrier")

            def allGather(self, message: str = "") -> list:  # noqa: N802 - PySpark's name
                raise _unavailable("allGather")

            def getTaskInfos(self) -> list:  # noqa: N802 - PySpark's name
                addresses = (self._localProperties or {}).get("addresses", "")
                return [BarrierTaskInfo(h.strip()) for h in addresses.split(",") if h.strip()]

        _barrier_cls = NodeBarrierTaskContext
    return _barrier_cls


def _task_context(info: SparkTaskInfo) -> Any:
    from pyspark import TaskContext
    from pyspark.resource import ResourceInformation

    cls = _node_barrier_class() if info.barrier else TaskContext
    tc = object.__new__(cls)  # PySpark's worker fills a bare instance the same way
    tc._stageId = info.stage_id
    tc._partitionId = info.partition_id
    tc._attemptNumber = info.attempt_number
    tc._taskAttemptId = info.task_attempt_id
    tc._cpus = info.cpus
    tc._localProperties = dict(info.local_properties)
    tc._resources = {name: ResourceInformation(name, list(addrs)) for name, addrs in info.resources}
    if hasattr(TaskContext, "_cpuAmount"):  # PySpark >= 4.3
        from decimal import Decimal

        tc._cpuAmount = Decimal(info.cpus)
    return tc


# ------------------------------------------------------------------------------ accumulators
def encode_accumulator_value(value: Any) -> dict:
    """``{"kind", "value"}``: a JSON form holding an accumulator's number exactly (pure).

    ints (numpy integers and bools too) as decimal strings of any size, floats (numpy
    floats too) as ``float.hex`` (inf and nan included), complex numbers as two of those.
    The control plane carries JSON only, never a pickle, so other values are refused.

    Raises:
        TypeError: ``value`` is not an int, float or complex number.
    """
    import numbers

    if isinstance(value, numbers.Integral):
        return {"kind": "int", "value": str(int(value))}
    if isinstance(value, numbers.Real):
        return {"kind": "float", "value": float(value).hex()}
    if isinstance(value, numbers.Complex):
        c = complex(value)
        return {"kind": "complex", "value": [c.real.hex(), c.imag.hex()]}
    raise TypeError(f"{type(value).__name__} {value!r:.200} is not an int, float or complex number")


def decode_accumulator_value(data: dict) -> Any:
    """The number :func:`encode_accumulator_value` encoded (pure).

    Raises:
        ValueError: Malformed data (also for an int of more than 10,000 digits).
    """
    kind, value = data.get("kind"), data.get("value")
    try:
        if kind == "int" and isinstance(value, str) and len(value) <= 10000:
            return int(value)
        if kind == "float" and isinstance(value, str):
            return float.fromhex(value)
        if kind == "complex" and isinstance(value, list) and len(value) == 2 and all(isinstance(v, str) for v in value):
            return complex(float.fromhex(value[0]), float.fromhex(value[1]))
    except (ValueError, OverflowError) as exc:
        raise ValueError(f"malformed {kind} accumulator value: {exc}") from None
    raise ValueError(f"malformed accumulator update {data!r:.200}")


_payload_accumulators: Optional[frozenset] = None  # ids set by load_payload


def load_payload(payload: bytes) -> Any:
    """Unpickles ``main_fun``'s payload (TF process; the bytes come from the local pipe,
    never the network) and notes which accumulators it deserialized, so that
    :func:`accumulator_updates` sends those and nothing else (not PySpark's own special
    accumulators, nor a driver's accumulators when a node runs in the driver's process).

    Returns:
        Whatever the payload holds (``(main_fun, tf_args)``).
    """
    import cloudpickle

    global _payload_accumulators
    mod = sys.modules.get("pyspark.accumulators")
    before = dict(mod._accumulatorRegistry) if mod is not None else {}
    value = cloudpickle.loads(payload)
    mod = sys.modules.get("pyspark.accumulators")
    after = dict(mod._accumulatorRegistry) if mod is not None else {}
    _payload_accumulators = frozenset(aid for aid, acc in after.items() if before.get(aid) is not acc)
    return value


def accumulator_updates() -> list[dict]:
    """What ``main_fun`` added to each accumulator of its payload (TF process, once
    ``main_fun`` returned): ``{"aid", "kind", "value"}`` per accumulator, [] when the
    payload held none (PySpark's registry of deserialized accumulators is empty or was
    never imported). As in a PySpark worker, each value is this node's sum of the terms
    ``main_fun`` added, starting from the accumulator's zero value.

    Raises:
        TFOSError: An accumulator holds something else than an int, float or complex
            number (e.g. after ``acc.add("x")``), which tfos cannot carry to the driver.
    """
    mod = sys.modules.get("pyspark.accumulators")
    if mod is None:
        return []
    updates = []
    for aid, acc in sorted(mod._accumulatorRegistry.items()):
        if _payload_accumulators is not None and aid not in _payload_accumulators:
            continue  # not main_fun's: PySpark's special ones, or the driver's (in-process nodes)
        if _payload_accumulators is None and int(aid) < 0:
            continue  # PySpark's special accumulators (profilers) have negative ids
        try:
            updates.append({"aid": int(aid), **encode_accumulator_value(acc._value)})
        except TypeError as exc:
            raise TFOSError(f"accumulator {aid}: its value cannot be sent to the driver: {exc}") from None
    return updates


def send_accumulator_updates(client: Any, executor_id: int) -> None:
    """Sends :func:`accumulator_updates` to the driver (TF process, once ``main_fun``
    returned, or a ps/evaluator node was stopped); nothing when there are none.

    Raises:
        TFOSError: A value that is not a number (see :func:`accumulator_updates`).
        OSError, ControlProtocolError, DeadlineExceededError: The driver did not take them;
            the node then fails, so that no update goes missing silently.
    """
    updates = accumulator_updates()
    if updates:
        client.call(_msg.Accumulators(executor_id=executor_id, updates=updates), timeout_s=10.0)
