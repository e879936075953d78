"""TFoS's own runtime, kept for TFoS programs that use its pieces directly (not used by
``TFCluster.run``).

``reservation`` (TFoS's reservation server and client; ``message_socket``), ``manager``
(``TFManager``, named queues in a multiprocessing manager; ``DataFeed`` reads them through
:mod:`tfos._data.queue_feed`) and ``spark_node`` (``TFSparkNode.run``: one unsupervised node in the foreground of
a Spark task). Their public paths are TFoS's: :mod:`tfos.reservation`, :mod:`tfos.TFManager`
and :mod:`tfos.TFSparkNode`, modules that re-export these. docs/migration.md says what differs
from TFoS.
"""
