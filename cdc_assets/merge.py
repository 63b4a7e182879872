"""Newest change per key → one guarded Delta MERGE; bad records → the table's error table.

Convergence (I3): a change is applied only when its sequence is greater than the row's, so
running hours in any order, any number of times, ends in the same table. A delete keeps the key
and its sequence as a soft-deleted row (`_cdc_deleted = true`, with the delete's before-image),
so an older change replayed later is stale against it and can't resurrect the row. Readers select
`_cdc_deleted = false` (the `live_rows` helper) to see the source table.

Atomicity (I4): the mirror changes in exactly one Delta commit per run, the MERGE, which carries
the hour's slice and counts as its commit metadata. The error table is written first with an
insert-only MERGE keyed by (topic, partition, offset), so a rerun after a crash adds nothing twice.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

from delta import exceptions as delta_errors
from delta.tables import DeltaTable
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from cdc_assets import toast
from cdc_assets.config import TableSpec
from cdc_assets.decode import (
    DELETED,
    ERROR,
    HOUR,
    INGESTED_AT,
    KAFKA_OFFSET,
    KAFKA_PARTITION,
    OP,
    SEQUENCE,
    SOURCE_TS,
    value_sequence,
)
from cdc_assets.ledger import DeltaLog
from cdc_assets.sealing import check_error_table, error_table_schema

log = logging.getLogger(__name__)
T_ = TypeVar("T_")

# A Delta commit that lost a race with another writer: nothing of it was committed, and every
# write here is guarded (sequence or Kafka coordinates), so doing it again is safe.
COMMIT_CONFLICTS = (
    delta_errors.DeltaConcurrentModificationException,
    delta_errors.ConcurrentWriteException,
    delta_errors.MetadataChangedException,
    delta_errors.ProtocolChangedException,
    delta_errors.ConcurrentAppendException,
    delta_errors.ConcurrentDeleteReadException,
    delta_errors.ConcurrentDeleteDeleteException,
    delta_errors.ConcurrentTransactionException,
)
CONFLICT_ATTEMPTS = 5


class CommitConflictError(RuntimeError):
    """Another writer kept winning the commit race on a table."""


DELETION_VECTORS_PROPERTY = "delta.enableDeletionVectors"


class MirrorSettingError(RuntimeError):
    """The mirror was created with another setting than the table's config now names."""


def retry_on_conflict(
    write: Callable[[], T_], *, table: str, path: str, attempts: int = CONFLICT_ATTEMPTS
) -> T_:
    """Runs `write`, again after a Delta commit conflict, at most `attempts` times in all.

    Each attempt re-reads the table, so the retry sees what the other writer committed; the
    sequence guard keeps the result the same whichever writer wins.
    """
    for attempt in range(1, attempts + 1):
        try:
            return write()
        except COMMIT_CONFLICTS as exc:
            kind = type(exc).__name__
            if attempt == attempts:
                raise CommitConflictError(
                    f"table '{table}': the commit to {path} lost {attempts} races in a row to "
                    f"another writer (last: {kind}). One run per table writes at a time when runs "
                    "go through the table's pool; look for a writer outside Dagster or a pool "
                    "limit above 1."
                ) from exc
            pause = min(8.0, 0.5 * 2 ** (attempt - 1)) * (0.5 + random.random())
            log.warning(
                "table '%s': Delta commit conflict (%s), attempt %d of %d; retrying in %.1f s",
                table,
                kind,
                attempt,
                attempts,
                pause,
            )
            time.sleep(pause)
    raise AssertionError("unreachable")


COMMIT_METADATA_CONF = "spark.databricks.delta.commitInfo.userMetadata"
METADATA_COLUMNS = (OP, SEQUENCE, SOURCE_TS, KAFKA_PARTITION, KAFKA_OFFSET, HOUR, INGESTED_AT)

ERROR_TABLE_SCHEMA = T.StructType(
    [
        T.StructField("topic", T.StringType(), False),
        T.StructField("partition", T.IntegerType(), False),
        T.StructField("offset", T.LongType(), False),
        T.StructField("kafka_timestamp", T.TimestampType(), True),
        T.StructField("key", T.BinaryType(), True),
        T.StructField("value", T.BinaryType(), True),
        T.StructField("reason", T.StringType(), False),
        T.StructField("hour", T.StringType(), False),
        T.StructField("ingested_at", T.TimestampType(), False),
    ]
)


@dataclass(frozen=True)
class PriorRows:
    """The mirror's rows for the hour's keys just before its MERGE, counted against the hour's
    newest change per key (one Spark job over the key and sequence columns, `prior_rows`).

    `inserted`, `updated` and `deleted` are live rows: a soft delete is an update to Delta and a
    deleted row to the reader; a change older than the row's is none of them.
    """

    source_rows: int  # the hour's keys (the MERGE's source rows)
    new_keys: int  # of them, keys the mirror has no row for: the MERGE must insert these
    live_rows: int  # live rows of the mirror under the hour's keys
    duplicate_live_rows: int  # of them, rows of a key with more than one live row
    inserted: int
    updated: int
    deleted: int


NO_PRIOR_ROWS = PriorRows(0, 0, 0, 0, 0, 0, 0)


@dataclass(frozen=True)
class MergeOutcome:
    version: int | None  # None: no commit was needed (every change was stale)
    merged_keys: int  # the MERGE's source rows: one newest change per key
    applied: int
    rows_inserted: int
    rows_updated: int
    rows_deleted: int
    # Rows a truncate in the hour deleted (among `rows_deleted`, not `applied`).
    truncated: int = 0
    # Rows the MERGE inserted (Delta's operation metrics), and what the mirror held before.
    rows_added: int = 0
    prior: PriorRows = NO_PRIOR_ROWS

    @property
    def duplicate_rows(self) -> int:
        """Live rows sharing a primary key among the hour's keys once the MERGE committed: the
        ones there before, and the rows the MERGE inserted for keys the mirror already had
        (a row it should have matched: a lost race, a pruning bound that missed it)."""
        return self.prior.duplicate_live_rows + max(0, self.rows_added - self.prior.new_keys)


def mirror_columns(spec: TableSpec) -> list[str]:
    return [*spec.columns, *METADATA_COLUMNS, DELETED, *toast.mirror_columns(spec)]


def latest_per_key(changes: DataFrame, spec: TableSpec) -> DataFrame:
    """The newest change of each primary key in the slice (one aggregation, no sort).

    Toasted columns follow their own rule (`cdc_assets/toast.py`).
    """
    toasted = set(spec.toasted_columns)
    row = [c for c in [*spec.columns, *METADATA_COLUMNS, DELETED] if c != INGESTED_AT]
    newest = F.max_by(F.struct(*[F.col(c) for c in row if c not in toasted]), F.col(SEQUENCE))
    aggregates, toasts = toast.batch_columns(spec, changes)
    return (
        changes.groupBy(*spec.primary_key)
        .agg(newest.alias("_newest"), *aggregates)
        .select(*[F.col(f"_newest.{c}").alias(c) for c in row if c not in toasted], *toasts)
    )


def mirror_schema(spark: SparkSession, path: str) -> T.StructType | None:
    """The stored mirror's schema, None before its first run."""
    if not DeltaTable.isDeltaTable(spark, path):
        return None
    return DeltaTable.forPath(spark, path).toDF().schema


def added_columns(schema: T.StructType | None, spec: TableSpec) -> dict[str, str]:
    """Source columns the mirror gained without a declaration (name → type), from its schema."""
    if schema is None:
        return {}
    known = {c.lower() for c in [*spec.columns, *spec.sensitive, *mirror_columns(spec)]}
    return {f.name: f.dataType.simpleString() for f in schema if f.name.lower() not in known}


def ensure_mirror_table(
    spark: SparkSession, path: str, changes: DataFrame, spec: TableSpec
) -> DeltaTable:
    """Creates the mirror the first time (deletion vectors on; the change data feed as the
    table's `change_data_feed` says); new columns come via MERGE.

    The columns of the toasted-value rule are added first if the table predates them,
    because the MERGE reads them from the table; a `change_data_feed` set true or false is
    applied to an existing mirror that differs.
    """
    schema = changes.schema
    feed = bool(spec.change_data_feed)
    table = (
        DeltaTable.createIfNotExists(spark)
        .location(path)
        .addColumns(schema)
        .property(CHANGE_DATA_FEED, str(feed).lower())
        .property(DELETION_VECTORS_PROPERTY, str(spec.deletion_vectors).lower())
        .execute()
    )
    quoted = path.replace("`", "``")
    properties = table_properties(spark, path)
    check_deletion_vectors(path, spec, properties)
    if spec.change_data_feed is not None and properties.get(CHANGE_DATA_FEED, "false") != (
        str(feed).lower()
    ):
        log.info(
            "table '%s': change_data_feed is %s in the tables file, so the mirror's %s is set "
            "to %s",
            spec.name,
            str(feed).lower(),
            CHANGE_DATA_FEED,
            str(feed).lower(),
        )
        spark.sql(
            f"ALTER TABLE delta.`{quoted}` SET TBLPROPERTIES "
            f"('{CHANGE_DATA_FEED}' = '{str(feed).lower()}')"
        )
    stored = {f.name.lower() for f in table.toDF().schema}
    missing = [
        f"`{name}` {schema[name].dataType.simpleString()}"
        for name in toast.mirror_columns(spec)
        if name.lower() not in stored
    ]
    if missing:
        spark.sql(f"ALTER TABLE delta.`{quoted}` ADD COLUMNS ({', '.join(missing)})")
    return table


CHANGE_DATA_FEED = "delta.enableChangeDataFeed"


def table_properties(spark: SparkSession, path: str) -> dict[str, str]:
    """A Delta table's properties as its metadata holds them (lowercased values); no job."""
    quoted = path.replace("`", "``")
    rows = spark.sql(f"SHOW TBLPROPERTIES delta.`{quoted}`").collect()
    return {row["key"]: str(row["value"]).strip().lower() for row in rows}


def check_deletion_vectors(path: str, spec: TableSpec, properties: Mapping[str, str]) -> None:
    """Refuses a mirror whose deletion-vector setting is not the table's `deletion_vectors`.

    createIfNotExists sets properties only when it creates the table, so a changed setting
    would otherwise be ignored without a word: a reader that needs a mirror without deletion
    vectors would still meet them. Changing it is the operator's step (turning them off
    rewrites every file that has one), so the run names the command instead of running it.
    """
    quoted = path.replace("`", "``")
    # Delta's default is off: a table without the property has no deletion vectors.
    stored = properties.get(DELETION_VECTORS_PROPERTY, "false") == "true"
    if stored == spec.deletion_vectors:
        return
    if spec.deletion_vectors:
        change = f"SET TBLPROPERTIES ('{DELETION_VECTORS_PROPERTY}' = true)"
        effect = "later MERGEs then write deletion vectors; readers need their support"
    else:
        change = "DROP FEATURE deletionVectors"
        effect = (
            "it rewrites the files that have deletion vectors, turns them off and lowers the "
            "table's reader version, so readers without their support can read it"
        )
    raise MirrorSettingError(
        f"table '{spec.name}': setting deletion_vectors is {str(spec.deletion_vectors).lower()}, "
        f"but its mirror at {path} was created with {DELETION_VECTORS_PROPERTY}="
        f"{str(stored).lower()}, and a mirror keeps the setting it was created with. Set "
        f"deletion_vectors: {str(stored).lower()} again, or change the table once with Spark "
        f"(no run writing it meanwhile): ALTER TABLE delta.`{quoted}` {change} ({effect}); "
        "then run the hour again"
    )


def commit_metadata_text(metadata: dict) -> str:
    return json.dumps(metadata, sort_keys=True)


@contextmanager
def commit_metadata(spark: SparkSession, metadata: dict) -> Iterator[None]:
    """Attaches `metadata` to the Delta commits made inside the block."""
    spark.conf.set(COMMIT_METADATA_CONF, commit_metadata_text(metadata))
    try:
        yield
    finally:
        spark.conf.unset(COMMIT_METADATA_CONF)


def merge_changes(
    spark: SparkSession,
    spec: TableSpec,
    path: str,
    latest: DataFrame,
    *,
    ingested_at,
    run_metadata: dict,
    truncate_before: Column | None = None,
    key_range: Mapping[str, tuple] | None = None,
    ledger: DeltaLog | None = None,
) -> MergeOutcome:
    """MERGEs the newest change per key into the mirror with the sequence guard.

    The commit carries `run_metadata`. When no change is newer than the mirror, Delta makes no
    commit; a metadata-only commit then records the run, so every hour's slice is in the log.
    A commit conflict with another writer is retried (`retry_on_conflict`).

    `truncate_before` (a sequence value) is the hour's newest truncate: the same commit deletes
    every row older than it that the hour's changes don't replace.

    `key_range` (primary key column → (lowest, highest) value among `latest`'s keys) narrows
    the join to the target rows in those ranges. It changes no match: every source key lies
    inside. But Delta reads only the files whose statistics overlap the ranges, so an hour
    whose keys are clustered (new ids, recent rows) reads a few files instead of the table.
    """
    return retry_on_conflict(
        lambda: _merge_once(
            spark,
            spec,
            path,
            latest,
            ingested_at=ingested_at,
            run_metadata=run_metadata,
            truncate_before=truncate_before,
            key_range=key_range,
            ledger=ledger or delta_log(path),
        ),
        table=spec.name,
        path=path,
    )


def _merge_once(
    spark: SparkSession,
    spec: TableSpec,
    path: str,
    latest: DataFrame,
    *,
    ingested_at,
    run_metadata: dict,
    truncate_before: Column | None,
    key_range: Mapping[str, tuple] | None = None,
    ledger: DeltaLog | None = None,
) -> MergeOutcome:
    source = latest.withColumn(INGESTED_AT, F.lit(ingested_at).cast("timestamp"))
    source = source.select(*mirror_columns(spec))
    table = ensure_mirror_table(spark, path, source, spec)
    bounds = {} if truncate_before is not None else dict(key_range or {})
    on = F.expr(" AND ".join(f"t.`{key}` = s.`{key}`" for key in spec.primary_key))
    # A truncate's MERGE reads the whole table anyway.
    for key, (low, high) in bounds.items():
        target = F.col(f"t.`{key}`")
        on = on & (target >= F.lit(low)) & (target <= F.lit(high))
    newer = f"s.`{SEQUENCE}` > t.`{SEQUENCE}`"
    inserted = {c: f"s.`{c}`" for c in mirror_columns(spec)}
    # Toasted values and moves follow their own rule, even from a change stale for the row (an
    # older hour run later fills a value in).
    filled, fill = toast.merge_sets(spec)
    prior = prior_rows(spark, spec, path, latest, bounds, fill)
    everything = {**inserted, **filled}
    merge = table.alias("t").merge(source.alias("s"), on)
    stored = {f.name.lower() for f in table.toDF().schema}
    if any(c.lower() not in stored for c in source.columns):
        # A column the source gained (new_columns: add): the MERGE adds it to the mirror.
        # Asked for only then: schema evolution costs every MERGE an analysis of its own.
        merge = merge.withSchemaEvolution()
    if spec.delete_mode == "hard":
        merge = merge.whenMatchedDelete(condition=f"{newer} AND s.`{OP}` = 'd'")
    merge = merge.whenMatchedUpdate(condition=newer, set=everything)
    if filled:
        merge = merge.whenMatchedUpdate(condition=fill, set=filled)
    if spec.delete_mode == "hard":
        merge = merge.whenNotMatchedInsert(condition=f"s.`{OP}` <> 'd'", values=inserted)
    else:
        # A soft delete stores the delete's before-image (the row as the source last had it),
        # so the tombstone row is the same whichever order the hours ran in.
        merge = merge.whenNotMatchedInsertAll()
    if truncate_before is not None:
        older = F.col(f"t.`{SEQUENCE}`") < truncate_before
        if spec.delete_mode == "hard":
            merge = merge.whenNotMatchedBySourceDelete(condition=older)
        else:
            merge = merge.whenNotMatchedBySourceUpdate(
                condition=older & ~F.col(f"t.`{DELETED}`"),
                set={
                    DELETED: F.lit(True),
                    OP: F.lit("t"),
                    # The truncate's own sequence: any older change is stale against it.
                    SEQUENCE: truncate_before,
                    HOUR: F.lit(run_metadata["hour"]),
                    INGESTED_AT: F.lit(ingested_at).cast("timestamp"),
                },
            )
    with commit_metadata(spark, run_metadata):
        metrics = merge.execute().first()
        if not metrics["num_affected_rows"]:
            # Every change was stale (or there was none): Delta committed nothing.
            # A metadata-only commit, so that this run's slice is on record too.
            _ledger_commit(spark, path)
            return MergeOutcome(None, prior.source_rows, 0, 0, 0, 0, prior=prior)
    # This run's commit, not one another writer made since (both carry the same metadata only
    # when they run the same hour, and then the later one commits nothing but the ledger).
    if ledger is not None:  # read from the log's files, no Spark job
        mine = ledger.run_commit(run_metadata, "MERGE")
        version, operation_metrics = mine.version, mine.metrics
    else:
        commit = (
            table.history(20)
            .where(F.col("userMetadata") == commit_metadata_text(run_metadata))
            .where(F.col("operation") == "MERGE")
            .orderBy(F.col("version").desc())
            .select("version", "operationMetrics")
            .first()
        )
        version, operation_metrics = commit["version"], dict(commit["operationMetrics"])
    return _outcome(version, operation_metrics, prior)


LEDGER_OPERATION = "SET TBLPROPERTIES"


def _ledger_commit(spark: SparkSession, path: str) -> None:
    """A commit that changes no data, carrying the session's commit metadata. The path is the
    lake's own, quoted as an identifier (Spark allows no parameter here)."""
    quoted = path.replace("`", "``")
    spark.sql(
        f"ALTER TABLE delta.`{quoted}` SET TBLPROPERTIES "
        "('cdc.ledger' = 'each run records its slice in the commit userMetadata')"
    )


def record_run(
    spark: SparkSession, spec: TableSpec, path: str, run_metadata: dict, ledger: DeltaLog | None
) -> int:
    """Records a run that changed nothing (an empty slice) in a metadata-only commit of the
    existing mirror: no data is read or written. Returns the commit's version."""

    def commit() -> int:
        with commit_metadata(spark, run_metadata):
            _ledger_commit(spark, path)
        if ledger is not None:
            return ledger.run_commit(run_metadata, LEDGER_OPERATION).version
        return current_version(spark, path)

    return retry_on_conflict(commit, table=spec.name, path=path)


def change_feed(spark: SparkSession, path: str, version: int) -> DataFrame:
    """What commit `version` of the table changed: Delta's change data feed of that commit."""
    return (
        spark.read.format("delta")
        .option("readChangeFeed", "true")
        .option("startingVersion", version)
        .option("endingVersion", version)
        .load(path)
    )


def prior_rows(
    spark: SparkSession,
    spec: TableSpec,
    path: str,
    latest: DataFrame,
    key_range: Mapping[str, tuple],
    fill: Column,
) -> PriorRows:
    """The mirror's rows under the hour's keys, as the MERGE is about to find them, counted
    against the hour's changes in one Spark job: the key, deleted flag and sequence of the
    rows in the key range (and the toasted-value rule's columns), joined with the batch.

    What the MERGE will do to each key follows from the CDC rule (`_merge_once`): a change is
    applied when its key has no row or its sequence is newer than the row's; a stale change
    still fills a TOASTed value (`fill`). A row per key is expected; duplicates are counted.
    """
    keys = list(spec.primary_key)
    toasted = (
        []
        if not spec.toasted_columns
        else [toast.MOVED_AT, *map(value_sequence, spec.toasted_columns)]
    )
    target = spark.read.format("delta").load(path)
    for key, (low, high) in key_range.items():
        target = target.where(F.col(key).between(F.lit(low), F.lit(high)))
    rows = target.select(*keys, DELETED, SEQUENCE, *toasted).join(
        latest.select(*keys), on=keys, how="left_semi"
    )
    per_key = rows.groupBy(*keys).agg(
        F.count(F.lit(1)).alias("_rows"),
        F.sum((~F.col(DELETED)).cast("int")).alias("_live"),
        # The newest row of the key (there is one, unless the mirror holds a duplicate).
        F.max_by(F.struct(SEQUENCE, *toasted), F.col(SEQUENCE)).alias("t"),
    )
    # What the rule reads of the hour's change: its deleted flag and sequence (and the toasted
    # rule's columns), not the whole row.
    read = [DELETED, SEQUENCE, *(c for c in toast.mirror_columns(spec) if c in latest.columns)]
    source = latest.select(*keys, F.struct(*read).alias("s"))
    joined = source.join(per_key, on=keys, how="left")
    existed = F.col("_rows").isNotNull()
    was_live = F.coalesce(F.col("_live"), F.lit(0)) > 0
    deleting = F.col(f"s.`{DELETED}`")
    applies = ~existed | (F.col(f"s.`{SEQUENCE}`") > F.col(f"t.`{SEQUENCE}`"))
    filling = existed & ~applies & fill
    if spec.delete_mode == "hard":
        # A delete removes the row it matches; one of a key the mirror lacks inserts nothing.
        gone = applies & deleting & existed
        added_keys = ~existed & ~deleting
    else:
        gone = applies & deleting & (was_live | ~existed)
        added_keys = ~existed

    def total(condition: Column, name: str) -> Column:
        return F.sum(condition.cast("int")).alias(name)

    counted = joined.agg(
        F.count(F.lit(1)).alias("source_rows"),
        total(added_keys, "new_keys"),
        F.sum(F.coalesce(F.col("_live"), F.lit(0))).alias("live_rows"),
        F.sum(F.when(F.col("_live") > 1, F.col("_live"))).alias("duplicate_live_rows"),
        total(applies & ~deleting & ~was_live, "inserted"),
        total((applies & ~deleting & was_live) | (filling & was_live), "updated"),
        total(gone, "deleted"),
    ).first()
    return PriorRows(**{name: int(counted[name] or 0) for name in counted.asDict()})


def _outcome(version: int, metrics: Mapping[str, str], prior: PriorRows) -> MergeOutcome:
    """What MERGE commit `version` did: the keys it took, the changes it applied and the rows
    it inserted from Delta's own operation metrics; the live rows inserted, updated and deleted
    from the rows it found (`prior_rows`), plus those a truncate in the hour deleted."""

    def metric(name: str) -> int:
        return int(metrics.get(name) or 0)

    truncated = metric("numTargetRowsNotMatchedBySourceUpdated") + metric(
        "numTargetRowsNotMatchedBySourceDeleted"
    )
    return MergeOutcome(
        version=version,
        merged_keys=metric("numSourceRows"),
        # Changes newer than their rows (or filling a TOASTed value), inserts of new keys.
        applied=metric("numTargetRowsInserted")
        + metric("numTargetRowsMatchedUpdated")
        + metric("numTargetRowsMatchedDeleted"),
        rows_inserted=prior.inserted,
        rows_updated=prior.updated,
        rows_deleted=prior.deleted + truncated,
        # Rows older than a truncate in the hour, which no change of it replaced.
        truncated=truncated,
        rows_added=metric("numTargetRowsInserted"),
        prior=prior,
    )


def write_errors(
    spark: SparkSession,
    spec: TableSpec,
    path: str,
    errors: DataFrame,
    *,
    hour_key: str,
    ingested_at,
) -> None:
    """Adds bad records to `spec`'s error table once each, keyed by their Kafka coordinates.

    A table with sensitive columns has its `key` and `value` sealed (`cdc_assets.sealing`);
    rows are never added to an error table sealed otherwise (`check_error_table`)."""
    sealed = bool(spec.sensitive)
    retry_on_conflict(
        lambda: _write_errors_once(
            spark, spec, path, errors, hour_key=hour_key, ingested_at=ingested_at, sealed=sealed
        ),
        table=spec.error_table_name,
        path=path,
    )


def _write_errors_once(
    spark: SparkSession,
    spec: TableSpec,
    path: str,
    errors: DataFrame,
    *,
    hour_key: str,
    ingested_at,
    sealed: bool,
) -> None:
    rows = errors.select(
        F.col("topic"),
        F.col(KAFKA_PARTITION).alias("partition"),
        F.col(KAFKA_OFFSET).alias("offset"),
        F.col("_cdc_kafka_timestamp").alias("kafka_timestamp"),
        F.col("key"),
        F.col("value"),
        F.col(ERROR).alias("reason"),
        F.lit(hour_key).alias("hour"),
        F.lit(ingested_at).cast("timestamp").alias("ingested_at"),
    )
    schema = error_table_schema(ERROR_TABLE_SCHEMA, sealed=sealed)
    table = DeltaTable.createIfNotExists(spark).location(path).addColumns(schema).execute()
    check_error_table(table.toDF().schema, table=spec.name, path=path, sealed=sealed)
    (
        table.alias("t")
        .merge(
            rows.alias("s"),
            "t.topic = s.topic AND t.partition = s.partition AND t.offset = s.offset",
        )
        .whenNotMatchedInsertAll()
        .execute()
    )


def live_rows(spark: SparkSession, path: str) -> DataFrame:
    """The mirror as the source table looks: live rows, without the tombstones."""
    return spark.read.format("delta").load(path).where(~F.col(DELETED))


def delta_log(path: str, s3_client=None) -> DeltaLog | None:
    """The table's log read without Spark: a local path, or S3 with `s3_client`; None for
    anything else (Spark's history is read instead)."""
    scheme = path.split("://", 1)[0] if "://" in path else ""
    if scheme in ("s3a", "s3") and s3_client is not None:
        return DeltaLog(path, s3_client=s3_client)
    if scheme in ("", "file"):
        return DeltaLog(path.removeprefix("file://"))
    return None  # another filesystem: Spark reads it


def mirror_newest_ms(spark: SparkSession, path: str, version: int) -> int | None:
    """The newest source timestamp (ms) among the mirror's rows at `version`: a scan."""
    return (
        spark.read.format("delta")
        .option("versionAsOf", version)
        .load(path)
        .agg(F.unix_millis(F.max(SOURCE_TS)).alias("newest"))
        .first()["newest"]
    )


def current_version(spark: SparkSession, path: str, ledger: DeltaLog | None = None) -> int:
    """The table's newest version."""
    ledger = ledger or delta_log(path)
    if ledger is not None:
        return ledger.latest_version()
    return DeltaTable.forPath(spark, path).history(1).select("version").first()["version"]


def hour_history(
    spark: SparkSession, path: str, ledger: DeltaLog | None = None
) -> tuple[int | None, list[dict]]:
    """The mirror's current version and its pipeline commits' metadata, newest first."""
    ledger = ledger or delta_log(path)
    if ledger is not None:
        return ledger.hour_history()
    return spark_hour_history(spark, path)


def spark_hour_history(spark: SparkSession, path: str) -> tuple[int | None, list[dict]]:
    """`hour_history` through Spark's DESCRIBE HISTORY (a Spark job)."""
    if not DeltaTable.isDeltaTable(spark, path):
        return None, []
    rows = DeltaTable.forPath(spark, path).history().select("version", "userMetadata").collect()
    history = []
    for row in rows:
        try:
            meta = json.loads(row["userMetadata"] or "null")
        except ValueError:
            continue
        if isinstance(meta, dict) and "slice" in meta:
            history.append({"version": row["version"], **meta})
    return max(row["version"] for row in rows), history
