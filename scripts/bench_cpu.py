"""CPU seconds per process class of a benchmark's Spark application (driver side only).

Used by ``bench_feed.py`` and ``bench_train.py`` to print where the CPU of each timed run
went: the executor JVMs, the driver JVM, the PySpark Python workers (feed tasks, plain
passes) and the nodes' TF processes. Only processes started by this driver (psutil
descendants) are counted; a process that ended between two snapshots is not.
"""

from __future__ import annotations

#: (substring of the command line, class name), first match wins.
CLASSES = (("CoarseGrainedExecutorBackend", "executor JVMs"), ("SparkSubmit", "driver JVM"),
           ("tfos._node.tf_process", "TF processes"), ("pyspark.daemon", "Python workers"))


def cpu_by_class() -> dict:
    """``{pid: (class, cpu seconds user + system)}`` of this process's descendants (psutil)."""
    import psutil

    out = {}
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
            t = p.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        cls = next((name for key, name in CLASSES if key in cmd), "other")
        out[p.pid] = (cls, t.user + t.system)
    return out


def cpu_delta(before: dict, after: dict) -> dict:
    """``{class: cpu seconds}`` used between two :func:`cpu_by_class` snapshots (a process
    started in between counts from zero)."""
    delta: dict = {}
    for pid, (cls, cpu) in after.items():
        delta[cls] = delta.get(cls, 0.0) + cpu - (before[pid][1] if pid in before else 0.0)
    return delta
