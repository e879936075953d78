"""Fed Keras 3 idioms on Spark (shared ``local-cluster[2,1,1024]``): every fed row trained, and
the driver's row accounting (docs/datafeed.md, "Row accounting", "Auto-shard policy").

One cluster, four ``train()`` calls, each a form users write:

0. ``tf.data.Dataset.from_generator`` over ``DataFeed.next_batch`` (TensorFlowOnSpark's own
   Keras examples), ``fit(steps_per_epoch=...)`` over two Keras epochs per fed epoch. Without
   tfos, TensorFlow's AUTO auto-shard falls back to DATA on a generator and each of two workers
   trains half of its own rows.
1. The same with ``AutoShardPolicy.DATA`` set on the dataset (the per-dataset opt-out, as a
   program that really wants it would), one ``fit`` to the generator's end: half the rows
   are lost, and the driver logs one
   row-accounting WARNING per node naming the node, the call, the epoch and both counts.
2. A ``filter()`` keeping half of the rows (auto-shard OFF, tfos's default): half the rows
   are lost, the ratio of an auto-shard on 2 workers, but the WARNING names the pipeline, not
   auto-sharding (the node knows the policy it distributed with).
3. ``as_dataset(batch_size).unbatch().take(100).batch(16)`` and one ``fit(epochs=1)``, then
   ``main_fun`` returns (the feed ends with it): the rows the node received but never read
   are counted, and the WARNING names the node, epoch, "at least" the rows fed, the rows
   trained and that main_fun stopped reading the feed; no "Your input ran out of data".

Run with ``TFOS_KERAS3_FIX=0`` (driver) to see it fail: ``fit`` raises on both nodes.
"""

from __future__ import annotations

import logging
import os

import pytest

from tfos import TFCluster

pytestmark = [pytest.mark.spark, pytest.mark.tf, pytest.mark.timeout(600)]

ROWS_PER_PARTITION = 320  # one partition per node and epoch: 20 batches of 16
BATCH = 16
TAKE = 100  # rows call 3 trains of each node's 320


def fed_rows_main(args, ctx):
    import keras
    import numpy as np
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(1, activation="sigmoid")])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="binary_crossentropy", metrics=["accuracy"])
    feed = ctx.get_data_feed()
    steps = args["rows"] // args["batch"]
    spec = (tf.TensorSpec((None, 4), tf.float32), tf.TensorSpec((None,), tf.float32))

    def generator(batches):
        def rows():
            for _ in range(batches):
                batch = np.asarray(feed.next_batch(args["batch"]), np.float32)
                if not len(batch):
                    return
                yield batch[:, 1:5], batch[:, 5]
        return rows

    # 0: from_generator over the feed, steps_per_epoch; two Keras epochs of half a fed epoch each
    # (MultiWorkerMirroredStrategy takes a dataset's batch as the global batch: one step
    # trains half of a node's batch, 2 x steps steps its rows).
    ds = tf.data.Dataset.from_generator(generator(steps), output_signature=spec)
    model.fit(ds, epochs=2, steps_per_epoch=steps, verbose=0)
    # 1: DATA forced on the dataset: each worker keeps every other batch of its own rows.
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    ds = tf.data.Dataset.from_generator(generator(steps), output_signature=spec).with_options(options)
    model.fit(ds, epochs=1, verbose=0)  # to the generator's end: every row of the call handed out
    # 2: a filter() keeping the rows labelled 1 (half of them), auto-shard left to tfos (OFF).
    ds = tf.data.Dataset.from_generator(generator(steps), output_signature=spec)
    model.fit(ds.unbatch().filter(lambda x, y: y > 0.5).batch(args["batch"]), epochs=1, verbose=0)
    # 3: the quick start's feed with a take(): fit ends after 100 rows, then main_fun returns.
    ds = feed.as_dataset(args["batch"], (tf.TensorSpec((None,), tf.float32),) * 6)
    ds = ds.map(lambda i, a, b, c, d, y: (tf.stack([a, b, c, d], 1), y))
    model.fit(ds.unbatch().take(args["take"]).batch(args["batch"]), epochs=1, verbose=0)


def _rdd(sc, seed: int, half_labelled: bool = False):
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(2 * ROWS_PER_PARTITION, 4))
    y = (np.arange(len(x)) % 2).astype(float) if half_labelled else (x.sum(axis=1) > 0).astype(float)
    rows = [(float(i), *map(float, x[i]), float(y[i])) for i in range(len(x))]
    return sc.parallelize(rows, 2)


def test_fed_rows_are_counted_and_a_pipeline_that_drops_them_is_named(sc, no_leftovers, monkeypatch, caplog, capfd):
    monkeypatch.delenv("TF_USE_LEGACY_KERAS", raising=False)
    args = {"rows": ROWS_PER_PARTITION, "batch": BATCH, "take": TAKE}
    with caplog.at_level(logging.WARNING, logger="tfos._driver.row_accounting"):
        cluster = TFCluster.run(sc, fed_rows_main, args, 2, 0, False, TFCluster.InputMode.SPARK, reservation_timeout=120)
        cluster.train(_rdd(sc, 0), num_epochs=1, feed_timeout=300)
        cluster.train(_rdd(sc, 1), num_epochs=1, feed_timeout=300)
        cluster.train(_rdd(sc, 2, half_labelled=True), num_epochs=1, feed_timeout=300)
        cluster.train(_rdd(sc, 3), num_epochs=1, end_of_feed=True, feed_timeout=300)
        cluster.shutdown(timeout=300)
    table = cluster.row_accounting()
    by_call = {c: [r for r in table if r.train_call == c] for c in range(4)}
    assert sorted(by_call) == [0, 1, 2, 3] and all(len(rows) == 2 for rows in by_call.values()), table
    for r in by_call[0]:
        # Every fed row trained once, on its own node (not half of them: no auto-shard of fed data).
        assert r.closed and r.ok and r.fed == r.trained == ROWS_PER_PARTITION and r.policy == "OFF", r
    for r in by_call[1]:
        assert r.closed and not r.ok and r.fed == ROWS_PER_PARTITION and r.trained == ROWS_PER_PARTITION // 2, r
        assert "AutoShardPolicy.DATA" in r.cause and r.policy == "DATA", r
    for r in by_call[2]:
        # Half lost as with a DATA auto-shard, but the policy was OFF: the filter is named.
        assert r.closed and not r.ok and r.fed == ROWS_PER_PARTITION and r.trained == ROWS_PER_PARTITION // 2, r
        assert r.policy == "OFF" and "AutoShardPolicy" not in r.cause and "filter()" in r.cause, r
    for r in by_call[3]:
        # 320 rows sent to the node; 100 trained; the rest read ahead or never read at all
        # (as_dataset buffered the whole partition and acknowledged it: no "at least").
        assert r.closed and not r.ok and r.trained == TAKE and r.unread > 0, r
        assert TAKE < r.fed <= ROWS_PER_PARTITION and r.difference == TAKE - r.fed, r
        assert "main_fun stopped reading the feed" in r.cause, r
    warnings = [rec.getMessage() for rec in caplog.records if rec.name == "tfos._driver.row_accounting"]
    assert len(warnings) == 6, warnings  # one per node, for calls 1, 2 and 3 only
    for r in by_call[1] + by_call[2] + by_call[3]:
        line = next(w for w in warnings if f"executor {r.executor_id}," in w and f"train() call {r.train_call}," in w)
        host = r.node.rsplit("host ", 1)[1].rstrip(")")
        assert r.node in line and host and (r.node.startswith("chief:0") or r.node.startswith("worker:")), line
        fed = (f"{'at least ' if r.at_least else ''}{r.fed} rows fed to the node ({r.unread} never read by main_fun)"
               if r.train_call == 3 else f"{r.fed} rows fed to TensorFlow")
        assert f"train() call {r.train_call}, epoch 0: {fed}, {r.trained} trained" in line, line
    out, err = capfd.readouterr()
    assert "ran out of data" not in out + err  # the feed's planned end is not Keras's "interrupting training"
    assert os.environ.get("TFOS_KERAS3_FIX", "1") != "0"
