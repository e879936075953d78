#!/usr/bin/env python
"""Cluster simulator: thousands of nodes against the real driver side of tfos.

The driver side is real: a :class:`tfos._driver.runtime.ClusterRuntime` (its
:class:`~tfos._control.host.ClusterHost` and its core, its :class:`~tfos._control.server.ControlServer`,
its liveness thread, its failure handling and teardown) with only the SparkContext faked.
The nodes are simulated: a few node processes, each running many nodes on one asyncio loop.
Every simulated node speaks the real control protocol with the real key handling
(:mod:`tfos._control.protocol`: the same frame reader, sessions, nonces and sequence
numbers as :class:`tfos._control.client.ControlClient`; :mod:`tfos._control.messages`):
like a real node its Spark start task asks for the node's state every
:func:`tfos._control.limits.start_poll_s` until the node
registered (on a connection of its own, closed then), and it holds one connection for its supervisor (heartbeats every
:func:`tfos._control.limits.heartbeat_interval_s`, reports of its exit) and one for its TF
process (register, await the cluster spec, report running, long-poll for directives every
:func:`tfos._control.limits.event_poll_s` with its row counter, report a failure), and
its feed task a third (claim partitions, report them sent and consumed).

For each cluster size it measures:

* ``registered_s``: from the nodes' start until the driver has every node registered, and
  ``spec_s`` until every node holds the cluster spec; ``form_cpu_s`` and ``form_frames``:
  the driver's CPU seconds and the requests it answered until every node registered, and
  ``nodes_cpu_s`` the node processes' CPU seconds meanwhile;
* ``cpu_pct``: the driver process's CPU time per second of wall time while only heartbeats
  and directive polls flow (a steady cluster), in percent of one core;
* ``frames_s``: control requests per second the driver answered in that window;
* ``threads`` and ``rss_mib`` of the driver process, ``conns`` (peak connections),
  ``refused`` (connections refused or evicted by a cap, and rejected frames),
  ``listen_overflows`` (connections the kernel dropped because a listener's accept queue
  was full: counted for the whole network namespace, so other programs' listeners too);
* ``feed_s``: time for every node's feed task to claim, hand over and acknowledge its
  partitions (counts checked exactly: every partition granted once, the feed closed);
* ``exception_s`` / ``silence_s`` / ``drop_s``: from the moment one node fails (reports an
  exception; goes silent with its connections open; drops its connections without a word)
  until the driver's ``train()`` raises the ClusterFailedError naming it, while the other
  nodes heartbeat, poll and feed. Each failure kind runs in a fresh cluster;
* ``hb_stale_s``: the longest time since a live node's last heartbeat (or its registration)
  that the driver's cluster state held before the failure (sampled every 0.5 s): the
  margin healthy nodes keep against ``heartbeat_timeout``; ``hb_gap_s``: the longest gap
  between two heartbeats one simulated node sent, and ``hb_rtt_s`` the slowest answer to
  one (the nodes' side: a gap with fast answers means the node processes lagged).

Usage::

    python scripts/sim_cluster.py                       # N = 10, 100, 500, 2000
    python scripts/sim_cluster.py --nodes 2000 --repeat 3 --heartbeat-timeout 15
    python scripts/sim_cluster.py --nodes 2000 --kinds exception --tf-startup-s 5   # start tasks poll 2.5-7.5 s
    nice -n 10 python scripts/sim_cluster.py --json out.json

Figures and how they were taken: docs/performance.md "Scale".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import random
import resource
import statistics
import subprocess
import sys
import threading
import time
import uuid
from typing import Any, Optional

import psutil

from tfos._common import wire as _wire
from tfos._common.deadline import Deadline
from tfos._control import messages as _msg
from tfos._control.limits import event_poll_s, heartbeat_interval_s, start_poll_s
from tfos._control.protocol import ClientSession, FrameReader, client_proof
from tfos._driver.runtime import ClusterRuntime
from tfos.cluster_template import NodeInfo, build_template, roles_from_template
from tfos.errors import ClusterFailedError, NodeFailure, TFOSError

FAILURE_KINDS = ("exception", "silence", "drop")


# =============================================================== simulated nodes
class SimConnection:
    """One control connection of a simulated node process (asyncio), multiplexed as the real
    client is: requests go out at once, answers are matched by sequence number."""

    def __init__(self, host: str, port: int, key: bytes, cluster_id: str):
        self.addr = (host, port)
        self.key, self.cluster_id = key, cluster_id
        self.waiting: dict[int, asyncio.Future] = {}
        self.writer: Optional[asyncio.StreamWriter] = None
        self.task: Optional[asyncio.Task] = None
        self.broken = True
        self.closed = False

    async def open(self, deadline: float) -> None:
        while True:
            if self.closed:
                raise ConnectionError("the node stopped")
            writer = None
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_connection(*self.addr), max(0.1, deadline - time.monotonic()))
                writer.write(client_proof(self.key))  # first, as the real client
                frames = FrameReader(self.key, _wire.MAX_FIRST_FRAME_BYTES)
                hello = None
                while hello is None:
                    data = await asyncio.wait_for(reader.read(65536), 20.0)
                    if not data:
                        raise ConnectionError("closed before the hello")
                    frames.feed(data)
                    hello = frames.next()
                frames.max_bytes = _wire.MAX_CONTROL_FRAME_BYTES
                self.session = ClientSession(self.key, self.cluster_id, hello)
                if self.closed:  # the node stopped meanwhile
                    writer.close()
                    raise ConnectionError("the node stopped")
                self.writer, self.broken = writer, False
                self.task = asyncio.ensure_future(self._read_loop(reader, frames))
                return
            except (OSError, asyncio.TimeoutError):
                if writer is not None:
                    writer.close()
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2 + random.random() * 0.3)
            except BaseException:  # cancelled (the node stopped): no half-open connection is left
                if writer is not None:
                    writer.close()
                raise

    async def _read_loop(self, reader: asyncio.StreamReader, frames: FrameReader) -> None:
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                frames.feed(data)
                while (body := frames.next()) is not None:
                    fut = self.waiting.pop(self.session.answers(body), None)
                    if fut is not None and not fut.done():
                        fut.set_result(body)
        except (OSError, asyncio.CancelledError):
            pass
        self.broken = True
        for fut in self.waiting.values():
            if not fut.done():
                fut.set_exception(ConnectionError("control connection closed"))
        self.waiting.clear()

    async def call(self, msg: _msg.Message, timeout_s: float, retry: bool = True) -> dict:
        """One request; as the real client, a broken connection is opened again first,
        and (``retry``) a request it broke under is sent once more."""
        for attempt in range(2 if retry else 1):
            if self.closed:
                raise ConnectionError("the node stopped")
            if self.broken:
                await self.open(time.monotonic() + 30.0)
            assert self.writer is not None
            frames = self.session.encode(msg.TYPE, msg.fields())
            fut = asyncio.get_running_loop().create_future()
            self.waiting[frames[-1][0]] = fut
            try:
                self.writer.write(b"".join(f for _, f, _ in frames))
                await self.writer.drain()
                return await asyncio.wait_for(fut, timeout_s)
            except ConnectionError:
                self.broken = True
                if attempt or not retry:
                    raise
        raise AssertionError("unreachable")

    def close(self, hard: bool = True) -> None:
        self.closed = True
        if self.task is not None:
            self.task.cancel()
        if self.writer is not None and hard:
            self.writer.close()


class SimNode:
    """One node: its Spark start task's connection (until the node registered), its
    supervisor's and its TF process's connections, its feed task's."""

    def __init__(self, cfg: dict, eid: int, worker: "NodeWorker"):
        self.cfg, self.eid, self.worker = cfg, eid, worker
        self.role = worker.roles[eid]
        self.name = f"{self.role.job_name}:{self.role.task_index} (executor {eid}, host 127.0.0.1)"
        self.alive = True
        self.rows = 0
        self.tasks: list[asyncio.Task] = []
        self.sup = SimConnection("127.0.0.1", cfg["port"], worker.key, cfg["cluster_id"])
        self.tf = SimConnection("127.0.0.1", cfg["port"], worker.key, cfg["cluster_id"])
        self.feed: Optional[SimConnection] = None
        self.start: Optional[SimConnection] = None

    def spawn(self, coro: Any) -> None:
        self.tasks.append(asyncio.ensure_future(coro))

    async def run(self) -> None:
        deadline = time.monotonic() + 120.0
        self.spawn(self.start_task())
        self.spawn(self.heartbeats())
        if self.cfg["tf_startup_s"]:  # the TF process starts (Python, TensorFlow's import) before it registers
            await asyncio.sleep(self.cfg["tf_startup_s"] * random.uniform(0.5, 1.5))
        await self.tf.open(deadline)
        node = NodeInfo(self.eid, self.role.job_name, self.role.task_index, "127.0.0.1", 20000 + self.eid,
                        30000 + self.eid, os.getpid(), f"127.0.0.1/{self.eid}")
        r = await self.tf.call(_msg.Register(node), 30.0)
        if not r.get("ok"):
            return
        while True:
            r = await self.tf.call(_msg.AwaitCluster(executor_id=self.eid, poll_s=5.0), 30.0)
            if r.get("abort"):
                return
            if r.get("ready"):
                break
        spec = r["cluster_spec"]
        assert sum(len(v) for v in spec.values()) == self.cfg["num_nodes"]
        self.worker.formed(self.eid)
        await self.tf.call(_msg.Status(self.eid, _msg.NodeState.RUNNING), 10.0)
        self.spawn(self.events())

    async def start_task(self) -> None:
        """The node's Spark start task (InputMode.SPARK), as ``_await_registration`` of
        tfos._node.start_task: from the supervisor's start until the node registered, it
        asks the driver for the node's state every :func:`start_poll_s`, on a connection of its
        own, which it then closes."""
        self.start = SimConnection("127.0.0.1", self.cfg["port"], self.worker.key, self.cfg["cluster_id"])
        try:
            while self.alive:
                r = await self.start.call(_msg.NodeStateQuery(self.eid), 10.0)
                if r.get("state") not in (None, "pending") or r.get("cluster_failed"):
                    return
                await asyncio.sleep(start_poll_s(self.cfg["num_nodes"]))
        finally:
            self.start.close()

    async def heartbeats(self) -> None:
        interval = self.cfg["hb_interval_s"]
        await asyncio.sleep(random.random() * interval)  # the nodes' heartbeats spread over an interval
        await self.sup.open(time.monotonic() + 120.0)  # as a real client, connected by its first request
        # As the real supervisor's loop: it checks its TF process every tick (1 s, or the
        # interval when shorter) and sends a heartbeat at the first tick at least
        # ``interval`` after the previous one went out; a slow answer delays the next by a tick.
        tick = min(1.0, interval)
        last = 0.0
        while self.alive:
            sent = time.monotonic()
            d = await self.sup.call(_msg.Heartbeat(self.eid, pid=os.getpid(), host="127.0.0.1", rss=200 << 20), 10.0)
            answered = time.monotonic()
            self.worker.heartbeat_sent(sent, last, answered - sent)
            last = sent
            if d.get("abort") or d.get("stop"):
                await self.end(-15)
                return
            await asyncio.sleep(tick * max(1, math.ceil((sent + interval - answered) / tick - 1e-9)))

    async def events(self) -> None:
        known: dict = {}
        poll_s = self.cfg["poll_s"]
        while self.alive:
            d = await self.tf.call(_msg.WaitEvent(self.eid, known, self.figures(), poll_s), poll_s + 14.0)
            if d.get("abort") or d.get("stop"):
                await self.end(-15)
                return
            known = {k: d.get(k) for k in ("stop", "feed_closed", "abort", "failed", "stack", "report")}

    def figures(self) -> dict:
        """What a real TF process sends with each poll (tfos._data.figures.live_snapshot, a
        Keras counter included): the same keys, plausible values."""
        if not self.cfg.get("status", True):
            return {"rows": self.rows}  # the payload before the driver kept status figures
        now = int(time.monotonic() * 1000)
        return {"rows": self.rows, "clock_ms": now, "cpu_ms": int(time.process_time() * 1000), "feed_wait_ms": now // 3,
                "feed_wait_since_ms": 0, "queue_chunks": 2, "queue_capacity": 4, "keras_steps": self.rows // 32}

    async def end(self, code: int) -> None:
        """The node's processes end (stopped or aborted by the driver): the supervisor
        reports the exit code, as a real one does."""
        if not self.alive:
            return
        self.alive = False
        try:
            await self.sup.call(_msg.Status(self.eid, _msg.NodeState.EXITED, code=code), 10.0)
        except (OSError, asyncio.TimeoutError):
            pass
        self.stop(hard=True)

    def stop(self, hard: bool) -> None:
        self.alive = False
        current = asyncio.current_task()
        for t in self.tasks:
            if t is not current:
                t.cancel()
        for conn in (self.start, self.sup, self.tf, self.feed):
            if conn is not None:
                conn.close(hard)

    async def claim(self, feed_id: str, indices: list[int], trickle_s: float = 0.0) -> tuple[int, int]:
        """The node's feed task: claims, hands over and acknowledges each partition."""
        if not self.alive:  # stopped before its feed task began: it opens no connection
            return 0, 0
        if self.feed is None:
            self.feed = SimConnection("127.0.0.1", self.cfg["port"], self.worker.key, self.cfg["cluster_id"])
            await self.feed.open(time.monotonic() + 60.0)
        granted = refused = 0
        for i in indices:
            if not self.alive:
                break
            r = await self.feed.call(_msg.ClaimPartition(feed_id, i, self.name, uuid.uuid4().hex), 30.0)
            if not r.get("granted"):
                refused += 1
                continue
            granted += 1
            await self.feed.call(_msg.PartitionSent(feed_id, i), 30.0)
            self.rows += 100
            await self.feed.call(_msg.PartitionDone(feed_id, i), 30.0)
            if trickle_s:
                await asyncio.sleep(trickle_s)
        return granted, refused

    async def inject(self, kind: str) -> float:
        """Fails this node the way ``kind`` says; returns the monotonic time it did."""
        t = time.monotonic()
        if kind == "exception":
            failure = NodeFailure(self.eid, self.role.job_name, self.role.task_index, "127.0.0.1", "exception",
                                  "SimulatedError", "main_fun raised (simulated)", "Traceback: simulated")
            await self.tf.call(_msg.Status(self.eid, _msg.NodeState.FAILED, failure=failure), 10.0)
            await self.end(1)
        elif kind == "silence":
            self.stop(hard=False)  # nothing more is sent; the connections stay open
        elif kind == "drop":
            self.stop(hard=True)  # connections closed without a word
        else:
            raise ValueError(kind)
        return t


class NodeWorker:
    """A node process: many simulated nodes on one event loop, driven over stdin/stdout."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.nodes: dict[int, SimNode] = {}
        self.key = b""
        self.roles: list = []
        self.expected = 0
        self.formed_count = 0
        self.first_formed = self.last_formed = 0.0
        self.out_lock = threading.Lock()
        self.hb_gap = self.hb_rtt = 0.0  # the longest gap between two heartbeats of a node, the slowest answer

    def heartbeat_sent(self, sent: float, previous: float, rtt: float) -> None:
        if previous:
            self.hb_gap = max(self.hb_gap, sent - previous)
        self.hb_rtt = max(self.hb_rtt, rtt)

    def send(self, **event: Any) -> None:
        with self.out_lock:
            sys.stdout.write(json.dumps(event) + "\n")
            sys.stdout.flush()

    def formed(self, eid: int) -> None:
        now = time.monotonic()
        self.formed_count += 1
        self.first_formed = self.first_formed or now
        self.last_formed = now
        if self.formed_count == self.expected:
            self.send(ev="formed", count=self.formed_count, first=self.first_formed, last=self.last_formed)

    async def _guard(self, coro: Any, eid: int) -> None:
        try:
            await coro
        except (OSError, asyncio.TimeoutError, asyncio.CancelledError):
            pass
        except Exception as exc:  # noqa: BLE001 - a simulator bug is reported, not hidden
            self.send(ev="error", eid=eid, error=f"{type(exc).__name__}: {exc}")

    async def handle(self, cmd: dict) -> None:
        try:
            await self._handle(cmd)
        except Exception as exc:  # noqa: BLE001 - a simulator bug is reported, not hidden
            self.send(ev="error", cmd=cmd.get("cmd"), error=f"{type(exc).__name__}: {exc}")

    async def _handle(self, cmd: dict) -> None:
        what = cmd["cmd"]
        if what == "start":
            for node in self.nodes.values():
                node.stop(hard=True)
            self.key = bytes.fromhex(cmd["key"])
            self.roles = roles_from_template(build_template(cmd["num_nodes"], 0))
            self.nodes = {eid: SimNode(cmd, eid, self) for eid in cmd["nodes"]}
            self.expected, self.formed_count, self.first_formed = len(self.nodes), 0, 0.0
            self.hb_gap = self.hb_rtt = 0.0
            for eid, node in self.nodes.items():
                asyncio.ensure_future(self._guard(node.run(), eid))
        elif what == "feed":
            per = cmd["per_node"]
            n = cmd["num_nodes"]
            results = await asyncio.gather(*(
                node.claim(cmd["feed_id"], [eid + k * n for k in range(per)], cmd.get("trickle_s", 0.0))
                for eid, node in self.nodes.items()), return_exceptions=True)
            ok = [r for r in results if isinstance(r, tuple)]
            if cmd.get("report", True):
                self.send(ev="fed", granted=sum(g for g, _ in ok), refused=sum(r for _, r in ok),
                          errors=sum(1 for r in results if not isinstance(r, tuple)), t=time.monotonic())
        elif what == "inject":
            t = await self.nodes[cmd["eid"]].inject(cmd["kind"])
            self.send(ev="injected", eid=cmd["eid"], kind=cmd["kind"], t=t)
        elif what == "stop":
            for node in self.nodes.values():
                node.stop(hard=True)
            self.nodes = {}
            self.send(ev="stopped", hb_gap=self.hb_gap, hb_rtt=self.hb_rtt)
        elif what == "exit":
            self.loop.stop()

    def main(self) -> None:
        def read_commands() -> None:
            for line in sys.stdin:
                cmd = json.loads(line)
                self.loop.call_soon_threadsafe(lambda c=cmd: asyncio.ensure_future(self.handle(c)))
            self.loop.call_soon_threadsafe(self.loop.stop)

        threading.Thread(target=read_commands, daemon=True).start()
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()


# ================================================================ driver side
class _Tracker:
    def getJobIdsForGroup(self, group: str) -> list:
        return [1]

    def getJobInfo(self, job_id: int) -> None:
        return None


class _Conf:
    def get(self, key: str, default: Any = None) -> Any:
        return default


class FakeSparkContext:
    """The Spark parts the runtime calls: job groups, their cancellation, the conf."""

    master = "sim"

    def __init__(self) -> None:
        self.cancelled: dict[str, threading.Event] = {}

    def setJobGroup(self, group: str, description: str, interruptOnCancel: bool = False) -> None:
        threading.current_thread().sim_group = group  # type: ignore[attr-defined]

    def cancelJobGroup(self, group: str) -> None:
        self.cancelled.setdefault(group, threading.Event()).set()

    def statusTracker(self) -> _Tracker:
        return _Tracker()

    def getConf(self) -> _Conf:
        return _Conf()


class Workers:
    """The node processes of one run and their events."""

    def __init__(self, procs: int):
        self.procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--node-worker"], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True, bufsize=1) for _ in range(procs)]
        self.events: list[dict] = []
        self.cond = threading.Condition()
        for p in self.procs:
            threading.Thread(target=self._read, args=(p,), name="sim-reader", daemon=True).start()

    def _read(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            ev = json.loads(line)
            if ev.get("ev") == "error":
                print(f"  node error: {ev}", file=sys.stderr)
            with self.cond:
                self.events.append(ev)
                self.cond.notify_all()

    def cpu_s(self) -> float:
        """CPU seconds the node processes used so far."""
        total = 0.0
        for p in self.procs:
            try:
                t = psutil.Process(p.pid).cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        return total

    def send(self, i: int, **cmd: Any) -> None:
        stdin = self.procs[i].stdin
        assert stdin is not None
        stdin.write(json.dumps(cmd) + "\n")
        stdin.flush()

    def wait(self, kind: str, count: int, timeout_s: float) -> list[dict]:
        deadline = Deadline(timeout_s, f"{count} '{kind}' events of the node processes")
        with self.cond:
            while True:
                got = [e for e in self.events if e.get("ev") == kind]
                if len(got) >= count:
                    for e in got:
                        self.events.remove(e)
                    return got
                if deadline.expired():
                    raise deadline.error(extra=f"got {len(got)}")
                self.cond.wait(deadline.slice(1.0))

    def close(self) -> None:
        for i, p in enumerate(self.procs):
            try:
                self.send(i, cmd="exit")
                assert p.stdin is not None
                p.stdin.close()
            except (OSError, ValueError):
                pass
        for p in self.procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)


def _listen_overflows() -> int:
    """Connections the kernel dropped since boot because a listener's accept queue was full
    (``TcpExt ListenOverflows`` of /proc/net/netstat: every listener of this network
    namespace, not only the driver's); 0 where that file does not exist."""
    try:
        with open("/proc/net/netstat") as f:
            lines = f.read().splitlines()
    except OSError:
        return 0
    for names, values in zip(lines[::2], lines[1::2]):
        if names.startswith("TcpExt:"):
            return int(dict(zip(names.split()[1:], values.split()[1:])).get("ListenOverflows", 0))
    return 0


class _Staleness:
    """The longest time since a live node's last heartbeat, as the driver's cluster state
    holds it (what its liveness check compares with heartbeat_timeout), sampled every
    0.5 s by a thread of the simulator until :meth:`end`: the margin healthy nodes keep."""

    def __init__(self, state: Any):
        self.state, self.max_s = state, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sim-staleness", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            seen = list(self.state.last_heartbeat.values())  # set at registration, then at each heartbeat
            if seen:
                self.max_s = max(self.max_s, time.monotonic() - min(seen))

    def end(self) -> float:
        self._stop.set()
        self._thread.join(5.0)
        return self.max_s


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


#: The driver keeps status figures (its status monitor runs; nodes send a real node's figures).
STATUS = True


def run_cluster(workers: Workers, n: int, timeout_s: float, steady_s: float, kind: str, measure: bool, per_node: int = 2,
                tf_startup_s: float = 0.0) -> dict:
    """Forms one cluster of ``n`` simulated nodes against a real driver runtime; measures
    (when ``measure``) its steady state and a feed, then fails one node the way ``kind``
    says and times the driver's error. Returns the figures."""
    cluster_id = f"tfos-sim-{uuid.uuid4().hex[:8]}"
    # Threads already in this process (a test runner's, the simulator's readers) are not
    # the driver side's: count only those started from here on, plus the main thread.
    before = {t.ident for t in threading.enumerate()}
    os_before = psutil.Process().num_threads()
    key = _wire.new_key()
    roles = roles_from_template(build_template(n, 0))
    sc = FakeSparkContext()
    runtime = ClusterRuntime(sc, cluster_id, roles, timeout_s, key, "127.0.0.1")
    host, state, server = runtime.host, runtime.host.core, runtime.server
    out: dict = {"nodes": n, "hb_interval_s": heartbeat_interval_s(n, timeout_s), "poll_s": event_poll_s(n)}
    shares = [list(range(i, n, len(workers.procs))) for i in range(len(workers.procs))]
    shares = [s for s in shares if s]
    overflows0 = _listen_overflows()
    staleness = _Staleness(state)
    try:
        t0, cpu0, nodes_cpu0 = time.monotonic(), _cpu_s(), workers.cpu_s()
        for i, share in enumerate(shares):
            workers.send(i, cmd="start", cluster_id=cluster_id, port=server.port, key=key.hex(), nodes=share, num_nodes=n,
                         hb_interval_s=out["hb_interval_s"], poll_s=out["poll_s"], tf_startup_s=tf_startup_s, status=STATUS)
        outcome = ""
        deadline = Deadline(300.0, f"{n} simulated nodes to register")
        while outcome not in ("all_registered", "cluster_failed", "expired"):
            outcome = host.wait_until_registered(deadline, lambda: False)
        if outcome != "all_registered":
            raise TFOSError(f"the simulated cluster did not form: {outcome}; missing {state.missing()[:10]}")
        out["registered_s"] = time.monotonic() - t0
        if STATUS:
            runtime.start_monitor(600.0, "warn")  # as the classic launcher does once every node registered
        out["form_cpu_s"] = _cpu_s() - cpu0  # the driver's CPU seconds to register every node
        out["form_frames"] = server.stats()["frames_in"]  # the requests it answered meanwhile (start tasks' polls too)
        out["nodes_cpu_s"] = workers.cpu_s() - nodes_cpu0  # the simulated nodes' (same machine)
        formed = workers.wait("formed", len(shares), 300.0)
        out["spec_s"] = max(e["last"] for e in formed) - t0
        running = Deadline(120.0, "every node to run")
        while not all(s == _msg.NodeState.RUNNING for s in list(state.proc_state.values())):
            running.check()  # polled: a condition wait would test all N nodes at every report
            time.sleep(0.2)
        if measure:
            time.sleep(max(2.0, out["hb_interval_s"]))  # every node heartbeats and polls by now
            proc = psutil.Process()
            f0, c0, w0 = server.stats()["frames_in"], _cpu_s(), time.monotonic()
            time.sleep(steady_s)
            f1, c1, w1 = server.stats()["frames_in"], _cpu_s(), time.monotonic()
            out["cpu_pct"] = 100.0 * (c1 - c0) / (w1 - w0)
            out["frames_s"] = (f1 - f0) / (w1 - w0)
            # The driver side's threads: the main thread and those the runtime started.
            started = [t for t in threading.enumerate() if t.ident not in before and not t.name.startswith("sim-")]
            out["threads"] = 1 + len(started)
            out["os_threads"] = 1 + proc.num_threads() - os_before - 1  # not the simulator's staleness sampler
            out["rss_mib"] = proc.memory_info().rss / 2**20
            out["load"] = os.getloadavg()[0]
            # A feed: every node's feed task claims its partitions; counts checked exactly.
            feed_id, total = "sim-feed-1", n * per_node
            host.close_feed_when_sent(feed_id, total)
            t1 = time.monotonic()
            for i, _ in enumerate(shares):
                workers.send(i, cmd="feed", feed_id=feed_id, per_node=per_node, num_nodes=n)
            fed = workers.wait("fed", len(shares), 300.0)
            out["feed_s"] = max(e["t"] for e in fed) - t1
            granted = sum(e["granted"] for e in fed)
            if granted != total or any(e["refused"] or e["errors"] for e in fed) or state.ledger.partitions_done(feed_id) != set(range(total)) \
                    or not state.feed_closed:
                raise TFOSError(f"feed counts wrong: granted {granted} of {total}, {fed}")
        # A failure while the others heartbeat, poll and feed (a slow trickle of partitions).
        for i, _ in enumerate(shares):
            workers.send(i, cmd="feed", feed_id="sim-feed-busy", per_node=1000, num_nodes=n, trickle_s=2.0, report=False)
        job = runtime.run_job("train", "simulated feed", lambda: _cancelled(sc, runtime.job_group("train")))
        victim = random.randrange(1, n) if n > 1 else 0
        out["hb_stale_s"] = staleness.end()
        workers.send(victim % len(workers.procs), cmd="inject", eid=victim, kind=kind)
        injected = workers.wait("injected", 1, 60.0)[0]
        try:
            runtime.await_job(job, "train()")
            raise TFOSError("the driver raised nothing after the failure")
        except ClusterFailedError as exc:
            out[f"{kind}_s"] = time.monotonic() - injected["t"]
            out[f"{kind}_recorded_s"] = (state.first_failure_at or 0.0) - injected["t"]
            if f"(executor {victim}," not in str(exc):
                raise TFOSError(f"the driver's error does not name executor {victim}: {str(exc)[:500]}") from None
        return out
    finally:
        staleness.end()
        if not runtime.closed:
            runtime.teardown(failed=True)
        runtime.join_teardown()
        stats = server.stats()  # the whole life of the cluster, its teardown included
        out["conns"] = stats["peak_connections"]
        out["refused"] = stats["rejected"]  # every connection refused by a cap, evicted or rejected
        if stats["rejected"]:
            print(f"  {n} nodes, {kind}: rejections {stats}", file=sys.stderr)
        for i, _ in enumerate(shares):
            workers.send(i, cmd="stop")
        stopped = workers.wait("stopped", len(shares), 60.0)
        out["hb_gap_s"] = max(e["hb_gap"] for e in stopped)  # the nodes' side: longest gap between two heartbeats
        out["hb_rtt_s"] = max(e["hb_rtt"] for e in stopped)  # and the slowest answer to one
        out["listen_overflows"] = _listen_overflows() - overflows0


def _cancelled(sc: FakeSparkContext, group: str) -> None:
    """The simulated Spark job of a feed: runs until its job group is cancelled."""
    sc.cancelled.setdefault(group, threading.Event()).wait(600.0)
    raise TFOSError(f"job group {group} cancelled")


def run_size(n: int, procs: int, timeout_s: float, steady_s: float, kinds: tuple[str, ...], tf_startup_s: float = 0.0) -> dict:
    """Every measurement of one cluster size (one cluster per failure kind)."""
    workers = Workers(procs)
    try:
        merged: dict = {}
        summed = ("refused", "listen_overflows")
        peaks = ("conns", "hb_stale_s", "hb_gap_s", "hb_rtt_s")
        over: dict = {k: 0 for k in summed + peaks}
        for i, kind in enumerate(kinds):
            res = run_cluster(workers, n, timeout_s, steady_s, kind, measure=(i == 0), tf_startup_s=tf_startup_s)
            for k in summed:
                over[k] += res.pop(k)
            for k in peaks:
                over[k] = max(over[k], res.pop(k))
            merged.update(res)
        merged.update(over)  # over every cluster of this size
        return merged
    finally:
        workers.close()


COLUMNS = ("nodes", "registered_s", "form_cpu_s", "form_frames", "nodes_cpu_s", "spec_s", "hb_interval_s", "frames_s", "cpu_pct", "threads", "os_threads", "rss_mib",
           "conns", "refused", "listen_overflows", "feed_s", "exception_s", "silence_s", "drop_s", "hb_stale_s", "hb_gap_s", "hb_rtt_s",
           "load")


def _fmt(values: list) -> str:
    if not values:
        return "-"
    if all(isinstance(v, int) for v in values) or all(float(v).is_integer() for v in values):
        lo, hi = int(min(values)), int(max(values))
        return str(lo) if lo == hi else f"{lo}-{hi}"
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:.2f}"
    return f"{med:.2f} [{min(values):.2f}-{max(values):.2f}]"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[10, 100, 500, 2000])
    ap.add_argument("--procs", type=int, default=0, help="node processes (default: 1 per 250 nodes, 1 to 8)")
    ap.add_argument("--heartbeat-timeout", type=float, default=15.0, help="heartbeat_timeout of run(), seconds")
    ap.add_argument("--steady-s", type=float, default=10.0, help="seconds of steady heartbeats measured")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--tf-startup-s", type=float, default=0.0,
                    help="a TF process registers this long (x 0.5-1.5) after its node started; its start task polls meanwhile")
    ap.add_argument("--kinds", default=",".join(FAILURE_KINDS))
    ap.add_argument("--json", default="", help="also write every run's figures to this file")
    ap.add_argument("--no-status", action="store_true",
                    help="no status monitor on the driver, and only the row counter in the nodes' polls (the A/B's before)")
    ap.add_argument("--node-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.node_worker:
        NodeWorker().main()
        return 0
    logging.basicConfig(level=logging.ERROR, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("tfos._control").setLevel(logging.WARNING)  # rejected connections are shown
    kinds = tuple(k for k in args.kinds.split(",") if k)
    global STATUS
    STATUS = not args.no_status
    runs: list[dict] = []
    for n in args.nodes:
        for r in range(args.repeat):
            procs = args.procs or min(8, max(1, n // 250))
            res = run_size(n, procs, args.heartbeat_timeout, args.steady_s, kinds, args.tf_startup_s)
            res["procs"] = procs
            runs.append(res)
            print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in res.items()}), file=sys.stderr, flush=True)
    print(f"# heartbeat_timeout {args.heartbeat_timeout:g} s, steady window {args.steady_s:g} s, {args.repeat} run(s) per size: "
          "median [min-max]; load = 1-min load average of the machine during the steady window")
    print(" | ".join(COLUMNS))
    for n in args.nodes:
        rows = [r for r in runs if r["nodes"] == n]
        print(" | ".join(_fmt([r[c] for r in rows if c in r]) for c in COLUMNS))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
