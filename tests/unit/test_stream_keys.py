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
