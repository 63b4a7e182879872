"""The asset factory: one hourly-partitioned Delta mirror asset per table spec.

A run materializes one hour, or a range of hours (a backfill, or the offset sensor catching
up), hour after hour in one process and one Spark session: each hour is still its own slice,
its own MERGE commit, its own metadata and its own check results, so a range gives exactly
what running its hours one by one gives.
"""

import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import dagster as dg
from pydantic import Field

from cdc_assets.config import TableSpec
from cdc_assets.hour_run import HourResult, SequenceConfigError, TruncateError, run_hour
from cdc_assets.masking import MaskedMirrorError, hashed_columns
from cdc_assets.slicing import SliceError
from checks.expectations import preload as preload_expectations
from checks.table_checks import (
    build_retention_check,
    evaluate_run_checks,
    hour_check_evaluation,
    run_check_specs,
)
from resources.kafka import KafkaResource
from resources.lake import LakeConfigError, LakeResource
from resources.masking import HmacKey, MaskingKeyError
from resources.spark import SparkResource


class HourRunConfig(dg.Config):
    force_open_hour: bool = Field(
        default=False,
        description=(
            "Slice an hour that has not closed yet. The result is marked partial; run the hour "
            "again after it closes to complete it."
        ),
    )


# A wrong slice or config: retrying can't help (the hour is open, its offsets are gone, the
# config is wrong), so a run failing with one of these is not retried.
NOT_RETRIED: tuple[type[Exception], ...] = (
    SliceError,
    SequenceConfigError,
    TruncateError,
    MaskedMirrorError,
    LakeConfigError,
)


def table_pool(spec: TableSpec) -> str:
    """One pool per table: at most one run merges into a Delta table at a time."""
    return f"cdc_table_{spec.name}"


def hourly_partitions(spec: TableSpec) -> dg.HourlyPartitionsDefinition:
    # end_offset=1: the current, still open hour exists as a partition so that a person can
    # force it (force_open_hour); run without forcing, it is refused with the reason.
    return dg.HourlyPartitionsDefinition(start_date=spec.start_hour, timezone="UTC", end_offset=1)


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
        "delta_version": dg.MetadataValue.int(result.delta_version),
        "delta_path": dg.MetadataValue.path(table_path),
        "partial_hour": dg.MetadataValue.bool(result.partial),
    }
    if result.slice.lost:
        metadata["lost_offsets"] = dg.MetadataValue.text(
            "; ".join(r.describe() for r in result.slice.lost)
        )
    if result.lag_seconds is not None:
        metadata["lag_seconds"] = dg.MetadataValue.float(round(result.lag_seconds, 3))
        metadata["newest_source_ts"] = dg.MetadataValue.timestamp(result.newest_source_ts)
    return metadata


def asset_description(spec: TableSpec) -> str:
    """The mirror asset's description, as the UI shows it."""
    description = (
        f"{spec.description or f'Mirror of the source table behind {spec.topic}.'}\n\n"
        f"Delta mirror of Kafka topic `{spec.topic}` (Debezium change events), key "
        f"{', '.join(spec.primary_key)}. Each hourly partition MERGEs that hour's slice of the "
        "topic: newest change per key, applied only when newer than the stored row; deletes "
        "are kept as rows with _cdc_deleted = true. Bad records go to "
        f"`{spec.error_table_name}`."
    )
    if spec.sensitive:
        masked = ", ".join(f"{column} ({mode})" for column, mode in spec.sensitive.items())
        description += (
            f" Sensitive columns are masked before anything stores them: {masked}; hashed "
            "columns hold HMAC-SHA256 hex strings."
        )
    return description


def mirror_asset(
    spec: TableSpec,
    compute: Callable,
    *,
    check_specs: list[dg.AssetCheckSpec],
    required_resource_keys: set[str],
    description: str,
) -> dg.AssetsDefinition:
    """`compute` as `spec`'s mirror asset: key, partitions, pool, checks, retries, metadata.

    Shared by the in-process asset (`build_table_asset`) and the one whose hours run outside
    Dagster through Pipes (`cdc_assets.pipes.build_pipes_table_asset`), so both are the same
    asset to Dagster.
    """
    with warnings.catch_warnings():
        # BackfillPolicy is a beta API; dagster is pinned, so the warning says nothing new.
        warnings.filterwarnings("ignore", category=dg.BetaWarning, message=".*backfill_policy")
        return dg.asset(
            name=spec.name,
            description=description,
            group_name=spec.group,
            partitions_def=hourly_partitions(spec),
            check_specs=check_specs,
            kinds={"kafka", "spark", "delta"},
            pool=table_pool(spec),
            # A backfill runs as few runs as possible, each over a bounded range of hours.
            backfill_policy=dg.BackfillPolicy.multi_run(max_partitions_per_run=spec.hours_per_run),
            # Transient failures (a broker or Spark hiccup) are retried; a wrong slice or config
            # is raised as a Failure that is not (see `hour_failure`).
            retry_policy=dg.RetryPolicy(
                max_retries=2, delay=20, backoff=dg.Backoff.EXPONENTIAL, jitter=dg.Jitter.PLUS_MINUS
            ),
            metadata={
                "kafka_topic": spec.topic,
                "primary_key": ", ".join(spec.primary_key),
                "delete_mode": spec.delete_mode,
                "error_table": spec.error_table_name,
                # Names and modes only: what is masked, never a value.
                **({"sensitive_columns": dict(spec.sensitive)} if spec.sensitive else {}),
            },
            required_resource_keys=required_resource_keys,
        )(compute)


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
    """The events of a run that materialized `reports`' hours, one or a range."""
    if context.has_partition_key:
        (report,) = reports
        yield dg.MaterializeResult(metadata=report.metadata, check_results=report.checks)
        return
    # A range: each hour's materialization carries that hour's metadata, and each check
    # result is recorded against its hour once the materializations exist.
    for report in reports:
        context.add_asset_metadata(report.metadata, partition_key=report.hour_key)
    yield dg.MaterializeResult()
    selected = context.selected_asset_check_keys
    for check_spec in check_specs:
        if check_spec.key in selected:
            # The check's output, once for the run; its results follow, one per hour.
            yield dg.Output(None, output_name=check_spec.get_python_identifier())
    blocking = {check.name: check.blocking for check in check_specs}
    for report in reports:
        for check in report.checks:
            if dg.AssetCheckKey(dg.AssetKey(spec.name), check.check_name) not in selected:
                continue
            yield hour_check_evaluation(
                context,
                check,
                spec=spec,
                hour_key=report.hour_key,
                blocking=blocking[check.check_name],
            )


def hour_failure(message: str, done: list[str]) -> dg.Failure:
    """The failure of an hour that retrying can't fix; `done`: the run's earlier hours."""
    written = ""
    if done:
        written = (
            f" The run's earlier hours {done[0]} to {done[-1]} are "
            "committed to Delta; running them again finds their changes already applied."
        )
    return dg.Failure(description=f"{message}{written}", allow_retries=False)


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
    return f"{spec.name} {result.hour_key} was forced while open: the result is partial."


def build_table_asset(*, spec: TableSpec) -> dg.AssetsDefinition:
    """The hourly Delta mirror of `spec.topic`; materializing hour H MERGEs H's Kafka slice."""
    check_specs = run_check_specs(spec, partitions_def=hourly_partitions(spec))

    def _mirror(context: dg.AssetExecutionContext, config: HourRunConfig) -> Iterator:
        kafka: KafkaResource = context.resources.kafka
        spark: SparkResource = context.resources.spark
        lake: LakeResource = context.resources.lake
        path = lake.table_path(spec.name)
        masking_key = _masking_key(context, spec)
        preload_expectations()  # while the Spark session starts
        hours: list[tuple[HourResult, list[dg.AssetCheckResult]]] = []
        for hour_key in context.partition_keys:
            result = _hour(
                context, spec, hour_key, config, kafka, spark, lake, masking_key, done=hours
            )
            checks = evaluate_run_checks(spark=spark.session, spec=spec, path=path, result=result)
            hours.append((result, checks))
        reports = [
            HourReport(result.hour_key, result_metadata(result, table_path=path), checks)
            for result, checks in hours
        ]
        yield from report_hours(context, spec, check_specs, reports)

    return mirror_asset(
        spec,
        _mirror,
        check_specs=check_specs,
        description=asset_description(spec),
        # Only a table that hashes needs the key, so the others run without one.
        required_resource_keys={"kafka", "spark", "lake"}
        | ({"masking"} if hashed_columns(spec) else set()),
    )


def _hour(
    context: dg.AssetExecutionContext,
    spec: TableSpec,
    hour_key: str,
    config: HourRunConfig,
    kafka: KafkaResource,
    spark: SparkResource,
    lake: LakeResource,
    masking_key: HmacKey | None,
    *,
    done: list,
) -> HourResult:
    """Runs one hour of the run's range; a wrong slice or config fails without retries."""
    try:
        result = run_hour(
            spark=spark.session,
            kafka=kafka,
            lake=lake,
            spec=spec,
            hour_key=hour_key,
            force_open_hour=config.force_open_hour,
            masking_key=masking_key,
        )
    except NOT_RETRIED as exc:
        # Retrying can't help: the hour is open, its offsets are gone, or the config is wrong.
        raise hour_failure(str(exc), [r.hour_key for r, _ in done]) from exc
    context.log.info(hour_summary(spec, result))
    if result.partial:
        context.log.warning(partial_warning(spec, result))
    return result


def _masking_key(context: dg.AssetExecutionContext, spec: TableSpec) -> HmacKey | None:
    """Checks the table's masking setup before anything is read; a wrong one isn't retried."""
    if not spec.sensitive:
        return None
    try:
        hashed = hashed_columns(spec)
        key = (
            context.resources.masking.hmac_key(table=spec.name, columns=hashed) if hashed else None
        )
    except MaskingKeyError as exc:
        raise dg.Failure(description=str(exc), allow_retries=False) from exc
    return key


def build_retention_check_for(*, spec: TableSpec) -> dg.AssetChecksDefinition:
    """The standalone retention-risk check of `spec`'s mirror, partitioned like it."""
    return build_retention_check(spec=spec, partitions_def=hourly_partitions(spec))
