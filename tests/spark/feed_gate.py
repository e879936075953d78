"""Feeds that start once main_fun runs, for tests that assert a node's feed timeout.

``feed_timeout`` counts from when a node last accepted data (tfos/_data/feed_tasks.py), and
``TFCluster.run`` returns once the nodes registered, before ``main_fun`` starts: on a loaded
machine a node can still be starting (imports) for seconds while its feed task already
waits on it, and a short ``feed_timeout`` then fires before ``main_fun`` had a chance to
read. A test about what a node's feed timeout reports holds its rows back until every
``main_fun`` it feeds has called :func:`mark_started` (a file in a directory the test and the
executors share), so the timeout's clock starts where ``main_fun`` runs; the test measures
its own bounds from :func:`started_at`.

The conftest ships this module by value to the executors and node processes, as it does
the test modules.
"""

from __future__ import annotations

import glob
import os
import time
from typing import Iterable, Iterator

#: Longest a partition's rows wait for the main_funs to start (a loaded start-up, not a hang).
START_WAIT_S = 240.0


def mark_started(out: str, ctx) -> None:
    """Called first in main_fun (TF process): records that this node's main_fun runs."""
    with open(os.path.join(out, f"started-{ctx.executor_id}"), "w"):
        pass


def after_started(out: str, nodes: int, rows: Iterable) -> Iterator:
    """``rows``, once ``nodes`` main_funs called :func:`mark_started` (Spark task).

    Raises:
        TimeoutError: They had not after ``START_WAIT_S`` seconds.
    """
    end = time.monotonic() + START_WAIT_S
    while len(glob.glob(os.path.join(out, "started-*"))) < nodes:
        if time.monotonic() > end:
            raise TimeoutError(f"only {len(glob.glob(os.path.join(out, 'started-*')))} of {nodes} main_fun(s) started "
                               f"within {START_WAIT_S:g} s")
        time.sleep(0.05)
    yield from rows


def started_at(out: str) -> float:
    """Wall-clock time (``time.time()``) the last of the main_funs started (driver)."""
    return max(os.stat(p).st_mtime for p in glob.glob(os.path.join(out, "started-*")))
