"""A mirror's Delta commits: each run's record in its commit, retried on conflicts, read back.

Every run commits to its mirror with the hour's slice and counts as the commit's `userMetadata`
(`commit_metadata`); a run that changed no row records itself in a metadata-only commit
(`record_run`), so every hour's slice is in the log and the next hour starts where it ended.
Atomicity (I4): the hour's changes reach the mirror in one Delta commit (its MERGE); a run that
moved rows fills their TOASTed values in a second one marked `moved_rows` (`hour_run`), and a
column with a default is added and filled before the MERGE (`merge.fill_defaults`), each step
repaired by a rerun. A commit that loses a
race with another writer is retried (`retry_on_conflict`); every write is guarded (by sequence or
by Kafka coordinates), so doing it again is safe. The log is read back without Spark where the
lake allows (`cdc_assets.ledger`).
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TypeVar

from delta import exceptions as delta_errors
from delta.tables import DeltaTable
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from cdc_assets.columns import DELETED, SOURCE_TS
from cdc_assets.config import TableSpec
from cdc_assets.ledger import DeltaLog

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


def commit_metadata_text(metadata: dict) -> str:
    return json.dumps(metadata, sort_keys=True)


@contextmanager
def commit_metadata(spark: SparkSession, metadata: dict | None) -> Iterator[None]:
    """Attaches `metadata` to the Delta commits made inside the block (None: none)."""
    if metadata is None:
        yield
        return
    spark.conf.set(COMMIT_METADATA_CONF, commit_metadata_text(metadata))
    try:
        yield
    finally:
        spark.conf.unset(COMMIT_METADATA_CONF)


LEDGER_OPERATION = "SET TBLPROPERTIES"

# Marks a commit a run makes before its MERGE (the table created, a column added and filled, a
# setting applied): it carries the run's record, so the log tells which run made it, under this
# key naming the step. It does not record the run: a run that stopped after it ran nothing of
# its hour (`hour_history` leaves such commits out).
PREPARES = "prepares"


def prepared(run_metadata: dict | None, step: str) -> dict | None:
    """The commit metadata of a step before a run's MERGE (`PREPARES`); None: no run."""
    return None if run_metadata is None else {**run_metadata, PREPARES: step}


def ledger_commit(spark: SparkSession, path: str) -> None:
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
            ledger_commit(spark, path)
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


CHANGE_DATA_FEED = "delta.enableChangeDataFeed"


@dataclass(frozen=True)
class StoredTable:
    """A Delta table as its log describes it now: its schema (None: no table yet) and its
    properties (values lowercased)."""

    schema: T.StructType | None
    properties: dict[str, str] = field(default_factory=dict)


def stored_table(spark: SparkSession, path: str, ledger: DeltaLog | None = None) -> StoredTable:
    """The table at `path` as its log describes it: read without Spark where the lake allows
    (`DeltaLog.table_metadata`), else through Spark (`DeltaTable`, SHOW TBLPROPERTIES)."""
    ledger = ledger or delta_log(path)
    if ledger is not None:
        metadata = ledger.table_metadata()
        if metadata is not None:
            properties = {k: str(v).strip().lower() for k, v in metadata.configuration.items()}
            return StoredTable(T.StructType.fromJson(metadata.schema), properties)
        if ledger.latest_version() is None:
            return StoredTable(None)
        # A log the reader doesn't read faithfully (a v2 checkpoint): Spark reads it.
    if not DeltaTable.isDeltaTable(spark, path):
        return StoredTable(None)
    return StoredTable(DeltaTable.forPath(spark, path).toDF().schema, table_properties(spark, path))


def table_properties(spark: SparkSession, path: str) -> dict[str, str]:
    """A Delta table's properties as Spark reads them (lowercased values): a command, no job.
    `stored_table` reads them without Spark where the lake allows."""
    quoted = path.replace("`", "``")
    rows = spark.sql(f"SHOW TBLPROPERTIES delta.`{quoted}`").collect()
    return {row["key"]: str(row["value"]).strip().lower() for row in rows}


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
        if isinstance(meta, dict) and "slice" in meta and PREPARES not in meta:
            history.append({"version": row["version"], **meta})
    return max(row["version"] for row in rows), history


# --- what the runs recorded, read back -----------------------------------------------------


def recorded_offsets(
    history: list[dict], hour_key: str, edge: str, *, complete: bool = False
) -> dict[int, int] | None:
    """The newest recorded run's `edge` ("start"/"end") offsets of an hour, or None;
    `complete`: of the newest run that read the hour closed, not a partial one (a refresh's
    end is not where the next hour begins)."""
    for commit in history:  # newest first
        if commit.get("hour") == hour_key and not (complete and commit.get("partial")):
            parts = commit["slice"]["partitions"]
            return {int(p): offsets[edge] for p, offsets in parts.items()}
    return None


def refreshed_to(
    history: list[dict], hour_key: str, hour_starts: Mapping[int, int]
) -> dict[int, int]:
    """Where the hour's newest run read each partition up to, when that run was a refresh (a
    partial run) that began the hour where this run does: the next refresh of the hour reads
    on from there (`slicing.remainder`). Empty otherwise: the run reads the whole hour, which
    the newer-wins rule makes a replay of what was applied."""
    for commit in history:  # newest first
        if commit.get("hour") != hour_key:
            continue
        if not commit.get("partial"):
            return {}
        parts = {int(p): offsets for p, offsets in commit["slice"]["partitions"].items()}
        if any(hour_starts.get(p) != offsets["start"] for p, offsets in parts.items()):
            return {}
        return {p: offsets["end"] for p, offsets in parts.items()}
    return {}


def applied_before(history: list[dict], hour_key: str, recorded_slice: dict) -> bool:
    """Whether a run on record read this hour closed, over exactly `recorded_slice`, and
    committed it: then each of the slice's changes was applied or found stale then, and the
    newer-wins rule keeps every one stale now (a replay). Only a run's own records count
    (`hour_history` leaves out the commits that prepare a MERGE), so a run that stopped before
    its MERGE is not taken for one that applied its hour."""
    recorded_slice = json.loads(json.dumps(recorded_slice))  # as the log holds it
    for commit in history:  # newest first
        if commit.get("hour") != hour_key or commit.get("partial") or "read_from" in commit:
            continue
        if commit.get("slice") == recorded_slice:
            return True
    return False


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


def truncate_watermark(history: list[dict], hour_truncate: list | None) -> list | None:
    """The newest truncate's sequence among the recorded runs and this hour, or None."""
    found = [c["truncated_before"] for c in history if c.get("truncated_before") is not None]
    if hour_truncate is not None:
        found.append(hour_truncate)
    return list(max(tuple(v) for v in found)) if found else None
