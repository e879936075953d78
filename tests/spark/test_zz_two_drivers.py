"""C08: two driver programs side by side on one host, each with its own tfos cluster.

Each driver is a separate Python process with its own ``local[2]`` SparkContext and a
2-node InputMode.SPARK cluster; both run at the same time and must both succeed (no
port clash between their control servers, data servers or TF ports) and leave no tfos
process behind. Needs no SparkContext in the test process itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("pyspark")

from conftest import assert_no_tfos_processes  # noqa: E402

pytestmark = pytest.mark.spark

_DRIVER = textwrap.dedent(
    """
    import json, os, sys, time
    from pyspark import SparkConf, SparkContext
    from tfos import TFCluster

    out_path, other, tag = sys.argv[1], sys.argv[2], sys.argv[3]

    def main_fun(args, ctx):
        feed = ctx.get_data_feed(train_mode=True)
        total = 0
        while not feed.should_stop():
            total += sum(feed.next_batch(100))
        with open(os.path.join(args["dir"], f"{args['tag']}-sum{ctx.executor_id}"), "w") as f:
            f.write(str(total))

    conf = (SparkConf().setMaster("local[2]").setAppName("tfos-two-drivers-" + tag)
            .set("spark.driver.host", "127.0.0.1").set("spark.ui.enabled", "false")
            .set("spark.ui.showConsoleProgress", "false"))
    sc = SparkContext(conf=conf)
    sc.setLogLevel("ERROR")
    out_dir = os.path.dirname(out_path)
    open(os.path.join(out_dir, tag + ".ready"), "w").close()
    end = time.monotonic() + 180  # start both clusters at the same moment
    while not os.path.exists(os.path.join(out_dir, other + ".ready")) and time.monotonic() < end:
        time.sleep(0.05)
    t0 = time.time()
    cluster = TFCluster.run(sc, main_fun, {"dir": out_dir, "tag": tag}, 2, 0, input_mode=TFCluster.InputMode.SPARK)
    info = cluster.cluster_info
    cluster.train(sc.parallelize(range(1000), 4), num_epochs=1)
    cluster.shutdown()
    t1 = time.time()
    total = sum(int(open(os.path.join(out_dir, f"{tag}-sum{e}")).read()) for e in (0, 1))
    ports = [n["port"] for n in info] + [n["data_port"] for n in info]
    with open(out_path, "w") as f:
        json.dump({"total": total, "ports": ports, "server_port": cluster.server.port, "t0": t0, "t1": t1}, f)
    sc.stop()
    """
)


def test_two_drivers_side_by_side(tmp_path):
    assert_no_tfos_processes()
    script = tmp_path / "driver.py"
    script.write_text(_DRIVER)
    env = dict(os.environ)
    env.pop("PYSPARK_GATEWAY_PORT", None)
    env.pop("PYSPARK_GATEWAY_SECRET", None)
    env.pop("TFOS_SERVER_PORT", None)
    # Each driver starts its cluster once both SparkContexts are up.
    procs = {}
    for tag, other in (("a", "b"), ("b", "a")):
        log = open(tmp_path / f"{tag}.log", "wb")
        procs[tag] = (subprocess.Popen(
            [sys.executable, str(script), str(tmp_path / f"{tag}.json"), other, tag],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(tmp_path),
        ), log)
    try:
        for tag, (p, _) in procs.items():
            rc = p.wait(240)
            assert rc == 0, f"driver {tag} failed (rc {rc}):\n" + (tmp_path / f"{tag}.log").read_text()[-4000:]
    finally:
        for p, log in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)
            log.close()
    results = {tag: json.loads((tmp_path / f"{tag}.json").read_text()) for tag in procs}
    for tag, r in results.items():
        assert r["total"] == sum(range(1000)), (tag, r)
    a, b = results["a"], results["b"]
    used_a = set(a["ports"]) | {a["server_port"]}
    used_b = set(b["ports"]) | {b["server_port"]}
    assert len(used_a) == 5 and len(used_b) == 5
    assert not used_a & used_b, (used_a, used_b)
    # the two clusters really ran at the same time
    assert a["t0"] < b["t1"] and b["t0"] < a["t1"], (a, b)
    assert_no_tfos_processes()
