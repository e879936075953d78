"""Data plane: Spark partitions into the TF process, and inference results back.

``feed_tasks`` (Spark tasks that push partitions), ``spark_rawio`` (PySpark's serialized
frames, untouched), ``framing`` (data frames and chunk decoding), ``feed_hub`` (the TF
process's data server), ``tfdata`` (tf.data read-ahead). The public consumer is
:mod:`tfos.datafeed`.
"""
