"""Key files of the streaming stop endpoint (tfos.reservation, issue 16): a Client given a
plain (host, port) in another process finds the key only in a file its user alone can read."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tfos import reservation
from tfos.errors import ConfigurationError


@pytest.fixture
def key_dir(tmp_path, monkeypatch):
    d = tmp_path / "keys"
    monkeypatch.setenv("TFOS_KEY_DIR", str(d))
    return d


def test_key_file_mode_and_stop_from_another_process(key_dir, monkeypatch):
    monkeypatch.setenv(reservation.TFOS_SERVER_HOST, "127.0.0.1")
    server = reservation.Server(1)
    addr = server.start()
    try:
        path = reservation.write_key_file(addr)
        assert (os.stat(path).st_mode & 0o777) == 0o600
        assert (os.stat(key_dir).st_mode & 0o777) == 0o700
        assert reservation.read_key_file(addr[0], addr[1]) == (addr.key, addr.server_id)
        code = "import sys; from tfos import reservation; c = reservation.Client((sys.argv[1], int(sys.argv[2]))); c.request_stop(); c.close()"
        subprocess.run([sys.executable, "-c", code, addr[0], str(addr[1])], check=True, timeout=60, env=dict(os.environ))
        assert server.done
    finally:
        server.stop()
        reservation.remove_key_file(addr)
    assert reservation.read_key_file(addr[0], addr[1]) is None


def test_key_file_readable_by_others_is_ignored(key_dir, monkeypatch):
    monkeypatch.setenv(reservation.TFOS_SERVER_HOST, "127.0.0.1")
    server = reservation.Server(1)
    addr = server.start()
    try:
        path = reservation.write_key_file(addr)
        os.chmod(path, 0o644)
        assert reservation.read_key_file(addr[0], addr[1]) is None
    finally:
        server.stop()
        reservation.remove_key_file(addr)


def test_client_without_key_file_is_refused(key_dir):
    with pytest.raises(ConfigurationError, match="no key for reservation server"):
        reservation.Client(("127.0.0.1", 1))


def _addr(port: int = 41235) -> reservation.ServerAddress:
    return reservation.ServerAddress(("127.0.0.1", port), key=b"k" * 32, server_id="sid-1")


def test_planted_files_never_receive_the_key(key_dir, tmp_path):
    """A file, FIFO or symlink another process placed under the names the writer could use
    never gets the key: the key goes to a fresh O_EXCL file renamed into place."""
    key_dir.mkdir(mode=0o700)
    precious = tmp_path / "precious"
    precious.write_text("keep me")
    addr = _addr()
    final = reservation._key_path(addr[0], addr[1])
    os.mkfifo(final + ".tmp")                  # the old fixed temporary name: would block open()
    os.symlink(precious, final)                # the final name points elsewhere
    path = reservation.write_key_file(addr)    # returns (no FIFO open), within the test timeout
    assert path == final and not os.path.islink(path)
    assert precious.read_text() == "keep me"
    assert (os.stat(path).st_mode & 0o777) == 0o600
    assert reservation.read_key_file(addr[0], addr[1]) == (addr.key, addr.server_id)


def test_wide_key_dir_of_this_user_is_narrowed(key_dir):
    key_dir.mkdir()
    os.chmod(key_dir, 0o777)
    reservation.write_key_file(_addr())
    assert (os.stat(key_dir).st_mode & 0o777) == 0o700


def test_key_dir_symlink_is_refused(key_dir, tmp_path):
    real = tmp_path / "elsewhere"
    real.mkdir(mode=0o700)
    os.symlink(real, key_dir)
    with pytest.raises(ConfigurationError, match="not a directory"):
        reservation.write_key_file(_addr())
    assert list(real.iterdir()) == []


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to chown to another user")
def test_key_dir_of_another_user_is_refused_and_its_files_ignored(key_dir):
    key_dir.mkdir(mode=0o700)
    os.chown(key_dir, 65534, 65534)            # nobody
    with pytest.raises(ConfigurationError, match="owned by uid 65534"):
        reservation.write_key_file(_addr())
    os.chown(key_dir, 0, 0)
    addr = _addr()
    path = reservation.write_key_file(addr)
    os.chown(path, 65534, 65534)               # a key file swapped in by another user
    assert reservation.read_key_file(addr[0], addr[1]) is None


def test_fifo_as_key_file_is_ignored_not_waited_on(key_dir):
    key_dir.mkdir(mode=0o700)
    addr = _addr()
    os.mkfifo(reservation._key_path(addr[0], addr[1]), 0o600)
    assert reservation.read_key_file(addr[0], addr[1]) is None


def test_stop_command_without_key_file_says_why_in_one_line(key_dir, capsys):
    from tfos import streaming

    assert streaming.main(["stop", "127.0.0.1", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "tfos.streaming stop 127.0.0.1:1: no key file for 127.0.0.1:1" in err
    assert "already ended" in err


def test_stop_command_stops_a_live_endpoint(key_dir, monkeypatch, capsys):
    from tfos import streaming

    monkeypatch.setenv(reservation.TFOS_SERVER_HOST, "127.0.0.1")
    server = reservation.Server(1)
    addr = server.start()
    try:
        reservation.write_key_file(addr)
        reservation._LOCAL_KEYS.pop((addr[0], addr[1]), None)  # as another process: key file only
        assert streaming.main(["stop", addr[0], str(addr[1])]) == 0
        assert server.done and "stop requested" in capsys.readouterr().err
    finally:
        server.stop()
        reservation.remove_key_file(addr)


def test_a_streaming_cluster_stops_through_its_control_server(key_dir, capsys):
    """The stop endpoint of a streaming cluster is its control server (no second listener):
    a StopRequest message, sent by ``python -m tfos.streaming stop`` or by TFoS's
    ``reservation.Client((host, port)).request_stop()`` from the key file alone, ends
    ``shutdown(ssc)``'s wait; node messages on the same server are unaffected."""
    import types

    from tfos import streaming
    from tfos._common import wire
    from tfos._control.host import ClusterHost
    from tfos._driver.stream_stop import StopEndpoint
    from tfos.cluster_template import build_template, roles_from_template

    key, cid = wire.new_key(), "tfos-unit-stream-stop"
    host = ClusterHost(cid, roles_from_template(build_template(1, 0)), 15.0)
    server = host.serve(key, "127.0.0.1")
    try:
        backend = types.SimpleNamespace(server=server, config=types.SimpleNamespace(key=key, cluster_id=cid),
                                        runtime=types.SimpleNamespace(host=host))
        endpoint = StopEndpoint(backend)
        assert endpoint.address == ("127.0.0.1", server.port) and not endpoint.requested
        assert streaming.main(["stop", "127.0.0.1", str(server.port)]) == 0
        assert endpoint.requested and "stop requested" in capsys.readouterr().err
        endpoint2 = StopEndpoint(backend)  # TFoS's client, given a plain (host, port)
        c = reservation.Client(("127.0.0.1", server.port))
        assert c.request_stop() == "OK" and endpoint2.requested
        c.close()
        endpoint.close()
        assert reservation.read_key_file("127.0.0.1", server.port) is None
    finally:
        host.close()
