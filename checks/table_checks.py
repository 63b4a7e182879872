"""Every check of one mirror table, assembled: its specs, its evaluation after a run, and the
standalone retention-risk check. Checks are partitioned like their asset, so the UI shows each
hour's results."""

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime

import dagster as dg
from kafka import TopicPartition
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from cdc_assets.config import TableSpec
from cdc_assets.decode import SOURCE_TS
from cdc_assets.hour_run import HourResult, recorded_offsets
from cdc_assets.merge import hour_history
from checks.expectations import expectation_check_specs, table_expectations, validate_written
from checks.invariants import (
    DESCRIPTIONS,
    RETENTION_RISK,
    accounting_result,
    complete_hour_result,
    continuity_result,
    error_rate_result,
    freshness_result,
    invariant_check_specs,
    retention_risk_result,
    schema_drift_result,
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


def mirror_newest_source_ts(spark: SparkSession, path: str, version: int | None) -> datetime | None:
    """The newest source timestamp among the mirror's rows at `version`."""
    if version is None:
        return None
    newest = (
        spark.read.format("delta")
        .option("versionAsOf", version)
        .load(path)
        .agg(F.unix_micros(F.max(SOURCE_TS)).alias("newest"))
        .first()["newest"]
    )
    return None if newest is None else datetime.fromtimestamp(newest / 1e6, UTC)


def evaluate_run_checks(
    *, spark: SparkSession, spec: TableSpec, path: str, result: HourResult
) -> list[dg.AssetCheckResult]:
    """The results of `run_check_specs` for one hour's run, in the same order."""
    policies = spec.checks
    results = [
        complete_hour_result(result, policies.complete_hour),
        accounting_result(result, policies.accounting),
        continuity_result(result, policies.continuity),
        error_rate_result(result, policies.error_rate),
        freshness_result(
            result,
            policies.freshness,
            mirror_newest=mirror_newest_source_ts(spark, path, result.delta_version),
        ),
        schema_drift_result(result, spec, policies.schema_drift),
    ]
    held_back = {}
    if result.audit is not None:
        held_back = {r.check_name: r for r in result.audit.check_results()}
    written = validate_written(spark, spec, path, result.merge_version)
    by_name = {
        o.expectation.name: o.check_result(rows_label="rows the hour wrote") for o in written
    }
    results += [held_back.get(e.name) or by_name[e.name] for e in table_expectations(spec)]
    return results


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
        hour_key = context.partition_key
        _, history = hour_history(spark.session, lake.table_path(spec.name))
        consumer = kafka.consumer()
        try:
            partitions = consumer.partitions_for_topic(spec.topic) or set()
            tps = [TopicPartition(spec.topic, p) for p in sorted(partitions)]
            log_starts = {tp.partition: o for tp, o in consumer.beginning_offsets(tps).items()}
        finally:
            consumer.close()
        return retention_risk_result(
            hour_key=hour_key,
            recorded_starts=recorded_offsets(history, hour_key, "start"),
            log_starts=log_starts,
            retention=kafka.topic_retention(spec.topic),
            now=datetime.now(UTC),
            policy=policy,
        )

    return _retention_risk
