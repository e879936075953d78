"""Param plumbing of ``tfos.pipeline`` (no SparkContext, no TensorFlow): ``Namespace``,
``merge_args_params``, setters/getters and their type conversion, defaults, copies, and
the checks that fail before any Spark work."""

from __future__ import annotations

import logging
import argparse
import pickle

import pytest

pytest.importorskip("pyspark")

from pyspark.sql.types import ArrayType, BinaryType, BooleanType, DoubleType, LongType, StructField, StructType  # noqa: E402

from tfos.cluster_template import InputMode  # noqa: E402
from tfos.errors import ConfigurationError  # noqa: E402
from tfos._pipeline.runner import output_schema as _output_schema  # noqa: E402
from tfos.pipeline import Namespace, TFEstimator, TFModel, TFTypeConverters  # noqa: E402


def train_fn(args, ctx):  # never run here
    raise AssertionError("not called")


ESTIMATOR_DEFAULTS = {
    "input_mapping": {}, "cluster_size": 1, "num_ps": 0, "driver_ps_nodes": False, "input_mode": 1,
    "master_node": "chief", "protocol": "grpc", "tensorboard": False, "model_dir": None, "export_dir": None,
    "tfrecord_dir": None, "batch_size": 100, "epochs": 1, "readers": 1, "steps": 1000, "grace_secs": 30,
    "feed_timeout": 600.0,
}
MODEL_DEFAULTS = {
    "input_mapping": {}, "output_mapping": {}, "batch_size": 100, "model_dir": None, "export_dir": None,
    "signature_def_key": "serving_default", "tag_set": "serve",
}


# ------------------------------------------------------------------------------ Namespace


def test_namespace_from_dict():
    ns = Namespace({"lr": 0.1, "layers": [3, 4]})
    assert (ns.lr, ns.layers) == (0.1, [3, 4])
    assert vars(ns) == {"lr": 0.1, "layers": [3, 4]}
    assert "lr" in ns and "layers" in ns and "missing" not in ns
    assert list(ns) == ["lr", "layers"]
    assert ns.argv is None and "argv" not in ns  # TFoS: argv is not one of the keys


def test_namespace_from_argparse_namespace_is_a_copy():
    src = argparse.Namespace(lr=0.5, steps=7)
    ns = Namespace(src)
    assert vars(ns) == {"lr": 0.5, "steps": 7}
    ns.lr = 1.0
    assert src.lr == 0.5
    again = Namespace(ns)  # a tfos Namespace is an argparse.Namespace too
    assert vars(again) == {"lr": 1.0, "steps": 7} and again is not ns


def test_namespace_from_argv_list():
    argv = ["--lr", "0.1", "--steps", "5"]
    ns = Namespace(argv)
    assert ns.argv == argv
    assert vars(ns) == {"argv": argv}
    assert list(ns) == argv  # TFoS iterates over the argv items
    assert "argv" in ns
    assert Namespace(Namespace(argv)).argv == argv


def test_namespace_none_is_empty():
    ns = Namespace(None)
    assert vars(ns) == {} and list(ns) == [] and ns.argv is None


@pytest.mark.parametrize("bad, name", [("--lr 0.1", "str"), (("--lr", "0.1"), "tuple"), (5, "int"), (object(), "object")])
def test_namespace_rejects_other_types(bad, name):
    with pytest.raises(TypeError) as info:
        Namespace(bad)
    assert str(info.value) == f"tf_args must be a dict, an argparse.Namespace or an argv list, got {name}"


def test_estimator_rejects_bad_tf_args():
    with pytest.raises(TypeError, match=r"tf_args must be a dict, an argparse.Namespace or an argv list, got str"):
        TFEstimator(train_fn, "--lr 0.1")


def test_namespace_pickles():
    for ns in (Namespace({"a": 1}), Namespace(["--a", "1"])):
        back = pickle.loads(pickle.dumps(ns))
        assert type(back) is Namespace and vars(back) == vars(ns) and back.argv == ns.argv


# ------------------------------------------------------------------------------ defaults


def test_estimator_defaults():
    est = TFEstimator(train_fn, {})
    got = {p.name: est.getOrDefault(p) for p in est.params}
    assert got == ESTIMATOR_DEFAULTS
    assert est.getFeedTimeout() == 600.0 and isinstance(est.getFeedTimeout(), float)
    assert est.getMasterNode() == "chief"
    assert InputMode(est.getInputMode()) is InputMode.SPARK
    assert not any(est.isSet(p) for p in est.params)
    assert est.train_fn is train_fn and est.export_fn is None


def test_model_defaults():
    model = TFModel()
    assert {p.name: model.getOrDefault(p) for p in model.params} == MODEL_DEFAULTS
    assert model.getSignatureDefKey() == "serving_default" and model.getTagSet() == "serve"
    assert vars(model.args) == {}


# --------------------------------------------------------------------- setters / getters


def test_estimator_setters_chain_and_getters_read_back():
    est = TFEstimator(train_fn, {"lr": 0.1})
    same = (
        est.setInputMapping({"image": "x", "label": "y"}).setClusterSize(3).setNumPS(1).setDriverPSNodes(True)
        .setInputMode(InputMode.SPARK).setMasterNode("master").setProtocol("grpc").setGraceSecs(5)
        .setTensorboard(True).setModelDir("/m").setExportDir("/e").setTFRecordDir("/t").setBatchSize(32)
        .setEpochs(3).setReaders(2).setSteps(50).setFeedTimeout(3)
    )
    assert same is est
    assert est.getInputMapping() == {"image": "x", "label": "y"}
    assert (est.getClusterSize(), est.getNumPS(), est.getDriverPSNodes(), est.getInputMode()) == (3, 1, True, 1)
    assert (est.getMasterNode(), est.getProtocol(), est.getGraceSecs(), est.getTensorboard()) == ("master", "grpc", 5, True)
    assert (est.getModelDir(), est.getExportDir(), est.getTFRecordDir()) == ("/m", "/e", "/t")
    assert (est.getBatchSize(), est.getEpochs(), est.getReaders(), est.getSteps()) == (32, 3, 2, 50)
    assert est.getFeedTimeout() == 3.0 and isinstance(est.getFeedTimeout(), float)
    est.setMasterNode(None)
    assert est.getMasterNode() is None


def test_model_setters_chain_and_getters_read_back():
    model = TFModel({"a": 1})
    same = (
        model.setInputMapping({"img": "x"}).setOutputMapping({"y": "pred"}).setBatchSize(8).setModelDir("/m")
        .setExportDir("/e").setSignatureDefKey("predict").setTagSet("serve,gpu")
    )
    assert same is model
    assert (model.getInputMapping(), model.getOutputMapping()) == ({"img": "x"}, {"y": "pred"})
    assert (model.getBatchSize(), model.getModelDir(), model.getExportDir()) == (8, "/m", "/e")
    assert (model.getSignatureDefKey(), model.getTagSet()) == ("predict", "serve,gpu")


def test_setters_convert_types():
    est = TFEstimator(train_fn, {})
    assert est.setBatchSize(32.0).getBatchSize() == 32 and isinstance(est.getBatchSize(), int)
    assert est.setFeedTimeout(2).getFeedTimeout() == 2.0
    with pytest.raises(TypeError):
        est.setBatchSize("32")
    with pytest.raises(TypeError):
        est.setEpochs(1.5)
    with pytest.raises(TypeError):
        est.setTensorboard("yes")
    with pytest.raises(TypeError, match=r"Could not convert \[\('a', 'b'\)\] to a dict"):
        est.setInputMapping([("a", "b")])
    with pytest.raises(TypeError, match="to a dict"):
        TFModel().setOutputMapping("pred")
    assert TFTypeConverters.toDict({"a": 1}) == {"a": 1}


# ------------------------------------------------------------------- merge_args_params


def test_merge_args_params_adds_every_param_to_a_copy():
    est = TFEstimator(train_fn, {"lr": 0.1, "hidden": 16}).setEpochs(3).setClusterSize(2).setFeedTimeout(3)
    merged = est.merge_args_params()
    assert isinstance(merged, Namespace) and merged is not est.args
    assert vars(est.args) == {"lr": 0.1, "hidden": 16}  # the user's args are left alone
    expected = dict(ESTIMATOR_DEFAULTS, lr=0.1, hidden=16, epochs=3, cluster_size=2, feed_timeout=3.0)
    assert vars(merged) == expected


def test_merge_args_params_params_win_over_user_args():
    # As in TFoS: a user key named like a param is replaced by the param's (default) value.
    est = TFEstimator(train_fn, {"epochs": 99, "batch_size": 7}).setEpochs(2)
    merged = est.merge_args_params()
    assert (merged.epochs, merged.batch_size) == (2, 100)


def test_merge_args_params_from_argparse_and_argv():
    est = TFEstimator(train_fn, argparse.Namespace(lr=0.2)).setSteps(10)
    merged = est.merge_args_params()
    assert (merged.lr, merged.steps, merged.argv) == (0.2, 10, None)
    argv = ["--lr", "0.3"]
    est = TFEstimator(train_fn, argv).setSteps(10)
    merged = est.merge_args_params()
    assert merged.argv == argv and merged.steps == 10
    assert vars(est.args) == {"argv": argv}


def test_model_merge_args_params():
    model = TFModel({"x": 1}).setExportDir("/e").setOutputMapping({"y": "pred"})
    assert vars(model.merge_args_params()) == dict(MODEL_DEFAULTS, x=1, export_dir="/e", output_mapping={"y": "pred"})


# ------------------------------------------------------------------------- copies


def test_copy_with_extra_params_is_independent():
    est = TFEstimator(train_fn, {"lr": 0.1}).setEpochs(2)
    other = est.copy({est.epochs: 5})
    assert (other.getEpochs(), est.getEpochs()) == (5, 2)
    other.setBatchSize(7)
    assert est.getBatchSize() == 100
    assert other.train_fn is train_fn and vars(other.args) == {"lr": 0.1}


def test_estimator_values_reach_the_model():
    # What fit() does after training: the model inherits the params it shares with the estimator.
    est = TFEstimator(train_fn, {"lr": 0.1}).setExportDir("/e").setBatchSize(32).setInputMapping({"f": "f"}).setEpochs(4)
    model = est._copyValues(TFModel(est.args))
    assert (model.getExportDir(), model.getBatchSize(), model.getInputMapping()) == ("/e", 32, {"f": "f"})
    assert model.isSet(model.export_dir) and not model.isSet(model.model_dir)
    assert not model.hasParam("epochs")
    assert vars(model.args) == {"lr": 0.1}


# ---------------------------------------------------------- checks before any Spark work


def test_fit_refuses_input_mode_tensorflow_before_spark():
    est = TFEstimator(train_fn, {}).setInputMode(InputMode.TENSORFLOW)
    with pytest.raises(ConfigurationError, match="input_mode must be InputMode.SPARK"):
        est.fit(None)  # raises before touching the (absent) SparkContext and dataset


def test_transform_needs_export_dir_and_mappings_before_spark():
    with pytest.raises(ValueError, match=r"TFModel needs export_dir \(the SavedModel to run\)"):
        TFModel().setInputMapping({"f": "x"}).setOutputMapping({"y": "p"}).transform(None)
    with pytest.raises(ValueError, match="TFModel needs input_mapping"):
        TFModel().setExportDir("/e").setOutputMapping({"y": "p"}).transform(None)
    with pytest.raises(ValueError, match="output_mapping"):
        TFModel().setExportDir("/e").setInputMapping({"f": "x"}).transform(None)


# ------------------------------------------------------------------ output schema


def test_output_schema_from_signature_kinds():
    schema = _output_schema(["a", "b", "c", "d"], [("float", 0), ("int", 1), ("bool", 0), ("bytes", 2)])
    assert schema == StructType([
        StructField("a", DoubleType(), True),
        StructField("b", ArrayType(LongType(), True), True),
        StructField("c", BooleanType(), True),
        StructField("d", ArrayType(ArrayType(BinaryType(), True), True), True),
    ])


@pytest.mark.parametrize("kinds", [[("float", 0), (None, 0)], [("float", None)], [("int", -1)]])
def test_output_schema_unknown_falls_back_to_inference(kinds):
    assert _output_schema(["a", "b"][: len(kinds)], kinds) is None


def test_set_input_mode_accepts_the_enum_and_ints():
    est = TFEstimator(train_fn, {})
    assert est.setInputMode(InputMode.TENSORFLOW).getInputMode() == 0
    assert type(est.getInputMode()) is int
    assert est.setInputMode(1).getInputMode() == 1
    for bad in (2, True, "1", 1.0):
        with pytest.raises(TypeError, match="to an InputMode"):
            est.setInputMode(bad)


# ------------------------------------------------- signature helpers (TensorFlow, no Spark)


@pytest.mark.tf
def test_signature_outputs_and_run_model(tmp_path):
    """``_signature_outputs`` reads kinds/ranks from the signature and checks the mappings;
    ``_run_model`` batches the rows and yields one tuple per row, in order."""
    tf = pytest.importorskip("tensorflow")
    from tfos._pipeline.runner import run_model as _run_model, signature_outputs as _signature_outputs

    class Module(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, 2], tf.float32, name="x"), tf.TensorSpec([None], tf.int64, name="k")])
        def serve(self, x, k):
            return {"sum": tf.reduce_sum(x, -1), "twice": x * 2.0, "k1": k + 1, "pos": k > 0}

    export_dir = str(tmp_path / "m")
    tf.saved_model.save(Module(), export_dir)
    s = {
        "export_dir": export_dir, "tag_set": "serve", "signature_def_key": "serving_default", "batch_size": 2,
        "inputs": ["k", "x"], "outputs": ["k1", "pos", "sum", "twice"],
    }
    assert _signature_outputs(s) == [("int", 0), ("bool", 0), ("float", 0), ("float", 1)]
    rows = [(i, [float(i), 1.0]) for i in range(-1, 4)]  # sorted columns: k, x
    out = list(_run_model(iter(rows), s))
    assert out == [(i + 1, i > 0, i + 1.0, [2.0 * i, 2.0]) for i in range(-1, 4)]
    assert list(_run_model(iter([]), s)) == []
    with pytest.raises(ValueError, match=r"output_mapping names signature output 'nope', but the signature has \['k1', 'pos', 'sum', 'twice'\]"):
        _signature_outputs(dict(s, outputs=["nope"]))
    with pytest.raises(ValueError, match=r"input_mapping names signature input 'y', but the signature has \['k', 'x'\]"):
        list(_run_model(iter(rows), dict(s, inputs=["y"])))
    with pytest.raises(ValueError, match=r"has no signature 'predict'; it has \['serving_default'\]"):
        _signature_outputs(dict(s, signature_def_key="predict"))


def test_fit_warns_when_train_fn_exported_nothing(tmp_path, caplog):
    """fit() names a missing SavedModel at once rather than leaving it to transform's tasks."""
    from tfos.pipeline import _warn_if_not_exported

    caplog.set_level(logging.WARNING, logger="tfos.pipeline")
    _warn_if_not_exported(str(tmp_path / "export"))
    assert f"no SavedModel at export_dir {tmp_path / 'export'}" in caplog.text
    caplog.clear()
    _warn_if_not_exported(None)
    assert "export_dir is not set" in caplog.text
    caplog.clear()
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "saved_model.pb").write_bytes(b"x")
    _warn_if_not_exported(str(tmp_path / "export"))
    _warn_if_not_exported(f"file://{tmp_path / 'export'}")
    _warn_if_not_exported(f"file:{tmp_path / 'export'}")
    _warn_if_not_exported("hdfs://namenode/models/export")  # not checked from the driver
    assert caplog.text == ""
    _warn_if_not_exported(f"file://{tmp_path / 'other'}")
    assert "no SavedModel at export_dir file://" in caplog.text
