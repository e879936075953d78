"""Restart bookkeeping (issue 14): policy, early stop, final error, feed resume, inference
ledger. Pure: no Spark, no TensorFlow."""

from __future__ import annotations

import pickle

import pytest

from tfos._driver.restart import AttemptOutcome, FeedResume, InferenceLedger, RestartPolicy, failure_signature
from tfos.errors import ClusterFailedError, NodeFailure, RecoveryFailedError


def _tb(line: int, func: str = "main_fun", path: str = "/home/me/train.py") -> str:
    return ("Traceback (most recent call last):\n"
            '  File "/venv/tfos/_node/tf_process.py", line 260, in run_node\n    main_fun(tf_args, ctx)\n'
            f'  File "{path}", line {line}, in {func}\n    raise ValueError("bad")\n')


def _exc(eid: int = 0, etype: str = "ValueError", msg: str = "bad input", line: int = 12, host: str = "10.0.0.5") -> NodeFailure:
    return NodeFailure(eid, "worker", eid, host, "exception", etype, msg, _tb(line))


def _lost(eid: int = 1, host: str = "10.0.0.6") -> NodeFailure:
    return NodeFailure(eid, "worker", eid, host, "lost", "NodeLost", f"no heartbeat for 15 s from host {host}")


def _feed(eid: int = 0) -> NodeFailure:
    return NodeFailure(eid, "worker", eid, "10.0.0.5", "feed", "FeedError", "partition 3 (epoch 0) -> worker:0: connection reset")


# ------------------------------------------------------------------ signatures
def test_signature_ignores_node_addresses_and_volatile_numbers():
    a = _exc(0, msg="cannot reach 10.0.0.7:41234 from pid 4411 (object at 0x7f3a12)", host="10.0.0.5")
    b = _exc(1, msg="cannot reach 10.0.0.9:39001 from pid 977 (object at 0x55aa00)", host="10.0.0.8")
    assert failure_signature(a) == failure_signature(b)
    assert failure_signature(a)[3] == "train.py:12:main_fun"


def test_signature_differs_by_type_message_or_raising_line():
    base = failure_signature(_exc())
    assert failure_signature(_exc(etype="KeyError")) != base
    assert failure_signature(_exc(msg="other text")) != base
    assert failure_signature(_exc(line=13)) != base
    assert failure_signature(_exc(msg="expected 3 columns, got 4")) != failure_signature(_exc(msg="expected 3 columns, got 5"))


# ---------------------------------------------------------------------- policy
def test_budget_allows_exactly_max_restarts():
    p = RestartPolicy(2)
    d0 = p.record(AttemptOutcome(0, (_lost(),), "train()", progressed=True))
    assert d0.restart and d0.next_attempt == 1 and "restart 1 of 2" in d0.reason
    d1 = p.record(AttemptOutcome(1, (_lost(),), "train()", progressed=True))
    assert d1.restart and d1.next_attempt == 2
    d2 = p.record(AttemptOutcome(2, (_lost(),), "train()", progressed=True))
    assert not d2.restart and "budget is spent (max_restarts=2)" in d2.reason
    assert p.restarts_used == 2


def test_zero_budget_never_restarts():
    d = RestartPolicy(0).record(AttemptOutcome(0, (_lost(),)))
    assert not d.restart and "max_restarts=0" in d.reason


@pytest.mark.parametrize("etype", ["ConfigurationError", "MalformedRowError", "InferenceResultError", "SyntaxError"])
def test_non_retryable_errors_stop_at_once(etype):
    p = RestartPolicy(5)
    d = p.record(AttemptOutcome(0, (_exc(etype=etype), _lost()), "train()", progressed=True))
    assert not d.restart and etype in d.reason and "stopped early" in d.reason


def test_same_exception_on_the_first_step_stops_early():
    p = RestartPolicy(5)
    assert p.record(AttemptOutcome(0, (_exc(0),), "train()", progressed=False)).restart
    # Same bug, other node and other address: still the same failure.
    d = p.record(AttemptOutcome(1, (_exc(1, host="10.0.0.9"),), "train()", progressed=False))
    assert not d.restart and "same exception" in d.reason and "4 restart(s) left unused" in d.reason


def test_unknown_progress_counts_as_first_step():
    p = RestartPolicy(3)
    assert p.record(AttemptOutcome(0, (_exc(),), "shutdown()")).restart
    assert not p.record(AttemptOutcome(1, (_exc(),), "shutdown()")).restart


def test_repeat_after_progress_or_different_or_not_an_exception_is_retried():
    p = RestartPolicy(4)
    assert p.record(AttemptOutcome(0, (_exc(),), progressed=True)).restart
    assert p.record(AttemptOutcome(1, (_exc(),), progressed=True)).restart  # it got further each time
    assert p.record(AttemptOutcome(2, (_exc(msg="other"),), progressed=False)).restart  # different exception
    assert p.record(AttemptOutcome(3, (_exc(msg="other"), _lost()), progressed=False)).restart  # a lost host too
    assert not p.record(AttemptOutcome(4, (_lost(),), progressed=False)).restart  # budget


def test_consequences_do_not_make_attempts_differ():
    p = RestartPolicy(3)
    assert p.record(AttemptOutcome(0, (_feed(0), _exc(1)), progressed=False)).restart
    assert not p.record(AttemptOutcome(1, (_exc(0), _feed(1)), progressed=False)).restart


def test_attempts_recorded_in_order_only():
    p = RestartPolicy(1)
    with pytest.raises(ValueError):
        p.record(AttemptOutcome(1, (_lost(),)))
    with pytest.raises(ValueError):
        RestartPolicy(-1)
    with pytest.raises(ValueError):
        RestartPolicy(True)  # type: ignore[arg-type]


def test_final_error_lists_every_attempt_and_pickles():
    p = RestartPolicy(1)
    p.record(AttemptOutcome(0, (_lost(1), _feed(0)), "train()", progressed=True, cluster_id="tfos-aaa"))
    d = p.record(AttemptOutcome(1, (_exc(0),), "shutdown()", progressed=True, cluster_id="tfos-bbb"))
    err = p.error(d.reason)
    assert isinstance(err, ClusterFailedError) and isinstance(err, RecoveryFailedError)
    text = str(err)
    assert text.startswith("tfos cluster tfos-bbb failed on all 2 attempt(s); the restart budget is spent (max_restarts=1)")
    assert "attempt 0 during train(): 1 root cause(s)" in text
    assert "- [lost] worker:1 (executor 1, host 10.0.0.6): NodeLost: no heartbeat" in text
    assert "attempt 1 during shutdown(): 1 root cause(s)" in text
    assert "- [exception] worker:0 (executor 0, host 10.0.0.5): ValueError: bad input" in text
    assert 'File "/home/me/train.py", line 12, in main_fun' in text
    assert "FeedError" not in text  # a consequence, not a cause
    assert [f.error_type for f in err.failures] == ["ValueError"]  # the last attempt's causes
    back = pickle.loads(pickle.dumps(err))
    assert str(back) == text and back.reason == err.reason and len(back.attempts) == 2


def test_identical_tracebacks_are_printed_once():
    p = RestartPolicy(2)
    p.record(AttemptOutcome(0, (_exc(),), progressed=True))
    p.record(AttemptOutcome(1, (_exc(),), progressed=True))
    d = p.record(AttemptOutcome(2, (_exc(),), progressed=True))
    text = str(p.error(d.reason))
    assert text.count("Traceback (most recent call last)") == 1
    assert text.count("ValueError: bad input") == 3


# ------------------------------------------------------------------ feed resume
def test_feed_resumes_at_the_first_incomplete_epoch():
    f = FeedResume(num_epochs=3, parts_per_epoch=4)
    assert f.resume_epoch() == 0
    for i in range(4):  # epoch 0 consumed in full
        f.record_index(i)
    f.record_index(4)  # epoch 1: partitions 0 and 2 only
    f.record_index(6)
    f.record_index(8)  # epoch 2 partition 0 (fed back to back)
    assert f.epoch_complete(0) and not f.epoch_complete(1)
    assert f.resume_epoch() == 1
    assert f.resume_epoch(checkpointed_epochs=0) == 0  # an older checkpoint wins
    assert f.resume_epoch(checkpointed_epochs=2) == 1  # never later than the feed allows
    assert f.restart() == 1 and f.epochs_left == 2
    # The new job feeds epochs 1 and 2: its index 0 is epoch 1 partition 0.
    assert not f.epoch_complete(1)
    for i in range(8):
        f.record_index(i)
    assert f.resume_epoch() == 3 and f.epoch_complete(2)


def test_every_row_accounted_for_across_restarts():
    # Simulate rows: 3 epochs x 5 partitions x 10 rows; a failure after an arbitrary prefix of
    # each attempt's job; the union of fed rows covers every (epoch, row) at least once, a
    # row is fed at most once per attempt, and only rows of resumed epochs more than once.
    epochs, parts = 3, 5
    f = FeedResume(epochs, parts)
    fed: dict[tuple[int, int, int], int] = {}
    resumed: list[int] = []
    for stop_after in (7, 4, None):
        job = [(f.first_epoch + e, p) for e in range(f.epochs_left) for p in range(parts)]
        for n, (e, p) in enumerate(job):
            if stop_after is not None and n == stop_after:
                break
            for r in range(10):
                fed[(e, p, r)] = fed.get((e, p, r), 0) + 1
            f.record(e, p)
        if stop_after is None:
            break
        before = f.first_epoch
        resumed.append(f.restart())
        assert resumed[-1] >= before
    assert resumed == [1, 1]
    assert len(fed) == epochs * parts * 10  # none lost
    assert max(fed.values()) == 3  # at most once per attempt
    assert {k[0] for k, n in fed.items() if n > 1} == {1}  # only the epoch the failures hit
    assert all(n == 1 for k, n in fed.items() if k[0] == 0)


def test_feed_resume_validates():
    with pytest.raises(ValueError):
        FeedResume(0, 1)
    f = FeedResume(1, 2)
    with pytest.raises(ValueError):
        f.record_index(2)


# ------------------------------------------------------------- inference ledger
def test_inference_reruns_only_missing_partitions():
    led = InferenceLedger(5)
    led.record(0, 100, rows=100)
    led.record(3, 40)
    led.record(4, 99, rows=100)  # short: not done
    assert led.missing() == [1, 2, 4] and not led.complete
    led.record_all([1, 2, 4])
    assert led.complete and led.missing() == [] and list(led.done()) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError):
        led.record(5, 1)
