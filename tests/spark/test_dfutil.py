"""Spark tests of tfos.dfutil (TFRecord save/load) and tfos.compat (SavedModel export).

Uses a module-scoped SparkSession on ``local-cluster[2,1,1024]`` (two separate
executor JVMs), so the TFRecord reads and writes really happen in executor
Python workers.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

pytest.importorskip("tensorflow")
pytest.importorskip("pyspark")

from pyspark.sql import DataFrame, SparkSession  # noqa: E402
from pyspark.sql.types import (  # noqa: E402
    ArrayType,
    BinaryType,
    FloatType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
)

from tfos import compat, dfutil  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.tf]

NUM_ROWS = 60
NUM_PARTITIONS = 3


@pytest.fixture(scope="module")
def spark(spark_manager) -> Iterator[SparkSession]:
    """A SparkSession over the shared local-cluster[2,1,1024] context (two executor JVMs)."""
    yield SparkSession(spark_manager.get())


def _source_rows() -> list[tuple[int, list[float], str, bytearray]]:
    rng = np.random.default_rng(42)
    images = rng.random((NUM_ROWS, 784), dtype=np.float32)  # float32 values survive the FloatList round trip
    return [
        (i, images[i].tolist(), f"sample-{i}-ü", bytearray(rng.bytes(16) + bytes([i])))
        for i in range(NUM_ROWS)
    ]


@pytest.fixture(scope="module")
def source_df(spark: SparkSession) -> DataFrame:
    schema = StructType(
        [
            StructField("label", IntegerType()),
            StructField("image", ArrayType(FloatType())),
            StructField("text", StringType()),
            StructField("raw", BinaryType()),
        ]
    )
    return spark.createDataFrame(_source_rows(), schema).repartition(NUM_PARTITIONS)


def test_save_and_load_round_trip(spark: SparkSession, source_df: DataFrame, tmp_path: Path) -> None:
    output_dir = str(tmp_path / "tfr")
    dfutil.saveAsTFRecords(source_df, output_dir)

    names = sorted(os.listdir(output_dir))
    assert names == ["_SUCCESS"] + [f"part-r-{i:05d}" for i in range(NUM_PARTITIONS)]

    loaded = dfutil.loadTFRecords(spark.sparkContext, output_dir, binary_features=["raw"])
    assert loaded.schema == StructType(
        [
            StructField("image", ArrayType(FloatType()), True),
            StructField("label", LongType(), True),
            StructField("raw", BinaryType(), True),
            StructField("text", StringType(), True),
        ]
    )
    assert loaded.rdd.getNumPartitions() == NUM_PARTITIONS  # one task per part file

    collected = loaded.collect()
    assert len(collected) == NUM_ROWS
    expected = {label: (image, text, bytes(raw)) for label, image, text, raw in _source_rows()}
    got = {row.label: (row.image, row.text, bytes(row.raw)) for row in collected}
    assert got == expected

    # The registry of loaded DataFrames (used to reuse TFRecords instead of re-writing them).
    assert dfutil.isLoadedDF(loaded)
    assert dfutil.loadedDF[loaded] == output_dir
    assert not dfutil.isLoadedDF(source_df)
    assert not dfutil.isLoadedDF(loaded.select("label"))

    # file:// URIs, single files and comma-separated lists of paths work too.
    some_files = ",".join(f"file://{output_dir}/part-r-{i:05d}" for i in range(NUM_PARTITIONS - 1))
    subset = dfutil.loadTFRecords(spark.sparkContext, some_files, binary_features=["raw"])
    assert 0 < subset.count() < NUM_ROWS

    # Writing into a non-empty directory is refused, like Hadoop's output formats.
    with pytest.raises(FileExistsError):
        dfutil.saveAsTFRecords(source_df, output_dir)


def test_load_errors(spark: SparkSession, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "_SUCCESS").touch()
    with pytest.raises(ValueError, match="no TFRecord files"):
        dfutil.loadTFRecords(spark.sparkContext, str(empty))
    with pytest.raises(FileNotFoundError):
        dfutil.loadTFRecords(spark.sparkContext, str(tmp_path / "does-not-exist"))


def test_save_rejects_unsupported_column(spark: SparkSession, tmp_path: Path) -> None:
    df = spark.createDataFrame([(1, {"a": 1})], "id int, props map<string,int>")
    with pytest.raises(TypeError, match="'props'"):
        dfutil.saveAsTFRecords(df, str(tmp_path / "bad"))
    assert not (tmp_path / "bad").exists()  # rejected on the driver before any job ran


# --------------------------------------------------------------------------- #
# compat (runs in this process; it needs TensorFlow but no Spark)
# --------------------------------------------------------------------------- #


def _inputs() -> np.ndarray:
    return np.random.default_rng(1).random((5, 4), dtype=np.float32)


def test_export_saved_model_tf_keras(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tf_keras = pytest.importorskip("tf_keras")
    import tensorflow as tf

    model = tf_keras.Sequential([tf_keras.Input((4,)), tf_keras.layers.Dense(3, activation="relu")])
    x = _inputs()
    export_dir = str(tmp_path / "chief")
    compat.export_saved_model(model, export_dir, is_chief=True)

    restored = tf_keras.models.load_model(export_dir)
    np.testing.assert_allclose(restored.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6)
    loaded = tf.saved_model.load(export_dir)  # keep a reference while its functions are used
    (output,) = loaded.signatures["serving_default"](tf.constant(x)).values()
    np.testing.assert_allclose(output.numpy(), model.predict(x, verbose=0), rtol=1e-6)

    # A non-chief worker saves to a temporary dir, which is removed afterwards.
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(scratch))
    compat.export_saved_model(model, str(tmp_path / "worker"), is_chief=False)
    assert not (tmp_path / "worker").exists()
    assert list(scratch.iterdir()) == []


def test_export_saved_model_keras3(tmp_path: Path) -> None:
    keras = pytest.importorskip("keras")
    if int(keras.__version__.split(".")[0]) < 3:
        pytest.skip("needs Keras 3")
    import tensorflow as tf

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="relu")])
    x = _inputs()
    export_dir = str(tmp_path / "k3")
    compat.export_saved_model(model, export_dir, is_chief=True)

    reloaded = tf.saved_model.load(export_dir)
    np.testing.assert_allclose(reloaded.serve(tf.constant(x)).numpy(), model.predict(x, verbose=0), rtol=1e-6)
    assert "serving_default" in reloaded.signatures


def test_export_saved_model_rejects_non_models(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="cannot export"):
        compat.export_saved_model(object(), str(tmp_path / "x"), is_chief=True)


def test_disable_auto_shard_and_gpu_probe() -> None:
    import tensorflow as tf

    options = tf.data.Options()
    assert compat.disable_auto_shard(options) is options
    assert options.experimental_distribute.auto_shard_policy == tf.data.experimental.AutoShardPolicy.OFF
    assert compat.is_gpu_available() == bool(tf.config.list_physical_devices("GPU"))
