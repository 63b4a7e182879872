"""Every version of every row: `<table>__history`, a type-2 table beside the mirror.

A table with `history: true` keeps one row per version of a key: the change's columns (a delete
keeps its before-image and is a version of its own, `_cdc_deleted`), the version's start and end
in source sequence (`_cdc_sequence`, `_cdc_end_sequence`) and in source time (`_cdc_valid_from`
and `_cdc_valid_to`, from Debezium's `source.ts_ms`), and whether it is the key's newest
(`_cdc_current`). Every change of the hour is a version, not only the newest per key.

Right in any hour order, any number of times: a version is identified by its key and its source
sequence (the table's `sequence` fields, not the Kafka coordinates: a change delivered twice is
one version). Each run takes the stored versions its hour can alter (for each key it touches,
the version in force at its earliest change and every later one, not the key's whole history)
together with the hour's, orders each key's versions by sequence and derives every end from the
next start, then MERGEs the result on (key, source sequence): new versions are inserted, stored
ones whose end, currency or filled-in values changed are updated, the rest left alone. A late
version thus splits the interval it falls into; running an hour again writes nothing new.

TOASTed values (`toasted_columns`): a version that does not carry one takes the value of the
newest version before it that did (recomputed with every run, so it is right when that version
arrives later); where no version of the key carried one, the value is null and
`_cdc_unknown__C` true. A life a primary-key move began takes the old key's value from just
before the move, as the mirror's row does (`cdc_assets.history_moves`). A column with a default
that the history gains shows the default in its versions from before, as the mirror's rows do.

The history's MERGE is its own commit, after the mirror's, carrying the same run record: a run
that dies between the two is completed by running the hour again (the mirror finds its changes
stale, the history inserts what it lacks). A refresh of an open hour (`refresh_minutes`) that
dies there is not: the next refresh reads on from where the mirror's commit recorded, so that
part of the hour reaches the history with the run after the hour closes, which reads it whole.
What each run did (`HistoryOutcome`) and what the stored versions of its keys look like
afterwards (`HistoryAudit`) feed the `history` check.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from delta.tables import DeltaTable
from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql import types as T

from cdc_assets.columns import (
    DELETED,
    HOUR,
    INGESTED_AT,
    KAFKA_OFFSET,
    KAFKA_PARTITION,
    MOVED_FROM,
    OP,
    SEQUENCE,
    SOURCE_TS,
    has_value,
    source_fields,
)
from cdc_assets.commits import (
    LEDGER_OPERATION,
    applied_before,
    commit_metadata,
    current_version,
    delta_log,
    ledger_commit,
    prepared,
    retry_on_conflict,
    stored_table,
)
from cdc_assets.config import TableSpec
from cdc_assets.history_moves import moves_of
from cdc_assets.merge import (
    DELETION_VECTORS_PROPERTY,
    MERGE_PERSISTENT_DVS,
    fill_defaults,
    persistent_deletion_vectors,
    within_key_range,
)
from cdc_assets.toast import unknown_flag

HISTORY_SUFFIX = "__history"
VALID_FROM, VALID_TO = "_cdc_valid_from", "_cdc_valid_to"
END_SEQUENCE, CURRENT = "_cdc_end_sequence", "_cdc_current"
# The audit's own columns, under the prefix no source column may take (`cdc_assets.config`).
AUDIT = "_cdc_audit_"
IS_VERSION = f"{AUDIT}is_version"  # a history version, not a mirror row


def history_name(spec: TableSpec) -> str:
    return f"{spec.name}{HISTORY_SUFFIX}"


def data_columns(spec: TableSpec, changes: DataFrame) -> list[str]:
    """The source columns a version keeps: the mirror's (declared, and added ones the hour
    brings), as the decoded changes hold them."""
    known = set(changes.columns)
    return [c for c in spec.columns if c in known]


def version_columns(spec: TableSpec, data: list[str]) -> list[str]:
    """The history's columns, in order."""
    toasted = [name for c in spec.toasted_columns for name in (has_value(c), unknown_flag(c))]
    moved = [MOVED_FROM] if spec.toasted_columns else []  # `cdc_assets.history_moves`
    return [
        *data,
        OP,
        DELETED,
        SEQUENCE,
        END_SEQUENCE,
        VALID_FROM,
        VALID_TO,
        CURRENT,
        KAFKA_PARTITION,
        KAFKA_OFFSET,
        HOUR,
        INGESTED_AT,
        *toasted,
        *moved,
    ]


@dataclass(frozen=True)
class HistoryOutcome:
    """What one run did to the history: the hour's versions (distinct key and source sequence,
    counted on the batch), the versions the MERGE inserted and the stored versions it rewrote
    (closed, split, refilled), both Delta's metrics read from its commit; the MERGE's commit
    (None: it changed nothing) and the commit that recorded the run (the MERGE's, or a
    metadata-only one; None: the history's log holds no commit of this run); whether the run's
    slice was on record in the history already (a replay: nothing derived or written); the
    primary-key moves the hour's keys take part in (`toasted_columns` only: stored ones whose
    old or new key the hour touches, and the hour's own), and the versions filled from their
    life's move afterwards (`history_moves`)."""

    versions: int
    opened: int
    rewritten: int
    version: int | None
    recorded_version: int | None = None
    replayed: bool = False
    moves: int = 0
    filled_from_moves: int = 0

    @property
    def problems(self) -> list[str]:
        """What the run's own figures show wrong (the `history` check, per hour)."""
        found = []
        if self.recorded_version is None:
            found.append(
                "the history's log holds no commit of this run: its write did not commit (run "
                "the hour again: it writes what the history lacks)"
            )
        if self.opened > self.versions:
            found.append(
                f"the history's MERGE inserted {self.opened} versions, more than the hour's "
                f"{self.versions}: a version was derived twice"
            )
        return found


@dataclass(frozen=True)
class HistoryAudit:
    """The stored versions of the hour's keys after the run, judged: keys without exactly one
    current version, versions whose end is not the next version's start (an overlap or a gap),
    and the keys whose current live version differs from the mirror's live row (either side
    missing, or a value differing), of `keys` keys; `unknown` current versions with a TOASTed
    value not known (compared only where both it and the mirror know it); with `delete_mode:
    hard`, keys the history has deleted that the mirror holds again because an older change
    ran after the delete (hard deletes converge only in order: reported, not a failure of the
    history)."""

    keys: int
    current_not_one: int
    broken_intervals: int
    mirror_mismatches: int
    unknown: int = 0
    revived_by_hard_delete_order: int = 0

    @property
    def problems(self) -> list[str]:
        found = []
        if self.current_not_one:
            found.append(f"{self.current_not_one} keys have no current version or several")
        if self.broken_intervals:
            found.append(
                f"{self.broken_intervals} versions do not end where the key's next version "
                "starts (overlapping or gapped intervals)"
            )
        if self.mirror_mismatches:
            found.append(
                f"{self.mirror_mismatches} keys' current version differs from the mirror's row"
            )
        return found


def hour_versions(spec: TableSpec, changes: DataFrame, ingested_at) -> DataFrame:
    """The hour's applicable changes as versions: one per key and source sequence (a change
    delivered twice keeps its lowest Kafka coordinates, so the stored row does not depend on
    which delivery a run saw first). Columns keep their metadata (a masked column's marks)."""
    data = data_columns(spec, changes)
    fields = source_fields(changes.schema[SEQUENCE].dataType)
    toasted = [has_value(c) for c in spec.toasted_columns]
    toasted += [MOVED_FROM] if spec.toasted_columns else []
    row = [*data, OP, DELETED, SOURCE_TS, KAFKA_PARTITION, KAFKA_OFFSET, HOUR, *toasted]
    identity = [*spec.primary_key, *(F.col(f"{SEQUENCE}.{f}").alias(f"_v_{f}") for f in fields)]
    first = F.min_by(
        F.struct(*[F.col(c) for c in row if c not in spec.primary_key]), F.col(SEQUENCE)
    )
    return (
        changes.groupBy(*identity)
        .agg(F.min(SEQUENCE).alias(SEQUENCE), first.alias("_v"))
        .select(
            *spec.primary_key,
            *[
                F.col(f"_v.{c}").alias(c, metadata=changes.schema[c].metadata)
                for c in row
                if c not in spec.primary_key
            ],
            SEQUENCE,
        )
        .withColumnRenamed(SOURCE_TS, VALID_FROM)
        .withColumn(INGESTED_AT, F.lit(ingested_at).cast("timestamp"))
    )


def write_history(
    spark: SparkSession,
    spec: TableSpec,
    path: str,
    changes: DataFrame,
    *,
    versions: int,
    ingested_at,
    run_metadata: dict,
    key_range: Mapping[str, tuple] | None = None,
    defaults: Mapping[str, Any] | None = None,
    s3_client=None,
) -> HistoryOutcome:
    """MERGEs the hour's versions into the history at `path` (created on the first run) and
    re-derives the ends of the keys it touches, in one commit carrying `run_metadata`: the
    versions derived in the MERGE's own source, its figures read from its commit. A run that
    changes nothing records itself in a metadata-only commit; a slice the history's log shows
    applied already (`commits.applied_before`) is recorded and not derived again. `versions`
    is the hour's count of them (distinct key and source sequence), counted on the batch. A
    column with a default (`defaults`, as the mirror's MERGE takes them) that the history
    gains shows it in the versions from before, as the mirror's rows from before do
    (`merge.fill_defaults`)."""
    return retry_on_conflict(
        lambda: _write_once(
            spark,
            spec,
            path,
            changes,
            versions,
            ingested_at,
            run_metadata,
            key_range or {},
            defaults or {},
            s3_client,
        ),
        table=history_name(spec),
        path=path,
    )


def _write_once(
    spark: SparkSession,
    spec: TableSpec,
    path: str,
    changes: DataFrame,
    versions: int,
    ingested_at,
    run_metadata: dict,
    key_range: Mapping[str, tuple],
    defaults: Mapping[str, Any],
    s3_client,
) -> HistoryOutcome:
    keys = list(spec.primary_key)
    ledger = delta_log(path, s3_client)
    fields = source_fields(changes.schema[SEQUENCE].dataType)
    new = hour_versions(spec, changes, ingested_at)
    data = data_columns(spec, changes)
    columns = version_columns(spec, data)
    schema = _schema(spec, new, columns)
    stored = ensure_history_table(spark, path, schema, spec, ledger, run_metadata)
    if replayed(ledger, run_metadata):
        recorded = record_once(spark, path, run_metadata, ledger)
        return HistoryOutcome(versions, 0, 0, None, recorded, replayed=True)
    # Not into deletes' versions: the decoder gives a delete's before-image no default.
    live = ~F.col(DELETED)
    if fill_defaults(spark, path, spec, schema, defaults, stored, live, run_metadata=run_metadata):
        stored = DeltaTable.forPath(spark, path).toDF().schema  # a column was added
    table = DeltaTable.forPath(spark, path)
    stored_names = {f.name.lower() for f in stored}
    evolving = any(c.lower() not in stored_names for c in columns)
    moves = 0
    if spec.toasted_columns:  # the moves' lives `history_moves` fills afterwards: a count
        moves = _moves(spec, table.toDF(), new).count()
    affected = _affected_versions(spark, path, keys, key_range, new)
    source = _derived(spec, new, affected, data, fields).select(*columns)
    merge = table.alias("t").merge(source.alias("s"), same_version(keys, fields, key_range))
    if evolving:
        merge = merge.withSchemaEvolution()
    # What a run may change in a stored version.
    changed = changed_columns(
        [SEQUENCE, END_SEQUENCE, VALID_TO, CURRENT, *_filled(spec)], stored_names
    )
    merge = merge.whenMatchedUpdate(
        condition=changed, set={c: F.col(f"s.`{c}`") for c in columns}
    ).whenNotMatchedInsert(values={c: F.col(f"s.`{c}`") for c in columns})
    metrics, version, recorded = execute_recorded(spark, spec, path, merge, run_metadata, ledger)
    return HistoryOutcome(
        versions=versions,
        opened=int(metrics.get("numTargetRowsInserted") or 0),
        rewritten=int(metrics.get("numTargetRowsUpdated") or 0),
        version=version,
        recorded_version=recorded,
        moves=moves,
    )


def _moves(spec: TableSpec, stored: DataFrame, new: DataFrame) -> DataFrame:
    """The primary-key moves a run's keys take part in (`history_moves` fills their lives'
    TOASTed values): those stored whose old or new key is one of `new`'s, and `new`'s own; a
    row each. `toasted_columns` only."""
    keys = list(spec.primary_key)
    own = new.where(F.col(MOVED_FROM).isNotNull()).select(*keys)
    if MOVED_FROM not in stored.columns:  # a history written before moves were followed
        return own
    return moves_of(stored, spec, new.select(*keys).distinct()).select(*keys).unionByName(own)


def same_version(keys: list[str], fields: list[str], key_range: Mapping[str, tuple]) -> Column:
    """A history MERGE's condition: the same key and source sequence (`fields`), narrowed to
    the hour's key range so Delta skips the files outside it, as the mirror's MERGE does."""
    same = F.expr(
        " AND ".join(
            [f"t.`{k}` <=> s.`{k}`" for k in keys]
            + [f"t.`{SEQUENCE}`.`{f}` <=> s.`{SEQUENCE}`.`{f}`" for f in fields]
        )
    )
    return within_key_range(same, key_range)


def changed_columns(columns: list[str], stored_names: set[str]) -> str:
    """A MERGE condition for a stored version whose `columns` differ from the source's;
    `stored_names`: the stored table's (lowercased). A column the table gains in this MERGE is
    null in every stored row until then."""
    return " OR ".join(
        f"NOT (t.`{c}` <=> s.`{c}`)" if c.lower() in stored_names else f"s.`{c}` IS NOT NULL"
        for c in columns
    )


def execute_recorded(
    spark: SparkSession, spec: TableSpec, path: str, merge, run_metadata: dict, ledger
) -> tuple[dict[str, str], int | None, int | None]:
    """Executes a history MERGE (deletion vectors as the table's size says) in a commit that
    carries `run_metadata`; one that changes nothing is replaced by a metadata-only commit, so
    the run is on record all the same. Returns Delta's operation metrics as its commit holds
    them ({} for none), the MERGE's commit version (None: no MERGE commit) and the version
    that recorded the run (None: the log holds no commit of it). Read from the log without
    Spark (`ledger`); a lake whose log only Spark reads, through Spark."""
    size = ledger.size_bytes() if ledger is not None else None
    spark.conf.set(MERGE_PERSISTENT_DVS, str(persistent_deletion_vectors(spec, size)).lower())
    before = ledger.latest_version() if ledger is not None else None
    with commit_metadata(spark, run_metadata):
        returned = merge.execute()
    if ledger is None:
        if returned.first()["num_affected_rows"]:
            version = current_version(spark, path)
            commit = DeltaTable.forPath(spark, path).history(1).first()
            return dict(commit["operationMetrics"]), version, version
        return {}, None, record_once(spark, path, run_metadata, ledger)
    mine = ledger.run_commit(run_metadata, "MERGE")
    if mine is None or (before is not None and mine.version <= before):
        return {}, None, record_once(spark, path, run_metadata, ledger)
    # Delta may commit a MERGE that changed no row: it records the run all the same.
    return mine.metrics, mine.version if changed_rows(mine.metrics) else None, mine.version


def changed_rows(metrics: Mapping[str, str]) -> int:
    """The rows a MERGE inserted, updated or deleted, by its commit's operation metrics."""
    names = ("numTargetRowsInserted", "numTargetRowsUpdated", "numTargetRowsDeleted")
    return sum(int(metrics.get(name) or 0) for name in names)


def record_once(spark: SparkSession, path: str, run_metadata: dict, ledger) -> int | None:
    """Records a run that changed nothing in a history table in a metadata-only commit;
    returns its version (None where it can't be read back)."""
    with commit_metadata(spark, run_metadata):
        ledger_commit(spark, path)
    if ledger is None:
        return current_version(spark, path)
    mine = ledger.run_commit(run_metadata, LEDGER_OPERATION)
    return None if mine is None else mine.version


def replayed(ledger, run_metadata: dict) -> bool:
    """Whether the history's log shows this run's slice applied (`commits.applied_before`)."""
    if ledger is None:
        return False
    _, history = ledger.hour_history()
    return applied_before(history, run_metadata["hour"], run_metadata["slice"])


def _filled(spec: TableSpec) -> list[str]:
    """The columns a run fills in again (TOASTed values and their flags, and the old key of a
    move a history written before moves were followed lacks)."""
    filled = [name for c in spec.toasted_columns for name in (c, unknown_flag(c))]
    return [*filled, MOVED_FROM] if spec.toasted_columns else filled


def _schema(spec: TableSpec, new: DataFrame, columns: list[str]) -> T.StructType:
    sequence = new.schema[SEQUENCE].dataType
    known = {f.name: f for f in new.schema}
    extra = {
        END_SEQUENCE: T.StructField(END_SEQUENCE, sequence),
        VALID_TO: T.StructField(VALID_TO, T.TimestampType()),
        CURRENT: T.StructField(CURRENT, T.BooleanType()),
        **{
            unknown_flag(c): T.StructField(unknown_flag(c), T.BooleanType())
            for c in spec.toasted_columns
        },
    }
    return T.StructType([known.get(c) or extra[c] for c in columns])


def create_history_table(
    spark: SparkSession,
    path: str,
    schema: T.StructType,
    spec: TableSpec,
    properties: Mapping[str, str] | None = None,
) -> DeltaTable:
    """The history at `path`, created with `schema`, the table's deletion-vector setting and
    `properties` if it is new."""
    builder = (
        DeltaTable.createIfNotExists(spark)
        .location(path)
        .addColumns(schema)
        .property(DELETION_VECTORS_PROPERTY, str(spec.deletion_vectors).lower())
    )
    for name, value in (properties or {}).items():
        builder = builder.property(name, value)
    return builder.execute()


def ensure_history_table(
    spark: SparkSession,
    path: str,
    schema: T.StructType,
    spec: TableSpec,
    ledger,
    run_metadata: dict,
    properties: Mapping[str, str] | None = None,
) -> T.StructType:
    """The history table's schema as stored; created first (`create_history_table`, in a
    commit carrying the run's record marked `prepares`) when its log shows none."""
    stored = stored_table(spark, path, ledger).schema
    if stored is not None:
        return stored
    with commit_metadata(spark, prepared(run_metadata, "the history's table")):
        create_history_table(spark, path, schema, spec, properties)
    return schema


def _mirror_rows(
    spark: SparkSession,
    path: str,
    keys: list[str],
    key_range: Mapping[str, tuple],
    hour_keys: DataFrame,
) -> DataFrame:
    """Every row the Delta table at `path` (the mirror) holds for the hour's keys (the key
    range lets Delta skip files)."""
    stored = spark.read.format("delta").load(path)
    for key, (low, high) in key_range.items():
        stored = stored.where(F.col(key).between(F.lit(low), F.lit(high)))
    return stored.join(hour_keys.distinct(), on=keys, how="left_semi")


def _affected_versions(
    spark: SparkSession,
    path: str,
    keys: list[str],
    key_range: Mapping[str, tuple],
    changes: DataFrame,
) -> DataFrame:
    """The stored versions of `changes`' keys that a run with these changes can alter: per key,
    the version in force at its earliest change (its end moves; `_boundary`) and every version
    after it (ends, currency, filled values). Versions that ended before the key's earliest
    change keep what they have, so a key's old versions are not read again by every run that
    touches it: a run's work grows with its own changes and what came after them, not with the
    key's whole history."""
    firsts = changes.groupBy(*keys).agg(F.min(SEQUENCE).alias("_first"))
    stored = spark.read.format("delta").load(path)
    for key, (low, high) in key_range.items():
        stored = stored.where(F.col(key).between(F.lit(low), F.lit(high)))
    # A version's end is the next one's start: the one in force at `_first` ends at or after it.
    affected = stored.join(firsts, on=keys).where(
        F.col(END_SEQUENCE).isNull() | (F.col(END_SEQUENCE) >= F.col("_first"))
    )
    return affected.withColumn("_boundary", F.col(SEQUENCE) < F.col("_first")).drop("_first")


def _derived(
    spec: TableSpec, new: DataFrame, stored: DataFrame, data: list[str], fields: list[str]
) -> DataFrame:
    """The hour's keys' versions, stored (`_affected_versions`) and new together, one per key
    and source sequence, each with its end (the next version's start), its currency and its
    filled-in TOASTed values; `_new`/`_stored` say where a version came from, `_was_current`
    what it was."""
    keys = list(spec.primary_key)
    identity = [*keys, *(F.col(f"{SEQUENCE}.{f}") for f in fields)]
    both = stored.select(
        *stored.columns, F.lit(False).alias("_new"), F.col(CURRENT).alias("_was_current")
    ).unionByName(
        new.select(*new.columns, F.lit(True).alias("_new"), F.lit(False).alias("_was_current")),
        allowMissingColumns=True,
    )
    # One row per version: the lowest Kafka coordinates' (a stored row on a tie).
    ranked = Window.partitionBy(*identity).orderBy(F.col(SEQUENCE), F.col("_new"))
    per_version = Window.partitionBy(*identity)
    if MOVED_FROM in both.columns:  # whichever delivery (or run) saw the header
        both = both.withColumn(MOVED_FROM, F.first(MOVED_FROM, ignorenulls=True).over(per_version))
    one = (
        both.withColumn("_rank", F.row_number().over(ranked))
        .withColumn("_any_new", F.max(F.col("_new").cast("int")).over(per_version) == 1)
        .withColumn("_any_stored", F.min(F.col("_new").cast("int")).over(per_version) == 0)
        .withColumn("_was", F.max(F.col("_was_current").cast("int")).over(per_version) == 1)
        .where(F.col("_rank") == 1)
        .select(
            *[c for c in both.columns if c not in ("_new", "_was_current", "_boundary")],
            F.coalesce(F.col("_boundary"), F.lit(False)).alias("_boundary"),
            F.col("_any_new").alias("_new"),
            F.col("_any_stored").alias("_stored"),
            F.col("_was").alias("_was_current"),
        )
    )
    ordered = Window.partitionBy(*keys).orderBy(SEQUENCE)
    derived = (
        one.withColumn(END_SEQUENCE, F.lead(SEQUENCE).over(ordered))
        .withColumn(VALID_TO, F.lead(VALID_FROM).over(ordered))
        .withColumn(CURRENT, F.lead(SEQUENCE).over(ordered).isNull())
    )
    if not spec.toasted_columns:
        return derived.drop("_boundary")
    # A key's life ends with a delete: a value carried before it is not the next life's (a row
    # moved to the key later starts without one, as in the mirror).
    before = ordered.rowsBetween(Window.unboundedPreceding, -1)
    life = F.coalesce(F.sum(F.col(DELETED).cast("int")).over(before), F.lit(0))
    derived = derived.withColumn("_life", life)
    upto = (
        Window.partitionBy(*keys, "_life")
        .orderBy(SEQUENCE)
        .rowsBetween(Window.unboundedPreceding, Window.currentRow)
    )
    for c in spec.toasted_columns:
        # A version stored before the column was toasted has no flag: its value is its own.
        # The version in force before the run's changes (`_boundary`) passes on the value it was
        # filled with: the versions it was filled from are not read again.
        flag = unknown_flag(c)  # none yet in a history written before c was toasted
        known = ~F.coalesce(F.col(flag), F.lit(False)) if flag in derived.columns else F.lit(True)
        carries = F.coalesce(F.col(has_value(c)), F.lit(True)) | (F.col("_boundary") & known)
        if flag in derived.columns and MOVED_FROM in derived.columns:
            # A stored version a move began passes on the value `history_moves` gave it (an
            # hour's version has no flag yet): nothing before it in its life can change it.
            given = F.col(MOVED_FROM).isNotNull() & F.coalesce(~F.col(flag), F.lit(False))
            carries = carries | given
        carried = F.last(F.when(carries, F.struct(F.col(c).alias("v"))), True)
        newest = carried.over(upto)
        derived = derived.withColumn(c, newest["v"]).withColumn(unknown_flag(c), newest.isNull())
    return derived.drop("_life", "_boundary")


def audit_history(
    spark: SparkSession,
    spec: TableSpec,
    path: str,
    mirror_path: str,
    changes: DataFrame,
    data: list[str],
    key_range: Mapping[str, tuple] | None = None,
) -> HistoryAudit:
    """Judges the stored versions of the hour's keys (the keys of `changes`) after the run
    against themselves and the mirror (`HistoryAudit`), read back from both tables in one Spark
    action: the versions and the mirror's live rows of those keys side by side, grouped by key
    once. The versions judged are those the run could alter (`_affected_versions`); the ones
    that ended before a key's earliest change were judged by the run that wrote them. A key
    with several current versions (`current_not_one`) or several live mirror rows (the
    mirror's `primary_key_unique`) is compared by its newest of each, once."""
    keys = list(spec.primary_key)
    bounds = key_range or {}
    hour_keys = changes.select(*keys).distinct()
    mirror = _mirror_rows(spark, mirror_path, keys, bounds, hour_keys).where(~F.col(DELETED))
    compared = [c for c in data if c not in keys and c in mirror.columns]
    flags = [unknown_flag(c) for c in spec.toasted_columns]
    versions = _affected_versions(spark, path, keys, bounds, changes).select(
        *keys,
        F.lit(True).alias(IS_VERSION),
        SEQUENCE,
        END_SEQUENCE,
        VALID_FROM,
        VALID_TO,
        CURRENT,
        DELETED,
        *compared,
        *flags,
    )
    # The mirror's own unknown flags: a value neither side knows, or only the history (the
    # mirror looks a moved row's value up in the old key's row as it is now), is not compared.
    mirror_flags = [f for f in flags if f in mirror.columns]
    mirror_rows = mirror.select(
        *keys,
        F.lit(False).alias(IS_VERSION),
        SEQUENCE,
        *compared,
        *[F.col(f).alias(f"{AUDIT}mirror{f}") for f in mirror_flags],
    )
    rows = versions.unionByName(mirror_rows, allowMissingColumns=True)
    # Each key's versions in order, its mirror rows after them (false sorts last here).
    ordered = Window.partitionBy(*keys).orderBy(F.col(IS_VERSION).desc(), F.col(SEQUENCE))

    def following(column: str) -> Column:
        """The key's next version's `column` (null after its last version)."""
        return F.when(F.lead(IS_VERSION).over(ordered), F.lead(column).over(ordered))

    broken = F.col(IS_VERSION) & (
        ~F.col(END_SEQUENCE).eqNullSafe(following(SEQUENCE))
        | ~F.col(VALID_TO).eqNullSafe(following(VALID_FROM))
        | (F.col(CURRENT) != following(SEQUENCE).isNull())
    )
    current = F.col(IS_VERSION) & F.col(CURRENT)
    in_mirror = ~F.col(IS_VERSION)

    def newest(condition: Column, *columns: str) -> Column:
        """The key's row with the highest sequence among those meeting `condition`."""
        picked = F.struct(*[F.col(c).alias(c) for c in columns])
        return F.max_by(F.when(condition, picked), F.when(condition, F.col(SEQUENCE)))

    # A window's value can't go inside an aggregate: each row's verdict is a column first.
    per_key = (
        rows.withColumn(f"{AUDIT}broken", broken)
        .groupBy(*keys)
        .agg(
            F.max(F.col(IS_VERSION).cast("int")).alias(f"{AUDIT}versions"),
            F.count(F.when(current, 1)).alias(f"{AUDIT}current"),
            F.count(F.when(F.col(f"{AUDIT}broken"), 1)).alias(f"{AUDIT}broken"),
            newest(current, DELETED, SEQUENCE, *compared, *flags).alias(f"{AUDIT}h"),
            newest(
                in_mirror, SEQUENCE, *compared, *[f"{AUDIT}mirror{f}" for f in mirror_flags]
            ).alias(f"{AUDIT}m"),
        )
    )

    def h(column: str) -> Column:
        """A column of the key's current version."""
        return F.col(f"{AUDIT}h.`{column}`")

    def m(column: str) -> Column:
        """A column of the key's live mirror row."""
        return F.col(f"{AUDIT}m.`{column}`")

    in_history = F.col(f"{AUDIT}h").isNotNull() & ~h(DELETED)
    mirrored = F.col(f"{AUDIT}m").isNotNull()
    same = F.lit(True)
    for c in compared:
        equal = h(c).eqNullSafe(m(c))
        if c in spec.toasted_columns:
            equal = equal | h(unknown_flag(c))
            if unknown_flag(c) in mirror_flags:
                equal = equal | F.coalesce(m(f"{AUDIT}mirror{unknown_flag(c)}"), F.lit(False))
        same = same & equal
    # delete_mode: hard converges only in order (cdc_assets/rule.py): an older change that ran
    # after the delete put the row back in the mirror. The history is right; counted apart.
    revived = F.lit(spec.delete_mode == "hard") & F.coalesce(
        h(DELETED) & mirrored & (m(SEQUENCE) < h(SEQUENCE)),
        F.lit(False),
    )
    differs = ~revived & ((in_history != mirrored) | (in_history & mirrored & ~same))
    unknown = F.lit(False)
    for c in spec.toasted_columns:
        unknown = unknown | (in_history & F.coalesce(h(unknown_flag(c)), F.lit(False)))
    has_versions = F.col(f"{AUDIT}versions") == 1
    found = per_key.agg(
        F.count(F.when(has_versions, 1)).alias("keys"),
        F.count(F.when(has_versions & (F.col(f"{AUDIT}current") != 1), 1)).alias("current_not_one"),
        F.coalesce(F.sum(f"{AUDIT}broken"), F.lit(0)).alias("broken"),
        F.count(F.when(differs, 1)).alias("mismatches"),
        F.count(F.when(unknown, 1)).alias("unknown"),
        F.count(F.when(revived, 1)).alias("revived"),
    ).first()
    return HistoryAudit(
        keys=int(found["keys"]),
        current_not_one=int(found["current_not_one"]),
        broken_intervals=int(found["broken"]),
        mirror_mismatches=int(found["mismatches"]),
        unknown=int(found["unknown"]),
        revived_by_hard_delete_order=int(found["revived"]),
    )


def as_of(history: DataFrame, moment: Column) -> DataFrame:
    """The table as it was at `moment` (source time): each key's version in force then, live
    ones only. The query docs/reading.md gives, as a function for tests and notebooks."""
    in_force = (F.col(VALID_FROM) <= moment) & (
        F.col(VALID_TO).isNull() | (moment < F.col(VALID_TO))
    )
    return history.where(in_force & ~F.col(DELETED))
