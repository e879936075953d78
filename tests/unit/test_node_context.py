"""Unit tests of tfos.node_context (absolute_path, TFNodeContext) and tfos.gpu_info (pure)."""

from __future__ import annotations

import getpass
import socket

import pytest

from tfos import TFNode
from tfos.errors import TFOSError
from tfos.gpu_info import cuda_visible_devices
from tfos.node_context import TFNodeContext, absolute_path

WD = "/work/exec-1/dir"


# -------------------------------------------------------------------- absolute_path
@pytest.mark.parametrize("fs", ["file://", "file:///", "file:/"])
def test_local_fs_absolute_and_relative(fs):
    assert absolute_path("/tmp/model", fs, WD) == "file:///tmp/model"
    assert absolute_path("model", fs, WD) == "file:///work/exec-1/dir/model"
    assert absolute_path("a/b/c", fs, WD) == "file:///work/exec-1/dir/a/b/c"


@pytest.mark.parametrize("fs", ["hdfs://nn:8020", "hdfs://nn:8020/"])
def test_hdfs_relative_goes_under_user(fs):
    assert absolute_path("model", fs, WD, user="alice") == "hdfs://nn:8020/user/alice/model"
    assert absolute_path("data/train", fs, WD, user="bob") == "hdfs://nn:8020/user/bob/data/train"


def test_hdfs_relative_default_user():
    assert absolute_path("m", "hdfs://nn:8020", WD) == f"hdfs://nn:8020/user/{getpass.getuser()}/m"


@pytest.mark.parametrize("fs", ["hdfs://nn:8020", "hdfs://nn:8020/"])
def test_hdfs_absolute(fs):
    assert absolute_path("/data/mnist", fs, WD, user="alice") == "hdfs://nn:8020/data/mnist"


def test_viewfs():
    assert absolute_path("model", "viewfs://cluster1/", WD, user="carol") == "viewfs://cluster1/user/carol/model"
    assert absolute_path("/shared/x", "viewfs://cluster1", WD) == "viewfs://cluster1/shared/x"


@pytest.mark.parametrize(
    "path",
    [
        "s3a://bucket/models/m1",
        "gs://bucket/x",
        "hdfs://other:9000/user/z/m",
        "file:///already/local",
        "viewfs://c/x",
        "abfss://c@acct.dfs.core.windows.net/p",
        "s3://b/k",
    ],
)
@pytest.mark.parametrize("fs", ["file://", "hdfs://nn:8020"])
def test_qualified_paths_unchanged(path, fs):
    assert absolute_path(path, fs, WD, user="alice") == path


def test_unknown_fs_scheme_relative(caplog):
    assert absolute_path("m", "custom://store/", WD) == "custom://store/m"
    assert "unknown default FS scheme custom://store" in caplog.text


# --------------------------------------------------------------------- TFNodeContext
def test_context_fields_and_helpers():
    spec = {"ps": ["h:1"], "chief": ["h:2"], "worker": ["h:3", "h:4"], "evaluator": ["h:5"]}
    ctx = TFNodeContext(3, "worker", 1, spec, "hdfs://nn:8020", WD, host="h", port=4)
    assert ctx.num_workers == 3
    assert ctx.cluster_spec == spec and ctx.cluster_spec is not spec
    assert repr(ctx) == "TFNodeContext(worker:1, executor 3, 3 workers)"
    assert ctx.absolute_path("/x") == "hdfs://nn:8020/x"
    assert TFNode.hdfs_path(ctx, "/y") == "hdfs://nn:8020/y"
    assert not ctx.stop_event.is_set()
    with pytest.raises(TFOSError, match="this node has no data feed"):
        ctx.get_data_feed()


def test_release_port_idempotent():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    ctx = TFNodeContext(0, "worker", 0, {"worker": ["h:1"]}, tmp_socket=s)
    assert ctx.reserved_port_socket is s
    ctx.release_port()
    assert ctx.reserved_port_socket is None
    assert s.fileno() == -1
    ctx.release_port()


# -------------------------------------------------------------------------- gpu_info
def test_cuda_visible_devices():
    assert cuda_visible_devices({}) is None
    assert cuda_visible_devices({"gpu": []}) is None
    assert cuda_visible_devices({"fpga": ["0"]}) is None
    assert cuda_visible_devices({"gpu": ["1", "3"]}) == "1,3"
    assert cuda_visible_devices({"gpu": ("2",)}) == "2"
    assert cuda_visible_devices({"gpu": [" 0 ", "7"]}) == "0,7"


@pytest.mark.parametrize("bad", ["GPU-3f2a", "-1", "", "0,1"])
def test_cuda_visible_devices_bad_address(bad):
    with pytest.raises(ValueError) as ei:
        cuda_visible_devices({"gpu": ["0", bad]})
    assert f"Spark assigned GPU address {bad!r}, which is not a GPU index" in str(ei.value)
