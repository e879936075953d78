"""TensorBoard on the lead node (TF process): started next to ``main_fun``, its URL (or why
it did not start) reported to the driver."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Optional

from tfos._common.deadline import Deadline
from tfos._control import messages as _msg
from tfos._control.client import ControlClient
from tfos._node.context import TFNodeContext, absolute_path
from tfos._node.launch import NodeLaunch
from tfos.errors import ControlProtocolError, DeadlineExceededError

__all__ = ["start_tensorboard"]

log = logging.getLogger(__name__)

_TENSORBOARD_MODULE = "tensorboard.main"
#: Seconds TensorBoard gets to listen on its port.
_TENSORBOARD_START_S = 90.0
#: Characters of a failed TensorBoard's stderr sent to the driver (its end).
_TENSORBOARD_STDERR_CHARS = 4000


def start_tensorboard(launch: NodeLaunch, ctx: TFNodeContext, client: ControlClient) -> Optional[subprocess.Popen]:
    """Starts TensorBoard and, from a thread, reports its URL to the driver once it listens,
    or its stderr when it exits (or never listens) first (TF process)."""
    cfg = launch.config
    # Default: 'tensorboard_<id>' in the executor's own directory (TFoS), where a main_fun that
    # writes to that relative path puts its summaries (ctx.working_dir is the driver's). A
    # log_dir given to run() resolves as ctx.absolute_path does (a relative one under the
    # driver's working directory), so main_fun can write to ctx.absolute_path(log_dir).
    if cfg.log_dir:
        logdir = absolute_path(cfg.log_dir, cfg.default_fs, cfg.driver_working_dir or launch.working_dir)
    else:
        logdir = absolute_path(f"tensorboard_{launch.role.executor_id}", cfg.default_fs, launch.working_dir)
    if logdir.startswith("file://"):
        logdir = logdir[len("file://"):]
    with socket.socket() as s:
        s.bind((launch.host, 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", _TENSORBOARD_MODULE, "--logdir", logdir, "--port", str(port), "--host", launch.host]
    eid = launch.role.executor_id

    def _report_error(text: str) -> None:
        log.error("TensorBoard did not start: %s", text)
        try:
            client.call(_msg.TensorBoard(executor_id=eid, url="", error=text), timeout_s=10.0)
        except (OSError, ControlProtocolError, DeadlineExceededError) as exc:
            log.warning("could not report the TensorBoard failure: %s", exc)

    # stderr goes to an unnamed temporary file: read back when TensorBoard fails, never
    # a pipe that a chatty TensorBoard could fill.
    import tempfile

    err_file = tempfile.TemporaryFile()
    try:
        # No preexec_fn (unsafe in a threaded process): TensorBoard stays in the TF process's
        # process group, which the supervisor kills when the node ends (_supervisor._end_group).
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err_file, close_fds=True)
    except OSError as exc:
        err_file.close()
        _report_error(f"could not run {' '.join(cmd[:3])}: {exc}")
        return None
    url = f"http://{launch.host}:{port}/"

    def _stderr_tail() -> str:
        try:
            err_file.seek(0, os.SEEK_END)
            size = err_file.tell()
            err_file.seek(max(0, size - _TENSORBOARD_STDERR_CHARS))
            return err_file.read().decode("utf-8", "replace").strip()
        except (OSError, ValueError):
            return ""

    def _wait_ready() -> None:
        deadline = Deadline(_TENSORBOARD_START_S, "TensorBoard to listen")
        while not deadline.expired() and proc.poll() is None:
            try:
                with socket.create_connection((launch.host, port), timeout=1.0):
                    break
            except OSError:
                time.sleep(0.5)
        code = proc.poll()
        if code is not None or deadline.expired():
            what = f"exited with {code}" if code is not None else f"not listening on port {port} after {_TENSORBOARD_START_S:g} s"
            _report_error(f"{' '.join(cmd)} {what}; its stderr:\n{_stderr_tail() or '(empty)'}")
            err_file.close()
            return
        try:
            client.call(_msg.TensorBoard(executor_id=eid, url=url), timeout_s=10.0)
        except (OSError, ControlProtocolError, DeadlineExceededError) as exc:
            log.warning("could not report the TensorBoard URL: %s", exc)
        err_file.close()  # TensorBoard keeps its own descriptor; the file vanishes with it

    threading.Thread(target=_wait_ready, name="tfos-tensorboard", daemon=True).start()
    return proc
