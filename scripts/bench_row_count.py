#!/usr/bin/env python
"""Step time of Keras 3 ``fit`` with and without tfos's row counting (one process, CPU).

On a fed node, tfos's Keras 3 fix adds each local batch's rows to an int64 variable inside
``train_step`` (``tfos._node.keras3_outputs.counting_step``; docs/datafeed.md, "Row
accounting"). This measures what that costs: the MLP of ``examples/mnist/keras``
(784-256-128-10, Adam) trained with one ``fit`` of ``--steps`` steps on an in-memory
``tf.data`` dataset of ``--batch`` rows per step, with the counting off and on, alternated
``--repeat`` times on the same model (the train function is rebuilt for each run; a first
fit per mode traces it). It prints each run's seconds per step, the median per mode and the
ratio on/off of the medians (1.00: no cost), and the load average. The spread between runs
of one mode is the noise to compare the ratio with.

Usage::

    .venv/bin/python scripts/bench_row_count.py --steps 400 --repeat 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    os.environ.pop("TF_USE_LEGACY_KERAS", None)
    from tfos._node import keras3_fix
    from tfos._data.row_count import ROWS

    keras3_fix.install()
    import numpy as np
    import tensorflow as tf
    import keras

    rng = np.random.default_rng(0)
    x = rng.uniform(size=(args.batch * 64, 784)).astype("float32")
    y = rng.integers(0, 10, size=len(x)).astype("int64")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch).repeat().prefetch(2)
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((784,)), keras.layers.Dense(256, activation="relu"),
                              keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10)])
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    def run(counting: bool, steps: int) -> float:
        ROWS.enabled = counting
        model.train_function = None  # rebuilt with (or without) the counting step
        model.fit(ds, epochs=1, steps_per_epoch=5, verbose=0)  # traces it
        t0 = time.perf_counter()
        model.fit(ds, epochs=1, steps_per_epoch=steps, verbose=0)
        return (time.perf_counter() - t0) / steps

    times: dict[bool, list[float]] = {False: [], True: []}
    for r in range(args.repeat):
        for counting in ((False, True) if r % 2 == 0 else (True, False)):
            times[counting].append(run(counting, args.steps))
            print(f"repeat {r} counting {'on ' if counting else 'off'}: {times[counting][-1] * 1e3:.3f} ms/step", flush=True)
    assert ROWS.trained() > 0, "the counting step did not count"
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(f"off: median {off * 1e3:.3f} ms/step (min {min(times[False]) * 1e3:.3f}, max {max(times[False]) * 1e3:.3f})")
    print(f"on:  median {on * 1e3:.3f} ms/step (min {min(times[True]) * 1e3:.3f}, max {max(times[True]) * 1e3:.3f})")
    print(f"ratio on/off of the medians: {on / off:.3f}; load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
