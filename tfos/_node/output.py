"""Node output: the TF process's stdout/stderr lines, filtered, teed and shown on the driver (C26).

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
"""

from __future__ import annotations

import logging
import os
import queue
import re
import sys
import threading
from typing import Any, Optional

from tfos._common.deadline import Deadline
from tfos.errors import ControlProtocolError, DeadlineExceededError

__all__ = ["NodeOutput", "emit", "is_tf_noise", "note_spark_bar", "spark_shows_progress", "tf_noise_level", "TF_LOG_LEVEL_DEFAULT"]

node_log = logging.getLogger("tfos.node")

#: The ``TF_CPP_MIN_LOG_LEVEL`` tfos sets in node processes when the user set none:
#: TensorFlow's C++ INFO lines are dropped, warnings and errors are kept.
TF_LOG_LEVEL_DEFAULT = "1"

_REQ_ERRORS = (OSError, ControlProtocolError, DeadlineExceededError)
_MAX_LINE_CHARS = 2000
# TensorFlow/absl C++ log lines: "I0000 00:00:1796080592.555864    7250 port.cc:153] ...".
_CXX_LINE = re.compile(r"^([IWEF])\d{4} \d\d:\d\d:\d+\.\d+\s+\d+ [^\s\]]+:\d+\] ")
_CXX_SEVERITY = {"I": 0, "W": 1, "E": 2, "F": 3}
_ABSL_PREINIT = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
# The second line of TensorFlow's cpu_feature_guard INFO message.
_CXX_CONTINUATION = "To enable the following instructions:"
_write_lock = threading.Lock()
#: Whether the driver's SparkContext draws Spark's console progress bar (set per cluster
#: by :func:`note_spark_bar`): node lines then erase the bar's unfinished line first.
_spark_bar = False
#: What a line written over Spark's progress bar starts with on a terminal: carriage
#: return, then "erase the line" (ANSI EL 2).
_ERASE_LINE = "\r\x1b[2K"


def _has_nvidia_driver() -> bool:
    return os.path.exists("/proc/driver/nvidia/version")


def is_tf_noise(line: str, min_level: int, nvidia_driver: bool, after_dropped: bool = False) -> bool:
    """Whether a node output line is TensorFlow C++ noise tfos hides by default (pure).

    Args:
        line: One output line, without its newline.
        min_level: ``TF_CPP_MIN_LOG_LEVEL`` in force (0 INFO, 1 WARNING, 2 ERROR, 3 FATAL):
            C++ lines of a lower severity are noise. TensorFlow 2.21 prints some lines
            before absl's log initialisation, ignoring that variable; this catches them.
        nvidia_driver: Whether the host has an NVIDIA driver. Without one, TensorFlow's
            ``failed call to cuInit`` error only says that there is no GPU: noise. The
            warning that ``DataFeed.as_dataset``'s generator dataset "will not be
            optimized" is noise too (nothing the user can change).
        after_dropped: The previous line was dropped (for two-line messages).

    Returns:
        True to drop the line.
    """
    if line.startswith(_ABSL_PREINIT):
        return min_level > 0
    if after_dropped and line.startswith(_CXX_CONTINUATION):
        return True
    m = _CXX_LINE.match(line)
    if m is None:
        return False
    if _CXX_SEVERITY[m.group(1)] < min_level:
        return True
    if "Input of GeneratorDatasetOp::Dataset will not be optimized" in line:
        return True  # about DataFeed.as_dataset's own generator: nothing the user can change
    return not nvidia_driver and "failed call to cuInit" in line


def tf_noise_level(env_value: Optional[str]) -> Optional[int]:
    """The ``min_level`` of :func:`is_tf_noise` for a node's ``TF_CPP_MIN_LOG_LEVEL`` (pure).

    The filter follows the level in force, whoever set it: tfos's default (``1``) or the
    user's (``2`` must never show more than ``1``). ``0`` (every line asked for) turns it off.

    Args:
        env_value: ``TF_CPP_MIN_LOG_LEVEL`` of the TF process, or None when unset.

    Returns:
        The level (1-3), or None for no filtering.
    """
    try:
        level = int(env_value if env_value is not None else TF_LOG_LEVEL_DEFAULT)
    except ValueError:
        level = int(TF_LOG_LEVEL_DEFAULT)
    return min(level, 3) if level > 0 else None


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
    """

    def __init__(self, client: Any, executor_id: int, tee: bool = True, tf_min_level: Optional[int] = None):
        self._client = client
        self._eid = executor_id
        self._tee = tee
        self._tf_min_level = tf_min_level
        self._nvidia = _has_nvidia_driver()
        self._lines: "queue.Queue[str]" = queue.Queue(maxsize=5000)
        self._dropped = 0
        self._readers: list[threading.Thread] = []
        self._stop = threading.Event()
        self._pipes = [os.pipe(), os.pipe()]  # (read, write) for descriptors 1 and 2
        self.log_fd = os.dup(2)
        self._sender: Optional[threading.Thread] = None

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
        pending = b""
        dropped = False
        while True:
            try:
                data = os.read(r, 65536)
            except OSError:
                break
            if not data:
                break
            pending += data
            *lines, pending = pending.split(b"\n")
            kept = []
            for raw in lines:
                text = raw.decode("utf-8", "replace").rstrip("\r")
                if self._tf_min_level is not None and is_tf_noise(text, self._tf_min_level, self._nvidia, dropped):
                    dropped = True
                    continue
                dropped = False
                kept.append(raw)
                self._offer(text)
            if self._tee and kept:
                try:
                    os.write(out, b"\n".join(kept) + b"\n")
                except OSError:
                    pass
        if pending:
            if self._tee:
                try:
                    os.write(out, pending)
                except OSError:
                    pass
            self._offer(pending.decode("utf-8", "replace"))
        os.close(r)

    def _offer(self, text: str) -> None:
        if self._client is None:
            return
        if "\r" in text:
            text = text.rsplit("\r", 1)[-1]
        if not text.strip():
            return
        try:
            self._lines.put_nowait(text[:_MAX_LINE_CHARS])
        except queue.Full:
            self._dropped += 1

    def _flush(self) -> bool:
        """Sends up to ~256 KB of queued lines; True when the queue is now empty."""
        batch: list[str] = []
        size = 0
        while size < 256 * 1024:
            try:
                line = self._lines.get_nowait()
            except queue.Empty:
                break
            batch.append(line)
            size += 6 * len(line) + 4  # worst case of JSON escaping
        if self._dropped:
            batch.append(f"[{self._dropped} output lines dropped]")
            self._dropped = 0
        if batch and self._client is not None:
            try:
                self._client.request("log", executor_id=self._eid, lines=batch, timeout_s=10.0)
            except _REQ_ERRORS:
                pass
        return self._lines.empty()

    def _send_loop(self) -> None:
        while not self._stop.wait(0.5):
            self._flush()

    def close(self, read_timeout_s: float = 2.0) -> None:
        """After the TF process (and its process group) ended: reads its output to the
        end (at most ``read_timeout_s`` more, for a descendant that still holds a pipe)
        and sends what is left to the driver (at most ~5 s). Idempotent."""
        for t in self._readers:
            t.join(read_timeout_s)
        self._stop.set()
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
        deadline = Deadline(5.0, "the last output lines to reach the driver")
        while not self._flush() and not deadline.expired():
            pass


def emit(node: str, lines: list) -> None:
    """Shows lines a node forwarded (driver, control server thread).

    Writes ``[node] line`` to ``sys.stderr`` (around tfos's progress bar, if one is
    shown; on a terminal, after erasing Spark's progress bar line, see
    :func:`note_spark_bar`), unless the ``tfos.node`` logger itself has handlers: then each line is an
    INFO record of that logger (the user routed node output into logging).

    Args:
        node: The short node name, e.g. ``"worker:0"``.
        lines: The lines (str), at most 1000 are shown, each cut at 2000 characters.
    """
    lines = [str(ln)[:_MAX_LINE_CHARS] for ln in lines[:1000]]
    if node_log.handlers:
        for ln in lines:
            node_log.info("[%s] %s", node, ln)
        return
    text = "".join(f"[{node}] {ln}\n" for ln in lines)
    if not text:
        return
    if _spark_bar and _isatty(sys.stderr):
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
    """Whether Spark draws its own console progress bars (driver).

    tfos then shows no progress bar of its own, so the two never interleave; set
    ``spark.ui.showConsoleProgress=false`` to get tfos's (epochs, rows, rows/s) instead.
    """
    try:
        return str(sc.getConf().get("spark.ui.showConsoleProgress", "false")).lower() == "true"
    except Exception:  # noqa: BLE001 - no conf (stopped context): no Spark bar either
        return False
