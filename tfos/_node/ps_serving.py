"""A worker that serves as TensorFlow's parameter-server tutorial writes it: ``server.join()`` (TF process).

Under ``ParameterServerStrategy`` the ps and worker tasks only run a TensorFlow server; the
tutorial's program starts one (``tf.distribute.Server(...)``, or TFoS's
``TFNode.start_cluster_server(ctx)``) and calls ``server.join()``, which never returns. On a
ps node tfos ends the process when the cluster stops; a worker node's ``main_fun``, though, is
waited for by ``shutdown()``. So on a worker of a cluster with a chief and ps tasks,
``Server.join()`` does what :func:`tfos.tf_server.run_server_and_wait` does: it tells the driver
the node only serves now (``shutdown()`` waits for the chief alone, and a lost worker is a state,
not the cluster's failure: docs/parameter_servers.md), then waits until the driver stops the
cluster and returns. Everywhere else ``join()`` is TensorFlow's. Installed by the TF process
before ``main_fun``; TensorFlow's module is patched when ``main_fun`` imports it.
"""

from __future__ import annotations

from typing import Any

from tfos._node import import_hooks

#: The module that defines ``tf.distribute.Server``.
SERVER_MODULE = "tensorflow.python.training.server_lib"
_CTX: list = []


def coordinated(cluster_spec: Any) -> bool:
    """Whether a cluster spec has a chief to coordinate and ps tasks (pure)."""
    return bool(cluster_spec.get("chief")) and bool(cluster_spec.get("ps"))


def install(ctx: Any) -> bool:
    """Arranges for ``Server.join()`` to serve until the cluster stops on this node, when it is a
    worker of a cluster with a chief and ps tasks (TF process). Returns whether it applies."""
    if ctx.job_name != "worker" or not coordinated(ctx.cluster_spec):
        return False
    _CTX[:] = [ctx]
    import_hooks.when_imported(SERVER_MODULE, _patch)
    return True


def _patch(module: Any) -> None:
    Server = module.Server
    if getattr(Server.join, "_tfos_serving", False):
        return
    tf_join = Server.join

    def join(self: Any) -> None:
        ctx = _CTX[0] if _CTX else None
        if ctx is None:
            return tf_join(self)
        if getattr(ctx, "mgr", None) is not None:
            from tfos._node import ps_feed

            ps_feed.serve(ctx)  # fed (InputMode.SPARK): the coordinator's per-worker datasets read this node's feed
        ctx.on_serving()  # the driver: shutdown() does not wait for this node
        ctx.stop_event.wait()  # until the driver stops the cluster (the supervisor ends us if it goes)

    join._tfos_serving = True  # type: ignore[attr-defined]
    join.__wrapped__ = tf_join  # type: ignore[attr-defined]
    Server.join = join
