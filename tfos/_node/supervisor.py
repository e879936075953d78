"""The node supervisor process: ``python -m tfos._node.supervisor`` (runs on an executor host).

One supervisor per node. It is light (no TensorFlow) and:

* starts the node's TF process and hands it the launch record over a pipe;
* sends the driver a heartbeat every ``heartbeat_interval_s`` (longer in large clusters, see
  :func:`tfos._control.limits.heartbeat_interval_s`) and obeys its directives; its own
  checks (below) run every second;
* watches the executor JVM (or the driver, for driver-hosted ps nodes) and, in
  InputMode.TENSORFLOW, its parent Spark task; when one goes away it ends the TF process;
* reaps the TF process and reports its exit code or signal to the driver at once;
* samples the resident memory of the TF process and its children (psutil) and sends it
  with each heartbeat, so a SIGKILL (usually a memory limit) is reported with it;
* after a stop directive, gives the TF process a grace period, then SIGTERM, then SIGKILL;
  after an abort directive (the cluster failed) there is no grace: SIGTERM at once,
  SIGKILL 2 s later;
* once the TF process has ended, kills its process group and, as the child subreaper of
  its descendants (Linux), whatever ``main_fun`` started in a session of its own.

It never outlives its node: every request to the driver is bounded by the time left
before ``heartbeat_timeout_s`` runs out, counted from the last answer the driver gave,
so losing the driver ends the node within about ``heartbeat_timeout_s`` + 2 s.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Optional

from tfos._control import messages as _msg
from tfos._control.client import ControlClient
from tfos._control.messages import NodeState
from tfos._control.registry import describe_exit
from tfos._data import local_socket as _local
from tfos._node.address_space import memory_limit_exit_hint
from tfos._node.launch import NodeLaunch
from tfos._node.output import NodeOutput
from tfos._node.start_task import read_launch, setup_process_logging, start_node_process, watch_stdin_eof
from tfos._node.tf_noise import tf_noise_level
from tfos.cluster_template import InputMode
from tfos.errors import ControlProtocolError, DeadlineExceededError, NodeFailure

# Run as ``python -m``: __name__ is "__main__" there, outside the 'tfos' logger and its
# handler (its records went to stderr bare, its INFO lines nowhere); __spec__ has the real name.
log = logging.getLogger(__spec__.name if __name__ == "__main__" and __spec__ is not None else __name__)

#: Seconds the TF process gets to exit by itself after a stop directive.
STOP_GRACE_S = 10.0
#: Seconds between SIGTERM and SIGKILL after a stop directive.
KILL_GRACE_S = 5.0
#: Seconds between SIGTERM and SIGKILL after an abort directive (another node failed) or
#: when the driver is gone. There is no grace before the SIGTERM: the cluster cannot
#: recover, and a main_fun busy in TF compute would never look at its stop event.
ABORT_KILL_S = 2.0
#: Longest wait for one driver answer (heartbeat, report).
_REQUEST_TIMEOUT_S = 5.0
#: Seconds of refused connections (nothing listens on the control port: the driver tore
#: the cluster down, e.g. after a Ctrl-C in run() before this node registered, or exited)
#: after which the node stops without waiting for heartbeat_timeout.
REFUSED_GIVE_UP_S = 3.0
#: Longest connection attempt of one heartbeat: the loop tries again (the silence budget
#: still ends the node heartbeat_timeout after the driver's last answer), and sees
#: refused connections within REFUSED_GIVE_UP_S (a refusal comes at once). Long enough for
#: the kernel's SYN retransmissions (after 1 and 3 s; the third leaves at 7 s) when a
#: flood makes the driver's host drop a SYN.
_CONNECT_SLICE_S = 7.5


def spark_executor_id(cmdline: list[str]) -> Optional[str]:
    """Spark's executor id from an executor JVM's command line, or None.

    Every cluster manager starts executors as ``CoarseGrainedExecutorBackend ...
    --executor-id <id>`` (YARN, Kubernetes and standalone, local-cluster included); a
    ``local[N]`` driver JVM has no such argument. This is the id of Spark's own "Lost
    executor <id>" lines and UI, which differs from tfos's ``executor_id`` (the node's index,
    as in TFoS).
    """
    for i, arg in enumerate(cmdline[:-1]):
        if arg == "--executor-id":
            return cmdline[i + 1]
    return None


class _Watch:
    """Liveness of one process by pid and start time (psutil)."""

    def __init__(self, pid: int):
        import psutil

        self.pid = pid
        self._proc: Optional[psutil.Process] = None
        #: Spark's executor id when the process is an executor JVM (read once, while it lives).
        self.spark_executor_id: Optional[str] = None
        if pid:
            try:
                self._proc = psutil.Process(pid)
                self.spark_executor_id = spark_executor_id(self._proc.cmdline())
            except psutil.Error:
                pass

    def describe(self) -> str:
        """``"pid N"``, with Spark's executor id when known: ``"pid N, Spark executor id 3"``."""
        eid = f", Spark executor id {self.spark_executor_id}" if self.spark_executor_id is not None else ""
        return f"pid {self.pid}{eid}"

    def alive(self) -> bool:
        import psutil

        if not self.pid:
            return True
        if self._proc is None:
            return False
        try:
            return self._proc.is_running() and self._proc.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False


def _stop_tf(tf: subprocess.Popen, kill_after_s: float = KILL_GRACE_S) -> int:
    """SIGTERM, then SIGKILL after ``kill_after_s``; returns the exit status."""
    if tf.poll() is None:
        tf.terminate()
        try:
            tf.wait(kill_after_s)
        except subprocess.TimeoutExpired:
            tf.kill()
    return tf.wait(KILL_GRACE_S)


def _tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and its descendants (0 when it is gone)."""
    import psutil

    try:
        proc = psutil.Process(pid)
        procs = [proc] + proc.children(recursive=True)
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            continue
    return total


def _is_stopped(pid: int) -> bool:
    """True while ``pid`` is stopped by a signal (SIGSTOP: the TF process leads a session
    of its own, an orphaned process group, for which the kernel discards SIGTSTP, SIGTTIN
    and SIGTTOU; state ``T``), not while a debugger holds it (``t``) (supervisor)."""
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_STOPPED
    except psutil.Error:
        return False


def _end_group(pgid: int) -> None:
    """Kills what is left of the TF process's group (processes main_fun started)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


#: prctl option that makes orphaned descendants reparent to this process (Linux >= 3.4).
_PR_SET_CHILD_SUBREAPER = 36


def _become_subreaper() -> bool:
    """Makes this supervisor the child subreaper of its descendants (Linux; supervisor).

    A process that ``main_fun`` starts in a session of its own (``setsid``,
    ``start_new_session=True``, a daemon's double fork) leaves the TF process's process
    group, so :func:`_end_group` misses it; once its parent exits it would be reparented
    to init and outlive the node. As a subreaper the supervisor inherits it instead, and
    :func:`_end_descendants` ends it with the node. Returns False where prctl is missing
    (not Linux) or refuses; the process-group kill still applies there.
    """
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _end_descendants(wait_s: float = 2.0, passes: int = 5) -> list[int]:
    """SIGKILLs and reaps every process still below this supervisor once the node has
    ended (supervisor): what ``main_fun`` started outside the TF process's group, found
    through the subreaper (:func:`_become_subreaper`). Repeats while new ones appear (a
    process forking as it is killed), ``passes`` times at most. Returns their pids."""
    import psutil

    ended: list[int] = []
    for _ in range(passes):
        try:
            left = psutil.Process().children(recursive=True)
        except psutil.Error:
            break
        if not left:
            break
        for p in left:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(left, timeout=wait_s)  # reaps the children (no zombies of the node)
        ended += [p.pid for p in left if p.pid not in ended]
    return ended


def _reap_orphans(tf_pid: int, most: int = 10000) -> int:
    """Reaps the exited processes this subreaper inherited while the node runs (a shell's
    ``cmd &`` whose shell exited, a daemon's double fork), so that they do not stay
    zombies until the node ends; never the TF process, which ``Popen.wait`` reaps.
    System calls only (``waitid`` peeks without reaping), so it runs at every heartbeat.
    Returns how many were reaped (supervisor)."""
    reaped = 0
    while reaped < most:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            break
        if info is None or info.si_pid == tf_pid:
            break  # none exited, or the TF process did (it is reaped by tf.wait, which ends the node)
        try:
            os.waitpid(info.si_pid, os.WNOHANG)
            reaped += 1
        except ChildProcessError:
            break
    return reaped


def _contact_budget_s(client: ControlClient, timeout_s: float, started: float) -> float:
    """Seconds left before ``timeout_s`` of silence from the driver, counted from its last
    answer (or from ``started`` before the first one); may be <= 0."""
    return timeout_s - (time.monotonic() - max(client.last_contact, started))


def _report(client: ControlClient, launch: NodeLaunch, kind: str, etype: str, message: str) -> None:
    r = launch.role
    failure = NodeFailure(r.executor_id, r.job_name, r.task_index, launch.host, kind, etype, message)
    try:
        # One attempt only, with a short connect budget: when the executor or driver is
        # going away, ending the node promptly matters more than the report.
        client.call(_msg.Status(executor_id=r.executor_id, state=NodeState.FAILED, failure=failure),
                    timeout_s=_REQUEST_TIMEOUT_S, retry=False, connect_timeout_s=2.0)
    except (OSError, ControlProtocolError, DeadlineExceededError) as exc:
        log.warning("could not report %s to the driver: %s", kind, exc)


def node_output(launch: NodeLaunch, client: Optional[ControlClient] = None) -> Optional[NodeOutput]:
    """The reader of the TF process's output: forwarded to the driver (over ``client``, the
    supervisor's own connection, when given), TF's C++ noise dropped (docs/api.md "Node output"); None when
    neither applies (supervisor)."""
    cfg = launch.config
    forwarded = cfg.forwards_logs_of(launch.role)
    tf_min_level = tf_noise_level(os.environ.get("TF_CPP_MIN_LOG_LEVEL"))  # what the TF process inherits
    if not forwarded and tf_min_level is None:
        return None
    if not forwarded:
        client = None
    elif client is None:
        client = ControlClient(cfg.driver_host, cfg.driver_port, cfg.key, cfg.cluster_id)
    # Under local[N], and for a node the driver started on its own host, the "executor
    # log" is the driver's terminal: forwarded lines show once (with their node prefix).
    tee = not (forwarded and (cfg.local_master or launch.on_driver))
    return NodeOutput(client, launch.role.executor_id, tee=tee, tf_min_level=tf_min_level)


def supervise(launch: NodeLaunch) -> int:
    """Runs one node to completion (supervisor process).

    Returns:
        The TF process's exit status (negative: killed by that signal).
    """
    return _Supervision(launch).run()


class _Supervision:
    """One node's supervision (supervisor process): the TF process, its heartbeats and the
    checks of every tick; ``code`` is set once the TF process ended or was ended."""

    def __init__(self, launch: NodeLaunch):
        cfg = self.cfg = launch.config
        self.launch = launch
        self.eid = launch.role.executor_id
        self.client = ControlClient(cfg.driver_host, cfg.driver_port, cfg.key, cfg.cluster_id,
                                    connect_timeout_s=cfg.heartbeat_timeout_s)
        self.jvm = _Watch(launch.watch_pid)
        self.parent_gone = threading.Event()
        self.sock_dir: Optional[_local.SocketDir] = None
        self.output: Optional[NodeOutput] = None
        self.tf: subprocess.Popen
        self.started = 0.0
        # The checks run every tick; a heartbeat goes out every heartbeat_interval_s (and a
        # tick after a failed one).
        self.tick_s = min(1.0, cfg.heartbeat_interval_s)
        self.next_beat = 0.0
        self.refused_since: Optional[float] = None
        self.stop_since: Optional[float] = None
        self.stopped_since: Optional[float] = None
        self.aborted = False
        self.driver_gone = False
        self.terminated = False
        self.rss = 0

    def run(self) -> int:
        if self.launch.watch_stdin:
            watch_stdin_eof(self.parent_gone.set, "tfos-parent-watch")
        self._start()
        code: Optional[int] = None
        while code is None:
            try:
                code = self.tf.wait(self.tick_s)
                break
            except subprocess.TimeoutExpired:
                pass
            code = self._tick()
        return self._finish(code)

    def _start(self) -> None:
        """Starts the TF process (and makes a fed node's socket directory first)."""
        launch, cfg = self.launch, self.cfg
        # A fed node's data server listens on a Unix socket in a directory made here, so that
        # it is removed whatever ends the TF process; directories of nodes killed together
        # with their supervisor (a process-group or cgroup kill) are swept first.
        if cfg.input_mode == InputMode.SPARK and launch.role.feedable and _local.SUPPORTED:
            _local.sweep_stale_socket_dirs()
            self.sock_dir = _local.make_socket_dir()
            if self.sock_dir is not None:
                launch = self.launch = dataclasses.replace(launch, feed_socket_dir=self.sock_dir.path)
        # Its own process group, so that whatever main_fun starts (subprocesses, forks,
        # TensorBoard) is ended with the node: see _end_group. Its output is read here (it
        # outlives the TF process), filtered, teed to the executor log and forwarded.
        threading.Thread(target=self._first_heartbeat, name="tfos-first-heartbeat", daemon=True).start()
        output = self.output = node_output(launch, self.client)  # its lines go over the heartbeat's connection
        try:
            if output is None:
                self.tf = start_node_process("tfos._node.tf_process", launch, new_session=True)
            else:
                self.tf = start_node_process("tfos._node.tf_process", launch, new_session=True, stdout=output.child_stdout,
                                             stderr=output.child_stderr, log_fd=output.log_fd, output_mark=output.mark)
                output.start()
        except BaseException:
            if output is not None:
                output.close()
            _local.remove_socket_dir(self.sock_dir)
            raise
        log.info("tfos node %s: TF process pid %d started", launch.node_name, self.tf.pid)
        self.started = time.monotonic()

    def _first_heartbeat(self) -> None:
        """Opens the heartbeat connection while the TF process starts (so before run()
        returns on the driver; a thread, so that the start is not delayed) and keeps it: a
        connection that proved it holds the key is never shed, so a flood that starts later
        cannot keep the heartbeats out. A failure is logged; the heartbeat loop retries
        within the silence budget."""
        try:
            self.client.call(_msg.Heartbeat(executor_id=self.eid, pid=os.getpid(), host=self.launch.host, rss=0),
                             timeout_s=_REQUEST_TIMEOUT_S, retry=False,
                             connect_timeout_s=max(0.1, min(self.cfg.heartbeat_timeout_s, _CONNECT_SLICE_S)))
        except (OSError, ControlProtocolError, DeadlineExceededError) as exc:
            log.warning("tfos node %s: the first heartbeat got no answer from the driver (%s); retrying while the "
                        "TF process starts", self.launch.node_name, exc)

    def _tick(self) -> Optional[int]:
        """One tick's checks and heartbeat; the exit status once the TF process was ended."""
        launch, cfg, tf, client = self.launch, self.cfg, self.tf, self.client
        if not self.jvm.alive():
            _report(client, launch, "lost", "ExecutorLost", f"the Spark executor JVM ({self.jvm.describe()}) on {launch.host} exited, taking the node down")
            return _stop_tf(tf, ABORT_KILL_S)
        if self.parent_gone.is_set():
            if self.stop_since is None:
                _report(client, launch, "lost", "SparkTaskKilled", "the Spark task hosting the node ended (task killed or Python worker died)")
            return _stop_tf(tf, ABORT_KILL_S)
        self.rss = _tree_rss(tf.pid) or self.rss
        if _is_stopped(tf.pid):
            # A stopped TF process stalls the cluster (its peers wait in their collectives,
            # its feed tasks until feed_timeout) while this supervisor heartbeats for it.
            self.stopped_since = time.monotonic() if self.stopped_since is None else self.stopped_since
            if time.monotonic() - self.stopped_since >= cfg.heartbeat_timeout_s:
                _report(client, launch, "exited", "ProcessStopped",
                        f"the TF process (pid {tf.pid}) was stopped by a signal (SIGSTOP) for about "
                        f"{time.monotonic() - self.stopped_since:.0f} s, longer than heartbeat_timeout "
                        f"({cfg.heartbeat_timeout_s:g} s); a stopped node stalls its cluster, so it was ended")
                self.terminated = True
                return _stop_tf(tf, ABORT_KILL_S)  # SIGKILL ends a stopped process too
        else:
            self.stopped_since = None
        _reap_orphans(tf.pid)
        if time.monotonic() >= self.next_beat:
            code = self._beat()
            if code is not None:
                return code
        if self.stop_since is not None and not self.terminated and time.monotonic() - self.stop_since >= STOP_GRACE_S:
            log.warning("tfos node %s: TF process still running %.0f s after stop; terminating it", launch.node_name, STOP_GRACE_S)
            self.terminated = True
            return _stop_tf(tf)
        return None

    def _beat(self) -> Optional[int]:
        """One heartbeat; the exit status once the TF process was ended (cluster aborted,
        driver gone)."""
        launch, cfg, client = self.launch, self.cfg, self.client
        self.next_beat = time.monotonic() + cfg.heartbeat_interval_s
        budget = _contact_budget_s(client, cfg.heartbeat_timeout_s, self.started)
        try:
            if budget <= 0:
                raise ConnectionError("no answer from the driver")
            # Connect and answer both bounded by the silence budget left: a dead driver
            # is given up on heartbeat_timeout_s after its last answer, not later. One
            # connection attempt takes at most _CONNECT_SLICE_S; the next heartbeat retries.
            d = client.call(
                _msg.Heartbeat(executor_id=self.eid, pid=os.getpid(), host=launch.host, rss=self.rss),
                timeout_s=max(0.1, min(_REQUEST_TIMEOUT_S, budget)), retry=False,
                connect_timeout_s=max(0.1, min(budget, _CONNECT_SLICE_S)),
            )
        except (OSError, ControlProtocolError, DeadlineExceededError) as exc:
            return self._unanswered(exc)
        if (d.get("stop") or d.get("abort")) and self.stop_since is None:
            self.stop_since = time.monotonic()
        if d.get("abort") and not self.aborted and not self.terminated:
            self.aborted = True
            log.warning("tfos node %s: the cluster aborted (%s); terminating the TF process", launch.node_name, d.get("abort"))
            self.terminated = True
            return _stop_tf(self.tf, ABORT_KILL_S)
        return None

    def _unanswered(self, exc: BaseException) -> Optional[int]:
        """A heartbeat got no answer: the exit status once the driver counts as gone."""
        launch, client = self.launch, self.client
        self.next_beat = time.monotonic() + self.tick_s  # try again at the next tick
        silence = time.monotonic() - max(client.last_contact, self.started)
        if isinstance(client.last_connect_error, ConnectionRefusedError):
            self.refused_since = time.monotonic() if self.refused_since is None else self.refused_since
        else:
            self.refused_since = None
        timeout_s = self.cfg.heartbeat_timeout_s
        if self.refused_since is not None and time.monotonic() - self.refused_since >= min(REFUSED_GIVE_UP_S, timeout_s):
            log.error("tfos node %s: the driver's control port refuses connections for %.1f s (the cluster was torn "
                      "down or the driver exited); stopping the node", launch.node_name, time.monotonic() - self.refused_since)
        elif silence >= timeout_s:
            log.error("tfos node %s: no answer from the driver for %.1f s (%s); stopping the node", launch.node_name, silence, exc)
        else:
            return None
        self.driver_gone = True
        if self.output is not None:
            self.output.abandon()  # at once: its sender stops trying while the TF process stops
        return _stop_tf(self.tf, ABORT_KILL_S)

    def _finish(self, code: int) -> int:
        """Ends what is left of the node and reports its exit; returns ``code``."""
        launch, client = self.launch, self.client
        _end_group(self.tf.pid)
        escaped = _end_descendants()
        if escaped:
            # those of the group just killed that this subreaper inherited, and those started
            # in a session of their own
            log.info("tfos node %s: ended and reaped %d process(es) left below the node: pids %s",
                     launch.node_name, len(escaped), escaped)
        _local.remove_socket_dir(self.sock_dir)
        if self.output is not None:
            self.output.close()  # its last lines reach the driver before its exit status
        log.info("tfos node %s: TF process %s", launch.node_name, describe_exit(code))
        if not self.driver_gone:
            # An address-space limit (spark.executor.pyspark.memory) in force, for the driver's ProcessDied text.
            hint = memory_limit_exit_hint(code)
            try:
                # unprompted: the TF process ended without this supervisor ending it, so a
                # non-zero code is a death of its own even if the cluster is stopping.
                client.call(_msg.Status(executor_id=self.eid, state=NodeState.EXITED, code=int(code), rss=self.rss,
                                        unprompted=not self.terminated, hint=hint or ""),
                            timeout_s=_REQUEST_TIMEOUT_S, retry=False, connect_timeout_s=2.0)
            except (OSError, ControlProtocolError, DeadlineExceededError) as exc:
                log.warning("could not report the exit of %s: %s", launch.node_name, exc)
        client.close()
        return code


def main() -> int:
    """Entry point of ``python -m tfos._node.supervisor``; returns the process exit code."""
    setup_process_logging()
    _become_subreaper()
    launch = read_launch(sys.stdin.buffer)
    if launch.watch_pid:
        # The PySpark daemon SIGHUPs its process group when the executor goes away; the
        # supervisor notices that itself (JVM watch) and reports it before ending the node.
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        code = supervise(launch)
    except BaseException as exc:  # noqa: BLE001 - reported to the driver, then the process ends
        import traceback

        log.exception("tfos node %s: the supervisor failed", launch.node_name)
        r = launch.role
        failure = NodeFailure(
            r.executor_id, r.job_name, r.task_index, launch.host, "exited", type(exc).__name__,
            f"the node supervisor failed: {exc}", traceback.format_exc(),
        )
        cfg = launch.config
        try:
            client = ControlClient(cfg.driver_host, cfg.driver_port, cfg.key, cfg.cluster_id, connect_timeout_s=2.0)
            client.call(_msg.Status(executor_id=r.executor_id, state=NodeState.FAILED, failure=failure), timeout_s=5.0, retry=False)
            client.close()
        except (OSError, ControlProtocolError, DeadlineExceededError):
            pass
        return 1
    return 0 if code == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())  # process entry point, not library code
