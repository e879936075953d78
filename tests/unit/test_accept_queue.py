"""The flood note speaks only of evidence on tfos's own port (tfos._control.accept_queue)."""

import socket
import sys

import pytest

from tfos._control import accept_queue
from tfos._control.accept_queue import QueueWatch
from tfos._control import server
from tfos._control.server import ControlServer

KEY = b"k" * 32


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="TCP_INFO of a listener is Linux")
def test_accept_queue_reads_the_length_and_limit_of_a_real_listener():
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(2)
    clients = []
    try:
        assert accept_queue.accept_queue(lst) == (0, 2)
        for _ in range(3):
            c = socket.socket()
            c.setblocking(False)
            c.connect_ex(lst.getsockname())
            clients.append(c)
        length, limit = accept_queue.accept_queue(lst)
        assert limit == 2 and length >= 2  # full: the kernel drops further attempts now
    finally:
        for c in clients:
            c.close()
        lst.close()


def test_the_host_counter_rising_elsewhere_is_no_flood_of_ours(monkeypatch):
    """The host's ListenDrops rose (another listener's queue overflowed) while the control
    port's own queue had room and nobody was turned away: the report says nothing."""
    drops = iter(range(0, 10**9, 119_095))
    monkeypatch.setattr(accept_queue, "listen_drops", lambda: next(drops))
    monkeypatch.setattr(server, "_listen_drops", lambda: next(drops), raising=False)  # the host-wide reading before
    srv = ControlServer(KEY, lambda body, peer: {}, "127.0.0.1")
    try:
        srv._loop.queue.sample()  # the real queue: room
        assert srv.flood_report() == ""
    finally:
        srv.close()


def test_a_full_own_queue_is_reported_with_the_host_drops_over_its_spans():
    queue = iter([(0, 1024), (1024, 1024), (1024, 1024), (3, 1024), (1024, 1024)])
    drops = iter([100, 160, 500, 530])  # opens at 100, closes at 160; opens at 500; report reads 530
    w = QueueWatch(None, read_queue=lambda _l: next(queue), read_drops=lambda: next(drops))
    assert w.summary() == ""
    w.sample()
    assert w.summary() == ""  # room
    for _ in range(4):
        w.sample()
    assert w.full_seen == 3 and w.drops == 60
    assert w.summary() == ("its accept queue was found full (1024 connections waiting) 3 times, and the kernel "
                           "dropped 90 connection attempts to full accept queues while it was (TcpExt ListenDrops)")


def test_the_server_report_names_port_and_remedy_for_a_full_own_queue():
    srv = ControlServer(KEY, lambda body, peer: {}, "127.0.0.1")
    try:
        fake = QueueWatch(None, read_queue=lambda _l: (8, 8), read_drops=lambda: 7)
        fake.sample()
        srv._loop.queue = fake
        report = srv.flood_report()
        assert report.startswith(f"the tfos control port 127.0.0.1:{srv.port}: its accept queue was found full")
        assert "private network" in report
    finally:
        srv.close()
