"""Security of both planes against the real FeedHub, wire and control code (C20, C21).

No Spark, no TensorFlow: a real :class:`tfos._data.feed_hub.FeedHub` on loopback, real
handshakes (:mod:`tfos._common.wire`), real framing (:mod:`tfos._data.framing`), a real
:class:`tfos._control.server.ControlServer`; raw sockets play squatters, relays and floods.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import socket
import struct
import threading
import time

import pytest

import tfos._control.server as cs_mod
import tfos._data.feed_hub as hub_mod
from tfos._common import wire as _wire
from tfos._common.admission import make_proof
from tfos._common.deadline import Deadline
from tfos._control.client import ControlClient
from tfos._control.protocol import client_proof
from tfos._control.server import ControlServer
from tfos._data import feed_gate
from tfos._data.feed_connection import Chunk, PartitionEnd
from tfos._data.feed_hub import FeedHub
from tfos._data.framing import FrameType, recv_frame, recv_json, send_frame, send_json
from tfos._driver.spark_checks import warn_key_transport
from tfos.errors import ControlProtocolError

def _send(client, msg_type: str, timeout_s: float = 30.0, retry: bool = True, connect_timeout_s=None, **fields) -> dict:
    """A request of any type, as the protocol carries it (tfos itself sends typed messages,
    ControlClient.call); a type of tfos._control.messages is checked first, as call() does."""
    from tfos._control.messages import message_class

    cls = message_class(msg_type)
    if cls is not None:
        cls.decode(fields)
    return client._request(msg_type, fields, timeout_s, retry, connect_timeout_s)  # send_raw() without a connect budget


KEY = _wire.new_key()
OTHER_KEY = _wire.new_key()
CID = "tfos-unit-sec"


class _Boom:
    """Unpickling this writes a marker file: proof that hostile bytes were unpickled."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _evil_pickle(path: str) -> bytes:
    return pickle.dumps([_Boom(path)])


@pytest.fixture
def hub():
    h = FeedHub("127.0.0.1", KEY, ("input",), 8, "worker:0 (executor 0, test)")
    yield h
    h.close("main_fun_returned", "test over")


def _header(**over) -> dict:
    h = {"qname": "input", "mode": "train", "partition": 0, "epoch": 0, "kind": "pickled_batch",
         "feed_timeout_s": 30.0, "feed_id": "feed-1", "index": 0}
    h.update(over)
    return h


def _client(hub: FeedHub, key: bytes = KEY):
    s = socket.create_connection(("127.0.0.1", hub.port), timeout=20)
    session = _wire.client_handshake(s, key, Deadline(20, "handshake"))
    return s, session


def _open_partition(hub: FeedHub, **over):
    s, session = _client(hub)
    send_json(s, session, FrameType.HEADER, _header(**over))
    ftype, status = recv_json(s, session, Deadline(20))
    assert ftype is FrameType.STATUS
    return s, session, status


def _take(hub: FeedHub, timeout: float = 20.0):
    return hub.queues["input"].get(timeout=timeout)


def _no_item(hub: FeedHub, wait: float = 0.5) -> None:
    with pytest.raises(queue.Empty):
        hub.queues["input"].get(timeout=wait)


def _wait(pred, what: str, timeout: float = 20.0) -> None:
    Deadline(timeout, what).wait_for(pred)


# ============================================================ handshake, frames
def test_authenticated_partition_end_to_end(hub):
    s, session, status = _open_partition(hub)
    assert status == {"state": "ok"}
    rows = [(i, float(i)) for i in range(10)]
    send_frame(s, session, FrameType.DATA, pickle.dumps(rows))
    big = bytes(range(256)) * 4096  # 1 MiB: the large-payload path
    send_frame(s, session, FrameType.DATA, big)
    send_frame(s, session, FrameType.END)
    c1, c2, end = _take(hub), _take(hub), _take(hub)
    assert isinstance(c1, Chunk) and pickle.loads(c1.payload) == rows
    assert isinstance(c2, Chunk) and bytes(c2.payload) == big
    assert isinstance(end, PartitionEnd)
    hub.finish_connection(end.conn, FrameType.ACK, {"rows": 10})
    ftype, info = recv_json(s, session, Deadline(20))
    assert (ftype, info) == (FrameType.ACK, {"rows": 10})
    s.close()


def test_wrong_key_client_rejected_and_nothing_queued(hub, tmp_path):
    s = socket.create_connection(("127.0.0.1", hub.port), timeout=20)
    with pytest.raises(_wire.DataAuthError, match="refused this feed task's proof"):  # refused on its first bytes
        _wire.client_handshake(s, OTHER_KEY, Deadline(20))
    s.close()
    _wait(lambda: hub.rejected >= 1, "the rejection")
    _no_item(hub)


def test_squatter_without_key_gets_only_a_nonce_and_a_proof(tmp_path):
    """A process without the key on a node's port: the feed task sends it 52 + 68 bytes (its
    proof of the key, then its nonce and a proof bound to the squatter's nonce), then stops."""
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(1)
    got = bytearray()

    def squatter():
        c, _ = lst.accept()
        c.sendall(_wire._DATA_MAGIC + os.urandom(32))
        c.settimeout(3)
        try:
            while True:
                b = c.recv(65536)
                if not b:
                    break
                got.extend(b)
                if len(got) >= 52 + 68:
                    c.sendall(os.urandom(32))  # a made-up "server proof"
        except OSError:
            pass
        c.close()

    t = threading.Thread(target=squatter)
    t.start()
    s = socket.create_connection(lst.getsockname(), timeout=20)
    with pytest.raises(_wire.DataAuthError, match="failed to prove it holds the cluster key"):
        _wire.client_handshake(s, KEY, Deadline(20))
    s.close()
    t.join(10)
    lst.close()
    assert len(got) == 52 + 68  # proof of the key, then magic + client nonce + proof bound to the squatter's nonce; no data


def test_relay_in_the_middle_gets_nothing_accepted(hub, tmp_path):
    """A relay passes a real feed task's handshake to the real node, then injects a pickle."""
    marker = tmp_path / "unpickled"
    relay = socket.socket()
    relay.bind(("127.0.0.1", 0))
    relay.listen(1)
    result: dict = {}

    def feed_task():
        s = socket.create_connection(relay.getsockname(), timeout=20)
        try:
            result["session"] = _wire.client_handshake(s, KEY, Deadline(20))
        except Exception as exc:  # noqa: BLE001
            result["error"] = exc
        result["sock"] = s

    t = threading.Thread(target=feed_task)
    t.start()
    victim, _ = relay.accept()
    node = socket.create_connection(("127.0.0.1", hub.port), timeout=20)
    node.sendall(_wire.recv_exact(victim, 52, Deadline(20)))  # task's proof of the key -> node
    victim.sendall(_wire.recv_exact(node, 36, Deadline(20)))  # node hello -> task
    node.sendall(_wire.recv_exact(victim, 68, Deadline(20)))  # task proof -> node
    victim.sendall(_wire.recv_exact(node, 32, Deadline(20)))  # node proof -> task
    t.join(20)
    assert "session" in result  # both ends authenticated each other; the relay knows no key
    # The relay now speaks for itself: a header, then a pickled batch under forged tags.
    forged_header = b'{"qname":"input","mode":"train","partition":0,"kind":"pickled_batch"}'
    node.sendall(struct.pack(">BQ", ord("H"), len(forged_header)) + os.urandom(16) + forged_header + os.urandom(16))
    evil = _evil_pickle(str(marker))
    try:  # the forged header's own tag failed after its first 25 bytes: the hub may have closed already
        node.sendall(struct.pack(">BQ", ord("D"), len(evil)) + os.urandom(16) + evil + os.urandom(16))
    except OSError:
        pass
    _wait(lambda: hub.rejected >= 1, "the hub to reject the forged frame")
    _no_item(hub)
    assert not marker.exists()
    # Replaying the captured client proof on a new connection fails too (fresh server nonce).
    with pytest.raises(_wire.DataAuthError):
        a, b = socket.socketpair()
        b.sendall(b"TFD2" + os.urandom(32) + os.urandom(32))
        _wire.server_handshake(a, KEY, Deadline(5))
    node.close()
    victim.close()
    relay.close()
    result["sock"].close()


def _sealed(session, ftype: int, payload: bytes) -> tuple[bytes, bytearray]:
    head = struct.pack(">BQ", ftype, len(payload))
    return head, bytearray(session.seal(ftype, head, payload))


def test_tampered_reordered_and_reflected_frames_rejected():
    """Tags bind header, payload, type, sequence number and direction; payloads are encrypted."""
    a, b = socket.socketpair()
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("c", _wire.client_handshake(b, KEY, Deadline(10))))
    t.start()
    server = _wire.server_handshake(a, KEY, Deadline(10))
    t.join(10)
    client = out["c"]
    # encrypted: the plaintext is nowhere in the frame
    head, ct = _sealed(client, ord("D"), b"secret rows" * 10)
    assert b"secret" not in bytes(ct) and len(ct) == 110 + 16
    server.open(ord("D"), head, ct)
    assert bytes(ct) == b"secret rows" * 10  # decrypted in place, tag removed
    # tampered payload (a flipped ciphertext bit)
    head, ct = _sealed(client, ord("D"), b"rows")
    ct[0] ^= 1
    with pytest.raises(_wire.DataAuthError):
        server.open(ord("D"), head, ct)
    # tampered header (another length): the header is authenticated with the payload
    head, ct = _sealed(client, ord("D"), b"rows")
    with pytest.raises(_wire.DataAuthError):
        server.open(ord("D"), struct.pack(">BQ", ord("D"), 5), ct)
    # frame type changed
    head, ct = _sealed(client, ord("D"), b"x")
    with pytest.raises(_wire.DataAuthError):
        server.open(ord("E"), head, ct)
    # replayed frame: the next expected sequence number differs
    head, ct = _sealed(client, ord("D"), b"x")
    replay = bytearray(ct)
    server.open(ord("D"), head, ct)
    with pytest.raises(_wire.DataAuthError):
        server.open(ord("D"), head, replay)
    # reflected: a frame the server sent, fed back to the server
    head, ct = _sealed(server, ord("A"), b"{}")
    with pytest.raises(_wire.DataAuthError):
        server.open(ord("A"), head, ct)
    a.close()
    b.close()


def test_data_header_size_capped_before_allocation(hub):
    s, session = _client(hub)
    # an authenticated peer announcing a 2 GiB header: refused on the length prefix
    head = struct.pack(">BQ", ord("H"), (1 << 31) - 2)
    s.sendall(head + session.seal_head(ord("H"), head))
    _wait(lambda: hub.rejected >= 1, "the oversize header to be refused")
    s.close()


def _rss_peak_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.parametrize("direction", ["to the node", "to the feed task"])
def test_rewritten_frame_length_allocates_nothing_and_closes(direction):
    """A man in the middle rewrites a data frame's clear length to 2^31-1: the receiver (the
    node's hub or the feed task, both read with recv_frame) refuses the header's own tag
    after 25 bytes; its peak RSS grows by far less than 64 MB (it was 2 GiB when the buffer
    was sized from the clear length before any tag was checked)."""
    a, b = socket.socketpair()
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("c", _wire.client_handshake(b, KEY, Deadline(20))))
    t.start()
    node = _wire.server_handshake(a, KEY, Deadline(20))
    t.join(20)
    task = out["c"]
    sender, receiver, rx = (b, a, node) if direction == "to the node" else (a, b, task)
    tx = task if rx is node else node
    mitm_in, mitm_out = socket.socketpair()
    send_frame(mitm_in, tx, FrameType.DATA, b"rows" * 1000)
    frame = bytearray(_wire.recv_exact(mitm_out, 9 + 16 + 4000 + 16, Deadline(20)))
    frame[1:9] = struct.pack(">Q", (1 << 31) - 1)
    before = _rss_peak_mb()
    sender.sendall(bytes(frame) + os.urandom(1 << 16))  # and more bytes behind it, as a live feed would
    with pytest.raises(_wire.DataAuthError, match="header of data frame 1"):
        recv_frame(receiver, rx, Deadline(20, "the forged frame"))
    assert _rss_peak_mb() - before < 64
    for s in (a, b, mitm_in, mitm_out):
        s.close()


def test_malformed_and_non_finite_header_refused(hub):
    # the last two: a well-formed header without the feed id / partition index that every
    # feed task sends after claiming the partition at the driver
    for header in (_header(feed_timeout_s=float("nan")), _header(mode="steal"), {"qname": "input"},
                   {k: v for k, v in _header().items() if k != "feed_id"}, _header(index=-1)):
        s, session = _client(hub)
        payload = __import__("json").dumps(header).encode()  # NaN written as the JSON token NaN
        send_frame(s, session, FrameType.HEADER, payload)
        s.settimeout(20)
        assert s.recv(1) == b""  # closed, no status
        s.close()
    _wait(lambda: hub.rejected >= 5, "5 rejections")
    _no_item(hub)


# ============================================================== retried work
def test_partition_already_delivered_for_the_feed_is_refused(hub):
    s, session, status = _open_partition(hub, index=7)
    assert status == {"state": "ok"}
    send_frame(s, session, FrameType.END)
    end = _take(hub)
    hub.finish_connection(end.conn, FrameType.ACK, {"rows": 0})
    s.close()
    # Spark re-runs the task (stage resubmission: attempt 0 again): same feed, same index.
    s2, _, status2 = _open_partition(hub, index=7)
    assert status2["state"] == "refused"
    assert "already received partition index 7 of this feed" in status2["message"]
    assert "worker:0 (executor 0, test)" in status2["message"]
    s2.close()
    # another feed (a new train() call) may feed the same partition index
    s3, session3, status3 = _open_partition(hub, index=7, feed_id="feed-2")
    assert status3 == {"state": "ok"}
    s3.close()


# =================================================== accept loop, caps, floods
def test_accept_loop_survives_failed_thread_start(hub, monkeypatch):
    real_start = threading.Thread.start
    failures = {"n": 0}

    def flaky_start(self):
        if self.name == "tfos-feed-conn" and failures["n"] < 3:
            failures["n"] += 1
            raise RuntimeError("can't start new thread")
        return real_start(self)

    monkeypatch.setattr(threading.Thread, "start", flaky_start)
    for _ in range(3):
        s = socket.create_connection(("127.0.0.1", hub.port), timeout=20)
        s.sendall(make_proof(KEY, _wire.DATA_PROOF_MAGIC))  # a key holder: the hub starts its thread
        s.settimeout(20)
        assert s.recv(1) == b""  # closed by the accept loop, which lives on
        s.close()
    assert failures["n"] == 3
    s, session, status = _open_partition(hub)
    assert status == {"state": "ok"}
    s.close()


def test_unauthenticated_flood_costs_no_thread_and_never_evicts_a_key_holder(monkeypatch, caplog):
    """Strangers beyond the cap of unproven connections: no thread each; those past the
    grace period are evicted (the log names the evicted connection's address); a feed task
    whose proof arrived is never evicted, however long it then takes; one that connects
    during the flood gets through."""
    monkeypatch.setattr(feed_gate, "MAX_UNPROVEN", 16)
    h = FeedHub("127.0.0.1", KEY, ("input",), 8, "worker:0 (executor 0, test)", local_socket=False)
    try:
        slow = socket.create_connection(("127.0.0.1", h.port), timeout=20)
        slow.sendall(make_proof(KEY, _wire.DATA_PROOF_MAGIC))  # proven, then silent for a while
        before = threading.active_count()
        flood = [socket.create_connection(("127.0.0.1", h.port), timeout=20) for _ in range(48)]
        _wait(lambda: h.rejected >= 16, "evictions of strangers past their grace period")
        assert threading.active_count() - before <= 1
        assert h.gate.flood.evicted >= 16 and h.gate.flood.by_address["127.0.0.1"] >= 16
        evicted_ports = {str(f.getsockname()[1]) for f in flood}
        assert any("evicted" in r.getMessage() and r.getMessage().split("from 127.0.0.1:")[1].split(":")[0] in evicted_ports
                   for r in caplog.records if "from 127.0.0.1:" in r.getMessage())
        s, session, status = _open_partition(h)  # connects during the flood
        assert status == {"state": "ok"}
        s.close()
        assert _wire.recv_exact(slow, 36, Deadline(20))[:4] == _wire._DATA_MAGIC  # its hello: still served
        slow.close()
        for f in flood:
            f.close()
    finally:
        h.close("main_fun_returned", "test over")


def test_authenticated_connection_cap(hub, monkeypatch):
    monkeypatch.setattr(hub_mod, "MAX_CONNECTIONS", 2)
    a = _open_partition(hub, index=1)
    b = _open_partition(hub, index=2)
    s = socket.create_connection(("127.0.0.1", hub.port), timeout=20)
    with pytest.raises(ConnectionError):  # proves it holds the key, then is refused for the cap
        _wire.client_handshake(s, KEY, Deadline(20, "handshake"))
    s.close()
    for sock, _, _ in (a, b):
        sock.close()


def test_hub_close_ends_accept_loop_and_pending(hub):
    idle = socket.create_connection(("127.0.0.1", hub.port), timeout=20)
    hub.close("main_fun_returned", "done")
    assert _closed(idle)  # the pending handshake is ended, not left to its timeout
    hub.gate.thread.join(10)
    assert not hub.gate.thread.is_alive()


# ============================================================== control plane
@pytest.fixture
def server(monkeypatch, caplog):
    monkeypatch.delenv("TFOS_SERVER_HOST", raising=False)
    monkeypatch.delenv("TFOS_SERVER_PORT", raising=False)
    caplog.set_level(logging.DEBUG, logger="tfos")
    calls: list = []

    def dispatch(body: dict, peer: str) -> dict:
        calls.append(body)
        if body.get("type") == "sleep":
            # a key holder's malformed field: float() or min() of garbage, huge ints...
            time.sleep(min(float(body["poll_s"]), 0.01))
            return {"slept": True}
        if body.get("type") == "attr":
            return {"n": body["items"].count(1)}  # AttributeError on a non-list
        return {"echo": body.get("x"), "ok": True}

    srv = ControlServer(KEY, dispatch, "127.0.0.1")
    srv.calls = calls
    yield srv
    srv.close()


def _raw(srv: ControlServer):
    s = socket.create_connection((srv.host, srv.port), timeout=20)
    s.sendall(client_proof(KEY))
    hello = _wire.read_frame(s, KEY, Deadline(20), 20)
    return s, hello["sn"]


def _closed(s: socket.socket) -> bool:
    s.settimeout(20)
    try:
        while s.recv(65536):
            pass
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    finally:
        s.close()


def test_first_control_frame_capped_before_mac(server):
    s, _ = _raw(server)
    s.sendall(_wire.MAGIC + struct.pack(">I", _wire.MAX_FIRST_FRAME_BYTES + 1))
    assert _closed(s)
    _wait(lambda: server.rejected >= 1, "the rejection")
    assert server.calls == []


def test_big_first_request_goes_through_with_hi(server):
    c = ControlClient(server.host, server.port, KEY, CID, connect_timeout_s=20)
    try:
        big = "x" * (_wire.MAX_FIRST_FRAME_BYTES * 3)
        assert _send(c, "ping", x=big)["echo"] == big
        assert _send(c, "ping", x=1)["echo"] == 1
    finally:
        c.close()
    assert [b["type"] for b in server.calls] == ["ping", "ping"]


@pytest.mark.parametrize("fields", [
    {"type": "sleep", "poll_s": "soon"},
    {"type": "sleep"},
    {"type": "sleep", "poll_s": 10 ** 400},
    {"type": "attr", "items": 5},
])
def test_malformed_message_from_key_holder_is_a_protocol_error(server, fields):
    s, sn = _raw(server)
    s.sendall(_wire.encode_frame(KEY, dict(fields, cluster=CID, sn=sn, cn="c" * 32, seq=1)))
    assert _closed(s)
    _wait(lambda: server.rejected >= 1, "the rejection")
    c = ControlClient(server.host, server.port, KEY, CID, connect_timeout_s=20)
    assert _send(c, "ping", x=2)["echo"] == 2  # the server lives on
    c.close()


@pytest.mark.parametrize("token", [b"NaN", b"Infinity", b"-Infinity", b"1e999"])
def test_non_finite_numbers_rejected(server, token):
    s, sn = _raw(server)
    body = b'{"type":"sleep","cluster":"%s","sn":"%s","cn":"%s","seq":1,"poll_s":%s}' % (
        CID.encode(), sn.encode(), b"c" * 32, token)
    length = struct.pack(">I", len(body))
    import hashlib
    import hmac
    s.sendall(_wire.MAGIC + length + hmac.new(KEY, length + body, hashlib.sha256).digest() + body)
    assert _closed(s)
    _wait(lambda: server.rejected >= 1, "the rejection")
    assert server.calls == []
    with pytest.raises(ValueError):
        _wire.loads_strict(b'{"a": NaN}')


def test_response_bound_to_client_nonce(server):
    """A response without this connection's client nonce is refused by the client."""
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(1)

    def impostor():
        c, _ = lst.accept()
        _wire.recv_exact(c, 52, Deadline(20))  # the client's proof of the key
        c.sendall(_wire.encode_frame(KEY, {"type": "hello", "sn": "s" * 32}))
        req = _wire.read_frame(c, KEY, Deadline(20), 20)
        # an old response replayed: right server nonce and sequence, another client's nonce
        c.sendall(_wire.encode_frame(KEY, {"state": "ok", "re": req["seq"], "sn": "s" * 32, "cn": "f" * 32}))
        time.sleep(0.5)
        c.close()

    t = threading.Thread(target=impostor)
    t.start()
    c = ControlClient("127.0.0.1", lst.getsockname()[1], KEY, CID, connect_timeout_s=5)
    with pytest.raises(ControlProtocolError, match="does not answer this request"):
        _send(c, "heartbeat", executor_id=0, retry=False)
    c.close()
    t.join(10)
    lst.close()


def test_control_flood_bounded_and_legit_client_gets_through(server):
    n = cs_mod.MAX_UNAUTHENTICATED * 3
    before = threading.active_count()
    flood = [socket.create_connection((server.host, server.port), timeout=20) for _ in range(n)]
    try:
        _wait(lambda: server.rejected >= n - cs_mod.MAX_UNAUTHENTICATED, "evictions")
        assert threading.active_count() - before <= cs_mod.MAX_UNAUTHENTICATED + 2
        c = ControlClient(server.host, server.port, KEY, CID, connect_timeout_s=20)
        assert _send(c, "ping", x=9)["echo"] == 9
        c.close()
    finally:
        for f in flood:
            f.close()


def test_control_accept_survives_a_failed_connection_setup(server, monkeypatch):
    """Any error setting up one accepted connection closes that connection only; the
    event loop goes on accepting (the server has no thread per connection to fail)."""
    import tfos._control.loop_accept as loop_mod  # where connections are accepted

    real_conn = loop_mod._Conn
    failures = {"n": 0}

    def flaky_conn(*args, **kwargs):
        if failures["n"] < 2:
            failures["n"] += 1
            raise RuntimeError("simulated: no memory for one more connection")
        return real_conn(*args, **kwargs)

    monkeypatch.setattr(loop_mod, "_Conn", flaky_conn)
    before = threading.active_count()
    for _ in range(2):
        s = socket.create_connection((server.host, server.port), timeout=20)
        assert _closed(s)
    assert failures["n"] == 2
    _wait(lambda: server.rejected >= 2, "2 rejections")
    assert server.active_connections == 0
    c = ControlClient(server.host, server.port, KEY, CID, connect_timeout_s=20)
    assert _send(c, "ping", x=5)["echo"] == 5
    c.close()
    assert threading.active_count() <= before + 2  # the client's reader and one handler thread


# ============================================================ key transport
def test_key_transport_warning(caplog):
    caplog.set_level(logging.WARNING, logger="tfos")
    assert warn_key_transport("spark://master:7077", {}) is True
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(msgs) == 1
    assert "spark.authenticate" in msgs[0] and "spark.network.crypto.enabled" in msgs[0]
    caplog.clear()
    assert warn_key_transport("yarn", {"spark.authenticate": "true"}) is True
    assert warn_key_transport("yarn", {"spark.authenticate": "true", "spark.network.crypto.enabled": "true"}) is False
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    caplog.clear()
    # Local masters: the block managers still serve closures to any process on the host
    # (a same-host attacker fetched the key from local[2] and local-cluster), so only
    # spark.authenticate matters there; crypto is not asked for.
    assert warn_key_transport("local[4]", {}) is True
    assert warn_key_transport("local-cluster[2,1,1024]", {"spark.network.crypto.enabled": "true"}) is True
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(msgs) == 2
    assert all("spark.authenticate=true" in m and "crypto" not in m for m in msgs)
    # local[N]: Spark makes its own secret; local-cluster needs one, kept off command lines
    assert "(on local[N] Spark generates the secret)" in msgs[0], msgs[0]
    assert "spark.authenticate.secret in a properties file only you can read (not --conf or" in msgs[1], msgs[1]
    caplog.clear()
    assert warn_key_transport("local[4]", {"spark.authenticate": "true"}) is False
    assert warn_key_transport("local-cluster[2,1,1024]", {"spark.authenticate": "True "}) is False
    # once per application: a second cluster of the same application does not repeat it
    conf = {"spark.app.id": "app-test-key-warning"}
    assert warn_key_transport("local[2]", conf) is True
    assert warn_key_transport("local[2]", conf) is True
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    caplog.clear()
    # and never the key itself: the warning names settings, not secrets
    assert warn_key_transport("yarn", {"spark.authenticate.secret": "s3cr3t-value"}) is True
    assert all("s3cr3t-value" not in r.getMessage() for r in caplog.records)


def test_the_secret_on_a_command_line_is_warned_about(caplog):
    """A secret given with builder.config/--conf lands on the driver JVM's command line,
    which every user of the host can read: tfos finds it there and says so, without the
    secret, naming the process."""
    import logging
    import subprocess
    import sys

    from tfos._driver.spark_checks import secret_on_command_line, warn_key_transport

    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()", "--conf", "spark.authenticate.secret=s3cr3t-on-argv"],
                            stdin=subprocess.PIPE)
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        assert secret_on_command_line(proc.pid) == proc.pid
        assert secret_on_command_line(child.pid) is None  # nor its parent, this test process
        assert secret_on_command_line(None) is None
        caplog.set_level(logging.WARNING, logger="tfos")
        conf = {"spark.authenticate": "true", "spark.authenticate.secret": "s3cr3t-on-argv"}
        assert warn_key_transport("local-cluster[2,1,1024]", conf, proc.pid) is True
        assert warn_key_transport("local-cluster[2,1,1024]", conf, None) is False
        (msg,) = [r.getMessage() for r in caplog.records]
        assert msg.startswith(f"spark.authenticate.secret is on the command line of process {proc.pid} "), msg
        assert "properties file only you can read" in msg and "s3cr3t" not in msg, msg
    finally:
        for p in (proc, child):
            p.communicate(b"", timeout=30)


def test_tags_over_foreign_buffers_without_copy():
    """Arrow buffers (signed-char exports) and numpy arrays are encrypted like their bytes,
    whole or in parts."""
    np = pytest.importorskip("numpy")
    pa = pytest.importorskip("pyarrow")
    tx, rx = _wire.DataSession(b"k" * 32, b"k" * 32), _wire.DataSession(b"k" * 32, b"k" * 32)
    data = np.arange(1000, dtype=np.float32)
    raw = data.tobytes()
    head = struct.pack(">BQ", ord("D"), len(raw))
    for payload in (pa.py_buffer(raw), data, memoryview(raw)):
        ct = bytearray(tx.seal(ord("D"), head, payload))
        rx.open(ord("D"), head, ct)
        assert bytes(ct) == raw
    parts = [pa.py_buffer(raw[:1000]), data[250:500], memoryview(raw)[2000:]]
    ct = bytearray(tx.seal_parts(ord("D"), head, parts, len(raw)))
    rx.open(ord("D"), head, ct)
    assert bytes(ct) == raw
