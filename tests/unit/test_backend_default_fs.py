"""Both backends hand every node the same ``ctx.defaultFS`` for the same Spark setting
(driver; no Spark): the classic launcher reads the SparkContext's Hadoop configuration, the
Spark Connect launcher the session's ``spark.hadoop.fs.defaultFS``; a scheme without a host
(``hdfs://``) stays ``hdfs://`` on both (it once became ``hdfs:`` under Spark Connect)."""

from __future__ import annotations

import pytest

pytest.importorskip("pyspark")

from fake_backends import plan  # noqa: E402
from tfos._driver.connect_backend import ConnectLauncher  # noqa: E402
from tfos._driver.classic import _default_fs  # noqa: E402


class _Conf:
    def __init__(self, values: dict):
        self.values = values

    def get(self, name: str, default=None):
        return self.values.get(name, default)


class _ConnectSession:
    """What ConnectLauncher reads of a Spark Connect session: its conf."""

    def __init__(self, default_fs):
        values = {"spark.master": "local[2]", "spark.authenticate": "true"}
        if default_fs is not None:
            values["spark.hadoop.fs.defaultFS"] = default_fs
        self.conf = _Conf(values)


class _SparkContext:
    """What the classic launcher reads of a SparkContext for defaultFS: the JVM's Hadoop conf."""

    def __init__(self, default_fs):
        hadoop = _Conf({} if default_fs is None else {"fs.defaultFS": default_fs})
        self._jsc = type("JSC", (), {"hadoopConfiguration": lambda _self: hadoop})()


@pytest.mark.parametrize("setting, node_sees", [
    ("hdfs://", "hdfs://"),
    ("hdfs://nn:8020/", "hdfs://nn:8020"),
    ("hdfs://nn:8020", "hdfs://nn:8020"),
    ("viewfs://", "viewfs://"),
    ("s3a://bucket/", "s3a://bucket"),
    ("file:///", "file://"),
    ("file:/", "file://"),
    (None, "file://"),
])
def test_both_backends_give_the_nodes_the_same_default_fs(setting, node_sees):
    pytest.importorskip("pyspark", minversion="4.0")
    connect = ConnectLauncher(_ConnectSession(setting), plan()).default_fs
    classic = _default_fs(_SparkContext(setting))
    assert connect == classic == node_sees
