"""Asks a streaming tfos cluster to stop, from another process (TFoS's stop_streaming.py).

Usage (as the driver's user, on the driver's host: the cluster's key is read from its key
file, see docs/streaming.md)::

    python examples/streaming/stop_streaming.py HOST PORT

HOST and PORT are in the driver's log line "streaming: ask this cluster to stop with ...".
The driver's ``cluster.shutdown(ssc)`` then stops the streaming context gracefully, ends
the feed and stops the nodes.
"""

import sys

from tfos import reservation

if __name__ == "__main__":
    client = reservation.Client((sys.argv[1], int(sys.argv[2])))
    try:
        client.request_stop()
    finally:
        client.close()
