"""One value of a row, as both decode passes read it: the rule written once.

A change's value is null, Debezium's placeholder for an unchanged TOASTed value (no value in a
column listed under `toasted_columns`, an error in any other) or a value its column's converter
reads exactly (`values.converter`). A delete's values are kept where they convert, null
otherwise: a delete needs only its key. The key of a primary-key update's old row comes in a
Kafka Connect header, read by `header_value`.
"""

from __future__ import annotations

import base64
import binascii
from decimal import Decimal
from typing import Any

from cdc_assets.decoding import values as enc
from cdc_assets.decoding.envelope import BadRecord
from cdc_assets.decoding.types import decimal_shape

# Debezium's stand-in for a TOASTed value the change doesn't carry (it did not change).
UNAVAILABLE = "__debezium_unavailable_value"
_UNAVAILABLE_BASE64 = base64.b64encode(UNAVAILABLE.encode()).decode()
_UNAVAILABLE_HEX = binascii.hexlify(UNAVAILABLE.encode()).decode()


def is_unavailable(raw: Any, encoding: enc.Encoding) -> bool:
    """Whether `raw` is Debezium's placeholder, as the column's encoding renders it."""
    if encoding.type == "bytes" or encoding.name == enc.BASE64_TEXT:
        return raw == _UNAVAILABLE_BASE64 or raw == UNAVAILABLE
    if encoding.name == enc.HEX_TEXT:
        return raw == _UNAVAILABLE_HEX or raw == UNAVAILABLE
    if encoding.type == "array":
        return type(raw) is list and len(raw) == 1 and raw[0] == UNAVAILABLE
    return raw == UNAVAILABLE


def convert(converter: enc.Converter | enc.Mismatch, raw: Any) -> Any:
    if isinstance(converter, enc.Mismatch):
        raise BadRecord(converter.reason)
    try:
        return converter(raw)
    except enc.DecodeError as exc:
        raise BadRecord(str(exc)) from None


def change_value(
    name: str,
    raw: Any,
    converter: enc.Converter | enc.Mismatch,
    encoding: enc.Encoding,
    *,
    toasted: bool,
) -> tuple[Any, bool]:
    """A change's value of column `name` and whether the change carries one (a toasted
    column's placeholder carries none); raises `BadRecord` with the reason."""
    if raw is None:
        return None, True
    if is_unavailable(raw, encoding):
        if not toasted:
            raise BadRecord(
                f"column '{name}' holds Debezium's unavailable-value placeholder; "
                "list it under toasted_columns"
            )
        return None, False
    return convert(converter, raw), True


def delete_value(raw: Any, converter: enc.Converter | enc.Mismatch, encoding: enc.Encoding) -> Any:
    """A delete's `before` value: converted, or null where there is none or it doesn't convert."""
    if raw is None or is_unavailable(raw, encoding):
        return None
    try:
        return convert(converter, raw)
    except BadRecord:
        return None


def header_value(value: Any, declared: str) -> Any:
    """One key column as SimpleHeaderConverter wrote it, exactly, or None."""
    family = "decimal" if decimal_shape(declared) else declared
    if family in ("bigint", "int") and type(value) is int:
        return value
    if family == "string" and type(value) is str:
        return value
    if family == "decimal" and type(value) in (int, Decimal):
        precision, scale = decimal_shape(declared)
        exact = Decimal(value).quantize(Decimal(1).scaleb(-scale))
        return exact if exact == value and abs(exact) < Decimal(f"1e{precision - scale}") else None
    if family == "binary" and type(value) is str:
        try:
            return base64.b64decode(value, validate=True)
        except binascii.Error:
            return None
    return None
