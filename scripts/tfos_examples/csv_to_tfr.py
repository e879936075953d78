"""Writes TFoS's MNIST TFRecords (``label`` int64[1], ``image`` int64[784]) from its CSV with
tfos.dfutil, for scripts/run_tfos_examples.sh when TFoS's tensorflow-hadoop jar wrote no
files (it writes none under Spark 4 / Hadoop 3.4). Driver program: spark-submit it."""

import os
import shutil
import sys

from pyspark.sql import SparkSession
from pyspark.sql.types import ArrayType, LongType, StructField, StructType

from tfos import dfutil

base = sys.argv[1]
spark = SparkSession.builder.appName("csv_to_tfr").getOrCreate()
schema = StructType([StructField("label", LongType()), StructField("image", ArrayType(LongType()))])
for split in ("train", "test"):
    out = f"{base}/tfr/{split}"
    if os.path.isdir(out) and not [f for f in os.listdir(out) if f.startswith("part-")]:
        shutil.rmtree(out)  # the jar's empty output (only _SUCCESS)
    rows = spark.sparkContext.textFile(f"{base}/csv/{split}").map(lambda ln: [int(x) for x in ln.split(",")]).map(lambda v: (v[0], v[1:]))
    dfutil.saveAsTFRecords(spark.createDataFrame(rows, schema), out)
spark.stop()
