"""Helpers shared by the integration tests: demo topics, Kafka read-back, mirror rows, the
daily checks' job run in process."""

from __future__ import annotations

import socket
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

import dagster as dg
from kafka import KafkaConsumer, TopicPartition
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from cdc_assets.commits import live_rows
from cdc_assets.config import TableSpec, load_tables, spark_type
from cdc_assets.factory import build_mirror_assets
from checks.daily import DAILY_CHECKS_JOB, build_daily_checks, build_daily_checks_schedule
from checks.table_checks import MIRROR_CHECKS
from demo.produce import ProducedRecord, produce
from demo.source import DemoSource, as_generated

HOUR_KEY = "%Y-%m-%d-%H:%M"
# Old enough to be closed, recent enough that every spec's start_hour precedes it.
FIRST_HOUR = datetime(2026, 11, 2, 6, tzinfo=UTC)


def demo_specs(prefix: str) -> list[TableSpec]:
    """The demo tables of tables.yaml, on topics private to one test, read as the demo
    generator (demo/source.py) writes them: decimals as text (decimal.handling.mode=string)."""
    return [
        spec.model_copy(update={"topic": f"{prefix}.{spec.topic}"})
        for spec in as_generated(load_tables())
    ]


def run_daily_checks(
    specs: Sequence[TableSpec], resources: dict[str, object]
) -> dict[tuple[str, str], dg.AssetCheckEvaluation]:
    """The `cdc_daily_checks` job of `specs`' mirrors, run in process as its schedule launches
    it (nothing materialized): each check's evaluation by table and check name."""
    checks = [check for spec in specs for check in build_daily_checks(spec)]
    job = dg.Definitions(
        assets=build_mirror_assets(list(specs), checks=MIRROR_CHECKS),
        asset_checks=checks,
        schedules=[build_daily_checks_schedule(checks)],
        resources=resources,
    ).resolve_job_def(DAILY_CHECKS_JOB)
    result = job.execute_in_process()
    assert result.get_asset_materialization_events() == []
    return {
        (e.asset_key.to_user_string(), e.check_name): e
        for e in result.get_asset_check_evaluations()
    }


def hour_keys(first: datetime, count: int) -> list[str]:
    return [(first + timedelta(hours=n)).strftime(HOUR_KEY) for n in range(count)]


def seed_demo(
    bootstrap: str,
    specs: list[TableSpec],
    *,
    hours: int,
    changes_per_hour: int,
    seed: int = 7,
    partitions: int = 3,
    first_hour: datetime = FIRST_HOUR,
) -> tuple[DemoSource, list[ProducedRecord]]:
    source = DemoSource(specs, seed=seed)
    records = source.generate(
        [first_hour + timedelta(hours=n) for n in range(hours)], changes_per_hour
    )
    return source, produce(records, bootstrap, partitions=partitions)


def read_records(bootstrap: str, topic: str, *, headers: bool = False) -> list[tuple]:
    """Every committed record of `topic` as (partition, offset, value, key, timestamp_ms), and
    its headers [(key, value)] last when `headers`."""
    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap,
        enable_auto_commit=False,
        isolation_level="read_committed",
        consumer_timeout_ms=5_000,
    )
    try:
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic))]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        ends = consumer.end_offsets(tps)
        out = []
        while any(consumer.position(tp) < ends[tp] for tp in tps):
            for batch in consumer.poll(timeout_ms=1_000).values():
                out += [
                    (m.partition, m.offset, m.value, m.key, m.timestamp)
                    + ((list(m.headers or ()),) if headers else ())
                    for m in batch
                ]
        return out
    finally:
        consumer.close()


def read_topic(bootstrap: str, topic: str) -> list[tuple[int, int, bytes | None, int]]:
    """Every committed record of `topic` as (partition, offset, value, timestamp_ms)."""
    return [(p, o, v, ts) for p, o, v, _, ts in read_records(bootstrap, topic)]


def accounts_spec(topic: str, *, balance: str = "decimal(10,2)", **overrides) -> TableSpec:
    """The small `accounts` table the edge and fault tests write their own changes for
    (schema-less, decimals as text: decimal.handling.mode=string)."""
    return TableSpec(
        name="accounts",
        topic=topic,
        primary_key=("id",),
        columns={"id": "bigint", "name": "string", "balance": balance},
        start_hour="2026-11-01-00:00",
        **{"decimal_handling": "string", **overrides},
    )


def free_ports(count: int) -> list[int]:
    """Distinct ports nothing listens on right now (all held at once so none repeats)."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def mirror_rows(spark: SparkSession, path: str, spec: TableSpec) -> dict[tuple, dict]:
    """The mirror's live rows as Python values typed like demo.reference's (UTC-aware times)."""
    return typed_rows(live_rows(spark, path), spec)


def typed_rows(frame, spec: TableSpec, extra: Sequence[str] = ()) -> dict[tuple, dict]:
    """`frame`'s rows by primary key: the spec's columns typed like demo.reference's (UTC-aware
    times), and `extra` columns as Spark returns them."""
    columns = []
    for name, declared in spec.columns.items():
        col = F.col(name)
        columns.append(F.unix_micros(col).alias(name) if _is_timestamp(declared) else col)
    rows = {}
    for row in frame.select(*columns, *extra).collect():
        values = row.asDict()
        for name, declared in spec.columns.items():
            if _is_timestamp(declared) and values[name] is not None:
                values[name] = datetime(1970, 1, 1, tzinfo=UTC) + timedelta(
                    microseconds=values[name]
                )
        rows[tuple(values[k] for k in spec.primary_key)] = values
    return rows


def _is_timestamp(declared: str) -> bool:
    return spark_type(declared) == "timestamp"


def full_table(spark: SparkSession, path: str) -> list[dict]:
    """Every row of the mirror, tombstones included, minus the per-run ingestion time."""
    frame = spark.read.format("delta").load(path).drop("_cdc_ingested_at")
    return sorted((r.asDict(recursive=True) for r in frame.collect()), key=repr)


def diff_rows(actual: dict[tuple, dict], expected: dict[tuple, dict]) -> dict[str, list]:
    """Keys missing, unexpected, or with different values; all empty when the tables agree."""
    return {
        "missing": sorted(set(expected) - set(actual)),
        "unexpected": sorted(set(actual) - set(expected)),
        "different": sorted(k for k in set(actual) & set(expected) if actual[k] != expected[k]),
    }
