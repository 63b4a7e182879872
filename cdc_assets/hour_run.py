"""One partition run: slice → read → decode → newest per key → errors → MERGE → counts.

Kept free of Dagster so that the same function serves the asset, tests and benchmarks; the
asset turns its `HourResult` into materialization metadata.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from pyspark import StorageLevel
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from cdc_assets import toast
from cdc_assets.config import TableSpec
from cdc_assets.decode import (
    ERROR,
    KAFKA_OFFSET,
    KAFKA_PARTITION,
    OP,
    SEQUENCE,
    SHAPE,
    SOURCE_TS,
    TOMBSTONE,
    TRUNCATE,
    SourceShape,
    added_column_types,
    decode,
)
from cdc_assets.masking import check_stored_mirror, mask_changes, stored_spec
from cdc_assets.merge import (
    added_columns,
    current_version,
    delta_log,
    hour_history,
    latest_per_key,
    merge_changes,
    mirror_newest_ms,
    mirror_schema,
    record_run,
    write_errors,
)
from cdc_assets.read import read_slice
from cdc_assets.slicing import DataLossError, HourSlice, OpenHourError, compute_slice
from checks.expectations import Audit, audit_changes, audit_no_changes
from resources.kafka import KafkaResource
from resources.lake import LakeResource
from resources.masking import HmacKey

HOUR_KEY_FORMAT = "%Y-%m-%d-%H:%M"


@dataclass(frozen=True)
class HourCounts:
    """I2: consumed = applied + superseded + stale + tombstones + errors (checks/invariants)."""

    consumed: int
    applied: int
    superseded: int
    stale: int
    tombstones: int
    errors: int


@dataclass(frozen=True)
class HourResult:
    table: str
    hour_key: str
    slice: HourSlice
    counts: HourCounts
    rows_inserted: int
    rows_updated: int
    rows_deleted: int
    delta_version: int | None
    partial: bool
    newest_source_ts: datetime | None
    finished_at: datetime
    error_reasons: dict[str, int] = field(default_factory=dict)
    # The MERGE commit that wrote this hour's changes; None when nothing was newer.
    merge_version: int | None = None
    # The previous hour's recorded end offsets when this hour ran; None: no run on record.
    previous_end: dict[int, int] | None = None
    # What the hour's records told of the source's columns (encodings, mismatches, new ones).
    source_fields: SourceShape = field(default_factory=SourceShape)
    # The hard expectations' verdict; None when the table declares none.
    audit: Audit | None = None
    # The newest source timestamp among the changes the mirror has taken, this run's included
    # (recorded in each run's commit as a running maximum, so no run scans the table for it).
    mirror_newest: datetime | None = None

    @property
    def lag_seconds(self) -> float | None:
        if self.newest_source_ts is None:
            return None
        return (self.finished_at - self.newest_source_ts).total_seconds()


def hour_start(hour_key: str) -> datetime:
    return datetime.strptime(hour_key, HOUR_KEY_FORMAT).replace(tzinfo=UTC)


def previous_key(hour_key: str) -> str:
    return (hour_start(hour_key) - timedelta(hours=1)).strftime(HOUR_KEY_FORMAT)


def recorded_offsets(history: list[dict], hour_key: str, edge: str) -> dict[int, int] | None:
    """The newest recorded run's `edge` ("start"/"end") offsets of an hour, or None."""
    for commit in history:  # newest first
        if commit.get("hour") == hour_key:
            parts = commit["slice"]["partitions"]
            return {int(p): offsets[edge] for p, offsets in parts.items()}
    return None


def known_starts(
    history: list[dict], hour_key: str, previous_end: dict[int, int] | None
) -> dict[int, int]:
    """Where the hour begins by the log of earlier runs, per partition.

    The newest recorded end of the hour before wins (consecutive slices must share it); else
    this hour's own last recorded start; else nothing is known.
    """
    if previous_end is not None:
        return previous_end
    return recorded_offsets(history, hour_key, "start") or {}


MIRROR_NEWEST = "mirror_newest_ms"


def recorded_mirror_newest(
    spark: SparkSession, path: str, history: list[dict], version: int | None
) -> int | None:
    """The mirror's newest source timestamp (ms) as the newest run recorded it; a table whose
    runs predate the record is read once (the next commit records it)."""
    if version is None:
        return None
    if history and MIRROR_NEWEST in history[0]:
        return history[0][MIRROR_NEWEST]
    return mirror_newest_ms(spark, path, version)


def _newer(a: int | None, b: int | None) -> int | None:
    return max((v for v in (a, b) if v is not None), default=None)


def _from_ms(ms: int | None) -> datetime | None:
    return None if ms is None else datetime.fromtimestamp(ms / 1000, UTC)


class TruncateError(RuntimeError):
    """A truncate event in an hour of a table configured with on_truncate: fail."""


def truncate_watermark(history: list[dict], hour_truncate: list | None) -> list | None:
    """The newest truncate's sequence among the recorded runs and this hour, or None."""
    found = [c["truncated_before"] for c in history if c.get("truncated_before") is not None]
    if hour_truncate is not None:
        found.append(hour_truncate)
    return list(max(tuple(v) for v in found)) if found else None


def sequence_value(sequence_type: T.StructType, values: list) -> Column:
    """A literal of the `_cdc_sequence` struct, comparable with the column."""
    fields = zip(sequence_type.fields, values, strict=True)
    return F.struct(*[F.lit(v).cast(f.dataType).alias(f.name) for f, v in fields])


class SequenceConfigError(RuntimeError):
    """Every change of an hour lacks the table's sequence: the config, not the data, is wrong."""


def _fail_on_sequence_mismatch(spec: TableSpec, hour_key: str, reasons: dict, totals) -> None:
    changes = totals["consumed"] - totals["tombstones"]
    (only_reason, count), *others = reasons.items()
    if changes and not others and only_reason.startswith("sequence field") and count == changes:
        fields = ", ".join(f"{part.field} ({part.type})" for part in spec.sequence)
        raise SequenceConfigError(
            f"table '{spec.name}', hour {hour_key}: none of the {changes} change events has the "
            f"configured sequence [{fields}]. Fix the table's 'sequence' setting to name fields "
            "the connector sends: Postgres [{field: source.lsn, type: bigint}], MySQL "
            "[{field: source.file, type: string}, {field: source.pos, type: bigint}, "
            "{field: source.row, type: bigint}]. Nothing was written."
        )


def run_hour(
    *,
    spark: SparkSession,
    kafka: KafkaResource,
    lake: LakeResource,
    spec: TableSpec,
    hour_key: str,
    now: datetime | None = None,
    force_open_hour: bool = False,
    masking_key: HmacKey | None = None,
) -> HourResult:
    """Materializes one hour of `spec` into its Delta mirror and returns what happened."""
    now = now or datetime.now(UTC)
    lake.connect(spark)
    path = lake.table_path(spec.name)
    ledger = delta_log(path, lake.s3_client())  # the table's commits, read without Spark
    last_version, history = hour_history(spark, path, ledger)
    previous_end = recorded_offsets(history, previous_key(hour_key), "end")
    consumer, uncommitted = kafka.consumer(), kafka.consumer(committed=False)
    try:
        hour_slice = compute_slice(
            consumer,
            table=spec.name,
            topic=spec.topic,
            hour_start=hour_start(hour_key),
            now=now,
            allowed_lateness=timedelta(minutes=spec.allowed_lateness_minutes),
            known_starts=known_starts(history, hour_key, previous_end),
            uncommitted=uncommitted,
        )
    finally:
        consumer.close()
        uncommitted.close()

    if not hour_slice.closed and not force_open_hour:
        raise OpenHourError(
            f"table '{spec.name}': hour {hour_key} is still open: {hour_slice.open_reason}. "
            "It runs once it closes. To read what has arrived so far, run it with the config "
            "force_open_hour: true; the result is marked partial and a later run completes it."
        )
    if hour_slice.lost and not spec.accept_data_loss:
        lost = "; ".join(r.describe() for r in hour_slice.lost)
        raise DataLossError(
            f"table '{spec.name}', topic '{spec.topic}', hour {hour_key}: Kafka no longer holds "
            f"offsets this hour needs, retention deleted them: {lost}. The mirror would miss "
            "those changes. Re-snapshot the table from the source, or set accept_data_loss: true "
            "for this table to materialize what is left and report the loss."
        )

    prior_newest = recorded_mirror_newest(spark, path, history, last_version)
    if hour_slice.size == 0 and last_version is not None:
        return _empty_hour(
            spark, spec, path, ledger, hour_key, hour_slice, previous_end, prior_newest
        )

    stored_schema = mirror_schema(spark, path)
    check_stored_mirror(stored_schema, path, spec)  # no raw sensitive values beside masked ones
    ingested_at = datetime.now(UTC)
    records = read_slice(spark, kafka.spark_options(), hour_slice)

    def decoded_with(added: dict[str, str]) -> DataFrame:
        # Sensitive columns are masked before anything reads them (cdc_assets/masking.py).
        frame = decode(records, spec, hour_key=hour_key, added_columns=added)
        return mask_changes(frame, spec, masking_key).persist(StorageLevel.MEMORY_AND_DISK)

    # Columns the mirror gained earlier, then any the hour's rows bring (decoded again for them:
    # only the hour a column first appears pays that second read).
    added = added_columns(stored_schema, spec)  # `ignore` stops new ones, not these
    decoded = decoded_with(added)
    source_fields = SourceShape.combine(
        row[SHAPE] for row in decoded.where(F.col(SHAPE).isNotNull()).select(SHAPE).collect()
    )
    new = added_column_types(source_fields, [*spec.columns, *added])
    if spec.new_columns == "add" and new:
        decoded.unpersist()
        added |= new
        decoded = decoded_with(added)
    # From here on `spec` describes the mirror: hashed columns are strings, dropped ones gone,
    # added ones there.
    stored = stored_spec(spec)
    spec = stored.model_copy(update={"columns": {**stored.columns, **added}})
    audited = None
    try:
        # Changes to rows: not errors, tombstones or truncates.
        applicable = F.col(ERROR).isNull() & ~F.col(TOMBSTONE) & (F.col(OP) != TRUNCATE)
        # Audit: hard expectations hold failing changes back, into the error table.
        audit = audit_changes(spark, spec, decoded.where(applicable))
        if audit is not None and audit.failed is not None:
            audited = (
                decoded.join(F.broadcast(audit.failed), [KAFKA_PARTITION, KAFKA_OFFSET], "left")
                .withColumn(ERROR, F.coalesce(F.col(ERROR), F.col("_cdc_expectation")))
                .drop("_cdc_expectation")
                .persist(StorageLevel.MEMORY_AND_DISK)
            )
            decoded, audited = audited, decoded
        good = decoded.where(applicable)
        is_truncate = F.col(ERROR).isNull() & (F.col(OP) == TRUNCATE)
        totals = decoded.agg(
            F.count("*").alias("consumed"),
            F.count_if(F.col(TOMBSTONE)).alias("tombstones"),
            F.count_if(F.col(ERROR).isNotNull()).alias("errors"),
            F.count_if(is_truncate).alias("truncates"),
            F.max(F.when(is_truncate, F.col(SEQUENCE))).alias("truncate_sequence"),
            F.min(F.when(is_truncate, F.struct(KAFKA_PARTITION, KAFKA_OFFSET))).alias("first_t"),
            F.unix_millis(F.max(F.when(F.col(ERROR).isNull(), F.col(SOURCE_TS)))).alias("newest"),
            # The range of the keys the MERGE applies: its pruning predicate (merge_changes).
            *[F.min(F.when(applicable, F.col(k))).alias(f"_low_{k}") for k in spec.primary_key],
            *[F.max(F.when(applicable, F.col(k))).alias(f"_high_{k}") for k in spec.primary_key],
        ).first()
        if totals["truncates"] and spec.on_truncate == "fail":
            at = totals["first_t"]
            raise TruncateError(
                f"table '{spec.name}', topic '{spec.topic}', hour {hour_key}: partition "
                f"{at[KAFKA_PARTITION]} offset {at[KAFKA_OFFSET]} is a truncate of the source "
                f"table (op 't'; {totals['truncates']} in the hour). on_truncate is 'fail', so "
                "nothing of this hour was written. Set on_truncate: apply for the table to "
                "delete every row older than the truncate and run the hour again, or "
                "re-snapshot the table."
            )
        hour_truncate = list(totals["truncate_sequence"]) if totals["truncates"] else None
        watermark = truncate_watermark(history, hour_truncate)
        older_than_truncate = 0
        if watermark is not None:
            # A change older than a truncate is gone from the source, whenever its hour runs.
            bound = sequence_value(decoded.schema[SEQUENCE].dataType, watermark)
            older_than_truncate = good.where(F.col(SEQUENCE) < bound).count()
            good = good.where(F.col(SEQUENCE) > bound)
        reasons = {}
        if totals["errors"]:
            reasons = {
                row[ERROR]: row["n"]
                for row in decoded.where(F.col(ERROR).isNotNull())
                .groupBy(ERROR)
                .agg(F.count("*").alias("n"))
                .collect()
            }
            _fail_on_sequence_mismatch(spec, hour_key, reasons, totals)
            write_errors(
                spark,
                spec.error_table_name,
                lake.table_path(spec.error_table_name),
                decoded.where(F.col(ERROR).isNotNull()),
                hour_key=hour_key,
                ingested_at=ingested_at,
            )
        commit = {
            "hour": hour_key,
            "slice": hour_slice.as_dict(),
            "partial": not hour_slice.closed,
            "consumed": totals["consumed"],
            "tombstones": totals["tombstones"],
            "errors": totals["errors"],
            "pipeline": "cdc-lake",
            MIRROR_NEWEST: _newer(prior_newest, totals["newest"]),
        }
        if hour_truncate is not None:
            commit["truncated_before"] = hour_truncate
        outcome = merge_changes(
            spark,
            spec,
            path,
            latest_per_key(good, spec),
            ingested_at=ingested_at,
            run_metadata=commit,
            truncate_before=(
                None
                if hour_truncate is None
                else sequence_value(decoded.schema[SEQUENCE].dataType, hour_truncate)
            ),
            key_range={
                k: (totals[f"_low_{k}"], totals[f"_high_{k}"])
                for k in spec.primary_key
                if totals[f"_low_{k}"] is not None
            },
            ledger=ledger,
        )
        version = outcome.version if outcome.version is not None else last_version
        # Unchanged TOASTed values of rows that moved (primary-key updates), from their old keys.
        if toast.resolve_moves(spark, spec, path):
            version = current_version(spark, path, ledger)
    finally:
        decoded.unpersist()
        if audited is not None:
            audited.unpersist()

    # Truncate records count as applied; changes older than a truncate as stale.
    n_changes = totals["consumed"] - totals["tombstones"] - totals["errors"] - totals["truncates"]
    keys_applied = outcome.applied - outcome.truncated
    newest = totals["newest"]
    return HourResult(
        table=spec.name,
        hour_key=hour_key,
        slice=hour_slice,
        counts=HourCounts(
            consumed=totals["consumed"],
            applied=keys_applied + totals["truncates"],
            superseded=n_changes - older_than_truncate - outcome.merged_keys,
            stale=outcome.merged_keys - keys_applied + older_than_truncate,
            tombstones=totals["tombstones"],
            errors=totals["errors"],
        ),
        rows_inserted=outcome.rows_inserted,
        rows_updated=outcome.rows_updated,
        rows_deleted=outcome.rows_deleted,
        delta_version=version,
        partial=not hour_slice.closed,
        newest_source_ts=datetime.fromtimestamp(newest / 1000, UTC) if newest else None,
        finished_at=datetime.now(UTC),
        error_reasons=reasons,
        merge_version=outcome.version,
        previous_end=previous_end,
        source_fields=source_fields,
        audit=audit,
        mirror_newest=_from_ms(commit[MIRROR_NEWEST]),
    )


def _empty_hour(
    spark: SparkSession,
    spec: TableSpec,
    path: str,
    ledger,
    hour_key: str,
    hour_slice: HourSlice,
    previous_end: dict[int, int] | None,
    prior_newest: int | None,
) -> HourResult:
    """An hour with no record: nothing is read, decoded or merged. Its slice is recorded in a
    metadata-only commit, as every run's is, so the next hour starts where it ended."""
    commit = {
        "hour": hour_key,
        "slice": hour_slice.as_dict(),
        "partial": not hour_slice.closed,
        "consumed": 0,
        "tombstones": 0,
        "errors": 0,
        "pipeline": "cdc-lake",
        MIRROR_NEWEST: prior_newest,
    }
    version = record_run(spark, spec, path, commit, ledger)
    return HourResult(
        table=spec.name,
        hour_key=hour_key,
        slice=hour_slice,
        counts=HourCounts(0, 0, 0, 0, 0, 0),
        rows_inserted=0,
        rows_updated=0,
        rows_deleted=0,
        delta_version=version,
        partial=not hour_slice.closed,
        newest_source_ts=None,
        finished_at=datetime.now(UTC),
        previous_end=previous_end,
        audit=audit_no_changes(spec),
        mirror_newest=_from_ms(prior_newest),
    )
