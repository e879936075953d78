"""Executor plane: the processes of one node.

``start_task`` (the Spark task that starts a node), ``launch`` (what the driver hands a
node), ``supervisor`` (watches the TF process, heartbeats), ``tf_process`` (runs
``main_fun``; ``tensorboard``, ``preimport``, ``node_failure``), ``output`` (forwards the
node's stdout/stderr to the driver); ``context`` (``ctx``, re-exported by :mod:`tfos.node_context`),
``server`` (re-exported by :mod:`tfos.tf_server`) with ``port_handover`` and ``sharding``.
"""
