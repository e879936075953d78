"""run_atexit_handlers: the TF process runs atexit handlers before os._exit, bounded."""

from __future__ import annotations

import subprocess
import sys
import textwrap

PROGRAM = textwrap.dedent('''
    import atexit, logging, os, sys, threading
    from tfos._node.tf_process import run_atexit_handlers
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="%(message)s")
    atexit.register(threading.Event().wait)               # stuck: runs last (LIFO), never ends
    atexit.register(print, "handler ran", flush=True)       # runs first
    run_atexit_handlers(float(sys.argv[1]))
    print("exiting", flush=True)
    os._exit(3)
''')


def test_handlers_run_and_a_stuck_one_is_given_up_after_the_budget():
    proc = subprocess.run([sys.executable, "-c", PROGRAM, "0.5"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout.splitlines() == ["handler ran", "exiting"]
    assert "atexit handlers did not finish within 0.5 s; exiting without them" in proc.stderr
