"""An hour's newest change per key → the mirror, in one guarded Delta MERGE.

What the MERGE applies is the CDC rule (`cdc_assets.rule`): newer wins, deletes as the table's
`delete_mode` says. It is the hour's one Spark query into the mirror: the table's schema and
settings come from its log (`commits.stored_table`), what the MERGE did from its commit's
operation metrics and, where the mirror keeps a change data feed, the commit's change rows,
both read without Spark (`_outcome`). The MERGE's commit carries the run's record
(`cdc_assets.commits`); when every change was stale, a metadata-only commit records the run
instead, and a slice an earlier run applied is not MERGEd again (`merge_changes`).

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

import pyarrow.compute as pc
from delta.tables import DeltaTable
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from cdc_assets import rule, toast
from cdc_assets.columns import DELETED, INGESTED_AT
from cdc_assets.commits import (
    CHANGE_DATA_FEED,
    LEDGER_OPERATION,
    StoredTable,
    commit_metadata,
    commit_metadata_text,
    current_version,
    delta_log,
    ledger_commit,
    prepared,
    retry_on_conflict,
    stored_table,
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
class MergeOutcome:
    """What one run's MERGE did, each figure from Delta's operation metrics read from its
    commit (`_outcome`), none from a scan of the mirror."""

    version: int | None  # the MERGE's commit; None: nothing newer, no data commit
    merged_keys: int  # the MERGE's source rows: one newest change per key
    applied: int
    # The live rows inserted, updated and deleted: from the commit's change data where the
    # mirror keeps a change data feed, else Delta's rows inserted, rewritten and removed
    # (`split`; docs/checks.md, "Where each count comes from").
    rows_inserted: int
    rows_updated: int
    rows_deleted: int
    # Rows a truncate in the hour deleted (among `rows_deleted`, not `applied`).
    truncated: int = 0
    # Rows the MERGE inserted (Delta's operation metrics).
    rows_added: int = 0
    # The commit that recorded the run: the MERGE's, or the metadata-only one of a stale hour.
    recorded_version: int | None = None
    split: str = "merge metrics"
    # The slice was applied by an earlier run on record (`commits.applied_before`): no MERGE.
    replayed: bool = False


# Where `MergeOutcome`'s live rows come from (`split`).
SPLIT_BY_FEED = "change data feed"
SPLIT_BY_METRICS = "merge metrics"


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
    *,
    stored: StoredTable | None = None,
    run_metadata: dict | None = None,
) -> tuple[DeltaTable, T.StructType]:
    """Creates the mirror the first time (deletion vectors on; the change data feed as the
    table's `change_data_feed` says); new columns come via MERGE. Returns the table and its
    schema as the MERGE will find it.

    `stored` is the mirror as its log describes it (`commits.stored_table`; read here when not
    given): an existing mirror costs no Spark query. The columns of the toasted-value rule are
    added first if the table predates them, because the MERGE reads them from the table; a
    `change_data_feed` set true or false is applied to an existing mirror that differs. Each
    commit made here carries `run_metadata` marked as preparing the run's MERGE (`prepared`).
    """
    schema = changes.schema
    stored = stored or stored_table(spark, path)
    with commit_metadata(spark, prepared(run_metadata, "the mirror's table")):
        if stored.schema is None:
            _create(spark, path, schema, spec)
            return DeltaTable.forPath(spark, path), schema
        check_deletion_vectors(path, spec, stored.properties)
        _apply_change_data_feed(spark, path, spec, stored.properties)
        missing = _add_toast_columns(spark, path, spec, schema, stored.schema)
    filled = fill_defaults(
        spark,
        path,
        spec,
        schema,
        spec.column_defaults() if defaults is None else defaults,
        stored.schema,
        run_metadata=run_metadata,
    )
    table = DeltaTable.forPath(spark, path)
    # The schema changed here: read it again (rare: a column was added).
    return table, table.toDF().schema if missing or filled else stored.schema


def _create(spark: SparkSession, path: str, schema: T.StructType, spec: TableSpec) -> None:
    """The mirror at `path`, created with `schema` and the table's settings (one commit; a
    writer that created it meanwhile wins, and its table is used)."""
    builder = DeltaTable.createIfNotExists(spark).location(path).addColumns(schema)
    for name, value in _created_with(spec).items():
        builder = builder.property(name, value)
    builder.execute()


def _created_with(spec: TableSpec) -> dict[str, str]:
    """The properties a new mirror of `spec` is created with."""
    return {
        CHANGE_DATA_FEED: str(bool(spec.change_data_feed)).lower(),
        DELETION_VECTORS_PROPERTY: str(spec.deletion_vectors).lower(),
    }


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
    *,
    run_metadata: dict | None = None,
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
    (the history: not the versions that are deletes, to which the decoder gives none). Each
    commit carries `run_metadata` marked as preparing the run's MERGE (`commits.prepared`), so
    the log tells which run made it. Returns whether it changed the table's schema.
    """
    defaults = {c: v for c, v in defaults.items() if c in schema.fieldNames() and v is not None}
    quoted = path.replace("`", "``")
    names = {f.name.lower() for f in stored}
    new = [c for c in defaults if c.lower() not in names]
    pending = [f for f in stored if str(f.metadata.get("comment", "")).startswith(FILLING_DEFAULT)]
    if not new and not pending:
        return False
    with commit_metadata(spark, prepared(run_metadata, "a column's default")):
        _fill(spark, path, quoted, spec, schema, defaults, new, rows)
    return True


def _fill(
    spark: SparkSession,
    path: str,
    quoted: str,
    spec: TableSpec,
    schema: T.StructType,
    defaults: Mapping[str, Any],
    new: list[str],
    rows: Column | None,
) -> None:
    """`fill_defaults`' three commits: the new columns added, every row filled, noted."""
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


def _sql_text(text: str) -> str:
    """Text for inside a Spark SQL string literal in single quotes."""
    return text.replace("\\", "\\\\").replace("'", "\\'")


def _name(column: str) -> str:
    """A column name for inside SQL backticks."""
    return column.replace("`", "``")


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
    source_rows: int = 0,
    replayed: bool = False,
) -> MergeOutcome:
    """MERGEs the newest change per key into the mirror with the sequence guard.

    The commit carries `run_metadata`; its metrics, read from the commit, are the outcome
    (`_outcome`). When no change is newer than the mirror, Delta makes no commit; a
    metadata-only commit then records the run, so every hour's slice is in the log. A commit
    conflict with another writer is retried (`retry_on_conflict`).

    `replayed`: the run's slice was applied by an earlier run on record
    (`commits.applied_before`), so every one of these newest changes is stale: no MERGE, which
    without deletion vectors would rewrite the files its keys are in to change nothing; the
    metadata-only commit records the run. `source_rows` (the batch's count of `latest`) stands
    for Delta's count of the MERGE's source rows where no MERGE committed.

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
            source_rows=source_rows,
            replayed=replayed,
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
    source_rows: int = 0,
    replayed: bool = False,
) -> MergeOutcome:
    source = latest.withColumn(INGESTED_AT, F.lit(ingested_at).cast("timestamp"))
    source = source.select(*rule.mirror_columns(spec))
    stored = stored_table(spark, path, ledger)
    table, schema = ensure_mirror_table(
        spark, path, source, spec, defaults, stored=stored, run_metadata=run_metadata
    )
    names = {f.name.lower() for f in schema}
    evolving = any(c.lower() not in names for c in source.columns)
    if replayed and truncate_before is None and not evolving:
        return _recorded(spark, path, run_metadata, ledger, source_rows, replayed=True)
    bounds = {} if truncate_before is not None else dict(key_range or {})
    on = F.expr(" AND ".join(f"t.`{key}` = s.`{key}`" for key in spec.primary_key))
    on = within_key_range(on, bounds)  # a truncate's MERGE reads the whole table anyway
    merge = table.alias("t").merge(source.alias("s"), on)
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
    # Either choice writes the same rows; only the cost differs. Delta's size of the mirror
    # (None: not known) decides.
    size = ledger.size_bytes() if ledger is not None else None
    spark.conf.set(MERGE_PERSISTENT_DVS, str(persistent_deletion_vectors(spec, size)).lower())
    before = ledger.latest_version() if ledger is not None else None
    with commit_metadata(spark, run_metadata):
        # The metrics come from the commit: reading the DataFrame execute() returns would be
        # a Spark query of its own.
        returned = merge.execute()
    mine = _merge_commit(spark, table, run_metadata, ledger, before, returned)
    if mine is None:
        # Every change was stale (or there was none): Delta committed nothing.
        return _recorded(spark, path, run_metadata, ledger, source_rows, replayed=False)
    version, metrics = mine
    # A mirror this run created has the settings it was created with.
    properties = stored.properties if stored.schema is not None else _created_with(spec)
    return _outcome(spec, version, metrics, ledger, properties)


def _recorded(
    spark: SparkSession,
    path: str,
    run_metadata: dict,
    ledger: DeltaLog | None,
    source_rows: int,
    *,
    replayed: bool,
) -> MergeOutcome:
    """A run whose changes were all stale, recorded in a metadata-only commit, so that its
    slice is on record too. `source_rows`: the batch's count of its newest changes per key
    (no MERGE committed, so Delta counted none)."""
    with commit_metadata(spark, run_metadata):
        ledger_commit(spark, path)
    mine = ledger.run_commit(run_metadata, LEDGER_OPERATION) if ledger else None
    recorded = mine.version if mine is not None else current_version(spark, path)
    return MergeOutcome(None, source_rows, 0, 0, 0, 0, recorded_version=recorded, replayed=replayed)


def within_key_range(on: Column, key_range: Mapping[str, tuple]) -> Column:
    """A MERGE condition narrowed to the target rows inside `key_range` (key column → lowest
    and highest value among the source's keys): it changes no match, and Delta reads only the
    files whose statistics overlap the ranges."""
    for key, (low, high) in key_range.items():
        target = F.col(f"t.`{key}`")
        on = on & (target >= F.lit(low)) & (target <= F.lit(high))
    return on


def _merge_commit(
    spark: SparkSession,
    table: DeltaTable,
    run_metadata: dict,
    ledger: DeltaLog | None,
    before: int | None,
    returned: DataFrame,
) -> tuple[int, Mapping[str, str]] | None:
    """The version and operation metrics of this run's MERGE commit (None: Delta committed
    nothing), not one another writer made since: only a commit after `before`, the version
    the run found, can be this MERGE's."""
    if ledger is not None:  # read from the log's files, no Spark job
        mine = ledger.run_commit(run_metadata, "MERGE")
        if mine is None or (before is not None and mine.version <= before):
            return None
        return mine.version, mine.metrics
    # A lake whose log only Spark reads: the returned metrics, then the history.
    if not returned.first()["num_affected_rows"]:
        return None
    commit = (
        table.history(20)
        .where(F.col("userMetadata") == commit_metadata_text(run_metadata))
        .where(F.col("operation") == "MERGE")
        .orderBy(F.col("version").desc())
        .select("version", "operationMetrics")
        .first()
    )
    return commit["version"], dict(commit["operationMetrics"])


def _outcome(
    spec: TableSpec,
    version: int,
    metrics: Mapping[str, str],
    ledger: DeltaLog | None,
    properties: Mapping[str, str],
) -> MergeOutcome:
    """What MERGE commit `version` did, from Delta's operation metrics: the keys it took, the
    changes it applied, the rows it inserted, rewrote and removed. The live rows inserted,
    updated and deleted from the commit's own change data where the mirror keeps a change data
    feed (`live_split`); else Delta's rows inserted, rewritten (updates, soft deletes and
    undeletes alike) and removed, which is what Delta tells apart."""

    def metric(name: str) -> int:
        return int(metrics.get(name) or 0)

    truncated = metric("numTargetRowsNotMatchedBySourceUpdated") + metric(
        "numTargetRowsNotMatchedBySourceDeleted"
    )
    inserted = metric("numTargetRowsInserted")
    changed = inserted + metric("numTargetRowsUpdated") + metric("numTargetRowsDeleted")
    split = None
    feed = properties.get(CHANGE_DATA_FEED) == "true"
    if ledger is not None and feed and changed:
        split = live_split(spec, ledger, version)
    if split is None:
        split = (
            inserted,
            metric("numTargetRowsMatchedUpdated"),
            metric("numTargetRowsMatchedDeleted") + truncated,
            SPLIT_BY_METRICS,
        )
    return MergeOutcome(
        # Delta may commit a MERGE that changed no row (every change stale): it records the
        # run, but wrote nothing.
        version=version if changed else None,
        merged_keys=metric("numSourceRows"),
        # Changes newer than their rows (or filling a TOASTed value), inserts of new keys.
        applied=inserted
        + metric("numTargetRowsMatchedUpdated")
        + metric("numTargetRowsMatchedDeleted"),
        rows_inserted=split[0],
        rows_updated=split[1],
        rows_deleted=split[2],
        # Rows older than a truncate in the hour, which no change of it replaced.
        truncated=truncated,
        rows_added=inserted,
        recorded_version=version,
        split=split[3],
    )


def live_split(spec: TableSpec, ledger: DeltaLog, version: int) -> tuple[int, int, int, str] | None:
    """The live rows commit `version` inserted, updated and deleted, read from its change data
    in the driver (`DeltaLog.change_rows`; None where it can't be read so): an insert of a live
    row, or an update that makes a deleted row live, is an insert; an update of a live row that
    leaves it live an update; one that soft-deletes it, or a removed live row, a delete; a
    soft delete of a key the mirror lacked is a delete too (as the rule counts it)."""
    keys = list(spec.primary_key)
    rows = ledger.change_rows(version, [*keys, DELETED])
    if rows is None:
        return None
    kind, deleted = rows.column("_change_type"), rows.column(DELETED)
    inserts = rows.filter(pc.equal(kind, "insert"))
    inserted_live = pc.sum(pc.invert(inserts.column(DELETED))).as_py() or 0
    inserted_deleted = inserts.num_rows - inserted_live
    removed_live = (
        pc.sum(pc.and_(pc.equal(kind, "delete"), pc.invert(pc.fill_null(deleted, False)))).as_py()
        or 0
    )
    before = rows.filter(pc.equal(kind, "update_preimage")).select([*keys, DELETED])
    after = rows.filter(pc.equal(kind, "update_postimage")).select([*keys, DELETED])
    pairs = before.rename_columns([*keys, "_before"]).join(
        after.rename_columns([*keys, "_after"]), keys, join_type="inner"
    )
    if not pairs.num_rows == before.num_rows == after.num_rows:
        return None  # images that don't pair up by key: not read faithfully
    was, now = pairs.column("_before"), pairs.column("_after")
    undeleted = pc.sum(pc.and_(was, pc.invert(now))).as_py() or 0
    updated = pc.sum(pc.and_(pc.invert(was), pc.invert(now))).as_py() or 0
    soft_deleted = pc.sum(pc.and_(pc.invert(was), now)).as_py() or 0
    return (
        inserted_live + undeleted,
        updated,
        soft_deleted + removed_live + inserted_deleted,
        SPLIT_BY_FEED,
    )
