"""TFRecord files: paths, part files, the _SUCCESS commit (Spark tasks, through tf.io.gfile)."""

from __future__ import annotations

import os
import uuid
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Sequence

if TYPE_CHECKING:  # pragma: no cover - typing only
    from pyspark import SparkContext


_PART_FILE_FORMAT = "part-r-%05d"


_SUCCESS_FILE = "_SUCCESS"


_TEMPORARY_DIR = "_temporary"


_GLOB_CHARS = frozenset("*?[")


def _write_tfrecord_partition(output_dir: str, index: int, serialized: Iterable[bytes]) -> Iterator[tuple[str, int]]:
    """Writes one partition's records to ``<output_dir>/part-r-<index:05d>``.

    Runs in a Spark task.  Records go to a uniquely named file under
    ``<output_dir>/_temporary`` which is then renamed over the final name.

    Args:
        output_dir: Absolute path or URI of the output directory.
        index: Partition index.
        serialized: Serialized records to write.

    Yields:
        One ``(final path, number of records)`` pair.
    """
    import tensorflow as tf

    name = _PART_FILE_FORMAT % index
    final_path = _join(output_dir, name)
    temp_path = _join(output_dir, _TEMPORARY_DIR, f"{name}.{uuid.uuid4().hex}")
    count = 0
    try:
        with tf.io.TFRecordWriter(temp_path) as writer:
            for record in serialized:
                writer.write(record)
                count += 1
        tf.io.gfile.rename(temp_path, final_path, overwrite=True)
    except BaseException:
        if tf.io.gfile.exists(temp_path):
            tf.io.gfile.remove(temp_path)
        raise
    yield final_path, count


def _read_tfrecord_files(paths: Iterable[str]) -> Iterator[bytes]:
    """Reads the raw records of TFRecord files.

    Runs in a Spark task.  Files ending in ``.gz`` are read as GZIP-compressed.

    Args:
        paths: File paths or URIs.

    Yields:
        Each serialized record (``bytes``), file by file, in file order.
    """
    import tensorflow as tf

    for path in paths:
        compression = "GZIP" if path.endswith(".gz") else ""
        dataset = tf.data.TFRecordDataset(path, compression_type=compression)
        for record in dataset.as_numpy_iterator():
            yield record


def _normalize_path(path: str) -> str:
    """Makes a scheme-less local path absolute (on the driver); URIs are unchanged.

    Args:
        path: Local path or URI.

    Returns:
        The path without trailing slashes, absolute when it was a relative local path.
    """
    path = path.strip()
    if "://" not in path:
        path = os.path.abspath(os.path.expanduser(path))
    return path.rstrip("/") or "/"


def _join(directory: str, *names: str) -> str:
    """Joins a directory path or URI with child names using '/'."""
    return "/".join([directory.rstrip("/"), *names])


def _run_in_task(sc: "SparkContext", func: Callable[..., Any], *args: Any) -> Any:
    """Runs ``func(*args)`` once in a single Spark task and returns its result.

    Used for small file-system operations so they run where TensorFlow is
    installed (the executors), not on the driver.

    Args:
        sc: The active SparkContext.
        func: Picklable function; its return value must be picklable.
        *args: Picklable arguments.

    Returns:
        ``func(*args)``.
    """
    return sc.parallelize([0], 1).map(lambda _: func(*args)).collect()[0]


def _prepare_output_dir(output_dir: str) -> str:
    """Creates the output directory if needed; runs in a Spark task.

    Returns:
        ``"ok"``, or ``"not-empty"`` if it already holds files.
    """
    import tensorflow as tf

    if tf.io.gfile.exists(output_dir):
        if tf.io.gfile.listdir(output_dir):
            return "not-empty"
    else:
        tf.io.gfile.makedirs(output_dir)
    tf.io.gfile.makedirs(_join(output_dir, _TEMPORARY_DIR))
    return "ok"


def _remove_temporary_dir(output_dir: str) -> None:
    """Deletes ``<output_dir>/_temporary`` if present; runs in a Spark task."""
    import tensorflow as tf

    temporary = _join(output_dir, _TEMPORARY_DIR)
    if tf.io.gfile.exists(temporary):
        tf.io.gfile.rmtree(temporary)


def _commit_output_dir(output_dir: str) -> None:
    """Writes the ``_SUCCESS`` marker and removes ``_temporary``; runs in a Spark task."""
    import tensorflow as tf

    _remove_temporary_dir(output_dir)
    with tf.io.gfile.GFile(_join(output_dir, _SUCCESS_FILE), "w") as marker:
        marker.write("")  # GFile only creates the file on the first write


def _is_data_file_name(name: str) -> bool:
    """True for names that are not hidden/marker files (leading ``_`` or ``.``)."""
    return not name.startswith(("_", "."))


def _list_tfrecord_files(paths: Sequence[str]) -> tuple[str, Any]:
    """Lists the TFRecord data files under the given paths; runs in a Spark task.

    Directories are listed non-recursively; glob patterns are expanded (matched
    directories are listed too); hidden and marker files are skipped.

    Args:
        paths: Absolute paths, URIs or glob patterns.

    Returns:
        ``("ok", sorted list of file paths)`` or ``("missing", path)`` for a
        path that does not exist.
    """
    import tensorflow as tf

    files: set[str] = set()
    for path in paths:
        if _GLOB_CHARS & set(path):
            matches = tf.io.gfile.glob(path)
        elif tf.io.gfile.exists(path):
            matches = [path]
        else:
            return "missing", path
        for match in matches:
            if tf.io.gfile.isdir(match):
                for name in tf.io.gfile.listdir(match):
                    child = _join(match, name.rstrip("/"))
                    if _is_data_file_name(name) and not tf.io.gfile.isdir(child):
                        files.add(child)
            elif _is_data_file_name(match.rstrip("/").rsplit("/", 1)[-1]):
                files.add(match)
    return "ok", sorted(files)
