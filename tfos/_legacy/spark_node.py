"""The body of TFoS's ``TFSparkNode`` (Spark task; not used by ``TFCluster.run``); its public
path is :mod:`tfos.TFSparkNode`.

``TFCluster.run`` starts every node as a supervised TF process (see docs/architecture.md).
This module keeps TFoS's building block for programs that call it directly:
:func:`run` returns a ``mapPartitions`` function that turns one Spark task into one
TensorFlow node *in the task's own Python process*: it picks GPUs, starts a
:mod:`tfos.TFManager`, registers with a :class:`tfos.reservation.Server`, waits for the
other nodes, sets ``TF_CONFIG`` and calls ``fn(tf_args, ctx)`` in the foreground. It has
none of tfos's supervision (a dead node is not detected); prefer ``TFCluster.run``.

TFoS's feeding functions (``train``, ``inference``, ``shutdown``) are replaced by the
``TFCluster`` methods of the same names. Their names are kept so that a TFoS program that
refers to them still imports, and calling one raises an error that names its replacement;
they are not in ``__all__``: tfos offers them to nobody.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import uuid
from typing import Any, Callable, Dict, Iterable, List, Optional

from tfos import gpu_info, util
from tfos._control.messages import NodeState
from tfos._legacy import manager, reservation
from tfos._node.context import TFNodeContext
from tfos.errors import TFOSError

__all__ = ["TFNodeContext", "TFSparkNode", "run"]

log = logging.getLogger("tfos.TFSparkNode")  # TFoS's module name: its public logger
#: TFoS's name for this module's logger.
logger = log


class TFSparkNode:
    """Per-process state of :func:`run` (TFoS kept the same two class attributes)."""

    mgr: Any = None  #: The TFManager of the node running in this process.
    cluster_id: Any = None  #: The cluster it belongs to.


def _has_spark_resource_api() -> bool:
    """True when PySpark has the resource API (``TaskContext.resources()``, Spark 3+)."""
    import pyspark

    try:
        return int(str(pyspark.__version__).split(".")[0]) >= 3
    except ValueError:
        return False


def _get_cluster_spec(sorted_cluster_info: Iterable[Dict[str, Any]]) -> Dict[str, List[str]]:
    """``{job: ["host:port", ...]}`` from reservations sorted by executor id.

    Raises:
        TFOSError: Two reservations have the same executor id (a retried task).
    """
    spec: Dict[str, List[str]] = {}
    last = None
    for node in sorted_cluster_info:
        if node["executor_id"] == last:
            raise TFOSError(f"duplicate reservation for executor {last} in cluster_info")
        last = node["executor_id"]
        spec.setdefault(node["job_name"], []).append(f"{node['host']}:{node['port']}")
    return spec


def _set_gpus(tf_args: Any, job_name: str, task_index: int, cluster_spec: Optional[Dict[str, List[str]]] = None) -> None:
    """Sets ``CUDA_VISIBLE_DEVICES`` the way TFoS did (Spark task).

    Spark's GPU resources first (``tf_args.num_gpus``, when given, truncates them); else, off
    Kubernetes and with ``nvidia-smi`` GPUs present, ``num_gpus`` (default 1) free GPUs, spread
    over the nodes of this host; else no GPU.

    Raises:
        TFOSError: ``tf_args.num_gpus`` GPUs were requested but fewer could be allocated.
    """
    gpus: List[str] = []
    on_k8s = "SPARK_EXECUTOR_POD_IP" in os.environ
    try:
        user_requested = "num_gpus" in tf_args
    except TypeError:
        user_requested = False
    requested = 0
    if user_requested:
        requested = int((tf_args.get("num_gpus") if isinstance(tf_args, dict) else getattr(tf_args, "num_gpus", 0)) or 0)
    if _has_spark_resource_api():
        from pyspark import TaskContext

        context = TaskContext.get()
        if context:
            resources = context.resources()
            if resources and "gpu" in resources:
                gpus = list(resources["gpu"].addresses)
                log.info("Spark GPU resources: %s", gpus)
                if user_requested:
                    if requested < len(gpus):
                        log.warning("requested %d GPU(s) of the %d Spark assigned", requested, len(gpus))
                        gpus = gpus[:requested]
                else:
                    requested = len(gpus)
    if not on_k8s and not gpus and gpu_info.is_gpu_available():
        if not user_requested:
            requested = max(1, requested)
        if requested > 0:
            index = 0
            if cluster_spec:
                mine = cluster_spec[job_name][task_index]
                host = mine.split(":")[0]
                peers = [a for addrs in cluster_spec.values() for a in addrs if a.split(":")[0] == host]
                index = peers.index(mine)
            gpus = list(gpu_info.get_gpus(requested, index, format=gpu_info.AS_LIST))
    if user_requested and len(gpus) < requested:
        raise TFOSError(f"unable to allocate {requested} GPU(s) for {job_name}:{task_index}; available: {gpus}")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
    if gpus:
        log.info("%s:%d: CUDA_VISIBLE_DEVICES=%s", job_name, task_index, os.environ["CUDA_VISIBLE_DEVICES"])


def run(
    fn: Callable[[Any, Any], Any],
    tf_args: Any,
    cluster_meta: Dict[str, Any],
    tensorboard: bool,
    log_dir: Optional[str],
    queues: List[str],
    background: bool,
) -> Callable[[Iterable[int]], None]:
    """A ``mapPartitions`` function that runs one TF node per task (Spark task).

    Args:
        fn: ``fn(tf_args, ctx)``, the node's main function.
        tf_args: Passed to ``fn``; an argv list also becomes ``sys.argv``.
        cluster_meta: TFoS's cluster metadata: ``id``, ``cluster_template``
            (``{job: [executor ids]}``), ``default_fs``, ``working_dir``, ``server_addr``
            (the :class:`tfos.reservation.ServerAddress` of a started server) and optionally
            ``release_port`` (default True).
        tensorboard: Must be False (use ``TFCluster.run(tensorboard=True)``).
        log_dir: Unused without TensorBoard.
        queues: Queue names of the node's TFManager.
        background: Must be False: ``fn`` runs in the task's own thread.

    Returns:
        ``_mapfn(iterator)``: the iterator's last item is the executor id.

    Raises (from the returned function):
        TFOSError: A node of this cluster already runs in this process, background/ps/evaluator
            nodes or TensorBoard were asked for, or GPUs could not be allocated.
        ReservationTimeoutError: The other nodes did not register within 600 s.
    """

    def _mapfn(it: Iterable[int]) -> None:
        executor_id = None
        for executor_id in it:
            pass
        if executor_id is None:
            raise TFOSError("TFSparkNode.run: the partition held no executor id")
        template = cluster_meta["cluster_template"]
        job_name, task_index = "default", -1
        for job, ids in template.items():
            if executor_id in ids:
                job_name, task_index = job, list(ids).index(executor_id)
                break
        if background or job_name in ("ps", "evaluator"):
            raise TFOSError(
                f"TFSparkNode.run runs fn in the foreground only ({job_name}:{task_index}, background={background}); "
                "for ps/evaluator or background nodes use TFCluster.run, which runs every node as a supervised process"
            )
        if tensorboard:
            raise TFOSError("TFSparkNode.run does not start TensorBoard; use TFCluster.run(..., tensorboard=True, log_dir=...)")
        _ = log_dir  # only used with TensorBoard, which this function does not start
        _set_gpus(tf_args, job_name, task_index)
        host = util.get_ip_address()
        util.write_executor_id(executor_id)
        cid = cluster_meta["id"]
        old = TFSparkNode.mgr
        if old is not None:
            if TFSparkNode.cluster_id == cid:
                raise TFOSError(f"a node of cluster {cid} already runs in this process (executor {executor_id}, host {host})")
            try:
                old.shutdown()
            except Exception as exc:  # noqa: BLE001 - an old manager that already died
                log.debug("old TFManager shutdown: %s", exc)
        authkey = uuid.uuid4().bytes
        mgr: Any = manager.start(authkey, list(queues), "local")
        mgr.set("state", str(NodeState.RUNNING))  # TFoS's manager state
        TFSparkNode.mgr, TFSparkNode.cluster_id = mgr, cid

        port, tmp_sock, cluster_info = _reserve(cluster_meta["server_addr"], executor_id, host, job_name, task_index,
                                                mgr, authkey)
        spec = _get_cluster_spec(sorted(cluster_info, key=lambda n: n["executor_id"]))
        if "master" in spec or "chief" in spec:
            os.environ["TF_CONFIG"] = json.dumps({"cluster": spec, "task": {"type": job_name, "index": task_index}, "environment": "cloud"})
        _set_gpus(tf_args, job_name, task_index, spec)
        keep = not cluster_meta.get("release_port", True)
        ctx = TFNodeContext(
            executor_id, job_name, task_index, spec, cluster_meta.get("default_fs", "file://"),
            cluster_meta.get("working_dir", os.getcwd()), mgr, tmp_sock if keep else None, host=host, port=port,
        )
        if tmp_sock is not None and not keep:
            tmp_sock.close()
        if isinstance(tf_args, list):
            sys.argv = tf_args
        log.info("starting TensorFlow %s:%d on executor %s in the foreground", job_name, task_index, executor_id)
        fn(tf_args, ctx)
        log.info("finished TensorFlow %s:%d on executor %s", job_name, task_index, executor_id)

    return _mapfn



def _reserve(server_addr: Any, executor_id: int, host: str, job_name: str, task_index: int, mgr: Any,
             authkey: bytes) -> tuple:
    """Registers this node with TFoS's reservation server (or finds its earlier registration)
    and waits for the others (Spark task).

    Returns:
        ``(TF port, the socket holding it or None, every node's reservation)``.
    """
    client = reservation.Client(server_addr)
    try:
        mine = [n for n in client.get_reservations() if n.get("host") == host and n.get("executor_id") == executor_id]
        tmp_sock: Optional[socket.socket] = None
        if mine:
            port = int(mine[0]["port"])
            cluster_info = client.get_reservations()
        else:
            if "TENSORFLOW_PORT" in os.environ:
                port = int(os.environ["TENSORFLOW_PORT"])
            else:
                tmp_sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                tmp_sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                tmp_sock.bind(("", 0))
                port = tmp_sock.getsockname()[1]
            node = {
                "executor_id": executor_id, "host": host, "job_name": job_name, "task_index": task_index,
                "port": port, "tb_pid": 0, "tb_port": 0, "addr": str(mgr.address), "authkey": authkey.hex(),
            }
            log.info("TFSparkNode.reserve: %s", {k: v for k, v in node.items() if k != "authkey"})
            client.register(node)
            cluster_info = client.await_reservations()
    finally:
        client.close()
    return port, tmp_sock, cluster_info


def _moved(name: str) -> Callable[..., Any]:
    def _f(*args: Any, **kwargs: Any) -> Any:
        raise TFOSError(
            f"TFSparkNode.{name}() is not available in tfos: its TFManager queue protocol is replaced by "
            f"authenticated data connections; call cluster.{name}(...) on the TFCluster returned by TFCluster.run"
        )

    _f.__name__ = name
    _f.__doc__ = f"Raises :class:`TFOSError`: use ``TFCluster.{name}`` instead."
    return _f


train = _moved("train")
inference = _moved("inference")
shutdown = _moved("shutdown")
