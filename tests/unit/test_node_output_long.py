"""The supervisor's reader of a TF process's output under long lines and floods
(tfos._node.output.NodeOutput._read, fed through a real pipe; no Spark, no TensorFlow).

Found by a break-under-load helper: one 20 MB line without a newline took the reader 6.4 s
(each 64 KB read re-split the whole unfinished line), long enough to stall main_fun's
print until the feed timed out; and under a flood the *last* lines (main_fun's final
words) were the ones dropped.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading

import pytest

from tfos._node import output
from tfos._node.output import NodeOutput

MIB = 1 << 20


class _Client:
    def __init__(self):
        self.lines: list = []
        self.sizes: list = []

    def call(self, msg, **kw):  # a typed message, as ControlClient.call takes it
        return self.request(msg.TYPE, **msg.fields(), **kw)

    def request(self, mtype, **fields):
        assert mtype == "log" and fields["executor_id"] == 5
        self.lines += fields["lines"]
        self.sizes.append(len(fields["lines"]))
        return {"ok": True}


def _read_through(out: NodeOutput, chunks: list, log_fd: int, which: int = 1) -> None:
    """Writes ``chunks`` into a pipe from a thread while ``out._read`` reads it as the
    supervisor reads the TF process's descriptor ``which`` (1 or 2), its tee going to
    ``log_fd`` (put in place of this process's descriptor ``which`` meanwhile)."""
    r, w = os.pipe()

    def write():
        with os.fdopen(w, "wb") as f:
            for c in chunks:
                f.write(c)

    t = threading.Thread(target=write)
    t.start()
    reads = []
    real_read = os.read

    def counting_read(fd, n):
        data = real_read(fd, n)
        if fd == r:
            reads.append(len(data))
        return data

    saved = os.dup(which)
    os.dup2(log_fd, which)
    output.os.read = counting_read
    try:
        out._read(r, which)
    finally:
        output.os.read = real_read
        os.dup2(saved, which)
        os.close(saved)
    t.join(30)
    assert sum(reads) == sum(len(c) for c in chunks)


def _drain(out: NodeOutput) -> None:
    for _ in range(1000):
        if out._flush():
            return
    raise AssertionError("the queue did not drain")


def test_a_20_mb_line_reaches_the_executor_log_whole_and_the_driver_once(tmp_path):
    """A 20 MB line without a newline, then a normal line: the executor log (the tee) gets
    every byte unchanged; the driver gets the long line once, cut at 2,000 characters,
    then the next line; the reader never held more than 1 MiB of the line."""
    client = _Client()
    out = NodeOutput(client, 5, tee=True, tf_min_level=1)
    body = bytes(range(32, 127)) * (20 * MIB // 95)
    chunks = [body[i:i + 3000] for i in range(0, len(body), 3000)] + [b"\nnext line\n"]
    held = []
    real_handle = out._handle

    def handle(lines, fd, state, cut):
        held.append(max(len(x) for x in lines))
        real_handle(lines, fd, state, cut)

    out._handle = handle
    log_path = tmp_path / "executor.log"
    with open(log_path, "wb") as log:
        _read_through(out, chunks, log.fileno())
    _drain(out)
    data = log_path.read_bytes()
    assert hashlib.sha256(data).hexdigest() == hashlib.sha256(body + b"\nnext line\n").hexdigest()
    assert client.lines == [body[:2000].decode(), "next line"]
    assert max(held) <= output._LONG_LINE_BYTES
    assert len(held) >= 20  # handled in pieces, not as one 20 MB line


def test_a_progress_bar_without_newlines_shows_its_last_state(tmp_path):
    """Keras/tqdm redraw a bar with carriage returns: 3 MiB of redraws, then a newline.
    The driver gets a few intermediate states (at most one per MiB) and the last state;
    the executor log gets every byte."""
    client = _Client()
    out = NodeOutput(client, 5, tee=True)
    n = 3 * MIB // 60
    bar = b"".join(b"\r%10d/%d [=====>....] - loss: 0.1234" % (i, n) for i in range(n)) + b"\n"
    log_path = tmp_path / "executor.log"
    with open(log_path, "wb") as log:
        _read_through(out, [bar[i:i + 4096] for i in range(0, len(bar), 4096)], log.fileno())
    _drain(out)
    assert log_path.read_bytes() == bar
    assert client.lines[-1] == "%10d/%d [=====>....] - loss: 0.1234" % (n - 1, n)
    assert 1 <= len(client.lines) <= 5, len(client.lines)


def test_a_noise_line_longer_than_a_piece_is_dropped_whole(tmp_path):
    """A TensorFlow C++ INFO line longer than 1 MiB: its later pieces are dropped with
    its first one (not shown as ordinary lines)."""
    client = _Client()
    out = NodeOutput(client, 5, tee=True, tf_min_level=1)
    noise = b"I0000 00:00:1796080592.555864    7250 port.cc:153] " + b"n" * (2 * MIB + 5) + b"\n"
    log_path = tmp_path / "executor.log"
    with open(log_path, "wb") as log:
        _read_through(out, [noise, b"kept\n"], log.fileno())
    _drain(out)
    assert client.lines == ["kept"]
    assert log_path.read_bytes() == b"kept\n"


def test_a_marker_after_a_long_unterminated_line_is_not_split(tmp_path):
    """main_fun wrote almost 1 MiB without a newline, then raised with a long message: the
    failure's marker line starts just before the 1 MiB cut and ends 100 KB after it. The
    cut moves before the marker, so the failure is still taken as a report (not shown as
    text), and the partial line reaches the executor log whole, ended by the marker as
    when the two are read together."""
    client = _Client()
    out = NodeOutput(client, 5, tee=True)
    partial = b"p" * (output._LONG_LINE_BYTES - 10)
    message = "m" * 100_000
    marker = f"{output._MARK_START}failure {out.mark} {{\"executor_id\": 5, \"job_name\": \"worker\", \"task_index\": 0, \"kind\": \"exception\", \"error_type\": \"E\", \"message\": \"{message}\"}}\n".encode()
    log_path = tmp_path / "executor.log"
    with open(log_path, "wb") as log:
        _read_through(out, [partial, marker, b"after\n"], log.fileno(), which=2)
    assert [(n, kind, report.failure.message) for n, kind, report in out._pending] == [(1, "failure", message)]
    _drain(out)
    assert client.lines == ["p" * 2000, "after"]
    assert log_path.read_bytes() == partial + b"\nafter\n"


def test_under_a_flood_the_driver_gets_the_last_lines(tmp_path):
    """20,000 lines arrive while nothing is sent: 5,000 stay queued, the oldest give way.
    The driver gets a note of the 15,000 left out, then the last 5,000 lines in order,
    the final one included; the executor log has all 20,000."""
    client = _Client()
    out = NodeOutput(client, 5, tee=True)
    text = "".join(f"line {i}\n" for i in range(20000)).encode()
    log_path = tmp_path / "executor.log"
    with open(log_path, "wb") as log:
        _read_through(out, [text], log.fileno())
    _drain(out)
    assert client.lines[0] == "[15000 output lines dropped here; the executor log has them]"
    assert client.lines[1:] == [f"line {i}" for i in range(15000, 20000)]
    assert log_path.read_bytes() == text
    # The driver shows at most 1,000 lines of one request: no request holds more (a helper
    # found batches of up to 26,000 short lines, the driver dropping all past 1,000 silently).
    assert max(client.sizes) == 1000 and sum(client.sizes) == 5001


def test_the_driver_shows_what_it_cut_from_one_request(capsys):
    from tfos._node.output import emit

    emit("worker:1", [f"l{i}" for i in range(1500)])
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "[worker:1] l0" and err[999] == "[worker:1] l999"
    assert err[1000:] == ["[worker:1] [500 more output lines of this node not shown]"]


@pytest.mark.parametrize("short", [10, 5, 3, 1])
def test_a_marker_across_the_1_mib_cut_is_still_a_report(tmp_path, short):
    """Unterminated stderr text ends ``short`` bytes before the 1 MiB cut, then a failure
    marker whose JSON (non-ASCII message, escaped to 12 bytes a character) is read in
    many pieces: the marker starts before the cut and ends after it. It must still be
    taken as the report (a helper lost the failure with 1, 3 or 5 bytes short: the
    driver saw only 'ProcessDied ... exit code 1')."""
    client = _Client()
    out = NodeOutput(client, 5, tee=True)
    text = b"x" * (output._LONG_LINE_BYTES - short)
    message = "\U0001F600" * 6000
    marker = f"{output._MARK_START}failure {out.mark} {json.dumps({'executor_id': 5, 'job_name': 'worker', 'task_index': 0, 'kind': 'exception', 'error_type': 'E', 'message': message})}\n".encode()
    log_path = tmp_path / "executor.log"
    with open(log_path, "wb") as log:
        _read_through(out, [text, marker, b"after\n"], log.fileno(), which=2)
    assert [(kind, report.failure.message) for _, kind, report in out._pending] == [("failure", message)]
    assert log_path.read_bytes() == text + b"\nafter\n"


def test_lines_that_only_look_like_markers_reach_the_executor_log_unchanged(tmp_path):
    """A wrong token, carriage returns, bytes that are not UTF-8, and a marker-like text in
    the last quarter of a 1 MiB piece: the tee is byte for byte what was written (a helper
    saw '\\r' stripped, U+FFFD written for bad bytes, and a newline inserted)."""
    client = _Client()
    out = NodeOutput(client, 5, tee=True)
    data = (b"\x1etfos-failure deadbeef {}\r\n\xff\xfe junk \x1etfos-x\r\n"
            + b"y" * (output._LONG_LINE_BYTES - 100) + b"\x1etfos-returned 0000 {}" + b"z" * 300 + b"\nend\n")
    log_path = tmp_path / "executor.log"
    with open(log_path, "wb") as log:
        _read_through(out, [data], log.fileno(), which=2)
    assert log_path.read_bytes() == data
    assert out._pending == []
    _drain(out)
    assert client.lines[:2] == ["\x1etfos-failure deadbeef {}", "\ufffd\ufffd junk \x1etfos-x"]
    assert client.lines[-1] == "end"


def test_a_marker_like_text_earlier_on_the_line_does_not_hide_the_report(tmp_path):
    """main_fun wrote binary output holding the marker's first bytes, without a newline,
    then raised: the real marker, the last on the line, is still taken as the report."""
    client = _Client()
    out = NodeOutput(client, 5, tee=True)
    marker = f"{output._MARK_START}failure {out.mark} {{\"executor_id\": 5, \"job_name\": \"worker\", \"task_index\": 0, \"kind\": \"exception\", \"error_type\": \"E\", \"message\": \"boom\"}}\n".encode()
    log_path = tmp_path / "executor.log"
    with open(log_path, "wb") as log:
        _read_through(out, [b"bin \x1etfos-", marker], log.fileno(), which=2)
    assert [(kind, report.failure.message) for _, kind, report in out._pending] == [("failure", "boom")]
    assert log_path.read_bytes() == b"bin \x1etfos-\n"
