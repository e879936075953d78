"""Driver plane: the Spark driver side of a cluster (runs in the user's pyspark program).

``cluster`` (run, TFCluster), ``lifecycle`` (the lifecycle states and the controller that
owns restarts), ``open_clusters`` (SIGTERM and interpreter exit), ``backend`` (the protocol
a cluster runs on) and ``classic`` (its SparkContext implementation; the Spark Connect one
is ``tfos._driver.connect_backend``), ``runtime`` (one classic attempt's live parts, around the
control-plane core's host, :mod:`tfos._control.host`), ``restart`` and
``recovery`` (restart policy and ledgers; cached results), ``spark_checks`` (Spark
configuration checks before launch), ``streaming`` (stream feeds), ``user_source`` (ships
main_fun's source for readable remote tracebacks). See docs/architecture.md.
"""
