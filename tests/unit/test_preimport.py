"""Fed nodes import the modules of the first chunk (pyarrow) during start-up (issue 12)."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_preimport_imports_in_a_background_thread_and_skips_missing_modules():
    code = textwrap.dedent(
        """
        import sys, threading, time
        from tfos._node import preimport
        assert "pyarrow" in preimport.FEED_MODULES
        assert "colorsys" not in sys.modules
        preimport.preimport_async(("tfos_no_such_module_x", "colorsys"), "worker:0")
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


def test_start_up_imports_end_before_main_fun_starts(tmp_path):
    """Importing numpy/pyarrow moves the C ``environ`` array (``setenv``); a ``main_fun`` that
    starts a subprocess while a tfos thread still imports can fail with ``OSError: [Errno 14]
    Bad address`` (seen in a stress run). main_fun must start with the imports done."""
    code = textwrap.dedent(
        """
        import json, sys, threading
        import cloudpickle
        assert "numpy" not in sys.modules and "pyarrow" not in sys.modules
        from tfos._common import wire
        from tfos._control.server import ControlServer
        from tfos._control.host import ClusterHost
        from tfos._node.launch import ClusterConfig, NodeLaunch
        from tfos._node.tf_process import run_node
        from tfos.cluster_template import InputMode, build_template, roles_from_template

        def main_fun(args, ctx):
            seen = {"threads": sorted(t.name for t in threading.enumerate() if t.name == "tfos-preimport"),
                    "numpy": "numpy" in sys.modules, "pyarrow": "pyarrow" in sys.modules}
            with open(args["out"], "w") as f:
                json.dump(seen, f)

        key = wire.new_key()
        roles = tuple(roles_from_template(build_template(1, 0)))
        state = ClusterHost("tfos-preimport", list(roles), 15.0)
        server = ControlServer(key, state, host="127.0.0.1")
        cfg = ClusterConfig(cluster_id="tfos-preimport", key=key, driver_host="127.0.0.1", driver_port=server.port,
                            input_mode=InputMode.SPARK, roles=roles, reservation_timeout_s=30.0, forward_logs="none")
        launch = NodeLaunch(config=cfg, role=roles[0], host="127.0.0.1", executor_key="h/1", watch_pid=0,
                            watch_stdin=False, working_dir=sys.argv[2], python_path=(),
                            fn_payload=cloudpickle.dumps((main_fun, {"out": sys.argv[1]})))
        print(run_node(launch))
        server.close()
        """
    )
    out_file = tmp_path / "seen.json"
    out = subprocess.run([sys.executable, "-c", code, str(out_file), str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "0", out.stdout
    import json

    assert json.loads(out_file.read_text()) == {"threads": [], "numpy": True, "pyarrow": True}
