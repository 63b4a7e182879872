"""Tracked columns: a history whose versions open only when a tracked column changes.

A table with `history_columns` (the tracked ones) or `history_except_columns` (the ones left
out) keeps two tables. `<table>__history_changes` holds a version per change, exactly what
`cdc_assets.history` writes for any history (every change, right in any hour order, TOASTed
values filled). `<table>__history`, the one readers query, is folded from it: a key's change
opens a version when it is the key's first, a delete, the first change after a delete, or
when a tracked column differs from the change before it (TOASTed values as filled); any other
change updates the version in force in place (as Spark's AUTO CDC does with
`track_history_column_list`). A folded version starts where its first change starts (its
sequence, source time, operation and Kafka coordinates), holds its last change's values (and
hour, ingestion time, TOASTed values' flags), and ends where the key's next version starts.

The per-change table is the raw store that keeps this right in any hour order: a change that
arrives late may split a folded version or join two, and only the changes say how. Each run
folds again, for the keys its hour touches, the stored changes from the one just before the
key's earliest change of the hour on, that one as part of the version it is in (which keeps
its start; nothing before it can change), so a run's work does not grow with the length of a
version. It MERGEs the result on (key, start sequence): new versions inserted, changed ones
updated, and folded versions that no longer start a version deleted. Its commit comes after
the per-change table's and carries the same run record; a run that dies between them is
completed by running the hour again, which folds the same range from the stored changes.

The setting is fixed when the history is created (`TRACKING_PROPERTY` on `<table>__history`):
a run refuses a history built with other tracked columns, or without them, naming the fix;
`cdc_assets.history_refold` folds the whole history again under the new setting.
"""

from __future__ import annotations

import functools
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
    has_value,
    source_fields,
)
from cdc_assets.commits import delta_log, retry_on_conflict, stored_table
from cdc_assets.config import TableSpec
from cdc_assets.history import (
    AUDIT,
    CURRENT,
    END_SEQUENCE,
    VALID_FROM,
    VALID_TO,
    changed_columns,
    ensure_history_table,
    execute_recorded,
    history_name,
    record_once,
    replayed,
    same_version,
)
from cdc_assets.merge import MirrorSettingError, fill_defaults
from cdc_assets.toast import unknown_flag

CHANGES_SUFFIX = "__history_changes"
# `<table>__history`'s property naming the tracked columns it was folded by.
TRACKING_PROPERTY = "cdc.history.tracking"
DROP = f"{AUDIT}drop"  # a source row of the fold's MERGE deleting a version that no longer is

# Columns every version has that are not the source's (`history.version_columns`).
_PIPELINE = {OP, DELETED, SEQUENCE, END_SEQUENCE, VALID_FROM, VALID_TO, CURRENT}
_PIPELINE |= {KAFKA_PARTITION, KAFKA_OFFSET, HOUR, INGESTED_AT}
# What a version takes from its first change; the rest, but its end, from its last.
_STARTS = (SEQUENCE, VALID_FROM, OP, DELETED, KAFKA_PARTITION, KAFKA_OFFSET)
# Recomputed from the versions' order after folding.
_DERIVED = {END_SEQUENCE, VALID_TO, CURRENT}
_FLAGS = (has_value(""), unknown_flag(""))


def tracking(spec: TableSpec) -> str | None:
    """The table's tracked-columns setting as `<table>__history` records it; None: every
    change is a version (no `__history_changes` table)."""
    if spec.history_columns is not None:
        return "columns:" + ",".join(sorted(c.lower() for c in spec.history_columns))
    if spec.history_except_columns:
        return "except:" + ",".join(sorted(c.lower() for c in spec.history_except_columns))
    return None


def changes_name(spec: TableSpec) -> str:
    return f"{spec.name}{CHANGES_SUFFIX}"


def per_change_name(spec: TableSpec) -> str:
    """The table holding a version per change: the history itself, unless columns are tracked."""
    return changes_name(spec) if tracking(spec) else history_name(spec)


def history_tables(spec: TableSpec) -> list[str]:
    """The tables a `history: true` table keeps beside its mirror ([] without history)."""
    if not spec.history:
        return []
    return [history_name(spec), *([changes_name(spec)] if tracking(spec) else [])]


def untracked_columns(spec: TableSpec, columns: list[str]) -> list[str]:
    """Of the history's data `columns`, the non-key ones whose changes alone open no version
    (with `history_columns`, every column not listed, added ones included)."""
    keys = set(spec.primary_key)
    if spec.history_columns is not None:
        tracked = set(spec.history_columns)
        return [c for c in columns if c not in keys and c not in tracked]
    return [c for c in columns if c in spec.history_except_columns]


def check_tracking(
    spark: SparkSession, spec: TableSpec, history_path: str, changes_path: str, s3_client=None
) -> None:
    """Refuses, before the run reads anything, a history built with other tracked columns
    than the table's (turned on, off, or changed), and a tracked history whose changes' table
    is gone (its folds would lose versions)."""
    wanted = tracking(spec)
    found = stored_table(spark, history_path, delta_log(history_path, s3_client))
    history = found.schema is not None
    log = delta_log(changes_path, s3_client)
    changes = log.exists() if log is not None else DeltaTable.isDeltaTable(spark, changes_path)
    stored = found.properties.get(TRACKING_PROPERTY) if history else None
    if not history or (stored == wanted and changes == (wanted is not None)):
        return  # a new history (or one whose first fold a crash cut short), or as set
    now = tracking_text(wanted)
    if stored == wanted:  # tracked, its changes' table gone
        problem = f"its changes' table {changes_path} is missing"
        fix = (
            f"put {changes_path} back, or rebuild the history: move {history_path} aside and "
            "run the table's hours again from its first one (while Kafka holds them)"
        )
    elif wanted is None and stored is None:  # a changes' table beside a per-change history
        problem = f"{changes_path} exists beside it, which only tracked columns keep"
        fix = f"move {changes_path} aside if it is left from an earlier setting"
    elif wanted is None:
        problem = f"it was built with {tracking_text(stored)}, and the table now sets {now}"
        fix = (
            f"set {tracking_text(stored)} again, or keep every change as a version from now on: "
            f"move {history_path} aside and rename {changes_path} to {history_path} (it holds "
            "every change as one)"
        )
    else:
        problem = f"it was built with {tracking_text(stored)}, and the table now sets {now}"
        fix = (
            f"set {tracking_text(stored)} again, or fold the history again under the new setting "
            "from the changes it keeps (no Kafka needed), while no hour of the table runs: "
            f"python -m cdc_assets.history_refold --table {spec.name}"
        )
    raise MirrorSettingError(
        f"table '{spec.name}': its history at {history_path} can't be written: {problem}; a "
        f"history keeps the versions it was built with. To go on, {fix}."
    )


def tracking_text(tracked: str | None) -> str:
    """A `tracking` value as the tables file writes it."""
    if tracked is None:
        return "no tracked columns (every change a version)"
    kind, _, names = tracked.partition(":")
    setting = "history_columns" if kind == "columns" else "history_except_columns"
    return f"{setting}: [{', '.join(n for n in names.split(',') if n)}]"


@dataclass(frozen=True)
class FoldOutcome:
    """What one run did to the folded history: the versions it derived for the hour's keys
    (from the start of each key's version in force at its earliest change on), and of them
    the ones the MERGE inserted and updated, the folded versions it deleted (joined into an
    earlier one by a late change), and its commit's version."""

    versions: int
    inserted: int
    updated: int
    deleted: int
    version: int | None
    # The commit that recorded the run (the MERGE's or a metadata-only one; None: none).
    recorded_version: int | None = None


def fold_history(
    spark: SparkSession,
    spec: TableSpec,
    path: str,
    changes_path: str,
    changes: DataFrame,
    *,
    run_metadata: dict,
    key_range: Mapping[str, tuple] | None = None,
    defaults: Mapping[str, Any] | None = None,
    s3_client=None,
) -> FoldOutcome:
    """Folds the hour's keys' stored changes (`changes_path`, written by this run already)
    into the versions of `<table>__history` at `path` (created on the first run, recording
    the setting), in one commit carrying `run_metadata`; a run that changes nothing records
    itself in a metadata-only commit. A column with a default that the history gains shows it
    in the versions from before, as in the changes' table (`merge.fill_defaults`)."""
    return retry_on_conflict(
        lambda: _fold_once(
            spark,
            spec,
            path,
            changes_path,
            changes,
            run_metadata,
            key_range or {},
            defaults or {},
            s3_client,
        ),
        table=history_name(spec),
        path=path,
    )


def _fold_once(
    spark: SparkSession,
    spec: TableSpec,
    path: str,
    changes_path: str,
    changes: DataFrame,
    run_metadata: dict,
    key_range: Mapping[str, tuple],
    defaults: Mapping[str, Any],
    s3_client,
) -> FoldOutcome:
    keys = list(spec.primary_key)
    ledger = delta_log(path, s3_client)
    stored_changes = _in_range(spark.read.format("delta").load(changes_path), key_range)
    schema = _folded_schema(stored_changes)
    columns = [f.name for f in schema]
    fields = source_fields(schema[SEQUENCE].dataType)
    setting = {TRACKING_PROPERTY: tracking(spec) or ""}
    target_schema = ensure_history_table(spark, path, schema, spec, ledger, run_metadata, setting)
    if replayed(ledger, run_metadata):
        return FoldOutcome(0, 0, 0, 0, None, record_once(spark, path, run_metadata, ledger))
    # Not into deletes' versions: the decoder gives a delete's before-image no default.
    deleted = ~F.col(DELETED)
    if fill_defaults(
        spark, path, spec, schema, defaults, target_schema, deleted, run_metadata=run_metadata
    ):
        target_schema = DeltaTable.forPath(spark, path).toDF().schema  # a column was added
    table = DeltaTable.forPath(spark, path)
    stored_names = {f.name.lower() for f in target_schema}

    def position(column: str) -> Column:
        """Where a change stands in its key's order at the source (Kafka coordinates aside:
        a change delivered twice stands in one place)."""
        return F.struct(*[F.col(f"{column}.{f}").alias(f) for f in fields])

    # Per key of the hour: its earliest change, the stored change just before it, and the
    # folded version that change belongs to (the version in force at `_first`).
    firsts = changes.groupBy(*keys).agg(F.min(position(SEQUENCE)).alias("_first"))
    mine = stored_changes.join(firsts, on=keys)
    before = mine.where(position(SEQUENCE) < F.col("_first")).groupBy(*keys)
    before = before.agg(
        F.max(position(SEQUENCE)).alias("_before"), F.min(position(SEQUENCE)).alias("_earliest")
    )
    versions = _in_range(spark.read.format("delta").load(path), key_range).join(firsts, on=keys)
    target = {f.name: f.dataType for f in target_schema}
    start = F.struct(
        *[
            (F.col(c) if c in target else F.lit(None).cast(schema[c].dataType)).alias(c)
            for c in _STARTS
        ]
    )
    in_force = (
        versions.join(before, on=keys)
        .where(
            (position(SEQUENCE) <= F.col("_before"))
            & (F.col(END_SEQUENCE).isNull() | (position(END_SEQUENCE) > F.col("_before")))
        )
        .groupBy(*keys)  # one, unless the stored versions overlap
        .agg(F.max_by(start, position(SEQUENCE)).alias("_start"))
    )
    # Folded again from the change before the hour's earliest, as part of the version it is
    # in (which keeps its start); from the hour's earliest where it is the key's first; from
    # the key's first where no stored version holds the change before (a fold a crash left
    # undone): that one is folded whole.
    plan = (
        firsts.join(before, on=keys, how="left")
        .join(in_force, on=keys, how="left")
        .select(
            *keys,
            "_first",
            "_start",
            F.when(F.col("_before").isNull(), F.col("_first"))
            .when(F.col("_start").isNotNull(), F.col("_before"))
            .otherwise(F.col("_earliest"))
            .alias("_from"),
            (F.col("_before").isNotNull() & F.col("_start").isNull()).alias("_whole"),
        )
    )
    refolded = (
        mine.drop("_first")
        .join(plan, on=keys)
        .where(position(SEQUENCE) >= F.col("_from"))
        .drop("_first", "_from", "_whole")
    )
    # The stored versions the fold may change or remove: the one in force at `_first` and
    # every later one (all of a key folded whole).
    affected = (
        versions.drop("_first")
        .join(plan, on=keys)
        .where(
            F.col("_whole")
            | F.col(END_SEQUENCE).isNull()
            | (position(END_SEQUENCE) >= F.col("_first"))
        )
    )
    folded = _folded(spec, refolded, columns, schema)
    identity = [*keys, *(F.col(f"{SEQUENCE}.{f}").alias(f"_id_{f}") for f in fields)]
    gone = affected.select(*identity, SEQUENCE).join(
        folded.select(*identity), on=[*keys, *(f"_id_{f}" for f in fields)], how="left_anti"
    )
    source = folded.select(*columns, F.lit(False).alias(DROP)).unionByName(
        gone.select(*keys, SEQUENCE, F.lit(True).alias(DROP)), allowMissingColumns=True
    )
    same = same_version(keys, fields, key_range)
    merge = table.alias("t").merge(source.alias("s"), same)
    if any(c.lower() not in stored_names for c in columns):
        merge = merge.withSchemaEvolution()
    changed = changed_columns(columns, stored_names)
    merge = (
        merge.whenMatchedDelete(condition=f"s.`{DROP}`")
        .whenMatchedUpdate(
            condition=f"NOT s.`{DROP}` AND ({changed})",
            set={c: F.col(f"s.`{c}`") for c in columns},
        )
        .whenNotMatchedInsert(
            condition=f"NOT s.`{DROP}`", values={c: F.col(f"s.`{c}`") for c in columns}
        )
    )
    metrics, version, recorded = execute_recorded(spark, spec, path, merge, run_metadata, ledger)

    def metric(name: str) -> int:
        return int(metrics.get(name) or 0)

    # Every version that no longer is matches its stored row and is deleted: the versions
    # derived are the MERGE's source rows less those.
    return FoldOutcome(
        versions=metric("numSourceRows") - metric("numTargetRowsDeleted"),
        inserted=metric("numTargetRowsInserted"),
        updated=metric("numTargetRowsUpdated"),
        deleted=metric("numTargetRowsDeleted"),
        version=version,
        recorded_version=recorded,
    )


def fold_all(spec: TableSpec, changes: DataFrame) -> DataFrame:
    """Every key's versions folded from all of its `changes` (a changes' table whole) by
    `spec`'s tracked columns: what `<table>__history` holds for them
    (`cdc_assets.history_refold`)."""
    schema = _folded_schema(changes)
    starts = T.StructType([schema[c] for c in _STARTS])
    rows = changes.withColumn("_start", F.lit(None).cast(starts))
    return _folded(spec, rows, [f.name for f in schema], schema)


def _folded_schema(changes: DataFrame) -> T.StructType:
    """The folded history's columns: the changes' table's but `_cdc_moved_from`, which says
    how one change began its key's life (`cdc_assets.history_moves`), not a version."""
    return T.StructType([f for f in changes.schema if f.name != MOVED_FROM])


def _in_range(frame: DataFrame, key_range: Mapping[str, tuple]) -> DataFrame:
    """`frame`'s rows inside the hour's key range (Delta skips the files outside it)."""
    for key, (low, high) in key_range.items():
        frame = frame.where(F.col(key).between(F.lit(low), F.lit(high)))
    return frame


def _folded(
    spec: TableSpec, rows: DataFrame, columns: list[str], schema: T.StructType
) -> DataFrame:
    """The versions of `rows` (changes, each key's from one that starts a version or continues
    the stored version `_start` on), folded by the tracked columns, with their ends and
    currency; columns keep their metadata."""
    keys = list(spec.primary_key)
    data = [c for c in columns if c not in _PIPELINE and not c.startswith(_FLAGS)]
    untracked = set(untracked_columns(spec, data))
    tracked = [c for c in data if c not in keys and c not in untracked]
    ordered = Window.partitionBy(*keys).orderBy(SEQUENCE)

    def before(column: str) -> Column:
        return F.lag(F.col(column)).over(ordered)

    # A key's first change, a delete and the change after it open a version; so does a change
    # whose tracked values differ from the change before it.
    opens = functools.reduce(
        lambda a, b: a | b,
        [~F.col(c).eqNullSafe(before(c)) for c in tracked],
        F.coalesce(before(DELETED), F.lit(True)) | F.col(DELETED),
    )
    upto = ordered.rowsBetween(Window.unboundedPreceding, Window.currentRow)
    numbered = rows.withColumn("_opens", opens).withColumn(
        "_version", F.sum(F.col("_opens").cast("int")).over(upto)
    )
    # A version starts as its first change did (the first one folded here as the stored
    # version it continues, `_start`) and holds its last change's values.
    last = [c for c in columns if c not in keys and c not in _STARTS and c not in _DERIVED]
    versions = numbered.groupBy(*keys, "_version").agg(
        F.min_by(F.struct(*_STARTS), F.col(SEQUENCE)).alias("_f"),
        F.first("_start", ignorenulls=True).alias("_start"),
        F.max_by(F.struct(*last), F.col(SEQUENCE)).alias("_l"),
    )
    continued = (F.col("_version") == 1) & F.col("_start").isNotNull()
    versions = versions.withColumn("_f", F.when(continued, F.col("_start")).otherwise(F.col("_f")))
    flat = versions.select(
        *keys,
        *[F.col(f"_f.`{c}`").alias(c) for c in _STARTS],
        *[F.col(f"_l.`{c}`").alias(c) for c in last],
    )
    following = Window.partitionBy(*keys).orderBy(SEQUENCE)
    ended = (
        flat.withColumn(END_SEQUENCE, F.lead(SEQUENCE).over(following))
        .withColumn(VALID_TO, F.lead(VALID_FROM).over(following))
        .withColumn(CURRENT, F.lead(SEQUENCE).over(following).isNull())
    )
    return ended.select(*[F.col(c).alias(c, metadata=schema[c].metadata) for c in columns])
