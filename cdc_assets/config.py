"""The table registry: one validated `TableSpec` per mirrored source table, loaded from YAML.

Adding a table is one entry in `tables.yaml` (or the file named by `CDC_TABLES_FILE` when the
Definitions are built); no code changes. Every entry is validated when the file is loaded and
each problem is reported with the table's name, the setting and how to fix it. The file's one
other setting, `shop_analytics`, switches the demo shop's analytics on (`TablesFile`).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, date, datetime
from decimal import Decimal, localcontext
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from cdc_assets.decoding import types
from cdc_assets.decoding.values import configurable_encodings
from cdc_assets.hours import HOUR_KEY_FORMAT, hour_start
from cdc_assets.java_regex import INVALID_JAVA, UntranslatableRegex, python_regex

DEFAULT_TABLES_FILE = Path(__file__).with_name("tables.yaml")
# The environment variable naming the tables file a deployment loads instead.
TABLES_FILE_ENV = "CDC_TABLES_FILE"
# The tables file's switch for the demo shop's analytics (`TablesFile`), and its settings.
SHOP_ANALYTICS = "shop_analytics"
TABLES_FILE_SETTINGS = ("tables", SHOP_ANALYTICS)

# Shorthands of earlier configs: a timestamp naming the unit of its epoch values, which is the
# column's encoding (cdc_assets/decoding/values.py).
_TIMESTAMP_UNITS = {
    "timestamp(us)": "MicroTimestamp",
    "timestamp(ms)": "Timestamp",
    "timestamp(ns)": "NanoTimestamp",
}
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


# Names of the checks every table has; expectations are named '<column>_<expect>'.
RESERVED_CHECK_NAMES = (
    "complete_hour",
    "accounting",
    "continuity",
    "changes_readable",
    "toasted_values",
    "history",
    "error_rate",
    "freshness",
    "schema_drift",
    "retention_risk",
    "primary_key_not_null",
    "primary_key_unique",
)


def spark_type(declared: str) -> str:
    """The Spark SQL type of a declared column type."""
    return types.spark_type(declared)


_INTEGERS = {"tinyint": 8, "smallint": 16, "int": 32, "bigint": 64}


def typed_default(declared: str, raw: Any) -> Any:
    """A column's configured `default` as the Python value of its declared type (what the
    decoder gives the column); ValueError naming what is wrong otherwise."""
    problem = f"default {raw!r} is not a {declared}"
    if declared == "string":
        if isinstance(raw, str | int | float | Decimal) and not isinstance(raw, bool):
            return str(raw)
        raise ValueError(f"{problem}; quote it")
    if declared == "boolean":
        if isinstance(raw, bool):
            return raw
        raise ValueError(f"{problem}; write true or false")
    if declared in _INTEGERS:
        bits = _INTEGERS[declared]
        if (
            isinstance(raw, int)
            and not isinstance(raw, bool)
            and -(2 ** (bits - 1)) <= raw < (2 ** (bits - 1))
        ):
            return raw
        raise ValueError(problem)
    if declared in ("float", "double"):
        if isinstance(raw, int | float) and not isinstance(raw, bool):
            return float(raw)
        raise ValueError(problem)
    shape = types.decimal_shape(declared)
    if shape is not None:
        return _decimal_default(problem, declared, shape, raw)
    if declared == "date":
        if isinstance(raw, date) and not isinstance(raw, datetime):
            return raw
        if isinstance(raw, str):
            try:
                return date.fromisoformat(raw)
            except ValueError:
                pass
        raise ValueError(f"{problem}; write it as YYYY-MM-DD")
    if declared == "timestamp":
        value = raw
        if isinstance(raw, str):
            try:
                value = datetime.fromisoformat(raw)
            except ValueError:
                value = None
        if isinstance(value, datetime):
            try:
                return value.replace(tzinfo=UTC) if not value.tzinfo else value.astimezone(UTC)
            except OverflowError:
                raise ValueError(f"{problem}: it is outside years 1 to 9999 in UTC") from None
        raise ValueError(f"{problem}; write it as YYYY-MM-DD HH:MM:SS[.ffffff][+HH:MM] (UTC)")
    raise ValueError(
        f"a default for a {declared} column is not supported; defaults are for string, boolean, "
        "integer, float, double, decimal, date and timestamp columns"
    )


def default_json(value: Any) -> str:
    """A typed default (`typed_default`) as JSON that `typed_default` reads back the same."""
    if isinstance(value, Decimal):
        return json.dumps(str(value))
    if isinstance(value, date | datetime):
        return json.dumps(value.isoformat())
    return json.dumps(value)


def _decimal_default(problem: str, declared: str, shape: tuple[int, int], raw: Any) -> Decimal:
    precision, scale = shape
    with localcontext() as context:
        context.prec = 2 * precision + 2  # room for any value that fits, and then some
        try:
            number = Decimal(str(raw)) if not isinstance(raw, bool) else None
        except (ArithmeticError, ValueError):
            number = None
        if number is None or not number.is_finite():
            raise ValueError(f"{problem}; write a number, quoted to keep its digits")
        try:
            exact = number.quantize(Decimal(1).scaleb(-scale))
        except ArithmeticError:
            exact = None  # more digits than the context holds: far too many
    if exact is None or number != exact or len(exact.as_tuple().digits) > precision:
        raise ValueError(f"{problem}: it does not fit {declared} exactly")
    return exact


class TableConfigError(ValueError):
    """The tables file is invalid; the message lists every problem, one per line."""


class SequenceField(BaseModel):
    """One component of a table's ordering key, read from the Debezium envelope."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    field: str = Field(description="Dotted path inside the envelope, e.g. 'source.lsn'.")
    type: Literal["bigint", "string", "binlog"] = Field(
        default="bigint",
        description=(
            "binlog: a MySQL binlog file name ('mysql-bin.000012'), ordered by its number, "
            "not as a string."
        ),
    )

    @field_validator("field")
    @classmethod
    def _path(cls, value: str) -> str:
        if not all(_IDENT.match(part) for part in value.split(".")):
            raise ValueError(f"'{value}' is not a dotted path of identifiers (e.g. 'source.lsn')")
        return value


Severity = Literal["WARN", "ERROR"]
_EXPECTATION_KINDS = ("not_null", "unique", "in_set", "between", "regex", "type")
# Row-level kinds: a failing change can be held back from the mirror (`hard: true`). Uniqueness
# is a property of the live table and a column's type is enforced by decoding, so neither is.
_HARD_KINDS = ("not_null", "in_set", "between", "regex")
# Kinds that keep their meaning on a keyed hash: HMAC maps null to null and equal values to
# equal hashes. The others judge the raw value, which a hashed column no longer holds.
_HASH_SAFE_KINDS = ("not_null", "unique")


# What each kind judges alike on Spark's and great-expectations' pandas engine, by column type
# (checks/expectations.py): a regex judges text, between numbers, in_set values of the column's
# own type, which the tables file can spell (no dates, timestamps, binaries or arrays).
_TEXT_TYPES = ("string", "time")
_NUMBER_TYPES = ("int", "bigint", "double", "float")
_INTEGER_RANGES = {"int": 2**31, "bigint": 2**63}
# A between bound's magnitude stays below it: every integer up to it is its own double.
_EXACT_BOUND = 2**53


def _misfit(expectation: ExpectationSpec, declared: str) -> str | None:
    """Why `expectation` can't judge a column declared `declared`, or None if it can."""
    named = (
        f"expectation '{expectation.check_name}' on the {declared} column '{expectation.column}'"
    )
    number = declared in _NUMBER_TYPES or types.decimal_shape(declared) is not None
    if expectation.expect == "regex" and declared not in _TEXT_TYPES:
        return (
            f"{named} matches a regex, which judges text, and Java and Python write a "
            f"{declared} as different text; use between or in_set, or a string column"
        )
    if expectation.expect == "between" and not number:
        return f"{named} compares it with numbers; between takes number and decimal columns"
    if expectation.expect != "in_set":
        return None
    if not (number or declared in _TEXT_TYPES or declared == "boolean"):
        return (
            f"{named} lists values, which the tables file can only give as text, numbers and "
            "booleans; in_set takes string, boolean, number and decimal columns"
        )
    for value in expectation.values or ():
        if declared in _TEXT_TYPES:
            fits = isinstance(value, str)
        elif declared == "boolean":
            fits = isinstance(value, bool)
        elif declared in _INTEGER_RANGES:
            limit = _INTEGER_RANGES[declared]
            fits = (
                isinstance(value, int) and not isinstance(value, bool) and -limit <= value < limit
            )
        else:
            fits = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not fits:
            return f"{named} lists {value!r}, which a {declared} column can't hold" + (
                " (quote it to make it text)" if declared in _TEXT_TYPES else ""
            )
    return None


class ExpectationSpec(BaseModel):
    """One great-expectations expectation on a source column, declared in the tables file.

    Hard expectations are evaluated on the hour's decoded changes before the MERGE: a change
    that fails goes to the error table, named by the expectation, and never reaches the mirror.
    The others run after the MERGE on the rows the hour wrote (`unique`: among the live rows)
    and report. A delete is never held back: removing a row that breaks a rule is fine.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    column: str
    expect: Literal["not_null", "unique", "in_set", "between", "regex", "type"]
    values: tuple[str | int | float | bool, ...] | None = Field(
        default=None, description="in_set: the allowed values."
    )
    min: float | int | None = Field(default=None, description="between: inclusive lower bound.")
    max: float | int | None = Field(default=None, description="between: inclusive upper bound.")
    regex: str | None = Field(
        default=None,
        description="regex: Java regex found in the value (on a string column); one with no "
        "Python equivalent (\\b, \\p{L}, ...) is refused, naming what to write instead.",
    )
    type: str | None = Field(default=None, description="type: the column's declared type.")
    hard: bool = False
    severity: Severity = "ERROR"
    blocking: bool = False

    @model_validator(mode="after")
    def _parameters(self) -> ExpectationSpec:
        needs = {"in_set": ("values",), "regex": ("regex",), "type": ("type",)}
        given = {
            name
            for name in ("values", "min", "max", "regex", "type")
            if getattr(self, name) is not None
        }
        wanted = set(needs.get(self.expect, ()))
        if self.expect == "between":
            if self.min is None and self.max is None:
                raise ValueError("'between' needs min, max or both")
            wanted = {"min", "max"} & given
            if self.min is not None and self.max is not None and self.min > self.max:
                raise ValueError(f"'between' has min {self.min} above max {self.max}")
        if wanted - given:
            raise ValueError(f"'{self.expect}' needs {', '.join(sorted(wanted - given))}")
        if given - wanted:
            raise ValueError(f"'{self.expect}' takes no {', '.join(sorted(given - wanted))}")
        if self.expect == "in_set" and not self.values:
            raise ValueError("'in_set' needs at least one value")
        for bound in (self.min, self.max):
            if isinstance(bound, float) and not math.isfinite(bound):
                raise ValueError(f"'between' takes finite bounds, not {bound}; leave it out")
            if bound is not None and abs(bound) >= _EXACT_BOUND:
                raise ValueError(
                    f"'between' bound {bound} is not within ±(2**53 - 1): great-expectations "
                    "takes bounds as doubles, and Spark compares a bigint with one as a double, "
                    "so values around it could be judged wrongly"
                )
        if any(isinstance(v, float) and math.isnan(v) for v in self.values or ()):
            # Spark finds NaN equal to NaN, so it would be in the set on one engine only.
            raise ValueError("'in_set' takes no NaN: it is no value a set can hold")
        if self.regex is not None:
            try:
                python_regex(self.regex)
            except UntranslatableRegex as exc:
                # Rows read in the driver are judged by Python's re, Spark's by Java's regex.
                judged = (
                    "does not compile"
                    if exc.why == INVALID_JAVA
                    else "can't be judged alike by Java (Spark) and Python (rows in memory)"
                )
                raise ValueError(
                    f"expectation '{self.check_name}': regex '{self.regex}' {judged}: {exc}"
                ) from None
        if self.type is not None and not types.is_valid_type(self.type):
            raise ValueError(f"type '{self.type}' is not a column type")
        if self.hard and self.expect not in _HARD_KINDS:
            raise ValueError(
                f"'{self.expect}' can't be hard: only {', '.join(_HARD_KINDS)} judge one change"
            )
        if self.blocking and self.severity == "WARN":
            raise ValueError("a blocking check needs severity ERROR (a WARN failure never blocks)")
        return self

    @property
    def check_name(self) -> str:
        return f"{self.column}_{self.expect}"


class CheckPolicy(BaseModel):
    """How a failure of one of the pipeline's own checks is reported."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    severity: Severity = "WARN"
    blocking: bool = False

    @model_validator(mode="before")
    @classmethod
    def _warn_alone_does_not_block(cls, data: Any) -> Any:
        # A WARN failure never blocks: `severity: WARN` alone means not blocking, whatever the
        # check's default (error_rate blocks by default).
        if isinstance(data, dict) and data.get("severity") == "WARN" and "blocking" not in data:
            return {**data, "blocking": False}
        return data

    @model_validator(mode="after")
    def _blocking_needs_error(self) -> CheckPolicy:
        if self.blocking and self.severity == "WARN":
            raise ValueError("a blocking check needs severity ERROR (a WARN failure never blocks)")
        return self


class ErrorRatePolicy(CheckPolicy):
    """The error_rate check: ERROR and blocking by default, so an hour that sends more than
    `max_share` of its changes to the error table fails its run. A table that accepts more
    says `severity: WARN` (the check stays red, the run green)."""

    severity: Severity = "ERROR"
    blocking: bool = True
    max_share: float = Field(
        default=0.01,
        ge=0.0,
        le=1.0,
        description="Largest share of an hour's changes (tombstones aside) in the error table.",
    )


class FreshnessPolicy(CheckPolicy):
    max_lag_minutes: int = Field(
        default=120,
        ge=0,
        description="How far the newest source change in the mirror may trail the hour's end.",
    )


class RetentionPolicy(CheckPolicy):
    min_hours_left: float = Field(
        default=24.0, ge=0, description="Warn when Kafka will delete the hour's offsets sooner."
    )


class ChecksConfig(BaseModel):
    """Severity, blocking and thresholds of the pipeline's own checks, per table."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    complete_hour: CheckPolicy = CheckPolicy(severity="ERROR", blocking=True)
    accounting: CheckPolicy = CheckPolicy(severity="ERROR", blocking=True)
    continuity: CheckPolicy = CheckPolicy(severity="ERROR", blocking=True)
    # An hour whose every change went to the error table applied nothing: fail the run.
    changes_readable: CheckPolicy = CheckPolicy(severity="ERROR", blocking=True)
    toasted_values: CheckPolicy = CheckPolicy(severity="ERROR")
    history: CheckPolicy = CheckPolicy(severity="ERROR")
    error_rate: ErrorRatePolicy = ErrorRatePolicy()
    freshness: FreshnessPolicy = FreshnessPolicy()
    schema_drift: CheckPolicy = CheckPolicy()
    retention_risk: RetentionPolicy = RetentionPolicy()
    # The implicit expectations on the primary key: not null and unique among live rows.
    primary_key: CheckPolicy = CheckPolicy(severity="ERROR", blocking=True)


class TableSpec(BaseModel):
    """How one Kafka topic of Debezium change events becomes one Delta mirror table."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="Asset and Delta table name.")
    topic: str
    primary_key: tuple[str, ...]
    columns: dict[str, str] = Field(
        description="Source columns and their Spark SQL types, in table order."
    )
    encodings: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "Column → how the connector encodes it when its records carry no schema "
            "(value.converter.schemas.enable=false); set per column as "
            "{type: ..., encoding: ...} under columns. See docs/debezium.md."
        ),
    )
    defaults: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            "Column → the value a change written before the column existed gives it, and the "
            "value rows the mirror held before it gained the column show (the source's "
            "ADD COLUMN ... DEFAULT); set per column as {type: ..., default: ...} under "
            "columns. Without one such rows hold null, as the source's do."
        ),
    )
    decimal_handling: Literal["precise", "string", "double"] = Field(
        default="precise",
        description=(
            "The connector's decimal.handling.mode, for decimal columns of records without a "
            "schema (the connector's default, precise: base64 of the unscaled integer)."
        ),
    )
    binary_handling: Literal["bytes", "base64", "hex"] = Field(
        default="bytes",
        description="The connector's binary.handling.mode, for binary columns (no schema).",
    )
    sequence: tuple[SequenceField, ...] = (SequenceField(field="source.lsn"),)
    delete_mode: Literal["soft", "hard"] = Field(
        default="soft",
        description=(
            "soft (default): a delete keeps the row, _cdc_deleted = true; hard: it removes the "
            "row. What each means for hours run out of order: the CDC rule, cdc_assets/rule.py."
        ),
    )
    on_truncate: Literal["fail", "apply"] = Field(
        default="fail",
        description=(
            "What a truncate event (op 't') does. fail: the run stops before writing anything "
            "and names the record; apply: every row whose change is older than the truncate is "
            "deleted (as delete_mode says), and older changes that arrive later stay out."
        ),
    )
    toasted_columns: tuple[str, ...] = Field(
        default=(),
        description=(
            "Columns Debezium may send as its unavailable-value placeholder "
            "(__debezium_unavailable_value: an unchanged TOASTed value in Postgres). Such a "
            "change keeps the column's newest known value, whichever order hours run in; the "
            "placeholder in any other column is an error."
        ),
    )
    new_columns: Literal["add", "ignore"] = Field(
        default="add",
        description=(
            "What a source column that is not declared under columns does. add: the mirror "
            "gains it (typed from its first values; later values that don't convert are "
            "errors); ignore: it is left out. Either way the schema_drift check names it. "
            "A table with sensitive columns adds none: a column waits until it is declared "
            "(marked sensitive or not), named in schema_drift's withheld_columns."
        ),
    )
    change_data_feed: bool | None = Field(
        default=None,
        description=(
            "Delta's change data feed on the mirror (delta.enableChangeDataFeed), for readers "
            "of each commit's changes with their before-images. It costs every MERGE a read "
            "and a shuffle of every column of every row in the files its changes touch (without "
            "it, of the key and sequence only), so turn it on for the tables whose feed is "
            "read (the demo's order_facts reads its three mirrors'). Unset: off on a new mirror, "
            "and an existing mirror keeps its setting; true or false: the next run sets it."
        ),
    )
    max_record_bytes: int = Field(
        default=8 * 1024 * 1024,
        ge=1,
        description="Records with a larger value go to the error table instead of the mirror.",
    )
    start_hour: str = Field(description="First hourly partition, 'YYYY-MM-DD-HH:00' in UTC.")
    allowed_lateness_minutes: int = Field(default=15, ge=0)
    hours_per_run: int = Field(
        default=24,
        ge=1,
        le=24 * 31,
        description=(
            "Most hours one run materializes: a backfill or a sensor catching up splits its "
            "range into runs of at most this many hours, each in one Spark session."
        ),
    )
    refresh_minutes: int | None = Field(
        default=None,
        ge=1,
        le=60,
        description=(
            "Tier-0 freshness: while an hour is open, the offset sensor refreshes it every this "
            "many minutes, each refresh reading only what arrived since the last one; the run "
            "after the hour closes completes it with every check. Unset: hourly only."
        ),
    )
    history: bool = Field(
        default=False,
        description=(
            "Keep every version of every row in '<name>__history' beside the mirror (type 2: "
            "each version's start and end in source time and sequence, deletes as versions of "
            "their own), right in any hour order; written by the same run. How to read it: "
            "docs/reading.md, 'History'."
        ),
    )
    history_columns: tuple[str, ...] | None = Field(
        default=None,
        description=(
            "With history: true, the columns whose changes open a version (as Spark's AUTO "
            "CDC track_history_column_list): a change that alters none of them updates the "
            "version in force in place. Columns added later are not tracked. Unset: every "
            "column is. Fixed when the history is created (docs/reading.md, 'History')."
        ),
    )
    history_except_columns: tuple[str, ...] = Field(
        default=(),
        description=(
            "With history: true, the columns whose changes alone open no version (as AUTO "
            "CDC's track_history_except_column_list): a change that alters only these, say a "
            "last_seen time, updates the version in force in place. Fixed when the history is "
            "created (docs/reading.md, 'History')."
        ),
    )
    accept_data_loss: bool = Field(
        default=False,
        description="Run hours whose offsets retention already deleted, reporting the loss.",
    )
    deletion_vectors: bool = Field(
        default=True,
        description=(
            "Whether the mirror's MERGEs mark replaced rows in deletion vectors (true) or "
            "rewrite the files that held them (false). Readers that can't apply deletion "
            "vectors (deltalake's to_pyarrow_dataset, engines on Delta reader version 1) need "
            "false; it makes each MERGE rewrite every file it touches. Fixed when the mirror "
            "is created: a run refuses a mirror whose stored setting differs and says how to "
            "change it (docs/reading.md)."
        ),
    )
    deletion_vectors_from_bytes: int = Field(
        default=4 * 1024 * 1024,
        ge=0,
        description=(
            "With deletion_vectors: true, the mirror's size (its data files' bytes) from which "
            "MERGEs write deletion vectors; a smaller mirror's MERGE rewrites the files it "
            "touches, which costs a small table less. 0: always write them."
        ),
    )
    group: str = "cdc_mirrors"
    description: str | None = None
    expectations: tuple[ExpectationSpec, ...] = ()
    checks: ChecksConfig = ChecksConfig()
    sensitive: dict[str, Literal["hash", "drop"]] = Field(
        default_factory=dict,
        description=(
            "Columns masked right after decoding, so their raw values reach neither the mirror "
            "nor metadata nor logs. hash: stored as the hex HMAC-SHA256 of the value's canonical "
            "string form, keyed by the masking resource's key (env CDC_MASKING_KEY), so the "
            "column becomes a string that still joins, groups and counts; drop: not stored. A "
            "primary-key column can't be masked; a dropped column takes no expectations and a "
            "hashed one only not_null and unique. The error table's raw record bytes are "
            "sealed with a key derived from the same one (cdc_assets/sealing.py)."
        ),
    )

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _IDENT.match(value):
            raise ValueError(f"'{value}' must be an identifier (letters, digits, underscores)")
        suffixes = (
            ("__errors", "error tables"),
            ("__history", "history tables"),
            ("__history_changes", "tracked histories' changes"),
        )
        for suffix, names in suffixes:
            if value.endswith(suffix):
                raise ValueError(f"'{value}' ends in '{suffix}', which names {names}")
        return value

    @model_validator(mode="before")
    @classmethod
    def _column_entries(cls, data: Any) -> Any:
        """`columns` entries may be a type or {type, encoding, default}; encodings and defaults
        are kept apart."""
        if not isinstance(data, dict) or not isinstance(data.get("columns"), dict):
            return data
        columns, found = {}, dict(data.get("encodings") or {})
        defaults = dict(data.get("defaults") or {})
        for column, entry in data["columns"].items():
            if isinstance(entry, dict) and set(entry) <= {"type", "encoding", "default"}:
                if entry.get("encoding") is not None:
                    found[column] = entry["encoding"]
                if entry.get("default") is not None:
                    defaults[column] = entry["default"]
                entry = entry.get("type")
            if isinstance(entry, str) and entry in _TIMESTAMP_UNITS:
                found.setdefault(column, _TIMESTAMP_UNITS[entry])
                entry = "timestamp"
            columns[column] = entry
        return {
            **data,
            "columns": columns,
            **({"encodings": found} if found else {}),
            **({"defaults": defaults} if defaults else {}),
        }

    @field_validator("columns")
    @classmethod
    def _columns(cls, value: dict[str, str]) -> dict[str, str]:
        if not value:
            raise ValueError("at least one column is required")
        problems = []
        seen: dict[str, str] = {}
        for column, declared in value.items():
            if not _IDENT.match(column) or column.lower().startswith("_cdc_"):
                problems.append(f"column '{column}' must be an identifier not starting with _cdc_")
            if column.lower() in seen:  # Spark resolves column names case-insensitively
                problems.append(f"columns '{seen[column.lower()]}' and '{column}' collide")
            seen[column.lower()] = column
            if not isinstance(declared, str) or not types.is_valid_type(declared):
                problems.append(
                    f"column '{column}' has type '{declared}'; use one of "
                    f"{list(types.SCALAR_TYPES)}, decimal(p,s) with 1 <= p <= 38 and "
                    "0 <= s <= p, or array<one of those>"
                )
        if problems:
            raise ValueError("; ".join(problems))
        return value

    @field_validator("encodings")
    @classmethod
    def _encodings(cls, value: dict[str, str], info: ValidationInfo) -> dict[str, str]:
        columns = info.data.get("columns") or {}
        problems = []
        for column, encoding in value.items():
            if columns and column not in columns:
                problems.append(f"column '{column}' has an encoding but is not under columns")
                continue
            allowed = configurable_encodings(columns.get(column, ""))
            if columns and encoding not in allowed:
                choice = f"one of {list(allowed)}" if allowed else "none (its type has one)"
                problems.append(
                    f"column '{column}' ({columns[column]}) has encoding '{encoding}'; use "
                    f"{choice}. It matters only when the connector sends no schema "
                    "(value.converter.schemas.enable=false): with one, the schema decides"
                )
        if problems:
            raise ValueError("; ".join(problems))
        return value

    @field_validator("defaults")
    @classmethod
    def _defaults(cls, value: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        columns = info.data.get("columns") or {}
        problems = []
        for column, raw in value.items():
            if columns and column not in columns:
                problems.append(f"column '{column}' has a default but is not under columns")
                continue
            try:
                typed_default(columns.get(column, "string"), raw)
            except ValueError as exc:
                problems.append(f"column '{column}': {exc}")
        if problems:
            raise ValueError("; ".join(problems))
        return value

    @field_validator("start_hour")
    @classmethod
    def _start_hour(cls, value: str) -> str:
        try:
            parsed = datetime.strptime(value, HOUR_KEY_FORMAT)
        except ValueError:
            raise ValueError(f"'{value}' is not an hour like '2026-11-20-00:00' (UTC)") from None
        if parsed.minute:
            raise ValueError(f"'{value}' must be on the hour")
        return value

    @field_validator("deletion_vectors", mode="before")
    @classmethod
    def _deletion_vectors(cls, value: Any) -> Any:
        # Only YAML's true/false: pydantic would also take 'yes', 'off', 0 or 1 as booleans,
        # and a quoted "false" that turned deletion vectors on would go unnoticed.
        if not isinstance(value, bool):
            raise ValueError(
                f"{value!r} is not true or false; write deletion_vectors: false for readers "
                "that can't apply deletion vectors, or leave it out (true)"
            )
        return value

    @field_validator("sensitive")
    @classmethod
    def _sensitive(cls, value: dict[str, str], info: ValidationInfo) -> dict[str, str]:
        # Settings that failed their own validation are missing here; they are reported already.
        columns = info.data.get("columns") or {}
        keys = info.data.get("primary_key") or ()
        expectations = info.data.get("expectations") or ()
        problems = []
        for column, mode in value.items():
            if columns and column not in columns:
                problems.append(
                    f"column '{column}' is not listed under columns; declare it there with its "
                    "type, then mark it"
                )
            if column in keys:
                problems.append(
                    f"column '{column}' is part of the primary_key, which can't be masked: the "
                    "MERGE matches and joins rows by it and Debezium sends it raw in the Kafka "
                    "key; leave it unmasked, or key the source table by a non-sensitive column"
                )
            for expectation in (e for e in expectations if e.column == column):
                if mode == "drop":
                    problems.append(
                        f"column '{column}' is dropped, so expectation "
                        f"'{expectation.check_name}' has nothing to check; remove the "
                        "expectation, or mark the column 'hash' to keep it masked"
                    )
                elif expectation.expect not in _HASH_SAFE_KINDS:
                    problems.append(
                        f"column '{column}' is stored hashed, so expectation "
                        f"'{expectation.check_name}' would judge the hash, not the value; remove "
                        f"it (only {' and '.join(_HASH_SAFE_KINDS)} keep their meaning on a "
                        "hashed column)"
                    )
        if problems:
            raise ValueError("; ".join(problems))
        return value

    @model_validator(mode="after")
    def _keys_are_columns(self) -> TableSpec:
        if not self.primary_key:
            raise ValueError("primary_key needs at least one column")
        missing = [key for key in self.primary_key if key not in self.columns]
        if missing:
            raise ValueError(f"primary_key columns {missing} are not listed under columns")
        problems, names = [], set(RESERVED_CHECK_NAMES)
        for column in self.defaults:
            if column in self.primary_key or column in self.sensitive:
                raise ValueError(
                    f"column '{column}' has a default, but it is "
                    + ("part of the primary_key" if column in self.primary_key else "masked")
                    + ", which can't take one; remove its default"
                )
        for column in self.toasted_columns:
            if column not in self.columns or column in self.primary_key:
                problems.append(
                    f"toasted_columns names '{column}', which is not a non-key column listed "
                    "under columns"
                )
            if self.sensitive.get(column) == "drop":
                problems.append(
                    f"toasted column '{column}' is dropped (sensitive), so it has no value to "
                    "keep; remove it from toasted_columns, or hash it"
                )
        tracking = {
            "history_columns": self.history_columns or (),
            "history_except_columns": self.history_except_columns,
        }
        for setting, listed in tracking.items():
            if listed and not self.history:
                problems.append(f"{setting} is set, but history is off; set history: true")
            for column in listed:
                if column not in self.columns or column in self.primary_key:
                    problems.append(
                        f"{setting} names '{column}', which is not a non-key column listed "
                        "under columns"
                    )
                elif self.sensitive.get(column) == "drop":
                    problems.append(
                        f"{setting} names '{column}', which is dropped (sensitive) and never "
                        "stored; remove it from the list"
                    )
        if self.history_columns is not None and self.history_except_columns:
            problems.append(
                "history_columns and history_except_columns are both set; keep one (the "
                "columns tracked, or the ones left out)"
            )
        if self.history and self.on_truncate == "apply":
            problems.append(
                "history: true with on_truncate: apply is not supported yet (a truncate would "
                "have to end every open version older than it, in any hour order); set "
                "on_truncate: fail, or turn history off"
            )
        for expectation in self.expectations:
            if expectation.column not in self.columns:
                problems.append(
                    f"expectation '{expectation.check_name}' names column "
                    f"'{expectation.column}', which is not listed under columns"
                )
            else:
                misfit = _misfit(expectation, self.columns[expectation.column])
                if misfit:
                    problems.append(misfit)
            if expectation.check_name in names:
                problems.append(
                    f"expectation '{expectation.check_name}' is declared twice (or clashes "
                    "with a built-in check); keep one per column and kind"
                )
            names.add(expectation.check_name)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def start_datetime(self) -> datetime:
        return hour_start(self.start_hour)

    @property
    def error_table_name(self) -> str:
        return f"{self.name}__errors"

    def column_defaults(self) -> dict[str, Any]:
        """The declared defaults as values of their columns' types (`typed_default`)."""
        return {
            c: typed_default(self.columns[c], raw)
            for c, raw in self.defaults.items()
            if c in self.columns
        }


def parse_tables(raw: dict, *, source: str = "tables config") -> list[TableSpec]:
    """Validates every entry and raises one `TableConfigError` listing all problems."""
    if not isinstance(raw, dict) or not isinstance(raw.get("tables"), list):
        raise TableConfigError(f"{source}: expected a top-level 'tables:' list of table entries")
    specs: list[TableSpec] = []
    problems: list[str] = []
    for index, entry in enumerate(raw["tables"]):
        label = entry.get("name", f"#{index + 1}") if isinstance(entry, dict) else f"#{index + 1}"
        try:
            specs.append(TableSpec.model_validate(entry))
        except ValidationError as exc:
            for err in exc.errors():
                setting = ".".join(str(part) for part in err["loc"]) or "(entry)"
                message = err["msg"].removeprefix("Value error, ")
                problems.append(f"{source}: table '{label}', setting '{setting}': {message}")
    # Uniqueness over the raw entries, so a duplicate is reported even next to other errors.
    entries = [entry for entry in raw["tables"] if isinstance(entry, dict)]
    for setting in ("name", "topic"):
        values = [entry.get(setting) for entry in entries if entry.get(setting) is not None]
        problems += [
            f"{source}: {setting} '{value}' is used by {values.count(value)} tables; "
            "each must be unique"
            for value in sorted(set(values), key=str)
            if values.count(value) > 1
        ]
    if problems:
        raise TableConfigError("\n".join(problems))
    return specs


@dataclass(frozen=True)
class TablesFile:
    """A validated tables file: its tables, and its file-wide switch.

    `shop_analytics: true` builds the demo shop's analytics (shop_analytics/) over the file's
    customers, orders and order_items. The demo's file sets it; tables merely named like the
    shop's never build them.
    """

    tables: list[TableSpec]
    shop_analytics: bool = False


def parse_tables_file(raw: dict, *, source: str = "tables config") -> TablesFile:
    """Validates a whole tables file (its settings and every table entry) and raises one
    `TableConfigError` listing all problems; an unknown top-level setting is one (keys starting
    `x-` are the file's own, e.g. a block of YAML anchors, and are passed over)."""
    problems: list[str] = []
    switch = False
    if isinstance(raw, dict):
        problems += [
            f"{source}: unknown top-level setting '{key}'; a tables file holds "
            f"{' and '.join(repr(s) for s in TABLES_FILE_SETTINGS)} (check its spelling; a "
            "block of YAML anchors goes under a key starting x-, e.g. x-defaults)"
            for key in sorted(set(raw) - set(TABLES_FILE_SETTINGS), key=str)
            if not str(key).startswith("x-")
        ]
        switch = raw.get(SHOP_ANALYTICS, False)
        if not isinstance(switch, bool):
            problems.append(
                f"{source}: setting '{SHOP_ANALYTICS}': {switch!r} is not true or false; write "
                f"{SHOP_ANALYTICS}: true to build the demo shop's analytics over this file's "
                "customers, orders and order_items, or leave it out"
            )
    try:
        tables = parse_tables(raw, source=source)
    except TableConfigError as exc:
        problems.append(str(exc))
    if problems:
        raise TableConfigError("\n".join(problems))
    return TablesFile(tables=tables, shop_analytics=switch)


def load_tables_file(path: str | Path = DEFAULT_TABLES_FILE) -> TablesFile:
    """Loads and validates the tables file at `path`: its tables and its settings."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise TableConfigError(
            f"tables file {path} does not exist; set CDC_TABLES_FILE to the tables YAML"
        ) from None
    except yaml.YAMLError as exc:
        raise TableConfigError(f"{path}: not valid YAML: {exc}") from None
    return parse_tables_file(raw, source=str(path))


def load_tables(path: str | Path = DEFAULT_TABLES_FILE) -> list[TableSpec]:
    """Loads and validates the tables file at `path`; its tables."""
    return load_tables_file(path).tables


def named_table(name: str, environ: Mapping[str, str] = os.environ) -> tuple[TableSpec, str]:
    """A command's `--table`: the table `name` of the tables file `CDC_TABLES_FILE` names (the
    default file without it), and that file's path; TableConfigError, listing the file's
    tables, when it has none of that name."""
    tables_file = str(environ.get(TABLES_FILE_ENV, DEFAULT_TABLES_FILE))
    specs = {s.name: s for s in load_tables(tables_file)}
    if name not in specs:
        raise TableConfigError(
            f"no table '{name}' in the tables file {tables_file}; tables: {sorted(specs)}"
        )
    return specs[name], tables_file
