"""The cluster simulator at a small size (scripts/sim_cluster.py; no Spark, no TF).

The real driver side (ClusterRuntime, its ClusterHost, ControlServer) with ten simulated
nodes in one node process speaking the real protocol: every node registers and gets the
cluster spec, the feed's partitions are each granted once, and each failure kind is named
by the driver's error well within two heartbeat timeouts; nothing is refused by a cap.
"""

from __future__ import annotations

import os
import sys
import threading

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
import sim_cluster  # noqa: E402

TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def figures():
    # Threads an earlier test left in this process (Spark's py4j threads, say) are not the
    # driver side's and must not be counted as its threads.
    done = threading.Event()
    strays = [threading.Thread(target=done.wait, args=(120,), name=f"stray-{i}", daemon=True) for i in range(5)]
    for t in strays:
        t.start()
    try:
        return sim_cluster.run_size(10, procs=1, timeout_s=TIMEOUT_S, steady_s=1.0, kinds=sim_cluster.FAILURE_KINDS)
    finally:
        done.set()


def test_the_cluster_forms_and_feeds_exactly(figures):
    # run_cluster raises when a node is missing, a partition is granted twice or not at all,
    # or the feed is not closed once every partition was handed over
    assert figures["nodes"] == 10
    assert figures["registered_s"] < 60 and figures["spec_s"] < 60 and figures["feed_s"] < 60
    assert figures["hb_interval_s"] == TIMEOUT_S / 4 and figures["poll_s"] == 1.0
    # heartbeats (10 nodes / 0.5 s) and directive polls (10 / 1 s): about 30 requests a second
    assert 5 < figures["frames_s"] < 100, figures


def test_every_failure_kind_is_named_within_two_heartbeat_timeouts(figures):
    # run_cluster checks that the driver's error names the failed executor
    assert figures["exception_s"] < 2 * TIMEOUT_S, figures
    for kind in ("silence", "drop"):
        # no report: the heartbeat timeout (counted from the last heartbeat) and the liveness tick
        assert TIMEOUT_S - TIMEOUT_S / 4 - 0.5 < figures[f"{kind}_s"] < 2 * TIMEOUT_S + 1.0, figures


def test_no_connection_refused_and_few_driver_threads(figures):
    assert figures["refused"] == 0, figures
    # the control server's loop and the liveness thread besides the main thread; no thread per connection
    assert figures["threads"] <= 4, figures
    assert figures["conns"] >= 20  # each node's supervisor and TF process, and its feed task


def test_healthy_nodes_keep_a_margin_against_the_heartbeat_timeout(figures):
    # the longest time since a live node's last heartbeat the driver held before a failure:
    # heartbeats every TIMEOUT_S / 4 keep it well under the timeout (else a healthy node is lost)
    assert 0 < figures["hb_stale_s"] < TIMEOUT_S, figures
    assert figures["hb_gap_s"] >= TIMEOUT_S / 4 - 0.05, figures  # paced as the real supervisor
