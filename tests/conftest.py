"""Shared test fixtures: one SparkContext at a time, leftover-process checks."""

from __future__ import annotations

import os
import sys
import time

import pytest

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ.setdefault("TFOS_PROGRESS", "0")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Every JVM the tests start (the shared context's driver and executors, the drivers of the
# example programs, standalone masters and workers) runs with C1 only and the serial GC:
# short-lived test JVMs then spend about half the CPU (a small tfos workload on
# local-cluster[2,1,1024]: 31-34 s -> 16-19 s of CPU, JIT compiler and GC threads mostly),
# which on a 2-core machine is also wall time. The java launcher reads JDK_JAVA_OPTIONS
# (and notes it on the JVM's stderr); a value the user set is kept.
os.environ.setdefault("JDK_JAVA_OPTIONS", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")
# Marks every process this test session starts (executors inherit the driver's environment),
# so leftover checks ignore processes of other programs on the machine. Each pytest-xdist
# worker is a session of its own (it inherits the controller's environment, so the marker
# is made anew there): a worker's leftover check must not see the other worker's live nodes.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["TFOS_TEST_SESSION"] = f"{os.environ['PYTEST_XDIST_WORKER']}-{os.getpid()}-{time.time_ns()}"
else:
    os.environ.setdefault("TFOS_TEST_SESSION", f"{os.getpid()}-{time.time_ns()}")

DEFAULT_MASTER = "local-cluster[2,1,1024]"


def pytest_collection_modifyitems(config, items):
    """The chaos tier (marker ``chaos``: the slowest chaos and soak cases) runs only with
    ``TFOS_CHAOS=1`` (``.ci/run`` sets it) or when ``-m`` names it; the README's test command
    skips it, saying how to run it."""
    if os.environ.get("TFOS_CHAOS") == "1" or "chaos" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="chaos tier: TFOS_CHAOS=1 bash scripts/run_tests.sh (or .ci/run) runs it")
    for item in items:
        if "chaos" in item.keywords:
            item.add_marker(skip)


def _await_executors(sc, master: str, timeout_s: float = 300.0) -> None:
    """Waits for a local-cluster's executors to register (block managers and scheduler): under
    CPU contention their JVMs can take longer than TFCluster.run's executor_wait_s (60 s),
    which would fail the test; and after a chaos test killed an executor JVM, Spark's
    replacement must be there before the next test uses the shared context."""
    import re

    m = re.match(r"local-cluster\[\s*(\d+)", master)
    if not m:
        return
    want = int(m.group(1))
    deadline = time.monotonic() + timeout_s

    def registered() -> bool:
        jsc = sc._jsc.sc()
        return jsc.getExecutorMemoryStatus().size() - 1 >= want and jsc.getExecutorIds().size() >= want

    while time.monotonic() < deadline and not registered():
        time.sleep(0.5)


class SparkManager:
    """Keeps at most one SparkContext alive; a test asking for another config replaces it."""

    def __init__(self) -> None:
        self.key = None
        self.sc = None

    def get(self, master: str = DEFAULT_MASTER, **conf: str):
        from pyspark import SparkConf, SparkContext

        key = (master, tuple(sorted(conf.items())))
        if self.sc is not None and self.key == key:
            _await_executors(self.sc, master)  # one py4j call when they are all there
            return self.sc
        self.stop()
        sconf = (
            SparkConf()
            .setMaster(master)
            .setAppName("tfos-tests")
            .set("spark.ui.enabled", "false")
            .set("spark.ui.showConsoleProgress", "false")
            .set("spark.driver.host", "127.0.0.1")
            .set("spark.executor.memory", "768m")
        )
        for k, v in conf.items():
            sconf.set(k.replace("__", "."), str(v))
        self.sc = SparkContext(conf=sconf)
        self.sc.setLogLevel("ERROR")
        self.key = key
        _await_executors(self.sc, master)
        return self.sc

    def stop(self) -> None:
        if self.sc is not None:
            self.sc.stop()
            self.sc = None
            self.key = None

    def discard_jvm(self, timeout_s: float = 60.0) -> None:
        """Stops any SparkContext of this process and ends its JVM, so the next context
        starts a fresh one. The JVM keeps the ``--conf`` settings it was launched with as
        system properties, which every later ``SparkConf()`` in it loads: a JVM that a
        ``remote("local[...]")`` session launched would give every later classic context
        its Spark Connect plugin (and that plugin's port)."""
        from pyspark import SparkContext

        self.stop()
        if SparkContext._active_spark_context is not None:
            SparkContext._active_spark_context.stop()
        gateway = SparkContext._gateway
        if gateway is None:
            return
        proc = getattr(gateway, "proc", None)
        try:
            gateway.shutdown()
        finally:
            SparkContext._gateway = None
            SparkContext._jvm = None
            if proc is not None:  # the JVM exits when its stdin closes; killed after the deadline
                if proc.stdin is not None:
                    proc.stdin.close()
                try:
                    proc.wait(timeout_s)
                except Exception:
                    proc.kill()
                    proc.wait(10)


_manager = SparkManager()


@pytest.fixture(scope="session")
def spark_manager():
    """The session's SparkManager (stops the last context at the end)."""
    yield _manager
    _manager.stop()


@pytest.fixture
def sc(spark_manager):
    """The shared local-cluster[2,1,1024] SparkContext (separate executor JVMs)."""
    return spark_manager.get()


def tfos_processes():
    """tfos node processes (supervisors, TF processes, TensorBoards) of this machine."""
    import psutil

    session = os.environ["TFOS_TEST_SESSION"]
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info.get("cmdline") or [])
        if "tfos._node.supervisor" in cmd or "tfos._node.tf_process" in cmd or "tensorboard.main" in cmd:
            try:
                if p.environ().get("TFOS_TEST_SESSION") != session:
                    continue
            except psutil.Error:
                continue
            found.append((p.info["pid"], cmd))
    return found


def assert_no_tfos_processes(timeout_s: float = 20.0) -> None:
    """Fails if tfos node processes are still alive after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    left = tfos_processes()
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = tfos_processes()
    assert not left, f"tfos processes left behind: {left}"


def feed_socket_dirs() -> set[str]:
    """The Unix-socket directories of nodes' data servers in the temp dir whose maker (a
    node's supervisor) is gone: left behind (live ones may be another run's)."""
    from tfos._data.local_socket import stale_socket_dirs

    return set(stale_socket_dirs(now=float("inf")))


@pytest.fixture
def no_leftovers():
    """Asserts that a test leaves no tfos node process behind, and no data-socket
    directory (a node's supervisor removes the one it made after its TF process ended)."""
    assert_no_tfos_processes()
    before = feed_socket_dirs()
    yield
    assert_no_tfos_processes()
    left = feed_socket_dirs() - before
    assert not left, f"data-socket directories left behind: {sorted(left)}"


@pytest.fixture(autouse=True)
def _ship_test_module_by_value(request):
    """Lets main_funs and RDD closures defined in a test module reach the node processes
    and executors (which cannot import test modules): both cloudpickle (tfos ships
    main_fun with it) and PySpark's vendored copy (RDD closures) then ship the module's
    functions by value."""
    import cloudpickle
    from pyspark import cloudpickle as spark_cloudpickle

    cloudpickle.register_pickle_by_value(request.module)
    spark_cloudpickle.register_pickle_by_value(request.module)
    for helper in ("feed_gate",):  # tests/spark helper modules the test modules import
        if helper in sys.modules:
            cloudpickle.register_pickle_by_value(sys.modules[helper])
            spark_cloudpickle.register_pickle_by_value(sys.modules[helper])
    yield


@pytest.fixture
def berlin_time(monkeypatch):
    """The process's local time zone is Europe/Berlin for the test (as ``TZ=...`` on an
    executor): 2023-10-29 02:00-02:59 happens twice there (the end of summer time)."""
    monkeypatch.setenv("TZ", "Europe/Berlin")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()
