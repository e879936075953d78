"""Unit tests of tfos._data.tfdata.FeedBatches (the DataFeed -> tf.data fast path) over a real
FeedHub whose feed connections are socketpairs (no Spark); the dataset test imports
TensorFlow."""

from __future__ import annotations


import logging
import re
import threading
import time

import numpy as np
import pyarrow as pa
import pytest

from tfos._data.framing import FrameType
from tfos._data.feed_connection import END_OF_FEED
from tfos._data.feed_hub import FeedHub
from tfos._data.tfdata import FeedBatches
from tfos.datafeed import DataFeed
from feed_fakes import Feeder as _Feeder
from tfos.errors import InferenceResultError, MalformedRowError, TFOSError

KEY = b"k" * 32
COLS = [(np.float32, (4,)), (np.int64, ())]


@pytest.fixture
def hub():
    h = FeedHub("127.0.0.1", KEY, ("input",), 64, "worker:0 (executor 1, host 127.0.0.1)")
    yield h
    h.close()


def Feeder(hub: FeedHub, partition: int, epoch: int = 0, kind: str = "pickled_batch") -> _Feeder:
    """A fake training feed task on ``hub`` with the test key (see feed_fakes.Feeder)."""
    return _Feeder(hub, KEY, partition, "train", epoch, kind)


def _rows(start: int, n: int) -> list:
    return [(np.full(4, i, np.float32), i) for i in range(start, start + n)]


def test_batches_span_chunks_and_partitions_exact_rows(hub):
    a, b = Feeder(hub, 0), Feeder(hub, 1)
    a.chunk(_rows(0, 3))
    a.chunk(_rows(3, 4))
    a.end()
    b.chunk(_rows(7, 6))
    b.end()
    hub.queues["input"].put_nowait(END_OF_FEED)
    feed = DataFeed(hub, timeout_s=10)
    reader = FeedBatches(feed, 5, COLS, track_sums=True)
    got = list(reader)
    assert [len(y) for _, y in got] == [5, 5, 3]
    x = np.concatenate([b[0] for b in got])
    y = np.concatenate([b[1] for b in got])
    assert x.dtype == np.float32 and x.shape == (13, 4) and y.dtype == np.int64
    assert y.tolist() == list(range(13)) and (x[:, 0] == y).all()
    assert a.frame() == (FrameType.ACK, {"rows": 7})
    assert b.frame() == (FrameType.ACK, {"rows": 6})
    assert hub.rows_taken == 13 and reader.rows == {0: 13}
    assert reader.sums[0] == [4.0 * sum(range(13)), float(sum(range(13)))]
    assert feed.should_stop() and reader.ended


def test_per_epoch_iterations_end_at_epoch_boundaries(hub):
    e0, e1, e2 = Feeder(hub, 0, 0), Feeder(hub, 0, 1), Feeder(hub, 0, 2)
    for f, start in ((e0, 0), (e1, 100), (e2, 200)):
        f.chunk(_rows(start, 7))
        f.end()
    hub.queues["input"].put_nowait(END_OF_FEED)
    reader = FeedBatches(DataFeed(hub, timeout_s=10), 4, COLS, per_epoch=True)
    epochs = [[y.tolist() for _, y in reader] for _ in range(4)]
    # Batches never mix epochs; the fourth iteration is empty (end of feed).
    assert epochs == [[[0, 1, 2, 3], [4, 5, 6]], [[100, 101, 102, 103], [104, 105, 106]],
                      [[200, 201, 202, 203], [204, 205, 206]], []]
    assert reader.rows == {0: 7, 1: 7, 2: 7}


def test_drop_remainder_and_single_column(hub):
    a = Feeder(hub, 0)
    a.chunk([1.5, 2.5, 3.5])
    a.end()
    hub.queues["input"].put_nowait(END_OF_FEED)
    reader = FeedBatches(DataFeed(hub, timeout_s=10), 2, [(np.float64, ())], single=True, drop_remainder=True)
    got = list(reader)
    assert len(got) == 1 and got[0].tolist() == [1.5, 2.5] and got[0].dtype == np.float64


def test_arrow_chunks_are_zero_copy_views(hub):
    a = Feeder(hub, 2, kind="arrow")
    n = 6
    values = np.arange(n * 4, dtype=np.float32)
    image = pa.ListArray.from_arrays(pa.array(np.arange(0, (n + 1) * 4, 4, dtype=np.int32)), pa.array(values))
    batch = pa.RecordBatch.from_arrays([image, pa.array(np.arange(n, dtype=np.int64))], ["image", "label"])
    a.arrow(batch.slice(1, 5))  # a sliced batch, as the Arrow feed task sends them
    a.end()
    hub.queues["input"].put_nowait(END_OF_FEED)
    reader = FeedBatches(DataFeed(hub, timeout_s=10), 5, COLS)
    (x, y), = list(reader)
    assert y.tolist() == [1, 2, 3, 4, 5]
    assert x.tolist() == values.reshape(n, 4)[1:].tolist()
    assert not x.flags.owndata and not y.flags.owndata  # views of the received chunk


def test_arrow_fallback_for_other_types(hub):
    a = Feeder(hub, 0, kind="arrow")
    batch = pa.RecordBatch.from_arrays([pa.array([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]]), pa.array([1, 2], pa.int32())], ["x", "y"])
    a.arrow(batch)
    a.end()
    hub.queues["input"].put_nowait(END_OF_FEED)
    (x, y), = list(FeedBatches(DataFeed(hub, timeout_s=10), 10, COLS))
    assert x.dtype == np.float32 and x.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert y.dtype == np.int64 and y.tolist() == [1, 2]


def test_malformed_row_names_partition_and_row(hub):
    a = Feeder(hub, 6, epoch=1)
    a.chunk(_rows(0, 3))
    a.chunk([(np.zeros(3, np.float32), 9)])
    a.end()
    hub.queues["input"].put_nowait(END_OF_FEED)
    reader = FeedBatches(DataFeed(hub, timeout_s=10), 2, COLS)
    it = iter(reader)
    assert next(it)[1].tolist() == [0, 1]
    with pytest.raises(MalformedRowError, match=r"partition 6 \(epoch 1\), row 3: column 0: expected shape \(4,\), got \(3,\)"):
        list(it)


def test_inference_rows_reaching_the_tf_data_reader_name_the_node_and_partition(hub):
    """cluster.inference() on a cluster whose main_fun trains with as_dataset(): the reader
    returns no results, so it must not take the rows as training data (the inference
    feed task would get no result for them)."""
    a = _Feeder(hub, KEY, 4, "inference")
    a.chunk(_rows(0, 3))
    a.end()
    reader = FeedBatches(DataFeed(hub, timeout_s=10), 2, COLS)
    with pytest.raises(InferenceResultError) as ei:
        list(reader)
    assert str(ei.value) == (
        "node worker:0 (executor 1, host 127.0.0.1): partition 4 was fed by cluster.inference(), but main_fun "
        "reads queue 'input' with as_dataset(), which trains and returns no results; read inference rows with "
        "next_batch() and answer every batch with batch_results()"
    )
    assert hub.rows_taken == 0 and reader.rows == {}


def test_one_reader_per_feed_and_train_mode_only(hub):
    feed = DataFeed(hub, timeout_s=10)
    hub.queues["input"].put_nowait(END_OF_FEED)
    assert list(FeedBatches(feed, 2, COLS)) == []
    with pytest.raises(TFOSError, match="already read by another"):
        list(FeedBatches(feed, 2, COLS))
    with pytest.raises(ValueError, match="train"):
        FeedBatches(DataFeed(hub, train_mode=False), 2, COLS)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        FeedBatches(feed, 0, COLS)


def test_as_dataset_whole_batches_and_per_epoch(hub):
    tf = pytest.importorskip("tensorflow")
    e0, e1 = Feeder(hub, 0, 0), Feeder(hub, 1, 1)
    e0.chunk(_rows(0, 10))
    e0.end()
    e1.chunk(_rows(10, 10))
    e1.end()
    hub.queues["input"].put_nowait(END_OF_FEED)
    sig = (tf.TensorSpec((None, 4), tf.float32), tf.TensorSpec((None,), tf.int64))
    ds = DataFeed(hub, timeout_s=10).as_dataset(8, sig, per_epoch=True)
    first = [y.numpy().tolist() for _, y in ds]
    second = [y.numpy().tolist() for _, y in ds]
    assert first == [list(range(8)), [8, 9]]
    assert second == [list(range(10, 18)), [18, 19]]
    assert list(ds) == []
    assert ds.tfos_batches.rows == {0: 10, 1: 10}


def test_steps_per_epoch_exact_batches_per_epoch_spreads_surplus_and_pads(hub):
    # Epoch 0: 11 rows (surplus over 3 x 3), epoch 1: no rows on this node, epoch 2: 4 rows
    # (short), then the end of the feed.
    e0a, e0b, e2 = Feeder(hub, 0, 0), Feeder(hub, 1, 0), Feeder(hub, 0, 2)
    e0a.chunk(_rows(0, 6))
    e0a.end()
    e0b.chunk(_rows(6, 5))
    e0b.end()
    e2.chunk(_rows(200, 4))
    e2.end()
    hub.queues["input"].put_nowait(END_OF_FEED)
    reader = FeedBatches(DataFeed(hub, timeout_s=10), 3, COLS, steps_per_epoch=3, buffer_batches=2, track_sums=True)
    assert reader.hold_batches == 1
    got = [(x.shape, y.tolist()) for x, y in reader]
    assert [y for _, y in got] == [
        [0, 1, 2], [3, 4, 5], [6, 7, 8, 9, 10],  # the held rows of epoch 0 in its last batch
        [], [], [],  # epoch 1: this node got no partition
        [200, 201, 202], [203], [],  # epoch 2: 4 rows over 3 batches
    ]
    assert all(s[1:] == (4,) for s, _ in got)
    assert reader.rows == {0: 11, 1: 0, 2: 4} and reader.ended
    assert reader.sums[0][1] == float(sum(range(11))) and reader.sums[2][1] == float(sum(range(200, 204)))
    assert e0a.frame() == (FrameType.ACK, {"rows": 6}) and e2.frame() == (FrameType.ACK, {"rows": 4})


def test_steps_per_epoch_spreads_held_rows_evenly(hub):
    f0, f1 = Feeder(hub, 0, 0), Feeder(hub, 0, 1)
    f0.chunk(_rows(0, 23))  # 2 batches of 4 cut at once, the other 15 rows spread over the 2 held
    f0.end()
    f1.chunk(_rows(100, 16))
    f1.end()
    hub.queues["input"].put_nowait(END_OF_FEED)
    reader = FeedBatches(DataFeed(hub, timeout_s=10), 4, COLS, steps_per_epoch=4, buffer_batches=4)
    assert reader.hold_batches == 2
    sizes = [len(y) for _, y in reader]
    assert sizes == [4, 4, 8, 7, 4, 4, 4, 4]
    assert reader.rows == {0: 23, 1: 16}


def test_steps_per_epoch_counts_from_the_resumed_feeds_first_epoch(hub):
    # A restarted train() fed epochs 2 and 3 of 4 (first_epoch=2): S batches for each of
    # them only, no empty batches for epochs 0 and 1 (a fit resumed after 2 epochs runs 2 x S
    # steps). This node's first chunk is of epoch 3: epoch 2 is S empty batches.
    f3 = _Feeder(hub, KEY, 0, "train", 3, first_epoch=2)
    f3.chunk(_rows(300, 8))
    f3.end()
    hub.queues["input"].put_nowait(END_OF_FEED)
    reader = FeedBatches(DataFeed(hub, timeout_s=10), 4, COLS, steps_per_epoch=2, buffer_batches=2)
    got = [y.tolist() for _, y in reader]
    assert got == [[], [], [300, 301, 302, 303], [304, 305, 306, 307]]
    assert reader.rows == {2: 0, 3: 8}


def test_steps_per_epoch_pads_the_last_epochs_a_node_got_no_row_of(hub):
    """train(data, 3) where this node got rows of epoch 0 only (the other node took every
    partition of epochs 1 and 2): the feed header says the job's last epoch is 2, so the
    dataset still holds S batches for each of the 3 epochs (S empty ones for epochs 1 and
    2); before, it ended after epoch 0, 2 of 6 batches, while the other node had 6."""
    f = _Feeder(hub, KEY, 0, "train", 0, last_epoch=2)
    f.chunk(_rows(0, 5))
    f.end()
    hub.queues["input"].put_nowait(END_OF_FEED)
    reader = FeedBatches(DataFeed(hub, timeout_s=10), 4, COLS, steps_per_epoch=2, buffer_batches=2)
    got = [y.tolist() for _, y in reader]
    assert got == [[0, 1, 2, 3], [4], [], [], [], []]
    assert reader.rows == {0: 5, 1: 0, 2: 0}


def test_feed_header_last_epoch_checked(hub):
    with pytest.raises(ValueError, match="bad feed header: last_epoch 1 for epoch 2"):
        _Feeder(hub, KEY, 0, "train", 2, last_epoch=1)


def test_feed_header_first_epoch_checked(hub):
    with pytest.raises(ValueError, match="first_epoch"):
        _Feeder(hub, KEY, 0, "train", 1, first_epoch=2)


def test_steps_per_epoch_argument_checks(hub):
    feed = DataFeed(hub, timeout_s=10)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="steps_per_epoch"):
            FeedBatches(feed, 4, COLS, steps_per_epoch=bad)
    with pytest.raises(ValueError, match="excludes per_epoch"):
        FeedBatches(feed, 4, COLS, steps_per_epoch=2, per_epoch=True)
    assert DataFeed.steps_per_epoch(30000, 128, 2) == 118
    assert DataFeed.steps_per_epoch(256, 128, 2) == 1
    with pytest.raises(ValueError):
        DataFeed.steps_per_epoch(0, 128, 2)


def _shuffled_feed(hub, epochs: int, parts: int, rows_per_part: int, chunk: int) -> None:
    """Feeds ``epochs`` epochs of ``parts`` partitions (labels ``1000 x epoch + 100 x part + i``)."""
    for e in range(epochs):
        for p in range(parts):
            f = Feeder(hub, p, e)
            base = 1000 * e + 100 * p
            for start in range(0, rows_per_part, chunk):
                f.chunk(_rows(base + start, min(chunk, rows_per_part - start)))
            f.end()
    hub.queues["input"].put_nowait(END_OF_FEED)


def test_shuffle_rows_every_row_once_per_epoch_mixed_across_partitions(hub):
    # 3 epochs of 4 partitions x 30 rows (120 rows) in chunks of 10, batches of 8, S = 16
    # (128 > 120: the last batches of each epoch share the rest), window 40 rows.
    _shuffled_feed(hub, 3, 4, 30, 10)
    reader = FeedBatches(DataFeed(hub, timeout_s=10), 8, COLS, steps_per_epoch=16, buffer_batches=8,
                         track_sums=True, shuffle_rows=40, shuffle_seed=7)
    assert reader.buffer_bytes == 24 * (8 * (8 + 2 + 4) + 40)  # 24 bytes a row
    got = [(x, y) for x, y in reader]
    assert len(got) == 3 * 16 and reader.ended
    for e in range(3):
        batches = got[16 * e : 16 * (e + 1)]
        labels = np.concatenate([y for _, y in batches])
        # every row of the epoch exactly once, no row of another epoch (batches never mix epochs)
        assert sorted(labels.tolist()) == [1000 * e + 100 * p + i for p in range(4) for i in range(30)]
        assert all((x[:, 0] == y).all() and x.shape[1:] == (4,) for x, y in batches)
        assert labels.tolist() != sorted(labels.tolist())  # the order is mixed
        # rows of different partitions meet in one batch (the fed order has none before row 24)
        assert any(len({int(v) // 100 % 10 for v in y}) > 1 for _, y in batches[:3])
        assert reader.rows[e] == 120
        assert reader.sums[e][1] == float(labels.sum())
    # Whole batches while the pool keeps 40 rows after the draw (10), then the epoch's last 40
    # rows spread over its 6 remaining batches.
    assert [len(y) for _, y in got[:16]] == [8] * 10 + [7, 7, 7, 7, 6, 6]


def test_shuffle_rows_is_seeded_and_keeps_steps_with_uneven_epochs(hub):
    def run(seed):
        h = FeedHub("127.0.0.1", KEY, ("input",), 64, "worker:0 (executor 1, host 127.0.0.1)")
        try:
            for e, parts in ((0, 5), (1, 1)):  # epoch 0: 5 x 30 rows (surplus), epoch 1: 30 rows (short)
                for p in range(parts):
                    f = Feeder(h, p, e)
                    f.chunk(_rows(1000 * e + 100 * p, 30))
                    f.end()
            h.queues["input"].put_nowait(END_OF_FEED)
            reader = FeedBatches(DataFeed(h, timeout_s=10), 8, COLS, steps_per_epoch=10, buffer_batches=4,
                                 shuffle_rows=16, shuffle_seed=seed)
            return [y.tolist() for _, y in reader], reader.rows
        finally:
            h.close()

    a, rows = run(3)
    b, _ = run(3)
    c, _ = run(4)
    assert a == b and a != c
    assert len(a) == 20 and rows == {0: 150, 1: 30}
    assert sorted(sum(a[:10], [])) == [100 * p + i for p in range(5) for i in range(30)]
    assert sorted(sum(a[10:], [])) == list(range(1000, 1030))
    assert sum(len(y) for y in a[10:]) == 30


def test_shuffle_rows_argument_checks(hub):
    feed = DataFeed(hub, timeout_s=10)
    with pytest.raises(ValueError, match="shuffle_rows needs steps_per_epoch"):
        FeedBatches(feed, 4, COLS, shuffle_rows=10)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="shuffle_rows must be"):
            FeedBatches(feed, 4, COLS, steps_per_epoch=2, shuffle_rows=bad)


def test_shuffle_rows_needs_one_row_shape_per_column(hub):
    f = Feeder(hub, 3, 0)
    f.chunk([(np.zeros(4, np.float32), 1)] * 2)
    f.chunk([(np.zeros(3, np.float32), 2)] * 2)  # fine without shuffling (a batch's own shape)
    f.end()
    hub.queues["input"].put_nowait(END_OF_FEED)
    reader = FeedBatches(DataFeed(hub, timeout_s=10), 2, [(np.float32, None), (np.int64, ())], steps_per_epoch=2,
                         shuffle_rows=1)
    with pytest.raises(MalformedRowError, match=r"partition 3 \(epoch 0\): column 0: rows of shape \(3,\) cannot be "
                                                r"shuffled with rows of shape \(4,\)"):
        list(reader)


@pytest.mark.parametrize("steps", [None, 2])
def test_abort_reaches_the_tf_data_reader_as_feed_aborted(hub, steps):
    """as_dataset's reader (both modes) after the driver's abort: batches handed out before
    stay handed out, then iterating raises FeedAbortedError within its 1 s poll (never the
    end of the feed), and a partition whose end comes after the abort is not acknowledged."""
    import threading
    import time

    from tfos.errors import FeedAbortedError

    a, b = Feeder(hub, 0), Feeder(hub, 1)
    a.chunk(_rows(0, 4))
    a.end()
    b.chunk(_rows(4, 4))
    feed = DataFeed(hub, timeout_s=30)
    reader = FeedBatches(feed, 4, COLS, steps_per_epoch=steps)
    got: list = []
    threading.Timer(0.5, hub.abort, args=("node worker:1 failed",)).start()
    t0 = time.monotonic()
    with pytest.raises(FeedAbortedError, match=r"the cluster aborted \(node worker:1 failed\)"):
        for _, y in reader:
            got.extend(y.tolist())
    assert time.monotonic() - t0 < 5.0
    # without steps every whole batch went out; with steps the rows are held for the epoch's end
    assert got == ([0, 1, 2, 3, 4, 5, 6, 7] if steps is None else [])
    assert a.frame() == (FrameType.ACK, {"rows": 4})  # ended before the abort
    b.end()
    assert b.no_frame_yet()
    assert not feed.should_stop()  # never an end of feed


def test_malformed_row_inside_tf_data_is_reported_as_itself(hub):
    """tf.data re-raises the reader's MalformedRowError as a TensorFlow InvalidArgumentError
    (TF's function names and blank lines around the text): the node's failure report gives
    the tfos error's type and message, as a user checking error_type expects; the
    traceback keeps TensorFlow's wrapper."""
    tf = pytest.importorskip("tensorflow")

    from tfos._data.tfdata import unwrap_tf_data_error
    from tfos._node.launch import NodeLaunch
    from tfos._node.node_failure import node_failure as _failure

    a = Feeder(hub, 6, epoch=1)
    a.chunk(_rows(0, 3))
    a.chunk([(np.zeros(3, np.float32), 9)])
    a.end()
    hub.queues["input"].put_nowait(END_OF_FEED)
    sig = (tf.TensorSpec((None, 4), tf.float32), tf.TensorSpec((None,), tf.int64))
    ds = DataFeed(hub, timeout_s=10).as_dataset(2, sig)
    with pytest.raises(tf.errors.OpError) as ei:
        for _ in ds:
            pass
    wrapped = ei.value
    assert type(wrapped).__name__ == "InvalidArgumentError"
    orig = unwrap_tf_data_error(wrapped)
    assert isinstance(orig, MalformedRowError)
    assert "partition 6 (epoch 1), row 3: column 0: expected shape (4,), got (3,)" in str(orig)
    assert unwrap_tf_data_error(RuntimeError(str(wrapped))) is None  # not a TF error
    assert unwrap_tf_data_error(tf.errors.InvalidArgumentError(None, None, "another error")) is None

    class _Role:
        executor_id, job_name, task_index = 1, "worker", 0

    class _Launch:
        role, host = _Role, "127.0.0.1"

    rep = _failure(_Launch, wrapped)
    assert rep.error_type == "MalformedRowError"
    assert rep.message == str(orig)
    assert "InvalidArgumentError" in rep.traceback and (rep.executor_id, rep.job_name, rep.host) == (1, "worker", "127.0.0.1")
    other = _failure(_Launch, ValueError("boom"))
    assert (other.error_type, other.message) == ("ValueError", "boom")


def test_failure_report_survives_an_exception_whose_str_raises():
    """An exception with a broken __str__ keeps its type and traceback (it used to kill the
    TF process before the report was sent: "ProcessDied ... exit code 1")."""
    from tfos._node.node_failure import node_failure as _failure

    class Weird(Exception):
        def __str__(self):
            raise RuntimeError("str() of this exception fails")

        def __repr__(self):
            raise RuntimeError("repr() fails too")

    class _Role:
        executor_id, job_name, task_index = 1, "worker", 0

    class _Launch:
        role, host = _Role, "127.0.0.1"

    def main_fun():
        raise Weird()

    try:
        main_fun()
    except Weird as exc:
        rep = _failure(_Launch, exc)
    assert rep.error_type == "Weird"
    assert rep.message == "<exception str() failed> (its Weird.__str__ raised)"
    assert "in main_fun" in rep.traceback and "raise Weird()" in rep.traceback


class _Driver:
    """The driver's answers to ``epoch_handover`` for one feed (see tfos._control.ledger)."""

    def __init__(self, hub: FeedHub, settled_after: int, mine: list, never: bool = False):
        self.hub, self.settled_after, self.mine, self.never = hub, settled_after, mine, never
        self.asked: list = []

    def __call__(self, msg) -> dict:
        fields = msg.fields()
        assert msg.TYPE == "epoch_handover" and fields["node"] == self.hub.node_name
        self.asked.append((fields["lo"], fields["hi"]))
        whole = fields["hi"] - fields["lo"]
        settled = 0 if self.never else whole if len(self.asked) > self.settled_after else whole - 1
        return {"settled": settled, "mine": self.mine}


def _epoch_feeder(hub, part, epoch, parts=2, **kw):
    return _Feeder(hub, KEY, part, "train", epoch, feed_id="feed-1", index=epoch * parts + part, parts_per_epoch=parts, **kw)


@pytest.mark.parametrize("steps", [None, 2])
def test_later_epoch_waits_until_the_driver_says_the_epoch_was_handed_over(hub, steps):
    """Spark ran partition 0 of epoch 1 before partition 1 of epoch 0 reached this node (a
    locality wait, or a slower feed task): the epoch-aware readers hold epoch 1 back until
    the driver says every partition of epoch 0 went to a node and this node read its own
    to the end, so each epoch holds exactly its rows. The held partition is acknowledged
    as soon as its end arrives (its feed task must not wait: see EpochOrder)."""
    late, early = _epoch_feeder(hub, 0, 1), _epoch_feeder(hub, 1, 0)
    late.chunk(_rows(100, 4))  # epoch 1 arrives first
    late.end()
    driver = _Driver(hub, settled_after=2, mine=[1])  # partition 1 of epoch 0 is claimed late
    hub.ask_driver = driver
    feed = DataFeed(hub, timeout_s=10)
    reader = FeedBatches(feed, 2, COLS, per_epoch=steps is None, steps_per_epoch=steps)
    reader.start()
    deadline = time.monotonic() + 10
    while len(driver.asked) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert late.frame() == (FrameType.ACK, {"rows": 0})  # held, acknowledged, not yet decoded
    early.chunk(_rows(0, 3))
    early.end()
    # The end of the feed (which would end any hold) comes only once epoch 1 was handed
    # out: the driver's answer ended the hold.
    if steps is None:
        epochs = [[y.tolist() for _, y in reader]]
        it = iter(reader)
        epochs.append([next(it)[1].tolist()])
        hub.queues["input"].put_nowait(END_OF_FEED)
        epochs[1] += [y.tolist() for _, y in it]
        epochs.append([y.tolist() for _, y in reader])
        assert epochs == [[[0, 1], [2]], [[100, 101], [102, 103]], []]
    else:
        it = iter(reader)
        got = [next(it)[1].tolist() for _ in range(2)]  # cut once the epoch-1 chunk came
        hub.queues["input"].put_nowait(END_OF_FEED)
        assert got + [y.tolist() for _, y in it] == [[0, 1], [2], [100, 101], [102, 103]]
    assert reader.rows == {0: 3, 1: 4}
    assert driver.asked[0] == (0, 2) and len(driver.asked) >= 3
    assert reader.order.waits == 1 and reader.order.boundaries == 1 and reader.order.peak_held_bytes > 0
    assert early.frame() == (FrameType.ACK, {"rows": 3})


def test_epoch_order_gives_up_when_the_held_chunks_exceed_their_bound(hub, caplog):
    """Held later-epoch chunks are bounded (max_held_bytes): past it the reader stops
    waiting, says so, and hands them out (the earlier epoch's late rows would then count
    in the later one)."""
    late = _epoch_feeder(hub, 0, 1)
    for k in range(3):
        late.chunk(_rows(100 + 10 * k, 10))
    late.end()
    hub.ask_driver = _Driver(hub, 0, [], never=True)
    feed = DataFeed(hub, timeout_s=10)
    from tfos._data.epoch_order import EpochOrder

    order = EpochOrder(feed, max_held_bytes=1)
    with caplog.at_level(logging.WARNING, logger="tfos._data.epoch_order"):
        t0 = time.monotonic()
        first = order.next()
    assert time.monotonic() - t0 < 2
    assert first.conn is late.conn and order.waits == 1
    assert "bytes of later epochs held (max_held_bytes 1)" in caplog.text, caplog.text


def test_epoch_order_gives_up_after_half_the_feed_timeout_with_a_warning(hub, caplog):
    """A driver that never reports the epoch complete delays the later epoch by half the
    feed timeout at most (the paused feed tasks must not time out), then a warning says
    which epoch may mix."""
    late = _epoch_feeder(hub, 0, 1, feed_timeout=1.0)
    late.chunk(_rows(100, 2))
    late.end()
    hub.ask_driver = _Driver(hub, 0, [], never=True)
    reader = FeedBatches(DataFeed(hub, timeout_s=10), 2, COLS, steps_per_epoch=1)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="tfos._data.epoch_order"):
        it = iter(reader)
        first = next(it)  # epoch 0: one empty batch, once the wait gave up
        waited = time.monotonic() - t0
        hub.queues["input"].put(END_OF_FEED)
        rest = list(it)
    assert [first[1].tolist()] + [y.tolist() for _, y in rest] == [[], [100, 101]]
    assert 0.5 <= waited < 5, waited
    assert re.search(r"node worker:0 \(executor 1, host 127\.0\.0\.1\): epoch 0 of the feed is still incomplete after "
                     r"0\.[5-9] s \(2 of its partitions not yet handed to any node\); handing out epoch 1 now, so rows of "
                     r"epoch 0 that arrive later count in epoch 1", caplog.text), caplog.text


def test_epoch_order_with_two_later_epochs_queued_in_reverse(hub):
    """The queue holds epoch 2's first chunk, then epoch 1's partition: epoch 1 goes out
    first (the hold narrows to the earliest later epoch), then epoch 2 once the driver
    says epoch 1 is complete and this node read its own partition of it."""
    e2, e1 = _epoch_feeder(hub, 0, 2), _epoch_feeder(hub, 0, 1)
    asked = []

    def driver(msg):
        f = msg.fields()
        asked.append((f["lo"], f["hi"]))
        # Nothing is settled until the reader has taken all four items off the queue, so
        # both ends arrive while held whatever the load (under load 12 the reader was
        # once slower than the 50 ms between its first two questions).
        settled = f["hi"] - f["lo"] if hub.queues["input"].empty() else 0
        return {"settled": settled, "mine": [i for i in (2, 4) if f["lo"] <= i < f["hi"]]}

    hub.ask_driver = driver
    e2.chunk(_rows(200, 2))
    e1.chunk(_rows(100, 3))
    e1.end()
    e2.end()
    reader = FeedBatches(DataFeed(hub, timeout_s=10), 4, COLS, steps_per_epoch=1)
    it = iter(reader)
    got = [next(it)[1].tolist() for _ in range(2)]  # epochs 0 and 1: cut once epoch 2 went out
    hub.queues["input"].put_nowait(END_OF_FEED)
    got += [y.tolist() for _, y in it]
    assert got == [[], [100, 101, 102], [200, 201]]
    assert reader.rows == {0: 0, 1: 3, 2: 2}
    assert asked[0] == (0, 4) and (0, 2) in asked and asked[-1] == (2, 4), asked
    # both partitions were acknowledged while held (before their rows were decoded)
    assert e1.frame() == (FrameType.ACK, {"rows": 0}) and e2.frame() == (FrameType.ACK, {"rows": 0})


def _call_feeder(hub, feed_id, part, epoch, parts=2):
    """A feed task of one train() call (``feed_id``) with ``parts`` partitions per epoch."""
    return _Feeder(hub, KEY, part, "train", epoch, feed_id=feed_id, index=epoch * parts + part, parts_per_epoch=parts)


@pytest.mark.parametrize("steps", [None, 2])
def test_epochs_continue_across_train_calls(hub, steps):
    """train(data, 2) then train(data, 1): the second call's epoch 0 is the dataset's epoch
    2 (each call numbers its epochs from 0), not rows added to epoch 0 or 1; per_epoch ends
    an iteration there, steps_per_epoch cuts it into its own S batches."""
    hub.ask_driver = lambda msg: {"settled": msg.hi - msg.lo, "mine": list(range(msg.lo, msg.hi))}
    calls = [("call-1", 0, 100), ("call-1", 1, 200), ("call-2", 0, 300)]
    for feed_id, epoch, start in calls:
        for part in range(2):
            f = _call_feeder(hub, feed_id, part, epoch)
            f.chunk(_rows(start + 2 * part, 2))
            f.end()
    hub.queues["input"].put_nowait(END_OF_FEED)
    reader = FeedBatches(DataFeed(hub, timeout_s=10), 2, COLS, per_epoch=steps is None, steps_per_epoch=steps)
    if steps is None:
        epochs = [[y.tolist() for _, y in reader] for _ in range(4)]
        assert epochs == [[[100, 101], [102, 103]], [[200, 201], [202, 203]], [[300, 301], [302, 303]], []]
    else:
        assert [y.tolist() for _, y in reader] == [[100, 101], [102, 103], [200, 201], [202, 203], [300, 301], [302, 303]]
    assert reader.rows == {0: 4, 1: 4, 2: 4}


def test_a_new_train_calls_rows_wait_behind_the_held_rows_of_the_previous_call(hub):
    """The first chunk of the next train() call arrives while rows of the previous call's
    last epoch are still held (its hold ends at the driver's next answer): they wait too,
    so the previous call's epochs stay whole and the new call's rows form the next epoch."""
    answers = {"n": 0}

    def driver(msg):
        answers["n"] += 1
        whole = msg.hi - msg.lo
        return {"settled": whole if answers["n"] > 2 else whole - 1, "mine": [1]}

    hub.ask_driver = driver
    late = _call_feeder(hub, "call-1", 0, 1)  # epoch 1 of call 1 comes first: held
    late.chunk(_rows(200, 2))
    late.end()
    nxt = _call_feeder(hub, "call-2", 0, 0)  # then the next call's first partition
    nxt.chunk(_rows(300, 2))
    nxt.end()
    early = _call_feeder(hub, "call-1", 1, 0)  # then call 1's late epoch-0 partition
    early.chunk(_rows(100, 2))
    early.end()
    hub.queues["input"].put_nowait(END_OF_FEED)
    reader = FeedBatches(DataFeed(hub, timeout_s=10), 2, COLS, steps_per_epoch=1)
    assert [y.tolist() for _, y in reader] == [[100, 101], [200, 201], [300, 301]]
    assert reader.rows == {0: 2, 1: 2, 2: 2}


def test_a_per_row_signature_is_refused_with_what_to_write(hub):
    """as_dataset yields batches: a per-row spec (TFoS's from_generator style) gets an error
    that says to add the batch dimension (new-user trial: TensorFlow's "yielded an element
    of shape (8,) where an element of shape () was expected", several times per node)."""
    import tensorflow as tf

    feed = DataFeed(hub, timeout_s=10)
    with pytest.raises(ValueError, match=r"output_signature column 1 is TensorSpec\(shape=\(\), dtype=tf.int64, name=None\), "
                                         r"a shape without the batch dimension: .*every spec starts with None"):
        feed.as_dataset(8, (tf.TensorSpec((None, 4), tf.float32), tf.TensorSpec((), tf.int64)))
    with pytest.raises(ValueError, match=r"column 0 is .*: its first dimension is the batch \(8 rows, or fewer at an epoch's end\), not 784"):
        feed.as_dataset(8, tf.TensorSpec((784,), tf.float32))
    ds = feed.as_dataset(8, (tf.TensorSpec((8, 4), tf.float32), tf.TensorSpec((None,), tf.int64)))  # fixed = batch_size
    assert ds.element_spec[1].shape.as_list() == [None]


@pytest.mark.parametrize("cols, want_batches, want_bytes", [
    ([(np.float32, (784,)), (np.int64, ())], 32 * 2**20 // (64 * (784 * 4 + 8)), 64 * (784 * 4 + 8) * (32 * 2**20 // (64 * (784 * 4 + 8)) + 2)),
    ([(object, ()), (np.int64, ())], 8, 0),       # strings: any size, only the data tells
    ([(np.float32, None)], 8, 0),                 # shape from the data
])
def test_default_buffer_is_about_32_mb_or_8_batches_when_row_size_is_unknown(hub, cols, want_batches, want_bytes):
    # A string column counted as 8 bytes a row (its object references): 256 batches were
    # buffered, 312 MB of 4 MB strings at batch size 1 (found by the break helper).
    reader = FeedBatches(DataFeed(hub, timeout_s=10), 64, cols)
    assert (reader.buffer_batches, reader.buffer_bytes) == (want_batches, want_bytes)


def test_ready_batches_of_strings_are_bounded_by_their_bytes(hub):
    """With a string column the default buffer holds at most about 32 MB of ready batches,
    the strings counted by their size: 8 batches of one 6 MiB string each (48 MiB) were
    held before, when only the count bounded it (stop 37 left this). The reader stops at
    5 (30 MiB); every row still arrives, in order."""
    big = "x" * (6 << 20)  # one object: pickle memoizes it, so the test holds it once
    a = Feeder(hub, 0)
    a.chunk([(big, i) for i in range(12)])
    a.end()
    hub.queues["input"].put_nowait(END_OF_FEED)
    reader = FeedBatches(DataFeed(hub, timeout_s=10), 1, [(object, ()), (np.int64, ())])
    assert reader.buffer_batches == 8
    reader.start()
    deadline, last, steady_since = time.monotonic() + 30, -1, time.monotonic()
    while time.monotonic() < deadline:
        n = reader._out.qsize()
        if n != last:
            last, steady_since = n, time.monotonic()
        elif time.monotonic() - steady_since > 1.0:
            break
        time.sleep(0.05)
    assert last == 5 and reader._held <= 32 << 20, (last, reader._held)
    got = [(len(s[0]), int(y[0])) for s, y in reader]
    assert got == [(6 << 20, i) for i in range(12)]
    assert reader._held == 0 and reader.rows == {0: 12}


@pytest.mark.parametrize("steps", [0, 2])
def test_next_train_call_starts_after_the_planned_last_epoch_a_node_got_no_row_of(hub, steps):
    """train(a, 2) then train(b, 1) where this node got rows of a's epoch 0 only (Spark ran
    every partition of epoch 1 on the other executor, as it did under load): b's rows are
    dataset epoch 2 on this node as on the other, not epoch 1 (they were counted in epoch 1
    because the next call's first epoch followed the last epoch this node had read)."""
    a = _Feeder(hub, KEY, 0, "train", 0, feed_id="a", last_epoch=1)
    a.chunk(_rows(0, 5))
    a.end()
    b = _Feeder(hub, KEY, 0, "train", 0, feed_id="b", last_epoch=0)
    b.chunk(_rows(100, 3))
    b.end()
    hub.queues["input"].put_nowait(END_OF_FEED)
    if steps:
        reader = FeedBatches(DataFeed(hub, timeout_s=10), 4, COLS, steps_per_epoch=steps, buffer_batches=2)
        got = [y.tolist() for _, y in reader]
        assert got == [[0, 1, 2, 3], [4], [], [], [100, 101], [102]]
        assert reader.rows == {0: 5, 1: 0, 2: 3}
    else:
        reader = FeedBatches(DataFeed(hub, timeout_s=10), 4, COLS, per_epoch=True)
        while not reader.ended:
            for _ in reader:
                pass
        assert reader.rows == {0: 5, 2: 3}
