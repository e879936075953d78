"""Streaming feeds of a :class:`~tfos._driver.cluster.TFCluster` (driver only): the
implementation; the public, TFoS-compatible module :mod:`tfos.streaming` is the user-facing
API over it (Structured Streaming inference, the stop command) and re-exports its entry points.

Two Spark streaming APIs feed the same data plane as ``train()``/``inference()``:

- Spark Streaming (DStreams, ``pyspark.streaming``; deprecated by Spark but still shipped):
  ``cluster.train(dstream)`` registers a ``foreachRDD`` that feeds every micro-batch RDD
  with ``train()`` itself (same framing, acknowledgements and fail-fast);
  ``cluster.inference(dstream)`` returns a DStream whose every micro-batch RDD is
  ``cluster.inference(rdd)``; ``cluster.shutdown(ssc)`` waits, as TFoS did, until the
  streaming context ends or someone asks the cluster to stop (from outside with ``python -m
  tfos.streaming stop HOST PORT``: a message to the cluster's control server), then stops the context
  gracefully (never the SparkContext), ends the feed and stops the nodes.
- Structured Streaming: ``cluster.train(streaming_df)`` starts a query whose
  ``foreachBatch`` feeds every micro-batch DataFrame with ``train()`` (Arrow), and returns
  its ``StreamingQuery``; :func:`inference_stream` runs ``inference()`` per micro-batch
  and hands the results to a sink.

A micro-batch is fed by one blocking ``train()`` call, so Spark does not start the next
micro-batch before the nodes acknowledged every partition of the current one: the bounded
node queues push back on the stream (see docs/streaming.md).

The state kept per cluster (:class:`StreamSet`) lives in ``cluster._streams``.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Optional, Union

from tfos._common.deadline import Deadline
from tfos._data.feed_plan import FEED_TIMEOUT_S
from tfos._driver.stream_stop import StopEndpoint
from tfos.errors import ClusterFailedError, ConfigurationError, TFOSError, check_num_epochs

__all__ = [
    "StreamSet", "is_dstream", "is_streaming_df", "train_dstream", "inference_dstream", "train_stream",
    "inference_stream", "stop_streams", "stop_address", "request_stop", "stream_stats",
]

log = logging.getLogger(__name__)

#: Seconds between two checks of the stop conditions while shutdown(ssc) waits.
_POLL_S = 1.0


class StreamStopped(TFOSError):
    """Raised by a micro-batch that starts after the cluster began to stop its streams:
    the batch is not fed and not committed (a restart from the checkpoint feeds it)."""


def is_dstream(data: Any) -> bool:
    """True when ``data`` is a Spark Streaming ``DStream`` (driver)."""
    try:
        from pyspark.streaming import DStream
    except ImportError:  # pragma: no cover - pyspark without streaming
        return False
    return isinstance(data, DStream)


def is_streaming_df(data: Any) -> bool:
    """True when ``data`` is a streaming DataFrame (``df.isStreaming``) (driver)."""
    from pyspark.sql import DataFrame

    return isinstance(data, DataFrame) and bool(data.isStreaming)


class _Feeder:
    """Feeds micro-batches of one stream with ``train()``/``inference()`` (driver; called
    by Spark's streaming scheduler threads)."""

    def __init__(self, streams: "StreamSet", kind: str, feed: Callable[[Any], tuple[bool, Any]], stop_on_error: Callable[[], None],
                 refuse_when_stopping: bool = False) -> None:
        self.streams = streams
        #: Queries: a micro-batch starting after stop_streams() began is refused (not
        #: committed). DStreams: a graceful stop feeds the batches Spark still runs.
        self.refuse_when_stopping = refuse_when_stopping
        self.kind = kind
        self._feed = feed
        self._stop_on_error = stop_on_error
        self.batches = 0
        self.busy = threading.Event()

    def __call__(self, data: Any) -> Any:
        s = self.streams
        with s.lock:
            if s.error is not None:
                raise TFOSError(f"{self.kind}: micro-batch not fed, the cluster's stream failed earlier: {s.error}")
            if s.stopping and self.refuse_when_stopping:
                raise StreamStopped(f"{self.kind}: micro-batch not fed, the cluster is stopping its streams")
            self.busy.set()
        try:
            with s.feed_lock:  # one micro-batch of this cluster's streams at a time
                fed, result = self._feed(data)
            if fed:
                with s.lock:
                    self.batches += 1
            return result
        except BaseException as exc:
            s.record_error(exc)
            self._stop_on_error()
            raise
        finally:
            self.busy.clear()


class StreamSet:
    """The streams feeding one cluster, its stop endpoint and the first feeding error (driver).

    Attributes:
        lock: Guards the fields below.
        error: The first exception a micro-batch raised (None when none did).
        stopping: True once :func:`stop_streams` began; later micro-batches are refused.
    """

    def __init__(self, cluster: Any) -> None:
        self.cluster = cluster
        self.lock = threading.RLock()
        #: Serializes the micro-batches of every stream of the cluster (train() is not reentrant).
        self.feed_lock = threading.Lock()
        self.error: Optional[BaseException] = None
        self.error_raised = False
        self.stopping = False
        self.contexts: list[Any] = []  # StreamingContexts of the DStreams fed
        self.queries: list[tuple[Any, _Feeder]] = []
        self.feeders: list[_Feeder] = []
        self._stop_server: Optional[StopEndpoint] = None

    def record_error(self, exc: BaseException) -> None:
        with self.lock:
            if self.error is None and not isinstance(exc, StreamStopped):
                self.error = exc
                log.error("streaming: a micro-batch failed; the cluster's streams stop: %s", exc)

    def stop_server(self) -> StopEndpoint:
        with self.lock:
            if self._stop_server is None:
                self._stop_server = StopEndpoint(self.cluster._classic("streaming"))
            return self._stop_server

    def close_stop_server(self) -> None:
        with self.lock:
            server, self._stop_server = self._stop_server, None
        if server is not None:
            server.close()


def _streams(cluster: Any, create: bool = True) -> Optional[StreamSet]:
    streams = getattr(cluster, "_streams", None)
    if streams is None and create:
        streams = StreamSet(cluster)
        cluster._streams = streams
    return streams


def _refuse_connect(cluster: Any, what: str) -> None:
    """Raises ConfigurationError for a Spark Connect cluster: streams need a classic
    SparkContext (driver)."""
    cluster._classic(what)


def _check_spark_mode(cluster: Any, what: str) -> None:
    from tfos.cluster_template import InputMode

    _refuse_connect(cluster, what)
    if cluster.input_mode != InputMode.SPARK:
        raise ConfigurationError(f"{what} feeds data only in InputMode.SPARK; this cluster runs InputMode.TENSORFLOW")
    cluster._check_open(what)


def _stop_context_async(ssc: Any) -> None:
    """Stops ``ssc`` (not the SparkContext) from another thread: a streaming job cannot wait
    for the scheduler that runs it."""
    def stop() -> None:
        try:
            ssc.stop(stopSparkContext=False, stopGraceFully=False)
        except Exception as exc:  # noqa: BLE001 - the feeding error is what gets raised
            log.warning("streaming: stopping the StreamingContext after a failure: %s", exc)

    threading.Thread(target=stop, name="tfos-stop-ssc", daemon=True).start()


# ------------------------------------------------------------------ DStreams
def train_dstream(cluster: Any, dstream: Any, num_epochs: int, feed_timeout: float, qname: str) -> None:
    """Feeds every micro-batch RDD of ``dstream`` with ``cluster.train`` (driver).

    Registers a ``foreachRDD`` output operation; feeding starts with ``ssc.start()``. Each
    micro-batch is one blocking ``train(rdd, num_epochs)`` call, run by Spark Streaming's
    job scheduler (one batch at a time, in order); empty micro-batches (no partition) are
    skipped. The feed stays open between micro-batches: it ends at ``cluster.shutdown()``.

    Args:
        cluster: The TFCluster.
        dstream: A ``pyspark.streaming.DStream`` of rows.
        num_epochs: Passes over each micro-batch (>= 1).
        feed_timeout: Seconds a node may accept no data before the feed fails.
        qname: The node queue to feed.

    Raises:
        ConfigurationError: Not InputMode.SPARK, bad ``num_epochs`` or unknown ``qname``.

    When a micro-batch fails (a node failed: ``ClusterFailedError``), the streaming context
    is stopped (not the SparkContext), later micro-batches are refused, and the error is
    raised by ``ssc.awaitTermination()`` and ``cluster.shutdown()``.
    """
    _check_spark_mode(cluster, "train(DStream)")
    check_num_epochs(num_epochs, streaming=True)
    if qname not in cluster.queues:
        raise ConfigurationError(f"qname {qname!r} is not one of the cluster's queues {cluster.queues}")
    jobs = cluster.sc.getConf().get("spark.streaming.concurrentJobs", "1")
    if jobs.strip() != "1":
        raise ConfigurationError(f"train(DStream) feeds micro-batches one at a time, in order; spark.streaming.concurrentJobs is {jobs}: leave it at 1")
    streams = _streams(cluster)
    assert streams is not None
    ssc = dstream._ssc

    def feed(rdd: Any) -> tuple[bool, None]:
        if rdd.getNumPartitions() == 0:
            return False, None
        cluster.train(rdd, num_epochs=num_epochs, feed_timeout=feed_timeout, qname=qname)
        return True, None

    feeder = _Feeder(streams, "train(DStream)", feed, lambda: _stop_context_async(ssc))
    with streams.lock:
        streams.feeders.append(feeder)
        if ssc not in streams.contexts:
            streams.contexts.append(ssc)
    streams.stop_server()
    dstream.foreachRDD(lambda _time, rdd: feeder(rdd))
    log.info("train(DStream): every micro-batch is fed to %d node(s) once the StreamingContext starts", sum(1 for n in cluster._classic("train(DStream)").nodes() if n.role.feedable))


def inference_dstream(cluster: Any, dstream: Any, feed_timeout: float, qname: str) -> Any:
    """A DStream of the results of ``cluster.inference`` on every micro-batch (driver).

    Each micro-batch RDD is fed when Spark Streaming generates the batch's jobs (the
    returned DStream's RDDs hold the results, one per input row, in input order within
    each partition); an output operation (``foreachRDD``, ``saveAsTextFiles``...) on the
    returned DStream consumes them.

    Args:
        cluster: The TFCluster.
        dstream: A DStream of rows.
        feed_timeout: Seconds a node may go without accepting data or returning results.
        qname: The node queue to feed.

    Returns:
        A ``pyspark.streaming.DStream`` of results.

    Raises:
        ConfigurationError: Not InputMode.SPARK, or unknown ``qname``.
    """
    _check_spark_mode(cluster, "inference(DStream)")
    if qname not in cluster.queues:
        raise ConfigurationError(f"qname {qname!r} is not one of the cluster's queues {cluster.queues}")
    streams = _streams(cluster)
    assert streams is not None
    ssc = dstream._ssc

    def infer(rdd: Any) -> tuple[bool, Any]:
        if rdd.getNumPartitions() == 0:
            return False, rdd
        return True, cluster.inference(rdd, feed_timeout=feed_timeout, qname=qname)

    feeder = _Feeder(streams, "inference(DStream)", infer, lambda: _stop_context_async(ssc))
    with streams.lock:
        streams.feeders.append(feeder)
        if ssc not in streams.contexts:
            streams.contexts.append(ssc)
    streams.stop_server()
    return dstream.transform(lambda rdd: feeder(rdd))


# --------------------------------------------------------- Structured Streaming
def _start_query(streams: StreamSet, sdf: Any, feeder: _Feeder, checkpointLocation: Optional[str],
                 trigger: Optional[dict], queryName: Optional[str]) -> Any:
    writer = sdf.writeStream.foreachBatch(lambda df, batch_id: feeder((df, batch_id)))
    if checkpointLocation:
        writer = writer.option("checkpointLocation", checkpointLocation)
    if trigger:
        writer = writer.trigger(**trigger)
    if queryName:
        writer = writer.queryName(queryName)
    query = writer.start()
    with streams.lock:
        streams.queries.append((query, feeder))
        streams.feeders.append(feeder)
    streams.stop_server()
    return query


def _stop_query_async(holder: list) -> None:
    def stop() -> None:
        # Wait until start() returned the query (a first batch may fail before that).
        for _ in range(600):
            if holder:
                break
            time.sleep(0.1)
        if holder:
            try:
                holder[0].stop()
            except Exception as exc:  # noqa: BLE001 - the feeding error is what gets raised
                log.warning("streaming: stopping the query after a failure: %s", exc)

    threading.Thread(target=stop, name="tfos-stop-query", daemon=True).start()


def train_stream(cluster: Any, sdf: Any, num_epochs: int = 1, feed_timeout: float = FEED_TIMEOUT_S, qname: str = "input",
                 checkpointLocation: Optional[str] = None, trigger: Optional[dict] = None,
                 queryName: Optional[str] = None) -> Any:
    """Starts a Structured Streaming query that feeds every micro-batch with ``train()`` (driver).

    Each micro-batch DataFrame is fed as Arrow record batches (as ``train(df)``), in one
    blocking call of ``foreachBatch``: Spark commits the micro-batch (in
    ``checkpointLocation``) only after every partition was acknowledged by the nodes.

    Args:
        cluster: The TFCluster.
        sdf: A streaming DataFrame (``df.isStreaming``).
        num_epochs: Passes over each micro-batch (>= 1).
        feed_timeout: Seconds a node may accept no data before the feed fails.
        qname: The node queue to feed.
        checkpointLocation: The query's checkpoint directory (Spark's own checkpointing:
            a query restarted with the same directory resumes after the last committed
            micro-batch; the micro-batch running at a failure or stop is fed again).
        trigger: Keyword arguments of ``DataStreamWriter.trigger`` (e.g.
            ``{"processingTime": "5 seconds"}`` or ``{"availableNow": True}``).
        queryName: The query's name.

    Returns:
        The started ``pyspark.sql.streaming.StreamingQuery`` (``awaitTermination``,
        ``processAllAvailable``, ``stop``...).

    Raises:
        ConfigurationError: Not InputMode.SPARK, bad ``num_epochs`` or unknown ``qname``.

    A micro-batch that fails (a node failed) fails the query with the node's error
    (``query.exception()``, ``awaitTermination()`` raise it) and ``cluster.shutdown()``
    raises it.
    """
    _check_spark_mode(cluster, "train(streaming DataFrame)")
    check_num_epochs(num_epochs, streaming=True)
    if qname not in cluster.queues:
        raise ConfigurationError(f"qname {qname!r} is not one of the cluster's queues {cluster.queues}")
    streams = _streams(cluster)
    assert streams is not None
    holder: list = []

    def feed(item: tuple) -> tuple[bool, None]:
        df, batch_id = item
        cluster.train(df, num_epochs=num_epochs, feed_timeout=feed_timeout, qname=qname)
        log.debug("train(streaming DataFrame): micro-batch %s fed", batch_id)
        return True, None

    feeder = _Feeder(streams, "train(streaming DataFrame)", feed, lambda: _stop_query_async(holder), refuse_when_stopping=True)
    query = _start_query(streams, sdf, feeder, checkpointLocation, trigger, queryName)
    holder.append(query)
    return query


def _results_df(spark: Any, results: Any, schema: Any) -> Any:
    def as_row(r: Any) -> tuple:
        if isinstance(r, (tuple, list)):
            return tuple(x.item() if hasattr(x, "item") and getattr(x, "ndim", 1) == 0 else x for x in r)
        if hasattr(r, "tolist"):
            r = r.tolist()
            return tuple(r) if isinstance(r, list) else (r,)
        return (r,)

    return spark.createDataFrame(results.map(as_row), schema)


def inference_stream(cluster: Any, sdf: Any, sink: Union[Callable[[Any, Any, int], None], dict], feed_timeout: float = FEED_TIMEOUT_S,
                     qname: str = "input", checkpointLocation: Optional[str] = None, trigger: Optional[dict] = None,
                     queryName: Optional[str] = None) -> Any:
    """Starts a query running ``cluster.inference`` on every micro-batch and writing the
    results to ``sink`` (driver).

    Args:
        cluster: The TFCluster.
        sdf: A streaming DataFrame; its rows (``df.rdd``) are fed.
        sink: Either a function ``sink(results_rdd, batch_df, batch_id)`` (results in input
            order within each partition, one per row), or a dict
            ``{"format": "parquet", "path": "...", "schema": <DDL string or StructType>,
            "mode": "append", "options": {...}}``: each result becomes a row of ``schema``
            (a tuple/list result is a row, anything else a one-column row) and the
            micro-batch's rows are written with ``DataFrame.write`` to ``path``.
        feed_timeout: Seconds a node may go without accepting data or returning results.
        qname: The node queue to feed.
        checkpointLocation: The query's checkpoint directory (see :func:`train_stream`).
        trigger: Keyword arguments of ``DataStreamWriter.trigger``.
        queryName: The query's name.

    Returns:
        The started ``StreamingQuery``.

    Raises:
        ConfigurationError: Not InputMode.SPARK, unknown ``qname``, or a ``sink`` dict
            without ``format``/``path``/``schema``.

    Delivery: a micro-batch that a failure or stop interrupts is not committed; a restart
    with the same ``checkpointLocation`` runs it again, so its results may reach the sink
    twice (a function sink can make that idempotent with ``batch_id``).
    """
    _check_spark_mode(cluster, "inference(streaming DataFrame)")
    if qname not in cluster.queues:
        raise ConfigurationError(f"qname {qname!r} is not one of the cluster's queues {cluster.queues}")
    if isinstance(sink, dict):
        missing = [k for k in ("format", "path", "schema") if k not in sink]
        if missing:
            raise ConfigurationError(f"inference_stream(): the sink dict needs {missing}")
        spec = dict(sink)

        def write(results: Any, df: Any, batch_id: int) -> None:
            out = _results_df(df.sparkSession, results, spec["schema"])
            w = out.write.format(spec["format"]).mode(spec.get("mode", "append"))
            for k, v in (spec.get("options") or {}).items():
                w = w.option(k, v)
            w.save(spec["path"])

        sink_fn: Callable[[Any, Any, int], None] = write
    elif callable(sink):
        sink_fn = sink
    else:
        raise ConfigurationError(f"inference_stream(): sink must be a function or a dict, got {type(sink).__name__}")
    streams = _streams(cluster)
    assert streams is not None
    holder: list = []

    def feed(item: tuple) -> tuple[bool, None]:
        df, batch_id = item
        results = cluster.inference(df, feed_timeout=feed_timeout, qname=qname)
        try:
            sink_fn(results, df, batch_id)
        finally:
            results.unpersist()
        return True, None

    feeder = _Feeder(streams, "inference(streaming DataFrame)", feed, lambda: _stop_query_async(holder), refuse_when_stopping=True)
    query = _start_query(streams, sdf, feeder, checkpointLocation, trigger, queryName)
    holder.append(query)
    return query


# ------------------------------------------------------------------ shutdown
def _context_active(ssc: Any) -> bool:
    try:
        return str(ssc._jssc.getState()) == "ACTIVE"
    except Exception:  # noqa: BLE001 - a context whose JVM side is gone is not active
        return False


def _is_query(obj: Any) -> bool:
    from pyspark.sql.streaming import StreamingQuery

    return isinstance(obj, StreamingQuery)


def _terminated(obj: Any, wait_s: float) -> bool:
    """True once ``obj`` (StreamingContext or StreamingQuery) ended (waits up to ``wait_s``);
    errors of the stream are not raised here (stop_streams raises them)."""
    if _is_query(obj):
        if not obj.isActive:
            return True
        time.sleep(wait_s)
        return not obj.isActive
    if not _context_active(obj):
        return True
    try:
        return bool(obj.awaitTerminationOrTimeout(wait_s))
    except Exception:  # noqa: BLE001 - a failed stream ended; its error is raised later
        return True


def _workers_done(cluster: Any) -> bool:
    st = cluster._classic("shutdown()").host.core
    return all(st.is_done(e) for e in st.feedable_ids())


def stop_streams(cluster: Any, ssc: Any, deadline: Deadline) -> None:
    """Stops the streams feeding ``cluster`` before its feed ends (driver; run by
    ``cluster.shutdown()``).

    With ``ssc`` (a ``StreamingContext``, as TFoS, or a ``StreamingQuery``) this first
    waits, as TFoS's ``shutdown(ssc)`` did, until it ends by itself, a stop is requested
    (:func:`request_stop`, or ``python -m tfos.streaming stop HOST PORT`` from another
    process), every worker's ``main_fun`` returned, a node failed, or ``deadline``
    expires. Then every stream of the cluster is stopped gracefully: a StreamingContext
    with ``stop(stopSparkContext=False, stopGraceFully=True)`` (its running and received
    micro-batches are fed first, bounded by ``spark.streaming.gracefulStopTimeout``); a
    query once its running micro-batch is fed (later ones are not started).

    Raises:
        ClusterFailedError: A micro-batch failed with a node failure (the first one).
        TFOSError: A micro-batch failed otherwise (its error is chained).
    """
    streams = _streams(cluster, create=False)
    if streams is None and ssc is None:
        return
    if streams is None:
        streams = _streams(cluster)
        assert streams is not None
    try:
        if ssc is not None:
            server = streams.stop_server()
            why = ""
            while not why:
                if _terminated(ssc, _POLL_S):
                    why = "the stream ended"
                elif server.requested:
                    why = "a stop was requested"
                elif cluster._classic("shutdown()").host.core.failed or streams.error is not None:
                    why = "the cluster failed"
                elif _workers_done(cluster):
                    why = "every worker's main_fun returned"
                elif deadline.expired():
                    why = "shutdown()'s timeout expired"
            log.info("shutdown(): %s; stopping the cluster's streams", why)
            if not _is_query(ssc) and ssc not in streams.contexts:
                streams.contexts.append(ssc)
        with streams.lock:
            streams.stopping = True
            queries = list(streams.queries)
            contexts = list(streams.contexts)
        # after a failure nothing more is fed: no graceful stop (which waits up to Spark's
        # spark.streaming.gracefulStopTimeout for micro-batches that would be refused anyway)
        graceful = streams.error is None and not cluster._classic("shutdown()").host.core.failed
        for ctx in contexts:
            if _context_active(ctx):
                ctx.stop(stopSparkContext=False, stopGraceFully=graceful)
        for query, feeder in queries:
            if query.isActive:
                # A micro-batch starting from now on raises StreamStopped and is not
                # committed. The running one is let finish first: stop() cancels the
                # query's job group, where the sink's own Spark jobs run (an inference
                # query's write of the results; the feed jobs run under this cluster's job
                # group), which failed the micro-batch with an InterruptedException.
                while graceful and feeder.busy.is_set() and not deadline.expired():
                    time.sleep(0.05)
                query.stop()
    finally:
        streams.close_stop_server()
    with streams.lock:
        err = None if streams.error_raised else streams.error
        streams.error_raised = streams.error is not None
    if isinstance(err, ClusterFailedError):
        raise err
    if err is not None:
        raise TFOSError(f"a streaming micro-batch failed: {err}") from err
    if ssc is not None and _is_query(ssc):
        exc = ssc.exception()
        if exc is not None and "StreamStopped" not in str(exc):
            raise TFOSError(f"the streaming query failed: {exc}")


def stop_address(cluster: Any) -> Any:
    """The ``(host, port)`` of the cluster's stop endpoint (its control server; a
    :class:`tfos._control.key_files.ServerAddress` carrying its key), set up on first use (driver).

    Raises:
        ConfigurationError: For a Spark Connect cluster (no streams there).
    """
    _refuse_connect(cluster, "stop_address()")
    streams = _streams(cluster)
    assert streams is not None
    return streams.stop_server().address


def request_stop(cluster: Any) -> None:
    """Ends a pending ``cluster.shutdown(ssc)`` wait, as an outside stop request does (driver).

    Raises:
        ConfigurationError: For a Spark Connect cluster (no streams there).
    """
    _refuse_connect(cluster, "request_stop()")
    streams = _streams(cluster)
    assert streams is not None
    streams.stop_server().request()


def stream_stats(cluster: Any) -> dict:
    """``{"batches": micro-batches fed, "error": first error or None}`` (driver)."""
    streams = _streams(cluster, create=False)
    if streams is None:
        return {"batches": 0, "error": None}
    with streams.lock:
        return {"batches": sum(f.batches for f in streams.feeders), "error": streams.error}
