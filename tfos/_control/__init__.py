"""Control plane: authenticated JSON messages between node processes and the driver.

``server`` (ControlServer: one event-loop thread on the driver, ``loop``), ``client``
(ControlClient: one connection per node process, used by Spark tasks and node processes),
``protocol`` (frames, sessions and deferred answers without I/O), ``messages`` (the typed
messages and NodeState), ``limits`` (caps and intervals that scale with the cluster). The
framing itself is in :mod:`tfos._common.wire`.
"""
