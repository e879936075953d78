"""How much address space (RLIMIT_AS, what spark.executor.pyspark.memory limits) a TF process
needs: the smallest limit under which a workload still succeeds, found by bisection, and
its peak virtual size (VmPeak) without a limit.

docs/api.md ("Memory limits") quotes this script's figures. Rerun:

    python scripts/tf_address_space.py                  # import, keras-fit at 2, 8, 32 threads; 3 runs each
    python scripts/tf_address_space.py --runs 5 --workloads import keras-fit --threads 2 64

Each run of a workload is a fresh ``python -c`` child under ``resource.setrlimit(RLIMIT_AS,
(limit, limit))``, exactly as PySpark limits its Python worker (and so a tfos node's
processes). TensorFlow's thread pools are sized with ``--threads`` (intra- and inter-op
threads, and OMP threads), standing for hosts with that many cores: each thread reserves a
stack (``ulimit -s``, 8 MiB by default) and glibc may give it a malloc arena (64 MiB of
address space each, up to 8 per core), which is why the need grows with cores.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import textwrap

MiB = 2**20

_PRELUDE = textwrap.dedent('''
    import os, sys
    n = int(sys.argv[1])
    os.environ["OMP_NUM_THREADS"] = str(n)
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(n)
    tf.config.threading.set_inter_op_parallelism_threads(n)
''')

WORKLOADS = {
    "import": _PRELUDE + "print(float(tf.reduce_sum(tf.ones([1000, 1000]))))\n",
    "keras-fit": _PRELUDE + textwrap.dedent('''
        import numpy as np
        import keras
        x = np.random.rand(4096, 784).astype("float32")
        y = np.random.randint(0, 10, 4096)
        model = keras.Sequential([keras.Input((784,)), keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)])
        model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=64, epochs=2, verbose=0)
        print("ok")
    '''),
    # MultiWorkerMirroredStrategy as a tfos node runs it (a one-worker cluster here): a gRPC
    # server and the coordination service add their threads. tf_keras, as TFoS programs use.
    "mwms-fit": "import json, os, socket\n" + textwrap.dedent('''
        s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
        os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"127.0.0.1:{port}"]}, "task": {"type": "worker", "index": 0}})
        os.environ["TF_USE_LEGACY_KERAS"] = "1"
    ''') + _PRELUDE + textwrap.dedent('''
        import numpy as np
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        with strategy.scope():
            model = tf.keras.Sequential([tf.keras.Input((784,)), tf.keras.layers.Dense(256, activation="relu"), tf.keras.layers.Dense(10)])
            model.compile("adam", tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        x = np.random.rand(4096, 784).astype("float32")
        y = np.random.randint(0, 10, 4096)
        model.fit(x, y, batch_size=64, epochs=2, verbose=0)
        print("ok")
    '''),
}


def _limited(limit: int):
    def _set() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    return _set


#: Seconds a run may take; one that takes longer counts as failed (a run must end by itself
#: under the limit; one run of the MultiWorkerMirroredStrategy workload once passed 600 s on a
#: machine at load 30 and the measurement stopped).
TIMEOUT_S = 400.0


def succeeds(workload: str, threads: int, limit: int) -> bool:
    """True when ``workload`` exits 0 under an address-space limit of ``limit`` bytes
    within :data:`TIMEOUT_S` (a run that hangs is killed and counts as failed)."""
    try:
        proc = subprocess.run([sys.executable, "-c", WORKLOADS[workload], str(threads)], preexec_fn=_limited(limit),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        print(f"  ({workload}, {threads} threads, limit {limit // MiB} MiB: no end within {TIMEOUT_S:g} s; counted as failed)",
              flush=True)
        return False
    return proc.returncode == 0


def smallest_limit(workload: str, threads: int, lo: int = 256 * MiB, hi: int = 64 * 1024 * MiB, step: int = 64 * MiB) -> int:
    """The smallest limit (a multiple of ``step``) under which ``workload`` succeeds."""
    if not succeeds(workload, threads, hi):
        raise RuntimeError(f"{workload} fails even under {hi // MiB} MiB")
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        if succeeds(workload, threads, mid):
            hi = mid
        else:
            lo = mid
    return hi


def vm_peak(workload: str, threads: int) -> int:
    """VmPeak (bytes) of an unlimited run, read from /proc at its end."""
    code = WORKLOADS[workload] + textwrap.dedent('''
        for line in open("/proc/self/status"):
            if line.startswith("VmPeak:"):
                print("VMPEAK", int(line.split()[1]) * 1024)
    ''')
    out = subprocess.run([sys.executable, "-c", code, str(threads)], capture_output=True, text=True, timeout=600, check=True)
    return next(int(l.split()[1]) for l in out.stdout.splitlines() if l.startswith("VMPEAK"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--workloads", nargs="+", default=["import", "keras-fit"], choices=sorted(WORKLOADS))
    ap.add_argument("--threads", nargs="+", type=int, default=[2, 8, 32])
    args = ap.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf  # its version for the report

    print(f"TensorFlow {tf.__version__}, Python {sys.version.split()[0]}, {os.cpu_count()} CPUs, "
          f"stack limit {resource.getrlimit(resource.RLIMIT_STACK)[0] // MiB} MiB; {args.runs} runs each")
    print(f"{'workload':<10} {'threads':>7}  {'smallest RLIMIT_AS (MiB): median [min, max]':<45} {'VmPeak unlimited (MiB)':<24}")
    for workload in args.workloads:
        for threads in args.threads:
            limits = [smallest_limit(workload, threads) // MiB for _ in range(args.runs)]
            peaks = [vm_peak(workload, threads) // MiB for _ in range(args.runs)]
            print(f"{workload:<10} {threads:>7}  {statistics.median(limits):>8.0f} [{min(limits)}, {max(limits)}]"
                  f"{'':<24} {statistics.median(peaks):>8.0f} [{min(peaks)}, {max(peaks)}]", flush=True)


if __name__ == "__main__":
    main()
