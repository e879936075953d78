"""The batch and ``tf.data`` views of a :class:`tfos.datafeed.DataFeed` (TF process): its
:meth:`~FeedDatasets.batches`, :meth:`~FeedDatasets.as_dataset` and
:meth:`~FeedDatasets.steps_per_epoch`, over the feed's own ``next_batch`` or the tf.data
reader of :mod:`tfos._data.tfdata`."""

from __future__ import annotations

from typing import Any, Iterator, Optional, Sequence

from tfos._data.columns import rows_to_columns

__all__ = ["FeedDatasets"]


class FeedDatasets:
    """Methods of ``DataFeed`` that hand its rows out as numpy batches or a ``tf.data.Dataset``."""

    last_origins: list

    def should_stop(self) -> bool:  # pragma: no cover - DataFeed's
        raise NotImplementedError

    def next_batch(self, batch_size: int) -> Any:  # pragma: no cover - DataFeed's
        raise NotImplementedError

    def batches(self, batch_size: int, columns: Optional[Sequence[tuple[Any, Optional[tuple]]]] = None) -> Iterator:
        """Yields batches until the end of the feed (TF process).

        Args:
            batch_size: Rows per batch (the last batch may be short).
            columns: When given, ``[(numpy dtype, row shape), ...]`` per column: each batch
                is converted with :func:`rows_to_columns` into a tuple of numpy arrays of
                shape ``(n,) + row shape``; otherwise raw row lists are yielded.

        Raises:
            MalformedRowError: A row does not fit ``columns`` (names partition and row).
            FeedAbortedError: The cluster aborted (see :meth:`next_batch`).
        """
        while not self.should_stop():
            batch = self.next_batch(batch_size)
            if not batch:
                continue
            if columns is None:
                yield batch
            else:
                assert isinstance(batch, list)  # batches() is used without input_mapping
                yield rows_to_columns(batch, columns, self.last_origins)

    def as_dataset(
        self,
        batch_size: int,
        output_signature: Any,
        drop_remainder: bool = False,
        per_epoch: bool = False,
        prefetch: int = 2,
        buffer_batches: Optional[int] = None,
        steps_per_epoch: Optional[int] = None,
        shuffle_rows: int = 0,
        shuffle_seed: Optional[int] = None,
    ):
        """A ``tf.data.Dataset`` of whole batches from this feed (TF process, train mode).

        Each row must be a tuple/list with one value per column of ``output_signature`` (or a
        single value when the signature is a single ``tf.TensorSpec``). A background thread
        reads the feed ahead, turns every chunk into numpy columns at once and cuts them into
        batches; TensorFlow receives whole batches (``tfos._data.tfdata.FeedBatches``, kept as
        ``dataset.tfos_batches``). The dataset ends cleanly at the end of the feed and has
        auto-sharding turned off (each worker already gets only its own partitions). From its
        first iteration on, the dataset is the feed's only reader. docs/datafeed.md "tf.data"
        gives the whole behaviour; in short:

        * Called in the dataset function of ``model.fit`` under ParameterServerStrategy (on
          the chief): each worker reads its own feed (docs/parameter_servers.md).

        * ``per_epoch=True``: every iteration is one epoch of ``cluster.train(data, n)``; call
          ``model.fit(ds, initial_epoch=e, epochs=e + 1)`` once per epoch.
        * ``steps_per_epoch=S`` (the same on every node, e.g. from :meth:`steps_per_epoch`):
          one iteration covers all epochs, each exactly ``S`` batches on every node (its last
          ``min(S, buffer_batches // 2)`` batches share the epoch's remaining rows), so one
          ``model.fit(ds, epochs=n, steps_per_epoch=S)`` trains all epochs; under
          MultiWorkerMirroredStrategy pass ``strategy.distribute_datasets_from_function(lambda
          _: ds)``. Epochs run on across ``train()`` calls.
        * Both keep every epoch whole when Spark runs a later epoch's task first
          (``tfos._data.epoch_order.EpochOrder``): a later epoch's chunks wait in memory, at
          most ``feed_timeout / 2`` seconds and ``max(2 x buffer, 64 MiB)`` bytes, then a
          WARNING names the epoch.
        * ``shuffle_rows=W`` (with ``steps_per_epoch``) draws each batch at random from a pool
          of at least ``W`` rows of the epoch (``tfos._data.shuffle``); batches never mix
          epochs and every row is handed out once.

        Args:
            batch_size: Rows per batch of this node's dataset. Under
                MultiWorkerMirroredStrategy, a dataset given to ``model.fit`` as is is
                distributed by Keras, which takes each batch as a global batch and splits
                it over the replicas (every fed row is still trained once); through
                ``strategy.distribute_datasets_from_function(lambda _: ds)`` (needed with
                ``steps_per_epoch``) each batch is one worker's step: the per-worker batch.
            output_signature: A ``tf.TensorSpec`` or tuple of them, with a leading ``None``
                (batch) dimension, e.g. ``(TensorSpec((None, 784), tf.float32),
                TensorSpec((None,), tf.int64))``.
            drop_remainder: Drop a last batch (of the feed, or of an epoch with
                ``per_epoch``) shorter than ``batch_size``.
            per_epoch: One epoch per iteration (see above).
            prefetch: Batches ``tf.data`` prefetches (0: none).
            buffer_batches: Batches the reader thread keeps ready (default about 32 MB; when a
                column holds strings or bytes or has no fixed shape, at most 8 batches and
                at most about 32 MB of them, counted as they come, but at least one).
            steps_per_epoch: Batches per epoch on every node (see above); excludes
                ``per_epoch`` and ``drop_remainder``.
            shuffle_rows: Row-level shuffle window in rows (0: the fed order); needs
                ``steps_per_epoch``. Memory: ``W`` rows more in the reader.
            shuffle_seed: Seed of that shuffle (None: from the OS).

        Returns:
            A ``tf.data.Dataset`` yielding tensors of the given dtypes and shapes.

        Raises:
            TypeError: When ``output_signature`` is not a TensorSpec or tuple of them.
            ValueError: For a spec without the leading batch dimension (a per-row shape such
                as ``TensorSpec(())``) or with a first dimension fixed to another size than
                ``batch_size``; in inference mode (``train_mode=False``), for ``batch_size`` < 1,
                ``shuffle_rows`` < 0, or ``shuffle_rows`` without ``steps_per_epoch``.
            MalformedRowError: (while iterating) a row that does not fit the signature
                (or, with ``shuffle_rows``, a column whose row shape changes).
            FeedAbortedError: (while iterating) the cluster aborted: the feed was cut off,
                not ended. TensorFlow wraps it in a ``tf.errors.UnknownError`` (see
                :class:`~tfos.errors.FeedAbortedError`); the driver counts it as a
                consequence of the abort either way.
        """
        from tfos._data import worker_feeds
        from tfos._data.chunk_columns import check_batch_dims, columns_of
        from tfos._data.tfdata import FeedBatches

        if worker_feeds.building_state() is not None:  # model.fit under ParameterServerStrategy: the workers' feeds
            return worker_feeds.workers_dataset(self, batch_size, output_signature, per_epoch,
                                           drop_remainder=drop_remainder, prefetch=prefetch, buffer_batches=buffer_batches,
                                           steps_per_epoch=steps_per_epoch, shuffle_rows=shuffle_rows, shuffle_seed=shuffle_seed)
        columns, single = columns_of(output_signature)
        check_batch_dims(output_signature, batch_size)
        reader = FeedBatches(self, batch_size, columns, single=single, per_epoch=per_epoch, drop_remainder=drop_remainder,
                             buffer_batches=buffer_batches, steps_per_epoch=steps_per_epoch, shuffle_rows=shuffle_rows,
                             shuffle_seed=shuffle_seed)
        ds = reader.dataset(output_signature, prefetch)
        ds.tfos_batches = reader
        return ds

    @staticmethod
    def steps_per_epoch(rows_per_epoch: int, batch_size: int, num_nodes: int) -> int:
        """The ``steps_per_epoch`` for :meth:`as_dataset` that every node can compute alike (pure).

        ``ceil(rows_per_epoch / (batch_size x num_nodes))``: the steps of an epoch when its
        rows are spread evenly over the nodes.

        Args:
            rows_per_epoch: Rows of one epoch over all nodes (``data.count()`` on the driver,
                passed to ``main_fun`` in its args).
            batch_size: Rows per step on one node (the per-worker batch).
            num_nodes: Nodes fed: ``ctx.num_workers`` (chief/master plus workers;
                ``strategy.num_replicas_in_sync`` equals it only with one replica per
                node). See docs/datafeed.md.

        Returns:
            The steps per epoch (>= 1).

        Raises:
            ValueError: When an argument is < 1.
        """
        if rows_per_epoch < 1 or batch_size < 1 or num_nodes < 1:
            raise ValueError(f"rows_per_epoch, batch_size and num_nodes must be >= 1, got "
                             f"{rows_per_epoch}, {batch_size}, {num_nodes}")
        return -(-int(rows_per_epoch) // (int(batch_size) * int(num_nodes)))
