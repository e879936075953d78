"""Unit tests of tfos._common.wire framing and the control server/client over loopback (C20).

No Spark, no TensorFlow: a real ControlServer with a small dispatch function, real
ControlClients, and raw sockets playing hostile peers.
"""

from __future__ import annotations

import base64
import json
import logging
import socket
import struct
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tfos._control.server as cs_mod
from tfos._common import wire as _wire
from tfos._control.client import ControlClient
from tfos._control.protocol import REFUSED, client_proof
from tfos._control.server import ControlServer, parse_port_spec
from tfos._common.deadline import Deadline
from tfos._data.feed_plan import FeedPlan
from tfos._node.launch import ClusterConfig, NodeLaunch
from tfos.cluster_template import InputMode, NodeInfo, NodeRole
from tfos.errors import ConfigurationError, ControlProtocolError, DeadlineExceededError

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
CID = "tfos-unit-c20"


def _key_forms(key: bytes) -> list[str]:
    return [key.hex(), key.hex().upper(), repr(key), str(key), base64.b64encode(key).decode()]


# =============================================================== _wire (pure)
def _split(frame: bytes) -> tuple[bytes, bytes, bytes]:
    return frame[:8], frame[8:40], frame[40:]


def test_encode_decode_roundtrip():
    body = {"type": "register", "n": 3, "s": "héllo ✓", "l": [1, 2.5, None], "d": {"a": True}}
    frame = _wire.encode_frame(KEY, body)
    assert frame[:4] == _wire.MAGIC == b"TFO1"
    header, mac, payload = _split(frame)
    assert struct.unpack(">I", header[4:])[0] == len(payload)
    assert _wire.decode_frame(KEY, header, mac, payload) == body


def test_tampered_body_byte_rejected():
    header, mac, payload = _split(_wire.encode_frame(KEY, {"type": "heartbeat", "executor_id": 1}))
    for i in range(len(payload)):
        bad = bytearray(payload)
        bad[i] ^= 0x01
        with pytest.raises(ControlProtocolError, match=r"frame authentication failed \(wrong key or tampered frame\)"):
            _wire.decode_frame(KEY, header, mac, bytes(bad))


def test_tampered_mac_or_length_rejected():
    header, mac, payload = _split(_wire.encode_frame(KEY, {"a": 1}))
    with pytest.raises(ControlProtocolError, match="frame authentication failed"):
        _wire.decode_frame(KEY, header, bytes([mac[0] ^ 0x80]) + mac[1:], payload)
    longer = header[:4] + struct.pack(">I", len(payload) + 1)
    with pytest.raises(ControlProtocolError, match="frame authentication failed"):
        _wire.decode_frame(KEY, longer, mac, payload + b" ")


def test_wrong_key_rejected():
    header, mac, payload = _split(_wire.encode_frame(OTHER_KEY, {"type": "register"}))
    with pytest.raises(ControlProtocolError) as ei:
        _wire.decode_frame(KEY, header, mac, payload)
    assert "wrong key" in str(ei.value)
    for form in _key_forms(KEY) + _key_forms(OTHER_KEY):
        assert form not in str(ei.value)


def test_bad_magic_rejected():
    header, mac, payload = _split(_wire.encode_frame(KEY, {"a": 1}))
    with pytest.raises(ControlProtocolError, match="bad frame magic: not a tfos control frame"):
        _wire.decode_frame(KEY, b"HTTP" + header[4:], mac, payload)


def test_non_json_body_with_valid_mac():
    import hashlib
    import hmac

    for payload, text in ((b"\xff\xfe not utf8", "not valid JSON"), (b"{not json", "not valid JSON"),
                          (b"[1, 2]", "not a JSON object"), (b'"str"', "not a JSON object")):
        length = struct.pack(">I", len(payload))
        mac = hmac.new(KEY, length + payload, hashlib.sha256).digest()
        with pytest.raises(ControlProtocolError, match=text):
            _wire.decode_frame(KEY, _wire.MAGIC + length, mac, payload)


def test_encode_refuses_oversize_and_non_json():
    with pytest.raises(ControlProtocolError, match=r"exceeds the cap of 1048576 bytes"):
        _wire.encode_frame(KEY, {"x": "a" * _wire.MAX_CONTROL_FRAME_BYTES})
    with pytest.raises(TypeError):
        _wire.encode_frame(KEY, {"x": object()})
    with pytest.raises(ValueError):
        _wire.encode_frame(KEY, {"x": float("nan")})


def test_read_frame_over_socketpair():
    a, b = socket.socketpair()
    with a, b:
        frame = _wire.encode_frame(KEY, {"type": "x", "v": 1})
        a.sendall(frame + frame)
        assert _wire.read_frame(b, KEY, Deadline(5), 5) == {"type": "x", "v": 1}
        assert _wire.read_frame(b, KEY, Deadline(5), 5) == {"type": "x", "v": 1}


def test_oversize_length_refused_before_reading_body():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(_wire.MAGIC + struct.pack(">I", 1001) + b"NEXT")
        t0 = time.monotonic()
        with pytest.raises(ControlProtocolError, match=r"frame length prefix 1001 exceeds the cap of 1000 bytes"):
            _wire.read_frame(b, KEY, Deadline(30), 30, max_bytes=1000)
        assert time.monotonic() - t0 < 10  # did not wait for a body that never comes
        # neither the MAC nor the body was read: the following bytes are still on the socket
        b.settimeout(5)
        assert b.recv(16) == b"NEXT"


def test_oversize_default_cap():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(_wire.MAGIC + struct.pack(">I", 0xFFFFFFFF))
        with pytest.raises(ControlProtocolError, match=r"frame length prefix 4294967295 exceeds the cap of 1048576"):
            _wire.read_frame(b, KEY, Deadline(30), 30)


def test_read_frame_bad_magic_and_truncation():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"GET / HTTP/1.1\r\n")
        with pytest.raises(ControlProtocolError, match="bad frame magic"):
            _wire.read_frame(b, KEY, Deadline(5), 5)
    a, b = socket.socketpair()
    with a, b:
        a.sendall(_wire.encode_frame(KEY, {"a": 1})[:-3])
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(_wire.TruncatedFrameError, match="truncated frame"):
            _wire.read_frame(b, KEY, Deadline(5), 5)
    a, b = socket.socketpair()
    with a, b:
        a.shutdown(socket.SHUT_WR)  # a clean close at a frame boundary is not a truncation
        with pytest.raises(ConnectionError) as ei:
            _wire.read_frame(b, KEY, Deadline(5), 5)
        assert not isinstance(ei.value, _wire.TruncatedFrameError)


def test_read_frame_stalled_rest_of_frame():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"T")
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceededError, match=r"the rest of a control frame; received 0 of 7 bytes"):
            _wire.read_frame(b, KEY, Deadline(30), 0.3)
        assert time.monotonic() - t0 < 10


def _challenge(server_key: bytes, client_key: bytes):
    a, b = socket.socketpair()
    result = {}

    def client():
        try:
            _wire.client_handshake(b, client_key, Deadline(10))
            result["client"] = "ok"
        except Exception as exc:  # noqa: BLE001
            result["client"] = exc

    t = threading.Thread(target=client)
    t.start()
    try:
        _wire.server_handshake(a, server_key, Deadline(10))
        result["server"] = "ok"
    except Exception as exc:  # noqa: BLE001
        result["server"] = exc
    a.close()
    t.join(10)
    b.close()
    return result


def test_challenge_response_right_key():
    assert _challenge(KEY, KEY) == {"server": "ok", "client": "ok"}


def test_challenge_response_wrong_key():
    r = _challenge(KEY, OTHER_KEY)
    assert isinstance(r["server"], ControlProtocolError)
    assert str(r["server"]).startswith("data connection authentication failed: its proof of the cluster key failed")
    # the server refused the first bytes, before its hello: the client says so at once
    assert isinstance(r["client"], _wire.DataAuthError) and "refused this feed task's proof" in str(r["client"])


def test_challenge_silent_peer_times_out():
    a, b = socket.socketpair()
    with a, b:
        with pytest.raises(DeadlineExceededError, match="received 0 of 52 bytes"):
            _wire.server_handshake(a, KEY, Deadline(0.3, "the handshake"))


# ==================================================================== server
def _dispatch_factory(calls: list):
    def dispatch(body: dict, peer: str) -> dict:
        calls.append(body)
        if body.get("cluster") != CID:
            raise ControlProtocolError("frame is for another cluster")
        if body.get("type") == "bad":
            raise ControlProtocolError("bad request type")
        return {"echo": body.get("x"), "ok": True}

    return dispatch


@pytest.fixture
def server(monkeypatch, caplog):
    monkeypatch.delenv("TFOS_SERVER_HOST", raising=False)
    monkeypatch.delenv("TFOS_SERVER_PORT", raising=False)
    caplog.set_level(logging.DEBUG, logger="tfos")
    calls: list = []
    srv = ControlServer(KEY, _dispatch_factory(calls), "127.0.0.1")
    srv.calls = calls
    yield srv
    srv.close()
    for form in _key_forms(KEY):
        assert form not in caplog.text


def _raw(srv: ControlServer) -> tuple[socket.socket, str]:
    s = socket.create_connection((srv.host, srv.port), timeout=20)
    s.sendall(client_proof(KEY))  # a key holder's first bytes
    hello = _wire.read_frame(s, KEY, Deadline(20), 20)
    assert hello["type"] == "hello"
    return s, hello["sn"]


CN = "c" * 32  # a client nonce (16 bytes, hex)


def _frame(sn: str, seq: int, key: bytes = KEY, **fields) -> bytes:
    body = {"type": "ping", "cluster": CID, "sn": sn, "cn": CN, "seq": seq}
    body.update(fields)
    return _wire.encode_frame(key, body)


def _closed_by_server(s: socket.socket, timeout: float = 20.0) -> bool:
    s.settimeout(timeout)
    try:
        while True:
            if not s.recv(65536):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False
    finally:
        s.close()


def _wait_rejected(srv: ControlServer, n: int) -> None:
    Deadline(20, f"{n} rejected connections").wait_for(lambda: srv.rejected >= n, extra=lambda: f"rejected={srv.rejected}")
    time.sleep(0.05)
    assert srv.rejected == n


def _legit_roundtrip(srv: ControlServer, x: int = 7) -> None:
    c = ControlClient(srv.host, srv.port, KEY, CID, connect_timeout_s=20)
    try:
        assert _send(c, "ping", x=x)["echo"] == x
    finally:
        c.close()


def test_parse_port_spec():
    assert parse_port_spec("") == [0]
    assert parse_port_spec(None) == [0]
    assert parse_port_spec("9000") == [9000]
    assert parse_port_spec("9000-9002") == [9000, 9001, 9002]
    with pytest.raises(ConfigurationError, match="must be a port or a range like 9000-9010, got 'abc'"):
        parse_port_spec("abc")
    with pytest.raises(ConfigurationError, match="out of 1-65535"):
        parse_port_spec("9002-9000")
    with pytest.raises(ConfigurationError, match="out of 1-65535"):
        parse_port_spec("0")


def test_bind_failure_message(monkeypatch):
    monkeypatch.delenv("TFOS_SERVER_HOST", raising=False)
    monkeypatch.delenv("TFOS_SERVER_PORT", raising=False)
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    try:
        with pytest.raises(ConfigurationError) as ei:
            ControlServer(KEY, lambda b, p: {}, "127.0.0.1", str(port))
        assert f"cannot bind the tfos control server on 127.0.0.1 ports {port}-{port}" in str(ei.value)
        assert "TFOS_SERVER_HOST / TFOS_SERVER_PORT" in str(ei.value)
    finally:
        busy.close()


def test_env_overrides_host(monkeypatch):
    monkeypatch.setenv("TFOS_SERVER_HOST", "127.0.0.1")
    monkeypatch.delenv("TFOS_SERVER_PORT", raising=False)
    srv = ControlServer(KEY, lambda b, p: {"ok": 1}, "no-such-host.invalid")
    try:
        assert srv.host == "127.0.0.1" and srv.port > 0
    finally:
        srv.close()
        srv.close()  # idempotent


def test_request_response(server):
    c = ControlClient(server.host, server.port, KEY, CID, connect_timeout_s=20)
    try:
        r1 = _send(c, "ping", x=5)
        r2 = _send(c, "ping", x=6, extra=[1, 2])
    finally:
        c.close()
    assert r1["echo"] == 5 and r1["re"] == 1 and r1["ok"] is True
    assert r2["echo"] == 6 and r2["re"] == 2 and r2["sn"] == r1["sn"]
    assert [b["seq"] for b in server.calls] == [1, 2]
    assert server.calls[1]["extra"] == [1, 2]
    assert all(b["cluster"] == CID and b["type"] == "ping" for b in server.calls)
    assert server.rejected == 0


def test_many_concurrent_clients(server):
    errors = []

    def worker(i):
        try:
            c = ControlClient(server.host, server.port, KEY, CID, connect_timeout_s=20)
            for j in range(5):
                assert _send(c, "ping", x=i * 100 + j)["echo"] == i * 100 + j
            c.close()
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert len(server.calls) == 40
    assert server.rejected == 0


def test_garbage_bytes_rejected(server):
    s, _ = _raw(server)
    s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert _closed_by_server(s)
    _wait_rejected(server, 1)
    assert server.calls == []
    _legit_roundtrip(server)
    assert server.rejected == 1


def test_garbage_without_reading_hello(server):
    s = socket.create_connection((server.host, server.port), timeout=20)
    s.sendall(b"\x00" * 64)
    assert _closed_by_server(s)
    _wait_rejected(server, 1)
    _legit_roundtrip(server)


def test_truncated_frame_rejected(server):
    s, sn = _raw(server)
    frame = _frame(sn, 1)
    s.sendall(frame[: len(frame) // 2])
    s.shutdown(socket.SHUT_WR)
    assert _closed_by_server(s)
    _wait_rejected(server, 1)
    s, sn = _raw(server)
    s.sendall(frame[:5])  # inside the header
    s.shutdown(socket.SHUT_WR)
    assert _closed_by_server(s)
    _wait_rejected(server, 2)
    assert server.calls == []
    _legit_roundtrip(server)


def test_clean_disconnect_is_not_a_rejection(server):
    s, sn = _raw(server)
    s.sendall(_frame(sn, 1, x=1))
    assert _wire.read_frame(s, KEY, Deadline(20), 20)["echo"] == 1
    s.shutdown(socket.SHUT_WR)
    assert _closed_by_server(s)
    time.sleep(0.2)
    assert server.rejected == 0


def test_wrong_key_frame_rejected(server):
    # a stranger without the key gets no hello (no server nonce): its proof is refused first
    s = socket.create_connection((server.host, server.port), timeout=20)
    s.sendall(client_proof(OTHER_KEY))
    assert s.recv(len(REFUSED), socket.MSG_WAITALL) == REFUSED
    assert _closed_by_server(s)
    _wait_rejected(server, 1)
    # a key holder's proof captured on the wire and replayed is refused (its nonce was seen)
    proof = client_proof(KEY)
    first = socket.create_connection((server.host, server.port), timeout=20)
    first.sendall(proof)
    assert _wire.read_frame(first, KEY, Deadline(20), 20)["type"] == "hello"
    replay = socket.create_connection((server.host, server.port), timeout=20)
    replay.sendall(proof)
    assert replay.recv(len(REFUSED), socket.MSG_WAITALL) == REFUSED
    assert _closed_by_server(replay)
    _wait_rejected(server, 2)
    first.close()
    assert server.calls == []
    _legit_roundtrip(server)


def test_wrong_key_client_fails_fast_and_frees_connection(server, monkeypatch):
    monkeypatch.setattr(cs_mod, "FIRST_FRAME_TIMEOUT_S", 120.0)
    c = ControlClient(server.host, server.port, OTHER_KEY, CID, connect_timeout_s=20)
    with pytest.raises(ControlProtocolError, match="frame authentication failed") as ei:
        _send(c, "ping")
    for form in _key_forms(KEY) + _key_forms(OTHER_KEY):
        assert form not in str(ei.value)
    # the failed attempt's socket is closed at once, not left for the server's timeout
    Deadline(20, "the server to drop the connection").wait_for(lambda: server.active_connections == 0)
    assert server.calls == []


def test_oversize_length_prefix_rejected_without_waiting(server, monkeypatch):
    monkeypatch.setattr(cs_mod, "FRAME_TIMEOUT_S", 120.0)
    s, _ = _raw(server)
    t0 = time.monotonic()
    s.sendall(_wire.MAGIC + struct.pack(">I", _wire.MAX_CONTROL_FRAME_BYTES + 1))
    assert _closed_by_server(s, timeout=60)
    assert time.monotonic() - t0 < 30  # refused on the prefix, not after a 120 s wait for the body
    _wait_rejected(server, 1)
    _legit_roundtrip(server)


def test_replayed_frame_rejected_on_new_and_same_connection(server, caplog):
    a, sn_a = _raw(server)
    captured = _frame(sn_a, 1, x=42)
    a.sendall(captured)
    resp = _wire.read_frame(a, KEY, Deadline(20), 20)
    assert resp["echo"] == 42 and resp["re"] == 1
    assert len(server.calls) == 1

    # the same bytes on a new connection: its nonce differs
    b, sn_b = _raw(server)
    assert sn_b != sn_a
    b.sendall(captured)
    assert _closed_by_server(b)
    _wait_rejected(server, 1)

    # the same bytes again on the original connection: the sequence number is stale
    a.sendall(captured)
    assert _closed_by_server(a)
    _wait_rejected(server, 2)
    assert len(server.calls) == 1
    msgs = [r.getMessage() for r in caplog.records if r.name == "tfos._control.loop" and r.levelno == logging.WARNING]
    assert sum("replayed or out-of-order frame" in m for m in msgs) == 2
    assert "(2 rejected so far)" in msgs[-1]
    _legit_roundtrip(server)


def test_out_of_order_and_forged_nonce_rejected(server):
    s, sn = _raw(server)
    s.sendall(_frame(sn, 2))
    assert _closed_by_server(s)
    s, sn = _raw(server)
    s.sendall(_frame("0" * 32, 1))
    assert _closed_by_server(s)
    s, sn = _raw(server)
    s.sendall(_frame(sn, 1)[:0] + _wire.encode_frame(KEY, {"type": "ping", "cluster": CID, "sn": sn}))
    assert _closed_by_server(s)
    _wait_rejected(server, 3)
    assert server.calls == []
    _legit_roundtrip(server)


def test_dispatch_error_drops_peer_and_client_recovers(server):
    c = ControlClient(server.host, server.port, KEY, CID, connect_timeout_s=20)
    try:
        with pytest.raises(ConnectionError):
            _send(c, "bad", retry=False)
        _wait_rejected(server, 1)
        assert _send(c, "ping", x=3)["echo"] == 3  # reconnects with a fresh nonce
        assert _send(c, "ping", x=4)["re"] == 2
    finally:
        c.close()


def test_foreign_cluster_frame_rejected(server):
    c = ControlClient(server.host, server.port, KEY, "another-cluster", connect_timeout_s=20)
    try:
        with pytest.raises(ConnectionError):
            _send(c, "ping", retry=False)
    finally:
        c.close()
    _wait_rejected(server, 1)
    _legit_roundtrip(server)


def test_silent_connection_cut_off(server, monkeypatch):
    monkeypatch.setattr(cs_mod, "FIRST_FRAME_TIMEOUT_S", 0.5)
    s, _ = _raw(server)
    t0 = time.monotonic()
    assert _closed_by_server(s, timeout=30)
    assert time.monotonic() - t0 < 25
    _wait_rejected(server, 1)
    _legit_roundtrip(server)


def test_slow_loris_one_byte_then_stall(server, monkeypatch):
    monkeypatch.setattr(cs_mod, "FIRST_FRAME_TIMEOUT_S", 60.0)
    monkeypatch.setattr(cs_mod, "FRAME_TIMEOUT_S", 0.5)
    s, _ = _raw(server)
    t0 = time.monotonic()
    s.sendall(b"T")
    assert _closed_by_server(s, timeout=30)
    assert time.monotonic() - t0 < 25
    _wait_rejected(server, 1)
    assert server.calls == []
    _legit_roundtrip(server)


def test_slow_loris_trickle_cut_off(server, monkeypatch):
    monkeypatch.setattr(cs_mod, "FRAME_TIMEOUT_S", 1.0)
    s, sn = _raw(server)
    frame = _frame(sn, 1)
    t0 = time.monotonic()
    cut = False
    for i in range(len(frame)):  # one byte every 0.2 s: the whole frame would take ~30 s
        try:
            s.sendall(frame[i : i + 1])
        except OSError:
            cut = True
            break
        try:
            r = s.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK) if _readable(s) else None
        except OSError:
            r = b""
        if r == b"":
            cut = True
            break
        time.sleep(0.2)
    assert cut
    assert time.monotonic() - t0 < 25
    s.close()
    _wait_rejected(server, 1)
    assert server.calls == []
    _legit_roundtrip(server)


def _readable(s: socket.socket) -> bool:
    import select

    r, _, _ = select.select([s], [], [], 0)
    return bool(r)


def test_slow_loris_after_legit_frame_cut_off(server, monkeypatch):
    monkeypatch.setattr(cs_mod, "FRAME_TIMEOUT_S", 0.5)
    s, sn = _raw(server)
    s.sendall(_frame(sn, 1, x=1))
    assert _wire.read_frame(s, KEY, Deadline(20), 20)["echo"] == 1
    s.sendall(_frame(sn, 2)[:3])
    assert _closed_by_server(s, timeout=30)
    assert len(server.calls) == 1


def test_close_drops_open_connections(monkeypatch):
    monkeypatch.delenv("TFOS_SERVER_HOST", raising=False)
    monkeypatch.delenv("TFOS_SERVER_PORT", raising=False)
    srv = ControlServer(KEY, lambda b, p: {"ok": True}, "127.0.0.1")
    c = ControlClient(srv.host, srv.port, KEY, CID, connect_timeout_s=20)
    assert _send(c, "ping")["ok"] is True
    Deadline(20).wait_for(lambda: srv.active_connections == 1)
    t0 = time.monotonic()
    srv.close(timeout_s=10)
    assert time.monotonic() - t0 < 15
    assert srv.active_connections == 0 and srv.rejected == 0
    with pytest.raises(ConnectionError):  # refused at once: 1 s of reconnecting (not the 20 s allowed above)
        _send(c, "ping", retry=False, connect_timeout_s=1.0)
    c.close()


def test_client_unreachable_driver():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there
    c = ControlClient("127.0.0.1", port, KEY, CID, connect_timeout_s=0.6)
    t0 = time.monotonic()
    with pytest.raises(ConnectionError) as ei:
        _send(c, "ping")
    assert time.monotonic() - t0 < 20
    assert f"a connection to the tfos driver at 127.0.0.1:{port}" in str(ei.value)
    assert "TFOS_SERVER_HOST/TFOS_SERVER_PORT" in str(ei.value)


# ====================================================================== fuzz
_payloads = st.one_of(
    st.binary(max_size=200),
    st.binary(max_size=120).map(lambda b: _wire.MAGIC + b),
    st.tuples(st.integers(0, 2**32 - 1), st.binary(max_size=80)).map(
        lambda t: _wire.MAGIC + struct.pack(">I", t[0]) + t[1]
    ),
)


def test_fuzz_random_bytes_never_dispatch(monkeypatch, caplog):
    monkeypatch.delenv("TFOS_SERVER_HOST", raising=False)
    monkeypatch.delenv("TFOS_SERVER_PORT", raising=False)
    monkeypatch.setattr(cs_mod, "FRAME_TIMEOUT_S", 2.0)
    caplog.set_level(logging.DEBUG, logger="tfos")
    calls: list = []
    srv = ControlServer(KEY, _dispatch_factory(calls), "127.0.0.1")
    try:

        @settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
        @given(data=_payloads, read_hello=st.booleans())
        def fuzz(data: bytes, read_hello: bool) -> None:
            before = srv.rejected
            s = socket.create_connection((srv.host, srv.port), timeout=20)
            if read_hello:  # a key holder's connection: its proof, the hello, then the fuzz
                s.sendall(client_proof(KEY))
                _wire.read_frame(s, KEY, Deadline(20), 20)
            try:
                s.sendall(data)
                s.shutdown(socket.SHUT_WR)
            except OSError:
                pass  # the server may already have refused a bad prefix
            assert _closed_by_server(s, timeout=30)
            # every non-empty input is an invalid frame, rejected exactly once; an empty one is a clean close
            want = before + (1 if data else 0)
            Deadline(20, "the rejection count").wait_for(lambda: srv.rejected >= want)
            assert srv.rejected == want
            assert calls == []

        fuzz()
        _legit_roundtrip(srv, x=99)
        assert [b["x"] for b in calls] == [99]
        Deadline(20).wait_for(lambda: srv.active_connections == 0)
    finally:
        srv.close()
    for form in _key_forms(KEY):
        assert form not in caplog.text


# ====================================================================== reprs
def test_key_not_in_reprs():
    roles = (NodeRole(0, "worker", 0),)
    cfg = ClusterConfig(cluster_id=CID, key=KEY, driver_host="127.0.0.1", driver_port=5000, input_mode=InputMode.SPARK, roles=roles)
    launch = NodeLaunch(cfg, roles[0], "127.0.0.1", "127.0.0.1/1", 0, False, "/tmp", ("/x",), b"\x80\x05secretpayload")
    plan = FeedPlan(CID, KEY, "127.0.0.1", 5000, (NodeInfo(0, "worker", 0, "127.0.0.1", 2000, 3000),))
    client = ControlClient("127.0.0.1", 5000, KEY, CID)
    for obj in (cfg, launch, plan, client):
        text = repr(obj) + str(obj)
        for form in _key_forms(KEY):
            assert form not in text, type(obj).__name__
        assert "key=" not in text.replace("executor_key=", "")
    assert "secretpayload" not in repr(launch)
    assert repr(client) == f"ControlClient(driver=127.0.0.1:5000, cluster={CID})"
    assert "cluster_id='tfos-unit-c20'" in repr(cfg)
