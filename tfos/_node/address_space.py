"""The address-space limit (``RLIMIT_AS``) of a node's processes: raised where the hard
limit allows it, named in the failure of a node that died under it (node processes).

With ``spark.executor.pyspark.memory`` set, PySpark limits each Python worker's address
space, soft and hard limit alike; a start task's supervisor and TF process inherit it.
TensorFlow reserves far more address space than it uses, so it fails under such limits
with errors that never mention them. :func:`memory_limit_note` (TF process, for an
exception of ``main_fun``) and :func:`memory_limit_exit_hint` (supervisor, for a TF process
killed by a signal) name the limit, the setting and the fix.

User docs: docs/api.md, "Memory limits".
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Optional

__all__ = ["address_space_limit", "address_space_hard_limit", "raise_address_space_limit", "memory_limit_text",
           "memory_limit_exit_hint", "memory_limit_note"]

log = logging.getLogger(__name__)


def _limits() -> tuple[Optional[int], Optional[int]]:
    """This process's soft and hard ``RLIMIT_AS`` in bytes, None for unlimited (or unknown)."""
    try:
        import resource

        limits = resource.getrlimit(resource.RLIMIT_AS)
        unlimited = resource.RLIM_INFINITY
    except (ImportError, OSError, ValueError, AttributeError):
        return None, None
    soft, hard = (None if v == unlimited or v < 0 else int(v) for v in limits)
    return soft, hard


def address_space_limit() -> Optional[int]:
    """This process's soft ``RLIMIT_AS`` in bytes; None when unlimited or unknown."""
    return _limits()[0]


def address_space_hard_limit() -> Optional[int]:
    """The hard ``RLIMIT_AS`` (what a TF process raises its soft limit to); None when unlimited."""
    return _limits()[1]


def raise_address_space_limit() -> Optional[int]:
    """Raises the soft ``RLIMIT_AS`` to the hard limit (TF process): Spark's own
    ``spark.executor.pyspark.memory`` sets both to one value, so this helps only where
    something else set a soft limit under the hard one. Returns the limit left in force
    (None: unlimited); logged when it changed."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        if soft != hard and soft != resource.RLIM_INFINITY:
            resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
            log.info("tfos: raised this TF process's address-space limit (RLIMIT_AS) from %d bytes to %s", soft,
                     "unlimited" if hard == resource.RLIM_INFINITY else f"{hard} bytes (the hard limit)")
    except (ImportError, OSError, ValueError, AttributeError) as exc:
        log.warning("tfos: could not raise the address-space limit (RLIMIT_AS): %s", exc)
    return address_space_limit()


def memory_limit_text(limit: int) -> str:
    """Why a TF process fails under an address-space limit of ``limit`` bytes, where the
    limit comes from and the fix (pure but for the environment variable Spark sets)."""
    mib = os.environ.get("PYSPARK_EXECUTOR_MEMORY_MB", "")
    if mib.isdigit():
        source = (f"which Spark set for the executor's Python worker from spark.executor.pyspark.memory ({mib} MiB); "
                  "the start task's node processes inherit it and cannot raise it")
    else:
        source = "set outside Spark (ulimit -v, or the container or cluster manager); the node's processes inherit it"
    return (
        f"the node ran under an address-space limit (RLIMIT_AS) of {limit / 2**30:.1f} GiB, {source}. TensorFlow "
        "reserves far more address space than it uses (its shared libraries, a stack per thread, allocator arenas), "
        "so under such a limit it fails with errors like 'failed to map segment', MemoryError, 'pthread_create() "
        "failed' or a SIGABRT. Fix: leave spark.executor.pyspark.memory unset for the executors of a tfos cluster, "
        "or size it for TensorFlow (see docs/api.md, 'Memory limits')"
    )


def memory_limit_exit_hint(code: int) -> str:
    """For a TF process that died with exit status ``code`` (negative: a signal): the
    address-space limit in force, or '' when there is none or the death was a SIGKILL
    (a memory killer's, see ``kill_hint``) or a clean exit (supervisor)."""
    limit = address_space_hard_limit()
    if code == 0 or code == -signal.SIGKILL or limit is None:
        return ""
    return "; " + memory_limit_text(limit)


#: Text of errors that running out of address space causes (lower case).
_MEMORY_SIGNS = (
    "memory", "allocat", "map segment", "mmap", "pthread", "thread creat", "create thread", "start new thread", "bad_alloc",
    "resource temporarily unavailable", "resourceexhausted",
)


def memory_limit_note(exc: BaseException) -> str:
    """For a ``main_fun`` exception that looks like a failed allocation (MemoryError, a
    failed mmap, thread or library load) in a TF process under an address-space limit:
    the limit, the setting and the fix; else '' (TF process)."""
    limit = address_space_limit()
    if limit is None:
        return ""
    seen: set = set()
    e: Optional[BaseException] = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        text = f"{type(e).__name__} {e}".lower()
        if isinstance(e, MemoryError) or any(s in text for s in _MEMORY_SIGNS):
            return " [" + memory_limit_text(limit) + "]"
        e = e.__cause__ or e.__context__
    return ""
