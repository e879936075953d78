"""Spark DataFrame <-> TFRecord (``tf.train.Example``) conversion utilities.

This is the TensorFlowOnSpark-compatible ``dfutil`` module.  TensorFlowOnSpark
read and wrote TFRecords through the ``tensorflow-hadoop`` jar and Hadoop input
and output formats; ``tfos`` instead reads and writes them with TensorFlow's own
APIs (``tf.io.TFRecordWriter``, ``tf.data.TFRecordDataset``, ``tf.io.gfile`` and
``tf.train.Example``) inside Spark tasks, so no extra jar is needed and every
file system TensorFlow supports (local, ``file://``, and ``hdfs://``/``gs://``
where the TensorFlow build has that support) works.

Type mapping (TensorFlowOnSpark's, with two differences: ``FloatList`` features
are inferred as ``FloatType`` -- TensorFlowOnSpark used ``DoubleType`` -- since
they only hold float32 values, and arrays of strings/binaries are supported):

=======================================  ==========================  ===================================
Spark SQL column type                    ``tf.train.Feature`` kind   type inferred back by ``infer_schema``
=======================================  ==========================  ===================================
boolean, tinyint, smallint, int, bigint  ``Int64List`` (1 value)     ``LongType``
float, double                            ``FloatList`` (1 value)     ``FloatType`` (float32 precision)
string                                   ``BytesList`` (utf-8)       ``StringType``
binary                                   ``BytesList``               ``BinaryType`` if in ``binary_features``
array<one of the above>                  list of the same kind       ``ArrayType`` of the above, when the
                                                                     first record has more than one value
=======================================  ==========================  ===================================

Null handling: a null scalar or null array is written as an empty list of the
column's kind.  :func:`loadTFRecords` reads an empty list back as ``None`` for
scalar columns and as ``[]`` for array columns (so a null array becomes ``[]``);
the schema-less :func:`fromTFExample` returns ``None`` for any empty list.  Null
elements inside arrays are rejected.

TensorFlow is imported lazily, only inside the functions that run in Spark
tasks, so this module imports (and the driver runs) without TensorFlow.
Driver-side file-system work (checking the output directory, writing the
``_SUCCESS`` marker, listing input files) is also done in small Spark tasks, so
that paths are resolved by the same TensorFlow file systems that read and write
the data.  Relative local paths are made absolute on the driver first.

These functions need a classic (JVM-backed) SparkContext; Spark Connect sessions
have no RDD API.
"""

from tfos._dfutil.decode import fromTFExample
from tfos._dfutil.driver import isLoadedDF, loadedDF, loadTFRecords, saveAsTFRecords
from tfos._dfutil.encode import toTFExample
from tfos._dfutil.schema import infer_schema

__all__ = [
    "loadedDF",
    "isLoadedDF",
    "saveAsTFRecords",
    "loadTFRecords",
    "toTFExample",
    "infer_schema",
    "fromTFExample",
]
