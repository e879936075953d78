"""TFoS-compatible ``TFParallel.run``: N independent TensorFlow instances, one per executor (driver).

Use it for embarrassingly parallel work such as batch inference with a single-node model on
every executor, where the instances do not form a TensorFlow cluster::

    def map_fn(args, ctx):         # ctx.executor_id / ctx.task_index = 0..N-1, job 'worker'
        model = tf.keras.models.load_model(args.model)
        ... read this instance's share of the files: TFNode.shard_files(ctx, pattern) ...

    TFParallel.run(sc, map_fn, args, num_executors=4)
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Optional

from tfos._driver import cluster as _cluster
from tfos._driver.user_source import with_source

from .cluster_template import InputMode
from .errors import ClusterFailedError, ConfigurationError, RecoveryFailedError

__all__ = ["run"]

#: TFoS's name for this module's logger: the parent of the driver's cluster loggers
#: (``tfos._driver.*``), which logs the instances' start and failures.
logger = logging.getLogger("tfos._driver")


class _Independent:
    """Wraps ``map_fun`` so each instance runs alone: no TF_CONFIG, its port released."""

    def __init__(self, map_fun: Callable[[Any, Any], Any]):
        # with its file name and source, so an instance's traceback names the user's file
        self.map_fun = with_source(map_fun)

    def __call__(self, args: Any, ctx: Any) -> Any:
        os.environ.pop("TF_CONFIG", None)
        ctx.release_port()
        return self.map_fun(args, ctx)


def run(
    sc: Any,
    map_fn: Optional[Callable[[Any, Any], Any]] = None,
    tf_args: Any = None,
    num_executors: int = 0,
    use_barrier: bool = True,
    timeout: float = 259200,
    **kwargs: Any,
) -> None:
    """Runs ``map_fn(tf_args, ctx)`` on ``num_executors`` executors at once and waits (driver).

    Each instance runs in its own TF process with the same supervision as a cluster node:
    a failing or dying instance makes this call raise within seconds, naming it.
    ``TF_CONFIG`` is not set, since the instances are independent; ``ctx.cluster_spec`` and
    ``ctx.num_workers`` still describe all instances, so ``TFNode.shard_files(ctx, ...)``
    splits input files between them.

    Args:
        sc: The SparkContext.
        map_fn: ``map_fn(args, ctx)`` (TFoS's keyword; ``map_fun=`` is accepted too);
            ``ctx.executor_id``, ``ctx.worker_num`` and ``ctx.task_index`` are
            ``0..num_executors-1`` and ``ctx.job_name`` is 'worker'.
        tf_args: Passed to ``map_fn`` unchanged.
        num_executors: Number of instances (one per executor, all scheduled together).
        use_barrier: Kept for TFoS compatibility; instances are always gang-scheduled, so
            with too few executors this raises (TFoS without barrier would run them one
            after another).
        timeout: Longest wait for every instance to finish, in seconds.
        **kwargs: Passed on to :func:`tfos.TFCluster.run` (e.g. ``reservation_timeout``).

    Raises:
        ConfigurationError: Bad Spark configuration (see ``TFCluster.run``), e.g. fewer
            executors than ``num_executors``; or no ``map_fn``.
        ClusterFailedError: Any instance failed or died.
    """
    del use_barrier
    alias = kwargs.pop("map_fun", None)
    if map_fn is None:
        map_fn = alias
    elif alias is not None:
        raise ConfigurationError("TFParallel.run got both map_fn and map_fun; pass one")
    if map_fn is None or not callable(map_fn):
        raise ConfigurationError("TFParallel.run needs map_fn, a function map_fn(args, ctx)")
    cluster = _cluster.run(sc, _Independent(map_fn), tf_args, num_executors, 0, input_mode=InputMode.TENSORFLOW, **kwargs)
    try:
        cluster.shutdown(timeout=timeout)
    except ClusterFailedError as exc:
        if not isinstance(exc, RecoveryFailedError) and exc.context == "shutdown()":
            exc.context = "TFParallel.run()"  # the caller never called shutdown() itself
        raise
