"""Helpers shared by the integration tests: demo topics, Kafka read-back, mirror rows, the
daily checks' job run in process.

The oracles read Delta tables with deltalake (delta-rs and its DataFusion engine, `delta_rows`),
not with the Spark and delta-spark that wrote them: independent of the code under test, and a
few milliseconds a read where a Spark job on the suite's session costs tenths of a second."""

from __future__ import annotations

import socket
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

import dagster as dg
import pyarrow as pa
from deltalake import DeltaTable, QueryBuilder
from kafka import KafkaConsumer, TopicPartition
from pyspark.sql import functions as F

from cdc_assets.columns import DELETED
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


# deltalake's connection to the suite's S3 server (tests/conftest.py's `s3` sets it), for the
# oracles' reads of an s3a:// mirror.
S3_OPTIONS: dict[str, str] = {}


def delta_rows(path: str, *, where: str | None = None, version: int | None = None) -> pa.Table:
    """The Delta table at `path` (its `version`, else the newest), rows matching the SQL
    `where`, read by deltalake's query engine (which applies deletion vectors)."""
    location = path.replace("s3a://", "s3://", 1)
    options = dict(S3_OPTIONS) if location.startswith("s3://") else None
    if options == {}:
        raise ValueError(f"{path}: the oracles read S3 through the `s3` fixture, not started")
    if options is None and "://" in location and not location.startswith("file://"):
        raise ValueError(f"the oracles read local or S3 tables, not {path}")
    table = DeltaTable(location, version=version, storage_options=options)
    query = "SELECT * FROM t" + (f" WHERE {where}" if where else "")
    return pa.table(QueryBuilder().register("t", table).execute(query))


def mirror_rows(path: str, spec: TableSpec) -> dict[tuple, dict]:
    """The mirror's live rows as Python values typed like demo.reference's (UTC-aware times),
    read with deltalake."""
    return rows_by_key(delta_rows(path, where=f"NOT {DELETED}").to_pylist(), spec)


def rows_by_key(rows: Sequence[dict], spec: TableSpec) -> dict[tuple, dict]:
    """`rows` by primary key, the spec's columns only."""
    return {
        tuple(row[k] for k in spec.primary_key): {c: row[c] for c in spec.columns} for row in rows
    }


def typed_rows(frame, spec: TableSpec, extra: Sequence[str] = ()) -> dict[tuple, dict]:
    """A Spark `frame`'s rows by primary key: the spec's columns typed like demo.reference's
    (UTC-aware times), and `extra` columns as Spark returns them."""
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


def full_table(path: str) -> list[dict]:
    """Every row of the mirror, tombstones included, minus the per-run ingestion time, read
    with deltalake."""
    rows = delta_rows(path).drop_columns(["_cdc_ingested_at"]).to_pylist()
    return sorted(rows, key=repr)


def diff_rows(actual: dict[tuple, dict], expected: dict[tuple, dict]) -> dict[str, list]:
    """Keys missing, unexpected, or with different values; all empty when the tables agree."""
    return {
        "missing": sorted(set(expected) - set(actual)),
        "unexpected": sorted(set(actual) - set(expected)),
        "different": sorted(k for k in set(actual) & set(expected) if actual[k] != expected[k]),
    }
