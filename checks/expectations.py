"""Great-expectations 1.x suites from the tables file, run on Spark DataFrames.

Write, audit, publish:

- Hard expectations run on an hour's decoded changes before the MERGE (`audit_changes`). A
  change that fails one goes to the error table with the expectation named as its reason and
  never reaches the mirror. Deletes are not audited: removing a row that breaks a rule is fine.
- The other expectations run on the hour's newest change per key (deletes excepted), the batch
  the MERGE takes, already in memory (`validate_batch`): one validation per hour, no read of the
  table back. `unique` is judged among the live rows: the live rows that share a value with the
  hour's rows must not repeat it, which finds every collision the hour caused without reading
  whole rows of the table.
- Every table also has the primary key's expectations: not null, and unique among live rows.

Results carry counts and the expectation's parameters as metadata; great-expectations' samples
of unexpected values are dropped, so no user row reaches the UI or the logs.
"""

from __future__ import annotations

import functools
import importlib
import json
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import dagster as dg
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from cdc_assets.columns import DELETED, KAFKA_OFFSET, KAFKA_PARTITION, OP
from cdc_assets.config import ExpectationSpec, TableSpec, spark_type
from cdc_assets.results import KeyCounts

PK_NOT_NULL = "primary_key_not_null"
PK_UNIQUE = "primary_key_unique"

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
}


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


def _gx_expectations(expectation: Expectation) -> list:
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
        return [kinds.ExpectColumnValuesToBeInSet(column=column, value_set=p["values"])]
    if expectation.kind == "between":
        return [
            kinds.ExpectColumnValuesToBeBetween(
                column=column, min_value=p.get("min"), max_value=p.get("max")
            )
        ]
    if expectation.kind == "regex":
        return [kinds.ExpectColumnValuesToMatchRegex(column=column, regex=p["regex"])]
    if expectation.kind == "type":
        declared = spark_type(p["type"])
        class_name = "DecimalType" if declared.startswith("decimal") else _SPARK_CLASSES[declared]
        return [kinds.ExpectColumnValuesToBeOfType(column=column, type_=class_name)]
    raise ValueError(f"unknown expectation kind '{expectation.kind}'")


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


@functools.lru_cache(maxsize=1)
def _batch_definition(session: SparkSession):
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
    context = gx.get_context(mode="ephemeral", project_config=config)
    # persist=False: great-expectations would cache every frame it validates and never release
    # it; the frames worth caching are cached (and released) here.
    source = context.data_sources.add_spark(name="cdc_lake", persist=False)
    return source.add_dataframe_asset(name="frame").add_batch_definition_whole_dataframe("all")


def _key(configuration) -> str:
    # A result's configuration gains the batch's id; the rest identifies the expectation.
    kwargs = {k: v for k, v in configuration.kwargs.items() if k != "batch_id"}
    return json.dumps([configuration.type, kwargs], sort_keys=True, default=str)


def _validate(frame: DataFrame, expectations: Sequence, result_format: dict) -> list:
    """Runs great-expectations over `frame`; returns one result per expectation, in order.

    great-expectations reorders results and would run an expectation declared twice (say, a
    declared not_null on a key column) twice; results are matched back by type and arguments.
    """
    import great_expectations as gx

    unique = {_key(e.configuration): e for e in expectations}
    suite = gx.ExpectationSuite(name="cdc_checks", expectations=list(unique.values()))
    batch = _batch_definition(frame.sparkSession).get_batch(batch_parameters={"dataframe": frame})
    results = batch.validate(suite, result_format=result_format).results
    by_key = {_key(r.expectation_config): r for r in results}
    return [by_key[_key(e.configuration)] for e in expectations]


@dataclass(frozen=True)
class Outcome:
    """What great-expectations found for one named check."""

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


def _summarize(expectation: Expectation, results: list) -> Outcome:
    """Folds the results of one check's expectations (one per key column for not_null)."""
    failures = [r.exception_info.get("exception_message") for r in results if _raised(r)]
    if failures:
        return Outcome(
            expectation,
            False,
            failure=f"great-expectations could not evaluate it: {failures[0]}",
        )
    counts: dict[str, Any] = {}
    for name in ("element_count", "unexpected_count", "missing_count"):
        values = [r.result.get(name) for r in results if r.result.get(name) is not None]
        if values:
            counts[name] = max(values) if name == "element_count" else sum(values)
    if counts.get("element_count") and "unexpected_count" in counts:
        counts["unexpected_percent"] = round(
            100.0 * counts["unexpected_count"] / counts["element_count"], 4
        )
    observed = results[0].result.get("observed_value") if expectation.kind == "type" else None
    return Outcome(
        expectation,
        all(r.success for r in results),
        counts=counts,
        observed_type=str(observed) if observed is not None else None,
    )


def _raised(result) -> bool:
    info = result.exception_info or {}
    return bool(info.get("raised_exception"))


# --- audit: hard expectations, before the MERGE --------------------------------------------


@dataclass(frozen=True)
class Audit:
    """The hard expectations' verdict on one hour's changes."""

    outcomes: tuple[Outcome, ...]
    failed: DataFrame | None  # (_cdc_kafka_partition, _cdc_kafka_offset, reason) to hold back
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
    return Audit(tuple(Outcome(e, True, counts=dict(empty)) for e in hard), None)


def audit_changes(spark: SparkSession, spec: TableSpec, changes: DataFrame) -> Audit | None:
    """Evaluates the hard expectations on `changes`; None when the table declares none.

    `changes` are decoded, applicable changes (no errors, no tombstones). The failing ones are
    returned by their Kafka coordinates, each with the names of the expectations it failed.
    """
    hard = [e for e in table_expectations(spec) if e.hard]
    if not hard:
        return None
    if not isinstance(changes, DataFrame):  # TEMPORARY until the pandas engine lands
        changes = spark.createDataFrame(changes)
    audited = changes.where(F.col(OP) != "d")
    index = [KAFKA_PARTITION, KAFKA_OFFSET]
    expanded = [(e, gx_e) for e in hard for gx_e in _gx_expectations(e)]
    results = _validate(
        audited,
        [gx_e for _, gx_e in expanded],
        {
            "result_format": "COMPLETE",
            "unexpected_index_column_names": index,
            "partial_unexpected_count": 0,
        },
    )
    outcomes, failed = [], {}
    for e in hard:
        mine = [r for (owner, _), r in zip(expanded, results, strict=True) if owner is e]
        outcomes.append(_summarize(e, mine))
        for result in mine:
            if _raised(result):
                raise RuntimeError(
                    f"table '{spec.name}': hard expectation '{e.name}' could not be evaluated "
                    f"({result.exception_info.get('exception_message')}); nothing was written. "
                    "Fix the expectation in the tables file."
                )
            for row in result.result.get("unexpected_index_list") or ():
                coordinates = (int(row[KAFKA_PARTITION]), int(row[KAFKA_OFFSET]))
                failed.setdefault(coordinates, []).append(e.name)
    held, reasons = {}, {}
    for (p, o), names in failed.items():
        reason = (
            "failed expectations: " + ", ".join(sorted(set(names)))
            if len(set(names)) > 1
            else f"expectation '{names[0]}' failed"
        )
        held[(p, o)] = reason
        reasons[reason] = reasons.get(reason, 0) + 1
    return Audit(tuple(outcomes), held, reasons)


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
    rows: DataFrame,
    keys: KeyCounts | None = None,
    frame: DataFrame | None = None,
) -> list[Outcome]:
    """Runs the table's non-hard expectations on `rows`, the hour's newest change per key
    (deletes excepted), and `unique` among the mirror's live rows at `version` (None: the
    mirror does not exist); the primary key's from `keys`."""
    expectations = [e for e in table_expectations(spec) if not e.hard]
    if not isinstance(rows, DataFrame):  # TEMPORARY until the pandas engine lands
        rows = frame
    outcomes: dict[str, Outcome] = {}
    per_row = [e for e in expectations if e.kind != "unique"]
    expanded = [(e, gx_e) for e in per_row for gx_e in _gx_expectations(e)]
    if expanded:
        results = _validate(
            rows,
            [gx_e for _, gx_e in expanded],
            {"result_format": "BASIC", "partial_unexpected_count": 0},
        )
        for e in per_row:
            mine = [r for (owner, _), r in zip(expanded, results, strict=True) if owner is e]
            outcomes[e.name] = _summarize(e, mine)
    for e in (e for e in expectations if e.kind == "unique"):
        if e.name == PK_UNIQUE:
            outcomes[e.name] = _key_unique(e, keys or KeyCounts(0, 0))
        else:
            outcomes[e.name] = _unique_among_live_rows(spark, e, path, version, rows)
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


def _unique_among_live_rows(
    spark: SparkSession, e: Expectation, path: str, version: int | None, rows: DataFrame
) -> Outcome:
    """Live rows sharing a value with the hour's rows: a repeat among them is a collision the
    hour caused (nulls are never duplicates, as in great-expectations).

    The mirror is read at its current snapshot, the run's own commit (one writer per table):
    Delta's cached snapshot, where `versionAsOf` would replay the log again. The few colliding
    rows are computed once and cached, so great-expectations' metrics don't each redo the join.
    """
    values = (
        rows.select(*e.columns)
        .where(functools.reduce(lambda a, b: a & b, [F.col(c).isNotNull() for c in e.columns]))
        .distinct()
    )
    if version is None:
        colliding = values  # no mirror yet: the hour's rows are all there is (one per value)
    else:
        live = spark.read.format("delta").load(path).where(~F.col(DELETED))
        # Only files whose statistics overlap the hour's values' ranges can collide.
        ranges = values.agg(
            *[F.min(c).alias(f"low_{n}") for n, c in enumerate(e.columns)],
            *[F.max(c).alias(f"high_{n}") for n, c in enumerate(e.columns)],
        ).first()
        for n, c in enumerate(e.columns):
            if ranges[f"low_{n}"] is not None:
                live = live.where(
                    F.col(c).between(F.lit(ranges[f"low_{n}"]), F.lit(ranges[f"high_{n}"]))
                )
        colliding = live.join(values, on=list(e.columns), how="left_semi").select(*e.columns)
    colliding = colliding.persist()
    try:
        return _summarize(
            e,
            _validate(
                colliding,
                _gx_expectations(e),
                {"result_format": "BASIC", "partial_unexpected_count": 0},
            ),
        )
    finally:
        colliding.unpersist()
