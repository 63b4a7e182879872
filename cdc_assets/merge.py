"""An hour's newest change per key → the mirror, in one guarded Delta MERGE.

What the MERGE applies is the CDC rule (`cdc_assets.rule`): newer wins, deletes as the table's
`delete_mode` says. Before it, one Spark aggregation counts what the mirror holds under the hour's
keys (`prior_rows`): the live rows the hour inserts, updates and deletes, and the rows a key has
twice. The MERGE's commit carries the run's record (`cdc_assets.commits`); when every change was
stale, a metadata-only commit records the run instead.

The mirror is created with deletion vectors (unless `deletion_vectors: false`) and the change
data feed only where `change_data_feed: true`. A MERGE into a mirror smaller than the table's
`deletion_vectors_from_bytes` rewrites the files it touches instead of writing deletion vectors:
for a small table that is the cheaper of the two (`persistent_deletion_vectors`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from delta.tables import DeltaTable
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from cdc_assets import rule, toast
from cdc_assets.columns import DELETED, INGESTED_AT, SEQUENCE, value_sequence
from cdc_assets.commits import (
    LEDGER_OPERATION,
    commit_metadata,
    commit_metadata_text,
    current_version,
    delta_log,
    ledger_commit,
    retry_on_conflict,
)
from cdc_assets.config import TableSpec, default_json, typed_default
from cdc_assets.ledger import DeltaLog

log = logging.getLogger(__name__)

DELETION_VECTORS_PROPERTY = "delta.enableDeletionVectors"
# Delta's session setting: whether a MERGE into a table with deletion vectors writes them (true,
# Delta's default) or rewrites the files it touches (false). The run sets it before each MERGE.
MERGE_PERSISTENT_DVS = "spark.databricks.delta.merge.deletionVectors.persistent"


class MirrorSettingError(RuntimeError):
    """The mirror was created with another setting than the table's config now names."""


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
    # Changes the MERGE will write (applied, or filling a TOASTed value); 0: every one is stale.
    writes: int = 0


NO_PRIOR_ROWS = PriorRows(0, 0, 0, 0, 0, 0, 0)


@dataclass(frozen=True)
class MergeOutcome:
    version: int | None  # the MERGE's commit; None: every change was stale, no data commit
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
    # The commit that recorded the run: the MERGE's, or the metadata-only one of a stale hour.
    recorded_version: int | None = None

    @property
    def duplicate_rows(self) -> int:
        """Live rows sharing a primary key among the hour's keys once the MERGE committed: the
        ones there before, and the rows the MERGE inserted for keys the mirror already had
        (a row it should have matched: a lost race, a pruning bound that missed it)."""
        return self.prior.duplicate_live_rows + max(0, self.rows_added - self.prior.new_keys)


def mirror_schema(spark: SparkSession, path: str) -> T.StructType | None:
    """The stored mirror's schema, None before its first run."""
    if not DeltaTable.isDeltaTable(spark, path):
        return None
    return DeltaTable.forPath(spark, path).toDF().schema


def added_columns(schema: T.StructType | None, spec: TableSpec) -> dict[str, str]:
    """Source columns the mirror gained without a declaration (name → type), from its schema."""
    if schema is None:
        return {}
    known = {c.lower() for c in [*spec.columns, *spec.sensitive, *rule.mirror_columns(spec)]}
    return {f.name: f.dataType.simpleString() for f in schema if f.name.lower() not in known}


def ensure_mirror_table(
    spark: SparkSession,
    path: str,
    changes: DataFrame,
    spec: TableSpec,
    defaults: Mapping[str, Any] | None = None,
) -> DeltaTable:
    """Creates the mirror the first time (deletion vectors on; the change data feed as the
    table's `change_data_feed` says); new columns come via MERGE.

    The columns of the toasted-value rule are added first if the table predates them,
    because the MERGE reads them from the table; a `change_data_feed` set true or false is
    applied to an existing mirror that differs.
    """
    schema = changes.schema
    table = _create_if_not_exists(spark, path, schema, spec)
    properties = table_properties(spark, path)
    check_deletion_vectors(path, spec, properties)
    _apply_change_data_feed(spark, path, spec, properties)
    stored_schema = table.toDF().schema
    missing = _add_toast_columns(spark, path, spec, schema, stored_schema)
    filled = fill_defaults(
        spark,
        path,
        spec,
        schema,
        spec.column_defaults() if defaults is None else defaults,
        stored_schema,
    )
    # A DeltaTable made before its schema changed refuses to MERGE: make it again.
    return DeltaTable.forPath(spark, path) if missing or filled else table


def _create_if_not_exists(
    spark: SparkSession, path: str, schema: T.StructType, spec: TableSpec
) -> DeltaTable:
    """The mirror at `path`, created with `schema` and the table's settings if it is new."""
    return (
        DeltaTable.createIfNotExists(spark)
        .location(path)
        .addColumns(schema)
        .property(CHANGE_DATA_FEED, str(bool(spec.change_data_feed)).lower())
        .property(DELETION_VECTORS_PROPERTY, str(spec.deletion_vectors).lower())
        .execute()
    )


def _apply_change_data_feed(
    spark: SparkSession, path: str, spec: TableSpec, properties: Mapping[str, str]
) -> None:
    """Sets the mirror's change data feed to the table's `change_data_feed` where it is set
    and the mirror's differs."""
    feed = str(bool(spec.change_data_feed)).lower()
    if spec.change_data_feed is None or properties.get(CHANGE_DATA_FEED, "false") == feed:
        return
    log.info(
        "table '%s': change_data_feed is %s in the tables file, so the mirror's %s is set to %s",
        spec.name,
        feed,
        CHANGE_DATA_FEED,
        feed,
    )
    quoted = path.replace("`", "``")
    spark.sql(f"ALTER TABLE delta.`{quoted}` SET TBLPROPERTIES ('{CHANGE_DATA_FEED}' = '{feed}')")


def _add_toast_columns(
    spark: SparkSession,
    path: str,
    spec: TableSpec,
    schema: T.StructType,
    stored_schema: T.StructType,
) -> list[str]:
    """Adds the toasted-value rule's columns the mirror lacks (it predates them), since the
    MERGE reads them from the table; returns the columns added, as SQL."""
    stored = {f.name.lower() for f in stored_schema}
    missing = [
        f"`{name}` {schema[name].dataType.simpleString()}"
        for name in toast.mirror_columns(spec)
        if name.lower() not in stored
    ]
    if missing:
        quoted = path.replace("`", "``")
        spark.sql(f"ALTER TABLE delta.`{quoted}` ADD COLUMNS ({', '.join(missing)})")
    return missing


# The comment a column carries from when it is added to a mirror that holds rows until its
# default (the JSON after the prefix) is in every one of them: a run that finds it fills them.
FILLING_DEFAULT = "cdc-lake: filling into the rows from before the column its default "


def fill_defaults(
    spark: SparkSession,
    path: str,
    spec: TableSpec,
    schema: T.StructType,
    defaults: Mapping[str, Any],
    stored: T.StructType,
    rows: Column | None = None,
) -> bool:
    """A column with a default (declared, or the connector's: `hour_run.column_defaults`) that
    the mirror gains while it holds rows: the rows from before it show the default, as the
    source's rows from before its `ADD COLUMN ... DEFAULT` do (a change written before the
    column existed gets it from the decoder). `defaults` holds only the columns whose rows from
    before may take it (`hour_run`: not one whose values the mirror left out earlier).

    Three commits before the run's MERGE, none of them the run's: the column is added with its
    default in the comment `FILLING_DEFAULT`, every row takes that default, the comment is
    replaced by a note. Any run that finds such a comment (a crash came between) fills the
    rows with the default it names before its MERGE, whatever defaults the run knows, so no
    MERGE writes the column before its fill. `stored` is the mirror's schema as the run found
    it (`ensure_mirror_table` has it already). `rows` narrows the rows that take the default
    (the history: not the versions that are deletes, to which the decoder gives none). Returns
    whether it changed the table's schema.
    """
    defaults = {c: v for c, v in defaults.items() if c in schema.fieldNames() and v is not None}
    quoted = path.replace("`", "``")
    names = {f.name.lower() for f in stored}
    new = [c for c in defaults if c.lower() not in names]
    pending = [f for f in stored if str(f.metadata.get("comment", "")).startswith(FILLING_DEFAULT)]
    if not new and not pending:
        return False
    if new:
        added = ", ".join(
            f"`{_name(c)}` {schema[c].dataType.simpleString()} COMMENT "
            f"'{_sql_text(FILLING_DEFAULT + default_json(defaults[c]))}'"
            for c in new
        )
        spark.sql(f"ALTER TABLE delta.`{quoted}` ADD COLUMNS ({added})")
    table = DeltaTable.forPath(spark, path)
    pending = [
        f
        for f in table.toDF().schema
        if str(f.metadata.get("comment", "")).startswith(FILLING_DEFAULT)
    ]
    values = {
        f.name: typed_default(
            f.dataType.simpleString(), json.loads(f.metadata["comment"][len(FILLING_DEFAULT) :])
        )
        for f in pending
    }
    table.update(
        condition=rows, set={f.name: F.lit(values[f.name]).cast(f.dataType) for f in pending}
    )
    for f in pending:
        log.info(
            "table '%s': column '%s' added, its default in the rows from before it",
            spec.name,
            f.name,
        )
        spark.sql(
            f"ALTER TABLE delta.`{quoted}` ALTER COLUMN `{_name(f.name)}` COMMENT "
            "'cdc-lake: rows from before the column hold its default'"
        )
    return True


def _sql_text(text: str) -> str:
    """Text for inside a Spark SQL string literal in single quotes."""
    return text.replace("\\", "\\\\").replace("'", "\\'")


def _name(column: str) -> str:
    """A column name for inside SQL backticks."""
    return column.replace("`", "``")


CHANGE_DATA_FEED = "delta.enableChangeDataFeed"


def table_properties(spark: SparkSession, path: str) -> dict[str, str]:
    """A Delta table's properties as its metadata holds them (lowercased values); no job."""
    quoted = path.replace("`", "``")
    rows = spark.sql(f"SHOW TBLPROPERTIES delta.`{quoted}`").collect()
    return {row["key"]: str(row["value"]).strip().lower() for row in rows}


def persistent_deletion_vectors(spec: TableSpec, size_bytes: int | None) -> bool:
    """Whether this MERGE writes deletion vectors: on a mirror that has them, once it holds
    `deletion_vectors_from_bytes` (a size not known counts as large). Below that, rewriting the
    few small files an hour touches costs less than writing, and later applying, deletion
    vectors (docs/reading.md)."""
    small = size_bytes is not None and size_bytes < spec.deletion_vectors_from_bytes
    return spec.deletion_vectors and not small


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
    defaults: Mapping[str, Any] | None = None,
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
            defaults=defaults,
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
    defaults: Mapping[str, Any] | None = None,
) -> MergeOutcome:
    source = latest.withColumn(INGESTED_AT, F.lit(ingested_at).cast("timestamp"))
    source = source.select(*rule.mirror_columns(spec))
    table = ensure_mirror_table(spark, path, source, spec, defaults)
    bounds = {} if truncate_before is not None else dict(key_range or {})
    on = F.expr(" AND ".join(f"t.`{key}` = s.`{key}`" for key in spec.primary_key))
    on = within_key_range(on, bounds)  # a truncate's MERGE reads the whole table anyway
    _, fill = toast.merge_sets(spec)
    # Delta's size of the mirror (None: not known). An empty one holds no row to count.
    size = ledger.size_bytes() if ledger is not None else None
    prior = prior_rows(spark, spec, path, latest, bounds, fill, empty=size == 0)
    merge = table.alias("t").merge(source.alias("s"), on)
    stored = {f.name.lower() for f in table.toDF().schema}
    evolving = any(c.lower() not in stored for c in source.columns)
    if evolving:
        # A column the source gained (new_columns: add): the MERGE adds it to the mirror.
        # Asked for only then: schema evolution costs every MERGE an analysis of its own.
        merge = merge.withSchemaEvolution()
    merge = rule.with_clauses(
        merge,
        spec,
        hour_key=run_metadata["hour"],
        ingested_at=ingested_at,
        truncate_before=truncate_before,
    )
    # A setting of the session (the fleet gives each table's thread a session of its own).
    # Either choice writes the same rows; only the cost differs.
    spark.conf.set(MERGE_PERSISTENT_DVS, str(persistent_deletion_vectors(spec, size)).lower())
    with commit_metadata(spark, run_metadata):
        # Every change stale (a replay) and no column to add: no MERGE, which without deletion
        # vectors would rewrite the files its keys are in to change nothing.
        stale = prior.writes == 0 and truncate_before is None and not evolving
        metrics = None if stale else merge.execute().first()
        if stale or not metrics["num_affected_rows"]:
            # Every change was stale (or there was none): Delta committed nothing.
            # A metadata-only commit, so that this run's slice is on record too.
            ledger_commit(spark, path)
            mine = ledger.run_commit(run_metadata, LEDGER_OPERATION) if ledger else None
            recorded = mine.version if mine is not None else current_version(spark, path)
            return MergeOutcome(
                None, prior.source_rows, 0, 0, 0, 0, prior=prior, recorded_version=recorded
            )
    return _outcome(*_merge_commit(table, run_metadata, ledger), prior)


def within_key_range(on: Column, key_range: Mapping[str, tuple]) -> Column:
    """A MERGE condition narrowed to the target rows inside `key_range` (key column → lowest
    and highest value among the source's keys): it changes no match, and Delta reads only the
    files whose statistics overlap the ranges."""
    for key, (low, high) in key_range.items():
        target = F.col(f"t.`{key}`")
        on = on & (target >= F.lit(low)) & (target <= F.lit(high))
    return on


def _merge_commit(
    table: DeltaTable, run_metadata: dict, ledger: DeltaLog | None
) -> tuple[int, Mapping[str, str]]:
    """The version and operation metrics of this run's MERGE commit, not one another writer
    made since (both carry the same metadata only when they run the same hour, and then the
    later one commits nothing but the ledger)."""
    if ledger is not None:  # read from the log's files, no Spark job
        mine = ledger.run_commit(run_metadata, "MERGE")
        return mine.version, mine.metrics
    commit = (
        table.history(20)
        .where(F.col("userMetadata") == commit_metadata_text(run_metadata))
        .where(F.col("operation") == "MERGE")
        .orderBy(F.col("version").desc())
        .select("version", "operationMetrics")
        .first()
    )
    return commit["version"], dict(commit["operationMetrics"])


def prior_rows(
    spark: SparkSession,
    spec: TableSpec,
    path: str,
    latest: DataFrame,
    key_range: Mapping[str, tuple],
    fill: Column,
    *,
    empty: bool = False,
) -> PriorRows:
    """The mirror's rows under the hour's keys, as the MERGE is about to find them, counted
    against the hour's changes in one Spark job: the key, deleted flag and sequence of the
    rows in the key range (and the toasted-value rule's columns), joined with the batch.
    `empty`: the mirror holds no data file (Delta's size is 0), so no key has a row and the
    job reads the batch alone.

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
    # What the rule reads of the hour's change: its deleted flag and sequence (and the toasted
    # rule's columns), not the whole row.
    read = [DELETED, SEQUENCE, *(c for c in toast.mirror_columns(spec) if c in latest.columns)]
    source = latest.select(*keys, F.struct(*read).alias("s"))
    if empty and all(c in latest.columns for c in toasted):
        # Every key without a row: the newest row's columns the rule reads, all null.
        nothing = F.struct(
            *[F.lit(None).cast(latest.schema[c].dataType).alias(c) for c in [SEQUENCE, *toasted]]
        )
        joined = source.select(
            "*",
            F.lit(None).cast("long").alias("_rows"),
            F.lit(None).cast("long").alias("_live"),
            nothing.alias("t"),
        )
        return _counted(spec, joined, fill)
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
    return _counted(spec, source.join(per_key, on=keys, how="left"), fill)


def _counted(spec: TableSpec, joined: DataFrame, fill: Column) -> PriorRows:
    """`prior_rows`' counts over each change `s` of the batch beside what the mirror holds for
    its key (`_rows`, `_live`: null for none; `t`: the key's newest row)."""
    effects = rule.live_effects(
        spec,
        exists=F.col("_rows").isNotNull(),
        live=F.coalesce(F.col("_live"), F.lit(0)) > 0,
        fills=fill,
    )

    def total(condition: Column, name: str) -> Column:
        return F.sum(condition.cast("int")).alias(name)

    counted = joined.agg(
        F.count(F.lit(1)).alias("source_rows"),
        total(effects["adds_row"], "new_keys"),
        F.sum(F.coalesce(F.col("_live"), F.lit(0))).alias("live_rows"),
        F.sum(F.when(F.col("_live") > 1, F.col("_live"))).alias("duplicate_live_rows"),
        total(effects["inserted"], "inserted"),
        total(effects["updated"], "updated"),
        total(effects["deleted"], "deleted"),
        total(effects["writes"], "writes"),
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
        recorded_version=version,
    )
