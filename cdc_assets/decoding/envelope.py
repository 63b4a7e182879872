"""A Debezium record's envelope: the rules both decode passes read a record's frame by.

The Kafka Connect JSON wrapper (`{"schema": ..., "payload": ...}`) and its schema text (the key
by which a decoder caches a schema's row plan), the `op`, the sequence fields, `source.ts_ms`
and the `__debezium.oldkey` header. A record that breaks one of them raises `BadRecord`, whose
message is the error row's reason.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

OPS = ("c", "r", "u", "d", "t")
# The ops whose record carries the row in `after`.
APPLIED_OPS = ("c", "u", "r")
SCHEMA_PREFIX = b'{"schema":'
PAYLOAD_SEPARATOR = b',"payload":'
OLD_KEY_HEADER = "__debezium.oldkey"


class BadRecord(Exception):
    """The record can't be applied; the message is its reason (it never quotes a value)."""


def row_schema(schema: Any) -> Mapping[str, Any] | None:
    """The struct schema of the envelope's `after` (else `before`) row."""
    if not isinstance(schema, dict):
        return None
    rows = {
        f.get("field"): f
        for f in schema.get("fields") or ()
        if isinstance(f, dict) and f.get("field") in ("before", "after")
    }
    return rows.get("after") or rows.get("before")


def is_wrapped(document: Any) -> bool:
    """Whether a parsed record is Kafka Connect's JSON {"schema": ..., "payload": ...}."""
    return (
        isinstance(document, dict)
        and len(document) == 2
        and "schema" in document
        and "payload" in document
    )


def schema_prefix(value: bytes) -> bytes | None:
    """The bytes of a wrapped record up to its first ',"payload":' (unverified).

    Only looked up among exact schema texts (`schema_text`): a complete JSON object can't be
    a proper prefix of another one starting at the same brace, so a hit is the record's schema.
    """
    if not (value.startswith(SCHEMA_PREFIX) and value.endswith(b"}")):
        return None
    cut = value.find(PAYLOAD_SEPARATOR, len(SCHEMA_PREFIX))
    return value[len(SCHEMA_PREFIX) : cut] if cut > 0 else None


def schema_text(value: bytes) -> bytes | None:
    """The raw bytes of a wrapped record's schema, when they can be told exactly."""
    if not value.startswith(SCHEMA_PREFIX):
        return None
    try:
        text = value.decode("utf-8")
        _, end = json.JSONDecoder().raw_decode(text, len(SCHEMA_PREFIX))
    except (ValueError, UnicodeDecodeError):
        return None
    if not text.startswith(PAYLOAD_SEPARATOR.decode(), end):
        return None
    return text[len(SCHEMA_PREFIX) : end].encode("utf-8")


def payload_of(value: bytes, prefix: bytes) -> bytes:
    """The payload bytes of a wrapped record whose schema text is `prefix` (`schema_prefix`)."""
    return value[len(SCHEMA_PREFIX) + len(prefix) + len(PAYLOAD_SEPARATOR) : -1]


def sequence_part(envelope: dict, path: str, kind: str) -> int | str:
    node: Any = envelope
    for part in path.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    if kind == "bigint" and type(node) is int and -(2**63) <= node < 2**63:
        return node
    if kind == "string" and type(node) is str:
        return node
    if kind == "binlog" and type(node) is str:
        number = node.rpartition(".")[2]
        if number.isdigit() and number.isascii() and len(number) < 19:
            return int(number)
    expected = {"bigint": "a bigint", "string": "a string", "binlog": "a binlog file name"}[kind]
    raise BadRecord(f"sequence field '{path}' is missing or not {expected}")


def source_micros(source: Any) -> int | None:
    """An envelope's `source.ts_ms` in microseconds; None when absent or outside years 1–9999."""
    millis = source.get("ts_ms") if type(source) is dict else None
    if type(millis) is not int or not -62_135_596_800_000 <= millis <= 253_402_300_799_999:
        return None
    return millis * 1000


def old_key_value(headers: list | None) -> bytes | None:
    """The value of a record's first `__debezium.oldkey` header that has one: the one header
    the decoder reads. `decoder_input` picks the same one in Spark (tests/cdc_assets/
    test_decoder_input.py holds the two to the same rows)."""
    for header in headers or ():
        if header.get("key") == OLD_KEY_HEADER and header.get("value") is not None:
            return header["value"]
    return None
