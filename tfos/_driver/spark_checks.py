"""Spark configuration checks before anything is launched (driver only).

:func:`plan_layout` and :func:`check_static` are pure (unit-tested without Spark);
:func:`check_spark` reads the live SparkContext and waits, with a deadline, for the
executors the cluster needs.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import time
from typing import Any, Mapping, Optional

from tfos._common.deadline import Deadline
from tfos._driver import remedies
from tfos.cluster_template import InputMode
from tfos.errors import ConfigurationError

__all__ = ["SparkLayout", "plan_layout", "resource_slots", "check_static", "check_spark", "live_executors", "busy_slots_report", "warn_key_transport", "secret_on_command_line", "driver_jvm_pid"]

log = logging.getLogger(__name__)

_LOCAL = remedies.LOCAL_MASTER
_LOCAL_CLUSTER = remedies.LOCAL_CLUSTER_MASTER


@dataclasses.dataclass(frozen=True)
class SparkLayout:
    """What the master URL and configuration say about task slots (pure).

    Attributes:
        master: The master URL.
        local: True for ``local``/``local[N]`` (one JVM; nodes are still separate processes).
        executors: Number of executors when known up front, else None.
        slots_per_executor: Concurrent tasks per executor when known, else None.
        total_slots: Concurrent tasks in the application when known, else None.
    """

    master: str
    local: bool
    executors: Optional[int]
    slots_per_executor: Optional[int]
    total_slots: Optional[int]


def _int_conf(conf: Mapping[str, str], key: str, default: Optional[int] = None) -> Optional[int]:
    val = conf.get(key)
    if val in (None, ""):
        return default
    try:
        return int(str(val).strip())
    except ValueError:
        raise ConfigurationError(f"Spark setting {key}={val!r} is not an integer") from None


_TASK_RESOURCE = re.compile(r"^spark\.task\.resource\.([^.]+)\.amount$")


def _float_conf(conf: Mapping[str, str], key: str) -> Optional[float]:
    val = conf.get(key)
    if val in (None, ""):
        return None
    try:
        return float(str(val).strip())
    except ValueError:
        raise ConfigurationError(f"Spark setting {key}={val!r} is not a number") from None


def resource_slots(conf: Mapping[str, str]) -> dict[str, int]:
    """Task slots per executor that each custom resource allows, as Spark counts them (pure).

    For every ``spark.task.resource.<name>.amount`` (e.g. ``gpu``), the executor's
    ``spark.executor.resource.<name>.amount`` addresses give ``amount // task_amount``
    slots; a fractional task amount (< 1) shares an address between ``floor(1 / amount)``
    tasks, so ``amount * floor(1 / task_amount)`` slots (Spark's ``ResourceProfile`` rule).

    Returns:
        ``{resource name: slots per executor}`` (empty when no task resource is set).

    Raises:
        ConfigurationError: A non-numeric amount, or a task amount without an executor
            amount (Spark refuses that too).
    """
    out: dict[str, int] = {}
    for key in sorted(conf):
        m = _TASK_RESOURCE.match(key)
        if not m:
            continue
        name = m.group(1)
        task_amount = _float_conf(conf, key)
        if task_amount is None or task_amount <= 0:
            continue
        exec_amount = _float_conf(conf, f"spark.executor.resource.{name}.amount")
        if exec_amount is None:
            raise ConfigurationError(
                f"{key}={conf[key]} is set but spark.executor.resource.{name}.amount is not: set how many "
                f"'{name}' addresses each executor has"
            )
        if task_amount < 1:
            out[name] = int(exec_amount) * int(1.0 / task_amount + 1e-9)
        else:
            out[name] = int(exec_amount // task_amount)
    return out


def plan_layout(master: str, conf: Mapping[str, str]) -> SparkLayout:
    """Derives the slot layout from the master URL and the Spark configuration (pure).

    Slots per executor are counted as Spark does: the smallest of cores /
    ``spark.task.cpus`` and, for every custom resource (e.g. GPUs), executor amount /
    task amount (see :func:`resource_slots`).

    Raises:
        ConfigurationError: For a non-integer core setting or a bad resource amount.
    """
    task_cpus: int = _int_conf(conf, "spark.task.cpus", 1) or 1
    limits = resource_slots(conf)

    def per_exec(cores: Optional[int]) -> Optional[int]:
        counts = list(limits.values()) + ([cores // task_cpus] if cores is not None else [])
        return min(counts) if counts else None

    m = _LOCAL.match(master)
    if m:
        n = m.group(1)
        slots = 1 if n is None else (os.cpu_count() or 1) if n == "*" else int(n)
        return SparkLayout(master, True, 1, slots // task_cpus, slots // task_cpus)
    m = _LOCAL_CLUSTER.match(master)
    if m:
        n_exec, exec_cores = int(m.group(1)), int(m.group(2))
        per_lc = per_exec(exec_cores) or 0
        return SparkLayout(master, False, n_exec, per_lc, n_exec * per_lc)
    instances = _int_conf(conf, "spark.executor.instances")
    cores = _int_conf(conf, "spark.executor.cores")
    if master.startswith("spark://"):
        # Standalone sizes an application by spark.cores.max (--total-executor-cores) and
        # ignores spark.executor.instances: at most cores.max // executor.cores executors.
        cores_max = _int_conf(conf, "spark.cores.max")
        instances = cores_max // cores if cores_max is not None and cores else None
    per = per_exec(cores)
    total = None if instances is None or per is None else instances * per
    return SparkLayout(master, False, instances, per, total)


def check_static(layout: SparkLayout, conf: Mapping[str, str], num_nodes: int, input_mode: InputMode) -> None:
    """Refuses configurations that cannot run ``num_nodes`` nodes (pure).

    Args:
        layout: From :func:`plan_layout`.
        conf: The Spark configuration.
        num_nodes: Nodes that need a Spark task slot (ps nodes excluded with driver_ps_nodes).
        input_mode: The cluster's input mode.

    Raises:
        ConfigurationError: Dynamic allocation on; InputMode.SPARK with
            ``spark.python.worker.reuse=false``; more than one task slot per executor; too few
            executors or slots. Each message says what to change (docs/reliability.md
            "Configuration errors, before launch").
    """
    if str(conf.get("spark.dynamicAllocation.enabled", "false")).lower() == "true":
        raise ConfigurationError(
            "spark.dynamicAllocation.enabled=true: tfos needs a fixed set of executors (one per node, and "
            "Spark's barrier scheduling). Set spark.dynamicAllocation.enabled=false and give the application "
            f"{num_nodes} executors ({remedies.more_executors_remedy(layout.master, num_nodes)})"
        )
    if input_mode == InputMode.SPARK and str(conf.get("spark.speculation", "false")).lower() == "true":
        raise ConfigurationError(
            "spark.speculation=true: a speculative copy of a feed task would feed its partition to a node a "
            "second time. Set spark.speculation=false for InputMode.SPARK"
        )
    if input_mode == InputMode.SPARK and str(conf.get("spark.python.worker.reuse", "true")).lower() == "false":
        raise ConfigurationError(
            "InputMode.SPARK needs spark.python.worker.reuse=true (the default): with reuse off, PySpark "
            "starts a fresh Python worker per task and feeding loses track of the nodes. Remove "
            "spark.python.worker.reuse=false from the Spark configuration"
        )
    if layout.local:
        if layout.total_slots is not None and layout.total_slots < num_nodes:
            raise ConfigurationError(
                f"master {layout.master} has {layout.total_slots} task slot(s) but the cluster needs "
                f"{num_nodes} (one per node): use local[{num_nodes}] or more"
            )
        return
    if layout.slots_per_executor is not None and layout.slots_per_executor > 1:
        raise ConfigurationError(
            f"each executor has {layout.slots_per_executor} task slots, so two tfos nodes could share one "
            f"executor and its CPUs/GPUs. tfos needs exactly one task slot per executor: "
            f"{remedies.one_slot_remedy(layout.master, layout.slots_per_executor)}"
        )
    if layout.executors is not None and layout.executors < num_nodes:
        raise ConfigurationError(
            f"the cluster needs {num_nodes} executors (one per node) but the Spark application has "
            f"{layout.executors} ({layout.master}). Reduce num_executors/cluster_size to {layout.executors}, "
            f"or start Spark with {num_nodes} executors ({remedies.more_executors_remedy(layout.master, num_nodes)})"
        )


def live_executors(sc: Any) -> int:
    """Executors currently registered with the driver (driver side; 0 under local mode)."""
    status = sc._jsc.sc().getExecutorMemoryStatus()
    return max(0, int(status.size()) - 1)


def _max_slots(sc: Any) -> Optional[int]:
    try:
        jsc = sc._jsc.sc()
        return int(jsc.maxNumConcurrentTasks(jsc.resourceProfileManager().defaultResourceProfile()))
    except Exception:  # noqa: BLE001 - private Spark API; the check is best effort
        return None


def _scheduler_executors(sc: Any) -> Optional[int]:
    """Executors known to the task scheduler (driver side; None if Spark hides it).

    Executors register with the scheduler (which counts their task slots) a little before
    their block manager registers (which :func:`live_executors` counts), so slots must be
    compared with this count, not with :func:`live_executors`.
    """
    try:
        return int(sc._jsc.sc().getExecutorIds().size())
    except Exception:  # noqa: BLE001 - private Spark API; the check is best effort
        return None


_key_warned: set = set()


def secret_on_command_line(pid: Optional[int]) -> Optional[int]:
    """The pid of the process, ``pid`` or its parent, whose command line carries
    ``spark.authenticate.secret=...`` (driver, Linux /proc; None elsewhere or when none does).

    A command line is readable by every user of the host (``ps``, ``/proc/PID/cmdline``,
    unless /proc is mounted with ``hidepid``). PySpark puts every ``SparkSession.builder.config``
    / ``SparkConf`` setting made before the JVM starts on the driver JVM's command line as
    ``--conf k=v``, and ``spark-submit --conf`` does the same.
    """
    seen = 0
    while pid and pid > 1 and seen < 2:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"spark.authenticate.secret=" in f.read():
                    return pid
            with open(f"/proc/{pid}/stat", "rb") as f:
                pid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return None
        seen += 1
    return None


def driver_jvm_pid(sc: Any) -> Optional[int]:
    """The driver JVM's pid, asked through py4j (driver); None when it cannot be asked."""
    try:
        return int(sc._jvm.java.lang.ProcessHandle.current().pid())
    except Exception:  # noqa: BLE001 - no py4j gateway (Spark Connect), or an old JVM
        return None


def warn_key_transport(master: str, conf: Mapping[str, str], secret_pid: Optional[int] = None) -> bool:
    """Logs a WARNING when Spark exposes the cluster key to others (driver, pure but for a
    once-per-application memo).

    The per-cluster key reaches the executors inside Spark task closures, which Spark keeps as
    broadcast blocks in its block managers. Those serve blocks to any process that connects,
    unless ``spark.authenticate`` is on, and they listen on the driver's and the executors'
    addresses, not on loopback: with ``spark.authenticate`` off, any process that can reach
    them (another user on the same host included, on ``local[N]`` and ``local-cluster``
    masters too) can fetch a closure and read the key. On a multi-host master the closures
    also cross the network in clear text unless ``spark.network.crypto.enabled`` is on as
    well. With the key, whoever holds it can send rows to the nodes and impersonate the
    driver or the nodes.

    ``spark.authenticate`` protects the blocks only while its secret stays secret: a secret
    on a command line (``secret_pid``) is readable by every user of the host, and with it
    anyone can fetch the closures.

    Args:
        master: The Spark master URL.
        conf: The SparkConf as a mapping; ``spark.app.id`` (when present) makes the WARNING
            appear once per application instead of once per cluster started.
        secret_pid: The pid of a process whose command line shows ``spark.authenticate.secret``
            (:func:`secret_on_command_line`), or None.

    Returns:
        True when the configuration exposes the key (whether or not the WARNING was logged
        this time), False when it does not.
    """
    auth = str(conf.get("spark.authenticate", "false")).strip().lower() == "true"
    crypto = str(conf.get("spark.network.crypto.enabled", "false")).strip().lower() == "true"
    local = master.startswith("local")
    if auth and secret_pid:
        memo = (conf.get("spark.app.id"), "cmdline")
        if memo[0] is None or memo not in _key_warned:
            _key_warned.add(memo)
            log.warning(
                "spark.authenticate.secret is on the command line of process %d (the driver JVM or what started it), "
                "which every user of this host can read (ps, /proc/%d/cmdline): with it they can fetch this "
                "application's task closures, and the tfos cluster key inside them, from Spark's block managers, and "
                "then send rows to the nodes and impersonate the driver or the nodes. Give the secret in a properties "
                "file only you can read (spark-defaults.conf in a SPARK_CONF_DIR of mode 0700, or spark-submit "
                "--properties-file), not with SparkSession.builder.config(), SparkConf before the first SparkContext, "
                "or --conf, which all reach the JVM's command line%s",
                secret_pid, secret_pid,
                "; on local[N] masters leave it unset: Spark generates one" if re.match(r"local(\[|$)", master) else "",
            )
    if auth and (crypto or local):
        return bool(secret_pid)
    app_id = conf.get("spark.app.id")
    if app_id is not None:
        if (app_id, auth) in _key_warned:
            return True
        _key_warned.add((app_id, auth))
    if not auth:
        log.warning(
            "spark.authenticate is off, so Spark's block managers serve this application's task closures, and the "
            "tfos cluster key inside them, to any process that connects (they listen on the driver's and the "
            "executors' addresses, not on loopback; other users of this host included, on local masters too): "
            "whoever fetches the key can send rows to the nodes and impersonate the driver or the nodes. %s",
            remedies.auth_remedy(master),
        )
    else:
        log.warning(
            "the tfos cluster key travels to the executors in Spark task closures, which Spark sends in clear "
            "text unless spark.network.crypto.enabled=true (spark.authenticate is on, spark.network.crypto.enabled "
            "is off): whoever can read the network between the driver and the executors can read the key and "
            "impersonate the driver or the nodes. Set spark.network.crypto.enabled=true on a shared network",
        )
    return True


def _ps_hint(num_ps: int, num_nodes: int, text: str) -> str:
    """The driver_ps_nodes alternative for a too-few-executors error (pure)."""
    if not num_ps or "Reduce num_executors" not in text:
        return ""
    return f"; or run the {num_ps} ps node(s) on the driver (driver_ps_nodes=True), which needs {num_nodes - num_ps} executor(s)"


def check_spark(sc: Any, num_nodes: int, input_mode: InputMode, wait_s: float = 60.0, ps_on_executors: int = 0) -> SparkLayout:
    """Checks the live SparkContext and waits for enough executors (driver side).

    Args:
        sc: The SparkContext.
        num_nodes: Nodes that need a Spark task slot.
        input_mode: The cluster's input mode.
        wait_s: Longest wait for executors to register (they start asynchronously).
        ps_on_executors: ps nodes among ``num_nodes`` (``driver_ps_nodes=False``): the
            too-few-executors error then also offers ``driver_ps_nodes=True``.

    Returns:
        The layout used.

    Raises:
        ConfigurationError: See :func:`check_static`; also when, after ``wait_s`` seconds,
            fewer executors than nodes registered, or some executor has several slots.
    """
    conf = dict(sc.getConf().getAll())
    layout = plan_layout(sc.master, conf)
    try:
        check_static(layout, conf, num_nodes, input_mode)
    except ConfigurationError as exc:
        raise ConfigurationError(str(exc) + _ps_hint(ps_on_executors, num_nodes, str(exc))) from None
    warn_key_transport(sc.master, conf, secret_on_command_line(driver_jvm_pid(sc)))
    if layout.local:
        return layout
    deadline = Deadline(wait_s, f"{num_nodes} Spark executors to register")
    have = live_executors(sc)
    while have < num_nodes and not deadline.expired():
        # An executor with several task slots is an error whatever else registers later:
        # say so now, not after wait_s (a standalone worker's cores all go to one
        # executor unless spark.executor.cores is set).
        if have:
            _check_one_slot_per_executor(sc, num_nodes, have)
        # Executor registration happens in the JVM, with no event to wait on from Python:
        # polling Spark here is the one sleep on the driver (not a control-host wait).
        time.sleep(deadline.slice(0.5))
        have = live_executors(sc)
    if have < num_nodes and (have == 0 or (layout.executors or 0) >= num_nodes):
        raise ConfigurationError(
            f"only {have} of the {num_nodes} executors the cluster needs registered with the Spark driver within "
            f"{wait_s:g} s ({sc.master}): they are probably still starting. Wait for them, or raise "
            "executor_wait_s / reservation_timeout in TFCluster.run()" + _gpu_hint(conf, num_nodes, sc.master)
        )
    if have < num_nodes:
        raise ConfigurationError(
            f"the cluster needs {num_nodes} executors (one per node) but only {have} registered with the "
            f"Spark driver within {wait_s:g} s ({sc.master}). Reduce num_executors/cluster_size to {have}, or "
            f"give the application {num_nodes} executors ({remedies.more_executors_remedy(sc.master, num_nodes)})"
            + _ps_hint(ps_on_executors, num_nodes, "Reduce num_executors") + _gpu_hint(conf, num_nodes, sc.master)
        )
    _check_one_slot_per_executor(sc, num_nodes, have)
    return layout


def _gpu_hint(conf: Mapping[str, str], num_nodes: int, master: str = "") -> str:
    """Why executors that ask for GPUs may never start, for the too-few-executors errors (pure)."""
    try:
        gpus = float(conf.get("spark.executor.resource.gpu.amount", 0) or 0)
    except ValueError:
        return ""
    return remedies.gpu_hint(master, gpus, num_nodes)


def _check_one_slot_per_executor(sc: Any, num_nodes: int, have: int) -> None:
    """Raises ConfigurationError when some executor has several task slots (driver).

    ``have``: executors registered so far; when fewer than ``num_nodes``, the message also
    says how to get one executor per core instead.
    """
    # Slots first, then executors: an executor registering in between can only raise the
    # executor count, never make a healthy layout look like several slots per executor.
    slots = _max_slots(sc)
    execs = _scheduler_executors(sc)
    if slots is not None and execs is not None and slots > execs:
        master = str(sc.master)
        kind = remedies.master_kind(master)
        more = ""
        if have < num_nodes:
            if kind == "local-cluster":
                fix = f"use {remedies.executors_setting(master, num_nodes)}"
            else:
                fix = "set spark.executor.cores=1 (spark-submit --executor-cores 1" + (
                    "; on a standalone cluster an executor otherwise takes all of its worker's cores)" if kind == "standalone"
                    else ")")
            more = (f". The cluster needs {num_nodes} executors and Spark gave the application {execs} with {slots} "
                    f"task slots in all: to get one executor per core, {fix}")
        fix_slots = ("set spark.task.cpus equal to spark.executor.cores, or spark.task.resource.gpu.amount equal to "
                     "spark.executor.resource.gpu.amount")
        if kind == "local-cluster":
            fix_slots = remedies.one_slot_remedy(master)
        elif kind == "standalone" and not more:
            fix_slots = ("set spark.executor.cores=1 (spark-submit --executor-cores 1; on a standalone cluster an executor "
                         "otherwise takes all of its worker's cores), or " + fix_slots[4:])
        raise ConfigurationError(
            f"the Spark application has {slots} task slots on {execs} executors (counting cores and every "
            "task resource, as Spark does), so two tfos nodes could share an executor. tfos needs exactly one "
            f"task slot per executor: {fix_slots}{more}"
        )


def busy_slots_report(sc: Any, own_group_prefix: str) -> str:
    """Which executors and jobs hold task slots, other than this cluster's jobs (driver).

    Reads Spark's status store (``sc.statusTracker()`` and the JVM's app status store).
    Best effort: returns '' when nothing else runs or Spark hides the information.

    Args:
        sc: The SparkContext.
        own_group_prefix: Job groups starting with this are the cluster's own.

    Returns:
        e.g. ``"1 of 2 executor slot(s) busy: executor 1 (127.0.0.1:4242, 1 running task);
        other active job(s): job 3 (group 'etl', 'count at x.py:4')"``.
    """
    try:
        tracker = sc.statusTracker()
        store = sc._jsc.sc().statusStore()
        others = []
        for jid in tracker.getActiveJobsIds():
            try:
                data = store.job(int(jid))
                group = data.jobGroup().get() if data.jobGroup().isDefined() else ""
                desc = data.description().get() if data.description().isDefined() else data.name()
            except Exception:  # noqa: BLE001 - private JVM API; fall back to the id only
                group, desc = "", ""
            if group and str(group).startswith(own_group_prefix):
                continue
            others.append(f"job {jid}" + (f" (group {group!r}, {str(desc)[:80]!r})" if group or desc else ""))
        if not others:
            return ""
        busy, total, used = [], 0, 0
        it = store.executorList(True).iterator()
        while it.hasNext():
            ex = it.next()
            if ex.id() == "driver":
                continue
            total += int(ex.maxTasks())
            if int(ex.activeTasks()) > 0:
                used += int(ex.activeTasks())
                busy.append(f"executor {ex.id()} ({ex.hostPort()}, {ex.activeTasks()} running task(s))")
        head = f"{used} of {total} executor slot(s) busy: {', '.join(busy)}" if busy else "no executor reports running tasks"
        return f"{head}; other active job(s): {', '.join(others)}"
    except Exception as exc:  # noqa: BLE001 - diagnostics only; never fails the caller
        log.debug("could not read Spark's status store: %s", exc)
        return ""
