"""Spark ML persistence of ``TFEstimator``/``TFModel`` without a SparkContext: what goes
into the JSON metadata and the cloudpickled code, the SHA-256 check, and that a stage
rebuilt from the metadata has exactly the same params (set and default), uid and args.

The real save/load through Spark's writers (and a fitted ``PipelineModel``) is
tests/spark/test_pipeline.py::test_pipeline_model_save_load_same_predictions."""

from __future__ import annotations

import json
import types

import pytest

pytest.importorskip("pyspark")

from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter, MLReadable, MLWritable  # noqa: E402

from tfos._pipeline.persist import (  # noqa: E402
    PERSIST_FORMAT, _check_metadata, _dump_code, _json_exact, _load_code, _stage_payload,
)
from tfos.pipeline import TFEstimator, TFEstimatorReader, TFModel, TFModelReader, TFStageWriter  # noqa: E402


def train_fn(args, ctx):  # never run as a node here
    return ("module-level", args)


FAKE_SPARK = types.SimpleNamespace(version="4.0.0")  # _get_metadata_to_save reads only .version


def _round_trip(instance, reader_cls):
    """Metadata JSON + code exactly as TFStageWriter builds them, read back as the reader does."""
    extras, code = _stage_payload(instance)
    if code is not None:
        text, sha = _dump_code(code)
        extras["code"] = {"sha256": sha}
    else:
        text, extras["code"] = None, None
    meta_json = DefaultParamsWriter._get_metadata_to_save(instance, FAKE_SPARK, extras)
    metadata = DefaultParamsReader._parseMetaData(meta_json)
    loaded_code = _load_code(text, extras["code"]["sha256"], "x") if text else {}
    args = metadata["args"] if metadata["args"] is not None else loaded_code.get("args", {})
    if reader_cls is TFEstimatorReader:
        obj = TFEstimator(loaded_code["train_fn"], args, loaded_code.get("export_fn"))
    else:
        obj = TFModel(args)
    return reader_cls._finish(obj, metadata), metadata, text


def _params(stage):
    return {p.name: (stage.isSet(p), stage.getOrDefault(p) if stage.isDefined(p) else None) for p in stage.params}


def test_stages_are_ml_writable_and_readable():
    est = TFEstimator(train_fn, {})
    model = TFModel({})
    assert isinstance(est, MLWritable) and isinstance(est, MLReadable)
    assert isinstance(model, MLWritable) and isinstance(model, MLReadable)
    assert isinstance(est.write(), TFStageWriter) and isinstance(model.write(), TFStageWriter)
    assert isinstance(TFEstimator.read(), TFEstimatorReader) and TFEstimator.read().cls is TFEstimator
    assert isinstance(TFModel.read(), TFModelReader) and TFModel.read().cls is TFModel


def test_estimator_round_trip_every_param_args_and_train_fn():
    est = (
        TFEstimator(train_fn, {"lr": 0.25, "layers": [3, 4], "name": "m"})
        .setInputMapping({"image": "x", "label": "y"}).setClusterSize(3).setNumPS(1).setDriverPSNodes(True)
        .setMasterNode("chief").setTensorboard(True).setModelDir("/m").setExportDir("/e").setBatchSize(7)
        .setEpochs(4).setSteps(9).setGraceSecs(2).setFeedTimeout(12.5).setReaders(2).setProtocol("grpc")
        .setTFRecordDir("/t")
    )
    back, metadata, text = _round_trip(est, TFEstimatorReader)
    assert metadata["class"] == "tfos.pipeline.TFEstimator" and metadata["tfosFormat"] == PERSIST_FORMAT
    assert metadata["args"] == {"lr": 0.25, "layers": [3, 4], "name": "m"}  # plain JSON: not pickled
    assert text is not None and metadata["code"]["sha256"]  # train_fn always is
    assert back.uid == est.uid
    assert _params(back) == _params(est)
    assert back.getFeedTimeout() == 12.5 and back.getInputMapping() == {"image": "x", "label": "y"}
    assert vars(back.args) == vars(est.args)
    assert back.train_fn(1, None) == ("module-level", 1)
    assert back.export_fn is None
    # unset params stay unset (defaults only), so a later default change still applies
    fresh, _, _ = _round_trip(TFEstimator(train_fn, {}), TFEstimatorReader)
    assert not any(fresh.isSet(p) for p in fresh.params)


def test_estimator_closure_and_non_json_args_are_pickled_by_value():
    scale = 5
    est = TFEstimator(lambda args, ctx: scale * args.k, {"k": 2, "shape": (2, 3)}, export_fn=lambda *a: "exp")
    back, metadata, _ = _round_trip(est, TFEstimatorReader)
    assert metadata["args"] is None  # the tuple would come back a list: pickled instead
    assert vars(back.args) == {"k": 2, "shape": (2, 3)}
    assert back.train_fn(back.args, None) == 10
    assert back.export_fn() == "exp"


def test_estimator_from_argv_keeps_argv():
    est = TFEstimator(train_fn, ["--lr", "0.1"])
    back, metadata, _ = _round_trip(est, TFEstimatorReader)
    assert metadata["args"] == {"argv": ["--lr", "0.1"]}
    assert back.args.argv == ["--lr", "0.1"]


def test_model_round_trip_needs_no_pickle():
    model = (
        TFModel({"lr": 0.1}).setInputMapping({"f": "features"}).setOutputMapping({"prediction": "pred"})
        .setExportDir("/exp").setSignatureDefKey("predict").setTagSet("serve,gpu").setBatchSize(64).setModelDir("/m")
    )
    back, metadata, text = _round_trip(model, TFModelReader)
    assert text is None and metadata["code"] is None
    assert back.uid == model.uid and _params(back) == _params(model)
    assert (back.getSignatureDefKey(), back.getTagSet(), back.getExportDir()) == ("predict", "serve,gpu", "/exp")
    assert back.getOutputMapping() == {"prediction": "pred"}
    assert vars(back.args) == {"lr": 0.1}


def test_fitted_model_values_survive():
    """The TFModel fit() returns (params copied from the estimator) round-trips too."""
    est = TFEstimator(train_fn, {"a": 1}).setExportDir("/e").setBatchSize(5).setInputMapping({"x": "x"})
    model = est._copyValues(TFModel(est.args))
    back, _, _ = _round_trip(model, TFModelReader)
    assert _params(back) == _params(model) and back.getExportDir() == "/e" and back.getBatchSize() == 5


def test_param_json_cannot_hold_is_refused_with_its_name():
    model = TFModel({})
    model._set(input_mapping={1: "x"})  # int key: JSON would give "1"
    with pytest.raises(ValueError, match=r"TFModel param input_mapping=\{1: 'x'\} cannot be saved"):
        _stage_payload(model)


def test_damaged_code_is_refused_before_unpickling():
    text, sha = _dump_code({"train_fn": train_fn})
    assert _load_code(text, sha, "p")["train_fn"](2, None) == ("module-level", 2)
    with pytest.raises(ValueError, match=r"p: the saved code's SHA-256 is [0-9a-f]{64}, the metadata says 0+: the stage is damaged"):
        _load_code(text, "0" * 64, "p")


@pytest.mark.parametrize(
    "value, exact",
    [
        ({"a": [1, 2.5, None, True, "s"]}, True), ((1, 2), False), ({1: "a"}, False), (float("nan"), False),
        (1, True), (True, True), ({"a": (1,)}, False), (b"x", False),
    ],
)
def test_json_exact(value, exact):
    assert _json_exact(value) is exact
    if exact:
        assert json.loads(json.dumps(value)) == value


def _metadata(instance):
    extras, code = _stage_payload(instance)
    extras["code"] = {"sha256": _dump_code(code)[1]} if code is not None else None
    return DefaultParamsReader._parseMetaData(DefaultParamsWriter._get_metadata_to_save(instance, FAKE_SPARK, extras))


def test_metadata_checks_run_before_any_unpickling():
    """A tampered directory cannot make TFModel.load unpickle: a code/ part next to JSON args,
    an estimator's directory loaded as a TFModel, and malformed entries are refused by the
    metadata check, which runs before code/ is read (names the path)."""
    model_meta = _metadata(TFModel({"lr": 0.1}))
    assert _check_metadata(model_meta, TFModel, "/m") is None
    forged = dict(model_meta, code={"sha256": "a" * 64})
    with pytest.raises(ValueError, match=r"/m: a TFModel with JSON args and a code/ part was not written by tfos"):
        _check_metadata(forged, TFModel, "/m")
    est_meta = _metadata(TFEstimator(train_fn, {"a": 1}))
    assert _check_metadata(est_meta, TFEstimator, "/e")["sha256"]
    with pytest.raises(ValueError, match=r"/e holds a saved tfos.pipeline.TFEstimator, not a tfos.pipeline.TFModel"):
        _check_metadata(est_meta, TFModel, "/e")
    with pytest.raises(ValueError, match=r"/m: metadata tfosFormat is '1', not an integer"):
        _check_metadata(dict(model_meta, tfosFormat="1"), TFModel, "/m")
    with pytest.raises(ValueError, match=r"/m: metadata code is 'abc'"):
        _check_metadata(dict(model_meta, code="abc", args=None), TFModel, "/m")
    with pytest.raises(ValueError, match=r"newer|reads up to"):
        _check_metadata(dict(model_meta, tfosFormat=PERSIST_FORMAT + 1), TFModel, "/m")
    # a TFModel whose args JSON cannot hold is written with code/ and no JSON args: accepted
    tuple_meta = _metadata(TFModel({"shape": (28, 28)}))
    assert tuple_meta["args"] is None and _check_metadata(tuple_meta, TFModel, "/t")["sha256"]
