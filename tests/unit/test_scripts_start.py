"""Every Python script in scripts/ starts and prints its usage: the figures in docs/ come
from these scripts, and anyone must be able to rerun them (bench_flood.py once imported a
module that had moved, and failed before its first line of output)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).resolve().parents[2] / "scripts").glob("*.py"))


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_script_prints_its_usage(script):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    if "__main__" in script.read_text():
        cmd = [sys.executable, str(script), "--help"]
    else:  # a helper module of the scripts (bench_cpu.py): it must at least load
        cmd = [sys.executable, "-c", f"import runpy; runpy.run_path({str(script)!r}); print('usage: loaded')"]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=180, env=env,
                          cwd=str(script.parent.parent))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "usage:" in proc.stdout, proc.stdout[-2000:]
