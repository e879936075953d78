"""A small tfos driver program run as a subprocess by test_driver_death.py (not a test).

Usage: python driver_program.py OUT_DIR HEARTBEAT_TIMEOUT_S

Starts a local-cluster[2,1,1024] SparkContext and a 2-node InputMode.SPARK cluster whose
main_fun starts a child process (``sleep`` in Python, tagged on its command line) and
reads a slow feed; writes OUT_DIR/ready once every node wrote its pids, then feeds until
it is killed.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time


def main_fun(args, ctx):
    import json as _json
    import os as _os
    import subprocess
    import sys as _sys
    import time as _time

    child = subprocess.Popen([_sys.executable, "-c", "import time; time.sleep(600)", "tfos-test-child-of-main-fun"])
    with open(_os.path.join(args["out"], f"node{ctx.executor_id}.json"), "w") as f:
        _json.dump({"pid": _os.getpid(), "child": child.pid}, f)
    feed = ctx.get_data_feed(train_mode=True)
    while not feed.should_stop():
        feed.next_batch(10)
        _time.sleep(0.05)  # a slow consumer: the driver stays inside train()


def main() -> int:
    out, hb = sys.argv[1], float(sys.argv[2])
    from pyspark import SparkConf, SparkContext

    from tfos import TFCluster

    conf = (
        SparkConf().setMaster("local-cluster[2,1,1024]").setAppName("tfos-driver-death")
        .set("spark.ui.enabled", "false").set("spark.ui.showConsoleProgress", "false")
        .set("spark.driver.host", "127.0.0.1").set("spark.executor.memory", "768m")
    )
    sc = SparkContext(conf=conf)
    sc.setLogLevel("ERROR")
    cluster = TFCluster.run(sc, main_fun, {"out": out}, 2, 0, input_mode=TFCluster.InputMode.SPARK, heartbeat_timeout=hb,
                            executor_wait_s=300, reservation_timeout=300)

    def _ready() -> None:
        while not all(os.path.exists(os.path.join(out, f"node{i}.json")) for i in range(2)):
            time.sleep(0.1)
        with open(os.path.join(out, "driver.json"), "w") as f:
            json.dump({"pid": os.getpid()}, f)
        os.rename(os.path.join(out, "driver.json"), os.path.join(out, "ready"))

    threading.Thread(target=_ready, daemon=True).start()
    cluster.train(sc.parallelize(range(10_000_000), 20), feed_timeout=600)
    cluster.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
