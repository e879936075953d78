"""Data plane: Spark partitions into the TF process, and inference results back.

Spark tasks: ``feed_tasks`` (push partitions; ``feed_plan``, ``feed_link``, ``arrow_chunks``),
``spark_rawio`` (PySpark's serialized records, untouched). Pure: ``framing`` (data frames and
chunk decoding), ``arrow_codec``/``arrow_vectors``/``arrow_views`` (the Arrow/Spark type
codec). TF process: ``feed_hub`` and ``feed_connection`` (the data server), ``tfdata`` (tf.data
read-ahead; ``epoch_order``, ``epoch_steps``, ``shuffle``, ``chunk_columns``). The public
consumer is :mod:`tfos.datafeed`.
"""
