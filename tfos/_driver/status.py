"""Why is the job slow, where is it stuck: the driver's reading of the nodes' figures (pure).

Every TF process sends its figures with each long-poll (about once a second,
:func:`tfos._data.figures.live_snapshot`); the driver's status monitor
(:mod:`tfos._driver.monitor`) keeps each node's recent ones and asks this module what they
mean. Nothing here holds a lock, a thread or a clock: samples in, figures and a verdict
out, so every rule is unit-tested with made-up samples. The rules and their remedies are
explained in docs/status.md.

Verdicts (:class:`Verdict`), from each fed node's last :data:`WINDOW_S` seconds:

- ``producer``: main_fun waits for rows at least :data:`STARVED_SHARE` of its time while
  its input queue is empty: the Spark tasks produce rows more slowly than main_fun takes
  them;
- ``feed``: main_fun waits as much, but rows wait in its queue: unpacking and moving them
  to main_fun (the feed itself) is the slow part;
- ``compute``: main_fun waits for rows at most :data:`BUSY_SHARE` of its time and its
  queue holds rows: main_fun (the TF step) is the slow part;
- ``skew``: one node takes rows far more slowly (below :data:`SKEW_RATIO` of the median
  of the fed nodes): it is far behind the others;
- ``none``: none of these holds (or no node takes rows), or too few figures yet: every
  verdict waits until each judged node's window spans :data:`VERDICT_SPAN_S` seconds, and
  the rate comparisons (``skew`` by rate, ``compute``) until the fed nodes took
  :data:`VERDICT_ROWS` rows each on average in their windows.
"""

from __future__ import annotations

import dataclasses
import enum
import re
import statistics
from typing import Mapping, Optional, Sequence

__all__ = [
    "Verdict", "NodeWindow", "window_of", "waited_ms", "in_tensorflow", "innermost_of_main", "epochs_of", "node_class", "judge", "progress_mark", "idle",
    "WINDOW_S", "VERDICT_SPAN_S", "VERDICT_ROWS", "STARVED_SHARE", "BUSY_SHARE", "EMPTY_SHARE", "SKEW_RATIO", "IDLE_CPU_SHARE",
]

#: Seconds of a node's own clock over which rates and shares are computed.
WINDOW_S = 10.0
#: Least span, in seconds, of a window worth judging (fewer samples say nothing).
MIN_SPAN_S = 3.0
#: main_fun waiting for rows at least this share of the window: the node is starved.
STARVED_SHARE = 0.5
#: main_fun waiting for rows at most this share: the node is busy (compute-bound when its
#: queue holds rows).
BUSY_SHARE = 0.2
#: Share of the window's samples with an empty input queue from which a starved node's
#: rows are said not to arrive (producer), below which they wait in the queue (feed).
EMPTY_SHARE = 0.5
#: A fed node taking rows below this share of the median rate is far behind (skew).
SKEW_RATIO = 0.5
#: Least span, in seconds, of every judged node's window before any verdict: a verdict
#: from the first seconds of a job (one node fed first, another still building its model)
#: flaps as the job settles.
VERDICT_SPAN_S = 8.0
#: Least rows per fed node, over the fed nodes' windows together, before the rates are
#: compared (``skew`` by rate, ``compute``): a few rows say nothing of a rate.
VERDICT_ROWS = 50
#: CPU below this share of one core (with no row and no step) counts as no progress.
IDLE_CPU_SHARE = 0.05


class Verdict(str, enum.Enum):
    """Where a fed job's time goes (docs/status.md "Verdicts")."""

    PRODUCER = "producer"
    FEED = "feed"
    COMPUTE = "compute"
    SKEW = "skew"
    NONE = "none"


@dataclasses.dataclass(frozen=True)
class NodeWindow:
    """One node's figures over its last window (driver).

    Attributes:
        span_s: Seconds of the node's clock the window covers.
        rows: Rows main_fun took from the feed in total (this attempt).
        rows_per_s: Rows taken per second over the window.
        feed_wait_share: Share (0..1) of the window main_fun spent in the feed
            (``next_batch``, the tf.data generator) rather than in its own code.
        waiting_s: Seconds main_fun has been in its current feed call (0 outside one).
        queue_empty_share: Share (0..1) of the window's samples with an empty input queue.
        queue_fill: The input queue's fill (0..1) at the last sample.
        cpu_share: CPU time of the TF process over the window, in cores (1.0 = one core).
        steps: Keras training steps so far (None where Keras is not counted).
        steps_per_s: Keras steps per second over the window (None without Keras).
    """

    span_s: float
    rows: int
    rows_per_s: float
    feed_wait_share: float
    waiting_s: float
    queue_empty_share: float
    queue_fill: float
    cpu_share: float
    steps: Optional[int] = None
    steps_per_s: Optional[float] = None

    @property
    def fed(self) -> bool:
        """True when main_fun took rows, or waited for them, in the window."""
        return self.rows_per_s > 0 or self.feed_wait_share > 0


def _steps(s: Mapping[str, int]) -> Optional[int]:
    """Keras steps in a sample: the Keras trainer's counter when it counts them."""
    for name in ("keras_steps", "steps"):
        if name in s:
            return int(s[name])
    return None


def waited_ms(s: Mapping[str, int]) -> int:
    """main_fun's feed wait up to the sample, the wait in progress included."""
    since = s.get("feed_wait_since_ms", 0)
    return s.get("feed_wait_ms", 0) + (max(0, s.get("clock_ms", 0) - since) if since else 0)


def window_of(samples: Sequence[Mapping[str, int]], window_s: float = WINDOW_S) -> Optional[NodeWindow]:
    """The figures of one node over its last ``window_s`` seconds (driver, pure).

    Args:
        samples: The node's figures (:func:`tfos._data.figures.live_snapshot`), oldest
            first, each with a distinct ``clock_ms``.
        window_s: Window length, in seconds of the node's clock.

    Returns:
        The window, or None with fewer than :data:`MIN_SPAN_S` seconds of samples.
    """
    if len(samples) < 2:
        return None
    last = samples[-1]
    end = last.get("clock_ms", 0)
    base_i = 0
    for i, s in enumerate(samples):
        if end - s.get("clock_ms", 0) >= window_s * 1000:
            base_i = i
    base = samples[base_i]
    span_ms = end - base.get("clock_ms", 0)
    if span_ms < MIN_SPAN_S * 1000:
        return None
    span_s = span_ms / 1000.0
    inside = samples[base_i + 1:]
    cap = last.get("queue_capacity", 0)
    steps1 = _steps(last)
    steps0 = _steps(base) if _steps(base) is not None else (0 if steps1 is not None else None)  # before the first step
    since = last.get("feed_wait_since_ms", 0)
    return NodeWindow(
        span_s=span_s,
        rows=int(last.get("rows", 0)),
        rows_per_s=max(0, last.get("rows", 0) - base.get("rows", 0)) / span_s,
        feed_wait_share=min(1.0, max(0.0, (waited_ms(last) - waited_ms(base)) / span_ms)),
        waiting_s=max(0, end - since) / 1000.0 if since else 0.0,
        queue_empty_share=sum(1 for s in inside if s.get("queue_chunks", 0) == 0) / len(inside),
        queue_fill=last.get("queue_chunks", 0) / cap if cap else 0.0,
        cpu_share=max(0, last.get("cpu_ms", 0) - base.get("cpu_ms", 0)) / span_ms,
        steps=steps1,
        steps_per_s=(max(0, steps1 - steps0) / span_s) if steps1 is not None and steps0 is not None else None,
    )


def node_class(w: NodeWindow) -> Verdict:
    """What one fed node's window says on its own: producer, feed, compute or none."""
    if w.feed_wait_share >= STARVED_SHARE:
        return Verdict.PRODUCER if w.queue_empty_share >= EMPTY_SHARE else Verdict.FEED
    if w.rows_per_s > 0 and w.feed_wait_share <= BUSY_SHARE and w.queue_empty_share < EMPTY_SHARE:
        return Verdict.COMPUTE
    return Verdict.NONE


def _names(nodes: Sequence[str]) -> str:
    return ", ".join(nodes)


def judge(windows: Mapping[str, NodeWindow]) -> tuple[Verdict, list[str], str]:
    """The cluster's verdict from its fed nodes' windows (driver, pure).

    Args:
        windows: Node name (``worker:1``) -> its window, for the running fed nodes while
            a feed runs. A node whose main_fun neither took nor waited for rows in its
            window (busy elsewhere, or stuck) while another waits for rows is far
            behind (skew); otherwise it is left out.

    Returns:
        ``(verdict, nodes it names, one-line explanation)``; the nodes are in the order
        of ``windows``.
    """
    fed = {n: w for n, w in windows.items() if w.fed}
    if not fed:
        return Verdict.NONE, [], "no node is taking rows from a feed"
    short = [n for n, w in windows.items() if w.span_s < VERDICT_SPAN_S]
    if short:
        return Verdict.NONE, [], (f"too few figures yet: {_names(short)} sent less than {VERDICT_SPAN_S:g} s of them "
                                  "(docs/status.md \"Verdicts\")")
    rows_enough = sum(w.rows_per_s * w.span_s for w in fed.values()) >= VERDICT_ROWS * len(fed)
    # a node that has not taken its first row yet is starting (its model, its TF server), not behind
    absent = [n for n, w in windows.items() if n not in fed and w.rows > 0]
    waiting = [n for n, w in fed.items() if w.feed_wait_share >= STARVED_SHARE]
    if absent and waiting:
        return Verdict.SKEW, absent, (
            f"{_names(absent)} took no row and did not wait for one while {_names(waiting)} waited for rows: "
            "main_fun there is busy elsewhere or stuck (cluster.stacks() shows where)")
    rates = [w.rows_per_s for w in fed.values()]
    median = statistics.median(rates)
    if len(fed) >= 2 and median > 0 and rows_enough:
        behind = [n for n, w in fed.items() if w.rows_per_s < SKEW_RATIO * median]
        if behind:
            r = {n: fed[n].rows_per_s for n in behind}
            return Verdict.SKEW, behind, (
                f"{_names(behind)} far behind: {', '.join(f'{v:,.0f}' for v in r.values())} rows/s against a median "
                f"of {median:,.0f} rows/s (uneven partitions, or a slower producer or host there)")
    classes = {n: node_class(w) for n, w in fed.items()}
    starved = [n for n, c in classes.items() if c in (Verdict.PRODUCER, Verdict.FEED)]
    if starved:
        producer = [n for n in starved if classes[n] is Verdict.PRODUCER]
        feed = [n for n in starved if classes[n] is Verdict.FEED]
        kind, named = (Verdict.PRODUCER, producer) if len(producer) >= len(feed) else (Verdict.FEED, feed)
        share = max(fed[n].feed_wait_share for n in named)
        if kind is Verdict.PRODUCER:
            why = "their input queues are empty: the Spark tasks produce rows more slowly than main_fun takes them"
        else:
            why = "rows wait in their input queues: unpacking them (the feed) is the slow part"
        return kind, named, f"{_names(named)}: main_fun waits for rows {share:.0%} of the time and {why}"
    busy = [n for n, c in classes.items() if c is Verdict.COMPUTE]
    if busy and rows_enough:
        share = max(fed[n].feed_wait_share for n in busy)
        return Verdict.COMPUTE, busy, (
            f"{_names(busy)}: main_fun runs {1 - share:.0%} of the time or more while rows wait in the queue: "
            "the TF step is the slow part")
    return Verdict.NONE, [], "rows arrive about as fast as main_fun takes them"


def epochs_of(sample: Mapping[str, int]) -> dict[int, dict[str, Optional[int]]]:
    """Rows per feed epoch of the node's latest ``train()`` call, from the row accounting's
    counters (``rows_fed/<feed>/<epoch>``, ``rows_trained/<feed>/<epoch>``,
    ``rows_closed/<feed>/<epoch>``: :mod:`tfos._data.row_count`, docs/datafeed.md "Row
    accounting"): ``{epoch: {"fed", "trained", "closed"}}`` (``trained`` None without Keras
    3 ``fit``); {} when the node has none (pure)."""
    feeds: dict[str, dict[int, dict[str, Optional[int]]]] = {}
    for name, value in sample.items():
        kind, sep, rest = name.partition("/")
        if not sep or kind not in ("rows_fed", "rows_trained", "rows_closed"):
            continue
        feed, sep, epoch = rest.rpartition("/")
        if not sep or not epoch.isdigit():
            continue
        row = feeds.setdefault(feed, {}).setdefault(int(epoch), {"fed": 0, "trained": None, "closed": 0})
        row[kind.split("_", 1)[1]] = int(value)
    if not feeds:
        return {}
    return dict(sorted(feeds[list(feeds)[-1]].items()))  # the feed counted last: the latest train() call


#: Path parts of the libraries whose frames, innermost in main_fun's stack, mean main_fun
#: waits inside TensorFlow (a collective, a step) rather than in its own code.
TF_PATHS = ("/tensorflow/", "/keras/", "/tf_keras/", "/tensorflow_core/")


_STDLIB = re.compile(r'File "[^"]*/lib/python\d\.\d+/(?![^"]*-packages/)')


def innermost_of_main(stack: str) -> str:
    """The innermost ``File "...", line N, in f`` line of main_fun's part of a
    :func:`tfos._node.stacks.thread_stacks` text that is not in Python's standard library
    (a ``threading`` wait, a ``multiprocessing.pool`` map: where the wait is, not who
    waits); '' when there is none (pure)."""
    main = stack.split("\nThread ", 1)[0].split("\ntfos threads:", 1)[0]
    files = [ln.strip() for ln in main.splitlines() if ln.strip().startswith('File "')]
    own = [f for f in files if not _STDLIB.match(f)]
    return own[-1] if own else (files[-1] if files else "")


def in_tensorflow(stack: str) -> bool:
    """True when main_fun waits in TensorFlow's or Keras's own code (its innermost frame
    outside the standard library is there): e.g. an all-reduce waiting for a peer that
    never comes (pure)."""
    line = innermost_of_main(stack)
    return any(part in line for part in TF_PATHS)


def progress_mark(samples: Sequence[Mapping[str, int]]) -> tuple:
    """What counts as a node's progress in its last sample: rows taken and Keras steps."""
    last = samples[-1] if samples else {}
    return (int(last.get("rows", 0)), _steps(last))


def idle(samples: Sequence[Mapping[str, int]], recent_s: float = 5.0) -> bool:
    """True when the node's CPU over its last ``recent_s`` seconds stayed below
    :data:`IDLE_CPU_SHARE` of one core and main_fun is not in the feed (driver, pure).

    A main_fun waiting for rows is not stuck by itself (the driver may not be feeding
    yet; ``feed_timeout`` bounds that wait); one that neither takes rows nor steps nor
    uses the CPU elsewhere is.
    """
    if len(samples) < 2:
        return False
    last = samples[-1]
    if last.get("feed_wait_since_ms", 0):
        return False
    end = last.get("clock_ms", 0)
    base = samples[0]
    for s in samples:
        if end - s.get("clock_ms", 0) >= recent_s * 1000:
            base = s
    span_ms = end - base.get("clock_ms", 0)
    if span_ms <= 0:
        return False
    return (last.get("cpu_ms", 0) - base.get("cpu_ms", 0)) / span_ms < IDLE_CPU_SHARE
