"""What a mirror run reports to Dagster: each hour's materialization metadata and check results.

One hour's run yields one `MaterializeResult` with its checks. A range (a backfill, the sensor
catching up) yields each hour's metadata under its own partition and each check result as an
evaluation of that hour's materialization, so a range reports exactly what its hours run one
by one would. The in-process runner and the Pipes runner (`emr.assets`) both report here.
"""

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import dagster as dg

# Dagster records a check result against one partition only through this event; a range run
# (a backfill) has no public way to name the hour a result belongs to.
from dagster._core.definitions.asset_checks.asset_check_evaluation import (
    AssetCheckEvaluationTargetMaterializationData,
)

from cdc_assets.config import TableSpec
from cdc_assets.results import HourResult


def result_metadata(result: HourResult, *, table_path: str) -> dict[str, dg.MetadataValue]:
    """What a person reads in the UI for one hour; numbers are typed so the UI plots them."""
    counts = result.counts
    offsets = {
        str(p.partition): {"start": p.start, "end": p.end, "records": p.size}
        for p in result.slice.partitions
    }
    metadata: dict[str, dg.MetadataValue] = {
        "kafka_topic": dg.MetadataValue.text(result.slice.topic),
        "kafka_offsets": dg.MetadataValue.json(offsets),
        "slice_records": dg.MetadataValue.int(result.slice.size),
        "consumed": dg.MetadataValue.int(counts.consumed),
        "applied": dg.MetadataValue.int(counts.applied),
        "superseded": dg.MetadataValue.int(counts.superseded),
        "stale": dg.MetadataValue.int(counts.stale),
        "tombstones": dg.MetadataValue.int(counts.tombstones),
        "errors": dg.MetadataValue.int(counts.errors),
        "error_reasons": dg.MetadataValue.json(result.error_reasons),
        "rows_inserted": dg.MetadataValue.int(result.rows_inserted),
        "rows_updated": dg.MetadataValue.int(result.rows_updated),
        "rows_deleted": dg.MetadataValue.int(result.rows_deleted),
        # Where the three were counted: the commit's change data, or the MERGE's metrics.
        "rows_counted_from": dg.MetadataValue.text(result.rows_counted_from),
        "delta_version": dg.MetadataValue.int(result.delta_version),
        "delta_path": dg.MetadataValue.path(table_path),
        "partial_hour": dg.MetadataValue.bool(result.partial),
    }
    if result.slice.lost:
        metadata["lost_offsets"] = dg.MetadataValue.text(
            "; ".join(r.describe() for r in result.slice.lost)
        )
    if result.refreshed_to is not None:
        # A refresh of this open hour had read up to these offsets: this run read the rest.
        metadata["hour_start_offsets"] = dg.MetadataValue.json(
            {str(p): o for p, o in result.hour_start_offsets().items()}
        )
    if result.mirror_newest is not None:
        # The mirror's freshness when the run ended: the age of its newest applied change.
        age = (result.finished_at - result.mirror_newest).total_seconds()
        metadata["freshness_seconds"] = dg.MetadataValue.float(round(age, 3))
    if result.history is not None:
        # The history's versions this hour: new ones, and stored ones rewritten (ended by a
        # newer version, split by a late one, or refilled).
        outcome = result.history.outcome
        metadata["history_versions_opened"] = dg.MetadataValue.int(outcome.opened)
        metadata["history_versions_rewritten"] = dg.MetadataValue.int(outcome.rewritten)
        versions = {"history_delta_version": outcome.version}
        folded = result.history.folded
        if folded is not None:  # tracked columns: the versions above are the changes' table's
            metadata["history_tracked_versions_inserted"] = dg.MetadataValue.int(folded.inserted)
            versions = {
                "history_changes_delta_version": outcome.version,
                "history_delta_version": folded.version,
            }
        for name, version in versions.items():
            if version is not None:
                metadata[name] = dg.MetadataValue.int(version)
    if result.lag_seconds is not None:
        metadata["lag_seconds"] = dg.MetadataValue.float(round(result.lag_seconds, 3))
        metadata["newest_source_ts"] = dg.MetadataValue.timestamp(result.newest_source_ts)
    return metadata


@dataclass(frozen=True)
class HourReport:
    """What one hour of a run reports: its materialization metadata and its check results."""

    hour_key: str
    metadata: Mapping[str, dg.MetadataValue]
    checks: list[dg.AssetCheckResult]


def report_hours(
    context: dg.AssetExecutionContext,
    spec: TableSpec,
    check_specs: list[dg.AssetCheckSpec],
    reports: list[HourReport],
) -> Iterator:
    """The events of a run that materialized `reports`' hours of `spec`, one or a range."""
    key = dg.AssetKey(spec.name)
    if context.has_partition_key:
        (report,) = reports
        checks = [_for_asset(check, key) for check in report.checks]
        yield dg.MaterializeResult(asset_key=key, metadata=report.metadata, check_results=checks)
        return
    # A range: each hour's materialization carries that hour's metadata, and each check
    # result is recorded against its hour once the materializations exist.
    for report in reports:
        context.add_asset_metadata(report.metadata, asset_key=key, partition_key=report.hour_key)
    yield dg.MaterializeResult(asset_key=key)
    yield from _check_outputs(context, check_specs, key)
    yield from _hour_checks(context, spec, check_specs, reports)


def report_done_hours(
    context: dg.AssetExecutionContext,
    spec: TableSpec,
    check_specs: list[dg.AssetCheckSpec],
    reports: list[HourReport],
) -> Iterator:
    """The hours a table committed before one of the run's range failed: each recorded as its
    own partition's materialization, with its checks (the failed hours are not)."""
    key = dg.AssetKey(spec.name)
    for report in reports:
        yield dg.AssetMaterialization(
            asset_key=key, partition=report.hour_key, metadata=report.metadata
        )
    yield from _hour_checks(context, spec, check_specs, reports)


def _check_outputs(
    context: dg.AssetExecutionContext, check_specs: list[dg.AssetCheckSpec], key: dg.AssetKey
) -> Iterator:
    selected = context.selected_asset_check_keys
    for check_spec in check_specs:
        if check_spec.asset_key == key and check_spec.key in selected:
            # The check's output, once for the run; its results follow, one per hour.
            yield dg.Output(None, output_name=check_spec.get_python_identifier())


def _hour_checks(
    context: dg.AssetExecutionContext,
    spec: TableSpec,
    check_specs: list[dg.AssetCheckSpec],
    reports: list[HourReport],
) -> Iterator:
    key = dg.AssetKey(spec.name)
    selected = context.selected_asset_check_keys
    blocking = {check.name: check.blocking for check in check_specs if check.asset_key == key}
    for report in reports:
        # The hour's materialization its checks judged (the one this run just recorded).
        target = _materialization(context, key, report.hour_key)
        for check in report.checks:
            if dg.AssetCheckKey(key, check.check_name) not in selected:
                continue
            yield hour_check_evaluation(
                check,
                key=key,
                hour_key=report.hour_key,
                target=target,
                blocking=blocking[check.check_name],
            )


def _materialization(
    context: dg.AssetExecutionContext, key: dg.AssetKey, hour_key: str
) -> AssetCheckEvaluationTargetMaterializationData | None:
    """The newest materialization of the asset's hour, as a check evaluation names it."""
    records = context.instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=key, asset_partitions=[hour_key]), limit=1
    ).records
    if not records:
        return None
    return AssetCheckEvaluationTargetMaterializationData(
        storage_id=records[0].storage_id,
        run_id=records[0].run_id,
        timestamp=records[0].timestamp,
    )


def hour_check_evaluation(
    check: dg.AssetCheckResult,
    *,
    key: dg.AssetKey,
    hour_key: str,
    target: AssetCheckEvaluationTargetMaterializationData | None,
    blocking: bool,
) -> dg.AssetCheckEvaluation:
    """`check` as the result of hour `hour_key`, for a run that materialized a range of hours.

    It names the hour's materialization it judged (`target`), so Dagster counts it as current:
    the UI shows it under that hour, and the downstream assets' `all_deps_blocking_checks_passed`
    sees it.
    """
    return dg.AssetCheckEvaluation(
        asset_key=key,
        check_name=check.check_name,
        passed=check.passed,
        metadata=check.metadata,
        target_materialization_data=target,
        severity=check.severity,
        description=check.description,
        blocking=blocking,
        partition=hour_key,
    )


def _for_asset(check: dg.AssetCheckResult, key: dg.AssetKey) -> dg.AssetCheckResult:
    return dg.AssetCheckResult(
        asset_key=key,
        check_name=check.check_name,
        passed=check.passed,
        severity=check.severity,
        description=check.description,
        metadata=check.metadata,
    )


def hour_summary(spec: TableSpec, result: HourResult) -> str:
    """The log line of one materialized hour."""
    counts = result.counts
    return (
        f"{spec.name} {result.hour_key}: consumed {counts.consumed}, applied "
        f"{counts.applied}, superseded {counts.superseded}, stale {counts.stale}, "
        f"tombstones {counts.tombstones}, errors {counts.errors}; "
        f"Delta version {result.delta_version}"
    )


def partial_warning(spec: TableSpec, result: HourResult) -> str:
    if spec.refresh_minutes:
        return (
            f"{spec.name} {result.hour_key} refreshed while open: the result is partial until "
            "the run after the hour closes."
        )
    return f"{spec.name} {result.hour_key} was forced while open: the result is partial."
