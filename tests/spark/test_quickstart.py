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
    env = dict(os.environ)
    for name in ("PYSPARK_GATEWAY_PORT", "PYSPARK_GATEWAY_SECRET"):
        env.pop(name, None)
    script = os.path.join(ROOT, "examples", "quickstart.py")
    with open(script) as f:
        assert 30 <= len(f.read().splitlines()) <= 50
    proc = subprocess.run([sys.executable, script, "local-cluster[2,1,1024]"], cwd=str(tmp_path), env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=900)
    # The JVM's shutdown noise comes last: show the driver's own traceback, when there is one.
    tb = proc.stderr.rfind("Traceback (most recent call last)")
    assert proc.returncode == 0, (f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[tb:tb + 8000] if tb >= 0 else ''}"
                                  f"\n...\n{proc.stderr[-4000:]}")
    m = re.search(r"^rows: (\d+), accuracy: ([0-9.]+)$", proc.stdout, re.MULTILINE)
    assert m, proc.stdout
    assert int(m.group(1)) == 2500
    assert float(m.group(2)) >= 0.9, proc.stdout
    # Spark authenticates (tfos.authenticate_spark): no key-transport WARNING, and the secret
    # was on no command line (tfos would warn about that too).
    assert "tfos cluster key" not in proc.stderr, proc.stderr[-6000:]  # in each of tfos's key-transport WARNINGs
    # Both nodes' print() reached the driver's stderr, with their node prefix.
    for node in ("chief:0", "worker:0"):
        assert f"[{node}] {node} trained" in proc.stderr, proc.stderr[-6000:]
