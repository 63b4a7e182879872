"""Great-expectations 1.x suites from the tables file, run where the hour's rows are.

Write, audit, publish:

- Hard expectations run on an hour's decoded changes before the MERGE (`audit_changes`). A
  change that fails one goes to the error table with the expectation named as its reason and
  never reaches the mirror. Deletes are not audited: removing a row that breaks a rule is fine.
- The other expectations run on the hour's newest change per key (deletes excepted), the batch
  the MERGE takes, already in memory (`validate_batch`): one validation per hour, no read of the
  table back. `unique` is judged among the live rows: the live rows that share a value with the
  hour's rows must not repeat it, which finds every collision the hour caused without reading
  whole rows of the table (one Spark aggregation, `_unique_among_live_rows`).
- Every table also has the primary key's expectations: not null, and unique among live rows.

Rows read in the driver come as a pyarrow Table and run on great-expectations' pandas engine,
without a Spark query; rows Spark read come as a DataFrame and run on its Spark engine. Where the
engines read an expectation differently, it is translated so both give the same results
(tests/checks/test_expectation_engines.py runs every kind through both):

- type: the declared type is named as each engine sees it (`_PANDAS_TYPES` for the columns
  `_pandas_frame` makes), and the observed type is reported as Spark names it on both.
- regex: the tables file's regex is Java's (Spark's `rlike`); pandas gets its Python form
  (`cdc_assets.java_regex`), and what has none is refused when the tables file is read.
- between: an integer column's bounds are rounded inwards to integers, so Spark (comparing
  longs as doubles) judges as pandas (exactly); a NaN is out of range (Spark orders NaN above
  every number); a decimal column is compared exactly with the decimal the bound names (Spark
  would compare doubles, pandas a decimal with the bound's binary fraction), exact on both
  engines up to precision 15, beyond which Spark's doubles can't tell neighbouring values apart.
- in_set: the values are given in the column's type (a float column's rounded to float32).

Results carry counts and the expectation's parameters as metadata; great-expectations' samples
of unexpected values are dropped, so no user row reaches the UI or the logs.
"""

from __future__ import annotations

import functools
import importlib
import json
import math
import struct
import sys
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from decimal import ROUND_CEILING, ROUND_FLOOR, Context, Decimal, localcontext
from typing import TYPE_CHECKING, Any

import dagster as dg
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from cdc_assets.columns import DELETED, KAFKA_OFFSET, KAFKA_PARTITION, OP
from cdc_assets.config import ExpectationSpec, TableSpec, spark_type
from cdc_assets.decoding.types import array_item, decimal_shape
from cdc_assets.java_regex import python_regex
from cdc_assets.results import KeyCounts

if TYPE_CHECKING:
    import pandas as pd

PK_NOT_NULL = "primary_key_not_null"
PK_UNIQUE = "primary_key_unique"

PANDAS, SPARK = "pandas", "spark"

# Spark's class name for each declared type, as great-expectations' type expectation reports it.
_SPARK_CLASSES = {
    "string": "StringType",
    "boolean": "BooleanType",
    "int": "IntegerType",
    "bigint": "LongType",
    "double": "DoubleType",
    "float": "FloatType",
    "timestamp": "TimestampType",
    "date": "DateType",
    "binary": "BinaryType",
}
# The same types as great-expectations' pandas engine names them, for the columns
# `_pandas_frame` makes (the name of the dtype's scalar type, unique to each).
_PANDAS_TYPES = {
    "StringType": "str",
    "BooleanType": "bool",
    "IntegerType": "int32",
    "LongType": "int64",
    "DoubleType": "float64",
    "FloatType": "float32",
    "TimestampType": "Timestamp",
    "DateType": "date",
    "DecimalType": "Decimal",
    "BinaryType": "bytes",
    "ArrayType": "list",
}
_SPARK_NAMES = {name: spark for spark, name in _PANDAS_TYPES.items()}


@dataclass(frozen=True)
class Expectation:
    """One named check backed by one or more great-expectations expectations."""

    name: str
    kind: str
    columns: tuple[str, ...]
    parameters: dict[str, Any]
    hard: bool
    severity: str
    blocking: bool
    # The declared type of the column a declared expectation judges (what its translation
    # for each engine depends on); None for the primary key's.
    column_type: str | None = None

    @property
    def description(self) -> str:
        params = ", ".join(f"{k}={v}" for k, v in self.parameters.items())
        where = (
            "before the MERGE; failing changes go to the error table"
            if self.hard
            else ("after the MERGE on the rows the hour wrote")
        )
        subject = ", ".join(self.columns)
        return f"{subject}: {self.kind}{f' ({params})' if params else ''}, checked {where}."

    @property
    def reason(self) -> str:
        """The error-table reason of a change this expectation held back."""
        return f"expectation '{self.name}' failed"


def table_expectations(spec: TableSpec) -> list[Expectation]:
    """The primary key's implicit expectations, then the declared ones, in file order."""
    policy = spec.checks.primary_key
    key = tuple(spec.primary_key)
    implicit = [
        Expectation(PK_NOT_NULL, "not_null", key, {}, False, policy.severity, policy.blocking),
        Expectation(PK_UNIQUE, "unique", key, {}, False, policy.severity, policy.blocking),
    ]
    return implicit + [_declared(spec, e) for e in spec.expectations]


def _declared(spec: TableSpec, declared: ExpectationSpec) -> Expectation:
    parameters: dict[str, Any] = {}
    if declared.expect == "in_set":
        parameters["values"] = list(declared.values or ())
    elif declared.expect == "between":
        parameters |= {
            k: v for k, v in (("min", declared.min), ("max", declared.max)) if v is not None
        }
    elif declared.expect == "regex":
        parameters["regex"] = declared.regex
    elif declared.expect == "type":
        parameters["type"] = declared.type
    return Expectation(
        name=declared.check_name,
        kind=declared.expect,
        columns=(declared.column,),
        parameters=parameters,
        hard=declared.hard,
        severity=declared.severity,
        blocking=declared.blocking,
        column_type=spec.columns.get(declared.column),
    )


def expectation_check_specs(
    spec: TableSpec, *, asset_key: dg.AssetKey, partitions_def: dg.PartitionsDefinition
) -> list[dg.AssetCheckSpec]:
    return [
        dg.AssetCheckSpec(
            e.name,
            asset=asset_key,
            partitions_def=partitions_def,
            blocking=e.blocking,
            description=e.description,
        )
        for e in table_expectations(spec)
    ]


def _spark_class(declared: str) -> str:
    """The Spark type class a declared column type is stored as (`DecimalType`, ...)."""
    stored = spark_type(declared)
    if array_item(stored) is not None:
        return "ArrayType"
    return "DecimalType" if decimal_shape(stored) else _SPARK_CLASSES[stored]


def _gx_expectations(expectation: Expectation, engine: str = SPARK) -> list:
    """great-expectations' expectations for `expectation`, in `engine`'s terms."""
    import great_expectations as gx

    kinds = gx.expectations
    columns = expectation.columns
    p = expectation.parameters
    if expectation.kind == "not_null":
        return [kinds.ExpectColumnValuesToNotBeNull(column=c) for c in columns]
    if expectation.kind == "unique":
        if len(columns) > 1:
            return [kinds.ExpectCompoundColumnsToBeUnique(column_list=list(columns))]
        return [kinds.ExpectColumnValuesToBeUnique(column=columns[0])]
    (column,) = columns
    if expectation.kind == "in_set":
        values = _typed_values(p["values"], expectation.column_type)
        return [kinds.ExpectColumnValuesToBeInSet(column=column, value_set=values)]
    if expectation.kind == "between":
        low, high = _bounds(p.get("min"), p.get("max"), expectation.column_type, engine)
        return [kinds.ExpectColumnValuesToBeBetween(column=column, min_value=low, max_value=high)]
    if expectation.kind == "regex":
        regex = p["regex"] if engine == SPARK else python_regex(p["regex"])
        return [kinds.ExpectColumnValuesToMatchRegex(column=column, regex=regex)]
    if expectation.kind == "type":
        name = _spark_class(p["type"])
        type_ = name if engine == SPARK else _PANDAS_TYPES[name]
        return [kinds.ExpectColumnValuesToBeOfType(column=column, type_=type_)]
    raise ValueError(f"unknown expectation kind '{expectation.kind}'")


def _typed_values(values: Sequence, declared: str | None) -> list:
    """An in_set's values as the column's type holds them (the tables file checked they fit),
    so both engines compare like with like."""
    if declared == "float":
        return [_float32(v) for v in values]
    if declared == "double":
        return [float(v) for v in values]
    if declared and decimal_shape(declared):
        return [_decimal(v) for v in values]
    return list(values)


def _float32(value: float) -> float:
    """`value` rounded to the nearest float32, as a Python float (what Spark compares)."""
    return struct.unpack("f", struct.pack("f", value))[0]


def _decimal(value: int | float) -> Decimal:
    # A float bound from the tables file names the decimal it was written as (0.1, not the
    # binary fraction nearest it).
    return Decimal(repr(value)) if isinstance(value, float) else Decimal(value)


def _bounds(
    low: float | None, high: float | None, declared: str | None, engine: str
) -> tuple[Any, Any]:
    """A between's bounds in `engine`'s terms, so that both judge each value alike."""
    shape = decimal_shape(declared) if declared else None
    if shape:
        return (
            None if low is None else _decimal_bound(low, shape[1], lower=True, engine=engine),
            None if high is None else _decimal_bound(high, shape[1], lower=False, engine=engine),
        )
    if declared in ("int", "bigint"):
        # The column's own nearest values inside the bounds: exact as doubles (the tables file
        # keeps bounds within 2**53), so Spark, which compares a long with a double as two
        # doubles, judges every value as pandas does (exactly, as Python ints).
        return (
            None if low is None else float(math.ceil(low)),
            None if high is None else float(math.floor(high)),
        )
    if declared in ("double", "float"):
        # An upper bound of infinity puts NaN out of range on Spark too (it orders NaN above
        # every number; pandas finds NaN in no range).
        return low, math.inf if high is None else high
    return low, high


def _decimal_bound(bound: float, scale: int, *, lower: bool, engine: str) -> float:
    """A decimal column's bound as a double that each engine compares exactly: the column's
    nearest value inside the bound, as Spark's double (Spark compares decimal(p<=15) values as
    doubles, which tell them apart), or for pandas (which compares each Decimal exactly with the
    double) the double just outside that value."""
    with localcontext(Context(prec=400)):
        edge = _decimal(bound).quantize(
            Decimal(1).scaleb(-scale), rounding=ROUND_CEILING if lower else ROUND_FLOOR
        )
    near = float(edge)
    if engine == PANDAS and (Decimal(near) > edge if lower else Decimal(near) < edge):
        near = math.nextafter(near, -math.inf if lower else math.inf)
    return near


def preload() -> None:
    """Imports great-expectations in a background thread.

    The import takes ~9 s of one core (measured by `scripts/bench.sh --profile-runs`). A run
    calls this before its Spark session starts, so the import overlaps the JVM's start instead
    of delaying the first check; a later import waits for it to finish.
    """
    if "great_expectations" not in sys.modules:
        threading.Thread(
            target=importlib.import_module,
            args=("great_expectations",),
            name="great-expectations-import",
            daemon=True,
        ).start()


def _context():
    import great_expectations as gx
    from great_expectations.data_context.types.base import (
        DataContextConfig,
        InMemoryStoreBackendDefaults,
        ProgressBarsConfig,
    )

    # In memory, no usage statistics sent anywhere, no progress bars in the run's logs.
    config = DataContextConfig(
        store_backend_defaults=InMemoryStoreBackendDefaults(),
        analytics_enabled=False,
        progress_bars=ProgressBarsConfig(globally=False),
    )
    return gx.get_context(mode="ephemeral", project_config=config)


@functools.lru_cache(maxsize=1)
def _batch_definition(session: SparkSession):
    # persist=False: great-expectations would cache every frame it validates and never release
    # it; the frames worth caching are cached (and released) here.
    source = _context().data_sources.add_spark(name="cdc_lake", persist=False)
    return source.add_dataframe_asset(name="frame").add_batch_definition_whole_dataframe("all")


@functools.lru_cache(maxsize=1)
def _pandas_batch_definition():
    source = _context().data_sources.add_pandas(name="cdc_rows")
    return source.add_dataframe_asset(name="frame").add_batch_definition_whole_dataframe("all")


# Every batch of a data asset has the same id, under which the engine keeps the batch's data:
# two tables validating rows at once (the fleet's threads) would read each other's.
_PANDAS_LOCK = threading.Lock()


def _pandas_dtype(arrow: pa.DataType):
    """The pandas dtype of a column in memory: nullable, exact, and one scalar type per
    declared type (what `_PANDAS_TYPES` names); None keeps pyarrow's own conversion."""
    import pandas as pd

    if pa.types.is_boolean(arrow):
        return pd.BooleanDtype()
    if pa.types.is_integer(arrow):
        return pd.api.types.pandas_dtype(
            f"{'U' if pa.types.is_unsigned_integer(arrow) else ''}Int{arrow.bit_width}"
        )
    if pa.types.is_floating(arrow) and arrow.bit_width in (32, 64):
        return pd.Float32Dtype() if arrow.bit_width == 32 else pd.Float64Dtype()
    if pa.types.is_string(arrow) or pa.types.is_large_string(arrow):
        # Python-backed: great-expectations' regex then runs Python's re, not pyarrow's RE2.
        return pd.StringDtype("python")
    if pa.types.is_timestamp(arrow) and arrow.tz is not None:
        return None  # datetime64[us, UTC]: pandas' own, which its between and type know
    return pd.ArrowDtype(arrow)  # decimals stay Decimal, dates date, binaries bytes, lists list


def _pandas_frame(rows: pa.Table, columns: Sequence[str]) -> pd.DataFrame:
    """`rows`' `columns` as pandas, types kept: nullable integers stay integers, decimals exact,
    timestamps microseconds in their time zone."""
    return rows.select(list(dict.fromkeys(columns))).to_pandas(
        types_mapper=_pandas_dtype, coerce_temporal_nanoseconds=False
    )


def _key(configuration) -> str:
    # A result's configuration gains the batch's id; the rest identifies the expectation.
    kwargs = {k: v for k, v in configuration.kwargs.items() if k != "batch_id"}
    return json.dumps([configuration.type, kwargs], sort_keys=True, default=str)


def _validate(rows: pd.DataFrame | DataFrame, expectations: Sequence, result_format: dict) -> list:
    """Runs great-expectations over `rows` (a pandas or a Spark frame); returns one result per
    expectation, in order.

    great-expectations reorders results and would run an expectation declared twice (say, a
    declared not_null on a key column) twice; results are matched back by type and arguments.
    """
    import great_expectations as gx

    unique = {_key(e.configuration): e for e in expectations}
    suite = gx.ExpectationSuite(name="cdc_checks", expectations=list(unique.values()))
    if isinstance(rows, DataFrame):
        batch = _batch_definition(rows.sparkSession).get_batch(batch_parameters={"dataframe": rows})
        results = batch.validate(suite, result_format=result_format).results
    else:
        with _PANDAS_LOCK, warnings.catch_warnings():
            # pandas warns of every regex with a group, as if its groups were wanted.
            warnings.filterwarnings("ignore", "This pattern is interpreted", UserWarning)
            batch = _pandas_batch_definition().get_batch(batch_parameters={"dataframe": rows})
            results = batch.validate(suite, result_format=result_format).results
    by_key = {_key(r.expectation_config): r for r in results}
    return [by_key[_key(e.configuration)] for e in expectations]


@dataclass(frozen=True)
class Outcome:
    """What great-expectations (or the query named in `evaluated_by`) found for one check."""

    expectation: Expectation
    success: bool
    counts: dict[str, Any] = field(default_factory=dict)
    observed_type: str | None = None
    failure: str | None = None  # the expectation could not be evaluated, and why
    # What evaluated it: great-expectations' expectation types, or the Spark query that did.
    evaluated_by: str | None = None

    def check_result(self, *, rows_label: str, extra: dict | None = None) -> dg.AssetCheckResult:
        e = self.expectation
        metadata: dict[str, Any] = {
            "expectation": self.evaluated_by
            or ", ".join(g.configuration.type for g in _gx_expectations(e)),
            "columns": ", ".join(e.columns),
            "parameters": dg.MetadataValue.json(e.parameters),
            "evaluated_on": rows_label,
            **{k: v for k, v in self.counts.items() if v is not None},
            **(extra or {}),
        }
        if self.observed_type:
            metadata["observed_type"] = self.observed_type
        description = self.failure
        if description is None and not self.success:
            unexpected = self.counts.get("unexpected_count")
            description = (
                f"{unexpected} of {self.counts.get('element_count')} rows are unexpected"
                if unexpected is not None
                else f"observed type {self.observed_type}, expected {e.parameters.get('type')}"
            )
        return dg.AssetCheckResult(
            check_name=e.name,
            passed=self.success,
            severity=dg.AssetCheckSeverity(e.severity),
            description=description,
            metadata=metadata,
        )


def _summarize(expectation: Expectation, results: list, engine: str) -> Outcome:
    """Folds the results of one check's expectations (one per key column for not_null)."""
    failures = [r.exception_info.get("exception_message") for r in results if _raised(r)]
    if failures:
        return Outcome(
            expectation,
            False,
            failure=f"great-expectations could not evaluate it: {failures[0]}",
        )
    counts = _counts(r.result for r in results)
    observed = results[0].result.get("observed_value") if expectation.kind == "type" else None
    if observed is not None and engine == PANDAS:
        observed = _SPARK_NAMES.get(str(observed), observed)  # as Spark names it
    return Outcome(
        expectation,
        all(r.success for r in results),
        counts=counts,
        observed_type=str(observed) if observed is not None else None,
    )


def _counts(results) -> dict[str, Any]:
    counts: dict[str, Any] = {}
    results = list(results)
    for name in ("element_count", "unexpected_count", "missing_count"):
        values = [r.get(name) for r in results if r.get(name) is not None]
        if values:
            counts[name] = max(values) if name == "element_count" else sum(values)
    if counts.get("element_count") and "unexpected_count" in counts:
        counts["unexpected_percent"] = round(
            100.0 * counts["unexpected_count"] / counts["element_count"], 4
        )
    return counts


def _raised(result) -> bool:
    info = result.exception_info or {}
    return bool(info.get("raised_exception"))


def _engine(rows: pa.Table | DataFrame) -> str:
    if isinstance(rows, pa.Table):
        return PANDAS
    if isinstance(rows, DataFrame):
        return SPARK
    raise TypeError(f"rows must be a pyarrow Table or a Spark DataFrame, not {type(rows)}")


def _run(
    expectations: Sequence[Expectation],
    rows: pa.Table | DataFrame,
    result_format: dict,
    index: Sequence[str] = (),
) -> list[tuple[Expectation, list]]:
    """Each of `expectations` with its great-expectations results on `rows`, on the engine
    that suits them: pandas for a Table (only the columns judged), Spark for a DataFrame."""
    engine = _engine(rows)
    expanded = [(e, gx_e) for e in expectations for gx_e in _gx_expectations(e, engine)]
    if not expanded:
        return []
    if engine == PANDAS:
        judged = [*index, *(c for e in expectations for c in e.columns)]
        rows = _pandas_frame(rows, judged)
    results = _validate(rows, [gx_e for _, gx_e in expanded], result_format)
    return [
        (e, [r for (owner, _), r in zip(expanded, results, strict=True) if owner is e])
        for e in expectations
    ]


# --- audit: hard expectations, before the MERGE --------------------------------------------


@dataclass(frozen=True)
class Audit:
    """The hard expectations' verdict on one hour's changes."""

    outcomes: tuple[Outcome, ...]
    # (kafka partition, kafka offset) -> error-table reason: the changes to hold back.
    failed: dict[tuple[int, int], str] = field(default_factory=dict)
    # The changes held back, per error-table reason.
    reasons: dict[str, int] = field(default_factory=dict)

    def check_results(self) -> list[dg.AssetCheckResult]:
        return [
            o.check_result(
                rows_label="the hour's changes, before the MERGE (deletes excepted)",
                extra={"held_back": o.counts.get("unexpected_count", 0)},
            )
            for o in self.outcomes
        ]


def audit_no_changes(spec: TableSpec) -> Audit | None:
    """The hard expectations' verdict on an hour without changes: each holds on the empty set
    (as great-expectations judges an empty frame); None when the table declares none."""
    hard = [e for e in table_expectations(spec) if e.hard]
    if not hard:
        return None
    empty = {"element_count": 0, "unexpected_count": 0}
    return Audit(tuple(Outcome(e, True, counts=dict(empty)) for e in hard))


def audit_changes(
    spark: SparkSession, spec: TableSpec, changes: pa.Table | DataFrame
) -> Audit | None:
    """Evaluates the hard expectations on `changes`; None when the table declares none.

    `changes` are decoded, applicable changes (no errors, no tombstones): a pyarrow Table (rows
    read in the driver: pandas, no Spark query) or a DataFrame (Spark). The failing ones are
    returned by their Kafka coordinates, each with its error-table reason.
    """
    hard = [e for e in table_expectations(spec) if e.hard]
    if not hard:
        return None
    if isinstance(changes, pa.Table):
        audited = changes.filter(pc.not_equal(changes[OP], "d"))
    else:
        audited = changes.where(F.col(OP) != "d")
    index = [KAFKA_PARTITION, KAFKA_OFFSET]
    result_format = {
        "result_format": "COMPLETE",
        "unexpected_index_column_names": index,
        "partial_unexpected_count": 0,
    }
    engine = _engine(changes)
    outcomes, names = [], {}
    for e, results in _run(hard, audited, result_format, index):
        outcomes.append(_summarize(e, results, engine))
        for result in results:
            if _raised(result):
                raise RuntimeError(
                    f"table '{spec.name}': hard expectation '{e.name}' could not be evaluated "
                    f"({result.exception_info.get('exception_message')}); nothing was written. "
                    "Fix the expectation in the tables file."
                )
            for row in result.result.get("unexpected_index_list") or ():
                coordinates = (int(row[KAFKA_PARTITION]), int(row[KAFKA_OFFSET]))
                names.setdefault(coordinates, []).append(e.name)
    failed = {
        coordinates: (
            "failed expectations: " + ", ".join(sorted(set(held)))
            if len(set(held)) > 1
            else f"expectation '{held[0]}' failed"
        )
        for coordinates, held in names.items()
    }
    reasons: dict[str, int] = {}
    for reason in failed.values():
        reasons[reason] = reasons.get(reason, 0) + 1
    return Audit(tuple(outcomes), failed, reasons)


# --- publish: the other expectations, on the hour's newest change per key -------------------


def validate_nothing(spec: TableSpec) -> list[Outcome]:
    """The non-hard expectations on an hour without changes: each holds on the empty set."""
    return [
        Outcome(e, True, counts={"element_count": 0, "unexpected_count": 0})
        for e in table_expectations(spec)
        if not e.hard
    ]


def validate_batch(
    spark: SparkSession,
    spec: TableSpec,
    path: str,
    version: int | None,
    rows: pa.Table | DataFrame,
    keys: KeyCounts | None = None,
    frame: DataFrame | None = None,
) -> list[Outcome]:
    """Runs the table's non-hard expectations on `rows`, the hour's newest change per key
    (deletes excepted): a pyarrow Table (pandas, no Spark query) or a DataFrame (Spark).

    A declared `unique` is judged among the mirror's live rows at `version` (None: the mirror
    does not exist) by one Spark query, which takes the hour's values from `frame`, a DataFrame
    of the same rows (needed when `rows` is a Table); the primary key's from `keys`."""
    expectations = [e for e in table_expectations(spec) if not e.hard]
    per_row = [e for e in expectations if e.kind != "unique"]
    engine = _engine(rows)
    outcomes = {
        e.name: _summarize(e, results, engine)
        for e, results in _run(
            per_row, rows, {"result_format": "BASIC", "partial_unexpected_count": 0}
        )
    }
    for e in (e for e in expectations if e.kind == "unique"):
        if e.name == PK_UNIQUE:
            outcomes[e.name] = _key_unique(e, keys or KeyCounts(0, 0))
        else:
            # Rows in memory hold stand-ins for hashed columns (`masking.stand_ins`), which
            # can't bound the hashes the mirror stores.
            stand_ins = {c for c, mode in spec.sensitive.items() if mode == "hash"}
            outcomes[e.name] = _unique_among_live_rows(
                spark, e, path, version, rows, frame, unranged=stand_ins
            )
    return [outcomes[e.name] for e in expectations]


def _key_unique(e: Expectation, keys: KeyCounts) -> Outcome:
    """The primary key's uniqueness among the live rows under the hour's keys (`KeyCounts`):
    counted by the run before its MERGE and from the MERGE's own metrics, so every table-hour
    pays no read of the mirror for it. A repeat is a row the MERGE should have matched."""
    counts = {"element_count": keys.keys, "unexpected_count": keys.duplicates}
    if keys.keys:
        counts["unexpected_percent"] = round(100.0 * keys.duplicates / keys.keys, 4)
    return Outcome(e, keys.duplicates == 0, counts=counts, evaluated_by=_KEY_QUERY)


_KEY_QUERY = (
    "the mirror's live rows per primary key of the hour before its MERGE (Spark aggregation), "
    "and the rows the MERGE inserted against the keys it had none for (Delta's metrics)"
)
_UNIQUE_QUERY = (
    "one Spark aggregation: the mirror's live rows that share a value with the hour's rows, "
    "counted per value (as great-expectations' unique counts them)"
)
_NO_MIRROR = "nothing: the mirror does not exist, so no live row can share a value"


def _unique_among_live_rows(
    spark: SparkSession,
    e: Expectation,
    path: str,
    version: int | None,
    rows: pa.Table | DataFrame,
    frame: DataFrame | None,
    unranged: set[str] = frozenset(),
) -> Outcome:
    """Live rows sharing a value with the hour's rows: a repeat among them is a collision the
    hour caused (nulls are never duplicates, as in great-expectations). `unranged`: columns
    whose values in `rows` don't stand for the mirror's (a hashed column's stand-ins), which
    don't narrow the files read.

    One Spark query: the live rows semi-joined with the hour's distinct values, counted per
    value, summed. element_count and unexpected_count are those great-expectations' unique
    gives on the same rows (every row counted; unexpected: the rows whose value repeats). The
    mirror is read at its current snapshot, the run's own commit (one writer per table):
    Delta's cached snapshot, where `versionAsOf` would replay the log again.
    """
    if version is None:
        return Outcome(
            e, True, counts={"element_count": 0, "unexpected_count": 0}, evaluated_by=_NO_MIRROR
        )
    hour = rows if isinstance(rows, DataFrame) else frame
    if hour is None:
        raise ValueError(
            f"expectation '{e.name}': the hour's rows are in memory, so judging it among the "
            "mirror's live rows needs `frame`, a Spark DataFrame of the same rows"
        )
    columns = list(e.columns)
    values = (
        hour.select(*columns)
        .where(functools.reduce(lambda a, b: a & b, [F.col(c).isNotNull() for c in columns]))
        .distinct()
    )
    live = spark.read.format("delta").load(path).where(~F.col(DELETED))
    if isinstance(rows, pa.Table):
        # Only files whose statistics overlap the hour's values' ranges can collide. (For rows
        # Spark holds, the ranges would cost a query of their own: the join reads every file.)
        for column, (low, high) in _ranges(rows, columns).items():
            if column in unranged:
                continue
            live = live.where(F.col(column) >= F.lit(low))
            if high is not None:
                live = live.where(F.col(column) <= F.lit(high))
    per_value = (
        live.join(values, on=columns, how="left_semi")
        .groupBy(*columns)
        .agg(F.count("*").alias("n"))
    )
    counted = per_value.agg(
        F.coalesce(F.sum("n"), F.lit(0)).alias("element_count"),
        F.coalesce(F.sum(F.when(F.col("n") > 1, F.col("n"))), F.lit(0)).alias("unexpected_count"),
    ).first()
    element_count, unexpected_count = int(counted[0]), int(counted[1])
    counts: dict[str, Any] = {
        "element_count": element_count,
        "unexpected_count": unexpected_count,
        "missing_count": 0,  # rows sharing a value have one
    }
    if element_count:
        counts["unexpected_percent"] = round(100.0 * unexpected_count / element_count, 4)
    return Outcome(e, unexpected_count == 0, counts=counts, evaluated_by=_UNIQUE_QUERY)


def _ranges(rows: pa.Table, columns: Sequence[str]) -> dict[str, tuple[Any, Any]]:
    """Each column's lowest and highest value among `rows` whose `columns` are all set (high
    None: unbounded, when a NaN is among them, which Spark orders above every number); columns
    without an order pyarrow and Spark share (lists, structs) are left out."""
    valid = functools.reduce(pc.and_, [pc.is_valid(rows[c]) for c in columns])
    judged = rows.select(list(columns)).filter(valid)
    ranges: dict[str, tuple[Any, Any]] = {}
    for column in columns:
        values = judged[column]
        if len(values) == 0 or pa.types.is_nested(values.type):
            continue
        high_open = False
        if pa.types.is_floating(values.type):
            nan = pc.is_nan(values)
            high_open = pc.any(nan).as_py() or False
            values = values.filter(pc.invert(nan))
            if len(values) == 0:
                continue
        bounds = pc.min_max(values)
        low, high = bounds["min"].as_py(), bounds["max"].as_py()
        ranges[column] = (low, None if high_open else high)
    return ranges
