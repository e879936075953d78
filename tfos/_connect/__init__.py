"""Spark Connect sessions: ``client`` (the Spark Connect backend of TFCluster: start stages,
control jobs, feed and inference jobs), ``tasks`` (Spark tasks launched through mapInArrow),
``host`` (the control host process that holds the ControlServer and ClusterHost on an
executor host)."""
