"""Streaming helpers of a tfos cluster (driver), and a command that asks a streaming
cluster to stop from another process.

``cluster.train(dstream)``, ``cluster.inference(dstream)``, ``cluster.train(streaming_df)``
and ``cluster.shutdown(ssc)`` are methods of :class:`tfos.TFCluster.TFCluster`; this module
adds Structured Streaming inference and the stop endpoint. This is the user-facing API; the
implementation (feeds, stop endpoint, per-cluster stream state) is
:mod:`tfos._driver.streaming`, which runs in the driver. See docs/streaming.md.

Stop a cluster waiting in ``cluster.shutdown(ssc)`` from a shell, as TFoS's
``stop_streaming.py`` did (run as the driver's user on the driver's host: the key is read
from the cluster's key file, see :func:`tfos.reservation.write_key_file`)::

    python -m tfos.streaming stop HOST PORT

HOST and PORT are in the driver's log line "streaming: ask this cluster to stop with ...".
"""

from __future__ import annotations

import argparse
from typing import Optional, Sequence

from tfos._driver.streaming import inference_stream, request_stop, stop_address, stream_stats

__all__ = ["inference_stream", "request_stop", "stop_address", "stream_stats", "main"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``stop HOST PORT``: asks the streaming cluster whose stop endpoint is HOST:PORT to
    stop (runs anywhere the key file of that endpoint is readable).

    Returns:
        0 when the stop was accepted; 2 when there is no key file for HOST:PORT (not the
        driver's user or host, or the cluster already ended and removed it) or the endpoint
        is unreachable or refused the request (one line on stderr, no traceback).
    """
    import sys

    from tfos._control import key_files
    from tfos._control import messages as _msg
    from tfos._control.client import ControlClient
    from tfos.errors import ControlProtocolError, DeadlineExceededError

    parser = argparse.ArgumentParser(prog="python -m tfos.streaming", description="Ask a streaming tfos cluster to stop.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    stop = sub.add_parser("stop", help="request a stop: shutdown(ssc) then stops the stream and the cluster")
    stop.add_argument("host")
    stop.add_argument("port", type=int)
    args = parser.parse_args(argv)
    where = f"{args.host}:{args.port}"
    known = key_files.read_key_file(args.host, args.port)
    if known is None:
        sys.stderr.write(f"tfos.streaming stop {where}: no key file for {where} in {key_files.key_dir()} (run this as the "
                         "driver's user on its host; or that cluster has already ended: its key file is removed at shutdown)\n")
        return 2
    client = ControlClient(args.host, args.port, known[0], known[1], connect_timeout_s=10.0)
    try:
        client.call(_msg.StopRequest(), timeout_s=10.0)
    except (OSError, ControlProtocolError, DeadlineExceededError) as exc:
        sys.stderr.write(f"tfos.streaming stop {where}: the stop endpoint did not accept the request: {exc}\n")
        return 2
    finally:
        client.close()
    sys.stderr.write(f"tfos.streaming stop {where}: stop requested\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
