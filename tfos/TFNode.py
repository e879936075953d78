"""TFoS-compatible TF-process helpers: ``TFNode.DataFeed``, ``start_cluster_server``... (TF process).

Everything here runs inside ``main_fun(args, ctx)`` on a node.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

from ._node.tf1_export import export_saved_model
from .datafeed import DataFeed
from .node_context import TFNodeContext, absolute_path

log = logging.getLogger(__name__)
#: TFoS's name for this module's logger.
logger = log

__all__ = [
    "DataFeed",
    "TFNodeContext",
    "hdfs_path",
    "start_cluster_server",
    "next_batch",
    "batch_results",
    "terminate",
    "export_saved_model",
    "shard_files",
    "release_port",
]


def hdfs_path(ctx: TFNodeContext, path: str) -> str:
    """``path`` made absolute against ``ctx.defaultFS`` / ``ctx.working_dir`` (TFoS rules).

    See :func:`tfos.node_context.absolute_path`.
    """
    return absolute_path(path, ctx.defaultFS, ctx.working_dir)


def start_cluster_server(ctx: TFNodeContext, num_gpus: int = 1, rdma: bool = False):
    """TF1-style ``(tf.train.ClusterSpec, tf.distribute.Server)`` for this node (TF process).

    Works on TF 2.x for ``tf.compat.v1`` between-graph programs. See
    :func:`tfos.tf_server.start_cluster_server` for the details and errors.
    """
    from .tf_server import start_cluster_server as _start

    return _start(ctx, num_gpus, rdma)


def shard_files(ctx: TFNodeContext, pattern: Any, num_workers: Optional[int] = None) -> list:
    """This worker's share of the input files: ``sorted(glob)[rank::num_workers]``.

    See :func:`tfos.tf_server.shard_files`.
    """
    from .tf_server import shard_files as _shard

    return _shard(ctx, pattern, num_workers)


def release_port(ctx: TFNodeContext) -> None:
    """Closes the socket holding this node's TF port so TensorFlow can bind it (TF process).

    TFoS's ``TFNode.release_port(ctx)``; same as ``ctx.release_port()``. Logs a warning
    when the port was already released (as TFoS did).
    """
    if getattr(ctx, "tmp_socket", None) is None:
        log.warning("release_port() invoked with no bound socket")
        return
    ctx.release_port()


def next_batch(mgr: Any, batch_size: int, qname: str = "input") -> Any:
    """TFoS's functional form of ``DataFeed(mgr, qname_in=qname).next_batch(batch_size)``.

    Prefer a long-lived :class:`DataFeed`: this helper keeps one per queue on ``mgr``
    (the same one :func:`batch_results` and :func:`terminate` use).
    """
    feed = _feed(mgr, qname)
    mgr.__dict__["_tfnode_last_feed"] = feed
    return feed.next_batch(batch_size)


def batch_results(mgr: Any, results: Sequence, qname: str = "output") -> None:
    """TFoS's functional form of ``DataFeed.batch_results``: answers the oldest unanswered
    inference batch of the queue :func:`next_batch` last read (``'input'`` before any).
    ``qname`` is kept for TFoS (results go back on the rows' own connection)."""
    feed = mgr.__dict__.get("_tfnode_last_feed") or _feed(mgr, "input")
    feed.batch_results(results)


def terminate(mgr: Any, qname: str = "input") -> None:
    """TFoS's functional form of ``DataFeed.terminate``."""
    _feed(mgr, qname).terminate()


def _feed(mgr: Any, qname: str) -> DataFeed:
    # One DataFeed per queue: next_batch() and batch_results() must share the batches
    # waiting for results (train_mode changes nothing for inference rows).
    feeds = mgr.__dict__.setdefault("_tfnode_feeds", {})
    if qname not in feeds:
        feeds[qname] = DataFeed(mgr, True, qname_in=qname)
    return feeds[qname]

