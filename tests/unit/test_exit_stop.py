"""Interpreter exit stops the local-cluster SparkContexts tfos clusters ran on, so the
JVM's shutdown hooks do not make the Master relaunch executors (tfos._driver.open_clusters)."""

from tfos._driver import open_clusters


class _JSC:
    def __init__(self, stopped):
        self.stopped = stopped

    def isStopped(self):
        return self.stopped


class _SC:
    def __init__(self, master, stopped=False):
        self.master = master
        self.stops = 0
        jsc = _JSC(stopped)
        self._jsc = type("J", (), {"sc": lambda _self: jsc})()

    def stop(self):
        self.stops += 1


def test_local_cluster_contexts_left_running_are_stopped_at_exit(monkeypatch):
    monkeypatch.setattr(open_clusters.OPEN, "contexts", {})
    running, stopped, yarn = _SC("local-cluster[2,1,1024]"), _SC("local-cluster[2,1,1024]", stopped=True), _SC("yarn")
    for sc in (running, stopped, yarn):
        open_clusters.OPEN.note_context(sc)
    open_clusters._teardown_at_exit()
    assert (running.stops, stopped.stops, yarn.stops) == (1, 0, 0)
    open_clusters._teardown_at_exit()  # once
    assert running.stops == 1
