"""Spark's console progress bar is off while a tfos cluster is open (tfos._driver.spark_bar),
against a fake py4j JVM; the real one is exercised by tests/spark/test_quickstart.py."""

from __future__ import annotations

import time

import pytest

from tfos._driver import spark_bar


class Option:
    def __init__(self, value=None):
        self.value = value

    def isDefined(self):
        return self.value is not None

    def get(self):
        assert self.value is not None
        return self.value


class Bar:
    def __init__(self, drew=True):
        self.lastUpdateTime = 1234 if drew else 0
        self.calls = []

    def stop(self):
        self.calls.append("stop")

    def clear(self):
        self.calls.append("clear")


class JSC:
    def __init__(self, bar):
        self._progressBar = Option(bar)
        self.stopped = False

    def progressBar(self):
        return self._progressBar

    def isStopped(self):
        return self.stopped


class Field:
    def __init__(self, name):
        self.name = name

    def setAccessible(self, on):
        assert on

    def get(self, obj):
        return getattr(obj, self.name)

    def set(self, obj, value):
        setattr(obj, self.name, value)


class Err:
    def __init__(self):
        self.text = ""

    def println(self):
        self.text += "\n"

    def flush(self):
        pass


class JVM:
    def __init__(self, refuse=False):
        self.err = Err()
        jvm = self

        class _Class:
            @staticmethod
            def forName(name):
                if refuse:
                    raise RuntimeError("py4j: no such field")
                return type("C", (), {"getDeclaredField": staticmethod(Field)})

        self.java = type("java", (), {"lang": type("lang", (), {"Class": _Class, "System": type("S", (), {"err": jvm.err})})})
        self.scala = type("scala", (), {"Option": type("O", (), {"apply": staticmethod(lambda v: Option(v))}),
                                        "Some": staticmethod(lambda v: Option(v))})
        self.made = []

        def _new_bar(jsc):
            self.made.append(Bar(drew=False))
            return self.made[-1]

        self.org = type("org", (), {"apache": type("a", (), {"spark": type("s", (), {"ui": type("u", (), {
            "ConsoleProgressBar": staticmethod(_new_bar)})})})})


class Conf:
    def __init__(self, on):
        self.on = on

    def get(self, key, default):
        return ("true" if self.on else "false") if key == "spark.ui.showConsoleProgress" else default


class SC:
    def __init__(self, on=True, drew=True, refuse=False):
        self.bar = Bar(drew)
        self._jvm = JVM(refuse)
        self.jsc = JSC(self.bar)
        self._jsc = type("J", (), {"sc": lambda _self: self.jsc})()
        self.conf = Conf(on)

    def getConf(self):
        return self.conf


@pytest.mark.parametrize("tty,drew,newline", [(False, True, True), (True, True, False), (False, False, False)])
def test_the_bar_is_off_while_clusters_are_open_and_back_after_the_last(monkeypatch, tty, drew, newline):
    monkeypatch.setattr(spark_bar, "_stderr_is_terminal", lambda: tty)
    sc = SC(drew=drew)
    assert spark_bar.showing(sc)
    spark_bar.pause(sc)
    spark_bar.pause(sc)  # a second cluster of the same SparkContext
    assert sc.bar.calls == ["stop", "clear"] and not sc.jsc.progressBar().isDefined()
    assert not spark_bar.showing(sc)
    # a frame the bar drew to a file or pipe is ended, so the next line is a line of its own
    assert sc._jvm.err.text == ("\n" if newline else "")
    spark_bar.resume(sc)
    assert not sc.jsc.progressBar().isDefined() and not spark_bar.showing(sc)  # one cluster still open
    spark_bar.resume(sc)
    assert sc.jsc.progressBar().get() is sc._jvm.made[0] and spark_bar.showing(sc)
    spark_bar.resume(sc)  # an extra resume changes nothing
    assert len(sc._jvm.made) == 1


def test_a_bar_that_is_off_in_the_conf_is_left_alone():
    sc = SC(on=False)
    spark_bar.pause(sc)
    assert sc.bar.calls == [] and sc.jsc.progressBar().isDefined() and not spark_bar.showing(sc)
    spark_bar.resume(sc)
    assert sc._jvm.made == []


def test_when_the_jvm_refuses_sparks_bar_stays_and_tfos_shows_none():
    sc = SC(refuse=True)
    spark_bar.pause(sc)
    assert spark_bar.showing(sc)  # tfos's own bar stays off, node lines erase Spark's on a terminal
    spark_bar.resume(sc)
    assert sc._jvm.made == []


def test_a_stopped_context_gets_no_new_bar(monkeypatch):
    monkeypatch.setattr(spark_bar, "_stderr_is_terminal", lambda: True)
    sc = SC()
    spark_bar.pause(sc)
    sc.jsc.stopped = True
    spark_bar.resume(sc)
    assert sc._jvm.made == [] and not sc.jsc.progressBar().isDefined()


def test_a_connect_session_is_left_alone():
    class Connect:
        def getConf(self):
            return Conf(True)

    spark_bar.pause(Connect())  # no _jsc: nothing to stop, no error
    assert spark_bar.showing(Connect())


def test_the_bar_comes_back_only_after_the_clusters_stages_ended(monkeypatch):
    """After a failure the cancelled feed tasks still run: Spark's bar would draw their
    stage and glue its frames to the log lines (`[Stage 5:====(3 + 1) / 4]END`)."""
    monkeypatch.setattr(spark_bar, "_stderr_is_terminal", lambda: False)
    monkeypatch.setattr(spark_bar, "POLL_S", 0.01)
    sc = SC()
    tasks = {"running": True}
    spark_bar.pause(sc)
    spark_bar.resume(sc, lambda: tasks["running"])
    time.sleep(0.2)
    assert not sc.jsc.progressBar().isDefined() and sc._jvm.made == []  # its stage still active
    tasks["running"] = False
    deadline = time.monotonic() + 30
    while not sc.jsc.progressBar().isDefined() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sc.jsc.progressBar().get() is sc._jvm.made[0]


def test_a_new_cluster_or_a_stopped_context_keeps_the_bar_off(monkeypatch):
    monkeypatch.setattr(spark_bar, "_stderr_is_terminal", lambda: False)
    monkeypatch.setattr(spark_bar, "POLL_S", 0.01)
    sc = SC()
    tasks = {"running": True}
    spark_bar.pause(sc)
    spark_bar.resume(sc, lambda: tasks["running"])
    spark_bar.pause(sc)  # the next cluster of the program starts meanwhile
    tasks["running"] = False
    time.sleep(0.2)
    assert sc._jvm.made == [] and not spark_bar.showing(sc)
    spark_bar.resume(sc)
    assert len(sc._jvm.made) == 1
    other = SC()
    spark_bar.pause(other)
    spark_bar.resume(other, lambda: True)
    other.jsc.stopped = True
    time.sleep(0.2)
    assert other._jvm.made == []
