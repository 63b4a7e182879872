"""Table maintenance: compact a mirror's small files (OPTIMIZE) and vacuum the files it dropped.

Every hourly MERGE writes a few small files and leaves the files it replaced on storage.
`<table>_maintenance` (one asset per table, group `cdc_maintenance`) fixes both, for the mirror
and for its error table when it exists:

- **OPTIMIZE ... ZORDER BY (primary key)** (the error table: its Kafka partition and offset, the
  key its MERGE matches on), or plain compaction with `zorder: false`. It commits with
  `dataChange = false`: readers, the change data feed and `order_facts` see the same rows.
  Z-ordering rewrites the whole table every run: run it less often, or with `zorder: false`,
  on very large mirrors.
- **VACUUM** deletes the files no version within the table's
  `delta.deletedFileRetentionDuration` needs, recorded as VACUUM START / END commits.

delta-spark 4.x reads no version older than that retention and vacuums by it: `retain_hours`
below it fails the run before anything is touched; above it, the run warns and reports the
retention Delta applied. An `order_facts` hour run more than the retention after its mirror
hour fails and can't be replayed. The asset runs in the mirrors' pool, never beside a MERGE
into its table; the daily schedule is STOPPED by default, as VACUUM removes history for good.
docs/deploy.md ("Table maintenance") has the details and the commands.
"""

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import dagster as dg
from delta.tables import DeltaTable
from pydantic import Field
from pyspark.sql import Row, SparkSession

from cdc_assets.config import TableSpec
from cdc_assets.history import history_name
from cdc_assets.history_tracking import history_tables
from cdc_assets.partitions import mirrors_pool
from resources.lake import LakeResource
from resources.spark import SparkResource, session_settings

MAINTENANCE_GROUP = "cdc_maintenance"
MAINTENANCE_JOB = "cdc_maintenance"
MAINTENANCE_SCHEDULE = "cdc_maintenance_daily"
DEFAULT_CRON = "0 3 * * *"

RETENTION_PROPERTY = "delta.deletedFileRetentionDuration"
DEFAULT_RETENTION = "interval 1 week"  # Delta's default when the table doesn't set it
# VACUUM START / VACUUM END commits with the counts. Delta leaves it off by default on S3, where
# two drivers committing at once can lose a commit; the table's pool makes this run the table's
# only writer, as for every other commit of the pipeline.
VACUUM_LOGGING_CONF = "spark.databricks.delta.vacuum.logging.enabled"
# The error table's MERGE key is (topic, partition, offset); the topic is one value per table.
ERROR_TABLE_ZORDER = ("partition", "offset")

_INTERVAL_PART = re.compile(
    r"(\d+(?:\.\d+)?)\s*(week|day|hour|minute|second|millisecond|microsecond)s?", re.IGNORECASE
)
_UNIT_HOURS = {
    "week": Fraction(168),
    "day": Fraction(24),
    "hour": Fraction(1),
    "minute": Fraction(1, 60),
    "second": Fraction(1, 3_600),
    "millisecond": Fraction(1, 3_600_000),
    "microsecond": Fraction(1, 3_600_000_000),
}


class MaintenanceConfig(dg.Config):
    zorder: bool = Field(
        default=True,
        description=(
            "OPTIMIZE ... ZORDER BY the primary key (rewrites the whole table); false: compact "
            "only the small files and the files with many deleted rows."
        ),
    )
    retain_hours: int = Field(
        default=168,
        ge=0,
        description=(
            "VACUUM keeps the files that versions of the last retain_hours need. Below the "
            "table's delta.deletedFileRetentionDuration the run fails; Delta vacuums by that "
            "property, so raise it to keep more."
        ),
    )
    vacuum_parallelism: int | None = Field(
        default=None,
        ge=1,
        description=(
            "Tasks VACUUM lists and deletes the table's files with. Default: one per core of "
            "the cluster. Spark's own default (10,000) makes a small table's VACUUM schedule "
            "about 170,000 tasks; raise this for tables of very many files on object storage."
        ),
    )


class RetentionTooShortError(ValueError):
    """retain_hours is below what the table's own retention setting keeps."""


@dataclass(frozen=True)
class TableMaintenance:
    """What OPTIMIZE and VACUUM did to one Delta table: counts only, never rows."""

    files_before: int
    bytes_before: int
    files_after: int
    bytes_after: int
    files_added: int
    files_removed: int
    optimize_version: int | None  # None: nothing to compact, no commit
    files_vacuumed: int  # files (and empty directories) VACUUM deleted
    bytes_vacuumed: int
    retain_hours_effective: float  # the retention Delta applied
    delta_version: int


def maintenance_asset_name(spec: TableSpec) -> str:
    return f"{spec.name}_maintenance"


def interval_hours(value: str) -> Fraction:
    """Hours of a Delta interval setting such as 'interval 1 week' or '36 hours 30 minutes'.

    Raises ValueError for anything else (Delta's retention settings take no months or years).
    """
    text = value.strip().lower().removeprefix("interval").strip()
    parts = _INTERVAL_PART.findall(text)
    if not parts or _INTERVAL_PART.sub("", text).strip():
        raise ValueError(f"'{value}' is not an interval of weeks, days, hours, minutes or seconds")
    return sum((Fraction(n) * _UNIT_HOURS[unit.lower()] for n, unit in parts), Fraction(0))


def table_retention(spark: SparkSession, path: str) -> tuple[str, Fraction]:
    """The table's `delta.deletedFileRetentionDuration`, as set and in hours."""
    properties = DeltaTable.forPath(spark, path).detail().first()["properties"] or {}
    value = properties.get(RETENTION_PROPERTY, DEFAULT_RETENTION)
    return value, interval_hours(value)


def check_retention(spark: SparkSession, *, table: str, path: str, retain_hours: int) -> Fraction:
    """The table's retention in hours; raises RetentionTooShortError when retain_hours is below."""
    value, hours = table_retention(spark, path)
    if retain_hours < hours:
        quoted = path.replace("`", "``")
        raise RetentionTooShortError(
            f"table '{table}' ({path}): retain_hours {retain_hours} is below the table's "
            f"{RETENTION_PROPERTY} ('{value}', {float(hours):g} hours). Delta keeps the files "
            f"that versions of the last {float(hours):g} hours need (readers, time travel, the "
            "change data feed order_facts reads), and this run vacuums nothing below that. Run "
            f"with retain_hours of at least {math.ceil(hours)}; or, to keep less history, lower "
            f"the setting first: ALTER TABLE delta.`{quoted}` SET TBLPROPERTIES "
            f"('{RETENTION_PROPERTY}' = 'interval {retain_hours} hours'). No reader can then see "
            f"a version older than {retain_hours} hours, and order_facts can't replay an hour "
            "whose mirror commits are older."
        )
    return hours


# The tasks VACUUM lists and deletes files with. Spark's default is 10,000, which turns a small
# table's VACUUM into tens of thousands of tasks (docs/benchmark.md, "Small table-hours").
LISTING_PARALLELISM_CONF = "spark.sql.sources.parallelPartitionDiscovery.parallelism"


def vacuum_settings(spark: SparkSession, parallelism: int | None) -> dict[str, str]:
    """What a VACUUM runs with: VACUUM START / END commits with its counts, and `parallelism`
    listing tasks (None: one per core of the cluster, Spark's default parallelism)."""
    tasks = parallelism or spark.sparkContext.defaultParallelism
    return {VACUUM_LOGGING_CONF: "true", LISTING_PARALLELISM_CONF: str(max(1, tasks))}


def maintain_table(
    spark: SparkSession,
    path: str,
    *,
    zorder_by: Sequence[str] | None,
    retain_hours: int,
    vacuum_parallelism: int | None = None,
) -> TableMaintenance:
    """OPTIMIZE (Z-ordered by `zorder_by`, or plain compaction when None), then VACUUM."""
    table = DeltaTable.forPath(spark, path)
    before = table.detail().select("numFiles", "sizeInBytes").first()
    start_version = table.history(1).first()["version"]
    optimize = table.optimize()
    result = optimize.executeZOrderBy(*zorder_by) if zorder_by else optimize.executeCompaction()
    metrics = result.first()["metrics"]
    after = table.detail().select("numFiles", "sizeInBytes").first()
    with session_settings(spark, vacuum_settings(spark, vacuum_parallelism)):
        table.vacuum(float(retain_hours))
    # This run's commits: OPTIMIZE (none when there was nothing to compact), VACUUM START and
    # VACUUM END. The table's pool keeps other writers out meanwhile.
    commits: dict[str, Row] = {}
    for commit in table.history(4).collect():  # newest first
        if commit["version"] > start_version:
            commits.setdefault(commit["operation"], commit)
    started, ended = commits.get("VACUUM START"), commits.get("VACUUM END")
    if started is None or ended is None:
        raise RuntimeError(f"VACUUM of {path} left no VACUUM START / END commit in its history")
    # Delta records the RETAIN it applied, or none when it used the table's own retention.
    parameters = started["operationParameters"]
    retention_ms = parameters.get("specifiedRetentionMillis")
    if retention_ms in (None, "", "null"):
        retention_ms = parameters["defaultRetentionMillis"]
    optimized = commits.get("OPTIMIZE")
    return TableMaintenance(
        files_before=before["numFiles"],
        bytes_before=before["sizeInBytes"],
        files_after=after["numFiles"],
        bytes_after=after["sizeInBytes"],
        files_added=metrics["numFilesAdded"],
        files_removed=metrics["numFilesRemoved"],
        optimize_version=None if optimized is None else optimized["version"],
        files_vacuumed=int(ended["operationMetrics"].get("numDeletedFiles", 0)),
        bytes_vacuumed=int(started["operationMetrics"].get("sizeOfDataToDelete", 0)),
        retain_hours_effective=int(retention_ms) / 3_600_000,
        delta_version=max(commit["version"] for commit in commits.values()),
    )


def maintenance_metadata(
    outcome: TableMaintenance, *, path: str, prefix: str = ""
) -> dict[str, dg.MetadataValue]:
    """One table's metadata, keys prefixed with `prefix` (the error table's `error_table_`)."""
    values: dict[str, dg.MetadataValue] = {
        "files_before": dg.MetadataValue.int(outcome.files_before),
        "files_after": dg.MetadataValue.int(outcome.files_after),
        "bytes_before": dg.MetadataValue.int(outcome.bytes_before),
        "bytes_after": dg.MetadataValue.int(outcome.bytes_after),
        "files_added": dg.MetadataValue.int(outcome.files_added),
        "files_removed": dg.MetadataValue.int(outcome.files_removed),
        "files_vacuumed": dg.MetadataValue.int(outcome.files_vacuumed),
        "bytes_vacuumed": dg.MetadataValue.int(outcome.bytes_vacuumed),
        "retain_hours_effective": dg.MetadataValue.float(outcome.retain_hours_effective),
        "delta_version": dg.MetadataValue.int(outcome.delta_version),
        "delta_path": dg.MetadataValue.path(path),
    }
    if outcome.optimize_version is not None:
        values["optimize_version"] = dg.MetadataValue.int(outcome.optimize_version)
    return {f"{prefix}{key}": value for key, value in values.items()}


@dataclass(frozen=True)
class _Target:
    name: str
    path: str
    zorder_by: tuple[str, ...]
    prefix: str


def _targets(spec: TableSpec, lake: LakeResource) -> list[_Target]:
    """The mirror, then its error table, then its history (`history: true`), each with its
    Z-order and metadata prefix."""
    targets = [
        _Target(spec.name, lake.table_path(spec.name), spec.primary_key, ""),
        _Target(
            spec.error_table_name,
            lake.table_path(spec.error_table_name),
            ERROR_TABLE_ZORDER,
            "error_table_",
        ),
    ]
    for name in history_tables(spec):
        prefix = "history_" if name == history_name(spec) else "history_changes_"
        targets.append(_Target(name, lake.table_path(name), spec.primary_key, prefix))
    return targets


def _check_retentions(
    spark: SparkSession, targets: Sequence[_Target], retain_hours: int
) -> dict[str, Fraction]:
    """Each table's retention in hours, all checked before any table is touched: a setting
    too short fails the run without retries (it changes nothing, and retrying can't fix it)."""
    retention: dict[str, Fraction] = {}
    try:
        for target in targets:
            retention[target.name] = check_retention(
                spark, table=target.name, path=target.path, retain_hours=retain_hours
            )
    except RetentionTooShortError as exc:
        raise dg.Failure(description=str(exc), allow_retries=False) from exc
    return retention


def _longer_retain_warning(table: str, retention: Fraction, retain_hours: int) -> str:
    """What to tell when `retain_hours` exceeds the table's retention, which Delta applies."""
    return (
        f"{table}: Delta vacuums by the table's {RETENTION_PROPERTY} ({float(retention):g} "
        f"hours) and ignores retain_hours {retain_hours}; versions older than that can't be "
        "read anyway. To keep more history, raise the table's setting."
    )


def build_maintenance_asset(spec: TableSpec) -> dg.AssetsDefinition:
    """`<table>_maintenance`: OPTIMIZE and VACUUM of `spec`'s mirror and error table."""
    keys = ", ".join(spec.primary_key)

    @dg.asset(
        name=maintenance_asset_name(spec),
        group_name=MAINTENANCE_GROUP,
        description=(
            f"Compacts the Delta files of `{spec.name}` (OPTIMIZE, Z-ordered by {keys}) and of "
            f"`{spec.error_table_name}`"
            + "".join(f" and `{name}`" for name in history_tables(spec))
            + ", then vacuums the files no version within the table's "
            "retention needs. Runs in the table's pool, never beside its MERGE; daily through "
            f"the `{MAINTENANCE_SCHEDULE}` schedule once it is turned on."
        ),
        deps=[dg.AssetKey(spec.name)],
        pool=mirrors_pool(spec),
        kinds={"spark", "delta"},
        metadata={"table": spec.name, "zorder_by": keys, "error_table": spec.error_table_name},
    )
    def _maintenance(
        context: dg.AssetExecutionContext,
        config: MaintenanceConfig,
        spark: SparkResource,
        lake: LakeResource,
    ) -> dg.MaterializeResult:
        session = spark.session
        lake.connect(session)
        targets = _targets(spec, lake)
        existing = [t for t in targets if DeltaTable.isDeltaTable(session, t.path)]
        metadata: dict[str, dg.MetadataValue] = {
            "table_exists": dg.MetadataValue.bool(targets[0] in existing),
            "error_table_exists": dg.MetadataValue.bool(targets[1] in existing),
            "zorder": dg.MetadataValue.bool(config.zorder),
            "retain_hours": dg.MetadataValue.int(config.retain_hours),
        }
        retention = _check_retentions(session, existing, config.retain_hours)
        for target in existing:
            if config.retain_hours > retention[target.name]:
                context.log.warning(
                    _longer_retain_warning(target.name, retention[target.name], config.retain_hours)
                )
            outcome = maintain_table(
                session,
                target.path,
                zorder_by=target.zorder_by if config.zorder else None,
                retain_hours=config.retain_hours,
                vacuum_parallelism=config.vacuum_parallelism,
            )
            context.log.info(_summary(target.name, outcome))
            metadata |= maintenance_metadata(outcome, path=target.path, prefix=target.prefix)
        if not existing:
            context.log.info(f"{spec.name}: the mirror has not been written yet; nothing to do")
        return dg.MaterializeResult(metadata=metadata)

    return _maintenance


def _summary(table: str, outcome: TableMaintenance) -> str:
    return (
        f"{table}: {outcome.files_before} files ({outcome.bytes_before} bytes) → "
        f"{outcome.files_after} files ({outcome.bytes_after} bytes); OPTIMIZE added "
        f"{outcome.files_added}, removed {outcome.files_removed}; VACUUM deleted "
        f"{outcome.files_vacuumed} ({outcome.bytes_vacuumed} bytes) at "
        f"{outcome.retain_hours_effective:g} hours' retention; Delta version "
        f"{outcome.delta_version}"
    )


def build_maintenance_schedule(
    assets: Sequence[dg.AssetsDefinition],
    *,
    cron_schedule: str = DEFAULT_CRON,
    default_status: dg.DefaultScheduleStatus = dg.DefaultScheduleStatus.STOPPED,
) -> dg.ScheduleDefinition:
    """The daily run of every table's maintenance asset (off until someone turns it on)."""
    job = dg.define_asset_job(
        MAINTENANCE_JOB,
        selection=dg.AssetSelection.assets(*assets),
        description="OPTIMIZE and VACUUM of every mirror and error table, table after table.",
    )
    return dg.ScheduleDefinition(
        name=MAINTENANCE_SCHEDULE,
        job=job,
        cron_schedule=cron_schedule,
        execution_timezone="UTC",
        default_status=default_status,
        description=(
            "Compacts and vacuums every mirror daily (cdc_assets/maintenance.py). Off by default: "
            "VACUUM removes history for good; turn it on once the tables' retention is chosen."
        ),
    )
