"""Fed nodes import the modules of the first chunk (pyarrow) during start-up (issue 12)."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_preimport_imports_in_a_background_thread_and_skips_missing_modules():
    code = textwrap.dedent(
        """
        import sys, threading, time
        from tfos._node import tf_process
        assert "pyarrow" in tf_process._FEED_MODULES
        assert "colorsys" not in sys.modules
        tf_process._preimport_async(("tfos_no_such_module_x", "colorsys"), "worker:0")
        for t in threading.enumerate():
            if t.name == "tfos-preimport":
                assert t.daemon
                t.join(30)
        assert "colorsys" in sys.modules and "tfos_no_such_module_x" not in sys.modules
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
