"""Row accounting on a node (tfos._data.row_count), the fed-data auto-shard rule
(tfos._node.fed_shard) and the array-shuffle seed (tfos._node.keras3_arrays): no Spark, no TF."""

from __future__ import annotations

import json
import warnings

import pytest

from tfos._node import fed_shard, keras3_arrays, keras3_outputs
from tfos._data.figures import NodeFigures
from tfos._data.row_count import RowCount


def _count(trained: list) -> tuple:
    figures = NodeFigures()
    rows = RowCount(figures)
    rows.enable()
    rows._read = lambda: trained[0]
    return rows, figures


def test_rows_trained_are_attributed_to_the_epoch_being_handed_out():
    trained = [0]
    rows, figures = _count(trained)
    rows.handed("f", 0, 16)
    rows.handed("f", 0, 16)
    assert "rows_trained/f/0" not in figures.snapshot()  # the epoch is open
    trained[0] = 24  # 8 rows still in the pipeline when epoch 1 begins
    rows.handed("f", 1, 16)
    trained[0] = 48
    rows.close()
    snap = figures.snapshot()
    assert snap["rows_fed/f/0"] == 32 and snap["rows_fed/f/1"] == 16
    assert snap["rows_trained/f/0"] == 24 and snap["rows_gap/f/0"] == 8
    assert snap["rows_trained/f/1"] == 24 and snap["rows_gap/f/1"] == 0 and snap["rows_final/f/1"] == 1
    assert snap["rows_closed/f/0"] == snap["rows_closed/f/1"] == 1 and "rows_final/f/0" not in snap
    assert snap["rows_batch/f/0"] == 16 and snap["rows_trained"] == 48


class _Conn:
    def __init__(self, epoch, qname="input", mode="train"):
        self.epoch, self.qname, self.mode, self.feed_id, self.kind = epoch, qname, mode, "f", None


def test_rows_received_but_never_read_are_counted_when_main_fun_returns():
    import pickle
    import queue

    from tfos._data.feed_connection import Chunk, PartitionEnd
    from tfos._data.framing import ChunkKind

    figures = NodeFigures()
    rows = RowCount(figures)
    rows.enable()
    rows._read = lambda: 300
    rows.distributed(POLICY_CODES["OFF"])
    rows.handed("f", 0, 320)
    current, later = _Conn(0), _Conn(1)
    current.kind = later.kind = ChunkKind.PICKLED_BATCH
    reader = type("Feed", (), {})()
    reader._conn, reader._rows, reader._pos, reader._peeked = current, list(range(512)), 320, None
    rows.reader(reader)
    ready = queue.Queue()  # an as_dataset reader's ready batches: ((dataset epoch, columns), bytes)
    ready.put(((3, ([0.0] * 16, [1.0] * 16)), 0))
    ready.put(("end marker", 0))
    tf_reader = type("FeedBatches", (), {})()
    tf_reader._out, tf_reader.epoch_keys, tf_reader._feed = ready, {3: ("f", 1)}, type("F", (), {"qname_in": "input"})()
    rows.reader(tf_reader)
    q = queue.Queue()
    for item in (PartitionEnd(current), Chunk(later, bytearray(pickle.dumps(list(range(100))))),
                 Chunk(_Conn(1, mode="inference"), b"")):
        q.put(item)
    terminated = queue.Queue()
    terminated.put(Chunk(_Conn(1, qname="other"), bytearray(pickle.dumps([1, 2]))))
    hub = type("Hub", (), {"queues": {"input": q, "other": terminated}, "terminated": {"other"}, "_conns": {later}})()
    rows.close(hub)
    snap = figures.snapshot()
    assert snap["rows_shard/f/0"] == POLICY_CODES["OFF"] and snap["rows_fed/f/0"] == 320
    assert snap["rows_unread/f/0"] == 192 and snap["rows_unended/f/0"] == 0 and snap["rows_final/f/0"] == 1
    assert snap["rows_unread/f/1"] == 116 and snap["rows_unended/f/1"] == 1 and snap["rows_closed/f/1"] == 1


def test_a_node_without_a_feed_counts_nothing():
    figures = NodeFigures()
    rows = RowCount(figures)
    rows.handed("f", 0, 16)
    rows.close()
    assert figures.snapshot() == {}


@pytest.mark.parametrize("ops, expected", [
    ({"GeneratorDataset", "BatchDatasetV2"}, True),           # from_generator over the feed
    ({"MapDataset", "EagerPyFunc", "RangeDataset"}, True),    # py_function
    ({"TFRecordDatasetV2", "PyFunc"}, False),                 # reads files: AUTO shards them
    ({"TensorSliceDataset", "BatchDatasetV2"}, False),        # in-memory: TensorFlow's default
])
def test_which_datasets_a_fed_node_leaves_unsharded(ops, expected):
    assert fed_shard.reads_python_not_files(frozenset(ops)) is expected


def test_the_auto_shard_opt_out(monkeypatch):
    monkeypatch.delenv(fed_shard.OPT_OUT, raising=False)
    assert not fed_shard.opted_out()
    monkeypatch.setenv(fed_shard.OPT_OUT, "auto")
    assert fed_shard.opted_out()


def test_every_worker_draws_the_same_array_seed(monkeypatch):
    monkeypatch.delenv("TFOS_ARRAY_SHUFFLE_SEED", raising=False)
    spec = {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}
    seeds = {keras3_arrays.cluster_seed(json.dumps({"cluster": spec, "task": {"type": "worker", "index": i}})) for i in (0, 1)}
    assert len(seeds) == 1
    other = keras3_arrays.cluster_seed(json.dumps({"cluster": {"worker": ["127.0.0.1:3", "127.0.0.1:4"]}}))
    assert other not in seeds
    monkeypatch.setenv("TFOS_ARRAY_SHUFFLE_SEED", "7")
    assert keras3_arrays.cluster_seed() == 7
    assert keras3_arrays.dataset_seed(1) != keras3_arrays.dataset_seed(0)


class _Iterator:
    def __init__(self, steps_per_epoch, steps_seen):
        self.steps_per_epoch, self._steps_seen, self.steps_per_execution = steps_per_epoch, steps_seen, 1

    def _interrupted_warning(self):
        warnings.warn("Your input ran out of data; interrupting training.", stacklevel=2)


@pytest.mark.parametrize("fed, steps_per_epoch, steps_seen, warned", [
    (True, None, 5, False),   # a fed epoch ended where its rows did: planned
    (True, None, 1, True),    # an epoch that found no data at all
    (True, 10, 5, True),      # steps_per_epoch asked for more than the data held
    (False, None, 5, True),   # not a fed node: Keras's behaviour
])
def test_the_end_of_data_warning(fed, steps_per_epoch, steps_seen, warned):
    cls = type("EpochIterator", (_Iterator,), {})
    keras3_outputs.quiet_planned_end(cls, lambda: fed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cls(steps_per_epoch, steps_seen)._interrupted_warning()
    assert bool(caught) is warned


# ----------------------------------------------------------------- the driver's verdict
from tfos._data.row_count import POLICY_CODES  # noqa: E402
from tfos._driver.row_accounting import READ_AHEAD_BATCHES, RowAccounting, fed_text, judge_node  # noqa: E402


def _node(*epochs, keras=True, policy="OFF", unread=None):
    """Figures of one node: ``(fed, trained, gap, final)`` per epoch of feed ``a``, batch 16,
    every epoch distributed with auto-shard ``policy``; ``unread``: ``{epoch: (rows, partitions)}``."""
    counters = {"rows_trained": 1} if keras else {}
    for e, (fed, trained, gap, final) in enumerate(epochs):
        counters.update({f"rows_fed/a/{e}": fed, f"rows_trained/a/{e}": trained, f"rows_gap/a/{e}": gap,
                         f"rows_batch/a/{e}": 16, f"rows_closed/a/{e}": 1})
        if policy:
            counters[f"rows_shard/a/{e}"] = POLICY_CODES[policy]
        if final:
            counters[f"rows_final/a/{e}"] = 1
    for e, (rows, parts) in (unread or {}).items():
        counters.update({f"rows_unread/a/{e}": rows, f"rows_unended/a/{e}": parts, f"rows_final/a/{e}": 1,
                         f"rows_closed/a/{e}": 1})
    return judge_node(1, "worker:0", counters, {}, 2)


def test_read_ahead_is_not_a_loss():
    # 32 rows in flight at each boundary, trained in the next epoch: nothing lost.
    rows = _node((320, 288, 32, False), (320, 320, 32, False), (320, 352, 0, True))
    assert [(r.difference, r.ok) for r in rows] == [(0, True)] * 3


def test_a_last_partial_batch_dropped_is_within_one_batch():
    rows = _node((330, 320, 10, True))
    assert rows[0].ok and rows[0].difference == -10


def test_data_auto_shard_is_named_in_the_epoch_that_lost_rows():
    rows = _node((320, 320, 0, False), (320, 160, 160, False), (320, 320, 160, True), policy="DATA")
    assert [r.difference for r in rows] == [0, -160, 0]
    assert rows[0].ok and rows[2].ok and "AutoShardPolicy.DATA" in rows[1].cause and "2 workers kept about 1/2" in rows[1].cause
    (row,) = _node((320, 160, 160, True), policy="AUTO")  # the user's own AUTO (or TFOS_FEED_AUTO_SHARD=auto)
    assert "AutoShardPolicy.AUTO, which falls back to DATA" in row.cause and row.policy == "AUTO"


@pytest.mark.parametrize("policy", ["OFF", ""])  # tfos's OFF, or no auto-shard (distribute_datasets_from_function)
def test_half_the_rows_lost_without_auto_shard_names_the_pipeline(policy):
    # A filter() keeping about half the rows, with auto-shard OFF: the ratio alone would say
    # "DATA auto-shard"; the policy the node distributed with says it was not.
    (row,) = _node((1024, 519, 505, True), policy=policy)
    assert not row.ok and "AutoShard" not in row.cause and "filter()" in row.cause, row.cause
    assert ("auto-shard was OFF: not the cause" in row.cause) is (policy == "OFF")


def test_rows_main_fun_never_read_are_counted_and_named():
    # ds.unbatch().take(300).batch(32): 320 rows handed to TensorFlow, 300 trained, 704 rows
    # received but never read, one partition not consumed to its end.
    (row,) = _node((320, 300, 20, True), unread={0: (704, 1)})
    assert (row.fed, row.trained, row.unread, row.at_least, row.difference) == (1024, 300, 704, True, -724)
    assert "main_fun stopped reading the feed" in row.cause and "take()" in row.cause
    assert fed_text(row) == "at least 1024 rows fed to the node (704 never read by main_fun)"
    # A later epoch only received, never handed out: judged on its own (nothing trained).
    rows = _node((320, 320, 0, True), unread={1: (320, 1)})
    assert [(r.epoch, r.fed, r.trained, r.difference) for r in rows] == [(0, 320, 320, 0), (1, 320, 0, -320)]
    assert rows[0].ok and "stopped reading the feed" in rows[1].cause


def test_partitions_skipped_after_main_fun_returned_make_the_last_epoch_at_least(caplog):
    # take(300): every row main_fun received was counted, but its later partitions were
    # refused (the driver's "not consumed to their end"): fed is a lower bound.
    counters = {"rows_trained": 300, "rows_fed/a/0": 320, "rows_trained/a/0": 300, "rows_gap/a/0": 20,
                "rows_batch/a/0": 32, "rows_closed/a/0": 1, "rows_final/a/0": 1, "rows_unread/a/0": 192,
                "rows_unended/a/0": 0, "rows_shard/a/0": POLICY_CODES["OFF"]}
    acct = RowAccounting(_State({1: counters}))
    (row,) = acct.table()
    assert not row.at_least and row.fed == 512
    acct.note_skipped(["worker:0 (executor 1, host h)"])
    with caplog.at_level("WARNING", logger="tfos._driver.row_accounting"):
        (row,) = acct.check()
    assert row.at_least and row.difference == -212 and "main_fun stopped reading the feed" in row.cause
    assert ("worker:0 (executor 1, host h), train() call 0, epoch 0: at least 512 rows fed to the node (192 never read "
            "by main_fun), 300 trained") in caplog.records[0].getMessage()


def test_an_untrained_epoch_is_never_within_tolerance():
    # from_generator + steps_per_epoch = rows // (B * workers): fed epoch 1 (32 rows on this
    # node, one batch) never trained. One batch of difference is otherwise allowed.
    rows = _node((32, 32, 0, False), (32, 0, 32, True))
    assert rows[0].ok and not rows[1].ok and rows[1].difference == -32 and "nothing trained" in rows[1].cause


def test_read_ahead_left_when_main_fun_returns_is_not_a_loss():
    # A TFoS-style fit(steps_per_epoch=...) that ends with a few batches read ahead (handed
    # to TensorFlow, not trained): up to READ_AHEAD_BATCHES batches; rows never read count.
    (row,) = _node((320, 256, 64, True))
    assert row.ok and row.difference == -64
    (row,) = _node((320, 256, 64, True), unread={0: (32, 1)})
    assert not row.ok and row.difference == -96 and "stopped reading the feed" in row.cause


def test_other_causes():
    (row,) = _node((640, 100, 540, True))
    assert row.difference == -540 and "take()" in row.cause and "auto-shard was OFF" in row.cause
    _, row = _node((320, 320, 0, False), (320, 640, -320, True))
    assert row.difference == 320 and "repeat()" in row.cause
    (row,) = _node((640, 0, 640, True))
    assert "nothing trained" in row.cause


def test_read_ahead_counts_up_to_a_limit():
    # Up to READ_AHEAD_BATCHES batches of gap are read-ahead; beyond, rows lost, placed in
    # the epoch where the gap grew (later gaps never shrink below rows lost).
    cap = READ_AHEAD_BATCHES * 16
    rows = _node((320, 320 - cap, cap, False), (320, 320 + cap, 0, True))
    assert [r.difference for r in rows] == [0, 0]
    rows = _node((320, 160, 160, False), (320, 160, 320, False), (320, 320, 320, True))  # DATA shard twice
    assert [r.difference for r in rows] == [-160, -160, 0]
    rows = _node((320, 300, 20, False), (320, 320, 20, False), (320, 150, 190, True))  # fit ended early
    assert [r.difference for r in rows] == [0, 0, -190] and "fit() ended before the feed did" in rows[2].cause
    # ... but up to READ_AHEAD_BATCHES batches handed out and untrained when main_fun returned are its read-ahead.
    rows = _node((320, 300, 20, False), (320, 320, 20, False), (320, 200, 140, True))
    assert [r.difference for r in rows] == [0, 0, -140] and rows[2].ok


def test_a_node_that_never_ran_keras_fit_is_not_judged():
    (row,) = _node((64, 0, 0, True), keras=False)
    assert row.trained is None and row.ok and row.closed


class _State:
    def __init__(self, counters):
        self.counters = counters
        self.roles = [type("R", (), {"job_name": "chief"})(), type("R", (), {"job_name": "worker"})()]

    def node_name(self, eid):
        return f"{'chief' if eid == 0 else 'worker'}:0 (executor {eid}, host h)"


def test_one_warning_per_node_and_epoch(caplog):
    good = {"rows_fed/a/0": 320, "rows_trained/a/0": 320, "rows_gap/a/0": 0, "rows_batch/a/0": 16, "rows_closed/a/0": 1,
            "rows_trained": 320}
    bad = {"rows_fed/a/0": 320, "rows_trained/a/0": 160, "rows_gap/a/0": 160, "rows_batch/a/0": 16, "rows_closed/a/0": 1,
           "rows_final/a/0": 1, "rows_fed/a/1": 320, "rows_batch/a/1": 16, "rows_trained": 160}
    acct = RowAccounting(_State({0: good, 1: bad}))
    with caplog.at_level("WARNING", logger="tfos._driver.row_accounting"):
        acct.check()
        acct.check()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    assert "worker:0 (executor 1, host h), train() call 0, epoch 0: 320 rows fed to TensorFlow, 160 trained" in lines[0]
    table = acct.table()
    assert [(r.executor_id, r.epoch, r.closed, r.ok) for r in table] == [(0, 0, True, True), (1, 0, True, False), (1, 1, False, True)]


def test_the_policy_noted_is_that_of_a_dataset_that_can_read_the_feed(monkeypatch):
    # A validation dataset in memory (AUTO, no Python) distributed between two fed epochs
    # must not stand for the fed dataset's policy; a generator's (the feed's way) does.
    tf = pytest.importorskip("tensorflow")
    monkeypatch.delenv(fed_shard.OPT_OUT, raising=False)
    noted = []
    monkeypatch.setattr("tfos._data.row_count.ROWS.distributed", noted.append)
    gen = tf.data.Dataset.from_generator(lambda: iter([[1.0]]), output_signature=tf.TensorSpec((1,), tf.float32))
    memory = tf.data.Dataset.from_tensor_slices([[1.0], [2.0]])
    policy = tf.data.experimental.AutoShardPolicy

    def with_policy(ds, p):
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = p
        return ds.with_options(options)

    fed_shard.note_policy(fed_shard.unsharded(gen), True)               # tfos set OFF
    fed_shard.note_policy(memory, False)                                # AUTO, in memory: not noted
    fed_shard.note_policy(with_policy(gen, policy.DATA))                # the program's DATA on a generator
    fed_shard.note_policy(with_policy(memory, policy.DATA))             # DATA on memory: not the feed
    fed_shard.note_policy(with_policy(memory, policy.OFF))              # OFF is always noted
    assert noted == [POLICY_CODES["OFF"], POLICY_CODES["DATA"], POLICY_CODES["OFF"]]


def test_a_dataset_from_function_forgets_an_earlier_policy(monkeypatch):
    # distribute_datasets_from_function never auto-shards: a DATA noted for an earlier fit
    # must not be named for the epochs it feeds.
    noted = []
    monkeypatch.setattr("tfos._data.row_count.ROWS.distributed", noted.append)

    class Strategy:
        def experimental_distribute_dataset(self, dataset, options=None):
            return dataset

        def distribute_datasets_from_function(self, dataset_fn, options=None):
            return dataset_fn(None)

    fed_shard.patch(type("module", (), {"CollectiveAllReduceStrategy": Strategy}))
    assert Strategy().distribute_datasets_from_function(lambda ctx: "ds") == "ds" and noted == [0]


def test_rows_of_earlier_epochs_taken_as_read_ahead_are_named_in_the_epoch_that_counts_them():
    # Batch 16: epoch 0 loses 96 rows (6 batches, within the 8-batch read-ahead allowance:
    # not yet a loss), epoch 1 loses 96 more and the node returns: epoch 1 carries all 192
    # rows lost, and its WARNING says 96 of them are epoch 0's (a user-style check found
    # '320 fed, 160 trained (-320 rows)' not adding up).
    from tfos._driver.row_accounting import earlier_text

    rows = _node((320, 224, 96, False), (320, 224, 192, True), policy="DATA")
    assert [(r.ok, r.difference) for r in rows] == [(True, 0), (False, -192)]
    assert earlier_text(rows[1]) == ", of which 96 rows of earlier epochs, taken as read-ahead when they ended"
    assert earlier_text(rows[0]) == ""
