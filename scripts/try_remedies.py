"""Applies the remedies of tfos's configuration errors on the masters this machine has, and
checks that each one works (or, for a wrong hint, that it does not).

    python scripts/try_remedies.py [--only NAME ...]

Each trial is a fresh driver process (one SparkContext per process) that asks
``TFCluster.run`` for some nodes on a master and a configuration, and prints either the
ConfigurationError or how many executors and nodes ran. Trials:

- local: 2 nodes on local[1] are refused with "use local[2]"; local[2] runs them.
- local-cluster: 4 nodes on local-cluster[2,1,1024] are refused with "local-cluster[4,1,1024]";
  spark.executor.instances=4 leaves it at 2 executors; local-cluster[4,1,...] runs 4 nodes.
  Two task slots per executor (local-cluster[2,2,1024]) are refused; both remedies
  (local-cluster[2,1,1024], spark.task.cpus=2) run the 2 nodes.
- standalone (scripts/spark_standalone.sh on free ports, authenticated): 4 nodes with
  --total-executor-cores 2 are refused with "--total-executor-cores 4 ... on workers with 4 free
  cores"; spark.executor.instances=4 does nothing there; --total-executor-cores 4
  --executor-cores 1 on workers with 4 cores runs them. An application without
  --executor-cores gets one 2-core executor per worker and is refused with "--executor-cores 1".
  The driver gets the cluster's secret from its SPARK_CONF_DIR: no security WARNING.

YARN and Kubernetes cannot run here; their remedies follow Spark's documentation and source
(tests/unit/test_remedies.py). Prints one PASS/FAIL line per trial; exits 1 on a FAIL.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DRIVER = r'''
import json, logging, sys, time
from pyspark import SparkConf, SparkContext
import tfos
from tfos import TFCluster
from tfos.errors import ConfigurationError

master, nodes, conf = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
warnings = []
class Keep(logging.Handler):
    def emit(self, record):
        warnings.append(record.getMessage())
logging.getLogger("tfos").addHandler(Keep(logging.WARNING))
want = int(conf.pop("_wait_executors", 0))
tfos.authenticate_spark(master)  # standalone: keeps the cluster's secret of SPARK_CONF_DIR
c = SparkConf().setMaster(master).setAppName("tfos-try-remedies").set("spark.ui.enabled", "false")
c.set("spark.driver.host", "127.0.0.1").set("spark.ui.showConsoleProgress", "false")
for k, v in conf.items():
    c.set(k, v)
sc = SparkContext(conf=c)
sc.setLogLevel("ERROR")
if want:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and sc._jsc.sc().getExecutorMemoryStatus().size() - 1 < want:
        time.sleep(0.5)
executors = sc._jsc.sc().getExecutorMemoryStatus().size() - 1

def main_fun(args, ctx):
    pass

out = {"executors": executors}
try:
    cluster = TFCluster.run(sc, main_fun, {}, nodes, 0, input_mode=TFCluster.InputMode.TENSORFLOW,
                            reservation_timeout=180, executor_wait_s=20)
    out["nodes"] = len(cluster.cluster_info)
    cluster.shutdown(timeout=120)
except ConfigurationError as exc:
    out["error"] = str(exc)
out["warnings"] = [w for w in warnings if "spark.authenticate" in w or "cluster key" in w]
print("RESULT " + json.dumps(out))
sc.stop()
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_driver(master: str, nodes: int, conf: dict, env: dict | None = None) -> dict:
    """One driver process; returns its RESULT (executors, nodes or error, warnings)."""
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(DRIVER)
    try:
        proc = subprocess.run([sys.executable, f.name, master, str(nodes), json.dumps(conf)], cwd=ROOT,
                              env=env or _env(), capture_output=True, text=True, timeout=600)
    finally:
        os.unlink(f.name)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"driver failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYSPARK_GATEWAY_PORT", "PYSPARK_GATEWAY_SECRET")}
    env.update(PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable, SPARK_LOCAL_IP="127.0.0.1",
               TFOS_PROGRESS="0", PYTHONPATH=ROOT)
    env.update(extra)
    return env


RESULTS: list[tuple[str, bool, str]] = []


def check(name: str, ok: bool, detail: str) -> None:
    RESULTS.append((name, ok, detail))
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)


def trial_local() -> None:
    r = run_driver("local[1]", 2, {})
    check("local[1], 2 nodes: refused, says local[2]", "use local[2] or more" in r.get("error", ""), r.get("error", r))
    r = run_driver("local[2]", 2, {})
    check("local[2] runs 2 nodes", r.get("nodes") == 2 and not r["warnings"], json.dumps(r))


def trial_local_cluster() -> None:
    small = {"spark.executor.memory": "512m", "_wait_executors": "2"}
    r = run_driver("local-cluster[2,1,1024]", 4, small)
    check("local-cluster[2,1,1024], 4 nodes: refused, says local-cluster[4,1,1024], not spark.executor.instances",
          "local-cluster[4,1,1024]" in r.get("error", "") and "spark.executor.instances" not in r.get("error", ""),
          r.get("error", r))
    r = run_driver("local-cluster[2,1,1024]", 4, {**small, "spark.executor.instances": "4", "_wait_executors": "4"})
    check("the old hint spark.executor.instances=4 leaves local-cluster[2,1,1024] at 2 executors",
          r["executors"] == 2 and "error" in r, f"executors={r['executors']}")
    r = run_driver("local-cluster[4,1,768]", 4, {**small, "_wait_executors": "4"})
    check("local-cluster[4,1,768] runs 4 nodes", r.get("nodes") == 4 and not r["warnings"], json.dumps(r))
    r = run_driver("local-cluster[2,2,1024]", 2, small)
    text = r.get("error", "")
    check("local-cluster[2,2,1024]: refused, says local-cluster[2,1,1024] or spark.task.cpus=2",
          "local-cluster[2,1,1024]" in text and "spark.task.cpus=2" in text, text or json.dumps(r))
    r = run_driver("local-cluster[2,2,1024]", 2, {**small, "spark.task.cpus": "2"})
    check("spark.task.cpus=2 on local-cluster[2,2,1024] runs 2 nodes", r.get("nodes") == 2, json.dumps(r))
    r = run_driver("local-cluster[2,1,1024]", 2, small)
    check("local-cluster[2,1,1024] runs 2 nodes, no WARNING (tfos.authenticate_spark)",
          r.get("nodes") == 2 and not r["warnings"], json.dumps(r))


def _standalone(cores: int, workers: int, work: str):
    script = os.path.join(ROOT, "scripts", "spark_standalone.sh")
    port = _free_port()
    env = _env(PYTHON=sys.executable, SPARK_STANDALONE_DIR=work, SPARK_MASTER_PORT=str(port),
               SPARK_MASTER_WEBUI_PORT=str(_free_port()), SPARK_WORKER_CORES=str(cores),
               SPARK_WORKER_MEMORY="2g", SPARK_WORKER_INSTANCES=str(workers))
    subprocess.run(["bash", script, "start"], check=True, env=env, timeout=300, stdout=subprocess.DEVNULL)
    return f"spark://127.0.0.1:{port}", env, lambda: subprocess.run(["bash", script, "stop"], env=env, timeout=120,
                                                                     stdout=subprocess.DEVNULL)


def trial_standalone() -> None:
    work = tempfile.mkdtemp(prefix="tfos-try-standalone-")
    master, env, stop = _standalone(1, 2, work)
    try:
        denv = _env(SPARK_CONF_DIR=os.path.join(work, "conf"))
        base = {"spark.executor.memory": "512m", "spark.executor.cores": "1"}
        r = run_driver(master, 4, {**base, "spark.cores.max": "2", "_wait_executors": "2"}, denv)
        text = r.get("error", "")
        check("standalone, 2 one-core workers, 4 nodes: refused, says --total-executor-cores 4 and worker cores",
              "--total-executor-cores 4" in text and "4 free cores" in text and "spark.executor.instances" not in text,
              text or json.dumps(r))
        r = run_driver(master, 4, {**base, "spark.cores.max": "2", "spark.executor.instances": "4",
                                   "_wait_executors": "4"}, denv)
        check("spark.executor.instances=4 does nothing on standalone (still 2 executors)", r["executors"] == 2,
              f"executors={r['executors']}")
        r = run_driver(master, 2, {**base, "spark.cores.max": "2", "_wait_executors": "2"}, denv)
        check("standalone runs 2 nodes with the cluster's secret, no WARNING", r.get("nodes") == 2 and not r["warnings"],
              json.dumps(r))
    finally:
        stop()
    master, env, stop = _standalone(2, 2, work)
    try:
        denv = _env(SPARK_CONF_DIR=os.path.join(work, "conf"))
        r = run_driver(master, 4, {"spark.executor.memory": "512m", "spark.cores.max": "4", "spark.executor.cores": "1",
                                   "_wait_executors": "4"}, denv)
        check("--total-executor-cores 4 --executor-cores 1 on workers with 4 cores runs 4 nodes", r.get("nodes") == 4,
              json.dumps(r))
        r = run_driver(master, 2, {"spark.executor.memory": "512m", "spark.cores.max": "4", "_wait_executors": "2"}, denv)
        text = r.get("error", "")
        check("standalone without --executor-cores (2-core executors): refused, says --executor-cores 1",
              "--executor-cores 1" in text, text or json.dumps(r))
    finally:
        stop()


TRIALS = {"local": trial_local, "local-cluster": trial_local_cluster, "standalone": trial_standalone}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="*", choices=sorted(TRIALS), help="run only these trials")
    args = p.parse_args()
    t0 = time.monotonic()
    for name in args.only or TRIALS:
        TRIALS[name]()
    fails = [r for r in RESULTS if not r[1]]
    print(f"{len(RESULTS) - len(fails)} of {len(RESULTS)} checks passed in {time.monotonic() - t0:.0f} s")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
