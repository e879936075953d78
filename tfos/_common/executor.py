"""Where a Spark task's Python process runs: its executor and the host address its peers
reach (Spark task side: the start task, feed tasks, Connect tasks)."""

from __future__ import annotations

import os
import socket

__all__ = ["executor_identity", "node_host"]


def executor_identity() -> tuple[str, int]:
    """Identity of the Spark executor this Python process belongs to (Spark task side).

    Returns:
        ``(key, jvm_pid)`` where key is ``"<hostname>/<pid of the nearest java ancestor>"``.
        Every Python worker of one executor gets the same key; under ``local[N]`` every
        worker shares the driver JVM, hence one key. ``jvm_pid`` is 0 when no java
        ancestor is found (then the key uses this process's parent).
    """
    import psutil

    host = socket.gethostname()
    try:
        for parent in psutil.Process().parents():
            try:
                if parent.name().startswith("java"):
                    return f"{host}/{parent.pid}", parent.pid
            except psutil.Error:
                continue
    except psutil.Error:
        pass
    return f"{host}/{os.getppid()}", 0


def node_host(driver_host: str, driver_port: int) -> str:
    """The address other nodes should use to reach this host (Spark task side).

    ``TFOS_NODE_HOST`` wins; else the local address of the route to the driver (no packet
    is sent); else ``SPARK_LOCAL_IP``; else the hostname.
    """
    explicit = os.environ.get("TFOS_NODE_HOST")
    if explicit:
        return explicit
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((driver_host, driver_port))
            addr = s.getsockname()[0]
            if addr and addr != "0.0.0.0":
                return addr
    except OSError:
        pass
    return os.environ.get("SPARK_LOCAL_IP") or socket.gethostname()
