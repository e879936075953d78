"""Unit tests of tfos.datafeed: rows_to_columns (C19) and DataFeed over a real FeedHub
whose feed connections are socketpairs (no Spark, no TensorFlow)."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from tfos._data.framing import FrameType
from tfos._data.feed_connection import END_OF_FEED
from tfos._data.feed_hub import FeedHub
from tfos.datafeed import DataFeed, rows_to_columns
from feed_fakes import Feeder as _Feeder
from tfos.errors import DeadlineExceededError, InferenceResultError, MalformedRowError, TFOSError

KEY = b"k" * 32
COLS = [(np.float32, (784,)), (np.int64, ())]


def _good_rows(n: int, start: int = 0) -> list:
    return [([float(i)] * 784, i) for i in range(start, start + n)]


# ------------------------------------------------------------------ rows_to_columns
def test_rows_to_columns_good_batch():
    x, y = rows_to_columns(_good_rows(5), COLS)
    assert x.dtype == np.float32 and x.shape == (5, 784)
    assert y.dtype == np.int64 and y.shape == (5,)
    assert y.tolist() == [0, 1, 2, 3, 4]
    assert float(x[3].sum()) == 3.0 * 784


def test_rows_to_columns_any_shape_and_scalars():
    (a, b) = rows_to_columns([(np.arange(3), "x"), (np.arange(3) + 1, "y")], [(np.int32, None), (np.str_, ())])
    assert a.shape == (2, 3) and a.dtype == np.int32
    assert b.tolist() == ["x", "y"]


def test_rows_to_columns_empty_batch():
    x, y = rows_to_columns([], COLS)
    assert x.shape == (0, 784) and x.dtype == np.float32
    assert y.shape == (0,) and y.dtype == np.int64


# origins: rows 0..4 of the batch come from partition 2 starting at its row 10,
# rows 5.. come from partition 3 (epoch 1) starting at its row 40.
ORIGINS = [(0, 2, 0, 10), (5, 3, 1, 40)]


def test_c19_short_row_names_partition_and_row():
    rows = _good_rows(9)
    rows[7] = ([0.5] * 783, 7)
    with pytest.raises(MalformedRowError) as ei:
        rows_to_columns(rows, COLS, ORIGINS)
    msg = str(ei.value)
    assert "partition 3" in msg
    assert "(epoch 1)" in msg
    assert "row 42" in msg
    assert "column 0: expected shape (784,), got (783,)" in msg
    assert isinstance(ei.value, ValueError)


def test_c19_all_rows_short_names_first_row():
    rows = [([0.5] * 783, i) for i in range(6)]
    with pytest.raises(MalformedRowError, match=r"partition 2 \(epoch 0\), row 10: column 0: expected shape \(784,\), got \(783,\)"):
        rows_to_columns(rows, COLS, ORIGINS)


def test_c19_none_row():
    rows = _good_rows(9)
    rows[3] = None
    with pytest.raises(MalformedRowError) as ei:
        rows_to_columns(rows, COLS, ORIGINS)
    msg = str(ei.value)
    assert "partition 2" in msg and "row 13" in msg
    assert "the row is None" in msg


@pytest.mark.parametrize(
    "bad, text",
    [
        (([1.0] * 784,), "expected 2 values per row, got 1"),
        (([1.0] * 784, 1, 2), "expected 2 values per row, got 3"),
        (5, "expected a row of 2 values, got int"),
        ((["a"] * 784, 1), "column 0: text ['a', 'a',"),
        (([1.0] * 784, "seven"), "column 1: text 'seven' where a number (int64) is asked; cast the column"),
        # numeric text is refused too: numpy would parse it ("1.5" -> 1.5), a StringType
        # column is not a number (found by a new user feeding CAST(x AS STRING))
        ((["1.5"] * 784, 1), "column 0: text ['1.5', '1.5',"),
        (([1.0] * 783 + ["2"], 1), "where a number (float32) is asked"),
        (([1.0] * 784, "7"), "column 1: text '7' where a number (int64) is asked"),
        (([1.0] * 784, b"7"), "column 1: text b'7' where a number (int64) is asked"),
    ],
)
def test_malformed_rows(bad, text):
    rows = _good_rows(6)
    rows[5] = bad
    with pytest.raises(MalformedRowError) as ei:
        rows_to_columns(rows, COLS, ORIGINS)
    assert "partition 3 (epoch 1), row 40: " in str(ei.value)
    assert text in str(ei.value)


def test_malformed_without_origins():
    with pytest.raises(MalformedRowError, match=r"partition -1 \(epoch 0\), row 1: the row is None"):
        rows_to_columns([(np.zeros(784), 1), None], COLS)


# ------------------------------------------------------------------- DataFeed
@pytest.fixture
def hub():
    h = FeedHub("127.0.0.1", KEY, ("input", "output"), 64, "worker:0 (executor 1, host 127.0.0.1)")
    yield h
    h.close()


def Feeder(hub: FeedHub, partition: int, *args, **kwargs) -> _Feeder:
    """A fake feed task on ``hub`` with the test key (see feed_fakes.Feeder)."""
    return _Feeder(hub, KEY, partition, *args, **kwargs)


def test_datafeed_needs_a_hub_and_queue(hub):
    with pytest.raises(TFOSError, match="this node has no data feed"):
        DataFeed(None)
    with pytest.raises(TFOSError, match=r"no queue 'nope' on this node; queues are \['input', 'output'\]"):
        DataFeed(hub, qname_in="nope")
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        DataFeed(hub).next_batch(0)


def test_train_batches_span_partitions_and_ack(hub):
    a, b = Feeder(hub, 3), Feeder(hub, 5)
    a.chunk([0, 1, 2])
    a.chunk([3, 4])
    a.end()
    b.chunk([10, 11, 12])
    b.end()
    hub.queues["input"].put_nowait(END_OF_FEED)
    feed = DataFeed(hub, train_mode=True, timeout_s=10)
    assert feed.next_batch(4) == [0, 1, 2, 3]
    assert feed.last_origins == [(0, 3, 0, 0), (3, 3, 0, 3)]
    assert feed.next_batch(4) == [4, 10, 11, 12]
    assert feed.last_origins == [(0, 3, 0, 4), (1, 5, 0, 0)]
    assert a.frame() == (FrameType.ACK, {"rows": 5})
    assert a.closed()
    assert not feed.should_stop()
    assert feed.next_batch(4) == []
    assert feed.should_stop()
    assert b.frame() == (FrameType.ACK, {"rows": 3})
    assert hub.rows_taken == 8


def test_input_mapping_sorted_columns(hub):
    a = Feeder(hub, 0)
    a.chunk([(1, "a"), (2, "b")])
    a.end()
    hub.queues["input"].put_nowait(END_OF_FEED)
    feed = DataFeed(hub, input_mapping={"label": "y_in", "image": "x_in"}, timeout_s=10)
    # columns in sorted column-name order: 'image' (row[0]) then 'label' (row[1])
    assert feed.next_batch(10) == {"x_in": [1, 2], "y_in": ["a", "b"]}


def test_input_mapping_takes_named_columns_by_name(hub, caplog):
    """DataFrame rows carry their column names: each tensor gets its own column whatever the
    DataFrame's column order (a docs audit fed columns zeta, alpha, mid and got alpha's values
    under zeta's tensor); Row objects too; names that miss a mapped column fall back to
    TFoS's positional pairing with a WARNING."""
    pa = pytest.importorskip("pyarrow")
    from pyspark.sql import Row

    a = Feeder(hub, 0, kind="arrow")
    a.arrow(pa.RecordBatch.from_pydict({"zeta": [0, 1], "alpha": [0, 2], "mid": [0, 3]}))
    a.arrow(pa.RecordBatch.from_pydict({"mid": [6], "zeta": [2], "alpha": [4]}))  # another order in one batch
    a.end()
    b = Feeder(hub, 1)
    b.chunk([Row(zeta=3, alpha=6, mid=9)])
    b.chunk([Row(x=1, y=2, z=3)])  # none of the mapped names: positional, warned
    b.end()
    hub.queues["input"].put_nowait(END_OF_FEED)
    feed = DataFeed(hub, input_mapping={"zeta": "tz", "alpha": "ta", "mid": "tm"}, timeout_s=10)
    assert feed.next_batch(3) == {"tz": [0, 1, 2], "ta": [0, 2, 4], "tm": [0, 3, 6]}
    assert feed.next_batch(1) == {"tz": [3], "ta": [6], "tm": [9]}
    with caplog.at_level("WARNING", logger="tfos.datafeed"):
        assert feed.next_batch(1) == {"ta": [1], "tm": [2], "tz": [3]}
    assert "input_mapping columns ['alpha', 'mid', 'zeta'] are not among the fed rows' columns ['x', 'y', 'z']" in caplog.text
    assert "worker:0 (executor 1, host 127.0.0.1)" in caplog.text


def test_batches_convert_and_name_bad_rows(hub):
    a = Feeder(hub, 6)
    a.chunk(_good_rows(3))
    a.chunk([([1.0] * 783, 9)])
    a.end()
    hub.queues["input"].put_nowait(END_OF_FEED)
    feed = DataFeed(hub, timeout_s=10)
    it = feed.batches(3, COLS)
    x, y = next(it)
    assert x.shape == (3, 784) and y.tolist() == [0, 1, 2]
    with pytest.raises(MalformedRowError, match=r"partition 6 \(epoch 0\), row 3: column 0: expected shape"):
        next(it)


def test_next_batch_times_out(hub):
    feed = DataFeed(hub, timeout_s=0.3)
    with pytest.raises(DeadlineExceededError, match=r"timed out after 0.3 s waiting for data on queue 'input'"):
        feed.next_batch(1)


def test_terminate(hub):
    a = Feeder(hub, 0)
    a.chunk([1, 2, 3])
    feed = DataFeed(hub, timeout_s=10)
    assert feed.next_batch(1) == [1]
    feed.terminate()
    assert feed.should_stop()
    assert "input" in hub.terminated
    assert a.frame() == (FrameType.TERMINATED, {"rows": 1})
    assert hub.queues["input"].empty()
    assert feed.next_batch(5) == []


def test_inference_batches_stay_within_a_partition(hub):
    a, b = Feeder(hub, 7, "inference"), Feeder(hub, 8, "inference")
    a.chunk(["a0", "a1", "a2"])
    a.end()
    b.chunk(["b0", "b1"])
    b.end()
    hub.queues["input"].put_nowait(END_OF_FEED)
    feed = DataFeed(hub, train_mode=False, timeout_s=10)
    assert feed.next_batch(2) == ["a0", "a1"]
    feed.batch_results(np.array([10, 11]))
    assert a.frame() == (FrameType.RESULTS, [10, 11])
    assert feed.next_batch(5) == ["a2"]  # ends at the partition boundary
    assert a.no_frame_yet()  # the partition is not over until its last batch is answered
    feed.batch_results(["r2"])
    assert a.frame() == (FrameType.RESULTS, ["r2"])
    assert a.frame() == (FrameType.RESULTS_END, {"rows": 3})
    assert feed.next_batch(5) == ["b0", "b1"]
    feed.batch_results([1, 2])
    assert b.frame() == (FrameType.RESULTS, [1, 2])
    assert b.frame() == (FrameType.RESULTS_END, {"rows": 2})
    assert feed.next_batch(5) == []
    assert feed.should_stop()


def test_inference_interleaved_partitions_all_get_results_end(hub):
    # Two feed tasks feed the same node at once, so their chunks interleave on the queue.
    a, b = Feeder(hub, 0, "inference"), Feeder(hub, 1, "inference")
    a.chunk(["a0", "a1"])
    b.chunk(["b0", "b1"])
    a.end()
    b.end()
    hub.queues["input"].put_nowait(END_OF_FEED)
    feed = DataFeed(hub, train_mode=False, timeout_s=10)
    assert feed.next_batch(10) == ["a0", "a1"]
    feed.batch_results(["A0", "A1"])
    assert a.frame() == (FrameType.RESULTS, ["A0", "A1"])
    assert feed.next_batch(10) == ["b0", "b1"]
    # partition 0's end came while partition 1's rows were in the batch: partition 0 is fully
    # answered, so its feed task must get RESULTS_END now (not wait for feed_timeout)
    assert a.frame() == (FrameType.RESULTS_END, {"rows": 2})
    feed.batch_results(["B0", "B1"])
    assert b.frame() == (FrameType.RESULTS, ["B0", "B1"])
    assert b.frame() == (FrameType.RESULTS_END, {"rows": 2})
    assert feed.next_batch(10) == []
    assert feed.should_stop()


def test_one_main_fun_serves_train_then_inference(hub):
    """train() then inference() on one cluster, read by one DataFeed in TFoS's default
    train_mode=True: a batch never mixes train and inference rows, results given for the
    train batch are dropped (nothing waits for them), and the inference batches stay in
    their partition and are answered on its connection."""
    t, i = Feeder(hub, 0), Feeder(hub, 1, "inference")
    t.chunk([0, 1, 2])
    t.end()
    i.chunk(["x", "y", "z"])
    i.end()
    hub.queues["input"].put_nowait(END_OF_FEED)
    feed = DataFeed(hub, timeout_s=10)
    assert feed.batch_mode is None
    assert feed.next_batch(5) == [0, 1, 2]  # ends where the inference rows begin
    assert feed.batch_mode == "train"
    assert t.frame() == (FrameType.ACK, {"rows": 3})
    feed.batch_results([10, 11, 12])  # a train batch: dropped
    assert feed.next_batch(2) == ["x", "y"]
    assert feed.batch_mode == "inference"
    feed.batch_results(["X", "Y"])
    assert i.frame() == (FrameType.RESULTS, ["X", "Y"])
    assert feed.next_batch(5) == ["z"]  # never past the end of its partition
    assert i.no_frame_yet()
    feed.batch_results(["Z"])
    assert i.frame() == (FrameType.RESULTS, ["Z"])
    assert i.frame() == (FrameType.RESULTS_END, {"rows": 3})
    with pytest.raises(InferenceResultError, match="no inference batch is waiting"):
        feed.batch_results(["again"])  # an inference batch is answered once
    assert feed.next_batch(5) == []
    assert feed.should_stop()
    assert hub.rows_taken == 6


def test_tfnode_functional_forms_share_one_feed_per_queue(hub):
    """TFoS's TFNode.next_batch/batch_results(mgr, ...) on an inference partition: both use
    the same DataFeed (they used separate ones, and batch_results found no batch waiting)."""
    from tfos import TFNode

    a = Feeder(hub, 2, "inference")
    a.chunk([1, 2, 3])
    a.end()
    assert TFNode.next_batch(hub, 2) == [1, 2]
    TFNode.batch_results(hub, [10, 20])
    assert a.frame() == (FrameType.RESULTS, [10, 20])
    assert TFNode.next_batch(hub, 2) == [3]
    TFNode.batch_results(hub, [30])
    assert a.frame() == (FrameType.RESULTS, [30])
    assert a.frame() == (FrameType.RESULTS_END, {"rows": 3})


def test_train_rows_read_in_the_inference_form_need_no_results(hub):
    """train() rows read with train_mode=False (a main_fun written for inference): batches
    end with their partition, as in TFoS, but nothing waits for results. The results
    main_fun gives are dropped; they used to go back as RESULTS frames that the train feed
    task failed on ("bad JSON in a RESULTS data frame")."""
    a, b = Feeder(hub, 3), Feeder(hub, 5)
    a.chunk([0, 1, 2])
    a.end()
    b.chunk([10, 11])
    b.end()
    hub.queues["input"].put_nowait(END_OF_FEED)
    feed = DataFeed(hub, train_mode=False, timeout_s=10)
    assert feed.next_batch(2) == [0, 1]
    feed.batch_results(["r0", "r1"])  # nothing goes to the feed task
    assert feed.next_batch(5) == [2]
    assert a.frame() == (FrameType.ACK, {"rows": 3})
    feed.batch_results(["r2"])
    assert a.closed()
    assert feed.next_batch(5) == [10, 11]
    assert b.frame() == (FrameType.ACK, {"rows": 2})
    feed.batch_results(["r10", "r11"])
    assert feed.next_batch(5) == []
    assert feed.should_stop()
    assert hub.rows_taken == 5


def test_inference_wrong_result_count(hub):
    a = Feeder(hub, 4, "inference")
    a.chunk(["x", "y", "z"])
    a.end()
    feed = DataFeed(hub, train_mode=False, timeout_s=10)
    with pytest.raises(InferenceResultError, match=r"^node worker:0 \(executor 1, host 127.0.0.1\): batch_results\(\) was called but no inference batch is waiting"):
        feed.batch_results([1])
    assert feed.next_batch(3) == ["x", "y", "z"]
    with pytest.raises(InferenceResultError) as ei:
        feed.batch_results([1, 2])
    msg = str(ei.value)
    assert "batch_results() got 2 results for a batch of 3 rows (partition 4, rows 0-2)" in msg
    ftype, info = a.frame()
    assert ftype is FrameType.ERROR
    assert info["state"] == "main_fun_failed" and info["message"] == msg


def test_abort_cuts_the_feed_off_and_is_never_an_end_of_feed(hub):
    """The driver's abort (another node failed, or this node's executor was lost) while
    main_fun reads: next_batch() raises FeedAbortedError naming the node and the reason,
    also when the feed is closed afterwards (the TF process's stop handler calls
    close_feed()), so main_fun never takes a cut-off feed for a complete one (it once
    trained 'through' the missing epochs and reported a final checkpoint)."""
    import time

    from tfos.errors import FeedAbortedError

    a = Feeder(hub, 2)
    a.chunk([1, 2, 3])
    feed = DataFeed(hub, timeout_s=10)
    assert feed.next_batch(1) == [1]
    hub.abort("node worker:1 failed")
    hub.close_feed()
    with pytest.raises(FeedAbortedError, match=r"node worker:0 \(executor 1, host 127.0.0.1\): the cluster aborted "
                                               r"\(node worker:1 failed\) while main_fun was reading queue 'input'"):
        feed.next_batch(10)
    assert not feed.should_stop()
    time.sleep(0.2)  # no end-of-feed marker arrives later either
    assert hub.queues["input"].empty()


def test_abort_wakes_a_waiting_reader(hub):
    """A reader blocked on an empty queue gets FeedAbortedError within its 1 s poll, not at
    its data timeout, and as_dataset-style consumers see the same error."""
    import threading
    import time

    from tfos.errors import FeedAbortedError, NodeFailure, is_root_cause

    feed = DataFeed(hub, timeout_s=30)
    threading.Timer(0.3, hub.abort, args=("the cluster failed",)).start()
    t0 = time.monotonic()
    with pytest.raises(FeedAbortedError, match=r"the cluster aborted \(the cluster failed\)"):
        feed.next_batch(5)
    assert time.monotonic() - t0 < 5.0
    # a consequence of the abort, never the root cause the driver raises
    assert not is_root_cause(NodeFailure(1, "worker", 0, "127.0.0.1", "exception", "FeedAbortedError", "x"))


def test_end_of_feed_queued_before_the_abort_is_never_handed_out(hub):
    """A normal end of feed that was queued (or was being queued by the marker thread) when
    the abort came is not an end of feed: the reader raises, also when the abort flag is set
    while the END_OF_FEED is already in the queue (the drain and the take race)."""
    from tfos.errors import FeedAbortedError

    feed = DataFeed(hub, timeout_s=10)
    hub.queues["input"].put_nowait(END_OF_FEED)
    hub.aborted = "node worker:1 failed"  # the abort's flag, before its drain ran
    with pytest.raises(FeedAbortedError, match=r"the cluster aborted \(node worker:1 failed\)"):
        feed.next_batch(4)
    assert not feed.should_stop()


def test_close_feed_then_abort_then_the_marker_thread_puts_nothing(hub):
    """close_feed() before the abort (the marker thread waiting for room in a full queue):
    after the abort's drain the marker thread stops instead of queueing END_OF_FEED."""
    import time

    from tfos.errors import FeedAbortedError

    q = hub.queues["input"]
    a = Feeder(hub, 0)
    while not q.full():
        a.chunk([1])
    hub.close_feed()  # the marker thread waits for room
    time.sleep(0.2)
    hub.abort("the cluster failed")
    time.sleep(1.5)  # the marker thread's put polls every 0.5 s
    assert q.empty()
    with pytest.raises(FeedAbortedError):
        DataFeed(hub, timeout_s=10).next_batch(1)


def test_abort_rows_left_in_the_chunk_are_not_handed_out_and_nothing_is_acknowledged(hub):
    """After the abort, next_batch() raises on every call even with rows left in its chunk,
    the end of a partition taken before is acknowledged but none after, terminate() sends
    no T frame (a terminated partition counts as consumed on a restart), and data
    connections opened after the abort are refused as failed."""
    from tfos.errors import FeedAbortedError

    a, b = Feeder(hub, 0), Feeder(hub, 1)
    a.chunk([1, 2])
    a.end()
    b.chunk([3, 4, 5, 6])
    feed = DataFeed(hub, timeout_s=10)
    assert feed.next_batch(3) == [1, 2, 3]  # partition 0 ended inside this batch: ACKed
    ftype, info = a.frame()
    assert ftype is FrameType.ACK and info == {"rows": 2}
    hub.abort("node worker:1 failed")
    for _ in range(2):
        with pytest.raises(FeedAbortedError):
            feed.next_batch(1)  # rows 4, 5, 6 are still in the decoded chunk
    assert hub.rows_taken == 3
    b.end()  # a PartitionEnd queued by a reader thread after the abort's drain
    feed._finish_partition(b.conn)  # (as a tf.data reader would)
    assert b.no_frame_yet()  # no ACK
    feed.terminate()
    assert feed.should_stop() and "input" not in hub.terminated
    assert b.no_frame_yet()  # no T frame either
    assert not hub._put(hub.queues["input"], b.conn, object())  # reader threads queue nothing more


def test_event_loop_handles_the_abort_before_the_feed_closing_in_one_reply():
    """One wait_event reply carrying both the abort and feed_closed (the teardown closes the
    feed too): the hub is aborted and its feed never closed normally, then stop runs."""
    from tfos._node.tf_process import _event_loop

    calls: list = []

    class _Hub:
        aborted = ""
        rows_taken = 0

        def abort(self, reason):
            calls.append(("abort", reason))
            self.aborted = reason

        def close_feed(self):
            calls.append(("close_feed",))

    class _Client:
        n = 0

        def call(self, msg, **kw):  # a typed message, as ControlClient.call takes it
            return self.request(msg.TYPE, **msg.fields(), **kw)

        def request(self, *_a, **_k):
            self.n += 1
            if self.n > 1:
                raise SystemExit  # ends the loop after one reply
            return {"stop": True, "feed_closed": True, "abort": "node worker:1 failed", "failed": True}

    import threading

    stop = threading.Event()
    with pytest.raises(SystemExit):
        _event_loop(_Client(), 1, _Hub(), stop, lambda: calls.append(("on_stop",)))
    assert calls == [("abort", "node worker:1 failed"), ("on_stop",)]
    assert stop.is_set()


def test_main_fun_stack_shows_where_main_fun_waits_and_the_event_loop_sends_it():
    """main_fun_stack: the frames from main_fun inward (innermost last, with source lines),
    none of the TF process's own; '' once the thread ended. The event loop answers a
    ``stack`` directive once per request number."""
    import threading

    from tfos._node import tf_process

    release = threading.Event()

    def stuck_main_fun():
        release.wait(30)  # the line the stack must show

    th = threading.Thread(target=stuck_main_fun, name="MainThread-ish")
    th.start()
    try:
        time.sleep(0.1)
        text = tf_process.main_fun_stack(th, "worker:0")
    finally:
        release.set()
        th.join(10)
    lines = text.splitlines()
    assert lines[0] == f"main_fun's stack on worker:0 (TF process pid {os.getpid()}, thread MainThread-ish), innermost call last:"
    assert any("in stuck_main_fun" in ln for ln in lines), text
    assert "release.wait(30)  # the line the stack must show" in text
    assert "threading.py" in lines[-2] and lines[-2].endswith(", in wait"), text  # innermost: inside Event.wait
    assert tf_process.main_fun_stack(th, "worker:0") == ""

    sent: list = []

    class _Client:
        replies = [{"stop": False, "stack": 0}, {"stop": False, "stack": 1}, {"stop": False, "stack": 1}, {"stop": False, "stack": 2}]

        def call(self, msg, **kw):  # a typed message, as ControlClient.call takes it
            return self.request(msg.TYPE, **msg.fields(), **kw)

        def request(self, mtype, **fields):
            if mtype == "stack":
                sent.append((fields["seq"], fields["text"]))
                return {"ok": True}
            if not self.replies:
                raise SystemExit
            return self.replies.pop(0)

    with pytest.raises(SystemExit):
        tf_process._event_loop(_Client(), 1, None, threading.Event(), lambda: None, lambda: "STACK")
    assert sent == [(1, "STACK"), (2, "STACK")]


def test_a_main_fun_failing_after_the_abort_reports_a_consequence():
    """tf.data wraps the feed's FeedAbortedError in tf.errors.UnknownError: the TF process
    reports whatever main_fun raised after the abort as a FeedAbortedError (with the original
    type and text in the message), so the driver never takes it for the root cause."""
    from tfos._node.node_failure import after_abort as _after_abort
    from tfos.errors import NodeFailure, is_root_cause

    raw = NodeFailure(1, "worker", 0, "127.0.0.1", "exception", "UnknownError", "FeedAbortedError: node worker:0 ...", "tb")
    assert is_root_cause(raw)
    rep = _after_abort(raw, "node worker:1 failed")
    assert not is_root_cause(rep)
    assert rep.error_type == "FeedAbortedError" and rep.traceback == "tb" and (rep.executor_id, rep.job_name) == (1, "worker")
    assert rep.message == "after the cluster aborted (node worker:1 failed), main_fun raised UnknownError: FeedAbortedError: node worker:0 ..."
    same = NodeFailure(1, "worker", 0, "127.0.0.1", "exception", "FeedAbortedError", "x", "tb")
    assert _after_abort(same, "r") is same
