"""Starting a cluster under Spark Connect (client side): the start stage and the checks
before it (partitions, slots, the key's transport, the client timeout). Used by
:class:`tfos._driver.connect_backend.ConnectLauncher`; see docs/connect.md."""

from __future__ import annotations

import logging
import os
import re
import threading
from typing import Any

from tfos._connect.tasks import START_SCHEMA, StartSpec, make_start_fn
from tfos._driver.spark_checks import plan_layout
from tfos.errors import ConfigurationError, ReservationTimeoutError

__all__ = ["MIN_CLIENT_TIMEOUT_S", "DEFAULT_CLIENT_TIMEOUT_S", "client_timeout_from_env"]

log = logging.getLogger(__name__)

#: Smallest ``TFOS_CONNECT_CLIENT_TIMEOUT_S`` accepted (s): the idle client's keep-alive
#: jobs run every quarter of the timeout, and each must get a task slot and run in time.
MIN_CLIENT_TIMEOUT_S = 20.0
#: Default of ``TFOS_CONNECT_CLIENT_TIMEOUT_S``: the control host aborts the cluster after
#: this many seconds without any client operation.
DEFAULT_CLIENT_TIMEOUT_S = 600.0


def _num_partitions(df: Any) -> int:
    """Partitions of a DataFrame, empty ones included (client).

    Spark Connect has no ``getNumPartitions()``; one job with a task per partition yields
    one row each. It reads the input once, so it is only run when the count matters.
    """

    def _one(batches: Any) -> Any:
        import pyarrow as pa
        from pyspark import TaskContext

        for _ in batches:
            pass
        tc = TaskContext.get()
        yield pa.RecordBatch.from_pydict({"p": pa.array([tc.partitionId() if tc else 0], pa.int64())})

    return len(df.mapInArrow(_one, "p long").collect())


def _key_transport_conf(spark: Any) -> tuple:
    """The master and security settings the Connect server's Spark runs with (client side).

    The start/feed closures (and the cluster key in them) reach the executors through the
    server's block managers, as on the classic path, so the same WARNING applies. A setting
    the server does not let the client read counts as off; an unreadable master as a
    multi-host one (both settings are then asked for).

    Returns:
        ``(master, conf)`` for :func:`tfos._driver.spark_checks.warn_key_transport`.
    """
    conf = {}
    for name in ("spark.authenticate", "spark.network.crypto.enabled", "spark.app.id", "spark.master", "spark.task.cpus"):
        try:
            value = spark.conf.get(name, None)
        except Exception:  # noqa: BLE001 - Connect may refuse to read a static conf
            value = None
        if value is not None:
            conf[name] = str(value)
    return conf.get("spark.master", ""), conf


def _check_local_slots(master: str, conf: dict, num_nodes: int) -> None:
    """Refuses a cluster larger than the task slots of a local Connect server (client).

    Only ``local``, ``local[N]`` and ``local-cluster[E,C,M]`` masters say how many slots
    there are (``local[*]`` counts the server host's CPUs, unknown here); on other masters
    a barrier stage without enough free slots is bounded by ``reservation_timeout``.

    Raises:
        ConfigurationError: Fewer slots than nodes.
    """
    if not master.startswith("local") or master.startswith("local[*"):
        return
    try:
        layout = plan_layout(master, conf)
    except ConfigurationError:
        return
    if layout.total_slots is not None and layout.total_slots < num_nodes:
        example = f"local[{num_nodes}]"
        m = re.fullmatch(r"local-cluster\[\s*(\d+)\s*,\s*(\d+)\s*,\s*(\d+)\s*\]", master.strip())
        if m and layout.slots_per_executor:
            executors = -(-num_nodes // layout.slots_per_executor)
            example = f"local-cluster[{executors},{m.group(2)},{m.group(3)}]"
        raise ConfigurationError(
            f"the Spark Connect server's master {master} has {layout.total_slots} task slot(s) but the cluster "
            f"needs {num_nodes} (one per node, in one barrier stage): start the server with more slots "
            f"(e.g. {example}) or ask for fewer nodes"
        )


def _start_stage(spark: Any, spec: StartSpec, n: int, timeout_s: float) -> list:
    """Runs the barrier start stage of ``n`` nodes and returns its rows, within ``timeout_s``
    (client; ``reservation_timeout``).

    Spark retries a barrier stage it cannot give ``n`` free slots at once for about ten
    minutes (``spark.scheduler.barrier.maxConcurrentTasksCheck.*``); the nodes' own
    registration wait only starts once their tasks run. So the client bounds the whole
    stage: past ``timeout_s`` it interrupts the stage's operation (a Spark Connect tag).

    Raises:
        ReservationTimeoutError: The stage did not finish within ``timeout_s``.
        Exception: What the stage's ``collect()`` raised.
    """
    tag = f"{spec.config.cluster_id}-start"
    out: dict = {}

    def _collect() -> None:
        try:
            spark.addTag(tag)  # tags are per thread: only this operation carries it
            try:
                out["rows"] = spark.range(0, n, 1, n).mapInArrow(make_start_fn(spec), START_SCHEMA, barrier=True).collect()
            finally:
                spark.removeTag(tag)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            out["error"] = exc

    def _interrupt() -> list:
        try:
            return list(spark.interruptTag(tag) or [])
        except Exception as exc:  # noqa: BLE001 - the server may be gone; the caller's error says what matters
            log.warning("tfos cluster %s: could not interrupt the start stage: %s", spec.config.cluster_id, exc)
            return []

    thread = threading.Thread(target=_collect, name=tag, daemon=True)
    thread.start()
    try:
        thread.join(timeout_s)
    except BaseException:  # Ctrl-C: the stage must not go on forming a cluster nobody holds
        _interrupt()
        raise
    if thread.is_alive():
        interrupted = _interrupt()
        thread.join(30.0)
        if "rows" not in out:  # formed just as the deadline passed: use it
            raise ReservationTimeoutError(
                f"tfos cluster {spec.config.cluster_id} (Spark Connect): the start stage of {n} nodes did not finish "
                f"within reservation_timeout={timeout_s:g} s, so it was interrupted ({len(interrupted)} operation(s)). "
                f"A barrier stage needs {n} free task slots at once: the Spark application may have too few "
                "executors or cores, or other jobs hold them; otherwise the nodes did not register (see the executor logs)"
            )
    if "error" in out:
        raise out["error"]
    return out["rows"]


def client_timeout_from_env() -> float:
    """``TFOS_CONNECT_CLIENT_TIMEOUT_S`` in seconds (default 600; client).

    Raises:
        ConfigurationError: Not a number, or below :data:`MIN_CLIENT_TIMEOUT_S` (20 s): the
            idle client's keep-alive jobs, each waiting for a task slot, could not keep a
            live client's cluster from being aborted.
    """
    text = os.environ.get("TFOS_CONNECT_CLIENT_TIMEOUT_S")
    if text is None or not text.strip():
        return DEFAULT_CLIENT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= MIN_CLIENT_TIMEOUT_S or value == float("inf"):
        raise ConfigurationError(
            f"TFOS_CONNECT_CLIENT_TIMEOUT_S={text!r}: give the seconds without any client operation after which the "
            f"control host aborts the cluster, a number >= {MIN_CLIENT_TIMEOUT_S:g} (default {DEFAULT_CLIENT_TIMEOUT_S:g})"
        )
    return value
