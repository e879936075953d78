"""TFoS's row-queue feed: ``DataFeed`` over a :mod:`tfos.TFManager` manager (TF process or test)."""

from __future__ import annotations

import logging
import queue
from typing import Any

from tfos._data.results import result_items
from tfos.errors import TFOSError
from tfos.marker import EndPartition

__all__ = ["QueueFeed"]

log = logging.getLogger(__name__)


class QueueFeed:
    """TFoS's row-queue protocol on a :mod:`tfos.TFManager` manager (TF process or test).

    Rows are single queue items; ``None`` ends the feed and a
    :class:`tfos.marker.EndPartition` ends a partition (an inference batch never spans one).
    Results go to ``qname_out``, one item per row.
    """

    def __init__(self, mgr: Any, qname_in: str, qname_out: str, train_mode: bool):
        self.mgr = mgr
        self.train_mode = train_mode
        self.queue_in = mgr.get_queue(qname_in)
        self.queue_out = mgr.get_queue(qname_out)
        if self.queue_in is None:
            raise TFOSError(f"the manager has no queue {qname_in!r}")
        self.done_feeding = False

    def next_batch(self, batch_size: int) -> list:
        out: list = []
        while len(out) < batch_size:
            item = self.queue_in.get(block=True)
            self.queue_in.task_done()
            if item is None:
                self.done_feeding = True
                break
            if isinstance(item, EndPartition):
                if not self.train_mode and out:
                    break
                continue
            out.append(item)
        return out

    def batch_results(self, results: Any) -> None:
        if self.queue_out is None:
            raise TFOSError("batch_results(): the manager has no output queue")
        for item in result_items(results):
            self.queue_out.put(item, block=True)

    def terminate(self) -> None:
        self.mgr.set("state", "terminating")
        dropped = 0
        while True:
            try:
                self.queue_in.get(block=True, timeout=5)
            except queue.Empty:
                break
            self.queue_in.task_done()
            dropped += 1
        log.info("DataFeed.terminate(): dropped %d queued items", dropped)
        self.done_feeding = True
