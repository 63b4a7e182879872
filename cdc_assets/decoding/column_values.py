"""A whole column of values converted at once: the common encodings' fast rule.

`values.converter` reads one value in its encoding, exactly, or names why it can't. Most of
an hour's values are plain (an int64 in range, a string, a decimal as text), and checking
them one call at a time costs more than parsing the record. `column_converter` gives, for the
encodings whose rule is a plain check of the values' JSON kinds and ranges, a function that
converts a whole column when every value passes that check, and returns None otherwise; the
decoder then reads that column value by value with `values.converter`, which finds the
values that fail and their reasons. So a column either converts here to exactly what the
per-value rule gives, or not at all: there is no second rule to drift from the first.

Debezium's placeholder for an unchanged TOASTed value is never converted here: only the
string rule could take it, and it refuses a column holding one.
"""

from __future__ import annotations

from collections.abc import Callable

import pyarrow as pa

from cdc_assets.decoding import values as enc
from cdc_assets.decoding.cells import UNAVAILABLE

ColumnConverter = Callable[[list], "list | pa.Array | None"]

_NONE = type(None)


def _kinds(values: list) -> set[type]:
    return set(map(type, values)) - {_NONE}


def _present(values: list) -> list:
    return [v for v in values if v is not None]


def _ints_within(values: list, low: int, high: int) -> bool:
    """Every value is a JSON integer (not a boolean) from `low` to `high`."""
    kinds = _kinds(values)
    if not kinds:
        return True
    if kinds != {int}:
        return False
    present = _present(values)
    return low <= min(present) and max(present) <= high


def column_converter(declared: str, encoding: enc.Encoding) -> ColumnConverter | None:
    """The fast rule for `declared` values in `encoding`, or None when it has none.

    Only pairs for which `values.converter` makes a converter (no mismatch) get one, and
    each accepts exactly the values that converter accepts without error, with the same
    result (an Arrow array holds the same values as the list it stands for).
    """
    family = "decimal" if enc.decimal_shape(declared) else declared
    kind, name = encoding.type, encoding.name
    if family in ("bigint", "int"):
        if kind not in enc.INT_TYPES or name not in enc.INTEGER_NAMES:
            return None
        if declared == "int" and kind == "int64":
            return None
        low, high = enc.INT_RANGE[declared]
        return lambda values: values if _ints_within(values, low, high) else None
    if family in ("double", "float"):
        if name is not None or kind not in ("float32", "float64", "int8", "int16", "int32"):
            return None
        if declared == "float" and kind == "float64":
            return None
        return _floats
    if family == "boolean":
        if kind != "boolean":
            return None
        return lambda values: values if _kinds(values) <= {bool} else None
    if family == "string":
        if kind != "string" or name is not None:
            return None
        return _strings
    if family == "decimal":
        if name is not None or kind != "string":
            return None
        return _decimal_text(pa.decimal128(*enc.decimal_shape(declared)))
    if family == "date":
        if name not in (enc.DATE, enc.CONNECT_DATE) or kind != "int32":
            return None
        return lambda values: values if _ints_within(values, enc.MIN_DAY, enc.MAX_DAY) else None
    if family == "timestamp":
        factor = {enc.MICRO_TIMESTAMP: 1, enc.TIMESTAMP: 1000, enc.CONNECT_TIMESTAMP: 1000}.get(
            name
        )
        if factor is None or kind != "int64":
            return None
        return _timestamps(factor)
    return None


def _strings(values: list) -> list | None:
    # Debezium's placeholder for an unchanged TOASTed value is a string too: a column holding
    # one is read value by value (`cells` says what it means there).
    if _kinds(values) <= {str} and UNAVAILABLE not in values:
        return values
    return None


def _floats(values: list) -> list | None:
    kinds = _kinds(values)
    if kinds <= {float}:
        return values
    if kinds <= {float, int}:
        return [None if v is None else float(v) for v in values]
    return None


def _decimal_text(arrow_type: pa.Decimal128Type) -> ColumnConverter:
    """Decimal text (decimal.handling.mode=string): Arrow's cast is exact or fails (it refuses
    to drop a digit or overflow the precision), after the same text check as `_decimal_text`
    and a length no 128-bit decimal could misread."""
    match = enc.DECIMAL_TEXT.match

    def convert(values: list) -> pa.Array | None:
        kinds = _kinds(values)
        if not kinds:
            return pa.array(values, arrow_type)
        if kinds != {str}:
            return None
        present = _present(values)
        if max(map(len, present)) > 30 or not all(map(match, present)):
            return None
        try:
            return pa.array(values, pa.string()).cast(arrow_type)
        except pa.ArrowInvalid:
            return None

    return convert


def _timestamps(factor: int) -> ColumnConverter:
    """Epoch milliseconds or microseconds within years 1 to 9999, as microseconds."""
    low, high = enc.MIN_MICROS, enc.MAX_MICROS
    limit = high // factor

    def convert(values: list) -> list | None:
        kinds = _kinds(values)
        if not kinds:
            return values
        if kinds != {int}:
            return None
        present = _present(values)
        smallest, largest = min(present), max(present)
        if max(abs(smallest), abs(largest)) > limit:
            return None
        if not (low <= smallest * factor and largest * factor <= high):
            return None
        return values if factor == 1 else [None if v is None else v * factor for v in values]

    return convert
