#!/usr/bin/env python
"""Decode cost on a node: microseconds per row of ``arrow_codec.arrow_rows`` per column kind (no Spark).

Builds Arrow IPC chunks shaped like the ones a DataFrame feed task sends for the C24
DataFrame of ``scripts/bench_feed.py`` (modes 6/7): ``img array<array<float>>`` (28 x 28),
``vec`` a dense Spark ML vector (4 values), ``st struct<a double, b long>``, ``ints
array<bigint>`` with a null and a value above 2**53 in every 7th row, ``label long``; plus
a sparse ML vector column for reference. Every chunk carries the Spark schema metadata the
feed puts there (``feed_schema_json``). Each column kind is timed alone (a one-column chunk
with its own Spark schema) and all C24 columns together, as the TF process decodes them
(``arrow_rows`` on the received payload, the schema JSON included). Before timing, the
decoded values are compared with the values ``df.rdd`` holds (built here in Python as
PySpark builds them), so a faster decoder that changed a value fails the run.

Prints, per kind: min and median microseconds per row over ``--repeat`` timings of
``--chunks`` chunks of ``--rows`` rows, and the load average.

Usage::

    python scripts/bench_decode.py --rows 320 --chunks 20 --repeat 7
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def _c24_columns(n: int, start: int = 0) -> dict:
    """``{kind: (arrow array, spark type, expected df.rdd values)}`` for rows ``start..start+n``."""
    import numpy as np
    import pyarrow as pa
    from pyspark.ml.linalg import DenseVector, SparseVector, VectorUDT
    from pyspark.sql import Row
    from pyspark.sql.types import ArrayType, DoubleType, FloatType, LongType, StructField, StructType

    ids = np.arange(start, start + n, dtype=np.int64)
    i = np.arange(28)[:, None] * 28 + np.arange(28)[None, :]
    imgs = (((ids[:, None, None] * 7 + i[None]) % 1000) / 1000.0).astype(np.float32)
    img = pa.ListArray.from_arrays(
        pa.array(np.arange(0, n * 28 + 1, 28, dtype=np.int32)),
        pa.ListArray.from_arrays(pa.array(np.arange(0, n * 784 + 1, 28, dtype=np.int32)), pa.array(imgs.reshape(-1))),
    )
    udt = VectorUDT()
    vec_arrow = pa.struct([
        pa.field("type", pa.int8(), nullable=False), pa.field("size", pa.int32()),
        pa.field("indices", pa.list_(pa.field("element", pa.int32(), nullable=False))),
        pa.field("values", pa.list_(pa.field("element", pa.float64(), nullable=False))),
    ])
    dense = [DenseVector([float(x), float(x % 13), 0.5, float(x % 3)]) for x in ids.tolist()]
    sparse = [SparseVector(16, [int(x % 16)], [float(x)]) if x % 5 else None for x in ids.tolist()]

    def vec_array(vs: list) -> "pa.Array":
        return pa.array([None if v is None else dict(zip(("type", "size", "indices", "values"), udt.serialize(v)))
                         for v in vs], vec_arrow)

    st_type = StructType([StructField("a", DoubleType()), StructField("b", LongType())])
    st_vals = [Row(a=float(x) / 2, b=int(x) * 3) for x in ids.tolist()]
    st = pa.array([{"a": r.a, "b": r.b} for r in st_vals], pa.struct([("a", pa.float64()), ("b", pa.int64())]))
    ints_vals = [[1152921504606846977 + x, None] if x % 7 == 0 else [x, x + 1] for x in ids.tolist()]
    ints = pa.array(ints_vals, pa.list_(pa.int64()))
    labels = (ids % 10).tolist()
    return {
        "img": (img, ArrayType(ArrayType(FloatType())), [imgs[k] for k in range(n)]),
        "vec": (vec_array(dense), VectorUDT(), dense),
        "st": (st, st_type, st_vals),
        "ints": (ints, ArrayType(LongType()), ints_vals),
        "label": (pa.array(labels, pa.int64()), LongType(), labels),
        "sparse_vec": (vec_array(sparse), VectorUDT(), sparse),
    }


def _chunk(cols: dict, names: list) -> bytearray:
    """One Arrow IPC stream payload of the named columns, with the feed's Spark schema metadata."""
    import pyarrow as pa
    from pyspark.sql.types import StructField, StructType

    from tfos._data.arrow_codec import feed_schema_json
    from tfos._data.arrow_views import SPARK_SCHEMA_KEY

    batch = pa.RecordBatch.from_arrays([cols[k][0] for k in names], names)
    text = feed_schema_json(StructType([StructField(k, cols[k][1]) for k in names]), True)
    if text is not None:
        batch = batch.replace_schema_metadata({SPARK_SCHEMA_KEY: text.encode()})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as w:
        w.write_batch(batch)
    return bytearray(sink.getvalue().to_pybytes())


def _same(got, want) -> bool:
    """Equal values of equal Python types (numpy arrays: same dtype, shape and numbers)."""
    import numpy as np

    if isinstance(want, np.ndarray):
        return isinstance(got, np.ndarray) and got.dtype == want.dtype and np.array_equal(got, want)
    if type(got) is not type(want):
        return False
    if isinstance(want, (list, tuple)) and not hasattr(want, "__fields__"):
        return len(got) == len(want) and all(_same(g, w) for g, w in zip(got, want))
    if hasattr(want, "__fields__"):
        return got.__fields__ == want.__fields__ and all(_same(g, w) for g, w in zip(got, want))
    return bool(got == want)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=320, help="rows per chunk (a C24 chunk of ~1 MB has ~320)")
    ap.add_argument("--chunks", type=int, default=20, help="chunks decoded per timing")
    ap.add_argument("--repeat", type=int, default=7)
    a = ap.parse_args()

    from tfos._data.arrow_codec import arrow_rows

    cols = _c24_columns(a.rows)
    kinds = [["img"], ["vec"], ["st"], ["ints"], ["label"], ["sparse_vec"], ["img", "vec", "st", "ints", "label"]]
    print(f"load average at start: {os.getloadavg()[0]:.2f}", flush=True)
    print(f"{'column kind':<28}{'min us/row':>12}{'median':>10}")
    for names in kinds:
        payload = _chunk(cols, names)
        rows = arrow_rows(payload)
        for j, name in enumerate(names):
            want = cols[name][2]
            got = [r[j] for r in rows]
            assert len(got) == len(want) and all(_same(g, w) for g, w in zip(got, want)), (
                f"{name}: decoded values differ from df.rdd's: {got[:3]} vs {want[:3]}")
        times = []
        for _ in range(a.repeat):
            t0 = time.perf_counter()
            for _ in range(a.chunks):
                arrow_rows(payload)
            times.append((time.perf_counter() - t0) / (a.chunks * a.rows) * 1e6)
        label = "+".join(names) if len(names) > 1 else names[0]
        print(f"{label:<28}{min(times):>12.2f}{statistics.median(times):>10.2f}", flush=True)
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
