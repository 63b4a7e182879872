"""How Debezium encodes a column's value in JSON, and its exact conversion to the declared type.

The rule, stated once: a value is read in the encoding it is in, or it is an error whose reason
names the column, the encoding found, the one expected and the setting that fixes it. Nothing
is guessed from how a value looks (the base64 text "76e4" is a precise decimal, not 760000).

Where the encoding comes from:

- With the Kafka Connect schema in the envelope (`value.converter.schemas.enable=true`, the
  JSON converter's default) each record's own schema says it: its Connect type, logical name
  and parameters (a decimal's scale). The table's settings are not consulted.
- Without a schema, the table's config says it: a column's `encoding`, else the table's
  `decimal_handling` / `binary_handling`, else the connector's default for the declared type
  (`configured_encoding`): precise decimals, MicroTimestamp, Date, MicroTime, bytea as bytes.

What each declared type accepts (anything else is an error naming the mismatch):

| declared        | encodings                                                                 |
|-----------------|---------------------------------------------------------------------------|
| bigint, int     | Connect int8/16/32/64 (Year, MicroDuration included), range-checked       |
| double, float   | Connect float32/64, int8/16/32 (exact)                                    |
| boolean         | Connect boolean (Postgres bit(1))                                         |
| decimal(p,s)    | Decimal (base64 unscaled two's complement + scale), VariableScaleDecimal, |
|                 | decimal text (decimal.handling.mode=string), float64 (mode=double) when   |
|                 | the double is exactly a value of scale s; integers; never rounded         |
| date            | io.debezium.time.Date, Connect Date (days since the epoch)                |
| timestamp       | Timestamp (ms), MicroTimestamp, NanoTimestamp (only whole microseconds),  |
|                 | Connect Timestamp (ms), ZonedTimestamp (ISO-8601 with offset, to UTC)     |
| time            | Time (ms), MicroTime, NanoTime, Connect Time: stored as 'HH:MM:SS.ffffff' |
| string          | any Connect string as sent (Json, Uuid, Enum, EnumSet, Xml, ZonedTime,    |
|                 | Interval, ...); decimals and temporal values as exact ISO/plain text;     |
|                 | Bits as a bit string                                                      |
| binary          | Connect bytes (base64 in JSON; Bits too), base64 or hex text              |
|                 | (binary.handling.mode=base64/hex: declare binary_handling)                |
| array<T>        | a Connect array whose items T accepts                                     |

Spark's timestamp holds microseconds and Delta has no time or interval type, hence `time` as
text and NanoTimestamp values with sub-microsecond digits as errors (declare `string` to keep
them whole).
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from decimal import Context, Decimal, Inexact, InvalidOperation
from typing import Any

from cdc_assets.decoding.types import array_item, decimal_shape

# Connect logical type names.
DECIMAL = "org.apache.kafka.connect.data.Decimal"
CONNECT_DATE = "org.apache.kafka.connect.data.Date"
CONNECT_TIME = "org.apache.kafka.connect.data.Time"
CONNECT_TIMESTAMP = "org.apache.kafka.connect.data.Timestamp"
VARIABLE_SCALE_DECIMAL = "io.debezium.data.VariableScaleDecimal"
DATE = "io.debezium.time.Date"
TIME = "io.debezium.time.Time"
MICRO_TIME = "io.debezium.time.MicroTime"
NANO_TIME = "io.debezium.time.NanoTime"
TIMESTAMP = "io.debezium.time.Timestamp"
MICRO_TIMESTAMP = "io.debezium.time.MicroTimestamp"
NANO_TIMESTAMP = "io.debezium.time.NanoTimestamp"
ZONED_TIMESTAMP = "io.debezium.time.ZonedTimestamp"
ZONED_TIME = "io.debezium.time.ZonedTime"
MICRO_DURATION = "io.debezium.time.MicroDuration"
INTERVAL = "io.debezium.time.Interval"
YEAR = "io.debezium.time.Year"
BITS = "io.debezium.data.Bits"
# Not Connect names: binary sent as text under binary.handling.mode=base64/hex, which the
# connector's schema declares as a plain string. Only the table's config can say so.
BASE64_TEXT = "cdc.base64"
HEX_TEXT = "cdc.hex"

INT_TYPES = ("int8", "int16", "int32", "int64")
INT_RANGE = {"int": (-(2**31), 2**31 - 1), "bigint": (-(2**63), 2**63 - 1)}
_TIMESTAMP_NAMES = {TIMESTAMP: 1000, CONNECT_TIMESTAMP: 1000, MICRO_TIMESTAMP: 1, NANO_TIMESTAMP: 0}
_TIME_NAMES = {TIME: 1000, CONNECT_TIME: 1000, MICRO_TIME: 1, NANO_TIME: 0}
INTEGER_NAMES = (None, YEAR, MICRO_DURATION)
# Spark's timestamp range: years 1 to 9999.
MIN_MICROS, MAX_MICROS = -62_135_596_800_000_000, 253_402_300_799_999_999
MIN_DAY, MAX_DAY = -719_162, 2_932_896
_DAY_MICROS = 86_400_000_000
_EPOCH_DATE = dt.date(1970, 1, 1)
EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)

# Decimal arithmetic that never rounds: a result needing more digits raises instead.
_EXACT = Context(prec=200, Emax=999_999, Emin=-999_999, traps=[InvalidOperation, Inexact])
# Debezium writes decimal.handling.mode=string as BigDecimal.toPlainString(): no exponent.
DECIMAL_TEXT = re.compile(r"^-?\d+(\.\d+)?$")
_DIGITS = re.compile(r"^\d+$")
_BASE64 = re.compile(r"^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$")
_HEX = re.compile(r"^(?:[0-9A-Fa-f]{2})*$")
_ISO_TIMESTAMP = re.compile(
    r"^(\d{4})-(\d{2})-(\d{2})T(\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?"
    r"(Z|[+-]\d{2}:\d{2}(?::\d{2})?)$"
)


class DecodeError(ValueError):
    """The value does not convert; the message is the reason (it never quotes the value)."""


class KindError(DecodeError):
    """The value is not in the encoding expected of it; `reason` says what it looks like."""

    def __init__(self, column: str, value: Any, expected: Encoding) -> None:
        super().__init__(column)
        self.column, self.value, self.expected = column, value, expected

    def reason(self, *, from_schema: bool, declared: str) -> str:
        decimal = decimal_shape(declared) is not None
        configurable = bool(configurable_encodings(declared))
        found = _looks_like(self.value, decimal=decimal)
        if from_schema:
            return (
                f"column '{self.column}' holds {found} where its record's own schema says "
                f"{self.expected.describe()}; the record contradicts its schema (was it "
                "rewritten after the connector?)"
            )
        fix = _fix_for_value(self.expected, self.value, decimal=decimal, configurable=configurable)
        return (
            f"column '{self.column}' holds {found} where {self.expected.describe()} was "
            f"expected; {fix}"
        )


@dataclass(frozen=True)
class Encoding:
    """How one value is encoded: its Connect type, logical name and parameters.

    `items` is an array's element encoding; `scale` a Connect Decimal's; `length` a Bits'.
    """

    type: str
    name: str | None = None
    scale: int | None = None
    items: Encoding | None = None
    length: int | None = None
    precision: int | None = None

    def describe(self) -> str:
        """The encoding as the person fixing a mismatch knows it."""
        if self.type == "array":
            return f"an array of {self.items.describe() if self.items else 'values'}"
        if self.name == DECIMAL:
            return f"base64 Connect Decimal (scale {self.scale}; decimal.handling.mode=precise)"
        if self.name == VARIABLE_SCALE_DECIMAL:
            return "VariableScaleDecimal (decimal.handling.mode=precise, no declared scale)"
        if self.name == BASE64_TEXT:
            return "base64 text (binary.handling.mode=base64)"
        if self.name == HEX_TEXT:
            return "hex text (binary.handling.mode=hex)"
        if self.name:
            return f"{self.name.rsplit('.', 1)[-1]} ({self.type})"
        return f"Connect {self.type}"

    def descriptor(self) -> str:
        """A compact, stable name for reports and schema drift (e.g. 'int64/MicroTimestamp')."""
        if self.type == "array":
            return f"array<{self.items.descriptor() if self.items else '?'}>"
        text = self.type if self.name is None else f"{self.type}/{self.name.rsplit('.', 1)[-1]}"
        return text if self.scale is None else f"{text}(scale={self.scale})"


# JsonConverter names Connect's FLOAT32 and FLOAT64 "float" and "double" in its schemas.
_JSON_SCHEMA_TYPES = {"float": "float32", "double": "float64"}


def from_connect_schema(schema: Mapping[str, Any]) -> Encoding:
    """The encoding a Connect field schema describes (JsonConverter's schema JSON)."""
    params = schema.get("parameters") or {}
    kind = _JSON_SCHEMA_TYPES.get(schema.get("type"), schema.get("type"))
    if kind == "array":
        items = schema.get("items")
        return Encoding("array", schema.get("name"), items=from_connect_schema(items or {}))
    is_decimal = schema.get("name") == DECIMAL
    scale = params.get("scale") if is_decimal else None
    precision = params.get("connect.decimal.precision") if is_decimal else None
    length = params.get("length") if schema.get("name") == BITS else None
    return Encoding(
        type=str(kind),
        name=schema.get("name"),
        scale=int(scale) if scale is not None else None,
        length=int(length) if length is not None else None,
        precision=int(precision) if precision is not None else None,
    )


# --- configured encodings (no schema in the envelope) ----------------------------------------

# Per declared type: the encodings a table may name for a column, by their setting names.
CONFIGURABLE = {
    "decimal": {
        "precise": "Decimal",
        "string": "string",
        "double": "double",
        "variable_scale": "VariableScaleDecimal",
    },
    "timestamp": {
        "Timestamp": TIMESTAMP,
        "MicroTimestamp": MICRO_TIMESTAMP,
        "NanoTimestamp": NANO_TIMESTAMP,
        "ZonedTimestamp": ZONED_TIMESTAMP,
    },
    "time": {"Time": TIME, "MicroTime": MICRO_TIME, "NanoTime": NANO_TIME},
    "binary": {"bytes": "bytes", "base64": BASE64_TEXT, "hex": HEX_TEXT},
}


def _family(declared: str) -> str:
    return "decimal" if decimal_shape(declared) else declared


def configurable_encodings(declared: str) -> tuple[str, ...]:
    """The `encoding` values a column of this declared type may set (empty: none needed)."""
    item = array_item(declared)
    return configurable_encodings(item) if item else tuple(CONFIGURABLE.get(_family(declared), ()))


def configured_encoding(
    declared: str,
    setting: str | None,
    *,
    decimal_handling: str = "precise",
    binary_handling: str = "bytes",
) -> Encoding:
    """The encoding a column has without a schema: its setting, else the table's, else the
    connector's default for the declared type."""
    item = array_item(declared)
    if item is not None:
        inner = configured_encoding(
            item, setting, decimal_handling=decimal_handling, binary_handling=binary_handling
        )
        return Encoding("array", items=inner)
    shape = decimal_shape(declared)
    if shape is not None:
        mode = setting or decimal_handling
        return {
            "precise": Encoding("bytes", DECIMAL, scale=shape[1]),
            "string": Encoding("string"),
            "double": Encoding("float64"),
            "variable_scale": Encoding("struct", VARIABLE_SCALE_DECIMAL),
        }[mode]
    if declared == "timestamp":
        name = CONFIGURABLE["timestamp"][setting or "MicroTimestamp"]
        return Encoding("string" if name == ZONED_TIMESTAMP else "int64", name)
    if declared == "time":
        name = CONFIGURABLE["time"][setting or "MicroTime"]
        return Encoding("int32" if name == TIME else "int64", name)
    if declared == "binary":
        mode = CONFIGURABLE["binary"][setting or binary_handling]
        return Encoding("bytes") if mode == "bytes" else Encoding("string", mode)
    return {
        "bigint": Encoding("int64"),
        "int": Encoding("int32"),
        "double": Encoding("float64"),
        "float": Encoding("float32"),
        "boolean": Encoding("boolean"),
        "string": Encoding("string"),
        "date": Encoding("int32", DATE),
    }[declared]


# --- conversion --------------------------------------------------------------------------------

Converter = Callable[[Any], Any]


@dataclass(frozen=True)
class Mismatch:
    """The declared type can't hold values of this encoding: the reason and the fix."""

    reason: str


def converter(
    column: str, declared: str, encoding: Encoding, *, from_schema: bool
) -> Converter | Mismatch:
    """The exact conversion of `encoding`'s JSON values to `declared`'s Python values.

    A converter takes a non-null JSON value and returns the Python value the Arrow column
    holds, or raises `DecodeError` with the reason. `from_schema`: the encoding is the
    connector's own (else the table's config said it), which the fixes name.
    """
    where = "in the connector's schema" if from_schema else "by the table's config"
    item = array_item(declared)
    if item is not None:
        if encoding.type != "array" or encoding.items is None:
            return _mismatch(column, declared, encoding, where)
        inner = converter(column, item, encoding.items, from_schema=from_schema)
        if isinstance(inner, Mismatch):
            return _mismatch(column, declared, encoding, where)
        return _array(column, inner)
    family = _family(declared)
    build = _BUILDERS.get(family)
    made = build(column, declared, encoding, from_schema) if build else None
    if made is None:
        return _mismatch(column, declared, encoding, where)

    def checked(value: Any) -> Any:
        try:
            return made(value)
        except KindError as exc:
            raise DecodeError(exc.reason(from_schema=from_schema, declared=declared)) from None

    return checked


def _mismatch(column: str, declared: str, encoding: Encoding, where: str) -> Mismatch:
    fix = _fix_for(declared, encoding)
    return Mismatch(
        f"column '{column}' is {encoding.describe()} {where} but is declared {declared}; {fix}"
    )


def _fix_for(declared: str, encoding: Encoding) -> str:
    if declared == "binary" and encoding.type == "string":
        return (
            "if the connector sends binary columns as text (binary.handling.mode=base64 or "
            "hex), declare binary_handling: base64 or hex for the table (or the column's "
            "encoding); else declare it string"
        )
    suggested = suggested_type(encoding)
    if suggested is not None and suggested != declared:
        return f"declare it {suggested}"
    return "declare the column with a type that holds it (see docs/debezium.md)"


def suggested_type(encoding: Encoding) -> str | None:
    """The declared type that holds an encoding's values best, or None when none does."""
    if encoding.type == "array":
        inner = suggested_type(encoding.items) if encoding.items else None
        return f"array<{inner}>" if inner and not inner.startswith("array<") else None
    if encoding.name == DECIMAL:
        precision = encoding.precision if encoding.precision else 38
        return f"decimal({max(precision, encoding.scale or 0)},{encoding.scale})"
    if encoding.name == VARIABLE_SCALE_DECIMAL:
        return "decimal(38,s) with the scale the source column has (or string)"
    if encoding.name in (DATE, CONNECT_DATE):
        return "date"
    if encoding.name in _TIMESTAMP_NAMES or encoding.name == ZONED_TIMESTAMP:
        return "timestamp"
    if encoding.name in _TIME_NAMES:
        return "time"
    if encoding.name in (BITS,) or encoding.type == "bytes":
        return "binary"
    if encoding.type == "string":
        return "string"
    if encoding.type in ("int8", "int16", "int32"):
        return "int"
    if encoding.type == "int64":
        return "bigint"
    if encoding.type == "float32":
        return "float"
    if encoding.type == "float64":
        return "double"
    if encoding.type == "boolean":
        return "boolean"
    return None


def _is_int(value: Any) -> bool:
    return type(value) is int


def _integer(
    column: str, declared: str, encoding: Encoding, from_schema: bool = True
) -> Converter | None:
    if encoding.type not in INT_TYPES or encoding.name not in INTEGER_NAMES:
        return None
    if declared == "int" and encoding.type == "int64":
        return None  # a 64-bit source column: declare bigint
    low, high = INT_RANGE[declared]

    def convert(value: Any) -> int:
        if not _is_int(value):
            raise KindError(column, value, encoding)
        if not low <= value <= high:
            raise DecodeError(f"column '{column}' holds a number out of the range of {declared}")
        return value

    return convert


def _floating(
    column: str, declared: str, encoding: Encoding, from_schema: bool = True
) -> Converter | None:
    if encoding.name is not None:
        return None
    if encoding.type not in ("float32", "float64", "int8", "int16", "int32"):
        return None
    if declared == "float" and encoding.type == "float64":
        return None  # a double precision source column: declare double

    def convert(value: Any) -> float:
        if _is_int(value) or type(value) is float:
            return float(value)
        raise KindError(column, value, encoding)

    return convert


def _boolean(
    column: str, declared: str, encoding: Encoding, from_schema: bool = True
) -> Converter | None:
    if encoding.type != "boolean":
        return None

    def convert(value: Any) -> bool:
        if type(value) is bool:
            return value
        raise KindError(column, value, encoding)

    return convert


def _decimal(
    column: str, declared: str, encoding: Encoding, from_schema: bool = True
) -> Converter | None:
    precision, scale = decimal_shape(declared)
    fit = _decimal_fitter(column, declared, precision, scale)
    if encoding.name == DECIMAL and encoding.scale is not None:
        unscaled = _unscaled_reader(column, encoding, ambiguous_digits=not from_schema)
        exponent = -encoding.scale
        return lambda value: fit(Decimal(unscaled(value)).scaleb(exponent, _EXACT))
    if encoding.name == VARIABLE_SCALE_DECIMAL:
        return lambda value: fit(_variable_scale(column, value))
    if encoding.name is not None:
        return None
    if encoding.type in INT_TYPES:
        return lambda value: fit(Decimal(_int_value(column, value, encoding)))
    if encoding.type == "string":
        return lambda value: fit(_decimal_text(column, value))
    if encoding.type == "float64":
        return lambda value: fit(_exact_double(column, value, scale))
    return None


def _int_value(column: str, value: Any, encoding: Encoding) -> int:
    if not _is_int(value):
        raise KindError(column, value, encoding)
    return value


def _decimal_fitter(column: str, declared: str, precision: int, scale: int) -> Converter:
    quantum = Decimal(1).scaleb(-scale, _EXACT)
    limit = Decimal(f"1e{precision - scale}")

    def fit(number: Decimal) -> Decimal:
        if not number.is_finite():
            raise DecodeError(f"column '{column}' holds NaN or infinity, which {declared} can't")
        try:
            exact = number.quantize(quantum, context=_EXACT)
        except (InvalidOperation, Inexact):
            exact = None
        if exact is None or exact != number:
            raise DecodeError(
                f"column '{column}' holds a value with more than {scale} decimal places, which "
                f"{declared} would round; declare the source column's scale"
            )
        if abs(exact) >= limit:
            raise DecodeError(f"column '{column}' holds a value too large for {declared}")
        return exact

    return fit


def _unscaled_reader(
    column: str, encoding: Encoding, *, ambiguous_digits: bool = False
) -> Converter:
    """Reads a Connect Decimal's unscaled integer from its base64 text.

    `ambiguous_digits`: without a schema nothing says the text is base64 rather than a
    decimal.handling.mode=string number, and a text of digits only reads both ways (the
    connector's base64 is all digits for about 1 value in 1,700 of up to 3 bytes, while
    decimal text of scale 0 always is): such a value is refused rather than guessed.
    """

    def read(value: Any) -> int:
        if type(value) is not str or not _BASE64.match(value):
            raise KindError(column, value, encoding)
        if ambiguous_digits and _DIGITS.match(value):
            raise DecodeError(
                f"column '{column}' holds digits only, which read both as base64 (a precise "
                "Connect Decimal, as the table's config says) and as decimal text "
                "(decimal.handling.mode=string); enable the connector's schemas "
                "(value.converter.schemas.enable=true) so the record says which, or declare "
                "decimal_handling: string if the connector sends text"
            )
        return int.from_bytes(base64.b64decode(value), "big", signed=True)

    return read


def _variable_scale(column: str, value: Any) -> Decimal:
    encoding = Encoding("struct", VARIABLE_SCALE_DECIMAL)
    if not isinstance(value, dict) or set(value) != {"scale", "value"}:
        raise KindError(column, value, encoding)
    scale, digits = value["scale"], value["value"]
    if not _is_int(scale) or type(digits) is not str or not _BASE64.match(digits):
        raise KindError(column, value, encoding)
    unscaled = int.from_bytes(base64.b64decode(digits), "big", signed=True)
    return Decimal(unscaled).scaleb(-scale, _EXACT)


def _decimal_text(column: str, value: Any) -> Decimal:
    if type(value) is str and DECIMAL_TEXT.match(value):
        return Decimal(value)
    raise KindError(column, value, Encoding("string"))


def _exact_double(column: str, value: Any, scale: int) -> Decimal:
    if _is_int(value):
        return Decimal(value)
    if type(value) is not float:
        raise KindError(column, value, Encoding("float64"))
    if not math.isfinite(value):
        raise DecodeError(f"column '{column}' holds NaN or infinity, which a decimal can't")
    # The double stands for the shortest decimal that reads back as it (what the source
    # printed); it is exact only if that decimal has at most `scale` places.
    return Decimal(repr(value))


def _date(
    column: str, declared: str, encoding: Encoding, from_schema: bool = True
) -> Converter | None:
    if encoding.name not in (DATE, CONNECT_DATE) or encoding.type != "int32":
        return None

    def convert(value: Any) -> int:
        days = _int_value(column, value, encoding)
        if not MIN_DAY <= days <= MAX_DAY:
            raise DecodeError(f"column '{column}' holds a date outside years 1 to 9999")
        return days

    return convert


def _timestamp(
    column: str, declared: str, encoding: Encoding, from_schema: bool = True
) -> Converter | None:
    if encoding.name == ZONED_TIMESTAMP and encoding.type == "string":
        return lambda value: _bounded_micros(column, _zoned_micros(column, value))
    factor = _TIMESTAMP_NAMES.get(encoding.name)
    if factor is None or encoding.type != "int64":
        return None

    def convert(value: Any) -> int:
        number = _int_value(column, value, encoding)
        if factor == 0:
            if number % 1000:
                raise DecodeError(
                    f"column '{column}' holds a NanoTimestamp with sub-microsecond digits, which "
                    "timestamp (microseconds) would cut; declare it string to keep them"
                )
            return _bounded_micros(column, number // 1000)
        if abs(number) > MAX_MICROS // factor:
            raise DecodeError(f"column '{column}' holds a timestamp outside years 1 to 9999")
        return _bounded_micros(column, number * factor)

    return convert


def _bounded_micros(column: str, micros: int) -> int:
    if not MIN_MICROS <= micros <= MAX_MICROS:
        raise DecodeError(f"column '{column}' holds a timestamp outside years 1 to 9999")
    return micros


def _zoned_micros(column: str, value: Any) -> int:
    match = _ISO_TIMESTAMP.match(value) if type(value) is str else None
    if match is None:
        raise KindError(column, value, Encoding("string", ZONED_TIMESTAMP))
    year, month, day, hour, minute, second, fraction, zone = match.groups()
    fraction = (fraction or "").ljust(9, "0")
    if fraction[6:] != "000":
        raise DecodeError(
            f"column '{column}' holds a ZonedTimestamp with sub-microsecond digits, which "
            "timestamp (microseconds) would cut; declare it string to keep them"
        )
    try:
        days = _days_from_civil(int(year), int(month), int(day))
        if not (int(hour) < 24 and int(minute) < 60 and int(second) < 60):
            raise ValueError
    except ValueError:
        raise DecodeError(f"column '{column}' holds a ZonedTimestamp that is no date") from None
    offset = 0
    if zone != "Z":
        sign = -1 if zone[0] == "-" else 1
        parts = [int(p) for p in zone[1:].split(":")]
        offset = sign * (parts[0] * 3600 + parts[1] * 60 + (parts[2] if len(parts) > 2 else 0))
    seconds = days * 86400 + int(hour) * 3600 + int(minute) * 60 + int(second) - offset
    return seconds * 1_000_000 + int(fraction[:6])


def _days_from_civil(year: int, month: int, day: int) -> int:
    """Days since 1970-01-01 of a proleptic Gregorian date (validated)."""
    return (dt.date(year, month, day) - _EPOCH_DATE).days


def _time(
    column: str, declared: str, encoding: Encoding, from_schema: bool = True
) -> Converter | None:
    factor = _TIME_NAMES.get(encoding.name)
    if factor is None or encoding.type not in ("int32", "int64"):
        return None

    def convert(value: Any) -> str:
        number = _int_value(column, value, encoding)
        nanos = number * 1000 * factor if factor else number
        if factor == 0 and number % 1000:
            raise DecodeError(
                f"column '{column}' holds a NanoTime with sub-microsecond digits, which time "
                "(microseconds) would cut; declare it string to keep them"
            )
        if not 0 <= nanos <= _DAY_MICROS * 1000:  # Postgres allows 24:00:00
            raise DecodeError(f"column '{column}' holds a time of day outside 00:00 to 24:00")
        return _time_text(nanos // 1000)

    return convert


def _time_text(micros: int, nanos_rest: int | None = None) -> str:
    seconds, micro = divmod(micros, 1_000_000)
    minutes, second = divmod(seconds, 60)
    hour, minute = divmod(minutes, 60)
    text = f"{hour:02d}:{minute:02d}:{second:02d}.{micro:06d}"
    return text if nanos_rest is None else f"{text}{nanos_rest:03d}"


def _string(
    column: str, declared: str, encoding: Encoding, from_schema: bool = True
) -> Converter | None:
    if encoding.type == "string" and encoding.name not in (BASE64_TEXT, HEX_TEXT):

        def verbatim(value: Any) -> str:
            if type(value) is str:
                return value
            raise KindError(column, value, encoding)

        return verbatim
    if encoding.name in (DECIMAL, VARIABLE_SCALE_DECIMAL):
        number = _decimal_any(column, encoding)
        return lambda value: _plain(number(value))
    if encoding.name in (DATE, CONNECT_DATE):
        days = _date(column, "date", encoding)
        return lambda value: _date_text(days(value))
    if encoding.name in _TIMESTAMP_NAMES and encoding.type == "int64":
        return _timestamp_text(column, encoding)
    if encoding.name in _TIME_NAMES:
        return _full_time_text(column, encoding)
    if encoding.name == BITS and encoding.type == "bytes":
        return lambda value: _bit_text(column, value, encoding)
    return None


def _decimal_any(column: str, encoding: Encoding) -> Converter:
    if encoding.name == VARIABLE_SCALE_DECIMAL:
        return lambda value: _variable_scale(column, value)
    unscaled = _unscaled_reader(column, encoding)
    return lambda value: Decimal(unscaled(value)).scaleb(-(encoding.scale or 0), _EXACT)


def _plain(number: Decimal) -> str:
    return format(number, "f")


def calendar_value(declared: str, value: Any) -> Any:
    """A decoded value as Python holds it outside Arrow: a date column's days since the epoch
    as a date, a timestamp column's microseconds as a UTC datetime; any other value as it is."""
    if type(value) is not int:
        return value
    if declared == "date":
        return _EPOCH_DATE + dt.timedelta(days=value)
    if declared == "timestamp":
        return EPOCH + dt.timedelta(microseconds=value)
    return value


def _date_text(days: int) -> str:
    return (_EPOCH_DATE + dt.timedelta(days=days)).isoformat()


def _timestamp_text(column: str, encoding: Encoding) -> Converter:
    factor = _TIMESTAMP_NAMES[encoding.name]

    def convert(value: Any) -> str:
        number = _int_value(column, value, encoding)
        nanos = number * factor * 1000 if factor else number
        micros, rest = divmod(nanos, 1000)
        _bounded_micros(column, micros)
        days, day_micros = divmod(micros, _DAY_MICROS)
        return f"{_date_text(days)}T{_time_text(day_micros, rest if not factor else None)}Z"

    return convert


def _full_time_text(column: str, encoding: Encoding) -> Converter:
    factor = _TIME_NAMES[encoding.name]

    def convert(value: Any) -> str:
        number = _int_value(column, value, encoding)
        nanos = number * factor * 1000 if factor else number
        if not 0 <= nanos <= _DAY_MICROS * 1000:
            raise DecodeError(f"column '{column}' holds a time of day outside 00:00 to 24:00")
        micros, rest = divmod(nanos, 1000)
        return _time_text(micros, rest if not factor else None)

    return convert


def _bit_text(column: str, value: Any, encoding: Encoding) -> str:
    data = _base64_bytes(column, value, encoding)
    length = encoding.length if encoding.length is not None else len(data) * 8
    # Connect's Bits are java.util.BitSet.toByteArray(): bit i in byte i // 8, little-endian;
    # the source's bit string puts bit 0 last (Postgres' B'1010' is bit 3 ... bit 0).
    number = int.from_bytes(data, "little")
    if number >> length:
        raise DecodeError(f"column '{column}' holds more bits than its length ({length})")
    return format(number, f"0{length}b") if length else ""


def _base64_bytes(column: str, value: Any, encoding: Encoding) -> bytes:
    if type(value) is not str or not _BASE64.match(value):
        raise KindError(column, value, encoding)
    return base64.b64decode(value)


def _binary(
    column: str, declared: str, encoding: Encoding, from_schema: bool = True
) -> Converter | None:
    if encoding.type == "bytes" and encoding.name in (None, BITS):
        return lambda value: _base64_bytes(column, value, encoding)
    if encoding.name == BASE64_TEXT:
        return lambda value: _base64_bytes(column, value, encoding)
    if encoding.name == HEX_TEXT:

        def from_hex(value: Any) -> bytes:
            if type(value) is not str or not _HEX.match(value):
                raise KindError(column, value, encoding)
            return binascii.unhexlify(value)

        return from_hex
    return None


def _array(column: str, item: Converter) -> Converter:
    def convert(value: Any) -> list:
        if type(value) is not list:
            raise DecodeError(f"column '{column}' holds {json_kind(value)} where an array was sent")
        return [None if element is None else item(element) for element in value]

    return convert


_BUILDERS: dict[str, Callable[[str, str, Encoding, bool], Converter | None]] = {
    "bigint": _integer,
    "int": _integer,
    "double": _floating,
    "float": _floating,
    "boolean": _boolean,
    "decimal": _decimal,
    "date": _date,
    "timestamp": _timestamp,
    "time": _time,
    "string": _string,
    "binary": _binary,
}


# --- what a value looks like, for reasons ------------------------------------------------------


def json_kind(value: Any) -> str:
    """The JSON kind of a parsed value, as reasons and schema drift name it."""
    if value is None:
        return "null"
    if type(value) is bool:
        return "boolean"
    if _is_int(value):
        return "integer"
    if type(value) is float:
        return "number"
    if type(value) is str:
        return "string"
    if type(value) is list:
        return "array"
    return "object"


def _looks_like(value: Any, *, decimal: bool) -> str:
    """What a value of the wrong encoding most likely is, named by the connector setting."""
    kind = json_kind(value)
    if kind == "number":
        return "a JSON number (decimal.handling.mode=double?)" if decimal else "a JSON number"
    if kind == "object" and isinstance(value, dict) and set(value) == {"scale", "value"}:
        return "a VariableScaleDecimal (decimal.handling.mode=precise on an unconstrained numeric)"
    if kind == "string":
        if decimal and DECIMAL_TEXT.match(value) and not _BASE64.match(value):
            return "decimal text (decimal.handling.mode=string?)"
        if _ISO_TIMESTAMP.match(value):
            return "an ISO-8601 timestamp (ZonedTimestamp?)"
        if decimal and _BASE64.match(value):
            return "base64 text (a precise Connect Decimal?)"
        return "a string"
    return f"a JSON {kind}"


def _fix_for_value(expected: Encoding, value: Any, *, decimal: bool, configurable: bool) -> str:
    kind = json_kind(value)
    if decimal:
        if kind == "string" and DECIMAL_TEXT.match(value) and expected.type != "string":
            return (
                "declare decimal_handling: string for the table (or the column's encoding), or "
                "set the connector's decimal.handling.mode=precise"
            )
        if kind == "number" and expected.type != "float64":
            return (
                "declare decimal_handling: double for the table (or the column's encoding), or "
                "set the connector's decimal.handling.mode=precise"
            )
        if kind == "string" and _BASE64.match(value):
            return (
                "declare decimal_handling: precise for the table (the connector's default), or "
                "set the connector's decimal.handling.mode=string"
            )
    if configurable:
        return (
            "enable the connector's schemas (value.converter.schemas.enable=true) or declare "
            "the column's encoding to match the connector's settings (docs/debezium.md)"
        )
    return "declare the column with the type the source sends"


def json_kinds_of(encoding: Encoding) -> set[str]:
    """The JSON kinds a configured encoding's values arrive as."""
    if encoding.type == "array":
        return {"array"}
    if encoding.type == "struct":
        return {"object"}
    if encoding.type in ("int8", "int16", "int32", "int64"):
        return {"integer"}
    if encoding.type in ("float32", "float64"):
        return {"number", "integer"}
    if encoding.type == "boolean":
        return {"boolean"}
    return {"string"}
