"""A relay without the key reads no row (no Spark; a real FeedHub, the real feed-task link).

A relay process listens where a node registered its data port (it took the port the node
released) and passes bytes between a feed task and another, live node, keeping a copy of
everything it forwards:

* the handshake binds the node the task meant to reach, so the live node refuses it, the
  task learns which node it reached (``DataRelayError``) and sends nothing but its nonce
  and proof: the relay saw 68 bytes from the task;
* even a relay in front of the very node the task means to reach (on a path it controls)
  forwards only ciphertext: frames are encrypted, so no row can be read from what it saw,
  and the node still receives every row.
"""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import time

import pytest

from tfos._common import wire as _wire
from tfos._common.deadline import Deadline
from tfos._data.feed_hub import FeedHub
from tfos._data.feed_link import Link as _Link
from tfos._data.feed_plan import FeedPlan
from tfos._data.framing import FeedState, FrameType, recv_json, send_frame, send_json
from tfos.cluster_template import NodeInfo
from tfos.datafeed import DataFeed

KEY = _wire.new_key()
MARK = b"ROW-SECRET-"

#: The relay: a separate process without the cluster key.
INTRUDERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "intruders.py")


@pytest.fixture
def live_node():
    """Node 1 (worker:1): a real FeedHub with its identity set, as its TF process sets it."""
    hub = FeedHub("127.0.0.1", KEY, ("input",), 8, "worker:1 (executor 1, host 127.0.0.1)")
    node = NodeInfo(1, "worker", 1, "127.0.0.1", 2223, hub.port, os.getpid(), "h/2", hub.path)
    hub.identity = _wire.node_identity(node)
    yield hub, node
    hub.close(FeedState.MAIN_FUN_RETURNED, "test over")


@pytest.fixture
def relay(live_node, tmp_path):
    """A separate process relaying a port of its own to node 1's data port; returns (port,
    capture path prefix)."""
    hub, _ = live_node
    capture = str(tmp_path / "capture")
    proc = subprocess.Popen([sys.executable, INTRUDERS, "relay", "--listen", "127.0.0.1:0", "--to", str(hub.port),
                             "--capture", capture], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        yield port, capture
    finally:
        proc.kill()
        proc.wait(10)


def _seen(capture: str, tag: str) -> bytes:
    try:
        with open(f"{capture}.{tag}", "rb") as f:
            return f.read()
    except FileNotFoundError:
        return b""


def _rows(n: int) -> list:
    return [(i, MARK + b"%05d" % i) for i in range(n)]


def test_a_relay_to_another_node_is_refused_and_named(live_node, relay):
    """Node 0 returned and a relay took its data port, passing connections to node 1: the
    feed task for node 0 learns its handshake reached worker:1 and sends it no row."""
    hub, node1 = live_node
    port, capture = relay
    node0 = NodeInfo(0, "worker", 0, "127.0.0.1", 2222, port, 999999, "h/1")  # its registered port: now the relay's
    plan = FeedPlan("tfos-unit-relay", KEY, "127.0.0.1", 1, (node0, node1), "input", "train", None,
                    feed_timeout_s=20.0, feed_id="relay", linger_s=0.01)
    with pytest.raises(_wire.DataRelayError) as ei:
        _Link(plan, node0, 0, 0, 0)
    assert ei.value.reached == node1.name
    assert ei.value.address == f"127.0.0.1:{port}"
    assert f"-> 127.0.0.1:{port}" in ei.value.connection and "listener uid" in ei.value.connection
    Deadline(10, "node 1 to refuse the relayed handshake").wait_for(lambda: hub.rejected >= 1)
    time.sleep(0.2)  # let the relay write what it forwarded
    assert len(_seen(capture, "to-node")) == 52  # its proof of the key, bound to node 0: nothing else
    assert len(_seen(capture, "to-task")) == 36  # node 1's refusal, naming node 1
    assert hub.queues["input"].empty()
    # Failing over, the task reaches node 1 itself and feeds it.
    link = _Link(plan, node1, 0, 0, 0)
    try:
        assert link.status == {"state": "ok"}
        send_frame(link.sock, link.session, FrameType.DATA, pickle.dumps(_rows(5)))
        send_frame(link.sock, link.session, FrameType.END)
        assert DataFeed(hub, timeout_s=10).next_batch(5) == _rows(5)
    finally:
        link.close()


def test_a_relay_in_front_of_the_right_node_sees_only_ciphertext(live_node, relay):
    """A relay on the path to the very node the task means to reach passes the handshake,
    but it knows no session key: every frame it forwards is encrypted, and the node gets
    every row."""
    hub, node1 = live_node
    port, capture = relay
    sock = socket.create_connection(("127.0.0.1", port), timeout=20)
    try:
        session = _wire.client_handshake(sock, KEY, Deadline(20, "handshake"), _wire.node_identity(node1))
        send_json(sock, session, FrameType.HEADER, {"qname": "input", "mode": "train", "partition": 0, "epoch": 0,
                                                    "kind": "pickled_batch", "feed_timeout_s": 20.0, "feed_id": "relay-ct",
                                                    "index": 0})
        assert recv_json(sock, session, Deadline(20))[1] == {"state": "ok"}
        rows = _rows(2000)
        for i in range(0, 2000, 500):
            send_frame(sock, session, FrameType.DATA, pickle.dumps(rows[i : i + 500]))
        send_frame(sock, session, FrameType.END)
        feed = DataFeed(hub, timeout_s=20)
        got: list = []
        while len(got) < 2000:
            got.extend(feed.next_batch(1000))
        assert got == rows
        hub.close_feed()
        assert feed.next_batch(1) == []  # takes the partition's end: the node acknowledges it
        answers = [recv_json(sock, session, Deadline(20))[0]]
        while answers[-1] is FrameType.PROGRESS:
            answers.append(recv_json(sock, session, Deadline(20))[0])
        assert answers[-1] is FrameType.ACK
    finally:
        sock.close()
    time.sleep(0.2)
    to_node, to_task = _seen(capture, "to-node"), _seen(capture, "to-task")
    assert len(to_node) > 2000 * 16  # the rows went through the relay...
    assert MARK not in to_node and b"relay-ct" not in to_node  # ...encrypted: not one row (nor the header) readable
    assert b'"state"' not in to_task  # the node's answers are encrypted too
    for blob in (to_node, to_task):  # nothing in it unpickles to a list of rows either
        for at in range(len(blob)):
            if blob[at] == 0x80:  # a pickle's PROTO opcode
                try:
                    assert not isinstance(pickle.loads(blob[at:]), list)
                except Exception:  # noqa: BLE001 - garbage, as it must be
                    pass
