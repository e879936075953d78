"""The Spark "start node" task and node-process spawning (runs in Spark tasks and on the driver).

A start task does not run TensorFlow itself. It works out where it is (host, executor
identity, GPUs), then spawns the node's *supervisor* process, which spawns the *TF
process* that runs ``main_fun``::

    Spark Python worker (start task) -> supervisor (tfos._node.supervisor) -> TF process (tfos._node.tf_process)

Why two processes:

* TensorFlow servers and collective contexts cannot be torn down in-process, so a TF
  process that exits is the only way to free ports and state between clusters.
* PySpark kills idle Python workers after a minute; in InputMode.SPARK the start task
  returns (feed tasks need the slot), so the supervisor must outlive its Python worker. It
  watches the executor JVM instead, reaps the TF process, and reports its exit code or
  signal to the driver within a second.

See docs/architecture.md "Executor plane: three processes per node".
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import struct
import subprocess
import sys
import threading
from typing import IO, Any, Callable, Iterable, Iterator, Optional, TypeVar

from tfos._common.executor import executor_identity, node_host
from tfos._control import messages as _msg
from tfos._node.launch import ClusterConfig, NodeLaunch
from tfos._node.output import OUTPUT_MARK_ENV
from tfos._node.task_world import broadcast_id, capture, capture_on_driver, payload_broadcasts
from tfos.cluster_template import InputMode
from tfos.errors import TFOSError
from tfos.gpu_info import cuda_visible_devices

__all__ = ["spawn_supervisor", "make_start_task", "write_launch", "read_launch", "write_record", "read_record"]

log = logging.getLogger(__name__)

_LEN = struct.Struct(">Q")
_R = TypeVar("_R")
# Supervisors spawned by this Python worker, kept so they are reaped (no zombies).
_children: list[subprocess.Popen] = []
_children_lock = threading.Lock()


def write_record(stream: IO[bytes], record: object) -> None:
    """Writes a launch record to a local pipe (length-prefixed pickle; never a socket)."""
    data = pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_LEN.pack(len(data)) + data)
    stream.flush()


def read_record(stream: IO[bytes], cls: type[_R]) -> _R:
    """Reads a record written by :func:`write_record` and checks that it is a ``cls``
    (node process or control-host process side).

    The bytes come from the parent process's pipe, which got them from the Spark closure:
    a trusted local channel, not the network.

    Raises:
        EOFError: When the parent closed the pipe before writing a full record, or the
            record is not a ``cls``.
    """
    head = stream.read(_LEN.size)
    if len(head) != _LEN.size:
        raise EOFError("no launch record on stdin")
    (n,) = _LEN.unpack(head)
    data = stream.read(n)
    if len(data) != n:
        raise EOFError("truncated launch record on stdin")
    record = pickle.loads(data)  # local pipe from the parent, see docstring
    if not isinstance(record, cls):
        raise EOFError(f"stdin did not carry a {cls.__name__}")
    return record


def write_launch(stream: IO[bytes], launch: NodeLaunch) -> None:
    """Writes a :class:`NodeLaunch` to a node process's stdin pipe."""
    write_record(stream, launch)


def read_launch(stream: IO[bytes]) -> NodeLaunch:
    """Reads the :class:`NodeLaunch` written by :func:`write_launch` (node process side).

    Raises:
        EOFError: When the parent closed the pipe before writing a full record.
    """
    return read_record(stream, NodeLaunch)


class ExecutorLogHandler(logging.StreamHandler):
    """A StreamHandler to the executor log that drops records once that log is gone.

    The executor log is the stderr pipe the node processes inherit from the executor JVM.
    When the JVM dies first (killed, lost), every later record would hit a closed pipe,
    and logging's default ``handleError`` prints "--- Logging error ---" with two
    tracebacks on the process's stderr, which the TF process forwards to the driver next
    to the real failure. Those records have nowhere to go: they are dropped and counted in
    :attr:`dropped`. Any other error is reported as logging always does (node processes).
    """

    def __init__(self, stream=None) -> None:
        super().__init__(stream)
        #: Records dropped because the stream's reader was gone.
        self.dropped = 0

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        exc = sys.exc_info()[1]
        if isinstance(exc, BrokenPipeError) or (isinstance(exc, ValueError) and "closed file" in str(exc)):
            self.dropped += 1
            return
        super().handleError(record)


#: Environment variable naming the descriptor a TF process writes its tfos log lines to
#: (the executor log) when its stdout/stderr are pipes read by its supervisor.
LOG_FD_ENV = "TFOS_LOG_FD"


def _log_stream() -> Any:
    """The stream of the process's tfos log lines: the ``TFOS_LOG_FD`` descriptor (removed
    from the environment and not inherited further), else ``sys.stderr``."""
    fd = os.environ.pop(LOG_FD_ENV, "")
    if fd.isdigit():
        try:
            os.set_inheritable(int(fd), False)
            return os.fdopen(int(fd), "w", buffering=1, encoding="utf-8", errors="replace")
        except OSError:
            pass
    return sys.stderr


def setup_process_logging() -> None:
    """Logging for the node processes' entry points: the 'tfos' logger to stderr (which
    lands in the executor log; in a TF process whose output its supervisor reads, the
    ``TFOS_LOG_FD`` descriptor, a copy of that log), printed once even if a library
    configures the root logger; nothing is printed about records lost because the
    executor JVM (the log's reader) died."""
    handler = ExecutorLogHandler(_log_stream())
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    tfos_log = logging.getLogger("tfos")
    tfos_log.addHandler(handler)
    tfos_log.setLevel(logging.INFO)
    tfos_log.propagate = False


def watch_stdin_eof(on_eof: Callable[[], None], name: str) -> None:
    """Calls ``on_eof`` from a daemon thread when this process's stdin reaches EOF, i.e.
    when the parent that holds the pipe's other end is gone (node processes).

    Reads the descriptor with ``os.read``: a daemon thread blocked inside the buffered
    ``sys.stdin`` would hold its lock and make the interpreter abort at exit.
    """

    def _watch() -> None:
        try:
            while os.read(sys.stdin.fileno(), 65536):
                pass
        except (OSError, ValueError):
            pass
        on_eof()

    threading.Thread(target=_watch, name=name, daemon=True).start()


def _child_env(launch: NodeLaunch) -> dict[str, str]:
    env = dict(os.environ)
    paths = [p for p in launch.python_path if p]
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def start_node_process(module: str, launch: NodeLaunch, new_session: bool = False, stdout: Optional[int] = None,
                       stderr: Optional[int] = None, log_fd: int = -1, output_mark: str = "") -> subprocess.Popen:
    """Starts ``python -m module`` in the executor's working directory with the node's
    environment, and hands it ``launch`` on its stdin (which stays open).

    Runs in the Spark task (the supervisor) and in the supervisor (the TF process).

    Args:
        stdout, stderr: Descriptors for the child's output (None: this process's).
        log_fd: A descriptor the child writes its tfos log lines to (``TFOS_LOG_FD``);
            -1: its stderr.
        output_mark: The token of the child's marker lines (``TFOS_OUTPUT_MARK``, see
            :func:`tfos._node.output.write_failure_marks`); "" for none.

    Raises:
        OSError: When the process cannot be started.
    """
    env = _child_env(launch)
    if log_fd >= 0:
        env[LOG_FD_ENV] = str(log_fd)
    env.pop(OUTPUT_MARK_ENV, None)
    if output_mark:
        env[OUTPUT_MARK_ENV] = output_mark
    # The in-memory files of decrypted broadcasts (tfos._node.task_world) go down to the TF process.
    inherited = launch.task_world.inherited_fds if launch.task_world is not None else ()
    proc = subprocess.Popen(
        [sys.executable, "-m", module],
        stdin=subprocess.PIPE,
        stdout=stdout,
        stderr=stderr,
        env=env,
        cwd=launch.working_dir if os.path.isdir(launch.working_dir) else None,
        close_fds=True,
        pass_fds=((log_fd,) if log_fd >= 0 else ()) + inherited,
        start_new_session=new_session,
    )
    assert proc.stdin is not None
    write_launch(proc.stdin, launch)
    return proc


def spawn_supervisor(launch: NodeLaunch) -> subprocess.Popen:
    """Starts the node's supervisor process and hands it the launch record.

    Runs in a Spark task (or on the driver for ``driver_ps_nodes``). The supervisor's
    stdout/stderr are inherited, so its output lands in the executor log.

    Returns:
        The supervisor's Popen; its stdin stays open (InputMode.TENSORFLOW supervisors
        stop when it closes, i.e. when this process dies).

    Raises:
        OSError: When the process cannot be started.
    """
    proc = start_node_process("tfos._node.supervisor", launch)
    with _children_lock:
        _children.append(proc)
    threading.Thread(target=_reap, args=(proc,), name=f"tfos-reap-{proc.pid}", daemon=True).start()
    return proc


def _reap(proc: subprocess.Popen) -> None:
    proc.wait()
    with _children_lock:
        if proc in _children:
            _children.remove(proc)


def make_start_task(config: ClusterConfig, executor_ids: Iterable[int], fn_payload: bytes, attempt: int = 0):
    """Builds the start-job partition function (driver side; the result runs in Spark tasks).

    Args:
        config: The cluster configuration (captured by value).
        executor_ids: The executor id of each start-job partition, in partition order
            (ps ids are absent when ``driver_ps_nodes``).
        fn_payload: cloudpickled ``(main_fun, tf_args)``; a
            :class:`tfos._node.task_world.Payload` also carries the broadcast variables it
            refers to, which this closure captures so that Spark ships them to each task.
        attempt: The cluster attempt (0 first, k after the k-th restart): ``ctx.attempt``.

    Returns:
        A function ``(partition_index, iterator) -> iterator`` for ``mapPartitionsWithIndex``
        that yields one ``(executor_id, outcome)`` tuple.
    """
    ids = tuple(executor_ids)
    attempt = int(attempt)
    broadcasts = payload_broadcasts(fn_payload)  # PySpark ships what a task's closure refers to
    broadcast_ids = tuple(broadcast_id(b) for b in broadcasts)
    fn_payload = bytes(fn_payload)

    def _start_node(index: int, _rows: Iterator) -> Iterator[tuple[int, str]]:
        from pyspark import TaskContext

        eid = ids[index]
        role = config.roles[eid]
        key, jvm_pid = executor_identity()
        host = node_host(config.driver_host, config.driver_port)
        ctx = TaskContext.get()
        resources = {}
        if ctx is not None:
            try:
                resources = {k: list(v.addresses) for k, v in ctx.resources().items()}
            except Exception:  # noqa: BLE001 - resources() is best effort on old Sparks
                resources = {}
        foreground = config.input_mode == InputMode.TENSORFLOW
        world = capture(zip(broadcast_ids, broadcasts))  # main_fun's broadcasts, SparkFiles, TaskContext
        launch = NodeLaunch(
            config=config,
            role=role,
            host=host,
            executor_key=key,
            watch_pid=jvm_pid,
            watch_stdin=foreground,
            working_dir=os.getcwd(),
            python_path=tuple(sys.path),
            fn_payload=fn_payload,
            cuda_visible_devices=cuda_visible_devices(resources),
            attempt=attempt,
            task_world=world,
        )
        try:
            proc = spawn_supervisor(launch)
        finally:
            world.close()  # the supervisor holds its own copies
        if not foreground:
            # The task keeps its slot only until the node registered with the driver (then
            # feed tasks need the slot at once), and fails the start job if the supervisor
            # dies first (broken install, bad environment) instead of leaving run()
            # waiting for reservation_timeout.
            code = _await_registration(config, eid, proc)
            if code is None:
                yield (eid, "started")
                return
            if code != 0:
                raise TFOSError(
                    f"the supervisor of {role.job_name}:{role.task_index} (executor {eid}, host {host}) exited with "
                    f"code {code} right after start-up; see this executor's stderr log"
                )
            yield (eid, "exited 0")
            return
        # InputMode.TENSORFLOW: the task stays busy for the node's whole life; the
        # supervisor bounds it (it exits when the driver stops the node or goes away).
        code = proc.wait()
        yield (eid, f"exited {code}")

    return _start_node


def _await_registration(config: ClusterConfig, executor_id: int, proc: subprocess.Popen) -> "int | None":
    """Waits until node ``executor_id`` registered with the driver, the cluster gave up, or
    the supervisor exited (Spark task side).

    Bounded by ``config.reservation_timeout_s`` (the driver fails the cluster by then).

    Returns:
        None once the node registered (or the driver answers that the cluster ended), else
        the supervisor's exit code.
    """
    from tfos._common.deadline import Deadline
    from tfos._control.client import ControlClient
    from tfos._control.limits import start_poll_s
    from tfos.errors import ControlProtocolError, DeadlineExceededError

    client = ControlClient(config.driver_host, config.driver_port, config.key, config.cluster_id, connect_timeout_s=10.0)
    deadline = Deadline(config.reservation_timeout_s, f"executor {executor_id} to register")
    poll_s = start_poll_s(len(config.roles))  # stretches with the cluster (docs/performance.md "Scale")
    try:
        while not deadline.expired():
            code = proc.poll()
            if code is not None:
                return code
            try:
                state = client.call(_msg.NodeStateQuery(executor_id=executor_id), timeout_s=10.0)
            except (OSError, ControlProtocolError, DeadlineExceededError) as exc:
                log.warning("start task of executor %d: cannot ask the driver (%s)", executor_id, exc)
                state = {}
            if state.get("state") not in (None, _msg.NodeState.PENDING) or state.get("cluster_failed"):
                return None
            try:
                return proc.wait(deadline.slice(poll_s))
            except subprocess.TimeoutExpired:
                pass
        return None
    finally:
        client.close()


def launch_local_node(config: ClusterConfig, executor_id: int, fn_payload: bytes, working_dir: str, attempt: int = 0) -> subprocess.Popen:
    """Starts a node on the driver host (``driver_ps_nodes=True``); runs on the driver.

    The supervisor watches the driver process and the stdin pipe, so it stops when the
    driver goes away. ``attempt`` is the cluster attempt (``ctx.attempt``; 0 first).
    """
    role = config.roles[executor_id]
    world = capture_on_driver(payload_broadcasts(fn_payload))
    launch = NodeLaunch(
        config=config,
        role=role,
        host=node_host(config.driver_host, config.driver_port),
        executor_key=f"{socket.gethostname()}/driver-{os.getpid()}",
        watch_pid=os.getpid(),
        watch_stdin=True,
        working_dir=working_dir,
        python_path=tuple(sys.path),
        fn_payload=bytes(fn_payload),
        cuda_visible_devices=None,
        attempt=int(attempt),
        on_driver=True,
        task_world=world,
    )
    try:
        return spawn_supervisor(launch)
    finally:
        world.close()  # the supervisor holds its own copies

