"""tfos.dfutil's implementation, by concern: ``schema`` (type mapping and inference),
``encode`` (Rows -> tf.train.Example), ``decode`` (tf.train.Example -> Rows), ``files``
(TFRecord files and the output commit) and ``driver`` (saveAsTFRecords / loadTFRecords).
"""
