"""examples/quickstart.py, the README's program, runs as a user would run it."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.spark, pytest.mark.tf]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_readme_shows_the_quickstart_verbatim():
    with open(os.path.join(ROOT, "examples", "quickstart.py")) as f:
        program = f.read()
    with open(os.path.join(ROOT, "README.md")) as f:
        assert "```python\n" + program + "```" in f.read()


def test_quickstart_trains_and_predicts(tmp_path, no_leftovers):
    """The quick start as `python examples/quickstart.py > log 2>&1` runs it: it trains and
    predicts, and the file is clean: Spark's stage bar (on: pyspark sets it when the log
    level is WARN) is off while tfos's clusters run, so no node line is glued to a
    "\\r[Stage 3:=> (1 + 2) / 4]" frame, tfos's own progress is whole lines, and no line
    carries a terminal escape code."""
    env = dict(os.environ)
    for name in ("PYSPARK_GATEWAY_PORT", "PYSPARK_GATEWAY_SECRET", "TFOS_PROGRESS"):  # tests/conftest.py turns the bar off
        env.pop(name, None)
    script = os.path.join(ROOT, "examples", "quickstart.py")
    with open(script) as f:
        assert 30 <= len(f.read().splitlines()) <= 50
    log = tmp_path / "quickstart.log"
    with open(log, "wb") as out:
        proc = subprocess.run([sys.executable, script, "local-cluster[2,1,1024]"], cwd=str(tmp_path), env=env,
                              stdout=out, stderr=subprocess.STDOUT, timeout=900)
    text = log.read_bytes().decode("utf-8", "replace")
    # The JVM's shutdown noise comes last: show the driver's own traceback, when there is one.
    tb = text.rfind("Traceback (most recent call last)")
    assert proc.returncode == 0, f"{text[tb:tb + 8000] if tb >= 0 else ''}\n...\n{text[-4000:]}"
    m = re.search(r"^rows: (\d+), accuracy: ([0-9.]+)$", text, re.MULTILINE)
    assert m, text[-6000:]
    assert int(m.group(1)) == 2500
    assert float(m.group(2)) >= 0.9, text[-6000:]
    # Spark authenticates (tfos.authenticate_spark): no key-transport WARNING, and the secret
    # was on no command line (tfos would warn about that too).
    assert "tfos cluster key" not in text, text[-6000:]  # in each of tfos's key-transport WARNINGs
    # Both nodes' print() reached the driver, each line starting with its node prefix.
    for node in ("chief:0", "worker:0"):
        assert f"\n[{node}] {node} trained\n" in text, text[-6000:]
    # A file or a CI log: no line joins a progress bar and a node line, no escape code.
    lines = text.split("\n")
    glued = [ln for ln in lines if "[Stage " in ln and re.search(r"\[(chief|worker):\d+\] ", ln)]
    assert not glued, glued[:3]
    assert "\x1b" not in text, [ln for ln in lines if "\x1b" in ln][:3]
    assert not [ln for ln in lines if "\r" in ln and re.search(r"\[(chief|worker):\d+\] ", ln)]
    # tfos's own progress, as whole lines (the last one of each train()/inference() at 100 %)
    bars = [ln for ln in lines if ln.startswith(("tfos train", "tfos inference"))]
    assert any("100%" in ln for ln in bars), bars or text[-6000:]
    assert not [ln for ln in bars if "\r" in ln], bars
