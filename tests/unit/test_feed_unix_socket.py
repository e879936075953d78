"""The node's Unix-domain data socket: same-host feed tasks connect there, with the same
handshake and tagged frames as over TCP, and fall back to TCP when it is not there."""

from __future__ import annotations

import os
import pickle
import socket
import stat
import tempfile

import pytest

from tfos._common import wire as _wire
from tfos._common.deadline import Deadline
from tfos._data import local_socket as local
from tfos._data.feed_connection import Chunk, PartitionEnd
from tfos._data.feed_hub import FeedHub
from tfos._data.feed_link import Link as _Link
from tfos._data.feed_plan import FeedPlan
from tfos._data.framing import FrameType
from tfos.cluster_template import NodeInfo
from tfos.errors import ControlProtocolError

KEY = _wire.new_key()
OTHER_KEY = _wire.new_key()


@pytest.fixture
def hub():
    h = FeedHub("127.0.0.1", KEY, ("input",), 8, "worker:0 (executor 0, test)")
    yield h
    h.close("main_fun_returned", "test over")


def _node(hub: FeedHub, path: str | None = None) -> NodeInfo:
    node = NodeInfo(0, "worker", 0, "127.0.0.1", 2222, hub.port, os.getpid(), "test/1",
                    hub.path if path is None else path)
    hub.identity = _wire.node_identity(node)  # as the TF process does once it registered
    return node


def _plan(node: NodeInfo, feed_id: str = "feed-unit") -> FeedPlan:
    return FeedPlan("tfos-unit-unix", KEY, "127.0.0.1", 1, (node,), "input", "train", None, feed_timeout_s=20.0, feed_id=feed_id)


def _feed_one(link: _Link, hub: FeedHub) -> list:
    rows = [(i, float(i) * 0.5) for i in range(7)]
    link.send(FrameType.DATA, pickle.dumps(rows))
    link.send(FrameType.END)
    chunk, end = hub.queues["input"].get(timeout=20), hub.queues["input"].get(timeout=20)
    assert isinstance(chunk, Chunk) and isinstance(end, PartitionEnd)
    return pickle.loads(chunk.payload)


def test_hub_listens_in_a_private_directory_and_removes_it(hub):
    assert hub.path and os.path.basename(os.path.dirname(hub.path)).startswith(f"tfos-feed-{local._pid_namespace()}-{os.getpid()}-")
    st = os.stat(os.path.dirname(hub.path))
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
    assert stat.S_ISSOCK(os.stat(hub.path).st_mode)
    hub.close("main_fun_returned", "done")
    assert not os.path.exists(os.path.dirname(hub.path))


def test_same_host_feed_goes_over_the_unix_socket(hub):
    link = _Link(_plan(_node(hub)), _node(hub), 3, 1, 3, local=True)
    try:
        assert link.sock.family == socket.AF_UNIX
        assert link.status == {"state": "ok"}
        assert _feed_one(link, hub) == [(i, float(i) * 0.5) for i in range(7)]
    finally:
        link.close()


def test_remote_node_and_missing_socket_use_tcp(hub, tmp_path):
    for feed, (node, local) in enumerate(((_node(hub), False), (_node(hub, str(tmp_path / "gone")), True))):
        link = _Link(_plan(node, f"feed-{feed}"), node, 0, 0, 0, local=local)  # a new feed: index 0 again
        try:
            assert link.sock.family == socket.AF_INET
            assert link.status == {"state": "ok"}
            assert len(_feed_one(link, hub)) == 7
        finally:
            link.close()


def test_unix_socket_refuses_a_client_without_the_key(hub):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(20)
    s.connect(hub.path)
    with pytest.raises(_wire.DataAuthError, match="refused this feed task's proof"):  # refused on its first bytes
        _wire.client_handshake(s, OTHER_KEY, Deadline(20, "handshake"))
    s.close()
    Deadline(20, "the rejection").wait_for(lambda: hub.rejected >= 1)
    assert hub.queues["input"].empty()


def test_too_long_temp_dir_leaves_tcp_only(tmp_path, monkeypatch):
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    h = FeedHub("127.0.0.1", KEY, ("input",), 8, "worker:1 (executor 1, test)")
    try:
        assert h.path == "" and os.listdir(deep) == []
        assert NodeInfo(1, "worker", 1, "127.0.0.1", 2222, h.port, data_path=h.path).data_path == ""
    finally:
        h.close()


def _dead_pid() -> int:
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_sweep_removes_only_dirs_whose_maker_died(tmp_path):
    ns, dead = local._pid_namespace(), _dead_pid()

    def mk(name: str, sock: bool = True, age_s: float = 0.0):
        d = tmp_path / name
        d.mkdir(mode=0o700)
        if sock:
            (d / "s").write_text("")
        if age_s:
            t = os.path.getmtime(d) - age_s
            os.utime(d, (t, t))
        return d

    stale = mk(f"tfos-feed-{ns}-{dead}-aaaa")
    live = mk(f"tfos-feed-{ns}-{os.getpid()}-bbbb")  # its maker runs: a live node
    other_ns = mk(f"tfos-feed-{ns + 1}-{dead}-cccc")  # another pid namespace: not ours to judge
    starting = mk(f"tfos-feed-{ns}-{dead}-dddd", sock=False)  # no socket yet, recent
    abandoned = mk(f"tfos-feed-{ns}-{dead}-eeee", sock=False, age_s=local.EMPTY_DIR_GRACE_S + 60)
    unrelated = mk(f"tfos-feed-x-{dead}-ffff")
    # Entries anyone can plant with such names (found by an attack review: a pid too large
    # for kill() ended every supervisor on the host with OverflowError).
    (tmp_path / f"tfos-feed-{ns}-99999999999999999999-x").write_text("")
    mk(f"tfos-feed-{ns}-3000000000-gggg")
    mk(f"tfos-feed-{ns}-0-hhhh")
    assert sorted(local.stale_socket_dirs(str(tmp_path))) == sorted([str(stale), str(abandoned)])
    assert local.sweep_stale_socket_dirs(str(tmp_path)) == 2
    assert not stale.exists() and not abandoned.exists()
    assert live.exists() and other_ns.exists() and starting.exists() and unrelated.exists()
    assert len(os.listdir(tmp_path)) == 7  # the planted entries are left alone


def test_without_proc_nothing_is_judged_stale(tmp_path, monkeypatch):
    dead = _dead_pid()
    (tmp_path / f"tfos-feed-0-{dead}-aaaa").mkdir(mode=0o700)
    monkeypatch.setattr(local, "_pid_namespace", lambda: 0)
    assert local.stale_socket_dirs(str(tmp_path)) == []


def test_a_replaced_directory_is_not_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    sd = local.make_socket_dir()
    theirs = tmp_path / "theirs"  # made while sd exists: another inode
    theirs.mkdir(mode=0o700)
    (theirs / "theirs").write_text("")
    os.rmdir(sd.path)
    os.rename(theirs, sd.path)  # someone else's directory at the same path
    assert not local.remove_socket_dir(sd)
    assert os.path.exists(os.path.join(sd.path, "theirs"))


def test_a_listener_that_is_not_the_node_gets_nothing_and_tcp_is_used(hub, tmp_path):
    """Another process of this user bound a socket where the node's was (its directory was
    removed): the task checks the listener's pid before sending anything, and feeds over TCP."""
    import subprocess
    import sys

    path = str(tmp_path / "s")
    code = (
        "import socket, sys\n"
        "s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen(1); print('up', flush=True)\n"
        "c, _ = s.accept(); c.settimeout(20); data = c.recv(1 << 16)\n"
        "print('got', len(data), flush=True)\n"
    )
    squatter = subprocess.Popen([sys.executable, "-c", code, path], stdout=subprocess.PIPE, text=True)
    try:
        assert squatter.stdout.readline().strip() == "up"
        node = _node(hub, path)
        link = _Link(_plan(node), node, 0, 0, 0, local=True)
        try:
            assert link.sock.family == socket.AF_INET
            assert len(_feed_one(link, hub)) == 7
        finally:
            link.close()
        assert squatter.stdout.readline().strip() == "got 0"  # closed without a byte
        assert squatter.wait(20) == 0
    finally:
        if squatter.poll() is None:
            squatter.kill()
            squatter.wait()


def test_peer_check_names_a_foreign_uid(hub, monkeypatch):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(hub.path)
        assert local.peer_is_node(s, os.getpid()) is None
        assert "not the node's TF process (pid 1)" in local.peer_is_node(s, 1)
        monkeypatch.setattr(local.os, "getuid", lambda: 4242)
        assert "not as this user (4242)" in local.peer_is_node(s, os.getpid())
    finally:
        s.close()


@pytest.mark.parametrize("bad", ["relative/s", "/tmp/a\0b", "/" + "x" * 300])
def test_node_record_with_a_bad_socket_path_is_refused(bad):
    rec = NodeInfo(0, "worker", 0, "127.0.0.1", 2222, 3333).to_dict()
    rec["data_path"] = bad
    with pytest.raises(ControlProtocolError, match="data socket path"):
        NodeInfo.from_dict(rec)


def test_tf_process_whose_supervisor_died_removes_its_socket_directory(tmp_path, monkeypatch):
    """Nobody else would: the supervisor, which removes it after a killed TF process, is gone."""
    from tfos._node import tf_process
    from tfos._node.launch import ClusterConfig, NodeLaunch
    from tfos.cluster_template import InputMode, build_template, roles_from_template

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    mine = local.make_socket_dir()
    with socket.socket() as s:  # a port nobody listens on: the driver is gone too
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    roles = roles_from_template(build_template(1, 0))
    cfg = ClusterConfig(cluster_id="tfos-unit-unixdir", key=KEY, driver_host="127.0.0.1", driver_port=port,
                        input_mode=InputMode.SPARK, roles=tuple(roles), forward_logs="none")
    launch = NodeLaunch(config=cfg, role=roles[0], host="127.0.0.1", executor_key="h/1", watch_pid=0,
                        watch_stdin=False, working_dir=str(tmp_path), python_path=(), fn_payload=b"")
    exits: list = []
    monkeypatch.setattr(os, "_exit", exits.append)
    ended: list = []
    # never kill the test's own process tree (its Spark JVM: the session's SparkContext
    # died at the end of a full run when _end_own_tree ran here for real)
    monkeypatch.setattr(tf_process, "_end_own_tree", lambda: ended.append(True))
    tf_process._supervisor_gone(launch, local.SocketDir.adopt(mine.path))
    assert exits == [tf_process.SUPERVISOR_GONE_EXIT] and ended == [True]
    assert not os.path.exists(mine.path)


def test_a_unix_socket_without_the_key_is_named_by_its_path(tmp_path):
    """A same-user process serving a node's socket path without the key answers the
    handshake with a bad proof: the task sends nothing more and the error names the path
    it reached (not the TCP port)."""
    import threading

    from tfos._common.wire import _DATA_MAGIC, _HELLO, _MAC_BYTES, DataAuthError

    path = str(tmp_path / "s")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    got: list = []

    def impostor() -> None:
        conn, _ = srv.accept()
        with conn:
            conn.sendall(_HELLO.pack(_DATA_MAGIC, os.urandom(_HELLO.size - len(_DATA_MAGIC))))
            conn.settimeout(20)
            first = b""
            while len(first) < 52 + _HELLO.size + _MAC_BYTES:  # its proof of the key, nonce and bound proof
                chunk = conn.recv(1 << 16)
                if not chunk:
                    break
                first += chunk
            got.append(first)
            conn.sendall(os.urandom(_MAC_BYTES))
            got.append(conn.recv(1 << 16))  # b"": the task closes, sending nothing else

    t = threading.Thread(target=impostor, daemon=True)
    t.start()
    node = NodeInfo(0, "worker", 0, "127.0.0.1", 2222, 1, os.getpid(), "test/1", path)
    try:
        with pytest.raises(DataAuthError) as ei:
            _Link(_plan(node), node, 0, 0, 0, local=True)
        t.join(20)
        assert ei.value.address == path
        assert len(got[0]) == 52 + _HELLO.size + _MAC_BYTES and got[1] == b""  # proof of the key, then the handshake
    finally:
        srv.close()
