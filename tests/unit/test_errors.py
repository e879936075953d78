"""Unit tests of tfos.errors: hierarchy, pickling, failure grouping (pure)."""

from __future__ import annotations

import pickle
import re

import pytest

from tfos import errors
from tfos.errors import (
    ClusterFailedError,
    ConfigurationError,
    ControlProtocolError,
    DeadlineExceededError,
    FeedAbortedError,
    FeedError,
    FeedTimeoutError,
    InferenceResultError,
    MalformedRowError,
    NodeFailedError,
    NodeFailure,
    ReservationTimeoutError,
    TFOSError,
)

TB = 'Traceback (most recent call last):\n  File "main.py", line 3, in main_fun\n    raise ValueError("bad lr")\nValueError: bad lr\n'


def _failure(eid: int, job: str = "worker", idx: int = 0, host: str = "10.0.0.7", kind: str = "exception",
             etype: str = "ValueError", msg: str = "bad lr", tb: str = TB) -> NodeFailure:
    return NodeFailure(eid, job, idx, host, kind, etype, msg, tb)


SIMPLE = [
    TFOSError,
    ConfigurationError,
    ReservationTimeoutError,
    DeadlineExceededError,
    FeedTimeoutError,
    ControlProtocolError,
    MalformedRowError,
    InferenceResultError,
    FeedError,
    FeedAbortedError,
    errors.TFServerError,
    errors.PortUnavailableError,
    errors.ProtocolUnavailableError,
]


@pytest.mark.parametrize("cls", SIMPLE, ids=lambda c: c.__name__)
def test_simple_errors_pickle_with_message(cls):
    err = cls("partition 3 of worker:1 (executor 1, host h): something broke")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is cls
    assert str(back) == "partition 3 of worker:1 (executor 1, host h): something broke"
    assert isinstance(back, TFOSError)


def test_every_exported_error_is_covered():
    exported = {getattr(errors, n) for n in errors.__all__ if isinstance(getattr(errors, n), type) and issubclass(getattr(errors, n), BaseException)}
    assert exported == set(SIMPLE) | {NodeFailedError, ClusterFailedError, errors.RecoveryFailedError}  # FeedError is public too


def test_hierarchy_builtin_bases():
    assert issubclass(ConfigurationError, ValueError)
    assert issubclass(MalformedRowError, ValueError)
    assert issubclass(InferenceResultError, ValueError)
    for cls in (ReservationTimeoutError, DeadlineExceededError, FeedTimeoutError):
        assert issubclass(cls, TimeoutError)
    assert not issubclass(ControlProtocolError, ValueError)


def test_node_failure_name_and_dict_roundtrip():
    f = _failure(2, idx=1)
    assert f.node_name == "worker:1 (executor 2, host 10.0.0.7)"
    assert NodeFailure.from_dict(f.to_dict()) == f
    assert _failure(0, host="").node_name == "worker:0 (executor 0, host unknown host)"
    with pytest.raises(ControlProtocolError, match="malformed node failure report"):
        NodeFailure.from_dict({"executor_id": 1, "job_name": "worker"})
    with pytest.raises(ControlProtocolError, match="malformed node failure report"):
        NodeFailure.from_dict(dict(f.to_dict(), executor_id="one"))


def test_node_failed_error_pickles_and_names_node():
    err = NodeFailedError(_failure(1, idx=0, msg="loss is NaN", etype="FloatingPointError"))
    back = pickle.loads(pickle.dumps(err))
    assert back.failure == err.failure
    text = str(back)
    assert text.startswith("worker:0 (executor 1, host 10.0.0.7): FloatingPointError: loss is NaN\n")
    assert 'raise ValueError("bad lr")' in text


def test_cluster_failed_error_groups_identical_failures():
    f1 = _failure(1, idx=0, host="hostA")
    f2 = _failure(2, idx=1, host="hostB", tb=TB.replace("line 3", "line 4"))
    f3 = _failure(0, job="ps", idx=0, host="hostA", kind="exited", etype="ProcessDied",
                  msg="the TF process died (killed by SIGKILL) before main_fun returned", tb="")
    err = ClusterFailedError("tfos-abc", [f1, f2, f3], "train()")
    text = str(err)
    lines = text.splitlines()
    assert lines[0] == "tfos cluster tfos-abc failed during train(): 3 node(s) reported 2 distinct error(s)"
    assert lines[1] == (
        "- [exception] worker:0 (executor 1, host hostA), worker:1 (executor 2, host hostB): ValueError: bad lr"
    )
    # the first traceback of the group is included, indented; the second one is not
    assert "    Traceback (most recent call last):" in lines
    assert '      File "main.py", line 3, in main_fun' in lines
    assert "line 4" not in text
    assert lines[-1] == (
        "- [exited] ps:0 (executor 0, host hostA): ProcessDied: the TF process died (killed by SIGKILL) "
        "before main_fun returned"
    )
    assert sum(1 for ln in lines if ln.startswith("- [")) == 2


def test_cluster_failed_error_pickles_with_failures_and_text():
    err = ClusterFailedError("tfos-xyz", [_failure(1), _failure(2, idx=1)], "shutdown()")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is ClusterFailedError
    assert back.cluster_id == "tfos-xyz"
    assert back.context == "shutdown()"
    assert back.failures == err.failures
    assert str(back) == str(err)
    assert "during shutdown()" in str(back)
    assert "ValueError: bad lr" in str(back)


def test_cluster_failed_error_without_context():
    err = ClusterFailedError("c9", [_failure(3, kind="lost", etype="NodeLost", msg="no heartbeat", tb="")])
    assert str(err) == (
        "tfos cluster c9 failed: 1 node(s) reported 1 distinct error(s)\n"
        "- [lost] worker:0 (executor 3, host 10.0.0.7): NodeLost: no heartbeat"
    )


@pytest.mark.parametrize("streaming", [False, True])
def test_num_epochs_zero_names_the_value_that_keeps_tfos_behaviour(streaming):
    """num_epochs=0 (TFoS's default) is refused on every train() path (classic, Spark
    Connect, DStream, streaming DataFrame) with the value that keeps what TFoS did: 10
    epochs of an RDD, one pass of each micro-batch of a stream (docs/migration.md)."""
    from tfos.errors import ConfigurationError, check_num_epochs

    with pytest.raises(ConfigurationError) as info:
        check_num_epochs(0, streaming=streaming)
    if streaming:
        assert str(info.value) == ("num_epochs must be an integer >= 1 (passes over each micro-batch), got 0 (TFoS fed "
                                   "each micro-batch once whatever num_epochs said: pass num_epochs=1 to keep that)")
    else:
        assert str(info.value) == ("num_epochs must be an integer >= 1 (one epoch = one pass over every partition), got 0 "
                                   "(TFoS fed 10 epochs for 0: pass num_epochs=10 to keep that)")
    for bad in (-1, True, 2.0, "3"):
        with pytest.raises(ConfigurationError, match=rf"got {re.escape(repr(bad))}$"):
            check_num_epochs(bad, streaming=streaming)
    check_num_epochs(1, streaming=streaming)
    check_num_epochs(7)


def test_every_train_path_refuses_num_epochs_zero_with_the_tfos_hint():
    """The Spark Connect client and both streaming feeds give the same message as the
    classic train() (tests/spark/test_feed_cases.py), before touching the data."""
    from types import SimpleNamespace

    from tfos._driver import streaming as stream_feeds
    from tfos._driver.cluster import TFCluster
    from tfos.cluster_template import InputMode
    from tfos.errors import ConfigurationError

    connect = object.__new__(TFCluster)  # the one cluster class, over a Connect launcher (no streams)
    connect.input_mode = InputMode.SPARK
    connect._ctl = SimpleNamespace(launcher=SimpleNamespace(streams=False))
    with pytest.raises(ConfigurationError, match=r"got 0 \(TFoS fed 10 epochs for 0: pass num_epochs=10 to keep that\)$"):
        connect.train(None, num_epochs=0)
    stub = SimpleNamespace(input_mode=InputMode.SPARK, queues=["input"], _classic=lambda what: None, _check_open=lambda what: None)
    for feed in (stream_feeds.train_dstream, stream_feeds.train_stream):
        with pytest.raises(ConfigurationError, match=r"got 0 \(TFoS fed each micro-batch once whatever num_epochs said: "
                                                     r"pass num_epochs=1 to keep that\)$"):
            feed(stub, None, 0, 600.0, "input")
