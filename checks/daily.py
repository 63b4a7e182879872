"""Daily checks of a mirror as a whole: the judgements that would cost a table scan per hour.

An hour's run judges what the hour wrote (checks/table_checks.py). What needs every row of a
table runs here once a day instead, in the `cdc_daily_checks` job, which the schedule
`cdc_daily_checks_daily` runs at 04:00 UTC (after maintenance's 03:00), on by default:

- `primary_key_unique_table`: no primary key has more than one live row in the mirror. The
  hourly `primary_key_unique` guards the rows each hour writes; a duplicate written by anything
  else (a writer outside the pipeline, a lost commit race) is found here, within a day.
- `history_table` (`history: true`): `<table>__history` judged over every key as each hour's
  `history` check judges that hour's keys (`cdc_assets.history.audit_history`): one current
  version per key, each version ending where the key's next starts, current live versions equal
  to the mirror's live rows.

The checks are not partitioned: each judges the table as it is when it runs, at the Delta
version its metadata names, with the table's `checks:` severity (`primary_key`, `history`), and
never blocks (a finding about the whole table is not an hour's). `history_table` reads two
tables, so it holds the table's pool as a writing run does: a run between its commit to the
mirror and its commit to the history would look like a difference (one table's read needs no
pool). A run that selects a mirror with all its checks (the UI's Materialize, a backfill) runs
them too, once per run; the offset sensor's runs select only each hour's checks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import dagster as dg
from delta.tables import DeltaTable
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from cdc_assets.columns import DELETED, SEQUENCE
from cdc_assets.commits import current_version, delta_log
from cdc_assets.config import CheckPolicy, TableSpec
from cdc_assets.history import HistoryAudit, audit_history, data_columns, history_name
from cdc_assets.partitions import mirrors_pool
from resources.lake import LakeResource
from resources.spark import SparkResource

PRIMARY_KEY_UNIQUE_TABLE = "primary_key_unique_table"
HISTORY_TABLE = "history_table"
DAILY_CHECKS = (PRIMARY_KEY_UNIQUE_TABLE, HISTORY_TABLE)
DAILY_CHECKS_JOB = "cdc_daily_checks"
DAILY_CHECKS_SCHEDULE = "cdc_daily_checks_daily"
# After the maintenance schedule's 03:00 (cdc_assets.maintenance.DEFAULT_CRON): its OPTIMIZE
# leaves fewer files to scan, and its run holds the pool `history_table` waits for.
DEFAULT_CRON = "0 4 * * *"

_NOT_BLOCKING = (
    " Daily and not blocking: it judges the whole table, not an hour, so the hourly runs and "
    "their downstream assets go on whatever it finds."
)


@dataclass(frozen=True)
class KeyDuplicates:
    """A mirror's live rows counted by primary key: counts only, never a key."""

    live_rows: int
    keys: int
    duplicated_keys: int  # keys with more than one live row
    duplicated_rows: int  # the live rows of those keys


def count_duplicate_keys(mirror: DataFrame, spec: TableSpec) -> KeyDuplicates:
    """The live rows of `mirror` grouped by the primary key, in one Spark action. A row with a
    null key column is no key's duplicate (as in great-expectations); `primary_key_not_null`
    judges it."""
    keys = list(spec.primary_key)
    live = mirror.where(~F.col(DELETED))
    for key in keys:
        live = live.where(F.col(key).isNotNull())
    per_key = live.groupBy(*keys).agg(F.count(F.lit(1)).alias("rows"))
    repeated = F.col("rows") > 1
    found = per_key.agg(
        F.coalesce(F.sum("rows"), F.lit(0)).alias("live_rows"),
        F.count(F.lit(1)).alias("keys"),
        F.count(F.when(repeated, 1)).alias("duplicated_keys"),
        F.coalesce(F.sum(F.when(repeated, F.col("rows"))), F.lit(0)).alias("duplicated_rows"),
    ).first()
    return KeyDuplicates(
        live_rows=int(found["live_rows"]),
        keys=int(found["keys"]),
        duplicated_keys=int(found["duplicated_keys"]),
        duplicated_rows=int(found["duplicated_rows"]),
    )


def _quoted(path: str) -> str:
    return "delta.`" + path.replace("`", "``") + "`"


def primary_key_unique_table_result(
    spec: TableSpec, found: KeyDuplicates | None, *, path: str, version: int | None
) -> dg.AssetCheckResult:
    """The verdict on `count_duplicate_keys` of the mirror at `version` (None: no mirror yet)."""
    policy = spec.checks.primary_key
    if found is None or version is None:
        return _passed(
            PRIMARY_KEY_UNIQUE_TABLE,
            policy,
            f"`{spec.name}` has no mirror yet ({path}); nothing to judge.",
            {"table_exists": dg.MetadataValue.bool(False)},
        )
    metadata = {
        "table_exists": dg.MetadataValue.bool(True),
        "delta_version": dg.MetadataValue.int(version),
        "live_rows": dg.MetadataValue.int(found.live_rows),
        "keys": dg.MetadataValue.int(found.keys),
        "duplicated_keys": dg.MetadataValue.int(found.duplicated_keys),
        "duplicated_rows": dg.MetadataValue.int(found.duplicated_rows),
        "primary_key": dg.MetadataValue.text(", ".join(spec.primary_key)),
    }
    if not found.duplicated_keys:
        return _passed(
            PRIMARY_KEY_UNIQUE_TABLE,
            policy,
            f"`{spec.name}` at Delta version {version}: each of its {found.keys} live keys has "
            "one live row.",
            metadata,
        )
    keys = ", ".join(spec.primary_key)
    return dg.AssetCheckResult(
        check_name=PRIMARY_KEY_UNIQUE_TABLE,
        passed=False,
        severity=dg.AssetCheckSeverity(policy.severity),
        description=(
            f"`{spec.name}` at Delta version {version}: {found.duplicated_keys} of its "
            f"{found.keys} live keys {'has' if found.duplicated_keys == 1 else 'have'} more than "
            f"one live row ({found.duplicated_rows} rows in all). "
            "The pipeline writes one row per key, so something else wrote the others: a writer "
            "outside the pipeline, or a commit race it lost. Find them with SELECT "
            f"{keys}, count(*) FROM {_quoted(path)} WHERE NOT {DELETED} GROUP BY {keys} "
            "HAVING count(*) > 1. Later changes of such a key update every one of its rows, so "
            "the mirror can't repair itself: rebuild it (move its folder aside and run its hours "
            "again while Kafka still holds them, or from a new snapshot of the source table)."
            + _NOT_BLOCKING
        ),
        metadata=metadata,
    )


def history_table_result(
    spec: TableSpec,
    audit: HistoryAudit | None,
    *,
    history_version: int | None,
    mirror_version: int | None,
) -> dg.AssetCheckResult:
    """The verdict on `audit_history` over every key of the history (None: nothing to judge
    yet, the mirror or the history has not been written)."""
    policy, history = spec.checks.history, history_name(spec)
    exists = {
        "table_exists": dg.MetadataValue.bool(mirror_version is not None),
        "history_exists": dg.MetadataValue.bool(history_version is not None),
    }
    if audit is None or history_version is None or mirror_version is None:
        missing = f"`{spec.name}`" if mirror_version is None else f"`{history}`"
        return _passed(HISTORY_TABLE, policy, f"{missing} has not been written yet.", exists)
    metadata = exists | {
        "delta_version": dg.MetadataValue.int(mirror_version),
        "history_version": dg.MetadataValue.int(history_version),
        "keys": dg.MetadataValue.int(audit.keys),
        "keys_without_one_current_version": dg.MetadataValue.int(audit.current_not_one),
        "broken_intervals": dg.MetadataValue.int(audit.broken_intervals),
        "keys_differing_from_mirror": dg.MetadataValue.int(audit.mirror_mismatches),
        "current_versions_with_unknown_toasted_values": dg.MetadataValue.int(audit.unknown),
        "keys_revived_in_mirror_by_hard_delete_order": dg.MetadataValue.int(
            audit.revived_by_hard_delete_order
        ),
    }
    judged = (
        f"`{history}` at Delta version {history_version} against `{spec.name}` at "
        f"{mirror_version}, over all its {audit.keys} keys"
    )
    problems = audit.problems
    if not problems:
        return _passed(HISTORY_TABLE, policy, f"{judged}: they agree.", metadata)
    return dg.AssetCheckResult(
        check_name=HISTORY_TABLE,
        passed=False,
        severity=dg.AssetCheckSeverity(policy.severity),
        description=(
            f"{judged}: " + "; ".join(problems) + ". A history and a mirror the pipeline alone "
            "wrote agree, so one was written outside it, or a run died between the mirror's "
            "commit and the history's and its hour has not run again (that hour's `history` "
            "check failed too: run it again). docs/checks.md ('Daily checks') has the query "
            "that finds the keys; moving the history aside and running the hours again while "
            "Kafka still holds them rebuilds it." + _NOT_BLOCKING
        ),
        metadata=metadata,
    )


def _passed(
    name: str, policy: CheckPolicy, description: str, metadata: dict[str, dg.MetadataValue]
) -> dg.AssetCheckResult:
    return dg.AssetCheckResult(
        check_name=name,
        passed=True,
        severity=dg.AssetCheckSeverity(policy.severity),
        description=description,
        metadata=metadata,
    )


def _version(spark: SparkSession, lake: LakeResource, path: str) -> int | None:
    """The table's newest Delta version, read from its log; None when it doesn't exist yet."""
    if not DeltaTable.isDeltaTable(spark, path):
        return None
    return current_version(spark, path, delta_log(path, lake.s3_client()))


def judge_primary_key(
    spark: SparkSession, lake: LakeResource, spec: TableSpec
) -> dg.AssetCheckResult:
    """`primary_key_unique_table` of `spec`'s mirror as it is now."""
    path = lake.table_path(spec.name)
    version = _version(spark, lake, path)
    found = None
    if version is not None:
        mirror = spark.read.format("delta").option("versionAsOf", version).load(path)
        found = count_duplicate_keys(mirror, spec)
    return primary_key_unique_table_result(spec, found, path=path, version=version)


def judge_history(spark: SparkSession, lake: LakeResource, spec: TableSpec) -> dg.AssetCheckResult:
    """`history_table` of `spec`: every key of `<table>__history` (the folded versions readers
    query, with tracked columns) against itself and the mirror. Each key's earliest sequence is
    among the keys and sequences handed to the audit, so it judges every version of the key."""
    path, mirror_path = lake.table_path(history_name(spec)), lake.table_path(spec.name)
    mirror_version = _version(spark, lake, mirror_path)
    history_version = _version(spark, lake, path)
    audit = None
    if mirror_version is not None and history_version is not None:
        history = spark.read.format("delta").load(path)
        audit = audit_history(
            spark,
            spec,
            path,
            mirror_path,
            history.select(*spec.primary_key, SEQUENCE),
            data_columns(spec, history),
            {},
        )
    return history_table_result(
        spec, audit, history_version=history_version, mirror_version=mirror_version
    )


DESCRIPTIONS = {
    PRIMARY_KEY_UNIQUE_TABLE: (
        "No primary key has more than one live row in the whole mirror. The hourly "
        "`primary_key_unique` guards the rows each hour writes; this finds a duplicate "
        "written any other way within a day." + _NOT_BLOCKING
    ),
    HISTORY_TABLE: (
        "The whole history against itself and the mirror: one current version per key, each "
        "version ending where the key's next begins, current live versions equal to the "
        "mirror's live rows. Holds the table's pool, as it reads both tables." + _NOT_BLOCKING
    ),
}


def build_daily_checks(spec: TableSpec) -> list[dg.AssetChecksDefinition]:
    """`spec`'s daily checks on its mirror asset: `primary_key_unique_table`, and
    `history_table` when the table keeps a history."""
    asset = dg.AssetKey(spec.name)

    @dg.asset_check(
        asset=asset,
        name=PRIMARY_KEY_UNIQUE_TABLE,
        description=DESCRIPTIONS[PRIMARY_KEY_UNIQUE_TABLE],
        blocking=False,
    )
    def _primary_key(spark: SparkResource, lake: LakeResource) -> dg.AssetCheckResult:
        lake.connect(spark.session)
        return judge_primary_key(spark.session, lake, spec)

    checks = [_primary_key]
    if spec.history:

        @dg.asset_check(
            asset=asset,
            name=HISTORY_TABLE,
            description=DESCRIPTIONS[HISTORY_TABLE],
            blocking=False,
            pool=mirrors_pool(spec),
        )
        def _history(spark: SparkResource, lake: LakeResource) -> dg.AssetCheckResult:
            lake.connect(spark.session)
            return judge_history(spark.session, lake, spec)

        checks.append(_history)
    return checks


def build_daily_checks_schedule(
    checks: Sequence[dg.AssetChecksDefinition],
    *,
    cron_schedule: str = DEFAULT_CRON,
    default_status: dg.DefaultScheduleStatus = dg.DefaultScheduleStatus.RUNNING,
) -> dg.ScheduleDefinition:
    """The daily run of `checks` (every table's `build_daily_checks`), on unless turned off."""
    job = dg.define_asset_job(
        DAILY_CHECKS_JOB,
        selection=dg.AssetSelection.checks(*checks),
        description=(
            "The checks that judge each mirror whole (checks/daily.py): no asset is "
            "materialized, so the run needs no Kafka and writes nothing."
        ),
    )
    return dg.ScheduleDefinition(
        name=DAILY_CHECKS_SCHEDULE,
        job=job,
        cron_schedule=cron_schedule,
        execution_timezone="UTC",
        default_status=default_status,
        description=(
            "Checks every mirror (and history) whole, once a day (checks/daily.py). On by "
            "default: these checks only read, and are what stands in for a scan in every hour."
        ),
    )
