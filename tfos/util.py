"""TFoS's ``util`` helpers (pure; driver, Spark tasks or TF process).

``single_node_env`` prepares a process for single-node TensorFlow (Hadoop class path,
GPU selection); the others are small host helpers TFoS programs import.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
from typing import Sequence, Union

from . import gpu_info

__all__ = ["single_node_env", "get_ip_address", "find_in_path", "write_executor_id", "read_executor_id"]

log = logging.getLogger(__name__)
#: TFoS's name for this module's logger.
logger = log

#: File holding the executor id, in the current working directory (TFoS's name).
EXECUTOR_ID_FILE = "executor_id"


def single_node_env(num_gpus: int = 1, worker_index: int = -1, nodes: Sequence[str] = ()) -> None:
    """Sets up this process for single-node TensorFlow (Spark task or TF process).

    * With ``HADOOP_PREFIX`` set, appends ``hadoop classpath --glob`` to ``CLASSPATH`` once
      (TensorFlow's HDFS file system needs the expanded class path).
    * Sets ``CUDA_VISIBLE_DEVICES``: ``num_gpus`` free GPUs (see :func:`gpu_info.get_gpus`)
      when GPUs are present and ``num_gpus`` > 0, else ``''`` (CPU). ``worker_index`` and
      ``nodes`` (``["host:port", ...]``) spread the nodes of one host over its GPUs.

    Args:
        num_gpus: GPUs to reserve (0: CPU only).
        worker_index: This node's index in ``nodes`` (-1: unknown; GPUs picked at random).
        nodes: Addresses of all nodes, to compute the index among this host's nodes.

    Raises:
        subprocess.CalledProcessError: ``hadoop classpath`` failed.
        RuntimeError: Not enough free GPUs after :data:`gpu_info.MAX_RETRIES` tries.
    """
    if "HADOOP_PREFIX" in os.environ and "TFOS_CLASSPATH_UPDATED" not in os.environ:
        hadoop = os.path.join(os.environ["HADOOP_PREFIX"], "bin", "hadoop")
        extra = subprocess.check_output([hadoop, "classpath", "--glob"], timeout=120).decode().strip()
        current = os.environ.get("CLASSPATH", "")
        os.environ["CLASSPATH"] = current + os.pathsep + extra if current else extra
        os.environ["TFOS_CLASSPATH_UPDATED"] = "1"
    if num_gpus > 0 and gpu_info.is_gpu_available():
        index = worker_index
        if worker_index >= 0 and nodes:
            mine = nodes[worker_index]
            host = mine.split(":")[0]
            index = [n for n in nodes if n.split(":")[0] == host].index(mine)
        gpus = gpu_info.get_gpus(num_gpus, index)
        log.info("using GPU(s) %s", gpus)
        os.environ["CUDA_VISIBLE_DEVICES"] = str(gpus)
    else:
        log.info("using the CPU")
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


def get_ip_address() -> str:
    """This host's IP address as other hosts see it (pure; no packet is sent).

    ``TFOS_NODE_HOST`` wins; else the source address of the default route (a UDP
    ``connect``, which sends nothing); else ``SPARK_LOCAL_IP``; else the address of the
    host name (which may be a loopback address on hosts without a network).
    """
    explicit = os.environ.get("TFOS_NODE_HOST")
    if explicit:
        return explicit
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: only selects a route, never reached
            addr = s.getsockname()[0]
            if addr and addr != "0.0.0.0":
                return addr
    except OSError:
        pass
    local = os.environ.get("SPARK_LOCAL_IP")
    if local:
        return local
    try:
        return socket.gethostbyname(socket.getfqdn())
    except OSError:
        return "127.0.0.1"


def find_in_path(path: str, file: str) -> Union[str, bool]:
    """The first ``<dir>/<file>`` that is a regular file, for ``dir`` in ``path`` (pure).

    Args:
        path: Directories separated by ``os.pathsep`` (like ``PATH``).
        file: A file name or relative path, e.g. ``tensorboard`` or ``tensorboard/main.py``.

    Returns:
        The path found, or False (TFoS's return value) when there is none.
    """
    for d in path.split(os.pathsep):
        candidate = os.path.join(d, file)
        if os.path.isfile(candidate):
            return candidate
    return False


def write_executor_id(num: int) -> None:
    """Writes ``num`` to the file ``executor_id`` in the current directory (Spark task)."""
    with open(EXECUTOR_ID_FILE, "w") as f:
        f.write(str(int(num)))


def read_executor_id() -> int:
    """Reads the id written by :func:`write_executor_id` from the current directory.

    tfos itself does not need this file (``ctx.executor_id`` is always set); it is kept for
    TFoS programs that call it after :func:`write_executor_id`.

    Raises:
        FileNotFoundError: No ``executor_id`` file here; the message names the directory.
    """
    if not os.path.isfile(EXECUTOR_ID_FILE):
        raise FileNotFoundError(
            f"no {EXECUTOR_ID_FILE} file in {os.getcwd()}: write_executor_id() was not called in this "
            "working directory (in a tfos cluster use ctx.executor_id instead)"
        )
    with open(EXECUTOR_ID_FILE) as f:
        return int(f.read().strip())
