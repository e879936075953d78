"""Driver plane: the Spark driver side of a cluster (runs in the user's pyspark program).

``cluster`` (TFCluster.run, train, inference, shutdown), ``state`` (ClusterState, the pure
registry of nodes, failures and directives), ``spark_checks`` (Spark configuration checks
before launch), ``user_source`` (ships main_fun's source for readable remote tracebacks).
"""
