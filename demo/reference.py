"""Reference replay: what a mirror table must contain, computed in plain Python from Kafka.

Deliberately independent of `demo.source` (it shares no code with the generator) and of the
Spark pipeline, so it can judge both. Given a table's records as read back from Kafka
(partition, offset, value bytes) in any order, it:

- skips tombstones (value None);
- parses the Debezium envelope, with or without the Kafka Connect ``schema``/``payload``
  wrapper, and rejects as malformed: bytes that are not a JSON object, a missing or unknown
  ``op`` (``c``/``r``/``u``/``d`` are known), a missing sequence field, a missing row image
  (``after`` for c/r/u, ``before`` for d), a missing or null primary-key column, a column
  missing from ``after`` although the record's schema names it (one it lacks without its
  schema naming it, or without a schema, did not exist yet: its declared default), and a column
  value of the wrong type for the spec (ints in range, decimals that fit ``decimal(p,s)``,
  timestamps as epoch micros unless the wrapper's schema names another unit, dates as epoch
  days, strict JSON types otherwise);
- orders the changes of one key by (the spec's sequence fields, partition, offset); c/r/u set
  the row to ``after``, d deletes it, and a change not newer than the last applied change of
  its key is ignored (a deleted key remembers its position, so an older change cannot revive
  it). The result does not depend on the order the records are given in.

Values come back as Python objects typed per the spec: int, float, str, bool, Decimal at the
declared scale, tz-aware UTC datetime, date.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterable
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Any

from cdc_assets.config import TableSpec

KNOWN_OPS = ("c", "r", "u", "d")
# Debezium's stand-in for an unchanged TOASTed value; only `toasted_columns` may carry it.
UNAVAILABLE_VALUE = "__debezium_unavailable_value"
_UNAVAILABLE = object()

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_EPOCH_DATE = date(1970, 1, 1)
_DECIMAL = re.compile(r"^decimal\((\d+),\s*(\d+)\)$")
_INT_RANGE = {"int": (-(2**31), 2**31 - 1), "bigint": (-(2**63), 2**63 - 1)}
# Microseconds per unit of each Debezium timestamp logical type.
_TIMESTAMP_UNITS = {
    "io.debezium.time.Timestamp": 1000,
    "io.debezium.time.MicroTimestamp": 1,
    "io.debezium.time.NanoTimestamp": None,  # nanoseconds: divided, not multiplied
}

Row = dict[str, Any]
# (Connect type, logical name, decimal scale) of a column's encoding.
Logical = tuple[str | None, str | None, int | None]
ReplayError = tuple[int, int, str]


class _Malformed(Exception):
    """A record that is not a valid change; the message is the reason."""


# (partition, offset, value[, key[, headers]])
Record = tuple


def replay(
    spec: TableSpec, records: Iterable[Record], added_columns: dict[str, str] | None = None
) -> dict[tuple, Row]:
    """The table's live rows after applying `records` (partition, offset, value[, key]).

    The Kafka key, when given, supplies a delete's primary key if its `before` lacks it.
    `added_columns` (name → type) are columns a change may lack (null) but, when it has one,
    its value must convert: the columns a mirror gains without a declaration.

    Returns:
        Rows by primary-key tuple (values in `spec.primary_key` order).
    """
    return replay_with_errors(spec, records, added_columns)[0]


def replay_with_errors(
    spec: TableSpec, records: Iterable[Record], added_columns: dict[str, str] | None = None
) -> tuple[dict[tuple, Row], list[ReplayError]]:
    """Like `replay`, also returning the rejected records as (partition, offset, reason).

    Reasons start with one of: "oversized", "invalid json", "missing op", "unknown op",
    "missing sequence", "missing row", "missing primary key", "key mismatch", "wrong type",
    "unavailable placeholder" (in a column not listed under ``toasted_columns``), "bad
    header". A toasted column holds the newest value that any change of its key carried since
    its row's life began; a row a primary-key update moved (a create naming the old key in its
    ``__debezium.oldkey`` header, given as the record's fifth element) takes the old key's value
    from just before the move.
    A truncate (op ``t``, known when the spec says ``on_truncate: apply``) deletes every row
    whose last change is older than it.
    """
    # key -> (position of the last applied change, row or None when deleted)
    latest: dict[tuple, tuple[tuple, Row | None]] = {}
    errors: list[ReplayError] = []
    truncated_before: tuple | None = None  # the newest truncate's position
    # key -> toasted column -> every (position, value) a change of the key carried
    toasted: dict[tuple, dict[str, list[tuple[tuple, Any]]]] = {}
    # key -> every (position, old key) of a primary-key update that moved a row to the key
    moves: dict[tuple, list[tuple[tuple, tuple]]] = {}
    for partition, offset, value, *rest in records:
        if value is None:
            continue  # tombstone: log compaction's marker, the delete event came before it
        kafka_key = rest[0] if rest else None
        headers = rest[1] if len(rest) > 1 else ()
        try:
            op, sequence, row = _parse(spec, value, kafka_key, added_columns or {})
            old_key = _old_key(spec, headers) if op == "c" and spec.toasted_columns else None
        except _Malformed as exc:
            errors.append((partition, offset, str(exc)))
            continue
        position = (sequence, partition, offset)
        if op == "t":
            truncated_before = max(truncated_before or position, position)
            continue
        key = tuple(row[col] for col in spec.primary_key)
        if old_key is not None:
            moves.setdefault(key, []).append((position, old_key))
        for col in spec.toasted_columns:
            if op != "d" and row[col] is not _UNAVAILABLE:
                toasted.setdefault(key, {}).setdefault(col, []).append((position, row[col]))
        current = latest.get(key)
        if current is not None and position <= current[0]:
            continue
        latest[key] = (position, None if op == "d" else row)
    # A truncate deletes every row whose last change is older than it.
    live = {
        key: row
        for key, (position, row) in latest.items()
        if row is not None and (truncated_before is None or position > truncated_before)
    }
    for key, row in live.items():
        live[key] = {
            **row,
            **{col: _toasted_value(key, col, None, toasted, moves) for col in spec.toasted_columns},
        }
    return live, errors


def history(spec: TableSpec, records: Iterable[Record]) -> dict[tuple, list[Row]]:
    """Every version of every key after `records` (as `replay` takes them), in any order: what
    a `history: true` table's `<table>__history` must hold, computed apart from the pipeline.

    A version per key and source sequence (the spec's sequence fields; a change delivered twice
    is one version), ordered by (sequence, partition, offset). Each is the change's row (a
    delete's before-image) with `_cdc_op`, `_cdc_deleted`, `_cdc_sequence` (the source
    sequence), `_cdc_end_sequence` (the next version's, None for the newest), `_cdc_valid_from`
    and `_cdc_valid_to` (source.ts_ms as UTC datetimes) and `_cdc_current`. A toasted column a
    change did not carry holds the newest value an earlier version of the same key carried
    since its last delete; in a life a primary-key move began (a create naming the old key in
    its ``__debezium.oldkey`` header), until then the old key's value from just before the
    move, as `replay` gives the mirror's row; None when nothing tells it (`_cdc_unknown__C`).
    Truncates are not replayed (a table with history refuses `on_truncate: apply`). Returns
    versions by primary-key tuple, oldest first.
    """
    found: dict[tuple, dict[tuple, tuple[tuple, str, Row, datetime | None, tuple | None]]] = {}
    toasted: dict[tuple, dict[str, list[tuple[tuple, Any]]]] = {}  # as in `replay_with_errors`
    moves: dict[tuple, list[tuple[tuple, tuple]]] = {}
    for partition, offset, value, *rest in records:
        if value is None:
            continue
        headers = rest[1] if len(rest) > 1 else ()
        try:
            op, sequence, row = _parse(spec, value, rest[0] if rest else None, {})
            old_key = _old_key(spec, headers) if op == "c" and spec.toasted_columns else None
        except _Malformed:
            continue
        if op == "t":
            continue
        key = tuple(row[col] for col in spec.primary_key)
        position = (sequence, partition, offset)
        if old_key is not None:
            moves.setdefault(key, []).append((position, old_key))
        for col in spec.toasted_columns:
            if op != "d" and row[col] is not _UNAVAILABLE:
                toasted.setdefault(key, {}).setdefault(col, []).append((position, row[col]))
        versions = found.setdefault(key, {})
        if sequence not in versions or position < versions[sequence][0]:
            versions[sequence] = (position, op, row, _source_time(value), old_key)
    out: dict[tuple, list[Row]] = {}
    for key, versions in found.items():
        ordered = sorted(versions.values(), key=lambda v: v[0])
        carried: dict[str, Any] = {}
        moved: tuple[tuple, tuple] | None = None  # (position, old key) of the life's move
        rows = []
        for i, (position, op, row, at, old_key) in enumerate(ordered):
            following = ordered[i + 1] if i + 1 < len(ordered) else None
            version = dict(row)
            if old_key is not None:
                moved = (position, old_key)
            for col in spec.toasted_columns:
                if op != "d" and row[col] is not _UNAVAILABLE:
                    carried[col] = row[col]
                    version[f"_cdc_unknown__{col}"] = False
                elif col in carried:
                    version[col] = carried[col]
                    version[f"_cdc_unknown__{col}"] = False
                else:
                    known, given = (False, None)
                    if moved is not None:
                        known, given = _toasted(moved[1], col, moved[0], toasted, moves)
                    version[col] = given
                    version[f"_cdc_unknown__{col}"] = not known
            version.update(
                _cdc_op=op,
                _cdc_deleted=op == "d",
                _cdc_sequence=position[0],
                _cdc_end_sequence=None if following is None else following[0][0],
                _cdc_valid_from=at,
                _cdc_valid_to=None if following is None else following[3],
                _cdc_current=following is None,
            )
            rows.append(version)
            if op == "d":
                carried, moved = {}, None  # the key's next life starts without values
        out[key] = rows
    return out


def tracked_history(spec: TableSpec, records: Iterable[Record]) -> dict[tuple, list[Row]]:
    """`history` folded by the table's tracked columns (`history_columns`, or every non-key
    column but `history_except_columns`): what `<table>__history` holds when some are set.

    A key's first change, a delete, the change after a delete, and a change whose tracked
    values differ from the change before it open a version; any other change updates the
    version in force in place. A version keeps its first change's `_cdc_op`, `_cdc_deleted`,
    `_cdc_sequence` and `_cdc_valid_from`, takes its last change's values (and TOASTed
    columns' unknown flags), and ends where the key's next version starts.
    """
    out: dict[tuple, list[Row]] = {}
    for key, changes in history(spec, records).items():
        data = [c for c in changes[0] if not c.startswith("_cdc_")]
        if spec.history_columns is not None:
            tracked = [c for c in data if c in spec.history_columns]
        else:
            keys = set(spec.primary_key)
            tracked = [c for c in data if c not in keys and c not in spec.history_except_columns]
        versions: list[Row] = []
        for n, change in enumerate(changes):
            before = changes[n - 1] if n else None
            if (
                before is None
                or change["_cdc_deleted"]
                or before["_cdc_deleted"]
                or any(change[c] != before[c] for c in tracked)
            ):
                versions.append(dict(change))
                continue
            versions[-1].update(
                {c: v for c, v in change.items() if c in data or c.startswith("_cdc_unknown__")}
            )
        for n, version in enumerate(versions):
            following = versions[n + 1] if n + 1 < len(versions) else None
            version.update(
                _cdc_end_sequence=None if following is None else following["_cdc_sequence"],
                _cdc_valid_to=None if following is None else following["_cdc_valid_from"],
                _cdc_current=following is None,
            )
        out[key] = versions
    return out


def _source_time(value: bytes) -> datetime | None:
    """A record's `source.ts_ms` as a UTC datetime (None when absent)."""
    document, _ = _document(value)
    millis = (document.get("source") or {}).get("ts_ms")
    return None if millis is None else _EPOCH + timedelta(milliseconds=millis)


def _toasted_value(
    key: tuple, col: str, before: tuple | None, toasted: dict, moves: dict, depth: int = 0
) -> Any:
    """A toasted column's value of `key` just before position `before` (None: at the end).

    The newest value a change of the key carried since its row's life began; a life that began
    with a primary-key update (a move) takes, until then, the old key's value just before the
    move. None where nothing tells it (the pipeline flags such rows).
    """
    return _toasted(key, col, before, toasted, moves, depth)[1]


def _toasted(
    key: tuple, col: str, before: tuple | None, toasted: dict, moves: dict, depth: int = 0
) -> tuple[bool, Any]:
    """`_toasted_value` and whether anything tells it (a carried null is known)."""
    earlier = [m for m in moves.get(key, ()) if before is None or m[0] < before]
    move = max(earlier, default=None)
    own = [
        (position, value)
        for position, value in toasted.get(key, {}).get(col, ())
        if (before is None or position < before) and (move is None or position >= move[0])
    ]
    if own:
        return True, max(own, key=lambda carried: carried[0])[1]
    if move is not None and depth < 32:
        return _toasted(move[1], col, move[0], toasted, moves, depth + 1)
    return False, None


def _old_key(spec: TableSpec, headers: Iterable) -> tuple | None:
    """The old primary key a create names in Debezium's `__debezium.oldkey` header."""
    for name, raw in headers or ():
        if name == "__debezium.oldkey" and raw is not None:
            try:
                document = json.loads(raw.decode("utf-8"))
                return tuple(document[col] for col in spec.primary_key)
            except (ValueError, KeyError, TypeError, UnicodeDecodeError):
                raise _Malformed("bad header: __debezium.oldkey does not name the key") from None
    return None


def _parse(
    spec: TableSpec, value: bytes, kafka_key: bytes | None, added: dict[str, str]
) -> tuple[str, tuple, Row]:
    if len(value) > spec.max_record_bytes:
        raise _Malformed(f"oversized: {len(value)} bytes")
    document, logical_types = _document(value)
    op = document.get("op")
    if op is None:
        raise _Malformed("missing op")
    known = KNOWN_OPS + (("t",) if spec.on_truncate == "apply" else ())
    if op not in known:
        raise _Malformed(f"unknown op {_short(op)}")
    sequence = tuple(_sequence_value(document, field.field, field.type) for field in spec.sequence)
    if op == "t":
        return op, sequence, {}
    if op == "d":
        row = _delete_row(spec, document.get("before"), kafka_key, logical_types)
        _check_key(spec, row, kafka_key)
        return op, sequence, row
    raw = document.get("after")
    if not isinstance(raw, dict):
        raise _Malformed(f"missing row: op '{op}' needs an object in 'after'")
    missing = [col for col in spec.primary_key if raw.get(col) is None]
    if missing:
        raise _Malformed(f"missing primary key: {missing} absent or null in 'after'")
    # A column the row lacks did not exist at the source yet: the record's schema (when it has
    # one) does not name it; without a schema every column the row had is written.
    named = [col for col in spec.columns if col not in raw and col in logical_types]
    if named:
        raise _Malformed(f"missing column: {named} absent from 'after' but in its schema")
    row = {}
    for col, spark_type in [*spec.columns.items(), *added.items()]:
        if col not in raw:
            row[col] = _default(spec, col, spark_type)
        elif raw.get(col) == UNAVAILABLE_VALUE and col in spec.columns:
            if col not in spec.toasted_columns:
                raise _Malformed(f"unavailable placeholder in column {col}")
            row[col] = _UNAVAILABLE  # unchanged: the value comes from an earlier change
        else:
            row[col] = _convert(col, spark_type, raw.get(col), logical_types.get(col), spec)
    _check_key(spec, row, kafka_key)
    return op, sequence, row


def _default(spec: TableSpec, col: str, spark_type: str) -> Any:
    """The column's declared default as the replay's rows hold values (None when none)."""
    raw = spec.defaults.get(col)  # the connector's schema defaults are not replayed here
    if raw is None:
        return None
    match = _DECIMAL.match(spark_type)
    if match:
        return Decimal(str(raw)).quantize(Decimal(1).scaleb(-int(match.group(2))))
    if spark_type == "date" and isinstance(raw, str):
        return date.fromisoformat(raw)
    if spark_type == "timestamp":
        moment = datetime.fromisoformat(raw) if isinstance(raw, str) else raw
        return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)
    if spark_type in ("double", "float"):
        return float(raw)
    if spark_type == "string":
        return str(raw)
    return raw


def _check_key(spec: TableSpec, row: Row, kafka_key: bytes | None) -> None:
    """A JSON Kafka key that names a primary-key value must name the row's."""
    if kafka_key is None:
        return
    try:
        key_doc, _ = _document(kafka_key)
    except _Malformed:
        return  # not a JSON key: nothing to compare
    for col in spec.primary_key:
        try:
            in_key = _convert(col, spec.columns[col], key_doc.get(col), None, spec)
        except _Malformed:
            continue
        if in_key is not None and in_key != row[col]:
            raise _Malformed(f"key mismatch: the Kafka key's {col} is not the row's")


def _document(value: bytes) -> tuple[dict[str, Any], dict[str, Logical]]:
    """The envelope (unwrapped from schema/payload) and the columns' logical type names."""
    try:
        document = json.loads(value.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError) as exc:
        raise _Malformed(f"invalid json: {exc}") from None
    if not isinstance(document, dict):
        raise _Malformed(f"invalid json: expected an object, got {type(document).__name__}")
    logical_types: dict[str, Logical] = {}
    if "schema" in document and "payload" in document:
        logical_types = _logical_types(document["schema"])
        document = document["payload"]
        if not isinstance(document, dict):
            raise _Malformed("invalid json: the payload is not an object")
    return document, logical_types


def _delete_row(
    spec: TableSpec, before: Any, kafka_key: bytes | None, logical_types: dict[str, Logical]
) -> Row:
    """A delete needs only its key: from `before`, else from the Kafka key."""
    before = before if isinstance(before, dict) else {}
    key_doc: dict[str, Any] = {}
    if kafka_key is not None:
        try:
            key_doc, _ = _document(kafka_key)
        except _Malformed:
            key_doc = {}
    row = {}
    for col, spark_type in spec.columns.items():
        try:
            row[col] = _convert(col, spark_type, before.get(col), logical_types.get(col), spec)
        except _Malformed:
            row[col] = None
        if col in spec.primary_key and row[col] is None:
            try:
                row[col] = _convert(col, spark_type, key_doc.get(col), None, spec)
            except _Malformed:
                row[col] = None
    missing = [col for col in spec.primary_key if row[col] is None]
    if missing:
        raise _Malformed(f"missing primary key: {missing} absent from 'before' and the key")
    return row


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _logical_types(schema: Any) -> dict[str, Logical]:
    """Column -> (Connect type, logical name, decimal scale), from the row structs of an
    envelope schema."""
    found: dict[str, Logical] = {}
    if not isinstance(schema, dict):
        return found
    for field in schema.get("fields") or ():
        if isinstance(field, dict) and field.get("field") in ("before", "after"):
            for column in field.get("fields") or ():
                if isinstance(column, dict) and column.get("field"):
                    scale = (column.get("parameters") or {}).get("scale")
                    found[column["field"]] = (
                        column.get("type"),
                        column.get("name"),
                        int(scale) if scale is not None else None,
                    )
    return found


def _sequence_value(document: dict[str, Any], path: str, kind: str) -> int | str:
    node: Any = document
    for part in path.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    if kind == "bigint" and isinstance(node, int) and not isinstance(node, bool):
        return node
    if kind == "string" and isinstance(node, str):
        return node
    if kind == "binlog" and isinstance(node, str) and re.fullmatch(r".*\.\d{1,18}", node):
        return int(node.rsplit(".", 1)[1])
    raise _Malformed(f"missing sequence: '{path}' is {_short(node)}, expected a {kind}")


def _configured(spec: TableSpec, column: str, declared: str) -> Logical:
    """How a column is encoded without a schema: its setting, the table's, the default."""
    setting = spec.encodings.get(column)
    match = _DECIMAL.match(declared)
    if match:
        mode = setting or spec.decimal_handling
        return {
            "precise": ("bytes", "org.apache.kafka.connect.data.Decimal", int(match[2])),
            "string": ("string", None, None),
            "double": ("float64", None, None),
        }[mode]
    if declared == "timestamp":
        unit = setting or "MicroTimestamp"
        return ("string" if unit == "ZonedTimestamp" else "int64", f"io.debezium.time.{unit}", None)
    if declared == "date":
        return ("int32", "io.debezium.time.Date", None)
    return (None, None, None)


def _convert(
    column: str, spark_type: str, value: Any, logical: Logical | None, spec: TableSpec
) -> Any:
    """The Python value of a JSON column value, or `_Malformed` if it is not in its encoding
    or does not fit the type exactly."""
    if value is None:
        return None
    encoding = logical if logical is not None else _configured(spec, column, spark_type)
    try:
        converted = _CONVERTERS.get(spark_type, _to_decimal)(
            value, spark_type, (*encoding, logical is not None)
        )
    except (ValueError, TypeError, ArithmeticError, OverflowError):
        converted = None
    if converted is None:
        raise _Malformed(f"wrong type: column '{column}' ({spark_type}) got {_short(value)}")
    return converted


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _to_int(value: Any, spark_type: str, _encoding: tuple) -> int | None:
    low, high = _INT_RANGE[spark_type]
    return value if _is_int(value) and low <= value <= high else None


def _to_float(value: Any, _type: str, _encoding: tuple) -> float | None:
    return float(value) if _is_int(value) or isinstance(value, float) else None


def _to_str(value: Any, _type: str, _encoding: tuple) -> str | None:
    return value if isinstance(value, str) else None


def _to_bool(value: Any, _type: str, _encoding: tuple) -> bool | None:
    return value if isinstance(value, bool) else None


_ISO = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d{1,6})?(Z|[+-]\d{2}:\d{2})")


def _to_timestamp(value: Any, _declared: str, encoding: tuple) -> datetime | None:
    _type, name, _scale, _from_schema = encoding
    if name == "io.debezium.time.ZonedTimestamp":
        if not isinstance(value, str) or not _ISO.fullmatch(value):
            return None
        return datetime.fromisoformat(value.replace("Z", "+00:00")).astimezone(UTC)
    if not _is_int(value) or name not in _TIMESTAMP_UNITS:
        return None
    unit = _TIMESTAMP_UNITS[name]
    if unit is None and value % 1000:
        return None  # nanoseconds a microsecond timestamp can't hold
    micros = value // 1000 if unit is None else value * unit
    return _EPOCH + timedelta(microseconds=micros)


def _to_date(value: Any, _type: str, encoding: tuple) -> date | None:
    return _EPOCH_DATE + timedelta(days=value) if _is_int(value) else None


def _to_decimal(value: Any, spark_type: str, encoding: tuple) -> Decimal | None:
    match = _DECIMAL.match(spark_type)
    if match is None:
        raise ValueError(f"unsupported column type '{spark_type}'")
    precision, scale = int(match[1]), int(match[2])
    kind, name, source_scale, from_schema = encoding
    if name == "org.apache.kafka.connect.data.Decimal":
        # Precise: base64 of the unscaled two's-complement integer. Without a schema, digits
        # alone read both as that and as decimal text: refused, never guessed.
        if not isinstance(value, str) or (not from_schema and value.isdigit()):
            return None
        unscaled = int.from_bytes(base64.b64decode(value, validate=True), "big", signed=True)
        number = Decimal(unscaled).scaleb(-source_scale)
    elif kind == "string" and isinstance(value, str) and re.fullmatch(r"-?\d+(\.\d+)?", value):
        number = Decimal(value)
    elif kind in ("float64", "int8", "int16", "int32", "int64") and _is_int(value):
        number = Decimal(value)
    elif kind == "float64" and isinstance(value, float):
        number = Decimal(repr(value))
    else:
        return None
    if not number.is_finite():
        return None
    quantized = number.quantize(Decimal(1).scaleb(-scale))
    if quantized != number:
        return None  # more places than the column holds: never rounded
    return quantized if abs(quantized) < Decimal(10) ** (precision - scale) else None


_CONVERTERS = {
    "bigint": _to_int,
    "int": _to_int,
    "double": _to_float,
    "float": _to_float,
    "string": _to_str,
    "boolean": _to_bool,
    "timestamp": _to_timestamp,
    "date": _to_date,
}
