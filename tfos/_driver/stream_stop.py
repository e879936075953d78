"""The stop endpoint of a streaming cluster: its own control server (driver). See
docs/streaming.md "Asking a streaming cluster to stop from outside"."""

from __future__ import annotations

import atexit
import logging
import threading
from typing import Any

from tfos._control import key_files
from tfos._control import messages as _msg

__all__ = ["StopEndpoint"]

log = logging.getLogger(__name__)


class StopEndpoint:
    """The authenticated stop endpoint of a streaming cluster: its own control server (driver).

    A :class:`~tfos._control.messages.StopRequest` to the cluster's control server ends
    ``shutdown(ssc)``'s wait (``python -m tfos.streaming stop HOST PORT``, or TFoS's
    ``reservation.Client((host, port)).request_stop()``). The cluster key and id go to a
    key file readable only by this user (:func:`tfos._control.key_files.write_key_file`),
    never to the log; no second listener is opened.
    """

    def __init__(self, backend: Any) -> None:
        server, config = backend.server, backend.config
        self._requested = threading.Event()
        backend.runtime.host.route(_msg.StopRequest, self._on_stop)
        self.address = key_files.ServerAddress((str(server.host), int(server.port)), config.key, config.cluster_id)
        self.key_file = key_files.write_key_file(self.address)
        atexit.register(key_files.remove_key_file, self.address)  # also when shutdown() never runs
        log.info("streaming: ask this cluster to stop with python -m tfos.streaming stop %s %d (or "
                 "tfos.reservation.Client((%r, %d)).request_stop()); key file %s",
                 self.address[0], self.address[1], self.address[0], self.address[1], self.key_file)

    def _on_stop(self, msg: _msg.StopRequest) -> dict:
        log.info("streaming: a stop was requested")
        self._requested.set()
        return {"data": "OK"}

    @property
    def requested(self) -> bool:
        return self._requested.is_set()

    def request(self) -> None:
        self._requested.set()

    def close(self) -> None:
        key_files.remove_key_file(self.address)
