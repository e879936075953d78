"""Spark feed and inference tasks (built on the driver, run in Spark tasks).

Each task takes one partition of one epoch, picks a node (its own executor's node
first), authenticates to the node's data server and streams the partition in chunks:
raw PySpark frames when possible (no unpickling here), pickled batches otherwise, or
Arrow record batches for DataFrames. It never does per-row IPC, and it never holds a
row longer than the plan's linger time (:mod:`tfos._data.outbox`): a frame goes out when
it is full or when its oldest row is that old, whichever comes first.

What a task does when the node cannot take data:

* the node called ``DataFeed.terminate()`` -> the partition is skipped at once, without
  reading its rows;
* the node's ``main_fun`` already returned -> the partition is skipped and counted; the
  driver logs a warning with the count (docs/datafeed.md "Ending early");
* the node failed or died -> the task reports a feed failure to the driver (which cancels
  this cluster's jobs) and raises an error naming the node and the partition;
* the process on the node's data port does not prove it is the node (it took over a
  released port, or relays to another node, which refuses the handshake) -> nothing but
  a nonce and a proof bound to that process's nonce and to the node's identity was sent
  to it; the task tells the driver (a WARNING there names the node and the connection),
  fails over to the next fed node, and when none authenticates it reports and raises an
  error naming the node and why (docs/reliability.md "Data plane");
* the node already received this partition index of this feed (Spark re-ran the task
  after a retry or a stage resubmission) -> the task raises instead of feeding twice.

Every frame in both directions is encrypted and authenticated (:mod:`tfos._data.framing`):
a partition counts as consumed only on an authenticated ``A`` frame, and result frames are
yielded (and later unpickled by Spark) only after their tag checked.
"""

from __future__ import annotations

import logging
import pickle
import struct
import threading
import time
from typing import Any, Iterator, Optional, Union

from tfos._common.wire import DataAuthError
from tfos._data.arrow_chunks import ARROW_CHUNK_BYTES, arrow_ipc_parts, arrow_slices, rename_columns
from tfos._data.arrow_views import SPARK_SCHEMA_KEY
from tfos._data.feed_link import (
    Link,
    auth_lost,
    drain_answer,
    node_gone,
    open_link,
    report,
    tell_done,
    tell_sent,
    tell_skipped,
    timed_out,
)
from tfos._data.feed_plan import FeedPlan
from tfos._data.framing import MAX_DATA_FRAME_BYTES, ChunkKind, FeedState, FrameType, parse_json
from tfos._data.outbox import InputFailed, Outbox
from tfos.errors import FeedError, FeedTimeoutError, TFOSError

__all__ = ["make_feed_fn", "make_arrow_feed_fn", "make_infer_fn", "arrow_safe_dataframe"]

log = logging.getLogger(__name__)

#: Most rows per chunk when rows are pickled in the task (RDDs that are not fed as raw
#: PySpark batches, e.g. a Python-pipelined RDD run in the feed task's own worker); fewer
#: when the rows are large (a chunk of about :data:`PACK_BYTES`).
GENERIC_CHUNK_ROWS = 1024
#: Bytes of PySpark pickled batches a feed task packs into one data frame
#: (``ChunkKind.PICKLED_BATCHES``; a frame closes once it holds at least this many, so it
#: is at most this plus one batch). PySpark pickles an RDD's rows in batches of about 64 to
#: 100 KB (32 MNIST rows), and each frame costs a tag, a send, a receive and a queue
#: hand-over on top of its bytes: ``scripts/bench_frame_hop.py`` measures the
#: difference.
PACK_BYTES = 1 << 20


class _Packing:
    """How the items a feed task reads from its partition become data frame payloads
    (Spark task).

    * ``ChunkKind.PICKLED_BATCHES`` (PySpark's raw pickled batches): packed, each batch
      preceded by its uint32 big-endian length, into frames of at least :data:`PACK_BYTES`
      (at most that plus one batch, and never past ``MAX_DATA_FRAME_BYTES``); a payload is
      a list of parts (the prefixes and the batches themselves, not copied), sent as one
      frame by :func:`~tfos._data.framing.send_frame_parts`;
    * kind None (rows): pickled in chunks of up to :data:`GENERIC_CHUNK_ROWS` rows, as
      many as make about :data:`PACK_BYTES` by the size of the rows pickled so far (the
      first chunk holds one row);
    * any other kind (Arrow IPC parts, other raw frames): one item per frame, as it is.

    Whatever the kind, a frame also goes out once its oldest item is ``plan.linger_s`` old
    (:class:`~tfos._data.outbox.Outbox`).
    """

    def __init__(self, kind: Optional[ChunkKind]):
        self.kind = kind
        if kind is ChunkKind.PICKLED_BATCHES:
            self.limit, self.max_size = PACK_BYTES, MAX_DATA_FRAME_BYTES
        elif kind is None:
            # The first frame holds one row: its pickled size sets the chunk size of the
            # next ones (rows of 1 MiB must not make a chunk of 1 GiB).
            self.limit, self.max_size = 1, GENERIC_CHUNK_ROWS
        else:
            self.limit, self.max_size = 1, 1

    def outbox(self, linger_s: float) -> Outbox:
        """A new :class:`Outbox` for one partition."""
        return Outbox(self.limit, linger_s, self.max_size)

    def size(self, item: Any) -> int:
        """``item``'s share of a frame (bytes with its prefix, or 1).

        Raises:
            ValueError: A PySpark batch too large for a data frame on its own (2 GiB - 5
                bytes or more).
        """
        if self.kind is not ChunkKind.PICKLED_BATCHES:
            return 1
        n = len(item) if isinstance(item, (bytes, bytearray)) else memoryview(item).nbytes
        if 4 + n > MAX_DATA_FRAME_BYTES:
            raise ValueError(f"a PySpark batch of {n} bytes is too large to feed (a data frame holds at most "
                             f"{MAX_DATA_FRAME_BYTES} bytes): use more partitions or smaller rows")
        return 4 + n

    def payload(self, items: list, outbox: Optional[Outbox] = None) -> Any:
        """The payload of one frame holding ``items`` (bytes-like, or a list of parts).

        For rows, the chunk size of later frames is adapted on ``outbox``: as many rows as
        make about :data:`PACK_BYTES`, at most :data:`GENERIC_CHUNK_ROWS`.
        """
        if self.kind is ChunkKind.PICKLED_BATCHES:
            parts: list = []
            for batch in items:
                n = len(batch) if isinstance(batch, (bytes, bytearray)) else memoryview(batch).nbytes
                parts.append(_BATCH_LEN.pack(n))
                parts.append(batch)
            return parts
        if self.kind is None:
            data = pickle.dumps(items, protocol=pickle.HIGHEST_PROTOCOL)
            if outbox is not None:
                per_row = max(1, len(data) // len(items))
                outbox.set_limit(max(1, min(GENERIC_CHUNK_ROWS, PACK_BYTES // per_row)))
            return data
        if len(items) != 1:  # pragma: no cover - Outbox(limit=1) hands these out one by one
            raise AssertionError(f"{len(items)} items taken for a one-item frame")
        return items[0]


#: Seconds beyond ``feed_timeout`` a feed task waits for its sender thread to end (each of
#: its sends is bounded by ``feed_timeout`` already).
_SENDER_JOIN_SLACK_S = 30.0


class _InputRaised(Exception):
    """Reading the partition raised :attr:`exc` (the RDD's or DataFrame's own code, e.g.
    an ``OSError`` of a remote read): not a fault of the node or of the connection. The
    caller re-raises :attr:`exc` itself."""

    def __init__(self, exc: Exception):
        super().__init__(repr(exc))
        self.exc = exc


def _send_loop(link: Link, outbox: Outbox, packing: _Packing, out: dict, watch_node: bool) -> None:
    """The sender thread of one partition: frames from ``outbox`` to the node, then the
    end marker (Spark task). Sets ``out["state"]`` ('sent', 'interrupted': the node spoke
    first, 'input_failed': the input raised) or ``out["error"]``. With ``watch_node`` (train) it
    stops as soon as the node sent something (T or X); inference results come while it
    sends, so an inference task does not watch."""
    try:
        while True:
            items = outbox.take()
            if items is None:
                link.send(FrameType.END)
                out["state"] = "sent"
                return
            if watch_node and link.peer_spoke():
                out["state"] = "interrupted"
                outbox.stop()
                return
            link.send(FrameType.DATA, packing.payload(items, outbox))
    except InputFailed:
        out["state"] = "input_failed"  # no END: the partition was not read to its end
    except BaseException as exc:  # noqa: BLE001 - re-raised by _stream in the task's thread
        out["error"] = exc
        outbox.stop()


def _stream(link: Link, items: Iterator[Any], packing: _Packing, watch_node: bool = True) -> str:
    """Reads ``items`` (this thread) while a sender thread sends them in frames, then the
    end marker; each item waits at most ``plan.linger_s`` to be sent (Spark task).

    Returns:
        'sent', or 'interrupted' when the node spoke first (a T or X frame: the caller
        reads it; only with ``watch_node``).

    Raises:
        _InputRaised: Reading ``items`` raised (the node gets no end marker: the partition
            was not read to its end).
        FeedTimeoutError, ConnectionError, OSError, DataAuthError: From the sends.
    """
    outbox = packing.outbox(link.plan.linger_s)
    out: dict = {}
    sender = threading.Thread(target=_send_loop, args=(link, outbox, packing, out, watch_node), name="tfos-feed-send",
                              daemon=True)
    sender.start()
    try:
        for item in items:
            if not outbox.put(item, packing.size(item)):
                break  # the sender stopped: an error, or the node spoke
        else:
            outbox.end()
    except BaseException as exc:
        outbox.fail()
        sender.join(link.plan.feed_timeout_s + _SENDER_JOIN_SLACK_S)
        if isinstance(exc, Exception):
            raise _InputRaised(exc) from None
        raise
    sender.join(link.plan.feed_timeout_s + _SENDER_JOIN_SLACK_S)
    if sender.is_alive():
        raise FeedTimeoutError(
            f"{link.node.name} accepted no data for {link.plan.feed_timeout_s:g} s while feeding {link.where}"
        )
    if "error" in out:
        raise out["error"]
    return str(out.get("state", "interrupted"))


_BATCH_LEN = struct.Struct(">I")


def _feed_partition(plan: FeedPlan, index: int, items: Iterator[Any]) -> tuple[int, str]:
    """Feeds one partition's ``items`` (PySpark's raw batches, rows or Arrow parts, as
    ``plan.kind`` says) to its node and waits for the node's answer (Spark task).

    Returns:
        ``(index, outcome)``: a :class:`FeedState` (OK, TERMINATED, SKIPPED).
    """
    link, node, state = open_link(plan, index)
    if link is None:
        tell_skipped(plan, index)
        tell_sent(plan, index)
        if state == FeedState.TERMINATED:
            tell_done(plan, index)
        return index, FeedState.SKIPPED if state == FeedState.MAIN_FUN_RETURNED else state
    try:
        failed: Optional[Exception] = None
        try:
            _stream(link, items, _Packing(plan.kind))
            tell_sent(plan, index)
            state, info = drain_answer(link)
        except _InputRaised as raised:
            failed = raised.exc
        except FeedTimeoutError:
            raise  # a TimeoutError, hence an OSError: not a lost connection
        except DataAuthError as exc:
            auth_lost(plan, node, link.where, exc)
        except (ConnectionError, OSError) as exc:
            return index, node_gone(plan, node, link.where, exc)
        if failed is not None:
            # The RDD's own code failed (an OSError of a remote read too), not the node:
            # raised as it is, outside the except clause so that its own cause stays.
            raise failed
        if state in (FeedState.OK, FeedState.TERMINATED):
            tell_done(plan, index)
            return index, state
        if state == FeedState.MAIN_FUN_RETURNED:
            log.warning("%s: main_fun returned before the partition was consumed", link.where)
            return index, FeedState.SKIPPED
        msg = f"{link.where}: the node failed: {info.get('message', '')}"
        report(plan, node, msg)
        raise FeedError(msg)
    except FeedTimeoutError as exc:
        raise timed_out(plan, node, exc) from None
    finally:
        link.close()


def make_feed_fn(plan: FeedPlan):
    """The ``mapPartitionsWithIndex`` function of a train feed job (driver builds, task runs).

    Yields one ``(partition index, outcome)`` per partition, outcome a :class:`FeedState`:
    OK, TERMINATED (node called terminate), SKIPPED (node's main_fun had returned).

    Raises (in the task):
        FeedError, FeedTimeoutError: The node failed, died or stopped reading; both name
            the node and partition, and are also reported to the driver.
    """

    def _feed(index: int, rows: Iterator[Any]) -> Iterator[tuple[int, str]]:
        result = _feed_partition(plan, index, rows)
        if result[1] != FeedState.OK:
            _drain(rows)
        yield result

    return _feed


#: Seconds a feed task that skips its partition (the node called terminate() or its
#: main_fun returned) spends reading the rest of the partition's input and dropping it.
#: A PySpark worker that leaves input unread exits after its task instead of serving the
#: next one, which then starts a new worker and imports tfos again (a 3x slower skip of the
#: remaining partitions was measured before this); reading a cached partition takes
#: milliseconds, and the bound keeps an expensive one from being computed for nothing.
SKIP_DRAIN_S = 0.25


def _drain(items: Iterator[Any], budget_s: float = SKIP_DRAIN_S) -> bool:
    """Reads and drops what is left of ``items`` for at most ``budget_s`` s (Spark task).

    Returns:
        True when the input was read to its end (Spark can reuse the Python worker); False
        when the budget ran out or reading raised (the error is dropped: the rows were
        skipped anyway).
    """
    deadline = time.monotonic() + budget_s
    try:
        for n, _ in enumerate(items, 1):
            if n % 64 == 0 and time.monotonic() > deadline:
                return False
    except Exception:  # noqa: BLE001 - the RDD's own code failed on rows nobody wants: skipped as before
        return False
    return True


def arrow_safe_dataframe(df: Any) -> tuple[Any, Optional[list]]:
    """``df`` ready for ``mapInArrow``, and the column names its record batches must get back (driver).

    PySpark's ``mapInArrow`` (classic and Spark Connect) passes its input columns to the
    function by name (``df[name]``), which fails for names Spark's resolver reads otherwise:
    a dot (``feature.x``: a nested field), a backtick, or a name twice (``a.id`` and
    ``b.id`` after a join; Spark compares names case-insensitively by default). For such a
    DataFrame this returns ``df.toDF("_c0", "_c1", ...)`` (columns renamed by position) and
    the original names, which the feed task puts back on every record batch
    (:func:`rename_columns`), so the node sees the names ``df.rdd`` has. Otherwise ``(df, None)``.
    """
    names = list(df.columns)
    if len({n.lower() for n in names}) == len(names) and not any("." in n or "`" in n for n in names):
        return df, None
    return df.toDF(*[f"_c{i}" for i in range(len(names))]), names


def make_arrow_feed_fn(plan: FeedPlan, spark_schema_json: Optional[str] = None, column_names: Optional[list] = None):
    """The ``mapInArrow`` function of a DataFrame train feed (driver builds, task runs).

    Each Arrow record batch Spark hands the task is cut into zero-copy slices of about
    :data:`ARROW_CHUNK_BYTES`, and each slice is sent as one IPC stream chunk whose data
    buffers go from Spark's batch to the socket without a copy (:func:`arrow_ipc_parts`);
    the function yields one record batch ``{partition: int64, outcome: string}``.

    Args:
        plan: The feed plan.
        spark_schema_json: The DataFrame's Spark schema (``df.schema.json()``), put into
            every chunk's Arrow schema metadata (:data:`tfos._data.arrow_views.SPARK_SCHEMA_KEY`)
            so the node can decode UDT columns (Spark ML vectors), whose Arrow form is a bare
            struct. None (the default) when no column needs it (see :func:`tfos._data.arrow_codec.feed_schema_json`).
        column_names: The DataFrame's own column names when the driver renamed its columns
            for ``mapInArrow`` (:func:`arrow_safe_dataframe`); None when it did not.
    """
    meta = {SPARK_SCHEMA_KEY: spark_schema_json.encode("utf-8")} if spark_schema_json else None

    def _feed(batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa
        from pyspark import TaskContext

        tc = TaskContext.get()
        if tc is None:
            raise TFOSError("the DataFrame feed function must run in a Spark task")
        index = tc.partitionId()

        def chunks() -> Iterator[Any]:
            for b in batches:
                b = rename_columns(b, column_names)
                schema = b.schema.with_metadata(meta) if meta is not None else b.schema
                for piece in arrow_slices(b, ARROW_CHUNK_BYTES):
                    yield arrow_ipc_parts(piece, schema)

        _, outcome = _feed_partition(plan, index, chunks())
        if outcome != FeedState.OK:
            _drain(batches)
        yield pa.RecordBatch.from_pydict({"partition": pa.array([index], pa.int64()), "outcome": pa.array([outcome])})

    return _feed


def make_infer_fn(plan: FeedPlan):
    """The partition function of an inference job (driver builds, task runs).

    Sends the partition from a sender thread while reading results, so neither side can
    block the other. Yields the node's result frames unchanged: each is a pickled list of
    results, one per input row, in input order.

    Raises (in the task):
        FeedError, FeedTimeoutError: As for training; also when the node ends without
            answering every row (names how many rows were left).
    """

    def _infer(index: int, rows: Iterator[Any]) -> Iterator[Union[bytes, bytearray]]:
        link, node, state = open_link(plan, index)
        if link is None:
            if state == FeedState.TERMINATED:
                _drain(rows)
                return
            msg = f"partition {index} -> {node.name}: the node is not running inference (state {state})"
            report(plan, node, msg)
            raise FeedError(msg)
        send_error: list[BaseException] = []
        input_failed = threading.Event()

        def _send() -> None:
            # Reads the partition (rows may come from the RDD's own code, pipelined into
            # this worker) while _stream's sender thread sends them.
            try:
                _stream(link, rows, _Packing(plan.kind), watch_node=False)
            except _InputRaised as raised:
                # Reading the input failed: the node gets no end marker, so wake the reader
                # below (blocked on the node's answer) instead of letting it wait for
                # feed_timeout; it raises this error.
                send_error.append(raised.exc)
                input_failed.set()
                link.shutdown()
            except BaseException as exc:  # noqa: BLE001 - surfaced by the reader below
                send_error.append(exc)

        sender = threading.Thread(target=_send, name="tfos-infer-send", daemon=True)
        sender.start()
        try:
            while True:
                try:
                    ftype, payload = link.recv()
                except FeedTimeoutError:
                    raise  # a TimeoutError, hence an OSError: not a lost connection
                except DataAuthError as exc:
                    auth_lost(plan, node, link.where, exc)
                except (ConnectionError, OSError) as exc:
                    if input_failed.is_set():
                        break  # the input failed (see _send): raised below
                    node_gone(plan, node, link.where, exc)
                    msg = f"{link.where}: main_fun returned before answering every row of the partition"
                    report(plan, node, msg)
                    raise FeedError(msg) from None
                if ftype is FrameType.RESULTS:
                    yield payload  # a bytearray; the worker writes it to the JVM verbatim
                elif ftype is FrameType.RESULTS_END:
                    break
                elif ftype is FrameType.TERMINATED:
                    break
                else:
                    info = parse_json(ftype, payload)
                    msg = f"{link.where}: {info.get('message') or 'the node ended before answering every row'}"
                    report(plan, node, msg)
                    raise FeedError(msg)
            sender.join(plan.feed_timeout_s + _SENDER_JOIN_SLACK_S)
            if send_error and (input_failed.is_set() or not isinstance(send_error[0], (ConnectionError, OSError))):
                raise send_error[0]
        except FeedTimeoutError as exc:
            raise timed_out(plan, node, exc) from None
        finally:
            link.close()

    return _infer
