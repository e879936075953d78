"""Deterministic per-worker data sharding: a node's rank among the data-consuming nodes
and its share of the input files (anywhere; TensorFlow optional)."""

from __future__ import annotations

import glob as _glob_module
import logging
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["LEADER_JOBS", "shard_files", "worker_rank"]

logger = logging.getLogger(__name__)

#: Jobs whose tasks rank before the 'worker' tasks in :func:`worker_rank`, in order.
LEADER_JOBS: tuple[str, ...] = ("chief", "master")

_GLOB_CHARS = frozenset("*?[")



def _count_data_workers(spec: dict[str, list[str]]) -> int:
    return sum(len(spec.get(job, ())) for job in LEADER_JOBS + ("worker",))


def worker_rank(ctx: Any) -> int:
    """Return the node's rank among the data-consuming nodes.

    Rule: chief/master tasks come first, then the ``'worker'`` tasks. With a
    chief (or master) in the cluster the chief is rank 0 and worker task ``i``
    is rank ``i + 1``; without one, worker task ``i`` is rank ``i``. (With
    both a chief and a master, the chief precedes the master.) ps and
    evaluator nodes consume no training data and have no rank.

    Runs anywhere; needs no TensorFlow.

    Args:
        ctx: The tfos node context (``job_name``, ``task_index``, ``cluster_spec``).

    Returns:
        The rank, in ``[0, number of chief/master/worker tasks)``.

    Raises:
        ValueError: For ps/evaluator nodes, or if the task is not in the
            cluster spec.
    """
    job = ctx.job_name
    index = ctx.task_index
    spec = ctx.cluster_spec
    if job not in LEADER_JOBS and job != "worker":
        raise ValueError(
            f"tfos: a {job!r} node has no worker rank; only chief/master/worker nodes "
            "shard training data. Pass an explicit index to shard_files() instead."
        )
    tasks = spec.get(job)
    if tasks is not None and not 0 <= index < len(tasks):
        raise ValueError(
            f"tfos: task_index {index} out of range for job {job!r} with {len(tasks)} task(s)."
        )
    rank = 0
    for leader in LEADER_JOBS:
        if leader == job:
            return rank + index
        rank += len(spec.get(leader, ()))
    return rank + index


def _has_glob(pattern: str) -> bool:
    return any(ch in _GLOB_CHARS for ch in pattern)


def _glob(pattern: str) -> list[str]:
    """Glob with ``tf.io.gfile`` (any TF filesystem) or, without TF, ``glob``."""
    try:
        import tensorflow as tf
    except ImportError:
        return _glob_module.glob(pattern)
    return list(tf.io.gfile.glob(pattern))


def shard_files(
    ctx_or_index: Any | int,
    pattern_or_list: str | Sequence[str],
    num_workers: int | None = None,
) -> list[str]:
    """Return this worker's share of the input files.

    The files are listed (a string is a glob pattern; in a list, entries with
    ``*``, ``?`` or ``[`` are expanded and other entries taken verbatim),
    de-duplicated, sorted, and then every ``num_workers``-th file starting at
    the worker's rank is kept: ``files[rank::num_workers]``. All workers must
    see the same listing for the shards to be disjoint and complete.

    Globbing uses ``tf.io.gfile.glob`` (so ``hdfs://``, ``gs://`` etc. work)
    when TensorFlow is importable, else :func:`glob.glob`. Runs in the TF
    process (or anywhere for an explicit index).

    Args:
        ctx_or_index: The node context, whose rank is :func:`worker_rank`
            (chief/master first, then workers), or an explicit integer rank.
        pattern_or_list: A glob pattern, or a list of paths/patterns.
        num_workers: Number of data-consuming workers. Defaults, for a
            context, to the number of chief/master/worker tasks in its cluster
            spec (falling back to ``ctx.num_workers``); required with an
            integer rank.

    Returns:
        The sorted list of this worker's files (never empty).

    Raises:
        ValueError: If nothing matches, there are fewer files than workers
            (some worker would get none), or the rank/count is invalid.
    """
    if isinstance(ctx_or_index, bool):
        raise ValueError("tfos: shard_files() needs a node context or an int rank, not a bool.")
    if isinstance(ctx_or_index, int):
        rank = ctx_or_index
        if num_workers is None:
            raise ValueError("tfos: shard_files() with an integer rank needs num_workers.")
    else:
        rank = worker_rank(ctx_or_index)
        if num_workers is None:
            num_workers = _count_data_workers(ctx_or_index.cluster_spec) or int(
                getattr(ctx_or_index, "num_workers", 0)
            )
    if num_workers < 1:
        raise ValueError(f"tfos: num_workers must be >= 1, got {num_workers}.")
    if not 0 <= rank < num_workers:
        raise ValueError(f"tfos: worker rank {rank} is out of range for {num_workers} worker(s).")

    patterns: Iterable[str]
    if isinstance(pattern_or_list, str):
        files = _glob(pattern_or_list)
        patterns = [pattern_or_list]
    else:
        patterns = list(pattern_or_list)
        files = []
        for entry in patterns:
            files.extend(_glob(entry) if _has_glob(entry) else [entry])
    files = sorted(set(files))
    if not files:
        raise ValueError(f"tfos: no input files match {list(patterns)!r}.")
    if len(files) < num_workers:
        raise ValueError(
            f"tfos: only {len(files)} input file(s) for {num_workers} workers, so some workers "
            "would get no data. Split the input into at least as many files as workers (e.g. "
            "repartition before writing), or run fewer workers."
        )
    shard = files[rank::num_workers]
    logger.info(
        "worker rank %d/%d reads %d of %d file(s)", rank, num_workers, len(shard), len(files)
    )
    return shard
