"""Spark Connect's executor side: ``tasks`` (Spark tasks launched through mapInArrow: the
start stage, control jobs, feed and inference tasks) and ``host`` (the control host process
that runs the control-plane core's ClusterHost on an executor host). The client side, the
Spark Connect backend of TFCluster, is :mod:`tfos._driver.connect_backend`."""
