"""Node output: the TF process's stdout/stderr lines, filtered, teed and shown on the driver
(docs/api.md "Node output").

Two ends:

* Node supervisor (executor host): :class:`NodeOutput` gives the TF process pipes as its
  descriptors 1 and 2 and reads them, drops TensorFlow's C++ start-up noise when tfos
  chose the log level (see :func:`is_tf_noise`), copies every other line to its own
  descriptors (the executor's log) and, for the nodes ``forward_logs`` selects, sends the
  lines to the driver. The reader is the supervisor, not the TF process, so a TF process
  that dies at once loses none of its last lines.
* Driver: :func:`emit` writes the lines it receives to the driver's ``sys.stderr`` with one
  short node prefix (``[worker:0] ``), without any logging set-up by the user. A user who
  attaches a handler to the ``tfos.node`` logger gets the lines as INFO records there
  instead (and not on stderr).

A forwarded node's failure report travels the same way as its output, so that the driver
shows the node's last lines before it raises (:func:`write_failure_marks`): the TF
process writes a marker line to its stdout, then its failure (JSON) on a marker line to
its stderr, both tagged with a per-launch token; the supervisor sends every line read
before them, then the failure. The report that ``main_fun`` returned travels the same way
(:func:`write_finished_marks`), so the driver's "main_fun finished" line follows the
node's last lines.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import re
import secrets
import sys
import threading
from typing import Any, Callable, Optional

from tfos._common.deadline import Deadline
from tfos._control import messages as _msg
from tfos._control.messages import NodeState
from tfos._node.tf_noise import has_nvidia_driver, is_tf_noise
from tfos.errors import ControlProtocolError, DeadlineExceededError, NodeFailure

__all__ = ["NodeOutput", "emit", "note_spark_bar", "spark_shows_progress", "OUTPUT_MARK_ENV", "std_fds_identity", "write_failure_marks",
           "write_finished_marks"]

node_log = logging.getLogger("tfos.node")
log = logging.getLogger(__name__)

#: Environment variable with the token of a forwarded TF process's marker lines (set by
#: the supervisor, popped by the TF process at start; not a secret: it only keeps the
#: markers apart from what main_fun prints).
OUTPUT_MARK_ENV = "TFOS_OUTPUT_MARK"
#: Start of a marker line: an ASCII record separator (not in normal output), then "tfos-".
_MARK_START = "\x1etfos-"


_REQ_ERRORS = (OSError, ControlProtocolError, DeadlineExceededError)
#: Stderr marker kinds that carry a status report for the driver: kind -> the report (a
#: Status message) of node ``eid``, from the marker's JSON (see :func:`_write_marks`).
_REPORTS: dict[str, Callable[[int, dict], _msg.Status]] = {
    "failure": lambda eid, body: _msg.Status(executor_id=eid, state=NodeState.FAILED, failure=NodeFailure.from_dict(body)),
    "returned": lambda eid, body: _msg.Status(executor_id=eid, state=NodeState.FINISHED,
                                              terminated=tuple(str(q) for q in body.get("terminated", []))),
}
#: Longest (re)connect to the driver for one request of the output sender, in seconds: a
#: driver that refuses or does not answer costs the sender this much, not the control
#: client's default (the heartbeat timeout, twice with a retry).
_CONNECT_S = 2.0
_MAX_LINE_CHARS = 2000
#: A line without a newline is handled in pieces of this many bytes (the supervisor
#: holds at most this much of one line): each piece goes to the executor log as it is;
#: the driver gets the line's first piece (cut at _MAX_LINE_CHARS) and, of later pieces,
#: only a progress bar's state after the last carriage return.
_LONG_LINE_BYTES = 1 << 20
#: Lines of one node queued for the driver; under a flood the oldest queued lines give
#: way, so the driver gets the node's last lines and a count of the ones left out.
_QUEUED_LINES = 5000
#: Most lines the driver shows of one request (:func:`emit`); a node sends no more at once.
_LINES_PER_REQUEST = 1000
# TensorFlow/absl C++ log lines: "I0000 00:00:1796080592.555864    7250 port.cc:153] ...".
_write_lock = threading.Lock()
#: Whether the driver's SparkContext draws Spark's console progress bar (set per cluster
#: by :func:`note_spark_bar`): node lines then erase the bar's unfinished line first.
_spark_bar = False
#: What a line written over Spark's progress bar starts with on a terminal: carriage
#: return, then "erase the line" (ANSI EL 2).
_ERASE_LINE = "\r\x1b[2K"
#: Terminal escape sequences (ANSI CSI such as Keras's bold and colours ``\x1b[1m``,
#: ``\x1b[32m``; OSC; two-byte escapes): dropped from node lines unless the driver's stderr
#: is a terminal.
_ESCAPES = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[0-~])")


class NodeOutput:
    """Captures the TF process's stdout/stderr (supervisor); see the module docstring.

    The supervisor makes two pipes, starts the TF process with their write ends as its
    descriptors 1 and 2 (:attr:`child_stdout`, :attr:`child_stderr`), and reads them in
    its own threads. The reading process outlives the TF process, so the last lines of a
    TF process that dies at once (``os.abort()``, a TensorFlow ``Check failed``, a
    segfault, ``os._exit``) still reach the executor log and the driver.

    Args:
        client: A control client to send lines to the driver, or None (not forwarded).
        executor_id: The node's executor id.
        tee: Copy lines to this process's descriptors 1 and 2 (the executor's log). tfos
            turns it off for forwarded nodes under ``local[N]`` masters and for nodes
            the driver started on its host (``driver_ps_nodes``), whose executor log is
            the driver's own terminal (the lines would show twice).
        tf_min_level: Drop TensorFlow C++ lines below this severity (see
            :func:`is_tf_noise`); None keeps every line (the user set
            ``TF_CPP_MIN_LOG_LEVEL``).

    Attributes:
        log_fd: A copy of this process's stderr (the executor log) for the TF process's
            own tfos log lines (``TFOS_LOG_FD``): they stay in the executor log, since
            the driver has its own account of them.
        mark: The token of the TF process's marker lines (``TFOS_OUTPUT_MARK``; see
            :func:`write_failure_marks`), or "" when lines are not forwarded (the TF
            process then reports its failure to the driver itself).
    """

    def __init__(self, client: Any, executor_id: int, tee: bool = True, tf_min_level: Optional[int] = None):
        self._client = client
        self._eid = executor_id
        self._tee = tee
        self._tf_min_level = tf_min_level
        self._nvidia = has_nvidia_driver()
        self._lines: "collections.deque[str]" = collections.deque()
        self._lines_lock = threading.Lock()  # _lines and _dropped: readers add, the sender takes
        self._dropped = 0  # lines that gave way since the last send (they precede the queued ones)
        self._readers: list[threading.Thread] = []
        self._stop = threading.Event()
        self._pipes = [os.pipe(), os.pipe()]  # (read, write) for descriptors 1 and 2
        self.log_fd = os.dup(2)
        self._sender: Optional[threading.Thread] = None
        self.mark = secrets.token_hex(8) if client is not None else ""
        self._wake = threading.Event()  # lines or a failure to send, or close()
        # Marker pairs: the n-th marker on stderr (a failure, or main_fun's return) goes
        # with the n-th "mark" line on stdout; its report waits for that one.
        self._marks = threading.Condition()  # also guards _pending
        self._stdout_marks = 0
        self._stderr_marks = 0
        self._pending: list[tuple[int, str, _msg.Status]] = []  # reports to send: (stderr marker no., kind, report)
        self._report_lock = threading.Lock()  # one sender of reports at a time (send loop, close)
        self._abandoned = threading.Event()  # the driver is gone: lines are no longer sent

    @property
    def child_stdout(self) -> int:
        """The write end to give the TF process as its stdout."""
        return self._pipes[0][1]

    @property
    def child_stderr(self) -> int:
        """The write end to give the TF process as its stderr."""
        return self._pipes[1][1]

    def start(self) -> None:
        """Starts reading, once the TF process holds the write ends (closed here, so that
        the readers see the end of the output when the TF process and its children exit)."""
        for out, (r, w) in zip((1, 2), self._pipes):
            os.close(w)
            t = threading.Thread(target=self._read, args=(r, out), name=f"tfos-out-{out}", daemon=True)
            t.start()
            self._readers.append(t)
        os.close(self.log_fd)  # the TF process has its copy
        self.log_fd = -1
        if self._client is not None:
            self._sender = threading.Thread(target=self._send_loop, name="tfos-out-send", daemon=True)
            self._sender.start()

    def _read(self, r: int, out: int) -> None:
        # Linear in the bytes read: only new data is searched for a newline, and a line
        # longer than _LONG_LINE_BYTES is handled in pieces of that size (see _cut_at).
        pending = bytearray()
        state = {"dropped": False, "cont": False}  # last line was noise; pending continues a cut line
        while True:
            try:
                data = os.read(r, 65536)
            except OSError:
                break
            if not data:
                break
            scan = len(pending)
            pending += data
            end = pending.rfind(b"\n", scan)
            if end >= 0:
                lines = bytes(pending[:end]).split(b"\n")
                del pending[:end + 1]
                self._handle(lines, out, state, cut=False)
            while len(pending) > _LONG_LINE_BYTES:
                at = _cut_at(pending)
                piece = bytes(pending[:at])
                del pending[:at]
                self._handle([piece], out, state, cut=True)
        if pending:
            self._handle([bytes(pending)], out, state, cut=True)
        os.close(r)

    def _handle(self, lines: "list[bytes]", out: int, state: dict, cut: bool) -> None:
        """Filters, tees and offers complete lines; with ``cut``, the one item is a piece
        of a longer line (or the output's unterminated end): teed without a newline, and
        offered to the driver only as its first piece or for a progress bar's last state."""
        kept = []
        for raw in lines:
            cont, state["cont"] = state["cont"], cut
            text = raw.decode("utf-8", "replace").rstrip("\r")
            if self.mark and _MARK_START in text:
                text, raw = self._take_mark(text, raw, out)
                if not text:
                    if cont and self._tee:
                        kept.append(b"")  # the marker ends main_fun's unfinished line, as read together
                    continue
            if cont:
                if state["dropped"]:
                    continue  # the rest of a noise line
            elif self._tf_min_level is not None and is_tf_noise(text, self._tf_min_level, self._nvidia,
                                                                state["dropped"]):
                state["dropped"] = True
                continue
            state["dropped"] = False
            kept.append(raw)
            if not cont or "\r" in text:
                self._offer(text)
        if self._tee and kept:
            try:
                _write_all(out, b"\n".join(kept) + (b"" if cut else b"\n"))
            except OSError:
                pass

    def _take_mark(self, text: str, raw: bytes, out: int) -> "tuple[str, bytes]":
        """Handles a marker line (see :func:`write_failure_marks`); returns what main_fun
        printed before it on the same line (it had no newline yet), as text and as the
        bytes read, else ``("", b"")``. A line that only looks like a marker (another
        token, bad JSON) stays a line, its bytes unchanged. The marker is the last one on
        the line (its JSON cannot hold the marker's first byte), so earlier output that
        happens to contain one does not hide it."""
        at = text.rindex(_MARK_START)
        kind, _, rest = text[at + len(_MARK_START):].partition(" ")
        token, _, payload = rest.partition(" ")
        if token != self.mark:
            return text, raw
        if kind == "mark" and out == 1:
            with self._marks:
                self._stdout_marks += 1
                self._marks.notify_all()
        elif kind in _REPORTS and out == 2:
            try:
                body = json.loads(payload)
            except ValueError:
                return text, raw
            try:
                report = _REPORTS[kind](self._eid, body)
            except (AttributeError, KeyError, TypeError, ValueError, ControlProtocolError):
                return text, raw  # not a report of this node's TF process
            with self._marks:
                self._stderr_marks += 1
                self._pending.append((self._stderr_marks, kind, report))
            self._wake.set()
        return text[:at], raw[:raw.rindex(_MARK_BYTES)]

    def _wait_stdout_mark(self, n: int, timeout_s: float) -> None:
        """Waits up to ``timeout_s`` for the ``n``-th stdout marker: the stdout lines written
        before the stderr marker it goes with were read by then."""
        with self._marks:
            self._marks.wait_for(lambda: self._stdout_marks >= n, timeout_s)

    def _offer(self, text: str) -> None:
        if self._client is None:
            return
        if "\r" in text:
            text = text.rsplit("\r", 1)[-1]
        if not text.strip():
            return
        with self._lines_lock:
            if len(self._lines) >= _QUEUED_LINES:
                self._lines.popleft()
                self._dropped += 1
            self._lines.append(text[:_MAX_LINE_CHARS])

    def _flush(self) -> bool:
        """Sends up to ~256 KB or 1,000 of the queued lines; True when the queue is now empty."""
        batch: list[str] = []
        size = 0
        with self._lines_lock:
            if self._dropped:
                where = "; the executor log has them" if self._tee else ""
                batch.append(f"[{self._dropped} output lines dropped here{where}]")
                self._dropped = 0
            while size < 256 * 1024 and len(batch) < _LINES_PER_REQUEST and self._lines:
                line = self._lines.popleft()
                batch.append(line)
                size += 6 * len(line) + 4  # worst case of JSON escaping
        if batch and self._client is not None and not self._abandoned.is_set():
            try:
                self._client.call(_msg.Log(executor_id=self._eid, lines=tuple(batch)), timeout_s=10.0, retry=False,
                                  connect_timeout_s=_CONNECT_S)
            except _REQ_ERRORS:
                self._after_send_error()
        with self._lines_lock:
            return not self._lines

    def _send_reports(self, stdout_wait_s: float) -> None:
        """Sends the pending reports in marker order, each after the lines written before
        it: every line read so far and (after waiting up to ``stdout_wait_s`` for its
        stdout marker) the stdout lines written before it, then the report (once)."""
        with self._report_lock:
            while True:
                with self._marks:
                    if not self._pending:
                        return
                    n, kind, report = self._pending.pop(0)
                self._wait_stdout_mark(n, stdout_wait_s)
                deadline = Deadline(5.0, f"the lines before the node's {kind} report to reach the driver")
                while not self._flush() and not deadline.expired():
                    pass
                if self._abandoned.is_set():
                    continue
                try:
                    self._client.call(report, timeout_s=10.0, connect_timeout_s=_CONNECT_S)
                except _REQ_ERRORS as exc:
                    self._after_send_error()
                    log.error("could not send the %s report of executor %s to the driver: %s", kind, self._eid, exc)

    def _after_send_error(self) -> None:
        """A request failed: when the driver's control port refused the connection (the
        driver exited or tore the cluster down; its port listens for the cluster's whole
        life), nothing more is sent, as after :meth:`abandon`."""
        if isinstance(getattr(self._client, "last_connect_error", None), ConnectionRefusedError):
            self.abandon()

    def _send_loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(0.5)
            self._wake.clear()
            if self._pending:
                self._send_reports(1.0)
            else:
                self._flush()  # also the lines written after a report was sent

    def abandon(self) -> None:
        """The driver is gone (supervisor): from now on nothing is sent to it, so
        :meth:`close` does not spend its deadlines on a driver that cannot answer. The
        lines are still copied to the executor log."""
        self._abandoned.set()
        self._wake.set()

    def close(self, read_timeout_s: float = 2.0) -> None:
        """After the TF process (and its process group) ended: reads its output to the
        end (at most ``read_timeout_s`` more, for a descendant that still holds a pipe)
        and sends what is left to the driver (at most ~5 s). Idempotent."""
        for t in self._readers:
            t.join(read_timeout_s)
        self._stop.set()
        self._wake.set()
        if self.log_fd >= 0:  # start() never ran (the TF process did not start)
            for fd in (self.log_fd, *(end for pipe in self._pipes for end in pipe)):
                try:
                    os.close(fd)
                except OSError:
                    pass
            self.log_fd = -1
        if self._sender is None:
            return
        self._sender.join(2.0)
        self._sender = None
        self._send_reports(0.0)  # the readers are done: every marker was read
        deadline = Deadline(5.0, "the last output lines to reach the driver")
        while not self._flush() and not deadline.expired():
            pass


def std_fds_identity() -> tuple:
    """(device, inode) of descriptors 1 and 2 (None for a closed one): a TF process takes
    it at start, and :func:`write_failure_marks` writes only when it is unchanged."""
    ident: list[Optional[tuple[int, int]]] = []
    for fd in (1, 2):
        try:
            st = os.fstat(fd)
            ident.append((st.st_dev, st.st_ino))
        except OSError:
            ident.append(None)
    return tuple(ident)


def write_failure_marks(token: str, failure: dict, fds_identity: Optional[tuple] = None) -> bool:
    """Hands a failure to the supervisor in line with the output (TF process).

    Flushes Python's stdout/stderr, then writes a marker line with ``token`` to
    descriptor 1 and the failure as JSON on a marker line to descriptor 2. The supervisor
    (:class:`NodeOutput`) sends the driver every line written before the markers, then
    reports the failure, so the driver shows the node's last lines before it raises.

    Args:
        token: The supervisor's ``TFOS_OUTPUT_MARK``; "" means the lines are not forwarded.
        failure: ``NodeFailure.to_dict()``.
        fds_identity: :func:`std_fds_identity` taken at start, or None: when descriptor 1
            or 2 no longer is the supervisor's pipe (main_fun or a library redirected it),
            nothing is written.

    Returns:
        False when there is no token, a descriptor was redirected, or a write failed (the
        caller reports the failure to the driver itself).
    """
    return _write_marks(token, "failure", failure, fds_identity)


def write_finished_marks(token: str, terminated: list, fds_identity: Optional[tuple] = None) -> bool:
    """Hands the report that ``main_fun`` returned to the supervisor in line with the
    output (TF process), as :func:`write_failure_marks` does for a failure: the driver
    gets the node's last lines, then its ``NodeState.FINISHED`` status.

    Args:
        token: The supervisor's ``TFOS_OUTPUT_MARK``; "" means the lines are not forwarded.
        terminated: The queue names main_fun ended with ``DataFeed.terminate()``.
        fds_identity: As for :func:`write_failure_marks`.

    Returns:
        False when nothing was handed over (the caller reports to the driver itself).
    """
    return _write_marks(token, "returned", {"terminated": [str(q) for q in terminated]}, fds_identity)


def _write_marks(token: str, kind: str, body: dict, fds_identity: Optional[tuple]) -> bool:
    if not token or (fds_identity is not None and std_fds_identity() != fds_identity):
        return False
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    try:
        _write_all(1, f"{_MARK_START}mark {token}\n".encode())
        _write_all(2, f"{_MARK_START}{kind} {token} {json.dumps(body)}\n".encode())
    except OSError:
        return False
    return True


_MARK_BYTES = _MARK_START.encode()


def _cut_at(pending: bytearray) -> int:
    """Where to cut a line longer than _LONG_LINE_BYTES (pure): at that length, or before
    the start of a marker that begins in its last quarter (also one that reaches past
    that length), so a marker is never split in two."""
    at = _LONG_LINE_BYTES
    mark = pending.rfind(_MARK_BYTES, at - _LONG_LINE_BYTES // 4, at + len(_MARK_BYTES) - 1)
    return mark if mark > 0 else at


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def emit(node: str, lines: list) -> None:
    """Shows lines a node forwarded (driver, control server thread).

    Writes ``[node] line`` to ``sys.stderr`` (around tfos's progress bar, if one is
    shown; on a terminal, after erasing Spark's progress bar line, see
    :func:`note_spark_bar`), unless the ``tfos.node`` logger itself has handlers: then each line is an
    INFO record of that logger (the user routed node output into logging). Terminal escape
    sequences (Keras's progress bar colours) are kept only when writing to a terminal.

    Args:
        node: The short node name, e.g. ``"worker:0"``.
        lines: The lines (str), at most 1000 are shown (then a line saying how many were
            not), each cut at 2000 characters.
    """
    extra = len(lines) - _LINES_PER_REQUEST
    lines = [str(ln)[:_MAX_LINE_CHARS] for ln in lines[:_LINES_PER_REQUEST]]
    if extra > 0:
        lines.append(f"[{extra} more output lines of this node not shown]")
    to_terminal = not node_log.handlers and _isatty(sys.stderr)
    if not to_terminal:
        lines = [_ESCAPES.sub("", ln) if "\x1b" in ln else ln for ln in lines]
    if node_log.handlers:
        for ln in lines:
            node_log.info("[%s] %s", node, ln)
        return
    text = "".join(f"[{node}] {ln}\n" for ln in lines)
    if not text:
        return
    if _spark_bar and to_terminal:
        # Spark's bar is a line without a newline ("\r[Stage 3:=>  (1 + 2) / 4]"); without
        # the erase, the node's first line would be appended to it.
        text = _ERASE_LINE + text
    from tqdm import tqdm

    with _write_lock:
        try:
            with tqdm.external_write_mode(file=sys.stderr):
                sys.stderr.write(text)
                sys.stderr.flush()
        except (OSError, ValueError):
            pass  # stderr closed (interpreter shutting down)


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, OSError, ValueError):
        return False


def note_spark_bar(on: bool) -> None:
    """Records whether Spark draws its console progress bar in this driver (driver; see
    :func:`spark_shows_progress`). While it does, :func:`emit` starts what it writes to a
    terminal with a carriage return and an erase-line, so a node line never lands on the
    end of the bar's line; Spark redraws the bar at its next update."""
    global _spark_bar
    _spark_bar = bool(on)


def spark_shows_progress(sc: Any) -> bool:
    """Whether Spark's configuration turns its console progress bar on (driver): while a
    tfos cluster is open, tfos turns it off (:mod:`tfos._driver.spark_bar`)."""
    try:
        return str(sc.getConf().get("spark.ui.showConsoleProgress", "false")).lower() == "true"
    except Exception:  # noqa: BLE001 - no conf (stopped context): no Spark bar either
        return False
