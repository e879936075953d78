"""docs/deploy.md's recipe: a venv packed with venv-pack, shipped with spark-submit --archives
to the standalone cluster of scripts/spark_standalone.sh, runs the tfos nodes.

The packed venv is small on purpose: it holds tfos (installed from its wheel) and a marker
package, and reaches its other dependencies (PySpark, numpy, ...) through a sitecustomize that appends
this venv's site-packages to sys.path, which exists on this one-machine cluster. Packing the full
TensorFlow venv (3 GB, scripts/venv_size.sh) works the same way but would take minutes in the suite; the
mechanics tested here (archive unpacked as ./environment on each executor, executors and the
tfos node processes running its Python and its packages) are the same.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import sysconfig
import textwrap

import pytest

pytestmark = [pytest.mark.spark, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

JOB = textwrap.dedent('''
    import sys
    from pyspark.sql import SparkSession
    from tfos import TFCluster

    def main_fun(args, ctx):
        import json, os, sys, tfos, tfos_deploy_marker
        with open(os.path.join(args, f"{ctx.job_name}-{ctx.task_index}.json"), "w") as f:
            json.dump({"python": sys.executable, "tfos": tfos.__file__, "marker": tfos_deploy_marker.VALUE}, f)

    spark = SparkSession.builder.appName("tfos-deploy-test").getOrCreate()
    sc = spark.sparkContext
    import tfos
    print("driver tfos:", tfos.__file__)
    cluster = TFCluster.run(sc, main_fun, sys.argv[1], 2, 0, master_node="chief", reservation_timeout=240)
    cluster.shutdown(timeout=240)
    print("executor python:", sc.parallelize([0], 1).map(lambda _: __import__("sys").executable).collect()[0])
    spark.stop()
''')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _clean_env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYSPARK_GATEWAY_PORT", "PYSPARK_GATEWAY_SECRET", "SPARK_HOME")}
    env["SPARK_LOCAL_IP"] = "127.0.0.1"
    return env


def test_venv_pack_archive_on_standalone_cluster(tmp_path, no_leftovers):
    # 1. a venv with tfos (from its wheel) and a package only it has
    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.py", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    shutil.copytree(os.path.join(ROOT, "tfos"), src / "tfos", ignore=shutil.ignore_patterns("__pycache__"))
    # pip without PYTHONPATH: a checkout on it with a tfos.egg-info (pip install -e leaves
    # one) made pip take tfos for installed in the new venv, and install nothing there.
    pip_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                    "-w", str(tmp_path / "dist"), str(src)], check=True, timeout=300, env=pip_env)
    wheel = next((tmp_path / "dist").glob("tfos-*.whl"))
    venv = tmp_path / "pyspark_venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = str(venv / "bin" / "python")
    subprocess.run([sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-deps", "--no-index", str(wheel)],
                   check=True, timeout=300, env=pip_env)
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    with open(os.path.join(site, "tfos_deploy_marker.py"), "w") as f:
        f.write("VALUE = 'shipped-42'\n")
    # (a sitecustomize, not a .pth: venv-pack refuses .pth path entries as editable installs)
    with open(os.path.join(site, "sitecustomize.py"), "w") as f:
        f.write(f"import sys\nsys.path.append({sysconfig.get_paths()['purelib']!r})\n")
    # 2. pack it
    archive = tmp_path / "pyspark_venv.tar.gz"
    subprocess.run([os.path.join(os.path.dirname(sys.executable), "venv-pack"), "-p", str(venv), "-o", str(archive), "-q"],
                   check=True, timeout=300)
    # 3. the standalone cluster, on free ports, with a clean environment
    state = tmp_path / "standalone"
    env = _clean_env()
    port = _free_port()
    env.update(PYTHON=sys.executable, SPARK_STANDALONE_DIR=str(state), SPARK_MASTER_PORT=str(port),
               SPARK_MASTER_WEBUI_PORT=str(_free_port()), SPARK_WORKER_CORES="1", SPARK_WORKER_MEMORY="1g",
               SPARK_WORKER_INSTANCES="2")  # two workers, as two machines would be
    script = os.path.join(ROOT, "scripts", "spark_standalone.sh")
    subprocess.run(["bash", script, "start"], check=True, env=env, timeout=300)
    try:
        job = tmp_path / "job.py"
        job.write_text(JOB)
        conf_dir = state / "conf"  # the cluster's secret (spark.authenticate, crypto), as docs/deploy.md says
        assert oct(conf_dir.stat().st_mode & 0o777) == "0o700"
        assert oct((conf_dir / "spark-defaults.conf").stat().st_mode & 0o777) == "0o600"
        submit = dict(env, PYSPARK_DRIVER_PYTHON=sys.executable, PYSPARK_PYTHON="./environment/bin/python",
                      PYTHONPATH=ROOT, SPARK_CONF_DIR=str(conf_dir))  # the driver runs this checkout's tfos; executors only the archive's
        proc = subprocess.run(
            [os.path.join(os.path.dirname(sys.executable), "spark-submit"), "--master", f"spark://127.0.0.1:{port}",
             "--archives", f"{archive}#environment", "--total-executor-cores", "2", "--executor-cores", "1",
             "--executor-memory", "768m", "--conf", "spark.driver.host=127.0.0.1", "--conf", "spark.log.level=WARN", str(job), str(tmp_path)],
            cwd=str(tmp_path), env=submit, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=600,
        )
    finally:
        subprocess.run(["bash", script, "stop"], env=env, timeout=120)
    out, err = proc.stdout, proc.stderr
    assert proc.returncode == 0, f"stdout:\n{out[-3000:]}\nstderr:\n{err[-6000:]}"
    # authenticated and encrypted: tfos has nothing to warn about
    assert "tfos cluster key" not in err, err[-6000:]  # in each of tfos's key-transport WARNINGs
    m = re.search(r"^executor python: (\S+)$", out, re.MULTILINE)
    assert m and m.group(1).endswith("/environment/bin/python") and str(state) in m.group(1), out
    workers = set()
    for node in ("chief-0", "worker-0"):
        with open(tmp_path / f"{node}.json") as f:
            seen = json.load(f)
        workers.add(re.search(r"/work/(\d+)/", seen["python"]).group(1))
        assert seen["python"].endswith("/environment/bin/python") and str(state) in seen["python"], seen
        assert "/environment/lib/" in seen["tfos"], seen  # tfos from the archive
        assert seen["marker"] == "shipped-42"
    assert workers == {"1", "2"}, workers  # one node on each worker (1 core each)
