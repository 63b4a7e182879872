"""Many tables' hours in one run, on one Spark session, tables in parallel.

A run of the mirrors' multi-asset (`cdc_assets.factory`) hands its selected tables and hours
here. Each table runs its hours in order, on a Spark session of its own sharing the run's
SparkContext (`SparkSession.newSession`: the commit metadata and per-hour settings of one
table can't leak into another's), in a pool of worker threads; Spark's FAIR scheduler shares
the executors between them. Nothing here talks to Dagster: each table's outcome (its hours'
results and checks, or the error that stopped it) comes back to the asset, which records it.

A table that fails stops at that hour; the other tables go on. An hour whose slice is empty
costs no Spark job (`run_hour`), so the fleet's idle tables are nearly free.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field

import dagster as dg
from pyspark.sql import SparkSession

from cdc_assets.checking import MirrorChecks
from cdc_assets.config import TableSpec
from cdc_assets.hour_run import run_hour
from cdc_assets.results import HourResult
from resources.kafka import KafkaResource
from resources.lake import LakeResource
from resources.masking import HmacKey


@dataclass(frozen=True)
class HourRun:
    """One hour of one table, run: what happened and its check results."""

    result: HourResult
    checks: list[dg.AssetCheckResult]
    seconds: float


@dataclass
class TableRun:
    """A table's part of a run: the hours done, in order, and the error that stopped it."""

    spec: TableSpec
    hours: list[HourRun] = field(default_factory=list)
    error: BaseException | None = None
    failed_hour: str | None = None


@dataclass(frozen=True)
class TableWork:
    spec: TableSpec
    hour_keys: Sequence[str]
    masking_key: HmacKey | None = None


def run_tables(
    *,
    spark: SparkSession,
    kafka: KafkaResource,
    lake: LakeResource,
    work: Sequence[TableWork],
    checks: MirrorChecks,
    parallelism: int,
    force_open_hour: bool = False,
    local_read_max_records: int | None = None,
    interpreted_max_bytes: int | None = None,
    on_done: Callable[[TableRun], None] | None = None,
) -> list[TableRun]:
    """Runs each table's hours, tables in parallel; returns their outcomes in `work`'s order.

    `on_done` is called (from the calling thread) as each table finishes, so a caller can log
    progress while the others still run. Each hour is audited, validated and checked by
    `checks` (`cdc_assets.checking`).
    """
    extra: dict = {"checks": checks}
    if local_read_max_records is not None:
        extra["local_read_max_records"] = local_read_max_records
    if interpreted_max_bytes is not None:
        extra["interpreted_max_bytes"] = interpreted_max_bytes
    counter = iter(range(1_000_000))
    lock = threading.Lock()

    def one_table(item: TableWork) -> TableRun:
        with lock:
            worker = next(counter)
        session = spark.newSession()
        # A FAIR pool per worker: one table's long job does not hold the others' small ones.
        session.sparkContext.setLocalProperty("spark.scheduler.pool", f"cdc-{worker}")
        outcome = TableRun(item.spec)
        for hour_key in item.hour_keys:
            started = time.monotonic()
            try:
                result = _run_one_hour(session, kafka, lake, item, hour_key, force_open_hour, extra)
                path = lake.table_path(item.spec.name)
                results = checks.evaluate(spark=session, spec=item.spec, path=path, result=result)
            except Exception as exc:  # the table stops here; the others go on
                outcome.error, outcome.failed_hour = exc, hour_key
                break
            outcome.hours.append(HourRun(result, results, time.monotonic() - started))
        session.sparkContext.setLocalProperty("spark.scheduler.pool", None)
        return outcome

    if parallelism <= 1 or len(work) <= 1:
        outcomes = []
        for item in work:
            outcomes.append(one_table(item))
            if on_done:
                on_done(outcomes[-1])
        return outcomes
    with ThreadPoolExecutor(max_workers=parallelism, thread_name_prefix="cdc-table") as pool:
        futures = {pool.submit(one_table, item): n for n, item in enumerate(work)}
        outcomes_by_index: dict[int, TableRun] = {}
        for future in as_completed(futures):
            outcome = future.result()
            outcomes_by_index[futures[future]] = outcome
            if on_done:
                on_done(outcome)
    return [outcomes_by_index[n] for n in range(len(work))]


def _run_one_hour(
    session: SparkSession,
    kafka: KafkaResource,
    lake: LakeResource,
    item: TableWork,
    hour_key: str,
    force_open_hour: bool,
    extra: dict,
) -> HourResult:
    return run_hour(
        spark=session,
        kafka=kafka,
        lake=lake,
        spec=item.spec,
        hour_key=hour_key,
        force_open_hour=force_open_hour,
        masking_key=item.masking_key,
        **extra,
    )
