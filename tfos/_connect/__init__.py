"""Spark Connect sessions: ``client`` (the Connect client's side of TFCluster.run),
``tasks`` (Spark tasks launched through mapInArrow), ``host`` (the control host process
that holds the ControlServer and ClusterState on an executor host)."""
