"""Fed datasets are not auto-sharded by TensorFlow (TF process of a fed node).

Under ``MultiWorkerMirroredStrategy``, ``experimental_distribute_dataset`` (which Keras's
``fit``/``evaluate``/``predict`` call) shards a dataset across the workers by its
``AutoShardPolicy``; the default, ``AUTO``, shards by file when the pipeline reads files and
otherwise falls back to ``DATA``: each worker keeps every N-th batch. On a fed node
(InputMode.SPARK) the dataset that reads the feed already holds this node's own rows, which
Spark gave no other node, so ``DATA`` can only drop them: with
``tf.data.Dataset.from_generator`` over ``DataFeed.next_batch`` each of two workers trained
half of its rows (tensorflow/tensorflow#36153; TensorFlowOnSpark lost the same half).

On a fed node, tfos makes ``AUTO`` mean ``OFF`` for a dataset whose pipeline calls Python
(a generator or ``py_function``: the only ways to read the feed; ``DataFeed.as_dataset``
sets ``OFF`` itself) and reads no files. Unchanged: a dataset with an explicit policy other
than ``AUTO`` (``DATA``, ``FILE``, ``HINT``: the opt-out per dataset, e.g. a generator that
yields the same rows on every node), a file-reading dataset (``AUTO`` shards its files),
and every dataset when the node's environment sets ``TFOS_FEED_AUTO_SHARD=auto`` (the
opt-out for the whole cluster: TensorFlow's own default). See docs/datafeed.md, "Auto-shard
policy".
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

log = logging.getLogger(__name__)

#: Environment variable; ``auto`` keeps TensorFlow's default policy for fed datasets.
OPT_OUT = "TFOS_FEED_AUTO_SHARD"
#: Where ``MultiWorkerMirroredStrategy`` is defined.
STRATEGY_MODULE = "tensorflow.python.distribute.collective_all_reduce_strategy"
#: Dataset ops that read files (TensorFlow's auto-shard shards their file names).
FILE_READERS = frozenset({"TFRecordDataset", "TFRecordDatasetV2", "TextLineDataset", "FixedLengthRecordDataset",
                          "FixedLengthRecordDatasetV2", "ArrayRecordDataset", "RecordIODataset", "SSTableDataset"})
#: Ops through which a pipeline calls Python (how a dataset reads the feed).
PYTHON_OPS = frozenset({"GeneratorDataset", "PyFunc", "PyFuncStateless", "EagerPyFunc"})


def opted_out() -> bool:
    """Whether the node's environment keeps TensorFlow's default policy (``auto``)."""
    return os.environ.get(OPT_OUT, "off").strip().lower() in ("auto", "tensorflow", "default")


def ops_of(dataset: Any) -> frozenset:
    """The op types of ``dataset``'s graph, its functions' included (TF process)."""
    import tensorflow as tf
    from tensorflow.core.framework import graph_pb2

    graph = graph_pb2.GraphDef()
    graph.ParseFromString(dataset._as_serialized_graph(
        external_state_policy=tf.data.experimental.ExternalStatePolicy.IGNORE).numpy())
    ops = {node.op for node in graph.node}
    for function in graph.library.function:
        ops.update(node.op for node in function.node_def)
    return frozenset(ops)


def reads_python_not_files(ops: frozenset) -> bool:
    """Whether a pipeline of op types ``ops`` calls Python and reads no files (pure)."""
    return bool(ops & PYTHON_OPS) and not (ops & FILE_READERS)


def unsharded(dataset: Any) -> Any:
    """``dataset`` with ``AutoShardPolicy.OFF`` when it has the default policy and reads
    the feed's way (see the module docstring); otherwise ``dataset`` itself (TF process)."""
    import tensorflow as tf

    if opted_out() or not isinstance(dataset, tf.data.Dataset):
        return dataset
    policy = tf.data.experimental.AutoShardPolicy
    if dataset.options().experimental_distribute.auto_shard_policy != policy.AUTO:
        return dataset
    try:
        ops = ops_of(dataset)
    except Exception:  # noqa: BLE001 - a graph that cannot be serialized: TensorFlow's default
        log.debug("could not read the dataset's graph; its auto-shard policy is left as it is", exc_info=True)
        return dataset
    if not reads_python_not_files(ops):
        return dataset
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = policy.OFF
    log.info("tfos: a dataset that reads Python (the feed) is not auto-sharded on this fed node "
             "(AutoShardPolicy.OFF; set a policy on the dataset or %s=auto to opt out, docs/datafeed.md)", OPT_OUT)
    return dataset.with_options(options)


def note_policy(dataset: Any, reads_python: Optional[bool] = None) -> None:
    """Tells the row accounting the auto-shard policy a dataset that may read the feed is
    distributed with (the cause it names depends on it; docs/datafeed.md "Row accounting")
    (TF process).

    ``OFF`` is always noted (``as_dataset``, tfos's own ``OFF``, a program's). A sharding
    policy (``AUTO``, ``DATA``, ``FILE``, ``HINT``) is noted only for a dataset whose
    pipeline calls Python (the only way to read the feed), so an in-memory validation
    dataset distributed between two fed epochs does not stand for the fed one.
    ``reads_python``: whether it does, when :func:`unsharded` already read the graph (None:
    read it here when needed).
    """
    import tensorflow as tf

    from tfos._data.row_count import POLICY_CODES, ROWS

    if not isinstance(dataset, tf.data.Dataset):
        return
    policy = dataset.options().experimental_distribute.auto_shard_policy
    if policy != tf.data.experimental.AutoShardPolicy.OFF:
        if reads_python is None:
            try:
                reads_python = bool(ops_of(dataset) & PYTHON_OPS)
            except Exception:  # noqa: BLE001 - a graph that cannot be serialized: not known to read the feed
                reads_python = False
        if not reads_python:
            return
    ROWS.distributed(POLICY_CODES.get(policy.name, 0))


def _is_auto(dataset: Any) -> bool:
    import tensorflow as tf

    return (isinstance(dataset, tf.data.Dataset)
            and dataset.options().experimental_distribute.auto_shard_policy == tf.data.experimental.AutoShardPolicy.AUTO)


def patch(module: Any) -> None:
    """Wraps ``experimental_distribute_dataset`` of the module's ``CollectiveAllReduceStrategy``
    (``tf.distribute.MultiWorkerMirroredStrategy``) with :func:`unsharded` and
    :func:`note_policy`, and ``distribute_datasets_from_function`` (never auto-sharded) so
    that the row accounting forgets an earlier dataset's policy (idempotent)."""
    cls = module.CollectiveAllReduceStrategy
    if getattr(cls, "_tfos_fed_shard", False):
        return
    tf_distribute = cls.experimental_distribute_dataset

    def experimental_distribute_dataset(self: Any, dataset: Any, options: Any = None) -> Any:
        if self.extended._num_workers > 1:
            shaped = unsharded(dataset)
            # unsharded() read the graph of an AUTO dataset it left alone: it reads no Python
            left_alone = shaped is dataset and _is_auto(dataset) and not opted_out()
            note_policy(shaped, True if shaped is not dataset else (False if left_alone else None))
            dataset = shaped
        return tf_distribute(self, dataset, options)

    experimental_distribute_dataset.__wrapped__ = tf_distribute  # type: ignore[attr-defined]
    experimental_distribute_dataset.__doc__ = tf_distribute.__doc__
    cls.experimental_distribute_dataset = experimental_distribute_dataset
    tf_from_function = cls.distribute_datasets_from_function

    def distribute_datasets_from_function(self: Any, dataset_fn: Any, options: Any = None) -> Any:
        from tfos._data.row_count import ROWS

        ROWS.distributed(0)  # no auto-shard policy applies: the accounting names none
        return tf_from_function(self, dataset_fn, options)

    distribute_datasets_from_function.__wrapped__ = tf_from_function  # type: ignore[attr-defined]
    distribute_datasets_from_function.__doc__ = tf_from_function.__doc__
    cls.distribute_datasets_from_function = distribute_datasets_from_function
    cls._tfos_fed_shard = True


def install() -> None:
    """Applies :func:`patch` once TensorFlow's strategy module is imported (TF process of a
    fed node, before ``main_fun``); imports nothing itself."""
    from tfos._node.import_hooks import when_imported

    when_imported(STRATEGY_MODULE, patch)
