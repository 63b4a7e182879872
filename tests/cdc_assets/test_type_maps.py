"""The type maps: a declared column type to its Spark type, and to the encoding it has without a
schema in the envelope (the connector's defaults, or the table's setting). Pure: no broker, no
Spark."""

from __future__ import annotations

import pytest

from cdc_assets.config import TableSpec, spark_type
from cdc_assets.decoding import values as enc
from cdc_assets.decoding.types import is_valid_type
from cdc_assets.decoding.values import Encoding


@pytest.mark.parametrize(
    ("declared", "stored"),
    [
        ("string", "string"),
        ("bigint", "bigint"),
        ("decimal(12,2)", "decimal(12,2)"),
        ("timestamp", "timestamp"),
        ("time", "string"),  # Spark has no time of day
        ("array<time>", "array<string>"),
        ("array<decimal(5,1)>", "array<decimal(5,1)>"),
    ],
)
def test_each_declared_type_is_stored_as(declared, stored):
    assert spark_type(declared) == stored


@pytest.mark.parametrize(
    ("declared", "valid"),
    [
        ("decimal(38,38)", True),
        ("decimal(39,2)", False),
        ("decimal(4,5)", False),
        ("array<array<int>>", False),
        ("array<int>", True),
        ("varchar", False),
    ],
)
def test_which_declared_types_are_valid(declared, valid):
    assert is_valid_type(declared) is valid


def test_without_a_schema_each_type_has_the_connectors_default_encoding():
    assert enc.configured_encoding("decimal(10,3)", None) == Encoding("bytes", enc.DECIMAL, scale=3)
    assert enc.configured_encoding("timestamp", None) == Encoding("int64", enc.MICRO_TIMESTAMP)
    assert enc.configured_encoding("time", None) == Encoding("int64", enc.MICRO_TIME)
    assert enc.configured_encoding("date", None) == Encoding("int32", enc.DATE)
    assert enc.configured_encoding("binary", None) == Encoding("bytes")
    assert enc.configured_encoding("float", None) == Encoding("float32")
    assert enc.configured_encoding("array<int>", None) == Encoding("array", items=Encoding("int32"))


def test_a_column_setting_wins_over_the_tables_and_the_tables_over_the_default():
    assert enc.configured_encoding("decimal(10,3)", None, decimal_handling="string") == Encoding(
        "string"
    )
    assert enc.configured_encoding("decimal(10,3)", "double", decimal_handling="string") == (
        Encoding("float64")
    )
    assert enc.configured_encoding("binary", None, binary_handling="hex") == Encoding(
        "string", enc.HEX_TEXT
    )
    assert enc.configured_encoding("timestamp", "ZonedTimestamp") == Encoding(
        "string", enc.ZONED_TIMESTAMP
    )
    assert enc.configured_encoding("time", "Time") == Encoding("int32", enc.TIME)


def test_the_encodings_a_column_may_set_follow_its_type():
    assert enc.configurable_encodings("decimal(5,2)") == (
        "precise",
        "string",
        "double",
        "variable_scale",
    )
    assert enc.configurable_encodings("array<binary>") == ("bytes", "base64", "hex")
    assert enc.configurable_encodings("bigint") == ()


def test_a_timestamp_shorthand_of_earlier_configs_names_its_encoding():
    spec = TableSpec(
        name="t",
        topic="t",
        primary_key=("id",),
        columns={"id": "bigint", "at": "timestamp(ms)", "seen": {"type": "timestamp"}},
        start_hour="2026-11-04-08:00",
    )
    assert spec.columns == {"id": "bigint", "at": "timestamp", "seen": "timestamp"}
    assert spec.encodings == {"at": "Timestamp"}
