"""Control plane: authenticated JSON messages between node processes and the driver.

``server`` (ControlServer, a thread on the driver), ``client`` (ControlClient, used by
Spark tasks and node processes). The framing itself is in :mod:`tfos._common.wire`.
"""
