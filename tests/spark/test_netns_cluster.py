"""tfos across real hosts: a Spark standalone cluster whose master and two workers run in
their own Linux network namespaces (scripts/netns_cluster.sh), each with its own address on
a private bridge. The driver is this test process, on the bridge's host-side address.

What only a multi-host cluster shows: TF addresses are the hosts' own addresses (not
127.0.0.1 or the machine's name), feed tasks reach the node of their host, TensorBoard is
reachable from the driver, and a host that drops off the network is named by the driver
within 2 x ``heartbeat_timeout``.

Needs root and ``ip netns`` (skipped otherwise). Run alone with ``pytest -m netns``; see
docs/reliability.md ("Multi-host test bed"). The module brings the bed up once (about a
minute on a loaded machine) and always takes it down, even when a test or the bring-up
fails; the failure tests come last: one cuts a host's link (and heals it), the next kills the
other host, and the restart test then adds hosts 3 and 4 (``netns_cluster.sh add-worker``)
and loses a third host with ``max_restarts=1``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("pyspark")

from tfos import TFCluster  # noqa: E402
from tfos.errors import ClusterFailedError  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "netns_cluster.sh"
#: The bed's own prefix, subnet and state dir, so a bed started by hand does not clash.
BED_ENV = {"TFOS_NETNS_PREFIX": "tfostst", "TFOS_NETNS_SUBNET": "10.77.7", "TFOS_NETNS_DIR": "/tmp/tfos-netns-pytest"}
HOSTS = 2
#: Small heartbeat timeout of the failure tests (seconds).
HEARTBEAT_S = 6.0
SHUTDOWN_TIMEOUT_S = 300.0
TENSORFLOW = TFCluster.InputMode.TENSORFLOW
SPARK = TFCluster.InputMode.SPARK


def _why_not() -> str:
    if os.geteuid() != 0:
        return "needs root (ip netns add, veth pairs, a bridge)"
    if shutil.which("ip") is None:
        return "iproute2 'ip' is not installed"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"'ip netns' is unavailable: {probe.stderr.strip()}"
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        return "needs Java for the Spark standalone master and workers"
    try:
        if Path("/proc/sys/net/ipv4/ip_forward").read_text().strip() != "0":
            return "net.ipv4.ip_forward=1: the test bed refuses to run where packets could leave the bridge"
    except OSError:
        pass
    return ""


_SKIP = _why_not()
pytestmark = [
    pytest.mark.netns,
    pytest.mark.chaos,  # the multi-host bed and its failures: minutes; .ci/run runs it (TFOS_CHAOS=1)
    pytest.mark.spark,
    pytest.mark.skipif(bool(_SKIP), reason=_SKIP or "runs"),
    pytest.mark.timeout(900),
]


# --------------------------------------------------------------------------- the bed
class Bed:
    """The running test bed, read from the script's state file."""

    def __init__(self) -> None:
        self.env = {**os.environ, **BED_ENV, "PYTHON": os.environ.get("PYSPARK_PYTHON", "python3")}
        self.state = Path(BED_ENV["TFOS_NETNS_DIR"]) / "state"
        self.master = ""
        self.driver_ip = ""
        self.hosts: dict[int, dict] = {}

    def sh(self, *args: str, timeout_s: float = 300.0) -> str:
        """Runs the script with ``args``; returns its stdout (raises with its output on failure)."""
        proc = subprocess.run(["bash", str(SCRIPT), *args], env=self.env, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0:
            raise RuntimeError(f"netns_cluster.sh {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return proc.stdout

    def load(self) -> None:
        for line in self.state.read_text().splitlines():
            kind, *rest = line.split()
            if kind == "master":
                self.master = rest[0]
            elif kind == "driver_ip":
                self.driver_ip = rest[0]
            elif kind == "host" and rest[0].startswith("w"):
                self.hosts[int(rest[0][1:])] = {"ns": rest[1], "ip": rest[2], "veth": rest[3]}

    @property
    def ips(self) -> set:
        return {h["ip"] for h in self.hosts.values()}

    def tfos_processes(self, i: int) -> list:
        """tfos node processes (supervisor, TF process, TensorBoard) in worker host ``i``."""
        pids = subprocess.run(["ip", "netns", "pids", self.hosts[i]["ns"]], capture_output=True, text=True).stdout.split()
        found = []
        for pid in pids:
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if "tfos._node.supervisor" in cmd or "tfos._node.tf_process" in cmd or "tensorboard.main" in cmd:
                found.append((int(pid), cmd[:120]))
        return found

    def assert_no_tfos_processes(self, hosts=None, timeout_s: float = 60.0) -> None:
        hosts = list(hosts or self.hosts)
        end = time.monotonic() + timeout_s
        left = [p for i in hosts for p in self.tfos_processes(i)]
        while left and time.monotonic() < end:
            time.sleep(0.5)
            left = [p for i in hosts for p in self.tfos_processes(i)]
        assert not left, f"tfos processes left behind on the worker hosts: {left}"


def _probe_privileges() -> str:
    """Why this machine cannot build the bed ('' when it can): root without CAP_NET_ADMIN
    (an unprivileged container) can list namespaces but not add them or a bridge."""
    name = BED_ENV["TFOS_NETNS_PREFIX"] + "prb"
    for add, delete in ((["ip", "netns", "add", name], ["ip", "netns", "del", name]),
                        (["ip", "link", "add", name, "type", "bridge"], ["ip", "link", "del", name])):
        made = subprocess.run(add, capture_output=True, text=True)
        subprocess.run(delete, capture_output=True)
        if made.returncode != 0:
            return f"cannot run {' '.join(add[:3])}: {made.stderr.strip()}"
    return ""


@pytest.fixture(scope="module")
def bed(request):
    """Master + ``HOSTS`` workers, each in its own network namespace; always taken down."""
    why = _probe_privileges()
    if why:
        pytest.skip(why)
    b = Bed()
    b.sh("down")  # a bed left by a crashed run (idempotent)
    request.addfinalizer(lambda: b.sh("down", timeout_s=180.0))
    t0 = time.monotonic()
    b.sh("up", str(HOSTS), timeout_s=420.0)
    b.load()
    b.up_s = time.monotonic() - t0
    assert len(b.hosts) == HOSTS and b.master.startswith("spark://")
    return b


@pytest.fixture(scope="module")
def bed_sc(bed, spark_manager, request):
    """A SparkContext on the bed: the driver binds the bridge's host-side address."""
    request.addfinalizer(spark_manager.stop)
    sc = spark_manager.get(
        bed.master,
        spark__driver__host=bed.driver_ip,
        spark__driver__bindAddress=bed.driver_ip,
        spark__executor__cores="1",
        spark__task__cpus="1",
        spark__cores__max=str(HOSTS),
    )
    _wait_executors(sc, HOSTS, 180.0)
    return sc


def _executor_hosts(sc) -> set:
    infos = sc._jsc.sc().statusTracker().getExecutorInfos()
    driver = sc.getConf().get("spark.driver.host")
    return {e.host() for e in infos if e.host() != driver}


def _wait_executors(sc, n: int, timeout_s: float) -> set:
    end = time.monotonic() + timeout_s
    hosts = _executor_hosts(sc)
    while len(hosts) < n and time.monotonic() < end:
        time.sleep(0.5)
        hosts = _executor_hosts(sc)
    assert len(hosts) >= n, f"only executors on {sorted(hosts)} registered within {timeout_s} s"
    return hosts


# --------------------------------------------------------------------------- main_funs
def _write_json(path: str, obj) -> None:
    import json
    import os

    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def _read_nodes(out: Path) -> dict:
    return {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*.json"))}


def mwms_main(args, ctx):
    """Trains y = 3x + 1 with MultiWorkerMirroredStrategy (collectives cross the hosts)."""
    import json
    import os
    import threading

    os.environ["TF_USE_LEGACY_KERAS"] = "1"
    import numpy as np
    import tensorflow as tf

    record = {"tf_config": json.loads(os.environ["TF_CONFIG"]), "cluster_spec": ctx.cluster_spec,
              "spark_local_ip": os.environ.get("SPARK_LOCAL_IP"), "ctx_host": ctx.host}
    box: dict = {}

    def train() -> None:
        comm = tf.distribute.experimental.CommunicationOptions(timeout_seconds=args["collective_timeout_s"])
        strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=comm)
        rng = np.random.default_rng(7)
        x = rng.uniform(-1.0, 1.0, size=(256, 1)).astype("float32")
        ds = tf.data.Dataset.from_tensor_slices((x, 3.0 * x + 1.0)).batch(32)
        opts = tf.data.Options()
        opts.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
        with strategy.scope():
            model = tf.keras.Sequential([tf.keras.layers.Input(shape=(1,)), tf.keras.layers.Dense(1)])
            model.compile(optimizer=tf.keras.optimizers.SGD(learning_rate=0.2), loss="mse")
        hist = model.fit(ds.with_options(opts), epochs=args["epochs"], verbose=0)
        box["losses"] = [float(v) for v in hist.history["loss"]]
        box["replicas"] = int(strategy.num_replicas_in_sync)

    t = threading.Thread(target=train, daemon=True)
    t.start()
    t.join(args["fit_timeout_s"])
    if t.is_alive():
        raise TimeoutError(f"model.fit did not finish within {args['fit_timeout_s']} s")
    record.update(box)
    _write_json(os.path.join(args["out"], f"{ctx.job_name}_{ctx.task_index}.json"), record)


def count_main(args, ctx):
    """Reads the feed to its end; writes rows, sum, sum of squares and its own address."""
    import os

    from tfos.util import get_ip_address

    if ctx.job_name == "ps":  # holds no data; stopped by shutdown() once the worker is done
        import threading

        threading.Event().wait()
    feed = ctx.get_data_feed(train_mode=True)
    n = total = squares = 0
    while not feed.should_stop():
        for x in feed.next_batch(100):
            n += 1
            total += x
            squares += x * x
    _write_json(os.path.join(args["out"], f"{ctx.job_name}_{ctx.task_index}.json"),
                {"rows": n, "sum": total, "squares": squares, "host": get_ip_address(), "ctx_host": ctx.host})


def tensorboard_main(args, ctx):
    """The chief writes one scalar summary and returns (TensorBoard lives until shutdown)."""
    import os

    if ctx.job_name == "chief":
        import tensorflow as tf

        w = tf.summary.create_file_writer(args["log_dir"])
        with w.as_default():
            tf.summary.scalar("loss", 0.5, step=1)
        w.flush()
    _write_json(os.path.join(args["out"], f"{ctx.job_name}_{ctx.task_index}.json"), {"host": ctx.host})


def training_loop_main(args, ctx):
    """SGD on a linear model (numpy) until told to stop; writes a progress file once
    training is under way, so the test can cut the host mid-training."""
    import os
    import time

    import numpy as np

    rng = np.random.default_rng(ctx.task_index)
    w = np.zeros(8)
    target = np.arange(8.0)
    end = time.monotonic() + args["max_s"]
    step = 0
    while time.monotonic() < end and not os.path.exists(args["stop"]):
        x = rng.normal(size=(32, 8))
        w -= 0.05 * x.T @ (x @ w - x @ target) / 32
        step += 1
        if step == 20:
            _write_json(os.path.join(args["out"], f"{ctx.job_name}_{ctx.task_index}.json"), {"host": ctx.host, "pid": os.getpid()})
        time.sleep(0.01)


def feed_loop_main(args, ctx):
    """Reads the feed slowly (a training step per batch); writes a progress file after its
    first batch, so the test can kill a host while partitions are still being fed."""
    import os
    import time

    feed = ctx.get_data_feed(train_mode=True)
    first = True
    while not feed.should_stop():
        feed.next_batch(100)
        if first:
            _write_json(os.path.join(args["out"], f"{ctx.job_name}_{ctx.task_index}.json"), {"host": ctx.host, "pid": os.getpid()})
            first = False
        time.sleep(0.02)


def _wait_files(out: Path, n: int, timeout_s: float) -> dict:
    end = time.monotonic() + timeout_s
    found = _read_nodes(out)
    while len(found) < n and time.monotonic() < end:
        time.sleep(0.2)
        found = _read_nodes(out)
    assert len(found) >= n, f"only {sorted(found)} started training within {timeout_s} s"
    return found


def _spec_hosts(spec: dict) -> set:
    return {addr.rsplit(":", 1)[0] for addrs in spec.values() for addr in addrs}


# --------------------------------------------------------------------------- tests
@pytest.mark.tf
def test_tensorflow_mode_across_hosts(bed, bed_sc, tmp_path):
    """(a) MultiWorkerMirroredStrategy across two hosts: every TF address is a host's own."""
    args = {"out": str(tmp_path), "epochs": 3, "collective_timeout_s": 120, "fit_timeout_s": 400}
    cluster = TFCluster.run(bed_sc, mwms_main, args, HOSTS, 0, False, TENSORFLOW, master_node="chief", reservation_timeout=300)
    spec = cluster.cluster_spec
    info = cluster.cluster_info
    cluster.shutdown(timeout=SHUTDOWN_TIMEOUT_S)
    assert _spec_hosts(spec) == bed.ips, spec
    assert {n["host"] for n in info} == bed.ips
    nodes = _read_nodes(tmp_path)
    assert set(nodes) == {"chief_0", "worker_0"}
    for name, rec in nodes.items():
        assert rec["spark_local_ip"] == rec["ctx_host"] and rec["ctx_host"] in bed.ips, (name, rec)
        assert _spec_hosts(rec["tf_config"]["cluster"]) == bed.ips, rec["tf_config"]
        assert rec["cluster_spec"] == spec
        assert rec["replicas"] == 2
        assert rec["losses"][-1] < rec["losses"][0], rec["losses"]
    # both workers ran the same synchronous steps on the same replicated model
    assert nodes["chief_0"]["losses"] == pytest.approx(nodes["worker_0"]["losses"])
    assert nodes["chief_0"]["ctx_host"] != nodes["worker_0"]["ctx_host"]
    bed.assert_no_tfos_processes()


@pytest.mark.parametrize("num_ps", [0, 1], ids=["2-workers", "ps-and-worker"])
def test_spark_mode_feeds_across_hosts(bed, bed_sc, tmp_path, num_ps):
    """(b) InputMode.SPARK: exact rows and checksums. With two workers each host's feed tasks
    reach the node of their own host; with a ps on one host, that host's feed tasks send
    every row across the bridge to the worker on the other host."""
    n_rows, parts, epochs = 20000, 8, 2
    rdd = bed_sc.parallelize(range(n_rows), parts)
    cluster = TFCluster.run(bed_sc, count_main, {"out": str(tmp_path)}, HOSTS, num_ps, False, SPARK, reservation_timeout=300)
    info = cluster.cluster_info
    cluster.train(rdd, num_epochs=epochs, feed_timeout=300)
    cluster.shutdown(timeout=SHUTDOWN_TIMEOUT_S)
    nodes = _read_nodes(tmp_path)
    fed = {n["host"] for n in info if n["job_name"] != "ps"}
    assert {n["host"] for n in info} == bed.ips
    assert len(nodes) == HOSTS - num_ps
    assert sum(r["rows"] for r in nodes.values()) == epochs * n_rows
    assert sum(r["sum"] for r in nodes.values()) == epochs * (n_rows * (n_rows - 1) // 2)
    assert sum(r["squares"] for r in nodes.values()) == epochs * sum(x * x for x in range(n_rows))
    assert {r["host"] for r in nodes.values()} == fed
    for name, rec in nodes.items():
        assert rec["host"] == rec["ctx_host"], (name, rec)
        assert rec["rows"] > 0, f"{name} on {rec['host']} got no rows"
    bed.assert_no_tfos_processes()


@pytest.mark.tf
def test_tensorboard_reachable_from_driver(bed, bed_sc, tmp_path):
    """(c) TensorBoard binds the chief's host address; the driver side GETs it (HTTP 200)."""
    log_dir = tmp_path / "tb"
    cluster = TFCluster.run(bed_sc, tensorboard_main, {"out": str(tmp_path), "log_dir": str(log_dir)}, HOSTS, 0, True,
                            TENSORFLOW, log_dir=str(log_dir), master_node="chief", reservation_timeout=300)
    try:
        url = cluster.tensorboard_url(timeout_s=240.0)
        chief = [n for n in cluster.cluster_info if n["job_name"] == "chief"][0]
        assert url is not None and url.startswith(f"http://{chief['host']}:"), (url, chief)
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(url, timeout=60) as resp:
            status = resp.status
            body = resp.read().decode("utf-8", "replace")
    finally:
        cluster.shutdown(timeout=SHUTDOWN_TIMEOUT_S)
    assert status == 200
    assert "TensorBoard" in body
    assert chief["host"] in bed.ips
    bed.assert_no_tfos_processes()


def _lost_host_case(bed, sc, tmp_path, action: str, host_index: int, mode=TENSORFLOW) -> None:
    """Starts training on both hosts, cuts or kills worker host ``host_index`` and asserts
    that the driver call in progress (``shutdown()`` in InputMode.TENSORFLOW, ``train()``
    in InputMode.SPARK) raises naming that host and its node within 2 x heartbeat_timeout."""
    ip = bed.hosts[host_index]["ip"]
    _wait_executors(sc, HOSTS, 180.0)
    args = {"out": str(tmp_path), "stop": str(tmp_path / "stop"), "max_s": 600}
    main = training_loop_main if mode == TENSORFLOW else feed_loop_main
    cluster = TFCluster.run(sc, main, args, HOSTS, 0, False, mode, master_node="chief",
                            reservation_timeout=300, heartbeat_timeout=HEARTBEAT_S)
    box: dict = {}

    def feed() -> None:  # InputMode.SPARK: train() blocks while the host is lost
        try:
            cluster.train(sc.parallelize(range(1_000_000), 16), feed_timeout=300)
        except BaseException as exc:  # noqa: BLE001 - inspected by the test
            box["error"] = exc
        box["t"] = time.monotonic()

    try:
        info = cluster.cluster_info
        [victim] = [n for n in info if n["host"] == ip]
        feeder = None
        if mode == SPARK:
            feeder = threading.Thread(target=feed, name="feed", daemon=True)
            feeder.start()
        _wait_files(tmp_path, HOSTS, 240.0)
        bed.sh(action, str(host_index))
        t0 = time.monotonic()
        if feeder is None:
            with pytest.raises(ClusterFailedError) as err:
                cluster.shutdown(timeout=SHUTDOWN_TIMEOUT_S)
            elapsed = time.monotonic() - t0
            error = err.value
        else:
            feeder.join(SHUTDOWN_TIMEOUT_S)
            assert not feeder.is_alive(), "train() did not return"
            error = box.get("error")
            assert isinstance(error, ClusterFailedError), repr(error)
            elapsed = box["t"] - t0
            cluster.shutdown()  # joins the teardown of the failed cluster
    finally:
        (tmp_path / "stop").touch()
    text = str(error)
    print(f"{action} {ip} ({mode.name}): raised after {elapsed:.1f} s (heartbeat_timeout {HEARTBEAT_S:g} s): {text}")
    node = f"{victim['job_name']}:{victim['task_index']}"
    assert f"{node} (executor {victim['executor_id']}, host {ip})" in text, text
    assert elapsed < 2 * HEARTBEAT_S, f"the lost host surfaced after {elapsed:.1f} s (bound {2 * HEARTBEAT_S} s): {text}"


def test_cut_host_is_named_fast(bed, bed_sc, tmp_path):
    """(d) First of the two failure tests: worker host 2 is cut off the network (its link
    down) while InputMode.TENSORFLOW trains."""
    _lost_host_case(bed, bed_sc, tmp_path, "cut", 2)
    bed.sh("heal", "2")
    bed.assert_no_tfos_processes(hosts=[2])


def test_killed_host_is_named_fast(bed, bed_sc, tmp_path):
    """(d) Last test (host 1 stays dead): worker host 1 crashes (its worker, executor and tfos
    processes SIGKILLed) while InputMode.SPARK feeds both hosts."""
    _lost_host_case(bed, bed_sc, tmp_path, "kill-worker", 1, SPARK)
    bed.assert_no_tfos_processes(hosts=[2])


# --------------------------------------------------------------------------- restarts (issue 14)
def gd_main(args, ctx):
    """Deterministic full-batch gradient descent on a fixed least-squares problem, with a
    checkpoint (weights, epoch) per epoch on the shared file system, keyed by the node's
    role so that a restart on another host resumes it. Writes the final loss."""
    import json
    import os
    import time

    import numpy as np

    rng = np.random.default_rng(7)
    x = rng.normal(size=(256, 8))
    y = x @ rng.normal(size=8) + 0.1 * rng.normal(size=256)
    name = f"{ctx.job_name}{ctx.task_index}"
    ckpt = os.path.join(args["out"], f"ckpt-{name}.json")
    w, start = np.zeros(8), 0
    if os.path.exists(ckpt):
        saved = json.load(open(ckpt))
        w, start = np.array(saved["w"]), saved["epoch"]
    _write_json(os.path.join(args["out"], f"start-{ctx.attempt}-{name}.json"), {"epoch": start, "host": ctx.host})
    for epoch in range(start, args["epochs"]):
        w = w - args["lr"] * (2.0 / len(y)) * (x.T @ (x @ w - y))
        _write_json(ckpt, {"w": w.tolist(), "epoch": epoch + 1})
        time.sleep(args["epoch_s"])
    _write_json(os.path.join(args["out"], f"final-{name}.json"), {"loss": float(np.mean((x @ w - y) ** 2)), "attempt": ctx.attempt})


def _gd_run(sc, out: Path, max_restarts: int, kill=None):
    out.mkdir()
    args = {"out": str(out), "epochs": 80, "lr": 0.01, "epoch_s": 0.25}
    cluster = TFCluster.run(sc, gd_main, args, HOSTS, 0, False, TENSORFLOW, master_node="chief",
                            reservation_timeout=300, heartbeat_timeout=HEARTBEAT_S, max_restarts=max_restarts,
                            executor_wait_s=240)
    if kill is not None:
        kill(cluster)
    cluster.shutdown(timeout=SHUTDOWN_TIMEOUT_S)
    finals = {p.stem[len("final-"):]: json.loads(p.read_text()) for p in out.glob("final-*.json")}
    return cluster, finals


def test_restart_on_a_third_host_matches_an_uninterrupted_run(bed, bed_sc, tmp_path, caplog):
    """After the crash test (host 1 dead): host 3 joins, an uninterrupted run gives the
    reference loss; host 4 joins as a spare, a second run loses the host of worker:0
    mid-training, and with max_restarts=1 it finishes on the spare host with the same loss."""
    import logging

    caplog.set_level(logging.WARNING, logger="tfos")
    bed.sh("add-worker", timeout_s=300.0)
    bed.load()
    _wait_executors(bed_sc, HOSTS, 240.0)
    _, reference = _gd_run(bed_sc, tmp_path / "reference", 0)
    assert set(reference) == {"chief0", "worker0"}, reference

    bed.sh("add-worker", timeout_s=300.0)  # the spare host: the app holds spark.cores.max executors already
    bed.load()
    lost: dict = {}

    def kill_worker_host(cluster) -> None:
        [victim] = [n for n in cluster.cluster_info if n["job_name"] == "worker"]
        [index] = [i for i, h in bed.hosts.items() if h["ip"] == victim["host"]]
        ckpt = tmp_path / "restarted" / "ckpt-worker0.json"
        end = time.monotonic() + 240
        while time.monotonic() < end and not (ckpt.exists() and json.loads(ckpt.read_text())["epoch"] >= 10):
            time.sleep(0.2)
        bed.sh("kill-worker", str(index))
        lost.update(host=victim["host"], index=index, t=time.monotonic())

    t0 = time.monotonic()
    cluster, finals = _gd_run(bed_sc, tmp_path / "restarted", 1, kill_worker_host)
    print(f"restart across hosts: run took {time.monotonic() - t0:.1f} s; host {lost['host']} killed "
          f"{lost['t'] - t0:.1f} s in; finals {finals}; reference {reference}")
    assert cluster.attempt == 1
    assert set(finals) == {"chief0", "worker0"} and all(f["attempt"] == 1 for f in finals.values()), finals
    for name, ref in reference.items():
        assert abs(finals[name]["loss"] - ref["loss"]) <= 1e-9 * max(1.0, ref["loss"]), (name, finals[name], ref)
    restarted = json.loads((tmp_path / "restarted" / "start-1-worker0.json").read_text())
    assert restarted["epoch"] >= 10 and restarted["host"] != lost["host"], restarted  # resumed, elsewhere
    text = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert f"host {lost['host']})" in text and "attempt 0 failed" in text, text
    bed.assert_no_tfos_processes(hosts=[i for i in bed.hosts if i != lost["index"]])
