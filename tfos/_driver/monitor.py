"""The driver's status monitor: live figures, the bottleneck verdict, stall detection (driver).

One thread per cluster attempt (``<cluster id>-status``) reads, once a second, the
figures the TF processes sent with their long-polls (the control core's ``counters``), the
supervisors' heartbeats and RSS, and:

- keeps each node's recent figures for :meth:`StatusMonitor.status` (``cluster.status()``)
  and its verdict (:mod:`tfos._driver.status`) every :data:`VERDICT_EVERY_S` seconds, for
  the progress line and the summary;
- warns once per stall when a node made no progress for ``stall_timeout`` seconds (no
  row, no Keras step, no CPU, main_fun outside the feed), with every thread's stack of
  its TF process and the nodes waiting on it; with ``stall_action="fail"`` it records a
  ``NodeStalled`` failure instead, which ``train()``/``shutdown()`` raise as a
  ``ClusterFailedError`` with the same text;
- with TensorBoard on, writes the figures as scalars (:mod:`tfos._driver.tb_scalars`).

docs/status.md explains the figures, the verdicts and the stall report.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Callable, Optional

from tfos._control import messages as _msg
from tfos._control.messages import NodeState
from tfos._driver import status as _status
from tfos._driver.status import Verdict
from tfos.errors import ConfigurationError

__all__ = ["StatusMonitor", "STALL_TIMEOUT_S", "STALL_ACTIONS", "check_stall_args", "summary_text"]

log = logging.getLogger(__name__)

#: ``run(stall_timeout=...)``'s default, in seconds: longer than a normal epoch's silence.
STALL_TIMEOUT_S = 600.0
#: ``run(stall_action=...)``'s values: log a WARNING, or fail the cluster.
STALL_ACTIONS = ("warn", "fail")
#: Seconds between two verdicts kept for the progress line and the summary (more in
#: clusters of over 400 nodes: one more second per 200 nodes).
VERDICT_EVERY_S = 2.0
#: Samples kept per node (at one a second: the window and some margin).
_SAMPLES_KEPT = 48
#: Longest wait, in seconds, for one node's thread stacks.
STACK_WAIT_S = 5.0
#: Stalled nodes whose stacks one stall report asks for and shows.
MAX_STACKS = 4


def check_stall_args(stall_timeout: Any, stall_action: Any) -> tuple[float, str]:
    """``run()``'s stall arguments, checked once (driver).

    Returns:
        ``(stall_timeout_s, stall_action)``; 0 turns stall detection off.

    Raises:
        ConfigurationError: A timeout that is not a finite number >= 0, or an action other
            than 'warn' or 'fail'.
    """
    ok = isinstance(stall_timeout, (int, float)) and not isinstance(stall_timeout, bool) and stall_timeout == stall_timeout
    if not ok or not 0 <= float(stall_timeout) < float("inf"):
        raise ConfigurationError(f"stall_timeout must be a finite number of seconds >= 0 (0: off), got {stall_timeout!r}")
    if stall_action not in STALL_ACTIONS:
        raise ConfigurationError(f"stall_action must be one of {', '.join(repr(a) for a in STALL_ACTIONS)}, got {stall_action!r}")
    return float(stall_timeout), str(stall_action)


class StatusMonitor:
    """Live figures, verdict and stall watch of one cluster attempt (driver).

    Args:
        host: The attempt's :class:`~tfos._control.host.ClusterHost`.
        stall_timeout_s: Seconds without progress before a node is reported (0: off).
        stall_action: 'warn' (log a WARNING) or 'fail' (record a ``NodeStalled`` failure).
        scalars: A :class:`tfos._driver.tb_scalars.ScalarWriter`, or None.
        tick_s: Seconds between two reads of the figures.
    """

    def __init__(self, host: Any, stall_timeout_s: float = STALL_TIMEOUT_S, stall_action: str = "warn",
                 scalars: Any = None, tick_s: float = 1.0) -> None:
        self.host = host
        self.state = host.core  # read without the lock: one field at a time
        self.stall_timeout_s = stall_timeout_s
        self.stall_action = stall_action
        self.scalars = scalars
        self.tick_s = tick_s
        self.started = time.monotonic()
        self._lock = threading.Lock()
        self._samples: dict[int, collections.deque] = {}
        self._seen: dict[int, int] = {}  # executor id -> clock_ms of its last sample
        self._first: dict[int, dict] = {}  # executor id -> its first sample (the summary's base)
        self._progress: dict[int, tuple] = {}  # executor id -> (rows, steps) last seen
        self._progress_at: dict[int, float] = {}  # executor id -> driver time of the last progress
        self._rows_at: dict[int, float] = {}  # executor id -> driver time rows last grew
        self._reported: set[int] = set()  # nodes whose current stall was reported
        self._verdict: tuple[Verdict, list[str], str] = (Verdict.NONE, [], "no figures yet")
        self._verdict_at = 0.0
        self._verdict_every_s = max(VERDICT_EVERY_S, len(self.state.roles) / 200.0)
        self._held: dict[Verdict, float] = {}  # verdict -> seconds it held
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        #: The last stall report's text ('' before any).
        self.last_stall = ""
        #: True while a train() or inference() job runs (set by the runtime): a node
        #: waiting for rows while none runs waits for the driver, not for a producer.
        self.feeding: Callable[[], bool] = lambda: True

    # --------------------------------------------------------------- thread
    def start(self) -> "StatusMonitor":
        """Starts the monitor's thread."""
        self._thread = threading.Thread(target=self._run, name=f"{self.state.cluster_id}-status", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops the thread after a last read (the summary then holds the final figures)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5.0)
        self.tick()
        if self.scalars is not None:
            self.scalars.write(self, [r.executor_id for r in self.state.roles], force=True)
            self.scalars.close()

    def _run(self) -> None:
        while not self._stop.wait(self.tick_s):
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - a bug here must not end the watch
                log.exception("tfos status monitor of %s", self.state.cluster_id)

    # ----------------------------------------------------------------- read
    def tick(self, now: Optional[float] = None) -> None:
        """Reads the nodes' figures once; judges, watches for stalls, writes scalars."""
        now = time.monotonic() if now is None else now
        counters = dict(self.state.counters)
        fresh = []
        with self._lock:
            for eid, figures in counters.items():
                clock = figures.get("clock_ms")
                if clock is None or clock == self._seen.get(eid):
                    continue
                self._seen[eid] = clock
                samples = self._samples.setdefault(eid, collections.deque(maxlen=_SAMPLES_KEPT))
                samples.append(figures)
                self._first.setdefault(eid, figures)
                fresh.append(eid)
                mark = _status.progress_mark(samples)
                if mark != self._progress.get(eid):
                    if eid in self._progress and mark[0] != self._progress[eid][0]:
                        self._rows_at[eid] = now
                    self._progress[eid] = mark
                    self._progress_at[eid] = now
                    self._reported.discard(eid)
                elif not _status.idle(samples):
                    # CPU alone delays a stall report, but does not re-arm one already made:
                    # answering the driver's stack request costs the stuck node CPU too
                    self._progress_at[eid] = now
                self._progress_at.setdefault(eid, now)
            if now - self._verdict_at >= self._verdict_every_s:
                if self._verdict_at:
                    self._held[self._verdict[0]] = self._held.get(self._verdict[0], 0.0) + now - self._verdict_at
                self._verdict = self._judge()
                self._verdict_at = now
        if self.scalars is not None and fresh:
            self.scalars.write(self, fresh)
        if self.stall_timeout_s > 0:
            self._watch_stalls(now)

    def _samples_of(self, eid: int) -> list:
        with self._lock:
            return list(self._samples.get(eid, ()))

    def window(self, eid: int) -> Optional[_status.NodeWindow]:
        """Node ``eid``'s current window (None before enough figures came)."""
        return _status.window_of(self._samples_of(eid))

    def _fed_windows(self) -> dict[str, _status.NodeWindow]:
        out = {}
        for r in self.state.roles:
            if not r.feedable or self.state.proc_state.get(r.executor_id) != NodeState.RUNNING:
                continue
            w = _status.window_of(list(self._samples.get(r.executor_id, ())))
            if w is not None:
                out[self.state.node_name(r.executor_id).split(" ")[0]] = w
        return out

    def _judge(self) -> tuple[Verdict, list[str], str]:
        windows = self._fed_windows()
        if not self.feeding():  # only nodes that took rows in the window (a stream's micro-batches)
            windows = {n: w for n, w in windows.items() if w.rows_per_s > 0}
            if not windows:
                return Verdict.NONE, [], "no train() or inference() job is running"
        return _status.judge(windows)

    @property
    def verdict(self) -> tuple[Verdict, list[str], str]:
        """The last verdict kept (updated every :data:`VERDICT_EVERY_S` s)."""
        with self._lock:
            return self._verdict

    def mark(self) -> str:
        """The verdict in a few characters for the progress line: '' for none, else e.g.
        ``producer`` or ``skew: worker:1`` (one node named)."""
        kind, named, _ = self.verdict
        if kind is Verdict.NONE:
            return ""
        return f"{kind.value}: {named[0]}" if len(named) == 1 else kind.value

    def held(self) -> dict[str, float]:
        """Seconds each verdict held so far."""
        with self._lock:
            held = dict(self._held)
            if self._verdict_at:
                held[self._verdict[0]] = held.get(self._verdict[0], 0.0) + time.monotonic() - self._verdict_at
        return {v.value: round(s, 1) for v, s in held.items()}

    # ---------------------------------------------------------------- stalls
    def _candidates(self) -> list[int]:
        """Nodes whose main_fun runs and can stall (ps and evaluator nodes wait by design)."""
        return [r.executor_id for r in self.state.roles
                if not r.is_background and self.state.proc_state.get(r.executor_id) == NodeState.RUNNING]

    def _watch_stalls(self, now: float) -> None:
        with self._lock:
            running = self._candidates()
            stalled = [e for e in running if e not in self._reported and e in self._progress_at
                       and now - self._progress_at[e] >= self.stall_timeout_s]
            if not stalled:
                return
            # the nodes without progress that waited at least a few seconds: one report for
            # them all, not one more per node as each reaches stall_timeout
            quiet = [e for e in running if e in self._progress_at and now - self._progress_at[e] >= min(5.0, self.stall_timeout_s)]
            self._reported.update(stalled + quiet)
        stacks = self._stacks_of(stalled[:MAX_STACKS])
        # Nodes blocked inside TensorFlow (a collective) wait for the one stuck in its own code.
        stuck = [e for e in stalled if not _status.in_tensorflow(stacks.get(e, ""))] or stalled
        text = self.stall_text(stuck, running, now, stacks)
        self.last_stall = text
        if self.stall_action == "fail":
            self.host.record_failure(self.state.make_failure(stuck[0], "stalled", "NodeStalled", text))
        else:
            log.warning("%s", text)

    def _stacks_of(self, eids: list[int]) -> dict[int, str]:
        """Every thread's stack of nodes ``eids``, asked at once."""
        if not eids:
            return {}
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=len(eids), thread_name_prefix="tfos-stacks") as pool:
            return dict(zip(eids, pool.map(self.stack_of, eids)))

    def _what(self, eid: int, now: float) -> str:
        """What node ``eid`` last did, for the stall report."""
        samples = self._samples_of(eid)
        last = samples[-1] if samples else {}
        rows = int(last.get("rows", 0))
        parts = []
        if eid in self._rows_at:
            parts.append(f"it last took a row {now - self._rows_at[eid]:.0f} s ago ({rows:,} rows so far)")
        elif rows:
            parts.append(f"it took {rows:,} rows, none since the driver started watching")
        else:
            parts.append("it took no row")
        steps = _status.progress_mark(samples)[1]
        if steps is not None:
            parts.append(f"{steps:,} Keras steps")
        return ", ".join(parts)

    def stall_text(self, stalled: list[int], running: list[int], now: float, stacks: Optional[dict] = None) -> str:
        """The stall report: the stuck nodes, what they last did and for how long, every
        thread's stack of their TF processes (``stacks``: those already asked), and the
        nodes waiting on them."""
        stacks = dict(stacks or {})
        name = self.state.node_name
        lines = []
        for eid in stalled:
            idle_s = now - self._progress_at[eid]
            lines.append(
                f"tfos: {name(eid)} made no progress for {idle_s:.0f} s (stall_timeout {self.stall_timeout_s:g} s): "
                f"no row taken, no Keras step, CPU below {_status.IDLE_CPU_SHARE:.0%} of a core and main_fun "
                f"not waiting for rows; {self._what(eid, now)}")
        waiting = []
        for eid in running:
            if eid in stalled:
                continue
            w = self.window(eid)
            if w is not None and w.waiting_s >= 1.0:
                waiting.append(f"{name(eid)}: main_fun waiting for rows for {w.waiting_s:.0f} s")
            elif _status.in_tensorflow(stacks.get(eid, "")):
                waiting.append(f"{name(eid)}: main_fun blocked inside TensorFlow for {now - self._progress_at[eid]:.0f} s "
                               f"(a collective waiting for its peers?) at {_status.innermost_of_main(stacks[eid])}")
            elif now - self._progress_at.get(eid, now) >= min(5.0, self.stall_timeout_s) or (
                    w is not None and w.rows_per_s == 0 and (w.steps_per_s or 0) == 0):
                waiting.append(f"{name(eid)}: no row or step for {now - self._rows_at.get(eid, self.started):.0f} s")
        if waiting:
            lines.append("Waiting on it: " + "; ".join(waiting))
        else:
            lines.append("No other node waits on it (every other node makes progress or has ended)")
        for eid in stalled[:MAX_STACKS]:
            stack = stacks[eid] if eid in stacks else self.stack_of(eid)
            lines.append(stack or f"(no stack came from {name(eid)} within {STACK_WAIT_S:g} s)")
        if len(stalled) > MAX_STACKS:
            lines.append(f"({len(stalled) - MAX_STACKS} more stalled node(s): cluster.stacks() has every node's stacks)")
        return "\n".join(lines)

    def stack_of(self, eid: int, wait_s: float = STACK_WAIT_S) -> str:
        """Every thread's stack of node ``eid``'s TF process ('' when it did not answer)."""
        answer = self.host.resolve(self.host.apply(_msg.NodeStack(eid, wait_s, all_threads=True)))
        return str(answer.get("stack") or "")

    def stacks(self, timeout_s: float = STACK_WAIT_S) -> dict[str, str]:
        """Every running node's thread stacks, asked of all nodes at once (driver)."""
        from concurrent.futures import ThreadPoolExecutor

        st = self.state
        live = [r for r in st.roles if st.proc_state.get(r.executor_id) in (NodeState.RUNNING, NodeState.SERVING)]
        if not live:
            return {}
        with ThreadPoolExecutor(max_workers=min(16, len(live)), thread_name_prefix="tfos-stacks") as pool:
            texts = list(pool.map(lambda r: self.stack_of(r.executor_id, min(timeout_s, 10.0)), live))
        return {f"{r.job_name}:{r.task_index}": t for r, t in zip(live, texts)}

    # ----------------------------------------------------------------- views
    def node_rows(self, eids: Optional[set[int]] = None) -> list[dict]:
        """One dict per node of the attempt, or of the executor ids ``eids`` (see
        ``TFCluster.status``)."""
        st = self.state
        now = time.monotonic()
        out = []
        with self._lock:
            verdict, named, _ = self._verdict
        for r in st.roles:
            eid = r.executor_id
            if eids is not None and eid not in eids:
                continue
            samples = self._samples_of(eid)
            w = _status.window_of(samples)
            last = samples[-1] if samples else {}
            beat = st.last_heartbeat.get(eid)
            state = st.proc_state.get(eid)
            row: dict = {
                "node": f"{r.job_name}:{r.task_index}", "executor_id": eid, "job_name": r.job_name,
                "task_index": r.task_index, "host": st.hosts.get(eid, ""),
                "state": state.value if state is not None else "",
                "rows": int(last.get("rows", 0)),
                "rows_by_epoch": _status.epochs_of(last),
                "rows_per_s": round(w.rows_per_s, 1) if w else None,
                "feed_wait_share": round(w.feed_wait_share, 3) if w else None,
                "feed_waiting_s": round(w.waiting_s, 1) if w else None,
                "queue_fill": round(w.queue_fill, 2) if w else None,
                "steps": _status.progress_mark([last])[1] if last else None,
                "steps_per_s": round(w.steps_per_s, 2) if w and w.steps_per_s is not None else None,
                "cpu_s": round(last.get("cpu_ms", 0) / 1000.0, 1) if last else None,
                "cpu_share": round(w.cpu_share, 3) if w else None,
                "rss_bytes": int(st.rss.get(eid, 0)),
                "heartbeat_age_s": round(now - beat, 1) if beat is not None else None,
                "idle_s": round(now - self._progress_at[eid], 1) if eid in self._progress_at else None,
                "class": (_status.node_class(w).value if w and w.fed else Verdict.NONE.value),
                "named": f"{r.job_name}:{r.task_index}" in named and verdict is not Verdict.NONE,
            }
            out.append(row)
        return out

    def status(self) -> dict:
        """The live status (see ``TFCluster.status`` for the fields)."""
        with self._lock:
            verdict = self._judge()
        return {
            "cluster_id": self.state.cluster_id,
            "elapsed_s": round(time.monotonic() - self.started, 1),
            "verdict": verdict[0].value, "verdict_nodes": verdict[1], "verdict_text": verdict[2],
            "verdicts_held_s": self.held(),
            "nodes": self.node_rows(),
            "last_stall": self.last_stall,
        }

    def summary(self) -> dict:
        """Per node over the whole attempt: rows, rows/s, feed-wait share, Keras steps,
        CPU seconds; and the verdict that held longest (see ``TFCluster.summary``)."""
        held = self.held()
        longest = max(held, key=lambda v: held[v]) if held else Verdict.NONE.value
        nodes = []
        for r in self.state.roles:
            eid = r.executor_id
            samples = self._samples_of(eid)
            with self._lock:
                first = self._first.get(eid)
            if not samples or first is None:
                continue
            last = samples[-1]
            span_ms = max(1, last.get("clock_ms", 0) - first.get("clock_ms", 0))
            wait_ms = _status.waited_ms(last) - _status.waited_ms(first)
            nodes.append({
                "node": f"{r.job_name}:{r.task_index}", "executor_id": eid,
                "rows": int(last.get("rows", 0)),
                "rows_per_s": round(max(0, last.get("rows", 0) - first.get("rows", 0)) * 1000.0 / span_ms, 1),
                "feed_wait_share": round(min(1.0, max(0.0, wait_ms / span_ms)), 3),
                "steps": _status.progress_mark([last])[1],
                "cpu_s": round(last.get("cpu_ms", 0) / 1000.0, 1),
                "seconds": round(span_ms / 1000.0, 1),
            })
        return {"cluster_id": self.state.cluster_id, "elapsed_s": round(time.monotonic() - self.started, 1),
                "verdict": longest, "verdicts_held_s": held, "nodes": nodes, "last_stall": self.last_stall}


def summary_text(summary: dict, limit: int = 8) -> str:
    """One log line of :meth:`StatusMonitor.summary` (at most ``limit`` nodes named)."""
    held = summary.get("verdicts_held_s", {})
    verdict = summary.get("verdict", "none")
    parts = [f"tfos cluster {summary.get('cluster_id')} summary: verdict {verdict}"
             f" (held {held.get(verdict, 0):.0f} s of {sum(held.values()):.0f} s)"]
    if summary.get("restarts"):
        parts[0] += f", {summary['restarts']} restart(s)"
    for n in summary.get("nodes", [])[:limit]:
        steps = f", {n['steps']:,} steps" if n.get("steps") is not None else ""
        parts.append(f"{n['node']}: {n['rows']:,} rows, {n['rows_per_s']:,.0f} rows/s, "
                     f"feed wait {n['feed_wait_share']:.0%}{steps}")
    left = len(summary.get("nodes", [])) - limit
    if left > 0:
        parts.append(f"... {left} more node(s) in cluster.summary()")
    return "; ".join(parts)
