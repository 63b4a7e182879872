"""Every check of one mirror table, assembled: its specs, its evaluation after a run, and the
standalone retention-risk check. Checks are partitioned like their asset, so the UI shows each
hour's results."""

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime

import dagster as dg
import pyarrow as pa
from kafka import TopicPartition
from pyspark.sql import DataFrame, SparkSession

from cdc_assets.commits import hour_history, recorded_offsets
from cdc_assets.config import TableSpec
from cdc_assets.partitions import hourly_partitions
from cdc_assets.results import HourResult, KeyCounts
from cdc_assets.toast import unknown_live_rows
from checks.expectations import (
    Audit,
    Outcome,
    audit_changes,
    audit_no_changes,
    expectation_check_specs,
    preload,
    table_expectations,
    validate_batch,
    validate_nothing,
)
from checks.invariants import (
    DESCRIPTIONS,
    RETENTION_RISK,
    accounting_result,
    changes_readable_result,
    complete_hour_result,
    continuity_result,
    error_rate_result,
    freshness_result,
    history_result,
    invariant_check_specs,
    retention_risk_result,
    run_checks,
    schema_drift_result,
    toasted_values_result,
)
from resources.kafka import KafkaResource
from resources.lake import LakeResource
from resources.spark import SparkResource


@contextmanager
def _partitioned_checks() -> Iterator[None]:
    # Partitioned asset checks are a Dagster preview; the per-hour reports rest on them and
    # dagster is pinned, so the warning at every definitions load says nothing new.
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", category=dg.PreviewWarning, message=".*partitions_def on an AssetCheckSpec"
        )
        yield


def run_check_specs(
    spec: TableSpec, *, partitions_def: dg.PartitionsDefinition
) -> list[dg.AssetCheckSpec]:
    """The checks evaluated inside each hour's run: the invariants, then the expectations."""
    key = dg.AssetKey(spec.name)
    with _partitioned_checks():
        return [
            *invariant_check_specs(spec, asset_key=key, partitions_def=partitions_def),
            *expectation_check_specs(spec, asset_key=key, partitions_def=partitions_def),
        ]


def run_check_names(spec: TableSpec) -> list[str]:
    """The names of `run_check_specs`: the checks every run of the asset evaluates."""
    return [*run_checks(spec), *(e.name for e in table_expectations(spec))]


def toasted_unknown(
    spark: SparkSession, path: str, spec: TableSpec, version: int | None
) -> dict[str, int]:
    """Live rows of the mirror at `version` whose toasted values are unknown, per column."""
    if version is None:
        return {}
    # The current snapshot is the run's own commit (one writer per table), and Delta has it
    # cached; reading `versionAsOf` would replay the log again.
    mirror = spark.read.format("delta").load(path)
    return dict(unknown_live_rows(mirror, spec))


def evaluate_run_checks(
    *, spark: SparkSession, spec: TableSpec, path: str, result: HourResult
) -> list[dg.AssetCheckResult]:
    """The results of `run_check_specs` for one hour's run, in the same order."""
    policies = spec.checks
    complete = policies.complete_hour
    if spec.refresh_minutes and result.partial:
        # A tier-0 table's refresh is partial by design: the check still fails, so downstream
        # automation (blocking checks passed) waits for the hour's complete run, but as a
        # warning, so that a refresh run does not end as a failed run every few minutes.
        complete = complete.model_copy(update={"severity": "WARN"})
    results = [
        complete_hour_result(result, complete),
        accounting_result(result, policies.accounting),
        continuity_result(result, policies.continuity),
        changes_readable_result(result, policies.changes_readable),
        error_rate_result(result, policies.error_rate),
        freshness_result(
            result,
            policies.freshness,
            mirror_newest=result.mirror_newest,
        ),
        schema_drift_result(result, spec, policies.schema_drift),
    ]
    if spec.toasted_columns:
        results.append(
            toasted_values_result(
                result,
                policies.toasted_values,
                unknown=toasted_unknown(spark, path, spec, result.delta_version),
            )
        )
    if spec.history:
        results.append(history_result(result, policies.history))
    held_back = {}
    if result.audit is not None:
        held_back = {r.check_name: r for r in result.audit.check_results()}
    by_name = {
        o.expectation.name: o.check_result(rows_label="the hour's newest change per key")
        for o in result.expectations
    }
    results += [held_back.get(e.name) or by_name[e.name] for e in table_expectations(spec)]
    return results


def build_retention_check_for(*, spec: TableSpec) -> dg.AssetChecksDefinition:
    """The standalone retention-risk check of `spec`'s mirror, partitioned like it."""
    return build_retention_check(spec=spec, partitions_def=hourly_partitions(spec))


def build_retention_check(
    *, spec: TableSpec, partitions_def: dg.PartitionsDefinition
) -> dg.AssetChecksDefinition:
    """retention_risk for one table: re-runnable on any materialized hour from the UI."""
    policy = spec.checks.retention_risk

    with _partitioned_checks():
        return _retention_check(spec, partitions_def, policy)


def _retention_check(spec: TableSpec, partitions_def, policy) -> dg.AssetChecksDefinition:
    @dg.asset_check(
        asset=dg.AssetKey(spec.name),
        name=RETENTION_RISK,
        description=DESCRIPTIONS[RETENTION_RISK]
        + " Re-run it on an old hour to see whether it is still replayable.",
        partitions_def=partitions_def,
        blocking=policy.blocking,
    )
    def _retention_risk(
        context: dg.AssetCheckExecutionContext,
        kafka: KafkaResource,
        spark: SparkResource,
        lake: LakeResource,
    ) -> dg.AssetCheckResult:
        lake.connect(spark.session)
        _, history = hour_history(spark.session, lake.table_path(spec.name))
        consumer = kafka.consumer()
        try:
            partitions = consumer.partitions_for_topic(spec.topic) or set()
            tps = [TopicPartition(spec.topic, p) for p in sorted(partitions)]
            log_starts = {tp.partition: o for tp, o in consumer.beginning_offsets(tps).items()}
        finally:
            consumer.close()
        retention, now = kafka.topic_retention(spec.topic), datetime.now(UTC)
        results = [
            retention_risk_result(
                hour_key=hour_key,
                recorded_starts=recorded_offsets(history, hour_key, "start"),
                log_starts=log_starts,
                retention=retention,
                now=now,
                policy=policy,
            )
            for hour_key in context.partition_keys
        ]
        if context.has_partition_key:
            return results[0]
        # A range run (a backfill that selected this check): Dagster records one result for
        # the run, not one per hour, so it speaks for every hour of the range.
        failing = [
            (k, r) for k, r in zip(context.partition_keys, results, strict=True) if not r.passed
        ]
        return dg.AssetCheckResult(
            passed=not failing,
            severity=dg.AssetCheckSeverity(policy.severity),
            description="; ".join(f"{k}: {r.description}" for k, r in failing)
            or f"every hour from {context.partition_keys[0]} to {context.partition_keys[-1]} "
            "can still be replayed",
            metadata={"hours": len(results), "hours_at_risk": len(failing)},
        )

    return _retention_risk


class TableChecks:
    """A mirror's checks as its run and its asset call them (`cdc_assets.checking.MirrorChecks`):
    great-expectations for the audit and the validation (pandas on rows in memory, Spark on a
    DataFrame), then the invariants and the expectations' results for each hour."""

    def preload(self) -> None:
        preload()

    def audit(
        self, spark: SparkSession, spec: TableSpec, changes: pa.Table | DataFrame
    ) -> Audit | None:
        return audit_changes(spark, spec, changes)

    def audit_nothing(self, spec: TableSpec) -> Audit | None:
        return audit_no_changes(spec)

    def validate(
        self,
        spark: SparkSession,
        spec: TableSpec,
        path: str,
        version: int | None,
        rows: pa.Table | DataFrame,
        keys: KeyCounts,
        frame: DataFrame | None = None,
    ) -> list[Outcome]:
        return validate_batch(spark, spec, path, version, rows, keys=keys, frame=frame)

    def validate_nothing(self, spec: TableSpec) -> list[Outcome]:
        return validate_nothing(spec)

    def check_specs(
        self, spec: TableSpec, *, partitions_def: dg.PartitionsDefinition
    ) -> list[dg.AssetCheckSpec]:
        return run_check_specs(spec, partitions_def=partitions_def)

    def evaluate(
        self, *, spark: SparkSession, spec: TableSpec, path: str, result: HourResult
    ) -> list[dg.AssetCheckResult]:
        return evaluate_run_checks(spark=spark, spec=spec, path=path, result=result)


MIRROR_CHECKS = TableChecks()
