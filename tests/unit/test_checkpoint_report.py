"""Checkpoint reports (ctx.report_checkpoint): the pure FeedResume rule, the driver's
'checkpoint' control message and its validation, and the node-side API (no Spark, no TF)."""

from __future__ import annotations

import types

import pytest

from tfos._common import wire as _wire
from tfos._control.client import ControlClient
from tfos._control.server import ControlServer
from tfos._driver.restart import FeedResume
from tfos._control.host import ClusterHost
from tfos.cluster_template import build_template, roles_from_template
from tfos.compat import checkpoint_callback
from tfos.errors import ControlProtocolError, TFOSError
from tfos.node_context import TFNodeContext

def _send(client, msg_type: str, timeout_s: float = 30.0, retry: bool = True, connect_timeout_s=None, **fields) -> dict:
    """A request of any type, as the protocol carries it (tfos itself sends typed messages,
    ControlClient.call); a type of tfos._control.messages is checked first, as call() does."""
    from tfos._control.messages import message_class

    cls = message_class(msg_type)
    if cls is not None:
        cls.decode(fields)
    return client._request(msg_type, fields, timeout_s, retry, connect_timeout_s)  # send_raw() without a connect budget


def _handle(host, body: dict, peer: str = "127.0.0.1:1") -> dict:
    """One request answered in this thread (a long-poll waited for here)."""
    return host.resolve(host.prepare(body, peer).run())


CID = "tfos-ckpt-1"


# ------------------------------------------------------------------ FeedResume
def _consume(f: FeedResume, epochs_parts) -> None:
    for e, p in epochs_parts:
        f.record(e, p)


def test_resume_at_the_checkpoint_when_the_feed_ran_ahead():
    f = FeedResume(num_epochs=5, parts_per_epoch=2, chief="chief:0")
    _consume(f, [(e, p) for e in range(3) for p in range(2)])  # epochs 0-2 consumed (read ahead)
    assert f.checkpointed_epochs is None and f.resume_epoch() == 3  # no report: as before
    f.record_checkpoint("chief:0", 1)
    f.record_checkpoint("worker:0", 1)
    assert f.checkpointed_epochs == 1
    assert f.resume_epoch() == 1
    assert f.restart() == 1 and f.epochs_left == 4
    # Nothing consumed from epoch 1 on is remembered: epochs 1..4 are fed again.
    assert not any(f.epoch_complete(e) for e in range(1, 5)) and f.epoch_complete(0)


def test_feed_once_reporting_zero_refeeds_the_whole_epoch():
    # mnist_spark.py --feed_once: train(data, 1), the nodes cache the epoch and report 0 at
    # start (their cache dies with them). The epoch was consumed in full, yet a restart
    # must feed it again, not nothing.
    f = FeedResume(num_epochs=1, parts_per_epoch=3, chief="chief:0")
    _consume(f, [(0, p) for p in range(3)])
    assert f.resume_epoch() == 1  # without the report: nothing left to feed
    f.record_checkpoint("chief:0", 0)
    f.record_checkpoint("worker:0", 0)
    assert f.resume_epoch() == 0
    assert f.restart() == 0 and f.epochs_left == 1 and not f.epoch_complete(0)


def test_first_unconsumed_epoch_wins_when_it_is_earlier():
    f = FeedResume(4, 3)
    _consume(f, [(0, 0), (0, 1), (0, 2), (1, 0)])
    f.record_checkpoint("worker:0", 3)
    assert f.resume_epoch() == 1


def test_minimum_over_nodes_and_latest_report_per_node():
    f = FeedResume(6, 1, chief="chief:0")
    _consume(f, [(e, 0) for e in range(6)])
    f.record_checkpoint("chief:0", 2)
    f.record_checkpoint("worker:0", 4)
    assert f.checkpointed_epochs == 2
    f.record_checkpoint("chief:0", 5)  # a later report replaces the earlier one
    assert f.checkpointed_epochs == 4
    f.record_checkpoint("worker:0", 9)  # above num_epochs: counts as num_epochs
    assert f.checkpointed_epochs == 5 and f.resume_epoch() == 5


def test_chief_must_have_reported():
    f = FeedResume(3, 1, chief="chief:0")
    _consume(f, [(e, 0) for e in range(3)])
    f.record_checkpoint("worker:0", 2)  # the chief may still be writing epoch 2's checkpoint
    assert f.checkpointed_epochs == 0 and f.resume_epoch() == 0
    g = FeedResume(3, 1)  # no chief named: any node's report counts
    g.record_checkpoint("worker:1", 2)
    assert g.checkpointed_epochs == 2


def test_explicit_argument_overrides_reports():
    f = FeedResume(3, 1)
    _consume(f, [(e, 0) for e in range(3)])
    f.record_checkpoint("worker:0", 2)
    assert f.resume_epoch(checkpointed_epochs=1) == 1
    assert f.resume_epoch() == 2


@pytest.mark.parametrize("bad", [-1, True, 1.0, "2", None])
def test_record_checkpoint_rejects_bad_values(bad):
    f = FeedResume(3, 1)
    with pytest.raises(ValueError):
        f.record_checkpoint("worker:0", bad)
    assert f.checkpointed_epochs is None


def test_reports_survive_attempts_and_every_row_after_the_checkpoint_is_trained():
    """Simulates read-ahead training: each attempt reads the feed up to `ahead` epochs past
    what it trained, checkpoints (and reports) at every epoch end, and dies at arbitrary
    points. Every row of every epoch is trained at least once, and trained rows of an epoch
    come from one attempt that saw the whole epoch."""
    epochs, parts, rows = 6, 3, 4
    f = FeedResume(epochs, parts, chief="chief:0")
    trained: dict[int, set] = {e: set() for e in range(epochs)}
    checkpoint = 0  # epochs in the model's checkpoint (what Keras restores)
    ahead = 2
    for die_at in ((3, 1), (4, 0), None):  # (trained epochs, partitions into the next epoch)
        assert f.first_epoch <= checkpoint  # the feed never resumes after the checkpoint
        epoch_rows: dict[int, list] = {}
        for e in range(f.first_epoch, epochs):
            # The reader consumes ahead of training: epoch e+ahead is consumed while e trains.
            for p in range(parts):
                epoch_rows.setdefault(e, []).extend((e, p, r) for r in range(rows))
                f.record(e, p)
                if die_at is not None and e == die_at[0] + ahead and p == die_at[1]:
                    break
            else:
                pass
            if die_at is not None and e == die_at[0] + ahead:
                break
        # Training restores `checkpoint` and trains epochs in order, on this attempt's rows.
        for e in range(checkpoint, epochs if die_at is None else min(die_at[0], epochs)):
            assert len(epoch_rows.get(e, [])) == parts * rows, (e, f.first_epoch)
            trained[e] |= set(epoch_rows[e])
            checkpoint = e + 1
            f.record_checkpoint("chief:0", checkpoint)  # after the save
        if die_at is None:
            break
        f.restart()
    assert checkpoint == epochs
    for e in range(epochs):
        assert trained[e] == {(e, p, r) for p in range(parts) for r in range(rows)}


# ------------------------------------------------------- the 'checkpoint' message
def _state() -> ClusterHost:
    # chief:0 (executor 0), worker:0 (executor 1)
    return ClusterHost(CID, roles_from_template(build_template(2, num_ps=0, master_node="chief")), 15.0)


def _req(st: ClusterHost, **fields) -> dict:
    return _handle(st, dict(fields, type="checkpoint", cluster=CID), "127.0.0.1:1")


def test_checkpoint_message_records_latest_per_node():
    st = _state()
    assert st.core.checkpoints() == {}
    assert _req(st, executor_id=0, epochs=1) == {"ok": True}
    assert _req(st, executor_id=1, epochs=2) == {"ok": True}
    assert _req(st, executor_id=0, epochs=3) == {"ok": True}
    assert st.core.checkpoints() == {"chief:0": 3, "worker:0": 2}
    assert _req(st, executor_id=0, epochs=0) == {"ok": True}  # 0 is valid (nothing checkpointed)
    assert st.core.checkpoints()["chief:0"] == 0
    st.clear_checkpoints()
    assert st.core.checkpoints() == {}


@pytest.mark.parametrize("fields", [
    {"executor_id": 0, "epochs": -1},
    {"executor_id": 0, "epochs": True},
    {"executor_id": 0, "epochs": 1.5},
    {"executor_id": 0, "epochs": "3"},
    {"executor_id": 0, "epochs": None},
    {"executor_id": 0},
    {"epochs": 1},
    {"executor_id": 7, "epochs": 1},
    {"executor_id": "0", "epochs": 1},
    {"executor_id": False, "epochs": 1},
])
def test_checkpoint_message_rejects_bad_fields(fields):
    st = _state()
    with pytest.raises(ControlProtocolError):
        _req(st, **fields)
    assert st.core.checkpoints() == {}


def test_checkpoint_over_the_authenticated_channel():
    """A real control server and client: a good report is recorded; a bad one closes the
    connection (a protocol error) without recording anything."""
    st = _state()
    key = _wire.new_key()
    srv = ControlServer(key, st, "127.0.0.1")
    try:
        c = ControlClient(srv.host, srv.port, key, CID, connect_timeout_s=20)
        assert _send(c, "checkpoint", executor_id=1, epochs=4, timeout_s=10.0) == {"ok": True, **_echo(c)}
        assert st.core.checkpoints() == {"worker:0": 4}
        with pytest.raises(ControlProtocolError, match="epochs must be an int >= 0"):
            _send(c, "checkpoint", executor_id=1, epochs=-3, timeout_s=10.0, retry=False)  # refused by the sender
        assert srv.rejected == 0
        with pytest.raises((ConnectionError, ControlProtocolError)):  # the same body on the wire: refused by the server
            c._request("checkpoint", {"executor_id": 1, "epochs": -3}, 10.0, False, None)
        assert st.core.checkpoints() == {"worker:0": 4}
        assert srv.rejected >= 1
        c.close()
    finally:
        srv.close()


def _echo(c: ControlClient) -> dict:
    # The response also carries the connection's nonces and the answered sequence number.
    session = c._conn.session
    return {"re": session.seq, "sn": session.snonce, "cn": session.cnonce}


# ----------------------------------------------------------------- node side API
def test_report_checkpoint_validates_and_forwards():
    sent: list = []
    ctx = TFNodeContext(executor_id=1, job_name="worker", on_checkpoint=sent.append)
    ctx.report_checkpoint(0)
    ctx.report_checkpoint(5)
    assert sent == [0, 5]
    for bad, exc in ((True, TypeError), (1.0, TypeError), ("2", TypeError), (None, TypeError), (-1, ValueError)):
        with pytest.raises(exc):
            ctx.report_checkpoint(bad)
    assert sent == [0, 5]


def test_report_checkpoint_outside_a_cluster_raises():
    with pytest.raises(TFOSError, match="no running tfos cluster"):
        TFNodeContext().report_checkpoint(1)


def _fake_keras():
    class Callback:
        def on_epoch_end(self, epoch, logs=None):
            pass

    return types.SimpleNamespace(callbacks=types.SimpleNamespace(Callback=Callback))


def test_checkpoint_callback_reports_epoch_plus_one_after_earlier_callbacks():
    keras = _fake_keras()
    order: list = []

    class Backup(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            order.append(("saved", epoch))

    ctx = TFNodeContext(executor_id=0, job_name="chief", on_checkpoint=lambda n: order.append(("reported", n)))
    cb = ctx.checkpoint_callback(keras)
    assert isinstance(cb, keras.callbacks.Callback)
    for epoch in range(3):  # what Keras does: callbacks in list order
        for c in (Backup(), cb):
            c.on_epoch_end(epoch, {})
    assert order == [("saved", 0), ("reported", 1), ("saved", 1), ("reported", 2), ("saved", 2), ("reported", 3)]
    assert checkpoint_callback(order.append, keras) is not None


@pytest.mark.tf
def test_checkpoint_callback_with_tf_keras_reports_after_backup_and_restore(tmp_path):
    """With tf_keras: listed after BackupAndRestore, each report finds that epoch's backup
    already written; a second fit restores from it and reports the remaining epochs."""
    import numpy as np

    tf_keras = pytest.importorskip("tf_keras")
    backup_dir = tmp_path / "backup"
    seen: list = []

    def _report(n: int) -> None:
        files = [p for p in backup_dir.rglob("*") if p.is_file()]
        seen.append((n, bool(files)))

    ctx = TFNodeContext(executor_id=0, job_name="chief", on_checkpoint=_report)
    x = np.random.default_rng(0).random((32, 3)).astype("float32")
    y = x.sum(axis=1)

    def _fit(epochs: int, stop_after: int = 0) -> None:
        model = tf_keras.Sequential([tf_keras.layers.Input((3,)), tf_keras.layers.Dense(1)])
        model.compile("sgd", "mse")
        callbacks = [tf_keras.callbacks.BackupAndRestore(str(backup_dir), delete_checkpoint=False), ctx.checkpoint_callback(tf_keras)]
        if stop_after:
            class _Die(tf_keras.callbacks.Callback):
                def on_epoch_begin(self, epoch, logs=None):
                    if epoch == stop_after:
                        raise RuntimeError("simulated failure")
            callbacks.append(_Die())
        try:
            model.fit(x, y, epochs=epochs, batch_size=8, verbose=0, callbacks=callbacks)
        except RuntimeError:
            pass

    _fit(4, stop_after=2)
    assert seen == [(1, True), (2, True)]
    _fit(4)  # restores after epoch 2, as a restarted attempt does
    assert seen == [(1, True), (2, True), (3, True), (4, True)]
