"""A PSS worker's ``server.join()`` (TensorFlow's tutorial) serves until the cluster stops."""

from __future__ import annotations

import threading
import types

import pytest

from tfos._node import ps_serving

SPEC = {"ps": ["h:1"], "chief": ["h:2"], "worker": ["h:3", "h:4"]}


class _Ctx:
    def __init__(self, job="worker", spec=SPEC, mgr=None):
        self.job_name, self.task_index, self.cluster_spec, self.mgr = job, 0, spec, mgr
        self.stop_event = threading.Event()
        self.served = 0

    def on_serving(self):
        self.served += 1
        self.stop_event.set()  # the driver's stop, at once


def _fake_server_module():
    class Server:
        joined = 0

        def join(self):
            Server.joined += 1

    return types.SimpleNamespace(Server=Server)


@pytest.fixture(autouse=True)
def _clean():
    yield
    ps_serving._CTX.clear()


def test_a_workers_join_reports_serving_and_returns_at_the_stop():
    ctx, module = _Ctx(), _fake_server_module()
    assert ps_serving.install(ctx)
    ps_serving._patch(module)
    module.Server().join()
    assert ctx.served == 1 and module.Server.joined == 0


def test_ps_nodes_and_clusters_without_a_chief_keep_tensorflows_join():
    assert not ps_serving.install(_Ctx(job="ps"))
    assert not ps_serving.install(_Ctx(spec={"ps": ["h:1"], "worker": ["h:3"]}))
    module = _fake_server_module()
    ps_serving._patch(module)
    module.Server().join()  # nothing installed: TensorFlow's join
    assert module.Server.joined == 1


def test_a_fed_worker_serves_its_feed_to_the_coordinators_datasets(monkeypatch):
    """InputMode.SPARK: a fed worker's join() registers its feed reader (tfos._node.ps_feed)
    before it reports serving."""
    from tfos._node import ps_feed

    order = []
    monkeypatch.setattr(ps_feed, "serve", lambda ctx: order.append(("feed", ctx.job_name)) or True)
    ctx, module = _Ctx(mgr=object()), _fake_server_module()
    ctx.on_serving = lambda: (order.append(("serving",)), ctx.stop_event.set())
    ps_serving.install(ctx)
    ps_serving._patch(module)
    module.Server().join()
    assert order == [("feed", "worker"), ("serving",)] and module.Server.joined == 0
