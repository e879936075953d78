"""``TFNodeContext``, the ``ctx`` of ``main_fun(args, ctx)`` (TF process), and the path
helpers it uses: the public, TFoS-compatible module. The implementation runs in the node's
TF process and lives in :mod:`tfos._node.context`; see docs/api.md "ctx"."""

from __future__ import annotations

from tfos._node.context import HADOOP_SCHEMES, TFNodeContext, absolute_path, normalize_default_fs

__all__ = ["TFNodeContext", "absolute_path", "normalize_default_fs", "HADOOP_SCHEMES"]
