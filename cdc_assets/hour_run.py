"""One table-hour, as stages: plan → read → decode → audit → apply → keep_history → validate
→ account.

    hour = plan(ctx, ...)            # the hour's slice of the topic, or why it can't run yet
    stored = stored_mirror(ctx)      # the mirror's schema; refused if it holds raw masked values
    records = read(ctx, hour)        # in this process for a small slice, by Spark for a large
    changes = decode_hour(ctx, ...)  # typed change rows, bad records marked as errors
    held = audit(ctx, changes, ...)  # the hard expectations hold failing changes back
    applied = apply(ctx, ...)        # errors to the error table; one guarded MERGE, one commit
    kept = keep_history(ctx, ...)    # `history: true`: every change a version, its own commit
    verdicts = validate(ctx, ...)    # the other expectations, on the hour's newest changes
    return account(ctx, ...)         # every record counted where it happened (`HourCounts`)

Each stage is a function of the run's `HourContext` and the values the stages before it
returned. Kept free of Dagster, so the same function serves the asset, tests and benchmarks;
the asset turns the `HourResult` into materialization metadata and check results.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pyarrow as pa
from kafka import KafkaConsumer
from pyspark import StorageLevel
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from cdc_assets import toast
from cdc_assets.checking import AuditVerdict, MirrorChecks
from cdc_assets.columns import (
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
)
from cdc_assets.commits import (
    MIRROR_NEWEST,
    MOVED_ROWS,
    commit_metadata,
    current_version,
    delta_log,
    hour_history,
    known_starts,
    record_run,
    recorded_mirror_newest,
    recorded_offsets,
    refreshed_to,
    truncate_watermark,
)
from cdc_assets.config import TableSpec, typed_default
from cdc_assets.decoding.shape import SourceShape, added_column_types
from cdc_assets.decoding.spark import decode, decode_locally
from cdc_assets.decoding.tally import Tally, key_value
from cdc_assets.error_table import write_errors
from cdc_assets.history import audit_history, data_columns, history_name, write_history
from cdc_assets.history_moves import MovedVersions, follow_moves
from cdc_assets.history_tracking import (
    changes_name,
    check_tracking,
    fold_history,
    history_tables,
    per_change_name,
)
from cdc_assets.hours import hour_start, previous_key
from cdc_assets.ledger import DeltaLog
from cdc_assets.masking import check_stored_mirror, mask_changes, stored_spec
from cdc_assets.merge import MergeOutcome, added_columns, merge_changes, mirror_schema
from cdc_assets.read import OffsetCensus, count_slice_records, read_slice, read_slice_locally
from cdc_assets.results import HistoryRun, HourCounts, HourResult, KeyCounts
from cdc_assets.rule import latest_per_key
from cdc_assets.slicing import (
    DataLossError,
    HourSlice,
    OpenHourError,
    compute_slice,
    remainder,
)
from resources.kafka import KafkaResource
from resources.lake import LakeResource, LakeWriteError, storage_failure
from resources.masking import HmacKey
from resources.spark import INTERPRETED_MAX_BYTES, session_settings

log = logging.getLogger(__name__)

# Slices up to this many records are read and decoded in the driver (see `run_hour`).
DEFAULT_LOCAL_READ_MAX_RECORDS = 20_000


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
    interpreted_max_bytes: int = INTERPRETED_MAX_BYTES,
) -> HourResult:
    """Materializes one hour of `spec` into its Delta mirror and returns what happened.

    `checks` audits the hour's changes before the MERGE (the hard expectations' failures go to
    the error table) and validates the newest change per key after it (`cdc_assets.checking`).

    A slice of at most `local_read_max_records` records is read and decoded in this process
    (`read_slice_locally`): no Spark job for the read, and a small hour costs little; a larger
    one is read by Spark's Kafka source and decoded in Spark's Python workers. Both run the
    same decoder, so they give the same rows.

    Such an hour, when its mirror, error table and history each hold fewer than
    `interpreted_max_bytes` bytes, has Spark evaluate its expressions without generating code
    for them (`interpreted_tables`); 0 never does.
    """
    lake.connect(spark)
    path = lake.table_path(spec.name)
    # One consumer for the plan's offset lookups and a small slice's read: each new one costs
    # its connections to the brokers.
    with _storage_failures_named(spec, hour_key, path), closing(kafka.consumer()) as consumer:
        ctx = HourContext.start(spark, kafka, lake, spec, hour_key, checks, masking_key)
        hour = plan(
            ctx, now or datetime.now(UTC), force_open_hour, local_read_max_records, consumer
        )
        if hour.slice.size == 0 and ctx.version is not None:
            return record_empty(ctx, hour)
        interpreted = interpreted_tables(ctx, hour, interpreted_max_bytes)
        with (
            sized_shuffles(
                spark, hour.slice.size, adaptive=not hour.local, interpreted=interpreted
            ),
            _Frames(hour.local) as frames,
        ):
            stored_schema = stored_mirror(ctx)
            records = read(ctx, hour, consumer)
            changes = decode_hour(ctx, stored_schema, records, frames)
            held = audit(ctx, changes, frames)
            applied = apply(ctx, hour, changes, held, frames)
            kept = keep_history(ctx, hour, applied)
            verdicts = validate(ctx, applied)
        return account(ctx, hour, records, changes, held, applied, verdicts, kept)


# --- the stages --------------------------------------------------------------------------------


def plan(
    ctx: HourContext,
    now: datetime,
    force_open_hour: bool,
    local_read_max_records: int,
    consumer: KafkaConsumer,
) -> HourPlan:
    """The hour's slice: where each partition's hour begins by the runs on record, where it
    ends by Kafka's offsets for the hour's end (looked up with `consumer`, read committed);
    refused while open (I5) or lost (I6). A refresh of an open hour (a partial run, forced or
    the sensor's `refresh_minutes`) after another reads only what followed the other's end;
    the run after the hour closes reads it whole, so that its checks judge the whole hour (a
    check of the last part alone would replace an earlier part's failure in Dagster)."""
    previous_end = recorded_offsets(ctx.history, previous_key(ctx.hour_key), "end", complete=True)
    starts = known_starts(ctx.history, ctx.hour_key, previous_end)
    hour_slice = _slice(
        ctx.kafka, consumer, ctx.spec, ctx.hour_key, now, starts, previous_end is not None
    )
    hour_starts = hour_slice.start_offsets()
    read_to = {} if hour_slice.closed else refreshed_to(ctx.history, ctx.hour_key, hour_starts)
    if read_to:
        hour_slice = remainder(hour_slice, read_to)
    _refuse_open_or_lost(ctx.spec, ctx.hour_key, hour_slice, force_open_hour)
    return HourPlan(
        slice=hour_slice,
        previous_end=previous_end,
        prior_newest=recorded_mirror_newest(ctx.spark, ctx.path, ctx.history, ctx.version),
        local=hour_slice.size <= local_read_max_records,
        hour_starts=hour_starts,
        refreshed_to=read_to or None,
    )


def stored_mirror(ctx: HourContext) -> T.StructType | None:
    """The mirror's schema as stored (None before its first run), refused before anything is
    read when it (or the table's history) holds raw values of a column the table now masks
    (`check_stored_mirror`), or when its history was built with other tracked columns
    (`check_tracking`)."""
    stored_schema = mirror_schema(ctx.spark, ctx.path)
    check_stored_mirror(stored_schema, ctx.path, ctx.spec)
    spec, lake = ctx.spec, ctx.lake
    if spec.history:
        check_tracking(
            ctx.spark,
            spec,
            lake.table_path(history_name(spec)),
            lake.table_path(changes_name(spec)),
            lake.s3_client(),
        )
    if spec.sensitive:  # a history keeps every value: the same rule
        for name in history_tables(spec):
            path = lake.table_path(name)
            check_stored_mirror(mirror_schema(ctx.spark, path), path, spec, "history")
    return stored_schema


def read(ctx: HourContext, hour: HourPlan, consumer: KafkaConsumer) -> DataFrame | pa.RecordBatch:
    """The slice's records: read by `consumer` in this process when small, else by Spark's
    Kafka source."""
    if not hour.local:
        return read_slice(ctx.spark, ctx.kafka.spark_options(), hour.slice)
    return read_slice_locally(consumer, hour.slice)


def decode_hour(
    ctx: HourContext,
    stored_schema: T.StructType | None,
    records: DataFrame | pa.RecordBatch,
    frames: _Frames,
) -> DecodedHour:
    """The hour's records decoded and masked, against the mirror as it is stored: the columns
    it gained undeclared, and those the hour brings (`_decode_with_new_columns`)."""
    batch, added, withheld, connector, defaults = _decode_with_new_columns(
        ctx.spark,
        records,
        ctx.spec,
        ctx.hour_key,
        added_columns(stored_schema, ctx.spec),
        ctx.masking_key,
        ctx.running(COLUMN_DEFAULTS, {}),
    )
    frames.track(batch.frame)
    # From here on the spec describes the mirror: hashed columns are strings, dropped ones
    # gone, added ones there.
    stored = stored_spec(ctx.spec)
    return DecodedHour(
        batch=batch,
        spec=stored.model_copy(update={"columns": {**stored.columns, **added}}),
        stored_schema=stored_schema,
        withheld=withheld,
        connector_defaults=connector,
        defaults=defaults,
    )


def audit(ctx: HourContext, changes: DecodedHour, frames: _Frames) -> HeldBack:
    """The hard expectations: changes that fail one are held back, into the error table."""
    held = _hold_back(ctx.spark, changes.spec, changes.batch, ctx.checks, frames.keep)
    tally = changes.batch.tally
    if tally.truncates and changes.spec.on_truncate == "fail":
        _fail_on_truncate(changes.spec, ctx.hour_key, tally)
    if held.errors:
        _fail_on_sequence_mismatch(changes.spec, ctx.hour_key, held.reasons, tally)
    return held


def apply(
    ctx: HourContext, hour: HourPlan, changes: DecodedHour, held: HeldBack, frames: _Frames
) -> Applied:
    """The error rows to the error table; the newest change per key MERGEd into the mirror in
    one commit that records the run; then the moved rows' TOASTed values, a commit of its own
    that carries the run's record, marked (a crash before it is repaired by the next run with
    changes, which resolves every move still open)."""
    spec, tally, decoded = changes.spec, changes.batch.tally, held.decoded
    hour_truncate = tally.truncate_sequence if tally.truncates else None
    good, older_than_truncate = _after_truncates(decoded, ctx.history, hour_truncate)
    # The hour's keys counted on the batch, apart from the newest-change-per-key step (the
    # MERGE's source) that Delta counts: the accounting compares the two.
    distinct_keys = good.select(*spec.primary_key).distinct().count()
    if held.errors:
        write_errors(
            ctx.spark,
            spec,
            ctx.lake.table_path(spec.error_table_name),
            decoded.where(F.col(ERROR).isNotNull()),
            hour_key=ctx.hour_key,
            ingested_at=hour.ingested_at,
        )
    commit = _run_record(ctx, hour, changes, held, hour_truncate)
    latest = frames.keep(latest_per_key(good, spec))  # the MERGE's source, the expectations'
    defaults = fillable_defaults(
        spec, changes.defaults, changes.stored_schema, set(ctx.running(SOURCE_COLUMNS, ()))
    )
    if not hour.local:
        latest.count()  # fills the cache once: the queries below read it twice each
    with merge_source(ctx.spark, materialized=not hour.local):
        outcome = merge_changes(
            ctx.spark,
            spec,
            ctx.path,
            latest,
            ingested_at=hour.ingested_at,
            run_metadata=commit,
            truncate_before=(
                None
                if hour_truncate is None
                else sequence_value(decoded.schema[SEQUENCE].dataType, hour_truncate)
            ),
            key_range=key_range(spec, tally),
            ledger=ctx.ledger,
            defaults=defaults,
        )
    version = outcome.recorded_version
    with commit_metadata(ctx.spark, {**commit, MOVED_ROWS: True}):
        if toast.resolve_moves(ctx.spark, spec, ctx.path):
            version = current_version(ctx.spark, ctx.path, ctx.ledger)
    return Applied(
        spec,
        outcome,
        version,
        latest,
        distinct_keys,
        older_than_truncate,
        commit,
        good,
        tally,
        defaults,
    )


def keep_history(ctx: HourContext, hour: HourPlan, applied: Applied) -> HistoryRun | None:
    """A table with `history: true`: every applied change of the hour becomes a version in
    `<table>__history`, in a commit of its own after the mirror's, carrying the same record (a
    crash between the two is repaired by running the hour again); TOASTed values carried over
    primary-key moves the hour takes part in (`cdc_assets.history_moves`, commits of their own);
    with tracked columns in `<table>__history_changes`, then folded into `<table>__history` in a
    further commit (`cdc_assets.history_tracking`). Then the stored versions of the keys the run
    touched in the history readers query are judged against themselves and the mirror
    (`cdc_assets.history`)."""
    if not ctx.spec.history:
        return None
    spec, lake = applied.spec, ctx.lake
    path, per_change = lake.table_path(history_name(spec)), lake.table_path(per_change_name(spec))
    bounds = key_range(spec, applied.tally)
    outcome = write_history(
        ctx.spark,
        spec,
        per_change,
        applied.changes,
        ingested_at=hour.ingested_at,
        run_metadata=applied.commit,
        key_range=bounds,
        defaults=applied.defaults,
        s3_client=lake.s3_client(),
    )
    touched = applied.changes
    moved = MovedVersions(0, None, None)
    if outcome.moves:
        moved = follow_moves(ctx.spark, spec, per_change, applied.changes, applied.commit)
    if moved.versions is not None:  # moved keys may lie outside the hour's key range
        outcome = replace(outcome, filled_from_moves=moved.filled, version=moved.version)
        keys = [*spec.primary_key, SEQUENCE]
        touched = touched.select(*keys).unionByName(moved.versions.select(*keys))
        bounds = {}
    folded = None
    if per_change != path:
        folded = fold_history(
            ctx.spark,
            spec,
            path,
            per_change,
            touched,
            run_metadata=applied.commit,
            key_range=bounds,
            defaults=applied.defaults,
            s3_client=lake.s3_client(),
        )
    audit = audit_history(
        ctx.spark,
        spec,
        path,
        ctx.path,
        touched,
        data_columns(spec, applied.changes),
        bounds,
    )
    return HistoryRun(outcome, audit, folded)


def validate(ctx: HourContext, applied: Applied) -> tuple[object, ...]:
    """The expectations that are not hard, on the hour's newest live change per key."""
    outcome = applied.outcome
    return tuple(
        ctx.checks.validate(
            ctx.spark,
            applied.spec,
            ctx.path,
            applied.version,
            applied.latest.where(~F.col(DELETED)),
            keys=KeyCounts(keys=outcome.prior.source_rows, duplicates=outcome.duplicate_rows),
        )
    )


def account(
    ctx: HourContext,
    hour: HourPlan,
    records: DataFrame | pa.RecordBatch,
    changes: DecodedHour,
    held: HeldBack,
    applied: Applied,
    verdicts: tuple[object, ...],
    kept: HistoryRun | None = None,
) -> HourResult:
    """What the run did: each figure of I2 counted where it happened (`HourCounts.counted`)."""
    spec, tally, outcome = applied.spec, changes.batch.tally, applied.outcome
    # Spark's read: counted by the decoder, which takes every row the read gives.
    consumed = records.num_rows if hour.local else tally.records
    census = (
        offset_census(ctx.kafka, hour.slice, None if hour.local else ctx.spark)
        if consumed < hour.slice.size
        else None
    )
    return HourResult(
        table=spec.name,
        hour_key=ctx.hour_key,
        slice=hour.slice,
        counts=HourCounts.counted(
            consumed,
            tally,
            held.errors,
            outcome,
            applied.distinct_keys,
            applied.older_than_truncate,
            census,
        ),  # fmt: skip
        rows_inserted=outcome.rows_inserted,
        rows_updated=outcome.rows_updated,
        rows_deleted=outcome.rows_deleted,
        delta_version=applied.version,
        partial=not hour.slice.closed,
        newest_source_ts=_from_ms(held.newest_ms),
        finished_at=datetime.now(UTC),
        error_reasons=held.reasons,
        merge_version=outcome.version,
        previous_end=hour.previous_end,
        hour_starts=hour.hour_starts,
        refreshed_to=hour.refreshed_to,
        source_fields=changes.batch.shape,
        audit=held.audit,
        expectations=verdicts,
        mirror_newest=_from_ms(applied.commit[MIRROR_NEWEST]),
        withheld_columns=changes.withheld if spec.new_columns == "add" else (),
        history=kept,
    )


def record_empty(ctx: HourContext, hour: HourPlan) -> HourResult:
    """An hour with no record: nothing is read, decoded or merged. Its slice is recorded in a
    metadata-only commit, as every run's is, so the next hour starts where it ended."""
    commit = _record(ctx, hour, consumed=0, tombstones=0, errors=0, newest_ms=None)
    version = record_run(ctx.spark, ctx.spec, ctx.path, commit, ctx.ledger)
    return HourResult(
        table=ctx.spec.name,
        hour_key=ctx.hour_key,
        slice=hour.slice,
        counts=HourCounts(0, 0, 0, 0, 0, 0),
        rows_inserted=0,
        rows_updated=0,
        rows_deleted=0,
        delta_version=version,
        partial=not hour.slice.closed,
        newest_source_ts=None,
        finished_at=datetime.now(UTC),
        previous_end=hour.previous_end,
        hour_starts=hour.hour_starts,
        refreshed_to=hour.refreshed_to,
        audit=ctx.checks.audit_nothing(ctx.spec),
        expectations=tuple(ctx.checks.validate_nothing(ctx.spec)),
        mirror_newest=_from_ms(hour.prior_newest),
    )


# --- what the stages hand each other -----------------------------------------------------------


@dataclass(frozen=True)
class HourContext:
    """One table-hour's run: its resources, table and hour, and the mirror's log as the run
    found it (`version` None: no mirror yet; `history`: its runs' records, newest first)."""

    spark: SparkSession
    kafka: KafkaResource
    lake: LakeResource
    spec: TableSpec
    hour_key: str
    checks: MirrorChecks
    masking_key: HmacKey | None
    path: str
    ledger: DeltaLog | None
    version: int | None
    history: list[dict]

    @classmethod
    def start(
        cls,
        spark: SparkSession,
        kafka: KafkaResource,
        lake: LakeResource,
        spec: TableSpec,
        hour_key: str,
        checks: MirrorChecks,
        masking_key: HmacKey | None,
    ) -> HourContext:
        path = lake.table_path(spec.name)
        ledger = delta_log(path, lake.s3_client())  # the table's commits, read without Spark
        version, history = hour_history(spark, path, ledger)
        return cls(
            spark, kafka, lake, spec, hour_key, checks, masking_key, path, ledger, version, history
        )

    def running(self, name: str, default: Any) -> Any:
        """A running record the newest run carried in its commit (`_record`)."""
        return self.history[0].get(name, default) if self.history else default


@dataclass(frozen=True)
class HourPlan:
    """The slice this run reads, the previous hour's recorded end, the mirror's newest source
    time as recorded (ms), whether the slice is read in this process, the run's ingestion
    time; where the hour begins, and where a refresh of it read up to (None: no refresh, the
    slice is the whole hour)."""

    slice: HourSlice
    previous_end: dict[int, int] | None
    prior_newest: int | None
    local: bool
    ingested_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    hour_starts: dict[int, int] = field(default_factory=dict)
    refreshed_to: dict[int, int] | None = None

    def recorded_slice(self) -> dict:
        """The slice as the run's commit records it: from the hour's start to this run's end,
        so the next hour, a rerun and the next refresh find where the hour begins."""
        recorded = self.slice.as_dict()
        for partition, offsets in recorded["partitions"].items():
            offsets["start"] = self.hour_starts.get(int(partition), offsets["start"])
        return recorded


@dataclass(frozen=True)
class DecodedHour:
    """The decoded hour (`DecodedSlice`), the spec of the mirror it goes into, the mirror's
    stored schema, and what the hour told of the source's columns: the new ones withheld, the
    defaults its schemas declare (`connector_defaults`), the defaults it was decoded with."""

    batch: DecodedSlice
    spec: TableSpec
    stored_schema: T.StructType | None
    withheld: tuple[str, ...]
    connector_defaults: dict[str, Any]
    defaults: dict[str, Any]


@dataclass(frozen=True)
class Applied:
    """What the MERGE did, the version that recorded the run (the moved rows' commit when there
    was one), the hour's newest change per key, its distinct keys, the changes older than a
    truncate, and the run's record."""

    spec: TableSpec
    outcome: MergeOutcome
    version: int | None
    latest: DataFrame
    distinct_keys: int
    older_than_truncate: int
    commit: dict
    changes: DataFrame  # the hour's applicable changes, every one (the history's versions)
    tally: Tally
    defaults: dict[str, Any]  # the column defaults rows from before a new column take


class _Frames:
    """The frames a run caches (a slice Spark read) or just derives (a slice read here: a local
    relation, cheap to compute again and deterministic, so nothing is cached and the MERGE
    takes it as it is); released when the run's stages are done."""

    def __init__(self, local: bool) -> None:
        self.local, self.frames = local, []

    def keep(self, frame: DataFrame) -> DataFrame:
        frame = frame if self.local else frame.persist(_CACHED)
        return self.track(frame)

    def track(self, frame: DataFrame) -> DataFrame:
        self.frames.append(frame)
        return frame

    def __enter__(self) -> _Frames:
        return self

    def __exit__(self, *exc: object) -> None:
        for frame in self.frames:
            frame.unpersist()


def _newer(a: int | None, b: int | None) -> int | None:
    return max((v for v in (a, b) if v is not None), default=None)


def _from_ms(ms: int | None) -> datetime | None:
    return None if ms is None else datetime.fromtimestamp(ms / 1000, UTC)


class TruncateError(RuntimeError):
    """A truncate event in an hour of a table configured with on_truncate: fail."""


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
# Spark's choice between generating code for expressions and evaluating them as they are:
# NO_CODEGEN evaluates projections, predicates and stages without generating classes for them
# (what a few callers generate directly, such as Delta's statistics of a written file, and
# what Spark's class cache already holds, are still used).
CODEGEN_FACTORY_MODE = "spark.sql.codegen.factoryMode"
INTERPRETED = "NO_CODEGEN"


@contextmanager
def sized_shuffles(
    spark: SparkSession, records: int, *, adaptive: bool = True, interpreted: bool = False
) -> Iterator[None]:
    """Sets the session's shuffle partitions for an hour of `records` records, then restores
    them (a run's tables each have a session of their own, `cdc_assets.fleet`).

    `adaptive=False` also turns adaptive query execution off: for an hour read in this process
    (a local relation, whose size Spark knows, so the planner broadcasts it without AQE's help)
    and of one shuffle partition, AQE has nothing to coalesce or convert, and its planning again
    at every stage costs a small hour more than it saves (docs/benchmark.md, "Small table-hours",
    has the before and after). Hours Spark reads keep it.

    `interpreted=True` (`interpreted_tables`) has Spark evaluate the hour's expressions without
    generating code for them: generating it (per task, for each projection of Delta's wide file
    actions too) costs more than it saves on a few thousand rows, and ~10 microseconds more a
    row than compiled code on many."""
    key = "spark.sql.shuffle.partitions"
    width = -(-records // RECORDS_PER_SHUFFLE_PARTITION)
    settings = {key: str(max(1, min(int(spark.conf.get(key)), width)))}
    if not adaptive and width <= 1:
        settings[ADAPTIVE] = "false"
    if interpreted:
        settings[CODEGEN_FACTORY_MODE] = INTERPRETED
    with session_settings(spark, settings):
        yield


def interpreted_tables(ctx: HourContext, hour: HourPlan, max_bytes: int) -> bool:
    """Whether the hour runs interpreted (`sized_shuffles`): it was read in this process and
    each table its MERGEs may scan, the mirror, its error table (scanned whole when the hour
    has errors) and (`history: true`) its history, holds fewer than `max_bytes` bytes of data
    files by Delta's checksum (a table not created yet holds none; a size not known, or a lake
    whose log is read by Spark rather than `delta_log`, counts as large)."""
    if not hour.local or max_bytes <= 0:
        return False
    spec, lake = ctx.spec, ctx.lake
    others = [spec.error_table_name, *history_tables(spec)]
    logs = [delta_log(lake.table_path(name), lake.s3_client()) for name in others]
    # The mirror's log as `HourContext.start` listed it: only this run writes the mirror.
    mirror = None if ctx.ledger is None else ctx.ledger.size_bytes(absent=0, relist=False)
    sizes = [mirror, *(None if log is None else log.size_bytes(absent=0) for log in logs)]
    return all(size is not None and size < max_bytes for size in sizes)


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
    if audit is None or not audit.failed:
        return HeldBack(decoded, audit, errors, reasons, newest_ms)
    failed = spark.createDataFrame(
        [(p, o, reason) for (p, o), reason in audit.failed.items()],
        f"{KAFKA_PARTITION} int, {KAFKA_OFFSET} bigint, _cdc_expectation string",
    )
    decoded = keep(
        decoded.join(F.broadcast(failed), [KAFKA_PARTITION, KAFKA_OFFSET], "left")
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
    consumer: KafkaConsumer,
    spec: TableSpec,
    hour_key: str,
    now: datetime,
    starts: dict[int, int],
    starts_cover_topic: bool,
) -> HourSlice:
    uncommitted = _OnFirstLookUp(kafka)
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
        uncommitted.close()


class _OnFirstLookUp:
    """A read_uncommitted consumer for `compute_slice`, connected on its first look-up: only an
    hour whose end some partition has not reached yet asks for one (`open_transactions`)."""

    def __init__(self, kafka: KafkaResource) -> None:
        self._kafka = kafka
        self._consumer: KafkaConsumer | None = None

    def end_offsets(self, partitions: list, timeout_ms: int | None = None) -> dict:
        if self._consumer is None:
            self._consumer = self._kafka.consumer(committed=False)
        return self._consumer.end_offsets(partitions, timeout_ms=timeout_ms)

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()


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


def _record(
    ctx: HourContext,
    hour: HourPlan,
    *,
    consumed: int,
    tombstones: int,
    errors: int,
    newest_ms: int | None,
    shape: SourceShape | None = None,
    connector_defaults: dict[str, Any] | None = None,
) -> dict:
    """What every run's commit records (the ledger, `cdc_assets.commits`): its hour, slice and
    counts, and the running records the next run reads (`HourContext.running`): the mirror's
    newest source time (ms), the column defaults the connector's schemas declared so far
    (`COLUMN_DEFAULTS`) and the source columns the runs have seen (`SOURCE_COLUMNS`)."""
    record = {
        "hour": ctx.hour_key,
        "slice": hour.recorded_slice(),
        "partial": not hour.slice.closed,
        "consumed": consumed,
        "tombstones": tombstones,
        "errors": errors,
        "pipeline": "cdc-lake",
        MIRROR_NEWEST: _newer(hour.prior_newest, newest_ms),
    }
    if hour.refreshed_to is not None:  # the counts are of the part after the refresh's end
        record["read_from"] = {str(p): o for p, o in hour.slice.start_offsets().items()}
    defaults = connector_defaults
    if defaults is None:
        defaults = ctx.running(COLUMN_DEFAULTS, {})
    if defaults:
        record[COLUMN_DEFAULTS] = defaults
    seen = set(ctx.running(SOURCE_COLUMNS, ())) | set(shape.fields if shape else ())
    if seen:
        record[SOURCE_COLUMNS] = sorted(seen)
    return record


def _run_record(
    ctx: HourContext,
    hour: HourPlan,
    changes: DecodedHour,
    held: HeldBack,
    hour_truncate: list | None,
) -> dict:
    """The record of a run that read changes (`_record`), with the hour's truncate if any."""
    tally = changes.batch.tally
    record = _record(
        ctx,
        hour,
        consumed=tally.records,
        tombstones=tally.tombstones,
        errors=held.errors,
        newest_ms=held.newest_ms,
        shape=changes.batch.shape,
        connector_defaults=changes.connector_defaults,
    )
    if hour_truncate is not None:
        record["truncated_before"] = hour_truncate
    return record
