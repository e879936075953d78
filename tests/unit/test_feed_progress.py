"""feed_timeout bounds a stall of the node, not the time main_fun takes to work through
the chunks already queued (attacker trial, session 17: a node steadily reading 33 rows/s
failed with "sent nothing for 20 s ... main_fun stopped consuming" after END).

After a partition's END the node sends its feed task a PROGRESS frame every
``min(feed_timeout / 4, PROGRESS_EVERY_S)`` seconds in which main_fun took rows; the task's
``_Link.recv`` skips them, each with a fresh feed_timeout."""
from __future__ import annotations

import os
import pickle
import threading
import time

import pytest

from tfos._common import wire as _wire
from tfos._data.feed_connection import Chunk, PartitionEnd
from tfos._data.feed_hub import FeedHub
from tfos._data.feed_link import Link as _Link
from tfos._data.feed_plan import FeedPlan
from tfos._data.framing import FrameType, parse_json
from tfos.cluster_template import NodeInfo
from tfos.errors import FeedTimeoutError

KEY = _wire.new_key()
FEED_TIMEOUT_S = 1.0


@pytest.fixture
def hub():
    h = FeedHub("127.0.0.1", KEY, ("input",), 4, "worker:0 (executor 0, test)")
    yield h
    h.close("main_fun_returned", "test over")


def _link(hub: FeedHub) -> _Link:
    node = NodeInfo(0, "worker", 0, "127.0.0.1", 2222, hub.port, os.getpid(), "test/1", hub.path)
    hub.identity = _wire.node_identity(node)  # as the TF process does once it registered
    plan = FeedPlan("tfos-unit-progress", KEY, "127.0.0.1", 1, (node,), "input", "train", None, feed_timeout_s=FEED_TIMEOUT_S, feed_id="feed-unit")
    return _Link(plan, node, 0, 0, 0, local=True)


def _send_partition(link: _Link, hub: FeedHub, rows: list) -> tuple[Chunk, PartitionEnd]:
    link.send(FrameType.DATA, pickle.dumps(rows))
    link.send(FrameType.END)
    chunk, end = hub.queues["input"].get(timeout=10), hub.queues["input"].get(timeout=10)
    assert isinstance(chunk, Chunk) and isinstance(end, PartitionEnd)
    return chunk, end


def test_a_slow_steady_consumer_keeps_its_feed_task_waiting_past_feed_timeout(hub):
    link = _link(hub)
    try:
        rows = list(range(40))
        chunk, end = _send_partition(link, hub, rows)
        taken = pickle.loads(chunk.payload)
        conn = chunk.conn

        def consume() -> None:  # 4 s for 40 rows: 4 x feed_timeout, never 1 s without a row
            for _ in taken:
                time.sleep(0.1)
                conn.rows_taken += 1
                hub.rows_taken += 1
            hub.finish_connection(conn, FrameType.ACK, {"rows": conn.rows_taken})

        t0 = time.monotonic()
        threading.Thread(target=consume, daemon=True).start()
        ftype, payload = link.recv()
        assert ftype is FrameType.ACK and parse_json(ftype, payload) == {"rows": 40}
        assert time.monotonic() - t0 > 3 * FEED_TIMEOUT_S
        assert sum(taken) == sum(rows)
    finally:
        link.close()


def test_a_stalled_consumer_still_times_out_after_feed_timeout(hub):
    link = _link(hub)
    try:
        _send_partition(link, hub, list(range(40)))
        t0 = time.monotonic()
        with pytest.raises(FeedTimeoutError, match=r"sent nothing for 1 s for partition 0 \(epoch 0\) -> worker:0"):
            link.recv()  # main_fun took the chunk and no row after it: no PROGRESS
        assert FEED_TIMEOUT_S <= time.monotonic() - t0 < FEED_TIMEOUT_S + 2
    finally:
        link.close()


def test_no_progress_frame_before_the_partitions_end(hub):
    """While the task still sends, the node never speaks unasked (a frame from the node
    then means T or X: ``_Link.peer_spoke`` stops the task's stream)."""
    link = _link(hub)
    try:
        link.send(FrameType.DATA, pickle.dumps([1, 2, 3]))
        chunk = hub.queues["input"].get(timeout=10)
        for _ in range(4):  # 0.8 s of steady consumption, over 3 x feed_timeout / 4 (the node
            time.sleep(0.2)  # closes a connection that sends nothing for feed_timeout)
            hub.rows_taken += 1
        assert not link.peer_spoke()
        link.send(FrameType.END)
        assert isinstance(hub.queues["input"].get(timeout=10), PartitionEnd)
        hub.finish_connection(chunk.conn, FrameType.ACK, {"rows": 3})
        ftype, payload = link.recv()
        assert ftype is FrameType.ACK and parse_json(ftype, payload) == {"rows": 3}
    finally:
        link.close()


def test_tfos_manager_methods_say_what_to_use_instead(hub):
    """TFoS's ctx.mgr.get_queue()/get()/set() (new-user trial: a bare AttributeError)."""
    from tfos.errors import TFOSError

    with pytest.raises(TFOSError, match=r"ctx.mgr.get_queue\('input'\): a tfos node has no manager row queues .*next_batch"):
        hub.get_queue("input")
    with pytest.raises(TFOSError, match=r"ctx.mgr.get\('state'\): .*should_stop\(\)"):
        hub.get("state")
    with pytest.raises(TFOSError, match=r"ctx.mgr.set\('state', ...\): .*DataFeed.terminate\(\)"):
        hub.set("state", "terminating")
