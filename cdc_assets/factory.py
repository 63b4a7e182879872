"""The asset factory: one hourly-partitioned Delta mirror asset per table spec."""

import dagster as dg
from pydantic import Field

from cdc_assets.config import TableSpec
from cdc_assets.hour_run import HourResult, run_hour
from checks.table_checks import build_retention_check, evaluate_run_checks, run_check_specs
from resources.kafka import KafkaResource
from resources.lake import LakeResource
from resources.spark import SparkResource


class HourRunConfig(dg.Config):
    force_open_hour: bool = Field(
        default=False,
        description=(
            "Slice an hour that has not closed yet. The result is marked partial; run the hour "
            "again after it closes to complete it."
        ),
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


def build_table_asset(*, spec: TableSpec) -> dg.AssetsDefinition:
    """The hourly Delta mirror of `spec.topic`; materializing hour H MERGEs H's Kafka slice."""
    description = (
        f"{spec.description or f'Mirror of the source table behind {spec.topic}.'}\n\n"
        f"Delta mirror of Kafka topic `{spec.topic}` (Debezium change events), key "
        f"{', '.join(spec.primary_key)}. Each hourly partition MERGEs that hour's slice of the "
        "topic: newest change per key, applied only when newer than the stored row; deletes "
        "are kept as rows with _cdc_deleted = true. Bad records go to "
        f"`{spec.error_table_name}`."
    )

    partitions_def = hourly_partitions(spec)

    @dg.asset(
        name=spec.name,
        description=description,
        group_name=spec.group,
        partitions_def=partitions_def,
        check_specs=run_check_specs(spec, partitions_def=partitions_def),
        kinds={"kafka", "spark", "delta"},
        pool=table_pool(spec),
        metadata={
            "kafka_topic": spec.topic,
            "primary_key": ", ".join(spec.primary_key),
            "delete_mode": spec.delete_mode,
            "error_table": spec.error_table_name,
        },
    )
    def _mirror(
        context: dg.AssetExecutionContext,
        config: HourRunConfig,
        kafka: KafkaResource,
        spark: SparkResource,
        lake: LakeResource,
    ) -> dg.MaterializeResult:
        result = run_hour(
            spark=spark.session,
            kafka=kafka,
            lake=lake,
            spec=spec,
            hour_key=context.partition_key,
            force_open_hour=config.force_open_hour,
        )
        counts = result.counts
        context.log.info(
            f"{spec.name} {result.hour_key}: consumed {counts.consumed}, applied "
            f"{counts.applied}, superseded {counts.superseded}, stale {counts.stale}, "
            f"tombstones {counts.tombstones}, errors {counts.errors}; "
            f"Delta version {result.delta_version}"
        )
        if result.partial:
            context.log.warning(
                f"{spec.name} {result.hour_key} was forced while open: the result is partial."
            )
        path = lake.table_path(spec.name)
        return dg.MaterializeResult(
            metadata=result_metadata(result, table_path=path),
            check_results=evaluate_run_checks(
                spark=spark.session, spec=spec, path=path, result=result
            ),
        )

    return _mirror


def build_retention_check_for(*, spec: TableSpec) -> dg.AssetChecksDefinition:
    """The standalone retention-risk check of `spec`'s mirror, partitioned like it."""
    return build_retention_check(spec=spec, partitions_def=hourly_partitions(spec))
