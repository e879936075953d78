"""The TF process: ``python -m tfos._node.tf_process`` runs one node's ``main_fun`` (executor host).

Steps, in order:

1. read the launch record from the supervisor's pipe, and exit if that pipe closes
   (the supervisor died);
2. hold a free TF port (bound, not listening, ``SO_REUSEADDR``, so gRPC can bind it meanwhile);
3. in InputMode.SPARK on chief/master/worker nodes, start the data server (:mod:`tfos._data.feed_hub`);
4. register with the driver, then wait for the full cluster;
5. set ``TF_CONFIG`` (always) and ``CUDA_VISIBLE_DEVICES`` (when Spark assigned GPUs);
6. start TensorBoard on the lead node when asked;
7. run ``main_fun(args, ctx)`` and report ``NodeState.FINISHED``, or ``FAILED`` with the traceback.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from typing import Callable, Optional

from tfos._common.deadline import Deadline
from tfos._common.wire import node_identity
from tfos._control import messages as _msg
from tfos._control.client import ControlClient
from tfos._control.limits import event_poll_s
from tfos._control.messages import NodeState
from tfos._data import local_socket as _local
from tfos._data import row_count
from tfos._data.feed_hub import FeedHub
from tfos._data.figures import live_snapshot, report_now
from tfos._data.framing import FeedState
from tfos._node import coordination as _coordination
from tfos._node import fed_shard, keras3_fix, ps_serving
from tfos._node import task_world as _task_world
from tfos._node.context import TFNodeContext
from tfos._node.launch import NodeLaunch
from tfos._node.node_failure import after_abort, node_failure
from tfos._node.output import OUTPUT_MARK_ENV, std_fds_identity, write_failure_marks, write_finished_marks
from tfos._node.preimport import FEED_MODULES, await_preimport, preimport_async
from tfos._node.stacks import thread_stacks
from tfos._node.start_task import read_launch, setup_process_logging, watch_stdin_eof
from tfos._node.tensorboard import start_tensorboard
from tfos._node.tf_noise import TF_LOG_LEVEL_DEFAULT
from tfos.cluster_template import InputMode, NodeInfo, tf_config_json
from tfos.errors import ControlProtocolError, DeadlineExceededError, NodeFailure, ReservationTimeoutError

# Run as ``python -m``: __name__ is "__main__" there, outside the 'tfos' logger and its
# handler (its records went to stderr bare, its INFO lines nowhere); __spec__ has the real name.
log = logging.getLogger(__spec__.name if __name__ == "__main__" and __spec__ is not None else __name__)

_REQ_ERRORS = (OSError, ControlProtocolError, DeadlineExceededError)


def reserve_port(host: str = "") -> socket.socket:
    """Binds (without listening) a free TCP port with SO_REUSEADDR (and SO_REUSEPORT) set.

    The port is bound on ``host`` (the node's address) when that address is local, else on
    every interface. TensorFlow's gRPC server itself later binds the wildcard address;
    tfos cannot change that.

    The socket keeps other programs off the port until ``ctx.release_port()``. TensorFlow's
    gRPC server (which sets SO_REUSEADDR) can bind the same port while it is held, because
    the held socket is not listening; ``tf_server.start_cluster_server`` relies on that to
    hand the port over without a gap.
    """
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if hasattr(socket, "SO_REUSEPORT"):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        s.bind((host, 0))
    except OSError:  # not an address of this host (NAT, a name resolving elsewhere)
        s.bind(("", 0))
    return s


def _tf_server_started() -> bool:
    """Whether main_fun started a TF server with ``start_cluster_server`` (TF process); only
    asked when tfos._node.server was imported, so nodes that never use it import nothing."""
    mod = sys.modules.get("tfos._node.server")
    return bool(mod is not None and mod.server_started())


def run_node(launch: NodeLaunch) -> int:
    """Runs one node in this process; returns the exit code (TF process)."""
    return _NodeRun(launch).run_node()


class _NodeRun:
    """One node's run in this process, step by step (TF process; see the module docstring)."""

    def __init__(self, launch: NodeLaunch):
        self.launch = launch
        self.cfg = launch.config
        self.role = launch.role
        self.eid = launch.role.executor_id
        # One connection for every thread of this process (main_fun's reports, the directive
        # poll, the data server's questions, TensorBoard's report): requests are answered in
        # any order, so the long-poll holds up nothing.
        self.client = ControlClient(self.cfg.driver_host, self.cfg.driver_port, self.cfg.key, self.cfg.cluster_id)
        self.hub: Optional[FeedHub] = None
        self.stop_event = threading.Event()
        self.main_done = threading.Event()
        self.tb_proc: Optional[subprocess.Popen] = None
        self.sock_dir: "Optional[_local.SocketDir]" = None

    def run_node(self) -> int:
        """The steps, in order; the exit code (its frame names tracebacks and stacks as run_node)."""
        launch, cfg, role, client = self.launch, self.cfg, self.role, self.client
        try:
            port_sock = reserve_port(launch.host)
            preimport = self._start_feed()
            hub = self.hub
            me = NodeInfo(self.eid, role.job_name, role.task_index, launch.host, port_sock.getsockname()[1],
                          hub.port if hub else 0, os.getpid(), launch.executor_key, hub.path if hub else "")
            if hub is not None:
                hub.identity = node_identity(me)  # data handshakes prove the task meant to reach this node
            spec = self._join(me)
            if spec is None:
                return 0
            await_preimport(preimport, launch.node_name)  # before TensorBoard's and main_fun's subprocesses
            os.environ["TF_CONFIG"] = tf_config_json(spec, role.job_name, role.task_index)
            if launch.cuda_visible_devices is not None:
                os.environ["CUDA_VISIBLE_DEVICES"] = launch.cuda_visible_devices
            ctx = self._context(spec, port_sock, me.port)
            main_thread = threading.current_thread()  # main_fun runs in this thread

            def _stack(all_threads: bool = False) -> str:
                main = "" if self.main_done.is_set() else main_fun_stack(main_thread, launch.node_name)
                if all_threads:  # the driver's stall watch and cluster.stacks()
                    return thread_stacks(launch.node_name, main_thread, main)
                return main

            threading.Thread(target=_event_loop, args=(client, self.eid, hub, self.stop_event, self._on_stop, _stack,
                                                       event_poll_s(cfg.num_nodes)), name="tfos-events", daemon=True).start()
            if cfg.hosts_tensorboard(role):
                self.tb_proc = start_tensorboard(launch, ctx, client)
            client.call(_msg.Status(executor_id=self.eid, state=NodeState.RUNNING), timeout_s=10.0)
            if cfg.release_port:
                ctx.release_port()
            keras3_fix.default_legacy_keras(cfg.tf_use_legacy_keras)
            keras3_fix.install(cfg.keras3_fix)  # applied when main_fun imports Keras 3 (docs/keras.md)
            ps_serving.install(ctx)  # a PSS worker's server.join() serves until the stop (docs/parameter_servers.md)
            if hub is not None:
                row_count.ROWS.enable()  # row accounting (docs/datafeed.md)
                fed_shard.install()  # no auto-shard of fed data
            self._run_main(ctx)
            self._linger()
        except BaseException as exc:  # noqa: BLE001 - every failure is reported, then the process ends
            self._fail(exc)
            return 1
        finally:
            tb_proc = self.tb_proc
            if tb_proc is not None and tb_proc.poll() is None:
                tb_proc.terminate()
                try:
                    tb_proc.wait(5.0)
                except subprocess.TimeoutExpired:
                    tb_proc.kill()
        return 0

    def _start_feed(self) -> Optional[threading.Thread]:
        """In InputMode.SPARK on a fed node: the data server, and the start-up imports of the
        first chunk (the thread, or None)."""
        launch, cfg, client = self.launch, self.cfg, self.client
        if cfg.input_mode != InputMode.SPARK or not self.role.feedable:
            return None
        self.sock_dir = _local.SocketDir.adopt(launch.feed_socket_dir) if launch.feed_socket_dir else None
        hub = self.hub = FeedHub(launch.host, cfg.key, cfg.queues, cfg.queue_chunks, launch.node_name,
                                 local_socket=self.sock_dir is not None, socket_dir=self.sock_dir)
        hub.data_timeout_s = cfg.data_timeout_s
        hub.ask_driver = lambda msg: client.call(msg, timeout_s=10.0)
        return preimport_async(FEED_MODULES, launch.node_name)

    def _join(self, me: NodeInfo) -> Optional[dict[str, list[str]]]:
        """Registers with the driver and waits for the whole cluster: its cluster spec, or
        None when the node was not admitted or the cluster aborted meanwhile.

        Raises:
            ReservationTimeoutError: Not every node registered within the reservation timeout.
        """
        client, name = self.client, self.launch.node_name
        resp = client.call(_msg.Register(me), timeout_s=30.0)
        if not resp.get("ok"):
            log.warning("tfos node %s not admitted: %s", name, resp.get("abort"))
            return None
        deadline = Deadline(
            self.cfg.reservation_timeout_s, "every node of the cluster to register",
            "too few free task slots, an executor busy with another job, or a node that failed to start",
        )
        while True:
            r = client.call(_msg.AwaitCluster(executor_id=self.eid, poll_s=5.0), timeout_s=30.0)
            if r.get("abort"):
                log.warning("tfos node %s: cluster aborted while waiting: %s", name, r["abort"])
                return None
            if r.get("ready"):
                return cluster_spec_of(r.get("cluster_spec"))
            if deadline.expired():
                raise deadline.error(ReservationTimeoutError, f"missing executor ids {r.get('missing')}")

    def _context(self, spec: dict[str, list[str]], port_sock: socket.socket, port: int) -> TFNodeContext:
        """The ``ctx`` main_fun gets."""
        launch, cfg, role, client, eid = self.launch, self.cfg, self.role, self.client, self.eid

        def _report_serving() -> None:
            # run_server_and_wait(): this node only serves now (shutdown() must not wait for it).
            client.call(_msg.Status(executor_id=eid, state=NodeState.SERVING), timeout_s=10.0)

        def _report_checkpoint(epochs: int) -> None:
            # ctx.report_checkpoint(): where a restarted train() resumes its feed (idempotent).
            client.call(_msg.Checkpoint(executor_id=eid, epochs=epochs), timeout_s=10.0)

        return TFNodeContext(
            executor_id=eid, job_name=role.job_name, task_index=role.task_index, cluster_spec=spec,
            defaultFS=cfg.default_fs, working_dir=cfg.driver_working_dir or launch.working_dir, mgr=self.hub,
            tmp_socket=port_sock, host=launch.host, port=port, stop_event=self.stop_event, on_serving=_report_serving,
            attempt=launch.attempt, on_checkpoint=_report_checkpoint,
        )

    def _on_stop(self) -> None:
        """The driver's stop directive (event-loop thread)."""
        if self.hub is not None:
            self.hub.close_feed()  # a no-op after hub.abort(): readers get FeedAbortedError
        if not self.main_done.is_set() and self.role.is_background:
            # ps/evaluator main_funs block forever (server.join()): end the process.
            report = _msg.Status(executor_id=self.eid, state=NodeState.STOPPED)
            try:
                _task_world.send_accumulator_updates(self.client, self.eid)  # a stop is their normal end
            except Exception as exc:  # noqa: BLE001 - reported: never a silently missing update
                report = _msg.Status(executor_id=self.eid, state=NodeState.FAILED, failure=node_failure(self.launch, exc))
            try:
                self.client.call(report, timeout_s=5.0)
            except _REQ_ERRORS:
                pass
            if self.tb_proc is not None:
                self.tb_proc.terminate()
            _local.remove_socket_dir(self.sock_dir)  # as main() does when run_node returns
            run_atexit_handlers()
            _flush_std_streams()
            os._exit(0)

    def _run_main(self, ctx: TFNodeContext) -> None:
        """Runs main_fun and reports that it returned."""
        launch, hub = self.launch, self.hub
        main_fun, tf_args = _task_world.load_payload(launch.fn_payload)  # from the local pipe, not the network
        log.info("tfos node %s: starting main_fun%s", launch.node_name, f" (attempt {launch.attempt})" if launch.attempt else "")
        try:
            main_fun(tf_args, ctx)
        except SystemExit as exc:
            if exc.code not in (None, 0):
                raise
        self.main_done.set()
        if hub is not None:
            row_count.ROWS.close(hub)  # the last epoch's rows trained, in the report below (docs/datafeed.md)
        report_now(self.client, self.eid, self.hub)  # main_fun's last rows and Keras steps, for the driver's summary
        _task_world.send_accumulator_updates(self.client, self.eid)  # before 'finished': the driver applies them at shutdown
        if hub is not None:
            hub.close(FeedState.MAIN_FUN_RETURNED, f"main_fun on {launch.node_name} returned")
        # The queues main_fun terminated: feed tasks that find the data server gone then
        # skip their partitions as 'terminated', not as 'main_fun returned early'
        # (docs/datafeed.md "Ending early").
        terminated = sorted(hub.terminated) if hub is not None else []
        # A forwarded node's supervisor reports it after the lines main_fun printed, so
        # the driver's "main_fun finished" line follows them.
        if not write_finished_marks(_OUTPUT_MARK, terminated, _OUTPUT_FDS):
            self.client.call(_msg.Status(executor_id=self.eid, state=NodeState.FINISHED, terminated=tuple(terminated)), timeout_s=10.0)

    def _linger(self) -> None:
        """After main_fun returned: keeps the process up while it must serve the cluster."""
        name = self.launch.node_name
        serving = _tf_server_started()
        part = _coordination.part_of(self.role) if not self.stop_event.is_set() else ""
        if part == "leader":
            # The other workers heartbeat to this process until they exit: it stays up until
            # the driver stops the cluster, after every main_fun returned (or a node failed).
            log.info("tfos node %s: main_fun returned; it leads TensorFlow's coordination service, "
                     "so its process waits for the cluster to stop", name)
            self.stop_event.wait()
        elif part == "member":
            # Its coordination agent heartbeats to the leader while this process lives: it
            # stays up until the driver stops the cluster (every main_fun returned, or a node
            # failed), at most coordination_linger_s(). Its FINISHED status is already sent,
            # so neither shutdown() nor a failure report waits for this.
            limit = _coordination.linger_s()
            log.info("tfos node %s: main_fun returned; its process keeps heartbeating to TensorFlow's coordination "
                     "service until the cluster stops (at most %g s)", name, limit)
            if not self.stop_event.wait(limit):
                log.warning("tfos node %s: the cluster did not stop within %g s after main_fun returned; the process "
                            "exits (the coordination service's leader may report it crashed)", name, limit)
        elif serving or (self.tb_proc is not None and self.tb_proc.poll() is None):
            # Keep TensorBoard, and a TF server main_fun started with start_cluster_server,
            # up until the driver stops the cluster (the supervisor ends this process if the
            # driver goes away): a TF1 peer may still be creating its session on this
            # node's server (it waits without end for every task of the cluster spec).
            if serving:
                log.info("tfos node %s: main_fun returned; its TF server serves until the cluster stops", name)
            self.stop_event.wait()

    def _fail(self, exc: BaseException) -> None:
        """Reports the failure of this node (main_fun's or tfos's own)."""
        launch, hub = self.launch, self.hub
        if isinstance(exc, BrokenPipeError) and (_SUPERVISOR_GONE.is_set() or _output_reader_gone()):
            # main_fun's print hit the pipes of a supervisor that just died: the supervisor
            # watch reports SupervisorDied (the root cause, not this) and ends this process;
            # only if it has not reported within the waits is this failure main_fun's own.
            if _SUPERVISOR_GONE.wait(_SUPERVISOR_GONE_WAIT_S) and _SUPERVISOR_REPORTED.wait(_SUPERVISOR_REPORT_WAIT_S):
                self.main_done.set()
                return
        self.main_done.set()
        failure = node_failure(launch, exc)
        if hub is not None and hub.aborted:
            failure = after_abort(failure, hub.aborted)
        if hub is not None:
            hub.close(FeedState.MAIN_FUN_FAILED, f"main_fun on {launch.node_name} failed: {failure.error_type}: {failure.message}")
        log.error("tfos node %s failed:\n%s", launch.node_name, failure.traceback)
        # A forwarded node's supervisor reports the failure after the lines main_fun
        # printed before it, so the driver shows them before it raises.
        if not write_failure_marks(_OUTPUT_MARK, failure.to_dict(), _OUTPUT_FDS):
            try:
                self.client.call(_msg.Status(executor_id=self.eid, state=NodeState.FAILED, failure=failure), timeout_s=10.0)
            except _REQ_ERRORS as rexc:
                log.error("could not report the failure to the driver: %s", rexc)


#: Longest wait, in seconds, for the atexit handlers of the TF process before it exits.
ATEXIT_BUDGET_S = 2.0


def run_atexit_handlers(budget_s: float = ATEXIT_BUDGET_S) -> None:
    """Runs the interpreter's atexit handlers, waiting at most ``budget_s`` (TF process).

    The TF process ends with ``os._exit`` (TensorFlow and gRPC leave non-daemon threads
    that a normal exit would wait for), which skips atexit. The handlers that
    ``main_fun`` and its libraries registered still run here: TensorFlow's autograph
    deletes the modules it generated in the temp directory (one file per converted
    function, otherwise left on every executor host), and the user's own handlers run
    as in a plain Python program. They run in a daemon thread so that a stuck handler
    delays the exit by ``budget_s`` at most (logged); a handler that raises is reported
    on stderr by Python and the others still run.
    """
    import atexit

    t = threading.Thread(target=atexit._run_exitfuncs, name="tfos-atexit", daemon=True)
    t.start()
    t.join(budget_s)
    if t.is_alive():
        log.warning("tfos: the TF process's atexit handlers did not finish within %g s; exiting without them", budget_s)


#: Innermost frames of main_fun's stack sent to the driver when a feed task asks for it.
_STACK_FRAMES = 40


def main_fun_stack(thread: threading.Thread, node_name: str) -> str:
    """Where ``thread`` (the one running main_fun) is now, as a traceback-style text with the
    innermost call last and without the TF process's own frames around main_fun (TF
    process). '' when the thread has ended.

    A feed task that timed out puts this in its FeedTimeoutError, so that a main_fun that
    stopped reading (stuck in a lock, a collective waiting for a peer, a long step) shows
    where it stopped instead of only that it stopped.
    """
    frame = sys._current_frames().get(thread.ident) if thread.is_alive() and thread.ident is not None else None
    if frame is None:
        return ""
    frames = list(traceback.extract_stack(frame))
    del frame
    here = os.path.abspath(__file__)
    start = 0
    for i, f in enumerate(frames):  # main() -> run_node() -> main_fun: keep main_fun and below
        if f.name == "run_node" and os.path.abspath(f.filename) == here:
            start = i + 1
    package = os.path.dirname(os.path.dirname(here)) + os.sep
    while start < len(frames) - 1 and os.path.abspath(frames[start].filename).startswith(package):
        start += 1  # tfos's wrappers of main_fun (tfos._driver.user_source)
    frames = frames[start:]
    left_out = max(0, len(frames) - _STACK_FRAMES)
    lines = [f"main_fun's stack on {node_name} (TF process pid {os.getpid()}, thread {thread.name}), innermost call last:\n"]
    if left_out:
        lines.append(f"  ... {left_out} outer frames left out ...\n")
    lines.extend(traceback.format_list(frames[left_out:]))
    return "".join(lines).rstrip("\n")


def cluster_spec_of(value: object) -> dict[str, list[str]]:
    """The cluster spec of the driver's ``await_cluster`` answer, checked (TF process).

    Raises:
        ControlProtocolError: Not a ``{job: ["host:port", ...]}`` mapping.
    """
    if not isinstance(value, dict) or not all(
        isinstance(job, str) and isinstance(addrs, list) and all(isinstance(a, str) for a in addrs) for job, addrs in value.items()
    ):
        raise ControlProtocolError(f"the driver's cluster spec is not a mapping of jobs to addresses: {str(value)[:200]}")
    return value


def _event_loop(client: ControlClient, eid: int, hub: Optional[FeedHub], stop_event: threading.Event, on_stop,
                stack_of: Optional[Callable[..., str]] = None, poll_s: float = 1.0) -> None:
    """Long-polls the driver for directives (TF process thread): each poll ends at once on
    a change, or after ``poll_s`` (longer in larger clusters, see
    :func:`tfos._control.limits.event_poll_s`), and carries the row counters."""
    known: dict = {}
    while True:
        try:
            d = client.call(
                _msg.WaitEvent(executor_id=eid, known=known, counters=live_snapshot(hub), poll_s=poll_s),
                timeout_s=poll_s + 14.0,
            )
        except _REQ_ERRORS:
            time.sleep(1.0)  # the supervisor decides when the driver is gone
            continue
        # The abort first: a reply can carry both (the teardown closes the feed too), and an
        # end of feed queued before the abort could reach main_fun as a normal end.
        if d.get("abort") and hub is not None:
            hub.abort(str(d.get("abort")))  # before on_stop(): never an end of feed after an abort
        if d.get("feed_closed") and not known.get("feed_closed") and hub is not None and not hub.aborted:
            hub.close_feed()
        ask = d.get("stack") or 0
        if ask and ask != known.get("stack") and stack_of is not None:
            # Where main_fun is (a feed task timed out: main_fun_stack), or every thread
            # (the driver's stall watch, cluster.stacks(): tfos._node.stacks).
            try:
                client.call(_msg.Stack(executor_id=eid, seq=int(ask), text=stack_of(True) if d.get("stack_all") else stack_of()), timeout_s=5.0)
            except _REQ_ERRORS as exc:
                log.warning("could not send main_fun's stack to the driver: %s", exc)
        if (d.get("stop") or d.get("abort")) and not stop_event.is_set():
            stop_event.set()
            on_stop()
        known = {k: d.get(k) for k in ("stop", "feed_closed", "abort", "failed", "stack", "stack_all", "report")}


def _flush_std_streams() -> None:
    """Flushes Python's stdout/stderr buffers before an ``os._exit`` (TF process)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


#: Exit status of a TF process whose supervisor died.
SUPERVISOR_GONE_EXIT = 70


#: Seconds main_fun's BrokenPipeError waits for the supervisor watch to report the death of
#: the supervisor (it reads stdout/stderr) and end the process.
_SUPERVISOR_GONE_WAIT_S = 5.0
#: Set by the supervisor watch when it starts handling the supervisor's death (it then
#: points descriptors 1 and 2 at /dev/null, so they no longer show the broken pipes).
_SUPERVISOR_GONE = threading.Event()
#: Set by the supervisor watch once its SupervisorDied report was sent (or failed), right
#: before it ends this process.
_SUPERVISOR_REPORTED = threading.Event()
#: Longest wait, in seconds, for that report (its connect and its call: 2 s each).
_SUPERVISOR_REPORT_WAIT_S = 10.0


def _output_reader_gone() -> bool:
    """Whether descriptor 1 or 2 is a pipe that nobody reads any more (TF process): the
    supervisor reading them died. ``poll`` reports ``POLLERR`` on the write end of a pipe
    whose read end is closed."""
    import select

    poller = select.poll()
    for fd in (1, 2):
        poller.register(fd, 0)  # POLLERR and POLLHUP are always reported
    try:
        return any(ev & select.POLLERR for _, ev in poller.poll(0))
    except OSError:
        return False


def _supervisor_gone(launch: NodeLaunch, sock_dir: "Optional[_local.SocketDir]" = None) -> None:
    """The supervisor's pipe closed, so it died (it never closes the pipe itself while the
    TF process runs): report the node lost to the driver, then end this process's group
    (the TF process and what main_fun started) at once (TF process)."""
    # First, while nothing else can end this process before it: the main thread may exit
    # on its own (main_fun's failure) while the report below waits for the driver.
    _local.remove_socket_dir(sock_dir)  # the supervisor that would have is gone
    _SUPERVISOR_GONE.set()
    r = launch.role
    cfg = launch.config
    # The supervisor read this process's stdout/stderr: with it gone, a print in main_fun
    # would raise BrokenPipeError and be reported as main_fun's own failure.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        os.close(devnull)
    except OSError:
        pass
    try:
        failure = NodeFailure(
            r.executor_id, r.job_name, r.task_index, launch.host, "lost", "SupervisorDied",
            "the node's supervisor process died (killed, or out of memory) and took the node down; "
            f"its TF process (pid {os.getpid()}) ended with it",
        )
        client = ControlClient(cfg.driver_host, cfg.driver_port, cfg.key, cfg.cluster_id, connect_timeout_s=2.0)
        client.call(_msg.Status(executor_id=r.executor_id, state=NodeState.FAILED, failure=failure), timeout_s=2.0, retry=False)
    except BaseException:  # noqa: BLE001 - the exit below must happen whatever the report did
        pass
    finally:
        _SUPERVISOR_REPORTED.set()
        # What main_fun started is in this process's group (the supervisor made the TF
        # process a group leader, and would have ended the group itself), or below this
        # process in a session of its own: end it with us.
        _end_own_tree()
        os._exit(SUPERVISOR_GONE_EXIT)


#: The supervisor's token for this process's marker lines ("": report failures directly).
_OUTPUT_MARK = ""
#: What descriptors 1 and 2 were at start (the supervisor's pipes when _OUTPUT_MARK is set).
_OUTPUT_FDS: Optional[tuple] = None


def _end_own_tree() -> None:
    """Kills every descendant of this process (those ``main_fun`` started in a session of
    their own too: only the dead supervisor, their subreaper, would have caught them
    later), then this process's group, this process with it (TF process)."""
    try:
        import psutil

        for p in psutil.Process().children(recursive=True):
            try:
                p.kill()
            except psutil.Error:
                pass
    except Exception:  # noqa: BLE001 - the group kill below must happen whatever this did
        pass
    try:
        if os.getpgrp() == os.getpid():
            os.killpg(os.getpid(), signal.SIGKILL)
    except OSError:
        pass


def _end_with_a_dead_supervisor(supervisor_pid: int) -> None:
    """At the normal end of the TF process: when its supervisor died meanwhile, what
    ``main_fun`` started must still go, and only the supervisor would have killed this
    process's group. ``main_fun`` can return right after the supervisor's death (the
    driver's abort reached it as a FeedAbortedError), before the supervisor watch,
    which reports the death to the driver, has ended the group. Waits for that watch
    (it exits this process), then ends the group itself (TF process)."""
    if not (_SUPERVISOR_GONE.is_set() or os.getppid() != supervisor_pid):
        return
    _SUPERVISOR_GONE.wait(1.0)  # the watch sees the pipe's end at once
    time.sleep(_SUPERVISOR_GONE_WAIT_S)  # its report takes 4 s at most, then it exits this process
    _end_own_tree()


def main() -> int:
    """Entry point of ``python -m tfos._node.tf_process``; returns the exit code."""
    global _OUTPUT_MARK, _OUTPUT_FDS
    supervisor_pid = os.getppid()
    _OUTPUT_MARK = os.environ.pop(OUTPUT_MARK_ENV, "")
    _OUTPUT_FDS = std_fds_identity()
    setup_process_logging()
    launch = read_launch(sys.stdin.buffer)
    # The start task's PySpark state (broadcasts, SparkFiles, TaskContext), set up before
    # the payload is unpickled; the soft RLIMIT_AS raised to the hard limit.
    _task_world.install(launch.task_world)

    # Quiet by default (docs/api.md "Node output"): TensorFlow's C++ INFO lines only if the
    # user asks for them (a TF_CPP_MIN_LOG_LEVEL of theirs wins); set before main_fun
    # imports TensorFlow.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", TF_LOG_LEVEL_DEFAULT)

    # The supervisor is gone: never outlive it. Tell the driver first (one try, 2 s at
    # most): nobody else will; without this the driver saw only the consequences (a feed
    # task's lost connection) or, in InputMode.TENSORFLOW, waited for the heartbeat timeout.
    sock_dir = _local.SocketDir.adopt(launch.feed_socket_dir) if launch.feed_socket_dir else None
    watch_stdin_eof(lambda: _supervisor_gone(launch, sock_dir), "tfos-supervisor-watch")
    if launch.watch_pid:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # the supervisor decides (see tfos._node.supervisor)
    code = run_node(launch)
    # The data server is closed: remove its directory now, not only when the supervisor
    # reaps this process (a supervisor killed before it did would leave it under TMPDIR).
    _local.remove_socket_dir(sock_dir)
    run_atexit_handlers()
    _flush_std_streams()
    _end_with_a_dead_supervisor(supervisor_pid)
    # TensorFlow and gRPC leave non-daemon threads behind; exit without joining them.
    os._exit(code)


if __name__ == "__main__":
    main()
