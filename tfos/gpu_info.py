"""GPU selection for nodes (pure; runs in Spark tasks).

tfos uses Spark's own GPU scheduling: when the application sets
``spark.executor.resource.gpu.amount`` / ``spark.task.resource.gpu.amount`` (with a
discovery script), each start task receives GPU addresses, and the node's TF process gets
them as ``CUDA_VISIBLE_DEVICES``. Without Spark GPU resources the environment is left as
it is (all GPUs visible, or none on a CPU host).
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

__all__ = ["cuda_visible_devices"]


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
