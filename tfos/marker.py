"""TFoS's queue markers (pure; TF process and tests): ``from tensorflowonspark import marker``
becomes ``from tfos import marker``.

Only the TFoS-style row queues of :mod:`tfos.TFManager` use them: a tfos cluster feeds
chunks over its own data connections and ends partitions and feeds with frames, not
markers (see docs/migration.md).
"""

from __future__ import annotations

__all__ = ["Marker", "EndPartition"]


class Marker:
    """Base class of the special objects placed in a TFoS-style data queue."""


class EndPartition(Marker):
    """Ends one Spark partition in a TFoS-style data queue; an inference batch read by
    ``DataFeed.next_batch`` never spans it."""
