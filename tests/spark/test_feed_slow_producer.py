"""A slow producer neither starves a node nor hides its failure (local-cluster).

The fed RDD's rows come slowly, as from an upstream decoder or a remote read: 200 rows per
partition, one every 0.05 s or 0.1 s (10 s and 20 s partitions). ``main_fun`` records when
its first row arrived and raises after 10 rows. Before the feed bounded its buffers in
time, a row reached ``main_fun`` only when its partition ended, and the error came 11.2 s
and 21.5 s after ``train()`` started. Now rows arrive within the linger time (50 ms) of
being produced, and the error follows the fault within seconds, whatever the partition's
duration. The bounds asserted here are loose (the test machine is loaded);
``scripts/bench_failures.py --only slow-producer`` measures the figures in
docs/reliability.md.
"""

from __future__ import annotations

import json
import os
import time

import pytest

pytest.importorskip("pyspark")

from tfos import TFCluster  # noqa: E402
from tfos.errors import ClusterFailedError  # noqa: E402

pytestmark = pytest.mark.spark

ROWS_PER_PART = 200


def _raise_after_ten(args, ctx):
    import json as _json
    import os as _os
    import time as _time

    feed = ctx.get_data_feed(train_mode=True)
    first = feed.next_batch(1)
    arrived = _time.time()
    rows = list(first)
    while len(rows) < 10 and not feed.should_stop():
        rows.extend(feed.next_batch(10 - len(rows)))
    record = {"first_lag_s": arrived - first[0][1], "tenth_produced": rows[-1][1], "fault": _time.time(), "rows": len(rows)}
    path = _os.path.join(args["out"], f"node{ctx.executor_id}.json")
    with open(path + ".tmp", "w") as f:
        _json.dump(record, f)
    _os.replace(path + ".tmp", path)
    raise RuntimeError(f"main_fun of executor {ctx.executor_id} failed after {len(rows)} rows")


def _slow_rdd(sc, every_s: float, parts: int = 2):
    def _produce(i):
        import time as _time

        _time.sleep(every_s)
        return (i, _time.time())  # the row and when it was produced

    return sc.parallelize(range(parts * ROWS_PER_PART), parts).map(_produce)


@pytest.mark.parametrize("every_s", [0.05, 0.1])
def test_a_slow_producers_failure_is_reported_within_seconds(sc, no_leftovers, tmp_path, every_s):
    partition_s = ROWS_PER_PART * every_s
    cluster = TFCluster.run(sc, _raise_after_ten, {"out": str(tmp_path)}, 2, 0, input_mode=TFCluster.InputMode.SPARK,
                            reservation_timeout=300)
    started = time.time()
    with pytest.raises(ClusterFailedError) as ei:
        cluster.train(_slow_rdd(sc, every_s), feed_timeout=600)
    raised = time.time()
    cluster.shutdown()
    text = str(ei.value)
    assert "RuntimeError: main_fun of executor" in text and "failed after 10 rows" in text, text
    records = [json.loads(p.read_text()) for p in tmp_path.glob("node*.json")]
    assert records, "no node recorded its fault"
    fault = min(r["fault"] for r in records)
    tenth = min(r["tenth_produced"] for r in records)
    # Before: the first row arrived when its partition ended (10.3 s into a 10 s partition)
    # and the error came 11.5 s after train() started (21.5 s with 20 s partitions). The
    # strict figures (<= 5 s) are bench_failures.py's; these bounds are loose for a loaded
    # machine and still below the partition's duration.
    assert raised - fault < 8.0, (raised - fault, records)
    assert raised - tenth < 8.0, (raised - tenth, records)
    assert raised - started < min(10.0, partition_s - 1.5), (raised - started, records)
    # The first row reached main_fun about the linger time after it was produced (strict
    # figure: 0.5 s; loose here).
    assert all(r["first_lag_s"] < 2.0 for r in records), records
    assert all(r["rows"] == 10 for r in records), records
