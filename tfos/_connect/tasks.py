"""Spark task functions of a Spark Connect cluster (built on the client, run in Spark tasks).

Every function here is a ``mapInArrow`` function: Spark Connect has no RDD API, and
``mapInArrow(..., barrier=True)`` gives the start stage the gang scheduling that the
classic path gets from ``rdd.barrier()``.

* :func:`make_start_fn`: the barrier start stage. Task 0 spawns the control host
  (:mod:`tfos._connect.control_host`); its address reaches every task by
  ``BarrierTaskContext.allGather``; every task spawns its node's supervisor (the same
  :func:`tfos._node.start_task.spawn_supervisor` as the classic path) and the stage returns once
  every node registered, or raises an error naming the failed node.
* :func:`make_op_fn`: one control request from a one-task job (how the client reaches the
  control host: it never connects to an executor itself).
* :func:`make_train_fn` / :func:`make_infer_fn`: the classic Arrow feed and inference
  tasks (:mod:`tfos._data.feed_tasks`), pointed at the control host instead of the driver.

Errors raised here carry a ``TFOS-FAILURES:`` line (the failures as base64 JSON), so the
client can rebuild a :class:`~tfos.errors.ClusterFailedError` from the Spark exception
even when the control host is gone.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import pickle
import select
import subprocess
import sys
from typing import Any, Iterator, Optional

from tfos._common.deadline import Deadline
from tfos._connect.control_host import HostLaunch, write_host_launch
from tfos._control import messages as _msg
from tfos._control.client import ControlClient
from tfos._control.messages import NodeState
from tfos._data.arrow_chunks import ARROW_CHUNK_BYTES, arrow_ipc_parts, arrow_slices, rename_columns
from tfos._data.feed_plan import FeedPlan
from tfos._data.feed_tasks import make_arrow_feed_fn
from tfos._data.feed_tasks import make_infer_fn as _classic_infer_fn
from tfos._node.launch import ClusterConfig, NodeLaunch
from tfos.errors import ClusterFailedError, ControlProtocolError, DeadlineExceededError, NodeFailure, TFOSError

__all__ = [
    "StartSpec", "make_start_fn", "make_op_fn", "make_train_fn", "make_infer_fn",
    "FAILURES_MARKER", "encode_failures", "decode_failures", "START_SCHEMA", "OP_SCHEMA",
]

#: Prefix of the line that carries structured failures inside a task's error message.
FAILURES_MARKER = "TFOS-FAILURES:"
#: Schema of the start stage's rows.
START_SCHEMA = "executor_id long, host string, ctrl_host string, ctrl_port long, nodes string"
#: Schema of a control request's single row.
OP_SCHEMA = "reply string"
#: Seconds the control host may take to start and report its port.
_HOST_START_S = 60.0
_REQ_ERRORS = (OSError, ControlProtocolError, DeadlineExceededError)


def encode_failures(failures: list[NodeFailure]) -> str:
    """One line ``TFOS-FAILURES:<base64 JSON>`` for a task error message (pure)."""
    data = json.dumps([f.to_dict() for f in failures]).encode("utf-8")
    return FAILURES_MARKER + base64.b64encode(data).decode("ascii")


def decode_failures(text: str) -> list[NodeFailure]:
    """The failures of the first ``TFOS-FAILURES:`` line in ``text``; [] when none (pure)."""
    pos = text.find(FAILURES_MARKER)
    if pos < 0:
        return []
    blob = text[pos + len(FAILURES_MARKER):].split()[0] if text[pos + len(FAILURES_MARKER):].split() else ""
    try:
        items = json.loads(base64.b64decode(blob, validate=False).decode("utf-8"))
        return [NodeFailure.from_dict(d) for d in items]
    except (ValueError, TypeError, ControlProtocolError):
        return []


def _raise_failed(cluster_id: str, failures: list[NodeFailure], context: str) -> None:
    err = ClusterFailedError(cluster_id, failures, context)
    raise TFOSError(f"{err}\n{encode_failures(failures)}")


@dataclasses.dataclass(frozen=True)
class StartSpec:
    """What the start stage needs, captured by value in its closure (client -> tasks).

    Attributes:
        config: The cluster config; its driver address is a placeholder that the start
            tasks replace with the control host's.
        fn_payload: cloudpickled ``(main_fun, tf_args)``.
        client_timeout_s: See :class:`tfos._connect.control_host.HostLaunch`.
        attempt: The attempt this stage starts (``ctx.attempt`` of every node).
    """

    config: ClusterConfig
    fn_payload: bytes = dataclasses.field(repr=False)
    client_timeout_s: float = 600.0
    attempt: int = 0


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [p for p in sys.path if p]
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _spawn_control_host(launch: HostLaunch) -> tuple[subprocess.Popen, dict]:
    """Starts the control host process and reads its address (start task 0).

    Raises:
        TFOSError: The process did not report an address within :data:`_HOST_START_S`.
    """
    proc = subprocess.Popen(
        [sys.executable, "-m", "tfos._connect.control_host"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=_child_env(),
        cwd=os.getcwd(), close_fds=True, start_new_session=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    write_host_launch(proc.stdin, launch)
    proc.stdin.close()
    deadline = Deadline(_HOST_START_S, "the tfos control host to report its address")
    line = b""
    fd = proc.stdout.fileno()
    while not line.endswith(b"\n"):
        if deadline.expired() or proc.poll() is not None and not select.select([fd], [], [], 0)[0]:
            proc.kill()
            raise TFOSError(f"the tfos control host did not start on {launch.host} (exit code {proc.poll()}); see this executor's stderr log")
        r, _, _ = select.select([fd], [], [], deadline.slice(0.5))
        if r:
            chunk = os.read(fd, 4096)
            if not chunk:
                continue
            line += chunk
    info = json.loads(line.decode("utf-8"))
    if "error" in info:
        raise TFOSError(f"the tfos control host failed to start on {launch.host}: {info['error']}")
    proc.stdout.close()
    return proc, info


def _task_resources(tc: Any) -> dict:
    """The task's resources (GPU addresses), ``{}`` where Spark cannot say (best effort)."""
    try:
        return {k: list(v.addresses) for k, v in tc.resources().items()}
    except Exception:  # noqa: BLE001 - resources() is best effort
        return {}


def make_start_fn(spec: StartSpec):
    """The barrier ``mapInArrow`` function of the start stage (client builds, tasks run).

    Partition ``i`` becomes executor id ``i``. Yields one row (see :data:`START_SCHEMA`);
    partition 0's row carries the registered nodes as JSON.

    Raises (in the task):
        TFOSError: The control host did not start, a node failed or not every node
            registered within ``reservation_timeout``; the message names the node(s) and
            carries the structured failures.
    """

    def _start(batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa
        from pyspark import BarrierTaskContext

        from tfos._common.executor import executor_identity, node_host
        from tfos._node.start_task import spawn_supervisor
        from tfos._node.task_world import capture as capture_task_world
        from tfos.gpu_info import cuda_visible_devices

        for _ in batches:
            pass
        tc = BarrierTaskContext.get()
        eid = tc.partitionId()
        cfg = spec.config
        role = cfg.roles[eid]
        first = tc.getTaskInfos()[0].address
        first_host, _, first_port = first.rpartition(":")
        key_id, jvm_pid = executor_identity()
        host = node_host(first_host or "127.0.0.1", int(first_port) if first_port.isdigit() else 9)
        name = f"{role.job_name}:{role.task_index} (executor {eid}, host {host})"

        msg: dict = {"host": host}
        if eid == 0:
            try:
                _, info = _spawn_control_host(HostLaunch(
                    cluster_id=cfg.cluster_id, key=cfg.key, roles=cfg.roles, host=host,
                    heartbeat_timeout_s=cfg.heartbeat_timeout_s, client_timeout_s=spec.client_timeout_s, watch_pid=jvm_pid,
                ))
                msg["ctrl"] = [info["host"], int(info["port"])]
            except Exception as exc:  # noqa: BLE001 - every barrier task must learn about it
                msg["error"] = f"{type(exc).__name__}: {exc}"
        gathered = [json.loads(m) for m in tc.allGather(json.dumps(msg))]
        lead = gathered[0]
        if "error" in lead:
            raise TFOSError(f"{name}: the start stage failed because {lead['error']}")
        ctrl_host, ctrl_port = str(lead["ctrl"][0]), int(lead["ctrl"][1])
        config = dataclasses.replace(cfg, driver_host=ctrl_host, driver_port=ctrl_port)
        launch = NodeLaunch(
            config=config, role=role, host=host, executor_key=key_id, watch_pid=jvm_pid, watch_stdin=False,
            working_dir=os.getcwd(), python_path=tuple(sys.path), fn_payload=spec.fn_payload,
            cuda_visible_devices=cuda_visible_devices(_task_resources(tc)), attempt=spec.attempt,
            task_world=capture_task_world(),  # TaskContext and SparkFiles for main_fun (docs/connect.md)
        )
        client = ControlClient(ctrl_host, ctrl_port, cfg.key, cfg.cluster_id, connect_timeout_s=30.0)
        try:
            proc = spawn_supervisor(launch)
            deadline = Deadline(
                cfg.reservation_timeout_s, f"all {cfg.num_nodes} nodes to register",
                "node processes failing at start-up (see the executor logs) or nodes that cannot reach each other",
            )
            status: dict = {}
            while True:
                status = client.call(_msg.ClientWait(until=_msg.WaitUntil.ALL_REGISTERED, poll_s=2.0), timeout_s=30.0)
                failures = [NodeFailure.from_dict(f) for f in status.get("failures", [])]
                if failures:
                    _raise_failed(cfg.cluster_id, failures, "run()")
                if status.get("done"):
                    break
                code = proc.poll()
                if code is not None and code != 0 and eid in status.get("missing", []):
                    f = NodeFailure(eid, role.job_name, role.task_index, host, "exited", "SupervisorDied",
                                    f"the node supervisor exited with code {code} before the node registered; see this executor's stderr log")
                    client.call(_msg.Status(executor_id=eid, state=NodeState.FAILED, failure=f), timeout_s=10.0)
                    continue
                if deadline.expired():
                    raise deadline.error(TFOSError, f"executor ids {status.get('missing')} never registered")
        except BaseException as exc:
            # The client learns nothing but this task's error: stop the nodes already
            # started and let the control host exit once they are gone.
            try:
                client.call(_msg.ClientControl(action="abort_and_exit", reason=f"the start stage failed in {name}: {type(exc).__name__}"),
                            timeout_s=10.0, retry=False)
            except _REQ_ERRORS:
                pass
            raise
        finally:
            client.close()
        nodes = json.dumps(status.get("nodes", [])) if eid == 0 else ""
        yield pa.RecordBatch.from_pydict({
            "executor_id": pa.array([eid], pa.int64()), "host": pa.array([host]), "ctrl_host": pa.array([ctrl_host]),
            "ctrl_port": pa.array([ctrl_port], pa.int64()), "nodes": pa.array([nodes]),
        })

    return _start


def make_op_fn(ctrl_host: str, ctrl_port: int, key: bytes, cluster_id: str, msg: _msg.Message, timeout_s: float):
    """The ``mapInArrow`` function of a one-task control job (client builds, task runs).

    Sends the message ``msg`` to the control host and yields its JSON answer as one row
    (:data:`OP_SCHEMA`).

    Raises (in the task):
        TFOSError: The control host cannot be reached (its executor died, or the cluster
            ended long ago).
    """

    def _op(batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa

        for _ in batches:
            pass
        client = ControlClient(ctrl_host, ctrl_port, key, cluster_id, connect_timeout_s=10.0)
        try:
            reply = client.call(msg, timeout_s=timeout_s, retry=False)
        except _REQ_ERRORS as exc:
            raise TFOSError(
                f"the tfos control host of cluster {cluster_id} at {ctrl_host}:{ctrl_port} cannot be reached "
                f"({type(exc).__name__}: {exc}); its executor may have died"
            ) from None
        finally:
            client.close()
        yield pa.RecordBatch.from_pydict({"reply": pa.array([json.dumps(reply)])})

    return _op


def _touch(plan: FeedPlan) -> None:
    """Tells the control host the client is still there (a feed can outlast its lease)."""
    client = ControlClient(plan.driver_host, plan.driver_port, plan.key, plan.cluster_id, connect_timeout_s=10.0)
    try:
        client.call(_msg.ClientWait(until=_msg.WaitUntil.NOW, poll_s=0.0), timeout_s=10.0)
    except _REQ_ERRORS:
        pass
    finally:
        client.close()


#: Errors of tfos's own feed path in a task: consequences, reported where they arise.
_CONSEQUENCES = ("FeedError", "FeedTimeoutError", "DataAuthError", "FeedAbortedError", "TaskKilled")


def _report_task_error(plan: FeedPlan, exc: BaseException) -> None:
    """Reports an error a Connect feed or inference task raised itself (the results do not
    fit the schema, or the DataFrame's input failed in this Python worker) to the control
    host as the cause, charged to the node the partition was for (Spark task).

    Under Spark Connect the client cannot read Spark's failed tasks (the classic driver
    does, :func:`tfos._driver.runtime.failed_task_errors`): Spark retries the task, tfos
    refuses the retry, and only the refusal would reach the client. Best effort: errors
    reaching the control host are ignored.
    """
    import traceback

    from pyspark import TaskContext

    from tfos._common.executor import executor_identity, node_host
    from tfos._data.feed_plan import choose_node

    if type(exc).__name__ in _CONSEQUENCES or not plan.nodes:
        return
    tc = TaskContext.get()
    index, attempt = (tc.partitionId(), tc.attemptNumber() + 1) if tc is not None else (0, 1)
    host = node_host(plan.driver_host, plan.driver_port)
    try:
        node, _ = choose_node(plan.nodes, index, executor_identity()[0], host)
    except Exception:  # noqa: BLE001 - attribution only
        node = plan.nodes[0]
    where = f"in the Spark task of partition {index}, attempt {attempt}, on host {host}"
    if isinstance(exc, TFOSError):
        message = f"{exc} ({where})"
    else:
        message = f"{exc} (raised by the DataFrame's own code {where}; not by main_fun)"
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip()
    failure = NodeFailure(node.executor_id, node.job_name, node.task_index, node.host, "spark", type(exc).__name__, message, tb)
    client = ControlClient(plan.driver_host, plan.driver_port, plan.key, plan.cluster_id, connect_timeout_s=10.0)
    try:
        client.call(_msg.FeedError(failure=failure), timeout_s=10.0)
    except _REQ_ERRORS:
        pass
    finally:
        client.close()


def make_train_fn(plan: FeedPlan, spark_schema_json: Optional[str] = None, column_names: Optional[list] = None):
    """The ``mapInArrow`` function of a DataFrame train feed (client builds, tasks run).

    The classic Arrow feed task (:func:`tfos._data.feed_tasks.make_arrow_feed_fn`) with the
    control host in place of the driver. Yields ``{partition: long, outcome: string}``.
    ``spark_schema_json`` and ``column_names``: as for ``make_arrow_feed_fn`` (UDT columns such as
    ML vectors; the names of columns renamed for ``mapInArrow``).
    """
    feed = make_arrow_feed_fn(plan, spark_schema_json, column_names)

    def _train(batches: Iterator[Any]) -> Iterator[Any]:
        _touch(plan)
        try:
            yield from feed(batches)
        except Exception as exc:
            _report_task_error(plan, exc)
            raise

    return _train


def _arrow_frames(batches: Iterator[Any], column_names: Optional[list] = None) -> Iterator[Any]:
    for b in batches:
        for piece in arrow_slices(rename_columns(b, column_names), ARROW_CHUNK_BYTES):
            yield arrow_ipc_parts(piece)  # sent as one frame without copying the data buffers


def results_to_batch(results: list, schema: Any) -> Any:
    """One Arrow record batch of ``schema`` from ``main_fun``'s results (Spark task).

    Args:
        results: One result per input row, in order: a value (single-field schemas), a
            tuple/list (fields by position) or a dict (fields by name).
        schema: A ``pyarrow.Schema``.

    Raises:
        TFOSError: A result does not fit the schema (names the row and the schema).
    """
    import pyarrow as pa

    names = schema.names
    cols: list[list] = [[] for _ in names]
    for i, r in enumerate(results):
        if isinstance(r, dict):
            vals = [r.get(n) for n in names]
        elif len(names) == 1:
            vals = [r]
        elif isinstance(r, (tuple, list)) and len(r) == len(names):
            vals = list(r)
        else:
            raise TFOSError(f"inference result {i} ({type(r).__name__}) does not fit the result schema {schema}: return a tuple of {len(names)} values or a dict")
        for c, v in zip(cols, vals):
            c.append(v.tolist() if v is not None and hasattr(v, "tolist") else v)
    try:
        convs = [_instant_converter(f.type) for f in schema]
        cols = [c if conv is None else [conv(v) for v in c] for c, conv in zip(cols, convs)]
        arrays = [pa.array(c, type=f.type) for c, f in zip(cols, schema)]
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise TFOSError(f"inference results do not fit the result schema {schema}: {exc}") from None
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def result_arrow_schema(struct: Any) -> Any:
    """The ``pyarrow.Schema`` of an inference result ``StructType`` (pure; Spark task).

    ``TimestampType`` fields (also nested) become ``timestamp('us', tz='UTC')``: Spark reads
    any zone there as the same instant, and PySpark's ``to_arrow_schema`` refuses them
    without a zone.
    """
    from pyspark.sql.pandas.types import to_arrow_schema

    try:
        return to_arrow_schema(struct, timezone="UTC")
    except TypeError:  # PySpark 3.5: no timezone argument, and it writes UTC itself
        return to_arrow_schema(struct)


def _instant_converter(t: Any) -> Any:
    """For an Arrow type that holds zone-aware timestamps (also inside lists, structs and
    maps), a function turning a result value into what ``pa.array`` stores as PySpark
    stores it, else None (pure).

    A ``datetime`` becomes its whole microseconds since the epoch: a naive one is a local
    time of this process, as the feed gives timestamps to ``main_fun`` (``df.rdd``'s naive
    local ``datetime``), with its ``fold`` (so a time in the repeated hour of a
    daylight-saving change keeps its instant; PySpark's own ``TimestampType.toInternal``
    goes through ``time.mktime``, which ignores ``fold``); an aware one is its own instant.
    ``pa.array`` alone would read a naive ``datetime`` as UTC.
    """
    import datetime

    import pyarrow as pa

    if pa.types.is_timestamp(t):
        if t.tz is None:
            return None

        def to_micros(v: Any) -> Any:
            if not isinstance(v, datetime.datetime):
                return v
            return int(v.replace(microsecond=0).timestamp()) * 1_000_000 + v.microsecond

        return to_micros
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        elem = _instant_converter(t.value_type)
        if elem is None:
            return None
        return lambda v: None if v is None else [elem(x) for x in v]
    if pa.types.is_struct(t):
        fields = [t.field(i) for i in range(t.num_fields)]
        convs = [_instant_converter(f.type) for f in fields]
        if all(c is None for c in convs):
            return None

        def convert_struct(v: Any) -> Any:
            if v is None:
                return None
            if isinstance(v, dict):
                return {f.name: (v.get(f.name) if c is None or v.get(f.name) is None else c(v.get(f.name)))
                        for f, c in zip(fields, convs)}
            return {f.name: (x if c is None else c(x)) for f, c, x in zip(fields, convs, v)}

        return convert_struct
    if pa.types.is_map(t):
        kc, vc = _instant_converter(t.key_type), _instant_converter(t.item_type)
        if kc is None and vc is None:
            return None

        def convert_map(v: Any) -> Any:
            if v is None:
                return None
            pairs = v.items() if isinstance(v, dict) else v
            return [(k if kc is None else kc(k), x if vc is None else vc(x)) for k, x in pairs]

        return convert_map
    return None


def make_infer_fn(plan: FeedPlan, schema_json: str, column_names: Optional[list] = None):
    """The ``mapInArrow`` function of a DataFrame inference (client builds, tasks run).

    Feeds the partition as Arrow chunks to a node (the classic inference task,
    :func:`tfos._data.feed_tasks.make_infer_fn`) and turns the node's result frames (pickled
    lists, read from the authenticated data connection) into record batches of the result
    schema, one row per input row, in input order. ``column_names``: the DataFrame's own
    column names when the client renamed its columns for ``mapInArrow``
    (:func:`tfos._data.feed_tasks.arrow_safe_dataframe`), else None.
    """
    infer = _classic_infer_fn(plan)

    def _infer(batches: Iterator[Any]) -> Iterator[Any]:
        from pyspark import TaskContext
        from pyspark.sql.types import StructType

        tc = TaskContext.get()
        if tc is None:
            raise TFOSError("the inference function must run in a Spark task")
        schema = result_arrow_schema(StructType.fromJson(json.loads(schema_json)))
        _touch(plan)
        try:
            for payload in infer(tc.partitionId(), _arrow_frames(batches, column_names)):
                results = pickle.loads(payload)  # from the node's authenticated data connection
                yield results_to_batch(results, schema)
        except Exception as exc:
            _report_task_error(plan, exc)
            raise

    return _infer
