"""The control host of a Spark Connect cluster: ``python -m tfos._connect.control_host`` (executor host).

Under Spark Connect the driver program is a remote client that executors may not reach, so
the control plane cannot live in the client. The first task of the barrier start stage
spawns this small process on its executor host. It runs what the driver runs in the
classic path, unchanged: a :class:`~tfos._control.server.ControlServer` (same authenticated
frames, same key) in front of the same :class:`~tfos._control.host.ClusterHost` (the
control-plane core: registry, heartbeats, failures, directives, feed ledger). Node supervisors and TF processes talk to it exactly as
they talk to the classic driver.

The client reaches it only through Spark jobs: each client operation is a one-task job whose
task dials this process (executors reach each other) and returns the JSON answer as a row.
The extra ``client_*`` messages served here are:

* ``client_wait``: optionally a control action first, then long-poll (up to
  :data:`MAX_POLL_S`) until a condition holds; answers the cluster status (states, exit
  codes, failures with tracebacks, TensorBoard URL);
* ``client_control``: close the feed, direct the nodes to stop, or abort them;
* ``client_teardown``: stop or abort the nodes, wait for their exit, then release;
* ``client_release``: the client is done; the process exits once every node exited.

Lifetime: it ends itself (after aborting the nodes and waiting, bounded, for their exit)
when the executor JVM it belongs to exits, when the client released it, or when no client
operation reached it for ``client_timeout_s`` (the client program went away).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import IO, Any, Callable, Optional

from tfos._control import messages as _msg
from tfos._control.host import ClusterHost
from tfos._control.protocol import LongPoll, Reply, Topic
from tfos._node import output as _node_output
from tfos._node.start_task import read_record, setup_process_logging, write_record
from tfos.cluster_template import NodeRole
from tfos.errors import ConfigurationError, ControlProtocolError, NodeFailure

__all__ = ["HostLaunch", "ControlHost", "MAX_POLL_S", "write_host_launch", "read_host_launch"]

# Run as ``python -m``: __name__ is "__main__" there, outside the 'tfos' logger and its
# handler (its records went to stderr bare, its INFO lines nowhere); __spec__ has the real name.
log = logging.getLogger(__spec__.name if __name__ == "__main__" and __spec__ is not None else __name__)

#: Longest a ``client_wait`` request is held open, in seconds.
MAX_POLL_S = 10.0
#: Seconds to wait for the nodes' processes to exit after an abort before exiting anyway.
_EXIT_WAIT_S = 30.0
#: Seconds the process stays up after every node exited, so the client can still fetch
#: the final status (failures) after a start stage that failed.
_LINGER_S = 60.0


@dataclasses.dataclass(frozen=True)
class HostLaunch:
    """What the start task hands the control host over its stdin pipe (never the network).

    Attributes:
        cluster_id: The cluster id.
        key: The cluster's HMAC key (32 bytes; never logged).
        roles: One role per executor id.
        host: The address to bind the control server to.
        heartbeat_timeout_s: Seconds without a supervisor heartbeat before a node is lost.
        client_timeout_s: Seconds without any client operation before the cluster is
            aborted and this process exits.
        watch_pid: The executor JVM's pid; its exit ends the cluster (0: no watch).
    """

    cluster_id: str
    key: bytes = dataclasses.field(repr=False)
    roles: tuple[NodeRole, ...]
    host: str
    heartbeat_timeout_s: float
    client_timeout_s: float
    watch_pid: int

    def __post_init__(self) -> None:
        if len(self.key) != 32:
            raise ConfigurationError("the cluster key must be 32 bytes")
        if self.client_timeout_s <= 0 or self.heartbeat_timeout_s <= 0:
            raise ConfigurationError("client_timeout_s and heartbeat_timeout_s must be > 0 seconds")


def write_host_launch(stream: IO[bytes], launch: HostLaunch) -> None:
    """Writes the launch record to the control host's stdin pipe (start task side)."""
    write_record(stream, launch)


def read_host_launch(stream: IO[bytes]) -> HostLaunch:
    """Reads the record written by :func:`write_host_launch` (control host process).

    Raises:
        EOFError: When the pipe closed before a full :class:`HostLaunch` record arrived.
    """
    return read_record(stream, HostLaunch)


class ControlHost:
    """The control plane of one Connect cluster (runs in the control host process): the
    same :class:`~tfos._control.host.ClusterHost` the classic driver runs, with the
    client's requests as extra routes and this process's lifetime.

    Args:
        launch: The :class:`HostLaunch` record.
    """

    def __init__(self, launch: HostLaunch):
        self.launch = launch
        self.host = ClusterHost(launch.cluster_id, launch.roles, launch.heartbeat_timeout_s,
                                on_failure=self._on_failure, on_lines=_node_output.emit)
        self.released = threading.Event()
        self.exit_asap = threading.Event()
        self._last_client = time.monotonic()
        for msg_type, handler, offload in (
            (_msg.ClientWait, self._on_client_wait, False), (_msg.ClientControl, self._on_client_control, False),
            (_msg.ClientTeardown, self._on_client_teardown, True), (_msg.ClientReturned, self._on_client_returned, True),
            (_msg.ClientRelease, self._on_client_release, False),
        ):
            self.host.route(msg_type, self._client(handler), offload)
        self.server = self.host.serve(launch.key, launch.host)

    def _on_failure(self, failure: NodeFailure) -> None:
        # The cluster cannot recover: every node is told to stop now (the classic driver
        # also cancels its Spark jobs; here the feed tasks fail when their nodes go away).
        self.host.abort(f"node {failure.node_name} failed")

    def _client(self, handler: Callable[[Any], Reply]) -> Callable[[Any], Reply]:
        def call(msg: Any) -> Reply:
            self._last_client = time.monotonic()
            return handler(msg)
        return call

    def _dispatch(self, body: dict, peer: str) -> dict:
        """Answers one request in this thread (a long-poll is waited for here)."""
        try:
            return self.host.resolve(self.host.prepare(body, peer).run())
        except (KeyError, TypeError, ValueError) as exc:
            raise ControlProtocolError(f"malformed {str(body.get('type'))!r} message: {exc!r}") from None

    def _on_client_wait(self, msg: _msg.ClientWait) -> LongPoll:
        if msg.action:
            self._client_control(msg.action, msg.reason)
        return self._client_wait_poll(msg.until, msg.poll_s)

    def _on_client_control(self, msg: _msg.ClientControl) -> dict:
        if msg.action == "close_feed_when_sent":
            self.host.close_feed_when_sent(msg.feed_id, msg.total)
            return {"ok": True}
        return self._client_control(msg.action, msg.reason)

    def _on_client_returned(self, msg: _msg.ClientReturned) -> dict:
        wait_s = max(0.0, min(msg.wait_s, MAX_POLL_S))
        return {"names": self.host.returned_without_terminate(list(msg.executors), msg.qname, wait_s)}

    def _on_client_release(self, msg: _msg.ClientRelease) -> dict:
        self.released.set()
        return {"ok": True}

    def _condition(self, until: str) -> bool:
        core = self.host.core
        if until == _msg.WaitUntil.ALL_REGISTERED:
            return core.all_registered()
        if until == _msg.WaitUntil.WORKERS_DONE:
            return core.workers_done()
        if until == _msg.WaitUntil.ALL_EXITED:
            return core.all_exited()
        if until == _msg.WaitUntil.CLUSTER_FAILED:
            return core.failed
        if until == _msg.WaitUntil.TENSORBOARD:
            return core.tensorboard_url is not None or bool(core.tensorboard_error)
        if until == _msg.WaitUntil.NOW:
            return True
        raise ValueError(f"unknown wait condition {until!r}")

    def _client_wait_poll(self, until: str, poll_s: float) -> LongPoll:
        """The deferred answer of a client wait: the status once ``until`` holds (ALL_EXITED
        is awaited after a failure too; any other wait ends at a failure), else at the end
        of ``poll_s`` (at most :data:`MAX_POLL_S`).

        Raises:
            ValueError: An unknown condition.
        """
        self._condition(until)

        def ready() -> Optional[dict]:
            if self._condition(until) or (self.host.core.failed and until != _msg.WaitUntil.ALL_EXITED):
                return self.status(done=self._condition(until))
            return None

        return LongPoll((Topic.ANY,), self.host.locked(ready), max(0.0, min(poll_s, MAX_POLL_S)),
                        self.host.locked(lambda: self.status(done=self._condition(until))))

    def status(self, done: bool) -> dict:
        """The cluster status for the client: ``done`` and the core's status."""
        return {"done": done, **self.host.read(lambda c: c.status())}

    def _on_client_teardown(self, msg: _msg.ClientTeardown) -> dict:
        """Stops (or aborts) every node and waits for their exit, in one request.

        With ``abort``, first waits up to ``attribution_s`` for a failure report (a failed
        Spark job usually precedes the failed node's own report by a moment). Releases
        this process once every node exited, or at once with ``release``. The answer also
        says what the nodes got done, for a restart: rows consumed, checkpoint reports, and
        the partitions of feed ``feed_id`` the nodes acknowledged.
        """
        host = self.host
        if msg.abort and msg.attribution_s > 0:
            host.wait_for_failure(msg.attribution_s)
        host.stop_nodes(msg.abort, "the cluster failed" if msg.abort else "", msg.poll_s, warn=False)
        status = self.status(done=self.host.read(lambda c: c.all_exited()))
        if status["done"] or msg.release:
            self.released.set()
        status.update(host.read(lambda c: {
            "rows_consumed": c.rows_consumed(), "checkpoints": c.checkpoints(),
            "partitions_done": sorted(c.ledger.partitions_done(msg.feed_id)) if msg.feed_id else [],
        }))
        return status

    def _client_control(self, action: str, reason: str) -> dict:
        host = self.host
        if action == "close_feed":
            host.close_feed()
        elif action == "stop":
            host.request_stop()
        elif action == "abort":
            host.abort(reason or "the client aborted the cluster")
        elif action == "clear_checkpoints":  # a train() call starts: earlier reports do not count
            host.clear_checkpoints()
        elif action == "abort_and_exit":
            # The start stage failed: nobody will release this process.
            host.abort(reason or "the start stage failed")
            self.exit_asap.set()
        else:
            raise ValueError(f"unknown action {action!r}")
        return {"ok": True}

    # --------------------------------------------------------------- lifetime
    def serve(self) -> int:
        """Serves until released (and every node exited) or a reason to end; returns 0.
        (Liveness runs in the host's own thread, as in the driver.)"""
        from tfos._node.supervisor import _Watch

        jvm = _Watch(self.launch.watch_pid)
        exited_since: Optional[float] = None
        why = ""
        while True:
            # The watch tick: a JVM exit and a silent client raise no event to wait on.
            time.sleep(0.5)
            now = time.monotonic()
            if not jvm.alive():
                why = f"the executor JVM ({jvm.describe()}) exited"
                break
            if now - self._last_client > self.launch.client_timeout_s:
                why = f"no client operation for {self.launch.client_timeout_s:g} s (the client program went away?)"
                break
            all_exited, aborted, empty = self.host.read(lambda c: (c.all_exited(), bool(c.abort_reason), not c.nodes))
            if self.released.is_set() and (all_exited or aborted or empty):
                # Released by the client: it fetched everything it needs.
                if all_exited or exited_since is not None and now - exited_since > _EXIT_WAIT_S:
                    break
                exited_since = exited_since or now
            if self.exit_asap.is_set():
                exited_since = exited_since or now
                if (all_exited and now - exited_since > 5.0) or now - exited_since > _LINGER_S:
                    break
        if why:
            log.warning("tfos control host of %s: %s; aborting the cluster", self.launch.cluster_id, why)
            self.host.stop_nodes(True, why, _EXIT_WAIT_S)
        self.host.close()
        return 0


def main() -> int:
    """Entry point of ``python -m tfos._connect.control_host``.

    Reads the :class:`HostLaunch` record from stdin, binds the control server, writes
    ``{"host": ..., "port": ...}`` as one JSON line to stdout for the start task, then
    serves until the cluster ends.
    """
    setup_process_logging()
    launch = read_host_launch(sys.stdin.buffer)
    if launch.watch_pid:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # the JVM watch decides
    try:
        host = ControlHost(launch)
    except BaseException as exc:  # noqa: BLE001 - reported to the start task on stdout
        sys.stdout.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n")
        sys.stdout.flush()
        return 1
    sys.stdout.write(json.dumps({"host": str(host.server.host), "port": int(host.server.port), "pid": os.getpid()}) + "\n")
    sys.stdout.flush()
    return host.serve()


if __name__ == "__main__":
    # Run main() of the imported module, not of __main__: the launch record unpickles
    # as tfos._connect.control_host.HostLaunch, which must be the class main() checks against.
    from tfos._connect.control_host import main as _main

    raise SystemExit(_main())  # process entry point, not library code
