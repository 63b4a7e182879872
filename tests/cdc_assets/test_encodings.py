"""Each Debezium encoding, decoded exactly or refused with a reason that names the fix.

Pure functions: no broker, no Spark. The values are what Debezium's JSON converter writes (the
real connector's records are checked end to end in tests/cdc_sources/).
"""

from __future__ import annotations

import base64
from decimal import Decimal

import pytest

from cdc_assets.decoding import values as enc
from cdc_assets.decoding.values import DecodeError, Encoding


def _schema(type_: str, name: str | None = None, **parameters: str) -> Encoding:
    field = {"type": type_, "name": name, "parameters": parameters or None}
    return enc.from_connect_schema({k: v for k, v in field.items() if v is not None})


def _unscaled(number: int) -> str:
    size = max(1, (number.bit_length() + 8) // 8)
    return base64.b64encode(number.to_bytes(size, "big", signed=True)).decode()


def convert(declared: str, encoding: Encoding, value, *, from_schema: bool = True):
    made = enc.converter("c", declared, encoding, from_schema=from_schema)
    assert not isinstance(made, enc.Mismatch), made
    return made(value)


def refused(declared: str, encoding: Encoding, value, *, from_schema: bool = True) -> str:
    made = enc.converter("c", declared, encoding, from_schema=from_schema)
    if isinstance(made, enc.Mismatch):
        return made.reason
    with pytest.raises(DecodeError) as error:
        made(value)
    return str(error.value)


DECIMAL_2 = _schema("bytes", enc.DECIMAL, scale="2", **{"connect.decimal.precision": "14"})


def test_precise_decimals_are_base64_unscaled_integers_at_the_schema_scale():
    # The silent corruption: "76e4" is base64 for -10711.76, not 760000.
    assert convert("decimal(14,2)", DECIMAL_2, "76e4") == Decimal("-10711.76")
    assert convert("decimal(14,2)", DECIMAL_2, _unscaled(1230)) == Decimal("12.30")
    assert convert("decimal(14,2)", DECIMAL_2, "AA==") == Decimal("0.00")
    big = 10**37 - 1
    assert convert("decimal(38,0)", _schema("bytes", enc.DECIMAL, scale="0"), _unscaled(big)) == big
    # A coarser declared scale holds a value only when nothing is cut.
    scale_3 = _schema("bytes", enc.DECIMAL, scale="3")
    assert convert("decimal(14,2)", scale_3, _unscaled(12340)) == Decimal("12.34")
    assert "more than 2 decimal places" in refused("decimal(14,2)", scale_3, _unscaled(12345))
    assert "too large for decimal(4,2)" in refused("decimal(4,2)", DECIMAL_2, _unscaled(100000))


def test_variable_scale_decimals_carry_their_own_scale():
    variable = _schema("struct", enc.VARIABLE_SCALE_DECIMAL)
    value = {"scale": 3, "value": _unscaled(-1500)}
    assert convert("decimal(10,2)", variable, value) == Decimal("-1.50")
    assert convert("string", variable, value) == "-1.500"
    assert "more than 2 decimal places" in refused(
        "decimal(10,2)", variable, {"scale": 4, "value": _unscaled(12345)}
    )


def test_string_and_double_decimal_modes():
    text, double = Encoding("string"), Encoding("float64")
    assert convert("decimal(10,2)", text, "-3.10") == Decimal("-3.10")
    assert convert("decimal(10,2)", double, 10711.76) == Decimal("10711.76")
    assert convert("decimal(10,2)", double, 7) == Decimal("7.00")
    assert "more than 2 decimal places" in refused("decimal(10,2)", double, 0.1 + 0.2)


def test_without_a_schema_the_configured_mode_decides_and_mismatches_name_the_fix():
    precise = enc.configured_encoding("decimal(14,2)", None)  # the connector's default
    assert precise == Encoding("bytes", enc.DECIMAL, scale=2)
    assert convert("decimal(14,2)", precise, "76e4", from_schema=False) == Decimal("-10711.76")
    reason = refused("decimal(14,2)", precise, "12.30", from_schema=False)
    assert reason == (
        "column 'c' holds decimal text (decimal.handling.mode=string?) where base64 Connect "
        "Decimal (scale 2; decimal.handling.mode=precise) was expected; declare "
        "decimal_handling: string for the table (or the column's encoding), or set the "
        "connector's decimal.handling.mode=precise"
    )
    # Digits alone read both ways without a schema: refused, never guessed.
    assert "digits only" in refused("decimal(14,2)", precise, "1234", from_schema=False)
    assert convert("decimal(14,2)", DECIMAL_2, "1234") == Decimal(
        int.from_bytes(base64.b64decode("1234"), "big", signed=True)
    ).scaleb(-2)

    text = enc.configured_encoding("decimal(14,2)", None, decimal_handling="string")
    reason = refused("decimal(14,2)", text, "76e4", from_schema=False)
    assert "base64" in reason and "declare decimal_handling: precise" in reason
    assert "decimal.handling.mode=string" in reason
    double_found = refused("decimal(14,2)", text, 12.5, from_schema=False)
    assert "declare decimal_handling: double" in double_found


def test_a_record_contradicting_its_own_schema_says_so():
    reason = refused("decimal(14,2)", DECIMAL_2, "12.30")
    assert "its record's own schema says base64 Connect Decimal" in reason


def test_dates_times_and_timestamps_in_every_unit():
    day = _schema("int32", enc.DATE)
    assert convert("date", day, 20_395) == 20_395
    assert convert("date", _schema("int32", enc.CONNECT_DATE), -1) == -1
    assert convert("string", day, 0) == "1970-01-01"
    micros = 1_793_491_657_373_712
    assert convert("timestamp", _schema("int64", enc.MICRO_TIMESTAMP), micros) == micros
    assert convert("timestamp", _schema("int64", enc.TIMESTAMP), micros // 1000) == (
        micros // 1000 * 1000
    )
    assert convert("timestamp", _schema("int64", enc.CONNECT_TIMESTAMP), 5) == 5000
    nano = _schema("int64", enc.NANO_TIMESTAMP)
    assert convert("timestamp", nano, micros * 1000) == micros
    assert "sub-microsecond" in refused("timestamp", nano, micros * 1000 + 1)
    assert convert("string", nano, micros * 1000 + 1).endswith(".373712001Z")
    zoned = _schema("string", enc.ZONED_TIMESTAMP)
    assert convert("timestamp", zoned, "1970-01-01T01:00:00.5+01:00") == 500_000
    assert convert("timestamp", zoned, "2026-11-03T09:15:00Z") == 1_793_697_300_000_000
    assert convert("string", zoned, "2026-11-03T09:15:00Z") == "2026-11-03T09:15:00Z"
    assert "outside years 1 to 9999" in refused(
        "timestamp", _schema("int64", enc.MICRO_TIMESTAMP), 10**18
    )
    assert convert("time", _schema("int32", enc.TIME), 3_723_004) == "01:02:03.004000"
    assert convert("time", _schema("int64", enc.MICRO_TIME), 86_400_000_000) == "24:00:00.000000"
    assert convert("time", _schema("int64", enc.NANO_TIME), 1_000) == "00:00:00.000001"
    zoned_time = _schema("string", enc.ZONED_TIME)
    assert convert("string", zoned_time, "10:15:30.25Z") == "10:15:30.25Z"


def test_strings_of_every_name_are_kept_as_sent():
    for name in ("io.debezium.data.Json", "io.debezium.data.Uuid", "io.debezium.data.Enum",
                 "io.debezium.data.EnumSet", "io.debezium.data.Xml", enc.INTERVAL):  # fmt: skip
        assert convert("string", _schema("string", name), "a,b") == "a,b"
    assert convert("bigint", _schema("int64", enc.MICRO_DURATION), 90_000_000) == 90_000_000
    assert convert("int", _schema("int32", enc.YEAR), 2026) == 2026


def test_binary_as_bytes_base64_hex_and_bits():
    data = b"\x00\xffhi"
    assert convert("binary", _schema("bytes"), base64.b64encode(data).decode()) == data
    hex_text = enc.configured_encoding("binary", "hex")
    assert convert("binary", hex_text, data.hex(), from_schema=False) == data
    reason = refused("binary", _schema("string"), "00ff")
    assert "declare binary_handling: base64 or hex" in reason
    bits = _schema("bytes", enc.BITS, length="4")
    assert convert("string", bits, base64.b64encode(b"\x05").decode()) == "0101"
    assert convert("binary", bits, base64.b64encode(b"\x05").decode()) == b"\x05"


def test_arrays_of_scalars():
    ints = enc.from_connect_schema({"type": "array", "items": {"type": "int32"}})
    assert convert("array<int>", ints, [1, None, 3]) == [1, None, 3]
    decimals = enc.from_connect_schema(
        {
            "type": "array",
            "items": {"type": "bytes", "name": enc.DECIMAL, "parameters": {"scale": "1"}},
        }
    )
    assert convert("array<decimal(5,1)>", decimals, [_unscaled(15)]) == [Decimal("1.5")]
    assert "declare it array<int>" in refused("array<string>", ints, [1])


def test_declared_types_that_cannot_hold_the_encoding_name_the_type_that_can():
    micro = _schema("int64", enc.MICRO_TIMESTAMP)
    assert refused("bigint", micro, 1) == (
        "column 'c' is MicroTimestamp (int64) in the connector's schema but is declared "
        "bigint; declare it timestamp"
    )
    assert "declare it bigint" in refused("int", _schema("int64"), 1)
    assert "declare it decimal(14,2)" in refused("double", DECIMAL_2, "AA==")
    assert "declare it string" in refused("bigint", _schema("string"), "1")


def test_json_converter_type_names():
    # JsonConverter writes Connect's FLOAT32/FLOAT64 as "float"/"double" (a real connector's).
    assert convert("float", enc.from_connect_schema({"type": "float"}), 1.5) == 1.5
    assert convert("double", enc.from_connect_schema({"type": "double"}), 2) == 2.0


def test_integers_and_booleans_are_strict():
    assert "out of the range of int" in refused("int", _schema("int32"), 2**31)
    assert "holds a string where" in refused("bigint", _schema("int64"), "42")
    assert "holds a JSON boolean" in refused("bigint", _schema("int64"), True)
    assert "holds a string" in refused("boolean", _schema("boolean"), "yes")
    assert convert("double", _schema("int32"), 3) == 3.0
