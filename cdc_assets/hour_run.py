"""One partition run: slice → read → decode → newest per key → errors → MERGE → counts.

Kept free of Dagster so that the same function serves the asset, tests and benchmarks; the
asset turns its `HourResult` into materialization metadata.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import pyarrow as pa
from pyspark import StorageLevel
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from cdc_assets import toast
from cdc_assets.checking import AuditVerdict, KeyCounts, MirrorChecks
from cdc_assets.commits import (
    commit_metadata,
    current_version,
    delta_log,
    hour_history,
    mirror_newest_ms,
    record_run,
)
from cdc_assets.config import TableSpec, typed_default
from cdc_assets.decode import (
    DELETED,
    ERROR,
    KAFKA_OFFSET,
    KAFKA_PARTITION,
    OP,
    SEQUENCE,
    SHAPE,
    SOURCE_TS,
    TALLY,
    TOMBSTONE,
    TRUNCATE,
    SourceShape,
    added_column_types,
    decode,
    decode_locally,
)
from cdc_assets.error_table import write_errors
from cdc_assets.hours import hour_start, previous_key
from cdc_assets.masking import check_stored_mirror, mask_changes, stored_spec
from cdc_assets.merge import added_columns, merge_changes, mirror_schema
from cdc_assets.read import OffsetCensus, count_slice_records, read_slice, read_slice_locally
from cdc_assets.rule import latest_per_key
from cdc_assets.slicing import DataLossError, HourSlice, OpenHourError, compute_slice
from cdc_assets.tally import Tally, key_value
from resources.kafka import KafkaResource
from resources.lake import LakeResource, LakeWriteError, storage_failure
from resources.masking import HmacKey
from resources.spark import session_settings

log = logging.getLogger(__name__)

# Slices up to this many records are read and decoded in the driver (see `run_hour`).
DEFAULT_LOCAL_READ_MAX_RECORDS = 20_000


@dataclass(frozen=True)
class HourCounts:
    """I2: consumed = applied + superseded + stale + tombstones + errors (checks/invariants).

    Each figure is counted where it happens, not derived from the others, so the identity can
    fail: `consumed` by the reader (the records Kafka returned), `tombstones` and `errors` by the
    decoder and the audit, `superseded` on the batch (applicable changes minus the distinct keys
    among them), `applied` and `stale` from the MERGE's own operation metrics (the rows it wrote,
    and its source rows it did not write). `distinct_keys` and `merge_source_rows` are the two
    counts of the hour's keys (the batch's, Delta's): a newest-change-per-key step that lost or
    doubled a key makes them differ, and the identity fail.
    """

    consumed: int
    applied: int
    superseded: int
    stale: int
    tombstones: int
    errors: int
    distinct_keys: int = 0
    merge_source_rows: int = 0
    # Counted by Kafka's own consumers when the reader got fewer records than the slice has
    # offsets (transaction markers, aborted records, compaction); None when it got them all.
    census: OffsetCensus | None = None


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
    audit: AuditVerdict | None = None
    # The other expectations' verdicts, on the hour's newest change per key (`MirrorChecks`).
    expectations: tuple[object, ...] = ()
    # The newest source timestamp among the changes the mirror has taken, this run's included
    # (recorded in each run's commit as a running maximum, so no run scans the table for it).
    mirror_newest: datetime | None = None
    # Undeclared columns `new_columns: add` did not add: the table has sensitive columns.
    withheld_columns: tuple[str, ...] = ()

    @property
    def lag_seconds(self) -> float | None:
        if self.newest_source_ts is None:
            return None
        return (self.finished_at - self.newest_source_ts).total_seconds()


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
# Marks the commit that fills moved rows' TOASTed values, after the run's MERGE (`toast`).
MOVED_ROWS = "moved_rows"


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


def _fail_on_sequence_mismatch(spec: TableSpec, hour_key: str, reasons: dict, tally) -> None:
    changes = tally.records - tally.tombstones
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
    checks: MirrorChecks,
    now: datetime | None = None,
    force_open_hour: bool = False,
    masking_key: HmacKey | None = None,
    local_read_max_records: int = DEFAULT_LOCAL_READ_MAX_RECORDS,
) -> HourResult:
    """Materializes one hour of `spec` into its Delta mirror and returns what happened.

    `checks` audits the hour's changes before the MERGE (the hard expectations' failures go to
    the error table) and validates the newest change per key after it (`cdc_assets.checking`).

    A slice of at most `local_read_max_records` records is read and decoded in this process
    (`read_slice_locally`): no Spark job for the read, and a small hour costs little; a larger
    one is read by Spark's Kafka source and decoded in Spark's Python workers. Both run the
    same decoder, so they give the same rows.
    """
    now = now or datetime.now(UTC)
    lake.connect(spark)
    path = lake.table_path(spec.name)
    with _storage_failures_named(spec, hour_key, path):
        ledger = delta_log(path, lake.s3_client())  # the table's commits, read without Spark
        last_version, history = hour_history(spark, path, ledger)
        previous_end = recorded_offsets(history, previous_key(hour_key), "end")
        starts = known_starts(history, hour_key, previous_end)
        hour_slice = _slice(kafka, spec, hour_key, now, starts, previous_end is not None)
        _refuse_open_or_lost(spec, hour_key, hour_slice, force_open_hour)

        prior_newest = recorded_mirror_newest(spark, path, history, last_version)
        if hour_slice.size == 0 and last_version is not None:
            return _empty_hour(
                spark,
                spec,
                path,
                ledger,
                hour_key,
                hour_slice,
                previous_end,
                prior_newest,
                history[0].get(COLUMN_DEFAULTS, {}) if history else {},
                checks,
            )
        local = hour_slice.size <= local_read_max_records
        with sized_shuffles(spark, hour_slice.size, adaptive=not local):
            return _apply_hour(
                spark=spark,
                kafka=kafka,
                lake=lake,
                spec=spec,
                hour_key=hour_key,
                hour_slice=hour_slice,
                ledger=ledger,
                history=history,
                previous_end=previous_end,
                prior_newest=prior_newest,
                masking_key=masking_key,
                local=local,
                checks=checks,
            )


@contextmanager
def _storage_failures_named(spec: TableSpec, hour_key: str, path: str) -> Iterator[None]:
    """A read or write the lake's storage refused (disk full, S3 throttling) fails the run with
    its cause and fix instead of a Java stack; every other error passes unchanged."""
    try:
        yield
    except Exception as error:
        failure = storage_failure(error)
        if failure is None:
            raise
        cause, fix = failure
        raise LakeWriteError(
            f"table '{spec.name}', hour {hour_key}: {cause} on {path}. A Delta "
            "commit is all or nothing, so the table holds all of the hour or none of it (files "
            f"of an unfinished write are never read; VACUUM removes them). {fix}, then run the "
            "hour again: it applies what is missing."
        ) from error


# An hour's shuffle width: one partition per this many records read (at least 1, at most the
# session's setting), so a small hour's MERGE runs a task per stage, not dozens.
RECORDS_PER_SHUFFLE_PARTITION = 100_000
ADAPTIVE = "spark.sql.adaptive.enabled"


@contextmanager
def sized_shuffles(spark: SparkSession, records: int, *, adaptive: bool = True) -> Iterator[None]:
    """Sets the session's shuffle partitions for an hour of `records` records, then restores
    them (a run's tables each have a session of their own, `cdc_assets.fleet`).

    `adaptive=False` also turns adaptive query execution off: for an hour read in this process
    (a local relation, whose size Spark knows, so the planner broadcasts it without AQE's help)
    and of one shuffle partition, AQE has nothing to coalesce or convert, and its planning again
    at every stage costs a small hour more than it saves (docs/benchmark.md, "Small table-hours",
    has the before and after). Hours Spark reads keep it."""
    key = "spark.sql.shuffle.partitions"
    width = -(-records // RECORDS_PER_SHUFFLE_PARTITION)
    settings = {key: str(max(1, min(int(spark.conf.get(key)), width)))}
    if not adaptive and width <= 1:
        settings[ADAPTIVE] = "false"
    with session_settings(spark, settings):
        yield


def _apply_hour(
    *,
    spark: SparkSession,
    kafka: KafkaResource,
    lake: LakeResource,
    spec: TableSpec,
    hour_key: str,
    hour_slice: HourSlice,
    ledger,
    history: list[dict],
    previous_end: dict[int, int] | None,
    prior_newest: int | None,
    masking_key: HmacKey | None,
    local: bool,
    checks: MirrorChecks,
) -> HourResult:
    """Reads, decodes, audits and MERGEs a non-empty (or first) hour; see `run_hour`."""
    path = lake.table_path(spec.name)
    stored_schema = mirror_schema(spark, path)
    check_stored_mirror(stored_schema, path, spec)  # no raw sensitive values beside masked ones
    ingested_at = datetime.now(UTC)
    records = _read(spark, kafka, hour_slice, local)
    known = history[0].get(COLUMN_DEFAULTS, {}) if history else {}
    seen_before = set(history[0].get(SOURCE_COLUMNS, ())) if history else set()
    batch, added, withheld, connector, defaults = _decode_with_new_columns(
        spark, records, spec, hour_key, added_columns(stored_schema, spec), masking_key, known
    )
    # A slice read here is a local relation: every frame derived from it is cheap to compute
    # again and deterministic, so nothing is cached and the MERGE takes it as it is. A slice
    # Spark read is cached once decoded, and the MERGE materializes its source (Delta's auto).
    keep = (lambda frame: frame) if local else (lambda frame: frame.persist(_CACHED))
    # From here on `spec` describes the mirror: hashed columns are strings, dropped ones gone,
    # added ones there.
    stored = stored_spec(spec)
    spec = stored.model_copy(update={"columns": {**stored.columns, **added}})
    tally, frames = batch.tally, [batch.frame]
    try:
        held = _hold_back(spark, spec, batch, checks, keep)
        decoded = held.decoded
        if decoded is not batch.frame:
            frames.append(decoded)
        if tally.truncates and spec.on_truncate == "fail":
            _fail_on_truncate(spec, hour_key, tally)
        hour_truncate = tally.truncate_sequence if tally.truncates else None
        good, older_than_truncate = _after_truncates(decoded, history, hour_truncate)
        # The hour's keys counted on the batch, apart from the newest-change-per-key step
        # (the MERGE's source) that Delta counts: the accounting compares the two.
        distinct_keys = good.select(*spec.primary_key).distinct().count()
        if held.errors:
            _fail_on_sequence_mismatch(spec, hour_key, held.reasons, tally)
            write_errors(
                spark,
                spec,
                lake.table_path(spec.error_table_name),
                decoded.where(F.col(ERROR).isNotNull()),
                hour_key=hour_key,
                ingested_at=ingested_at,
            )
        commit = _run_record(
            hour_key,
            hour_slice,
            consumed=tally.records,
            tombstones=tally.tombstones,
            errors=held.errors,
            mirror_newest=_newer(prior_newest, held.newest_ms),
            column_defaults=connector,
        )
        commit[SOURCE_COLUMNS] = sorted(seen_before | set(batch.shape.fields))
        if hour_truncate is not None:
            commit["truncated_before"] = hour_truncate
        # The newest change per key: the MERGE's source and what the expectations judge.
        latest = keep(latest_per_key(good, spec))
        frames.append(latest)
        if not local:
            latest.count()  # fills the cache once: the queries below read it twice each
        with merge_source(spark, materialized=not local):
            outcome = merge_changes(
                spark,
                spec,
                path,
                latest,
                ingested_at=ingested_at,
                run_metadata=commit,
                truncate_before=(
                    None
                    if hour_truncate is None
                    else sequence_value(decoded.schema[SEQUENCE].dataType, hour_truncate)
                ),
                key_range=key_range(spec, tally),
                ledger=ledger,
                defaults=fillable_defaults(spec, defaults, stored_schema, seen_before),
            )
        version = outcome.recorded_version
        # Unchanged TOASTed values of rows that moved (primary-key updates), from their old keys:
        # a commit of its own that carries the run's record, marked. A crash before it is
        # repaired by the next run of any hour, which resolves every move still open.
        with commit_metadata(spark, {**commit, MOVED_ROWS: True}):
            if toast.resolve_moves(spark, spec, path):
                version = current_version(spark, path, ledger)
        expectations = checks.validate(
            spark,
            spec,
            path,
            version,
            latest.where(~F.col(DELETED)),
            keys=KeyCounts(keys=outcome.prior.source_rows, duplicates=outcome.duplicate_rows),
        )
    finally:
        for frame in frames:
            frame.unpersist()

    # Counted where each happened (HourCounts): the records by the reader (Spark's read: by the
    # decoder, which takes every row it gives), superseded on the batch, applied and stale by
    # Delta (operationMetrics); truncate records count as applied, changes older than a truncate
    # as stale.
    changes = tally.changes - (held.errors - tally.errors)  # the audit's held-back are errors
    consumed = records.num_rows if local else tally.records
    census = (
        offset_census(kafka, hour_slice, None if local else spark)
        if consumed < hour_slice.size
        else None
    )
    return HourResult(
        table=spec.name,
        hour_key=hour_key,
        slice=hour_slice,
        counts=HourCounts(
            consumed=consumed,
            applied=outcome.applied + tally.truncates,
            superseded=changes - older_than_truncate - distinct_keys,
            stale=outcome.merged_keys - outcome.applied + older_than_truncate,
            tombstones=tally.tombstones,
            errors=held.errors,
            distinct_keys=distinct_keys,
            merge_source_rows=outcome.merged_keys,
            census=census,
        ),
        rows_inserted=outcome.rows_inserted,
        rows_updated=outcome.rows_updated,
        rows_deleted=outcome.rows_deleted,
        delta_version=version,
        partial=not hour_slice.closed,
        newest_source_ts=_from_ms(held.newest_ms),
        finished_at=datetime.now(UTC),
        error_reasons=held.reasons,
        merge_version=outcome.version,
        previous_end=previous_end,
        source_fields=batch.shape,
        audit=held.audit,
        expectations=tuple(expectations),
        mirror_newest=_from_ms(commit[MIRROR_NEWEST]),
        withheld_columns=withheld if spec.new_columns == "add" else (),
    )


def _run_record(
    hour_key: str,
    hour_slice: HourSlice,
    *,
    consumed: int,
    tombstones: int,
    errors: int,
    mirror_newest: int | None,
    column_defaults: dict[str, Any],
) -> dict:
    """What every run's commit records (the ledger, `cdc_assets.commits`): its hour, slice and
    counts, the mirror's newest source time (ms) as a running maximum, and the column defaults
    the connector's schemas declared so far (`column_defaults`)."""
    return {
        "hour": hour_key,
        "slice": hour_slice.as_dict(),
        "partial": not hour_slice.closed,
        "consumed": consumed,
        "tombstones": tombstones,
        "errors": errors,
        "pipeline": "cdc-lake",
        MIRROR_NEWEST: mirror_newest,
        **({COLUMN_DEFAULTS: column_defaults} if column_defaults else {}),
    }


def _after_truncates(
    decoded: DataFrame, history: list[dict], hour_truncate: list | None
) -> tuple[DataFrame, int]:
    """The applicable changes newer than the table's newest truncate (this hour's or an earlier
    one's, recorded in `history`), and how many were older: a change older than a truncate is
    gone from the source, whenever its hour runs."""
    good = decoded.where(applicable())
    watermark = truncate_watermark(history, hour_truncate)
    if watermark is None:
        return good, 0
    bound = sequence_value(decoded.schema[SEQUENCE].dataType, watermark)
    return good.where(F.col(SEQUENCE) > bound), good.where(F.col(SEQUENCE) < bound).count()


def _read(
    spark: SparkSession, kafka: KafkaResource, hour_slice: HourSlice, local: bool
) -> DataFrame | pa.RecordBatch:
    """The slice's records: read in this process when `local`, else by Spark's Kafka source."""
    if not local:
        return read_slice(spark, kafka.spark_options(), hour_slice)
    consumer = kafka.consumer()
    try:
        return read_slice_locally(consumer, hour_slice)
    finally:
        consumer.close()


def _decode_with_new_columns(
    spark: SparkSession,
    records: DataFrame | pa.RecordBatch,
    spec: TableSpec,
    hour_key: str,
    added: dict[str, str],
    masking_key: HmacKey | None,
    known: dict[str, Any],
) -> tuple[DecodedSlice, dict[str, str], tuple[str, ...], dict[str, Any], dict[str, Any]]:
    """The decoded hour, the undeclared columns the mirror takes (`added`: the ones it gained
    earlier, then any the hour's rows bring under `new_columns: add`), the new ones it
    withholds (a table with sensitive columns: they wait for a declaration, masking.py), the
    connector's column defaults known so far (`known`, recorded by earlier runs, then those
    the hour's schemas declare), and the defaults the hour was decoded with (`column_defaults`).

    A column or a default the hour brings is decoded again for it: only the hour it first
    appears pays that second decode. `new_columns: ignore` stops new columns, not the ones
    already added.
    """
    defaults = column_defaults(spec, added, known)
    batch = _decode(spark, records, spec, hour_key, added, masking_key, defaults)
    new = added_column_types(batch.shape, [*spec.columns, *added])
    withheld = tuple(sorted(new)) if spec.sensitive else ()
    # The first one recorded stays. Nothing of a masked column, nor of an undeclared one on a
    # table that masks (it may be sensitive), is recorded.
    found = {
        name: value
        for name, value in batch.shape.source_defaults().items()
        if not spec.sensitive or (name in spec.columns and name not in spec.sensitive)
    }
    connector = {**found, **known}
    wider = {**added, **new} if spec.new_columns == "add" and new and not withheld else added
    again = column_defaults(spec, wider, connector)
    if wider != added or again != defaults:
        batch.frame.unpersist()
        batch = _decode(spark, records, spec, hour_key, wider, masking_key, again)
    return batch, wider, withheld, connector, again


COLUMN_DEFAULTS = "column_defaults"
# The source columns the mirror's runs have seen so far (names), recorded in each run's commit.
SOURCE_COLUMNS = "source_columns"


def fillable_defaults(
    spec: TableSpec,
    defaults: dict[str, Any],
    stored: T.StructType | None,
    seen_before: set[str],
) -> dict[str, Any]:
    """The defaults the mirror's rows from before a column may take when the mirror gains it
    (`merge.fill_defaults`): not of a column earlier runs saw the source send while the mirror
    left it out (`new_columns: ignore`, withheld on a table with sensitive columns): those rows'
    values were never stored, and the default would be a wrong value where null says unknown."""
    if stored is None:
        return defaults
    have = {f.name.lower() for f in stored}
    fillable = {}
    for name, value in defaults.items():
        if name.lower() not in have and name in seen_before:
            log.warning(
                "table '%s': column '%s' joins the mirror, but earlier hours' changes carried "
                "values of it that the mirror left out; its rows from before hold null, not "
                "the default. Re-snapshot the table to fill them",
                spec.name,
                name,
            )
            continue
        fillable[name] = value
    return fillable


def column_defaults(
    spec: TableSpec, added: dict[str, str], connector: dict[str, Any]
) -> dict[str, Any]:
    """What a change written before a column existed gives it, typed: a declared column's
    `default` from the tables file; an undeclared one the mirror added (`added`), the default
    the connector's schema declared for it (Debezium copies the source's `DEFAULT` there).

    A declared column never takes the connector's: whether the hours from before it run before
    or after the hour that tells the default would decide what they hold (schema_drift names a
    connector default the tables file lacks). Masked columns take none (config.py refuses one).
    """
    typed = {}
    for name, value in connector.items():
        if name not in added or name in spec.sensitive:
            continue
        try:
            typed[name] = typed_default(added[name], value)
        except ValueError:
            continue  # a type defaults don't cover (time, binary, arrays): null
    return {**typed, **spec.column_defaults()}


@dataclass(frozen=True)
class HeldBack:
    """The hour after its audit: the decoded changes with the failing ones marked as errors,
    the errors and their reasons (the decoder's and the audit's), and the newest source time of
    the changes the mirror takes (ms)."""

    decoded: DataFrame
    audit: AuditVerdict | None
    errors: int
    reasons: dict[str, int]
    newest_ms: int | None


def _hold_back(
    spark: SparkSession,
    spec: TableSpec,
    batch: DecodedSlice,
    checks: MirrorChecks,
    keep: Callable[[DataFrame], DataFrame],
) -> HeldBack:
    """The audit: the hard expectations hold failing changes back, into the error table."""
    tally, decoded = batch.tally, batch.frame
    audit = checks.audit(spark, spec, decoded.where(applicable()))
    newest_ms = None if tally.newest_source_us is None else tally.newest_source_us // 1000
    errors, reasons = tally.errors, dict(tally.reasons)
    if audit is None or audit.failed is None:
        return HeldBack(decoded, audit, errors, reasons, newest_ms)
    decoded = keep(
        decoded.join(F.broadcast(audit.failed), [KAFKA_PARTITION, KAFKA_OFFSET], "left")
        .withColumn(ERROR, F.coalesce(F.col(ERROR), F.col("_cdc_expectation")))
        .drop("_cdc_expectation")
    )
    errors += sum(audit.reasons.values())
    for reason, n in audit.reasons.items():
        reasons[reason] = reasons.get(reason, 0) + n
    # The changes held back are not in the mirror: its newest source time without them.
    newest_ms = decoded.where(F.col(ERROR).isNull()).agg(F.unix_millis(F.max(SOURCE_TS))).first()[0]
    return HeldBack(decoded, audit, errors, reasons, newest_ms)


def applicable() -> Column:
    """Decoded changes to rows: not errors, tombstones or truncates."""
    return F.col(ERROR).isNull() & ~F.col(TOMBSTONE) & (F.col(OP) != TRUNCATE)


@dataclass(frozen=True)
class DecodedSlice:
    """An hour's records decoded and masked (cached), with what the decoder counted."""

    frame: DataFrame
    tally: Tally
    shape: SourceShape


def _decode(
    spark: SparkSession,
    records: DataFrame | pa.RecordBatch,
    spec: TableSpec,
    hour_key: str,
    added: dict[str, str],
    masking_key: HmacKey | None,
    defaults: dict[str, Any],
) -> DecodedSlice:
    """Decodes the slice into a cached frame; one Spark job fills the cache and brings back
    each batch's tally and shape (so the totals, drift and key range cost no job of their own).
    Records read in the driver are decoded here, into a local relation.
    Sensitive columns are masked before anything reads them (cdc_assets/masking.py)."""
    if isinstance(records, pa.RecordBatch):
        frame = decode_locally(
            spark, records, spec, hour_key=hour_key, added_columns=added, defaults=defaults
        )
        frame = mask_changes(frame, spec, masking_key)
    else:
        frame = decode(records, spec, hour_key=hour_key, added_columns=added, defaults=defaults)
        frame = mask_changes(frame, spec, masking_key).persist(_CACHED)
    rows = frame.where(F.col(TALLY).isNotNull()).select(SHAPE, TALLY).collect()
    return DecodedSlice(
        frame,
        Tally.combine(row[TALLY] for row in rows),
        SourceShape.combine(row[SHAPE] for row in rows),
    )


# A cached hour stays in memory as Spark's columnar batches, not serialized again (what
# MEMORY_AND_DISK adds for a frame), and spills to disk when memory is short.
_CACHED = StorageLevel.MEMORY_AND_DISK_DESER
_MATERIALIZE_SOURCE = "spark.databricks.delta.merge.materializeSource"


@contextmanager
def merge_source(spark: SparkSession, *, materialized: bool) -> Iterator[None]:
    """Whether Delta's MERGE materializes its source first (its default, "auto"), or reads it
    twice as it is ("none": only for a source that is deterministic and not cached, as a small
    hour's local relation is; it saves the MERGE a write and a read of the source). A cached
    source must be materialized: Delta refuses to read a cached plan twice
    (DELTA_MERGE_SOURCE_CACHED_DURING_EXECUTION); copying it from the cache costs little."""
    with session_settings(spark, {_MATERIALIZE_SOURCE: "auto" if materialized else "none"}):
        yield


def key_range(spec: TableSpec, tally: Tally) -> dict[str, tuple]:
    """The MERGE's pruning bounds: each ranged key column's lowest and highest applied value."""
    return {
        k: (key_value(spec.columns[k], tally.low[k]), key_value(spec.columns[k], tally.high[k]))
        for k in spec.primary_key
        if k in tally.low and k in tally.high
    }


def offset_census(
    kafka: KafkaResource, hour_slice: HourSlice, spark: SparkSession | None = None
) -> OffsetCensus | None:
    """The slice's records as Kafka's consumers count them, committed and not (`OffsetCensus`):
    what explains offsets the reader got no record for. Counted by kafka-python for a slice the
    driver read, by Spark's Kafka source for one Spark read (two count jobs).

    Taken after the hour's commit, so it never fails the run: when the count can't be taken
    (a broker error, offsets deleted meanwhile) it is None, and the accounting check says the
    gap is unexplained.
    """
    counts = {}
    try:
        for committed in (True, False):
            if spark is not None:
                isolation = "read_committed" if committed else "read_uncommitted"
                options = {**kafka.spark_options(), "kafka.isolation.level": isolation}
                counts[committed] = read_slice(spark, options, hour_slice).count()
                continue
            consumer = kafka.consumer(committed=committed)
            try:
                counts[committed] = count_slice_records(consumer, hour_slice)
            finally:
                consumer.close()
    except Exception as error:  # noqa: BLE001 - reported by the accounting check instead
        log.warning(
            "topic '%s': Kafka's count of the slice could not be taken (%s: %s); the "
            "accounting check reports the offset gap as unexplained",
            hour_slice.topic,
            type(error).__name__,
            str(error).splitlines()[0][:300],
        )
        return None
    return OffsetCensus(committed=counts[True], uncommitted=counts[False])


def _slice(
    kafka: KafkaResource,
    spec: TableSpec,
    hour_key: str,
    now: datetime,
    starts: dict[int, int],
    starts_cover_topic: bool,
) -> HourSlice:
    consumer, uncommitted = kafka.consumer(), kafka.consumer(committed=False)
    try:
        return compute_slice(
            consumer,
            table=spec.name,
            topic=spec.topic,
            hour_start=hour_start(hour_key),
            now=now,
            allowed_lateness=timedelta(minutes=spec.allowed_lateness_minutes),
            known_starts=starts,
            starts_cover_topic=starts_cover_topic,
            uncommitted=uncommitted,
        )
    finally:
        consumer.close()
        uncommitted.close()


def _refuse_open_or_lost(
    spec: TableSpec, hour_key: str, hour_slice: HourSlice, force_open_hour: bool
) -> None:
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


def _fail_on_truncate(spec: TableSpec, hour_key: str, tally: Tally) -> None:
    partition, offset = tally.first_truncate
    raise TruncateError(
        f"table '{spec.name}', topic '{spec.topic}', hour {hour_key}: partition "
        f"{partition} offset {offset} is a truncate of the source "
        f"table (op 't'; {tally.truncates} in the hour). on_truncate is 'fail', so "
        "nothing of this hour was written. Set on_truncate: apply for the table to "
        "delete every row older than the truncate and run the hour again, or "
        "re-snapshot the table."
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
    known_defaults: dict[str, Any],
    checks: MirrorChecks,
) -> HourResult:
    """An hour with no record: nothing is read, decoded or merged. Its slice is recorded in a
    metadata-only commit, as every run's is, so the next hour starts where it ended."""
    commit = _run_record(
        hour_key,
        hour_slice,
        consumed=0,
        tombstones=0,
        errors=0,
        mirror_newest=prior_newest,
        column_defaults=known_defaults,
    )
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
        audit=checks.audit_nothing(spec),
        expectations=tuple(checks.validate_nothing(spec)),
        mirror_newest=_from_ms(prior_newest),
    )
