"""tfos chains its teardown to SIGTERM only where nobody else handles it (issue 10, C23)."""

from __future__ import annotations

import signal
import threading

import pytest

import tfos._cluster_runtime as cl


@pytest.fixture
def default_sigterm():
    old = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    cl._sigterm_installed = False
    yield
    signal.signal(signal.SIGTERM, old)
    cl._sigterm_installed = False


class _FakeCluster:
    cluster_id = "tfos-fake"


def test_installed_only_over_the_default_and_removed_with_the_last_cluster(default_sigterm):
    fake = _FakeCluster()
    cl._open_clusters.add(fake)  # type: ignore[arg-type]
    cl.install_sigterm(True)
    assert signal.getsignal(signal.SIGTERM) is cl._on_sigterm
    with pytest.raises(SystemExit) as ei:
        cl._on_sigterm(signal.SIGTERM, None)
    assert ei.value.code == 143
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # a second SIGTERM ends the driver at once
    cl.install_sigterm(True)
    cl._forget(fake)  # type: ignore[arg-type]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_user_handler_is_never_replaced(default_sigterm):
    def mine(signum, frame):
        pass

    signal.signal(signal.SIGTERM, mine)
    cl.install_sigterm(True)
    assert signal.getsignal(signal.SIGTERM) is mine


def test_not_installed_when_disabled_or_off_the_main_thread(default_sigterm):
    cl.install_sigterm(False)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    t = threading.Thread(target=cl.install_sigterm, args=(True,))
    t.start()
    t.join()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
