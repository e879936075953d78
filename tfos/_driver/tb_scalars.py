"""The nodes' live figures as TensorBoard scalars, one run per node (driver).

With ``run(..., tensorboard=True)`` the status monitor writes, under the cluster's log
dir, a ``tfos/`` folder with one run per node (``tfos/chief_0``, ``tfos/worker_1``, ...),
so TensorBoard draws one line per node on each chart, next to the model's own runs:

- ``tfos/rows_per_s``: rows main_fun took from the feed per second;
- ``tfos/feed_wait_pct``: percent of main_fun's time spent in the feed;
- ``tfos/steps_per_s``: Keras training steps per second (where Keras counts them);
- ``tfos/cpu_pct``: CPU of the TF process, in percent of one core;
- ``tfos/rss_mib``: resident memory of the node's process tree, in MiB;
- ``tfos/queue_fill_pct``: the fill of its input queue, in percent.

Event files are written with TensorBoard's own record format (``tensorboard.summary.writer``
and its protobufs, no TensorFlow import on the driver), to a local directory: a log dir on
another file system (``hdfs://``, ``gs://``) gets no tfos scalars (one WARNING says so).
docs/status.md "In TensorBoard".
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any, Optional

__all__ = ["ScalarWriter", "scalar_dir", "scalar_writer", "EVERY_S"]

log = logging.getLogger(__name__)

#: Seconds between two points of one node's scalars.
EVERY_S = 5.0


def scalar_dir(log_dir: Optional[str], default_fs: str, driver_working_dir: str) -> Optional[str]:
    """The local directory of the tfos runs: ``<log dir>/tfos`` (driver).

    Args:
        log_dir: ``run()``'s ``log_dir``; None: ``tensorboard_tfos`` in the driver's
            working directory (the nodes' default log dir is on their executors).
        default_fs: Spark's ``fs.defaultFS``, for a log dir without a scheme.
        driver_working_dir: Where a relative log dir is resolved (as on the nodes).

    Returns:
        The directory, or None when it is not on a local file system.
    """
    from tfos._node.context import absolute_path

    path = absolute_path(log_dir, default_fs, driver_working_dir) if log_dir else os.path.join(driver_working_dir, "tensorboard_tfos")
    if path.startswith("file://"):
        path = path[len("file://"):]
    if "://" in path:
        return None
    return path if log_dir is None else os.path.join(path, "tfos")


class ScalarWriter:
    """Writes each node's figures every :data:`EVERY_S` seconds (driver; the status
    monitor's thread). Step = whole seconds since the cluster attempt started.

    Args:
        root: The ``tfos`` directory (from :func:`scalar_dir`).
    """

    def __init__(self, root: str) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.record_writer import RecordWriter

        self.root = root
        self._event_pb2, self._summary_pb2, self._record_writer = event_pb2, summary_pb2, RecordWriter
        self._files: dict[str, Any] = {}
        self._last: dict[int, float] = {}
        self._failed = False

    def _writer(self, run: str) -> Any:
        w = self._files.get(run)
        if w is None:
            d = os.path.join(self.root, run)
            os.makedirs(d, exist_ok=True)
            name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}.tfos"
            w = self._record_writer(open(os.path.join(d, name), "ab"))
            ev = self._event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2")
            w.write(ev.SerializeToString())
            self._files[run] = w
        return w

    def write(self, monitor: Any, eids: list[int], force: bool = False) -> None:
        """Writes the scalars of nodes ``eids`` (those with new figures) that are due
        (``force``: all of them, the last point when the attempt ends)."""
        if self._failed:
            return
        now = time.monotonic()
        step = int(now - monitor.started)
        due = {eid for eid in eids if force or now - self._last.get(eid, -1e9) >= EVERY_S}
        if not due:
            return
        rows = {r["executor_id"]: r for r in monitor.node_rows(due)}
        try:
            for eid in sorted(due):
                row = rows.get(eid)
                if row is None or row["rows_per_s"] is None:
                    continue
                self._last[eid] = now
                values = {
                    "tfos/rows_per_s": row["rows_per_s"],
                    "tfos/feed_wait_pct": 100.0 * (row["feed_wait_share"] or 0.0),
                    "tfos/cpu_pct": 100.0 * (row["cpu_share"] or 0.0),
                    "tfos/rss_mib": row["rss_bytes"] / 2**20,
                    "tfos/queue_fill_pct": 100.0 * (row["queue_fill"] or 0.0),
                }
                if row["steps_per_s"] is not None:
                    values["tfos/steps_per_s"] = row["steps_per_s"]
                summary = self._summary_pb2.Summary(value=[
                    self._summary_pb2.Summary.Value(tag=t, simple_value=float(v)) for t, v in values.items()])
                w = self._writer(row["node"].replace(":", "_"))
                w.write(self._event_pb2.Event(wall_time=time.time(), step=step, summary=summary).SerializeToString())
                w.flush()
        except OSError as exc:
            self._failed = True
            log.warning("tfos: cannot write the nodes' figures to TensorBoard under %s: %s (no more tried)", self.root, exc)

    def close(self) -> None:
        """Closes the event files."""
        for w in self._files.values():
            try:
                w.close()
            except OSError:
                pass
        self._files.clear()


def scalar_writer(config: Any) -> Optional[ScalarWriter]:
    """The writer of an attempt whose ``ClusterConfig`` has TensorBoard on, else None
    (driver). Logs a WARNING when the log dir is not local or TensorBoard's writer is not
    installed on the driver, and INFO where the scalars go."""
    if not config.tensorboard:
        return None
    root = scalar_dir(config.log_dir, config.default_fs, config.driver_working_dir)
    if root is None:
        log.warning("tfos: the nodes' figures are written to TensorBoard on local log dirs only; %s is not one", config.log_dir)
        return None
    try:
        writer = ScalarWriter(root)
    except ImportError as exc:
        log.warning("tfos: no TensorBoard scalars of the nodes' figures: the driver cannot import TensorBoard (%s)", exc)
        return None
    log.info("tfos: the nodes' figures go to TensorBoard runs under %s", root)
    return writer
