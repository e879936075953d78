"""GPU selection for nodes (pure; runs in Spark tasks).

tfos uses Spark's own GPU scheduling: when the application sets
``spark.executor.resource.gpu.amount`` / ``spark.task.resource.gpu.amount`` (with a
discovery script), each start task receives GPU addresses, and the node's TF process gets
them as ``CUDA_VISIBLE_DEVICES``. Without Spark GPU resources the environment is left as
it is (all GPUs visible, or none on a CPU host).

TFoS's ``nvidia-smi`` helpers are kept for programs that pick GPUs themselves:
:func:`is_gpu_available`, :func:`get_gpus` and the constants ``MAX_RETRIES``,
``AS_STRING``, ``AS_LIST``.
"""

from __future__ import annotations

import logging
import random
import subprocess
import time
from typing import List, Mapping, Optional, Sequence, Union

__all__ = ["cuda_visible_devices", "is_gpu_available", "get_gpus", "MAX_RETRIES", "AS_STRING", "AS_LIST"]

log = logging.getLogger(__name__)
#: TFoS's name for this module's logger.
logger = log

#: Tries of :func:`get_gpus` before it gives up (30 s, 60 s... apart).
MAX_RETRIES = 3
#: ``get_gpus(format=AS_STRING)``: ``"0,1"``.
AS_STRING = "string"
#: ``get_gpus(format=AS_LIST)``: ``["0", "1"]``.
AS_LIST = "list"

#: Seconds any nvidia-smi call may take.
_SMI_TIMEOUT_S = 60.0
#: Base pause between tries of get_gpus, in seconds (multiplied by the try number).
_RETRY_PAUSE_S = 30.0


def _smi(*args: str) -> str:
    return subprocess.check_output(["nvidia-smi", *args], timeout=_SMI_TIMEOUT_S).decode()


def is_gpu_available() -> bool:
    """True when ``nvidia-smi --list-gpus`` runs and succeeds on this host (any process).

    Unlike :func:`tfos.compat.is_gpu_available` this does not import TensorFlow.
    """
    try:
        _smi("--list-gpus")
        return True
    except (OSError, subprocess.SubprocessError):
        return False


def get_gpus(num_gpu: int = 1, worker_index: int = -1, format: str = AS_STRING) -> Union[str, List[str]]:
    """Picks ``num_gpu`` GPUs that no process is using, according to ``nvidia-smi``.

    Tries up to :data:`MAX_RETRIES` times, pausing 30 s, 60 s, ... between tries.

    Args:
        num_gpu: Number of GPUs wanted.
        worker_index: Placement hint: GPUs ``[i*num_gpu, (i+1)*num_gpu)`` of the free ones
            (wrapping around); -1 picks free GPUs at random.
        format: :data:`AS_STRING` (``"0,1"``) or :data:`AS_LIST` (``["0", "1"]``).

    Returns:
        The GPU indices, as a comma-separated string or a list of strings.

    Raises:
        RuntimeError: Fewer than ``num_gpu`` free GPUs after every try (the message lists the
            processes using them).
        ValueError: Unknown ``format``.
        OSError, subprocess.SubprocessError: ``nvidia-smi`` is missing or failed.
    """
    if format not in (AS_STRING, AS_LIST):
        raise ValueError(f"unknown GPU format {format!r}; use gpu_info.AS_STRING or gpu_info.AS_LIST")
    all_gpus = [tuple(c.strip() for c in line.split(",")) for line in _smi("--query-gpu=index,uuid", "--format=csv,noheader").splitlines() if line.strip()]
    free: List[str] = []
    for attempt in range(1, MAX_RETRIES + 1):
        busy = {line.strip() for line in _smi("--query-compute-apps=gpu_uuid", "--format=csv,noheader").splitlines() if line.strip()}
        free = [idx for idx, uuid in all_gpus if uuid not in busy]
        if len(free) >= num_gpu:
            break
        log.warning("only %d of the %d requested GPUs are free (try %d of %d)", len(free), num_gpu, attempt, MAX_RETRIES)
        if attempt < MAX_RETRIES:
            time.sleep(_RETRY_PAUSE_S * attempt)
    if len(free) < num_gpu:
        apps = _smi("--query-compute-apps=gpu_uuid,pid,process_name,used_gpu_memory", "--format=csv")
        raise RuntimeError(f"unable to find {num_gpu} free GPU(s) among {len(all_gpus)}; GPU processes:\n{apps}")
    if worker_index < 0:
        chosen = random.sample(free, num_gpu)
    else:
        start = worker_index * num_gpu
        if start + num_gpu > len(free):
            start = start % len(free)
        chosen = (free[start:] + free[:start])[:num_gpu]
    log.info("using GPU(s) %s of the free %s", chosen, free)
    return ",".join(chosen) if format == AS_STRING else chosen


def cuda_visible_devices(resources: Mapping[str, Sequence[str]]) -> Optional[str]:
    """The ``CUDA_VISIBLE_DEVICES`` value for a task's Spark resources.

    Args:
        resources: Resource name -> addresses, from ``TaskContext.resources()``.

    Returns:
        Comma-separated GPU addresses in the order Spark assigned them (e.g. ``"1,3"``),
        or None when the task was assigned no GPU resource.

    Raises:
        ValueError: When an address is not a non-negative integer (a broken discovery
            script); the message names the address.
    """
    addrs = list(resources.get("gpu", ()))
    if not addrs:
        return None
    for a in addrs:
        if not str(a).strip().isdigit():
            raise ValueError(f"Spark assigned GPU address {a!r}, which is not a GPU index; check the discovery script")
    return ",".join(str(a).strip() for a in addrs)
