"""tfos.authenticate_spark: spark.authenticate for a program that starts its own Spark, with a
secret in a SPARK_CONF_DIR only the user can read (pure parts and the files it writes; the
examples' Spark runs are in tests/spark/test_quickstart.py and test_mnist_examples.py)."""

from __future__ import annotations

import os
import stat

import pytest

import tfos
from tfos import spark_auth
from tfos.errors import ConfigurationError


def test_read_properties_takes_the_forms_spark_defaults_conf_uses():
    text = ("# comment\n! also a comment\n\nspark.executor.memory   2g\nspark.a=1\nspark.b: x y \n"
            "  spark.c\tz\nspark.a 3\n")
    assert spark_auth.read_properties(text) == {"spark.executor.memory": "2g", "spark.a": "3", "spark.b": "x y",
                                                 "spark.c": "z"}


@pytest.mark.parametrize("master", ["local", "local[2]", "local[*]", "local[4,2]"])
def test_local_masters_need_only_the_switch_spark_makes_the_secret(master):
    assert spark_auth.auth_settings(master, {}) == {"spark.authenticate": "true"}
    assert spark_auth.auth_settings(master, {"spark.authenticate": "True"}) == {}


def test_local_cluster_gets_a_new_random_secret_each_time():
    first = spark_auth.auth_settings("local-cluster[2,1,1024]", {})
    second = spark_auth.auth_settings("local-cluster[2,1,1024]", {})
    assert set(first) == {"spark.authenticate", "spark.authenticate.secret"}
    assert len(first["spark.authenticate.secret"]) == 64 and int(first["spark.authenticate.secret"], 16) >= 0
    assert first["spark.authenticate.secret"] != second["spark.authenticate.secret"]
    # a secret the user gave is kept
    assert spark_auth.auth_settings("local-cluster[2,1,1024]", {"spark.authenticate": "true",
                                                                "spark.authenticate.secret": "mine"}) == {}


@pytest.mark.parametrize("master", ["yarn", "k8s://https://10.0.0.1:6443"])
def test_yarn_and_kubernetes_generate_the_secret_and_get_encryption(master):
    assert spark_auth.auth_settings(master, {}) == {"spark.authenticate": "true", "spark.network.crypto.enabled": "true"}
    # an explicit choice about encryption is the user's
    assert spark_auth.auth_settings(master, {"spark.network.crypto.enabled": "false"}) == {"spark.authenticate": "true"}


def test_standalone_needs_the_clusters_own_secret():
    with pytest.raises(ConfigurationError) as info:
        spark_auth.auth_settings("spark://10.0.0.1:7077", {})
    text = str(info.value)
    assert "the secret its master and workers were started with" in text and "scripts/spark_standalone.sh" in text, text
    cluster = {"spark.authenticate": "true", "spark.authenticate.secret": "s", "spark.network.crypto.enabled": "true"}
    assert spark_auth.auth_settings("spark://10.0.0.1:7077", cluster) == {}


@pytest.fixture
def no_jvm(monkeypatch):
    """As in a fresh program: no Spark driver JVM yet (the test session may hold one)."""
    monkeypatch.setattr(spark_auth, "_jvm_running", lambda: False)
    registered = []
    monkeypatch.setattr(spark_auth.atexit, "register", lambda fn, *a: registered.append((fn, a)))
    yield registered
    for fn, args in registered:  # what the interpreter's exit would do
        fn(*args)


def test_writes_a_private_conf_dir_that_keeps_the_users_settings(tmp_path, monkeypatch, no_jvm):
    mine = tmp_path / "conf"
    mine.mkdir()
    (mine / "spark-defaults.conf").write_text("spark.executor.memory 2g")  # no final newline
    (mine / "log4j2.properties").write_text("rootLogger.level = warn\n")
    monkeypatch.setenv("SPARK_CONF_DIR", str(mine))
    new = tfos.authenticate_spark("local-cluster[2,1,1024]")
    assert new and new != str(mine) and os.environ["SPARK_CONF_DIR"] == new
    assert stat.S_IMODE(os.stat(new).st_mode) == 0o700
    defaults = os.path.join(new, "spark-defaults.conf")
    assert stat.S_IMODE(os.stat(defaults).st_mode) == 0o600
    props = spark_auth.read_properties(open(defaults).read())
    assert props["spark.executor.memory"] == "2g" and props["spark.authenticate"] == "true"
    assert len(props["spark.authenticate.secret"]) == 64
    assert os.path.realpath(os.path.join(new, "log4j2.properties")) == str(mine / "log4j2.properties")
    assert (mine / "spark-defaults.conf").read_text() == "spark.executor.memory 2g"  # the user's file is untouched
    # removed when the interpreter exits
    (fn, args), = no_jvm
    fn(*args)
    assert not os.path.exists(new)
    no_jvm.clear()


def test_nothing_to_add_keeps_the_current_dir(tmp_path, monkeypatch, no_jvm):
    mine = tmp_path / "conf"
    mine.mkdir()
    (mine / "spark-defaults.conf").write_text("spark.authenticate true\n")
    monkeypatch.setenv("SPARK_CONF_DIR", str(mine))
    assert tfos.authenticate_spark("local[2]") == str(mine)
    assert os.environ["SPARK_CONF_DIR"] == str(mine) and no_jvm == []


def test_without_a_conf_dir_the_file_holds_only_the_additions(tmp_path, monkeypatch, no_jvm):
    monkeypatch.delenv("SPARK_CONF_DIR", raising=False)
    monkeypatch.setenv("SPARK_HOME", str(tmp_path / "no-such-spark"))
    new = tfos.authenticate_spark("local[2]")
    assert sorted(os.listdir(new)) == ["spark-defaults.conf"]
    assert spark_auth.read_properties(open(os.path.join(new, "spark-defaults.conf")).read()) == {"spark.authenticate": "true"}


def test_a_running_driver_jvm_is_left_alone(monkeypatch, tmp_path):
    """Under spark-submit (or after a SparkContext) the JVM's settings are fixed: nothing is
    written and SPARK_CONF_DIR stays; TFCluster.run still warns if they do not authenticate."""
    monkeypatch.setenv("PYSPARK_GATEWAY_PORT", "12345")
    monkeypatch.setenv("SPARK_CONF_DIR", str(tmp_path))
    assert spark_auth._jvm_running()
    assert tfos.authenticate_spark("local-cluster[2,1,1024]") is None
    assert os.environ["SPARK_CONF_DIR"] == str(tmp_path) and os.listdir(tmp_path) == []


@pytest.mark.parametrize("master", ["local-cluser[2,1,1024]", "locall[2]", "local[2", "Local[2]"])
def test_a_typod_master_is_named_with_the_forms_spark_accepts(master, tmp_path, monkeypatch, no_jvm):
    """Checked first: no conf dir is written, and the error is Spark's, not the standalone
    cluster's secret advice it got before."""
    monkeypatch.setenv("SPARK_CONF_DIR", str(tmp_path))
    with pytest.raises(ConfigurationError) as info:
        tfos.authenticate_spark(master)
    text = str(info.value)
    assert text.startswith(f"Could not parse Master URL: {master!r}") and "local-cluster[E,C,M]" in text, text
    assert "standalone" not in text and "secret" not in text, text
    assert os.environ["SPARK_CONF_DIR"] == str(tmp_path) and not no_jvm


def test_a_typod_master_is_refused_even_when_the_driver_jvm_runs(monkeypatch):
    monkeypatch.setattr(spark_auth, "_jvm_running", lambda: True)
    with pytest.raises(ConfigurationError, match=r"^Could not parse Master URL: 'locall\[2\]'"):
        tfos.authenticate_spark("locall[2]")
    assert tfos.authenticate_spark("local[2]") is None


def test_a_cluster_manager_plugins_master_is_not_called_standalone():
    with pytest.raises(ConfigurationError) as info:
        spark_auth.auth_settings("nomad:http://10.0.0.1:4646", {})
    assert "not one of Spark's own master forms" in str(info.value) and "standalone" not in str(info.value)
    assert spark_auth.auth_settings("nomad:http://10.0.0.1:4646", {"spark.authenticate": "true", "spark.authenticate.secret": "s"}) == {
        "spark.network.crypto.enabled": "true"}
