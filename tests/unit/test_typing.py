"""mypy must pass on tfos/ (STYLE: full type hints)."""

import subprocess
import sys
from pathlib import Path

import pytest


def test_mypy_passes_on_tfos():
    pytest.importorskip("mypy")
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "tfos", "--ignore-missing-imports", "--no-incremental"],
        cwd=root, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Success: no issues found" in proc.stdout
