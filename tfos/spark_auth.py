"""Spark authentication for a program that starts its own Spark (driver, before the JVM starts).

tfos's per-cluster key reaches the executors inside Spark task closures, which Spark's block
managers serve to any process that connects unless ``spark.authenticate`` is on
(docs/reliability.md, "Threat model"). :func:`authenticate_spark` turns it on for the Spark
application that this Python process is about to start (``python program.py``, a notebook),
in the one way that keeps a secret off every command line: ``spark-defaults.conf`` in a
``SPARK_CONF_DIR`` that only the current user can read, which the driver JVM reads when it
starts. Under ``spark-submit`` give the settings to ``spark-submit`` instead
(docs/deploy.md, "Spark authentication").
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import secrets
import shutil
import tempfile
from typing import Mapping, Optional

from tfos._driver.remedies import check_master_url
from tfos.errors import ConfigurationError

__all__ = ["authenticate_spark", "auth_settings", "read_properties"]

log = logging.getLogger(__name__)

DEFAULTS_FILE = "spark-defaults.conf"
_PROPERTY = re.compile(r"^\s*([^\s=:#!][^\s=:]*)\s*[=:\s]\s*(.*?)\s*$")


def read_properties(text: str) -> dict[str, str]:
    """The ``key value`` / ``key=value`` lines of a Spark properties file (pure; comments and
    blank lines skipped; a later line wins, as in Java's ``Properties.load``)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        if line.lstrip().startswith(("#", "!")):
            continue
        m = _PROPERTY.match(line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def _true(value: Optional[str]) -> bool:
    return str(value).strip().lower() == "true"


def auth_settings(master: str, defaults: Mapping[str, str]) -> dict[str, str]:
    """The settings to add to ``defaults`` so that an application on ``master`` authenticates (pure
    but for the random secret).

    Per Spark's ``SecurityManager``: on ``local``/``local[N]``, YARN and Kubernetes Spark
    generates a secret per application once ``spark.authenticate=true``; ``local-cluster``
    needs ``spark.authenticate.secret`` (a new random one: the driver JVM runs its master and
    workers, and hands the secret to the executors in their environment); a standalone
    cluster needs the secret its master and workers were started with. On masters that span
    hosts (standalone, YARN, Kubernetes) ``spark.network.crypto.enabled=true`` is added too,
    unless ``defaults`` set it.

    Args:
        master: The Spark master URL.
        defaults: The properties already in effect (``spark-defaults.conf``).

    Returns:
        The properties to add ({} when ``defaults`` already authenticate).

    Raises:
        ConfigurationError: ``master`` is not a URL Spark can parse (see
            :func:`tfos._driver.remedies.check_master_url`: it names the URL and lists the
            forms Spark accepts); or a standalone (or a cluster manager plugin's) master and no
            ``spark.authenticate.secret`` in ``defaults``: only the cluster's own secret works there.
    """
    kind = check_master_url(master)
    out: dict[str, str] = {}
    if not _true(defaults.get("spark.authenticate")):
        out["spark.authenticate"] = "true"
    if "spark.authenticate.secret" not in defaults:
        if kind == "local-cluster":
            out["spark.authenticate.secret"] = secrets.token_hex(32)
        elif kind == "other":
            raise ConfigurationError(
                f"master {master}: not one of Spark's own master forms (local[N], local-cluster[E,C,M], spark://, yarn, "
                "k8s://), so tfos cannot tell whether its cluster manager generates Spark's authentication secret. Put "
                "spark.authenticate true and, if that cluster manager needs it, spark.authenticate.secret in "
                "spark-defaults.conf of a SPARK_CONF_DIR only you can read (docs/deploy.md, Spark authentication)"
            )
        elif kind == "standalone":
            raise ConfigurationError(
                f"master {master}: a standalone cluster accepts only applications that give the secret its master and "
                "workers were started with (spark.authenticate.secret), and tfos cannot know it. Put "
                "spark.authenticate true, spark.authenticate.secret and spark.network.crypto.enabled true in "
                "spark-defaults.conf of a SPARK_CONF_DIR only you can read (scripts/spark_standalone.sh makes one for "
                "its cluster), or use spark-submit --properties-file (docs/deploy.md, Spark authentication)"
            )
    if kind not in ("local", "local-cluster") and "spark.network.crypto.enabled" not in defaults:
        out["spark.network.crypto.enabled"] = "true"
    return out


def _jvm_running() -> bool:
    """Whether this process's Spark driver JVM already runs (spark-submit started the program, or
    a SparkContext was made): its settings are fixed then (driver)."""
    if os.environ.get("PYSPARK_GATEWAY_PORT"):
        return True
    try:
        from pyspark import SparkContext
    except ImportError:
        return False
    return SparkContext._gateway is not None


def _current_conf_dir() -> str:
    """The configuration directory the next driver JVM would read (``SPARK_CONF_DIR``, else
    ``$SPARK_HOME/conf``, else PySpark's own ``conf/``)."""
    if os.environ.get("SPARK_CONF_DIR"):
        return os.environ["SPARK_CONF_DIR"]
    home = os.environ.get("SPARK_HOME")
    if not home:
        import pyspark

        home = os.path.dirname(os.path.abspath(pyspark.__file__))
    return os.path.join(home, "conf")


def authenticate_spark(master: str) -> Optional[str]:
    """Turns on Spark's authentication for the Spark application this process is about to start,
    with a secret only the current user can read (driver, before the first SparkSession or
    SparkContext of the process).

    Makes a new directory of mode 0700, writes there a ``spark-defaults.conf`` (mode 0600) with
    the properties of the current one plus ``spark.authenticate=true`` and, where the master
    needs one, a new random ``spark.authenticate.secret`` (see :func:`auth_settings`), links
    the current directory's other files (``log4j2.properties``, ``spark-env.sh``, ...), and
    points ``SPARK_CONF_DIR`` at it. The driver JVM reads the file when PySpark starts it, so
    the secret never appears on a command line (``ps``) or in a log; ``local-cluster``
    executors get it from Spark in their environment. The directory is removed when the
    interpreter exits. Settings given to ``SparkSession.builder.config()`` or ``SparkConf``
    still apply on top.

    Example::

        tfos.authenticate_spark("local-cluster[2,1,1024]")
        spark = SparkSession.builder.master("local-cluster[2,1,1024]").getOrCreate()

    Args:
        master: The master URL the program will give Spark (``local[N]``,
            ``local-cluster[E,C,M]``, ``yarn``, ``k8s://...``, or ``spark://...`` when the
            current ``spark-defaults.conf`` holds the standalone cluster's secret).

    Returns:
        The ``SPARK_CONF_DIR`` now in effect, or None when the driver JVM already runs (a program
        started by ``spark-submit``, or an earlier SparkContext): its settings are fixed then,
        and ``TFCluster.run`` still warns when they leave authentication off.

    Raises:
        ConfigurationError: ``master`` is not a URL Spark can parse (checked first, also when
            the driver JVM already runs): the message names the URL and lists the forms Spark
            accepts. A standalone master whose secret the current configuration does not
            hold (see :func:`auth_settings`).
        OSError: The directory or file could not be written.
    """
    check_master_url(master)  # before anything else: a typo gets Spark's diagnosis, not another master's advice
    if _jvm_running():
        return None
    current = _current_conf_dir()
    defaults_path = os.path.join(current, DEFAULTS_FILE)
    try:
        with open(defaults_path) as f:
            text = f.read()
    except FileNotFoundError:
        text = ""
    add = auth_settings(master, read_properties(text))
    if not add:
        return current
    new = tempfile.mkdtemp(prefix="tfos-spark-conf-")  # mode 0700
    atexit.register(shutil.rmtree, new, True)
    if os.path.isdir(current):
        for name in os.listdir(current):
            if name != DEFAULTS_FILE:
                os.symlink(os.path.join(os.path.abspath(current), name), os.path.join(new, name))
    fd = os.open(os.path.join(new, DEFAULTS_FILE), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        if text:
            f.write(text if text.endswith("\n") else text + "\n")
        f.write("# added by tfos.authenticate_spark\n")
        f.writelines(f"{key} {value}\n" for key, value in add.items())
    os.environ["SPARK_CONF_DIR"] = new
    log.info("Spark authentication for master %s: %s in %s (mode 0700)", master, ", ".join(sorted(add)), new)
    return new
