"""Pure tests of tfos.dfutil's tf.train.Example conversion (TensorFlow, no Spark)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")


from pyspark.sql import Row  # noqa: E402
from pyspark.sql.types import (  # noqa: E402
    ArrayType,
    BinaryType,
    FloatType,
    LongType,
    StringType,
    StructField,
    StructType,
)

from tfos import dfutil  # noqa: E402
from tfos._dfutil.decode import _examples_to_tuples  # noqa: E402
from tfos._dfutil.schema import _field_specs  # noqa: E402

IMAGE = np.random.default_rng(0).random(784, dtype=np.float32).tolist()  # exactly representable as float32

DTYPES = [
    ("label", "int"),
    ("big", "bigint"),
    ("flag", "boolean"),
    ("score", "double"),
    ("image", "array<float>"),
    ("name", "string"),
    ("blob", "binary"),
    ("ids", "array<bigint>"),
    ("tags", "array<string>"),
]


def _row(label: int = 7, name: str = "héllo wörld ✓") -> Row:
    return Row(
        label=label,
        big=9223372036854775807,
        flag=True,
        score=0.5,
        image=IMAGE,
        name=name,
        blob=bytearray(b"\x00\x01\xffbinary"),
        ids=[-1, 0, 2**40],
        tags=["a", "ß"],
    )


def _serialize(rows: list[Any], dtypes: list[tuple[str, str]] = DTYPES) -> list[bytes]:
    return list(dfutil.toTFExample(dtypes)(iter(rows)))


def test_toTFExample_feature_kinds_and_values() -> None:
    (record,) = _serialize([_row()])
    assert isinstance(record, bytes)
    feature = tf.train.Example.FromString(record).features.feature
    assert list(feature["label"].int64_list.value) == [7]
    assert list(feature["big"].int64_list.value) == [9223372036854775807]
    assert list(feature["flag"].int64_list.value) == [1]
    assert list(feature["score"].float_list.value) == [0.5]
    assert list(feature["image"].float_list.value) == IMAGE
    assert list(feature["name"].bytes_list.value) == ["héllo wörld ✓".encode("utf-8")]
    assert list(feature["blob"].bytes_list.value) == [b"\x00\x01\xffbinary"]
    assert list(feature["ids"].int64_list.value) == [-1, 0, 2**40]
    assert list(feature["tags"].bytes_list.value) == [b"a", "ß".encode("utf-8")]


def test_round_trip_through_fromTFExample() -> None:
    rows = [_row(label=i, name=f"row {i}") for i in range(3)]
    decoded = list(dfutil.fromTFExample(_serialize(rows), binary_features=["blob"]))
    assert len(decoded) == 3
    for i, row in enumerate(decoded):
        assert row.__fields__ == sorted(name for name, _ in DTYPES)  # sorted by feature name
        assert row.label == i
        assert row.big == 9223372036854775807
        assert row.flag == 1
        assert row.score == 0.5
        assert row.image == IMAGE
        assert row.name == f"row {i}"
        assert row.blob == bytearray(b"\x00\x01\xffbinary")
        assert isinstance(row.blob, bytearray)
        assert row.ids == [-1, 0, 2**40]
        assert row.tags == ["a", "ß"]


def test_fromTFExample_accepts_hadoop_pairs_and_messages() -> None:
    (record,) = _serialize([_row()], [("label", "int"), ("name", "string")])
    example = tf.train.Example.FromString(record)
    for item in ([(bytearray(record), None)], [example], [memoryview(record)]):
        (row,) = list(dfutil.fromTFExample(item))
        assert row == Row(label=7, name="héllo wörld ✓")
    with pytest.raises(TypeError, match="expected serialized"):
        list(dfutil.fromTFExample([12345]))


def test_double_is_stored_with_float32_precision() -> None:
    (record,) = _serialize([Row(x=0.1)], [("x", "double")])
    (row,) = list(dfutil.fromTFExample([record]))
    assert row.x == float(np.float32(0.1))
    assert row.x != 0.1


def test_infer_schema_types_and_order() -> None:
    (record,) = _serialize([_row()])
    example = tf.train.Example.FromString(record)
    schema = dfutil.infer_schema(example, binary_features=["blob"])
    assert schema == StructType(
        [
            StructField("big", LongType(), True),
            StructField("blob", BinaryType(), True),
            StructField("flag", LongType(), True),
            StructField("ids", ArrayType(LongType()), True),
            StructField("image", ArrayType(FloatType()), True),
            StructField("label", LongType(), True),
            StructField("name", StringType(), True),
            StructField("score", FloatType(), True),
            StructField("tags", ArrayType(StringType()), True),
        ]
    )
    # Without binary_features, bytes are typed as strings (TensorFlowOnSpark behaviour).
    assert dfutil.infer_schema(example)["blob"].dataType == StringType()


def test_infer_schema_single_value_array_is_scalar_and_empty_is_string() -> None:
    example = tf.train.Example()
    example.features.feature["one"].float_list.value.append(1.5)
    example.features.feature["unset"].SetInParent()
    schema = dfutil.infer_schema(example)
    assert schema["one"].dataType == FloatType()
    assert schema["unset"].dataType == StringType()


def test_infer_schema_rejects_non_bytes_binary_feature() -> None:
    (record,) = _serialize([Row(label=1)], [("label", "int")])
    with pytest.raises(ValueError, match="'label'"):
        dfutil.infer_schema(tf.train.Example.FromString(record), binary_features=["label"])


@pytest.mark.parametrize(
    "dtype",
    ["decimal(10,2)", "date", "timestamp", "map<string,int>", "struct<a:int>", "array<array<int>>", "array<date>"],
)
def test_toTFExample_rejects_unsupported_types_eagerly(dtype: str) -> None:
    with pytest.raises(TypeError) as info:
        dfutil.toTFExample([("ok", "int"), ("bad_col", dtype)])  # no iteration needed
    assert "bad_col" in str(info.value)
    assert dtype in str(info.value)


def test_nulls_become_empty_lists() -> None:
    dtypes = [("i", "int"), ("f", "float"), ("s", "string"), ("a", "array<float>")]
    (record,) = _serialize([Row(i=None, f=None, s=None, a=None)], dtypes)
    feature = tf.train.Example.FromString(record).features.feature
    assert [feature[name].WhichOneof("kind") for name in "ifsa"] == [
        "int64_list",
        "float_list",
        "bytes_list",
        "float_list",
    ]
    (row,) = list(dfutil.fromTFExample([record]))
    assert row == Row(a=None, f=None, i=None, s=None)


def test_null_array_element_raises_with_column_name() -> None:
    with pytest.raises(ValueError, match="'vec'"):
        _serialize([Row(vec=[1.0, None])], [("vec", "array<double>")])


def test_mistyped_value_raises_with_column_name() -> None:
    with pytest.raises(TypeError, match="'n'"):
        _serialize([Row(n="not a number")], [("n", "int")])


def test_schema_aware_decoding_used_by_loadTFRecords() -> None:
    dtypes = [("vec", "array<float>"), ("x", "int")]
    records = _serialize([Row(vec=[1.0, 2.0], x=1), Row(vec=[3.0], x=None), Row(vec=[], x=2)], dtypes)
    schema = dfutil.infer_schema(tf.train.Example.FromString(records[0]))
    fields = _field_specs(schema)
    assert list(_examples_to_tuples(records, fields)) == [([1.0, 2.0], 1), ([3.0], None), ([], 2)]
    # A scalar column whose later record holds several values does not fit the inferred schema.
    bad = _serialize([Row(vec=[1.0, 2.0], x=[1, 2])], [("x", "array<int>"), ("vec", "array<float>")])
    with pytest.raises(ValueError, match="'x'"):
        list(_examples_to_tuples(bad, fields))


def test_isLoadedDF_false_for_unregistered_objects() -> None:
    assert dfutil.isLoadedDF(object()) is False  # type: ignore[arg-type]  # not weak-referenceable
    assert dfutil.isLoadedDF(Row(a=1)) is False  # type: ignore[arg-type]


def test_non_utf8_bytes_need_binary_features() -> None:
    (record,) = _serialize([Row(raw=bytearray(b"\xff\xfe"))], [("raw", "binary")])
    with pytest.raises(ValueError, match="binary_features"):
        list(dfutil.fromTFExample([record]))
    (row,) = list(dfutil.fromTFExample([record], binary_features=["raw"]))
    assert row.raw == bytearray(b"\xff\xfe")


def test_toTFExample_accepts_dicts_and_reordered_rows() -> None:
    dtypes = [("b", "string"), ("a", "int")]
    records = _serialize([Row(a=1, b="x"), {"a": 2, "b": "y"}, Row(b="z", a=3)], dtypes)
    assert list(dfutil.fromTFExample(records)) == [Row(a=1, b="x"), Row(a=2, b="y"), Row(a=3, b="z")]
    with pytest.raises(KeyError, match="'b'"):
        _serialize([Row(a=1)], dtypes)
