"""What to change, per Spark master, in tfos's configuration errors and warnings (pure).

Each cluster manager sizes an application its own way, so a remedy that works on one
master can do nothing on another:

- ``local`` / ``local[N]``: one JVM, ``N`` task slots; nodes are separate processes.
- ``local-cluster[E,C,M]``: ``E`` workers of ``C`` cores and ``M`` MB, started by the driver;
  the executors come from the URL (``spark.executor.instances`` does nothing there).
- ``spark://`` (standalone): an application gets ``spark.cores.max`` (``--total-executor-cores``)
  cores in executors of ``spark.executor.cores`` (``--executor-cores``) each; without it an
  executor takes all free cores of its worker, and ``spark.executor.instances`` is ignored.
- ``yarn``: ``spark.executor.instances`` (``--num-executors``) executors of
  ``spark.executor.cores`` cores (default 1).
- ``k8s://``: ``spark.executor.instances`` pods of ``spark.executor.cores`` cores (default 1).

Spark authentication differs too (Spark's ``SecurityManager``): on ``local``, ``local[N]``,
YARN and Kubernetes Spark generates a secret per application when ``spark.authenticate`` is
on; ``local-cluster`` and standalone need ``spark.authenticate.secret`` set (standalone: the
one secret of the master, the workers and every application).

Used by :mod:`tfos._driver.spark_checks` (driver) and :mod:`tfos.spark_auth`.
"""

from __future__ import annotations

import difflib
import re
from typing import Optional

from tfos.errors import ConfigurationError

__all__ = ["LOCAL_MASTER", "LOCAL_CLUSTER_MASTER", "MASTER_FORMS", "check_master_url", "master_kind", "local_cluster_parts", "executors_setting", "one_slot_remedy", "more_executors_remedy",
           "gpu_hint", "auth_remedy"]

#: ``local``, ``local[N]``, ``local[*]``, ``local[N,F]`` (group 1: N or ``*``).
LOCAL_MASTER = re.compile(r"^local(?:\[(\*|\d+)(?:\s*,\s*\d+)?\])?$")
#: ``local-cluster[E,C,M]`` (groups: workers, cores per worker, MB per worker).
LOCAL_CLUSTER_MASTER = re.compile(r"^local-cluster\[\s*(\d+)\s*,\s*(\d+)\s*,\s*(\d+)\s*\]$")


#: The master URLs Spark itself accepts (``SparkContext``'s task scheduler and its YARN and
#: Kubernetes cluster managers), as its documentation writes them.
MASTER_FORMS = (
    "local", "local[N]", "local[*]", "local[N,F]", "local[*,F]", "local-cluster[E,C,M]",
    "spark://HOST:PORT (several HOST:PORT, comma-separated, for a standby master)", "yarn", "k8s://HOST:PORT",
)


def _builtin_kind(master: str) -> Optional[str]:
    """The kind of ``master`` when it is one of Spark's own forms, exactly as Spark matches
    them (case-sensitive, no spaces around the URL), else None (pure)."""
    if LOCAL_MASTER.fullmatch(master):
        return "local"
    if LOCAL_CLUSTER_MASTER.fullmatch(master):
        return "local-cluster"
    if master.startswith("spark://"):
        return "standalone"
    if master == "yarn":
        return "yarn"
    if master.startswith("k8s"):
        return "k8s"
    return None


def _suggestion(master: str) -> Optional[str]:
    """A close URL of one of Spark's forms (``local-cluser[2,1,1024]`` -> ``local-cluster[2,1,1024]``), or None (pure)."""
    text = master.strip().replace(" ", "")
    low = text.lower()
    candidates = [low, low + "]"]
    head, bracket, tail = low.partition("[")
    close = difflib.get_close_matches(head, ["local", "local-cluster"], n=1, cutoff=0.7)
    if bracket and close:
        candidates += [close[0] + "[" + tail, close[0] + "[" + tail + "]"]
    for scheme in ("spark", "k8s"):
        if low.startswith(scheme + ":") and not low.startswith(scheme + "://"):
            candidates.append(scheme + "://" + low[len(scheme) + 1:].lstrip("/"))
    if not bracket:
        candidates += difflib.get_close_matches(low, ["yarn", "local"], n=1, cutoff=0.8)
    return next((c for c in candidates if c != master and _builtin_kind(c)), None)


def check_master_url(master: str) -> str:
    """Checks a Spark master URL as Spark parses it; returns its kind (pure).

    A URL that none of Spark's own forms (:data:`MASTER_FORMS`) matches but that is meant as
    one of them (it starts with ``local``, ``spark``, ``yarn`` or ``k8s`` in any case, holds
    a bracket, is empty, or has spaces around it) is refused with Spark's own words, never
    taken for another kind of master. Any other URL is left to a cluster manager plugin
    (kind ``'other'``), as Spark does.

    Args:
        master: The master URL, as given to ``SparkSession.builder.master()`` or
            ``spark-submit --master``.

    Returns:
        ``'local'``, ``'local-cluster'``, ``'standalone'``, ``'yarn'``, ``'k8s'`` or ``'other'``.

    Raises:
        ConfigurationError: ``master`` is not a string, or Spark could not parse it: the
            message names the URL, lists the forms Spark accepts and, when one is close,
            suggests it.
    """
    if not isinstance(master, str):
        raise ConfigurationError(f"the Spark master URL must be a string, got {master!r}")
    kind = _builtin_kind(master)
    if kind is not None:
        return kind
    low = master.lower()
    meant_builtin = (not master.strip() or master != master.strip() or "[" in master or "]" in master
                     or low.startswith(("local", "spark", "yarn", "k8s", "sc://")))
    if not meant_builtin:
        return "other"
    hint = _suggestion(master)
    if low.startswith("sc://"):
        hint_text = ". A Spark Connect URL goes to SparkSession.builder.remote(), not master() (docs/connect.md)"
    else:
        hint_text = f". Did you mean {hint!r}?" if hint else ""
    raise ConfigurationError(
        f"Could not parse Master URL: {master!r} (Spark refuses it the same way). Spark accepts "
        f"{', '.join(MASTER_FORMS)}; master URLs are case-sensitive, without spaces around them{hint_text}"
    )


def master_kind(master: str) -> str:
    """``'local'``, ``'local-cluster'``, ``'standalone'``, ``'yarn'``, ``'k8s'`` or ``'other'``
    for a Spark master URL (pure)."""
    master = (master or "").strip()
    if LOCAL_MASTER.match(master):
        return "local"
    if master.startswith("local-cluster["):
        return "local-cluster"
    if master.startswith("spark://"):
        return "standalone"
    if master.startswith("yarn"):
        return "yarn"
    if master.startswith("k8s://"):
        return "k8s"
    return "other"


def local_cluster_parts(master: str) -> Optional[tuple[int, int, int]]:
    """``(workers, cores per worker, MB per worker)`` of a ``local-cluster[E,C,M]`` URL, else None (pure)."""
    m = LOCAL_CLUSTER_MASTER.match((master or "").strip())
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None


def executors_setting(master: str, n: int) -> str:
    """The setting that gives an application ``n`` one-core executors on ``master`` (pure)."""
    kind = master_kind(master)
    if kind == "local-cluster":
        parts = local_cluster_parts(master)
        return f"the master local-cluster[{n},1,{parts[2] if parts else 1024}]: its executors come from the URL"
    if kind == "standalone":
        return f"--total-executor-cores {n} (spark.cores.max) with --executor-cores 1"
    if kind == "yarn":
        return f"--num-executors {n} (spark.executor.instances={n}) with --executor-cores 1"
    if kind == "k8s":
        return f"spark.executor.instances={n} with spark.executor.cores=1"
    if kind == "local":
        return f"the master local[{n}]"
    return f"spark.executor.instances={n}"


def more_executors_remedy(master: str, n: int) -> str:
    """How to give the application ``n`` executors, as the end of a too-few-executors error (pure)."""
    text = executors_setting(master, n)
    if master_kind(master) == "standalone":
        text += f", on workers with {n} free cores in all (SPARK_WORKER_CORES)"
    return text


def one_slot_remedy(master: str, slots: Optional[int] = None) -> str:
    """How to get exactly one task slot per executor on ``master`` (pure).

    Args:
        master: The Spark master URL.
        slots: Task slots an executor has now, when known.
    """
    parts = local_cluster_parts(master)
    if parts is not None:
        workers, cores, mb = parts
        return (f"use the master local-cluster[{workers},1,{mb}] (one core per worker: its executors get their cores "
                f"from the URL), or set spark.task.cpus={cores} so that one node takes all {cores} cores of an executor")
    text = ("set spark.task.cpus equal to spark.executor.cores (e.g. spark.executor.cores=1 and spark.task.cpus=1, "
            "or spark.task.cpus=<cores per executor>), or let a resource limit it (e.g. "
            "spark.task.resource.gpu.amount equal to spark.executor.resource.gpu.amount)")
    if master_kind(master) == "standalone":
        text += "; on a standalone cluster give --executor-cores 1, or an executor takes all of its worker's cores"
    return text


def gpu_hint(master: str, gpus: float, n: int) -> str:
    """Why ``n`` executors asking for ``gpus`` GPUs each may never start on ``master``, as the end
    of a too-few-executors error (pure; '' without GPUs)."""
    if gpus <= 0:
        return ""
    head = (f". Each executor asks for {gpus:g} GPU(s) (spark.executor.resource.gpu.amount): a cluster manager "
            f"starts an executor only where a worker has that many GPUs free, so {n} executors need "
            f"{n * gpus:g} GPUs in all")
    kind = master_kind(master)
    if kind == "yarn":
        where = (" on the NodeManagers (YARN's GPU scheduling, resource yarn.io/gpu; the ResourceManager UI shows "
                 "each node's resources)")
    elif kind == "k8s":
        where = (" on the Kubernetes nodes (spark.executor.resource.gpu.vendor, e.g. nvidia.com; kubectl describe "
                 "nodes shows the allocatable GPUs)")
    else:
        where = (" on the workers (spark.worker.resource.gpu.amount and what its discoveryScript finds; the master's "
                 "log and UI show each worker's resources)")
    return head + where + ", and waiting longer does not help when they are not there"


def auth_remedy(master: str) -> str:
    """How to turn Spark's authentication on for an application on ``master`` without a secret on a
    command line, as the end of the key-transport WARNING (pure; says nothing secret)."""
    kind = master_kind(master)
    starts_own = ("; a program that starts its own Spark (python, a notebook) can call "
                  "tfos.authenticate_spark(master) before its first SparkSession/SparkContext, which does this")
    if kind == "local":
        return "Set spark.authenticate=true (on local[N] Spark generates the secret)" + starts_own
    if kind == "local-cluster":
        return ("Set spark.authenticate=true with spark.authenticate.secret in a properties file only you can read "
                "(not --conf or SparkSession.builder.config(), which put it on the JVM's command line): "
                "spark-defaults.conf in a SPARK_CONF_DIR of mode 0700" + starts_own)
    if kind == "standalone":
        return ("Set spark.authenticate=true with the standalone cluster's spark.authenticate.secret (the one its master "
                "and workers were started with) in a properties file only you can read (spark-submit --properties-file "
                "FILE, or spark-defaults.conf in a SPARK_CONF_DIR of mode 0700; not --conf or "
                "SparkSession.builder.config(), which put it on the JVM's command line), and "
                "spark.network.crypto.enabled=true so that closures do not cross the network in clear text "
                "(docs/deploy.md, Spark authentication)")
    if kind == "yarn":
        return ("Set spark.authenticate=true (on YARN Spark generates a secret per application) and "
                "spark.network.crypto.enabled=true so that closures do not cross the network in clear text "
                "(docs/deploy.md, Spark authentication)")
    if kind == "k8s":
        return ("Set spark.authenticate=true (on Kubernetes Spark generates a secret per application and gives it to the "
                "executor pods in an environment variable: allow only yourself to read pods in the namespace, or mount "
                "it from a Kubernetes Secret with spark.authenticate.secret.driver.file and .executor.file) and "
                "spark.network.crypto.enabled=true so that closures do not cross the network in clear text "
                "(docs/deploy.md, Spark authentication)")
    return ("Set spark.authenticate=true with spark.authenticate.secret in a properties file only you can read (not "
            "--conf or SparkSession.builder.config(), which put it on the JVM's command line), and "
            "spark.network.crypto.enabled=true so that closures do not cross the network in clear text")
