"""What a small table-hour costs on a started session, and where the JVM's CPU goes.

    PYTHONPATH=. .venv/bin/python -m benchmarks.small_hours   # 10 hours of 200 changes
    PYTHONPATH=. .venv/bin/python -m benchmarks.small_hours --conf spark.sql.adaptive.enabled=true

Starts its own Kafka broker (`.local/bench/small-hours`), sends HOURS hours of CHANGES creates
and updates of an accounts table over 500 keys, then runs the hours in order through `run_hour`
with every check, on one Spark session configured as the tests' (`local[2]`, 2g driver, 4
shuffle partitions, one partition for a Delta log's replay), plus any `--conf`. For each hour it
prints its wall time, the CPU seconds of the Spark JVM and of this process, and the classes
Spark's code generation compiled. The first hours warm the JVM up (its JIT compilers take a
large share of its CPU for minutes); the summary is the mean over the hours from the fourth on.
Every mirror is compared with the plain-Python replay of its topic at the end. Not part of the
tests; run it on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psutil
from kafka import KafkaAdminClient, KafkaProducer
from kafka.admin import NewTopic

from cdc_assets.config import TableSpec
from cdc_assets.hour_run import run_hour
from checks.table_checks import MIRROR_CHECKS
from demo.reference import replay
from devtools import kafka_broker
from devtools.processes import port_free
from resources.kafka import KafkaResource
from resources.lake import LakeResource
from resources.spark import SparkResource, compiled_classes

REPO = Path(__file__).resolve().parents[1]
FIRST = datetime(2026, 11, 4, 8, tzinfo=UTC)
HOUR_FORMAT = "%Y-%m-%d-%H:%M"
PARTITIONS = 3
KEYS = 500
WARM_FROM = 3  # hours before this one warm the JVM up and are left out of the mean


def _spec() -> TableSpec:
    return TableSpec(
        name="accounts",
        topic="small-hours",
        primary_key=("id",),
        columns={"id": "bigint", "name": "string", "balance": "bigint"},
        start_hour="2026-11-01-00:00",
        decimal_handling="string",
    )


def _events(hours: int, changes: int) -> list[tuple[int, bytes, bytes]]:
    """(timestamp ms, key, value): creates and updates, LSNs increasing, seconds into each hour."""
    rng, lsn, out = random.Random(1), 1_000, []
    for hour in range(hours):
        for n in range(changes):
            lsn += 10
            row_id = rng.randrange(KEYS)
            at = int((FIRST + timedelta(hours=hour, seconds=1 + n)).timestamp() * 1000)
            envelope = {
                "op": rng.choice("cu"),
                "before": None,
                "after": {"id": row_id, "name": f"n{lsn}", "balance": lsn},
                "source": {"lsn": lsn, "ts_ms": at},
                "ts_ms": at,
            }
            key = json.dumps({"id": row_id}).encode()
            out.append((at, key, json.dumps(envelope).encode()))
    return out


def _send(bootstrap: str, topic: str, hours: int, changes: int) -> list[tuple]:
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        admin.create_topics([NewTopic(topic, num_partitions=PARTITIONS, replication_factor=1)])
    finally:
        admin.close()
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
    records = []
    try:
        for at, key, value in _events(hours, changes):
            meta = producer.send(topic, key=key, value=value, timestamp_ms=at).get(timeout=30)
            records.append((meta.partition, meta.offset, value, key, ()))
        # A tombstone of an unused key past the last hour on every partition closes the hours.
        close = int((FIRST + timedelta(hours=hours, seconds=1)).timestamp() * 1000)
        for p in range(PARTITIONS):
            key = json.dumps({"id": 10**9}).encode()
            producer.send(topic, key=key, value=None, timestamp_ms=close, partition=p).get(30)
    finally:
        producer.close()
    return records


def _cmdline(process: psutil.Process) -> str:
    """A child's command line; "" for one that has exited (a zombie until it is reaped)."""
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


def _cpu(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hours", type=int, default=10)
    parser.add_argument("--changes", type=int, default=200, help="changes per hour")
    parser.add_argument("--conf", action="append", default=[], help="KEY=VALUE, a Spark setting")
    parser.add_argument("--work", default=str(REPO / ".local" / "bench" / "small-hours"))
    args = parser.parse_args(argv)
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    extra = dict(item.split("=", 1) for item in args.conf)
    port = 29092  # away from the tests' free ports and the ingest benchmark's 19092
    while not (port_free(port) and port_free(port + 1)):
        port += 2
    broker = kafka_broker.BrokerConfig(port=port, data_dir=work / "kafka")
    bootstrap = kafka_broker.start(broker)
    try:
        spec = _spec()
        records = _send(bootstrap, spec.topic, args.hours, args.changes)
        resource = SparkResource(
            master="local[2]", shuffle_partitions=4, delta_snapshot_partitions=1, extra_conf=extra
        )
        spark = resource.session
        me = psutil.Process()
        # The session's JVM (the broker is a child of this process too).
        (jvm,) = [c for c in me.children(recursive=True) if "SparkSubmit" in _cmdline(c)]
        kafka = KafkaResource(bootstrap_servers=bootstrap)
        lake = LakeResource(root=str(work / "lake"))
        rows = []
        for hour in range(args.hours):
            key = (FIRST + timedelta(hours=hour)).strftime(HOUR_FORMAT)
            before = (time.monotonic(), _cpu(jvm), _cpu(me), compiled_classes(spark))
            result = run_hour(
                spark=spark, kafka=kafka, lake=lake, spec=spec, hour_key=key, checks=MIRROR_CHECKS
            )
            after = (time.monotonic(), _cpu(jvm), _cpu(me), compiled_classes(spark))
            wall, jvm_s, python_s, compiles = (a - b for a, b in zip(after, before, strict=True))
            failed = [c.check_name for c in result.expectations if not c.success]
            rows.append((wall, jvm_s, python_s, compiles))
            print(
                f"hour {hour}: {wall:5.2f} s wall, JVM {jvm_s:5.2f} s CPU, Python "
                f"{python_s:4.2f} s CPU, {compiles:3d} classes compiled, "
                f"{result.counts.applied} changes applied"
                + (f", FAILED {failed}" if failed else ""),
                flush=True,
            )
        warm = rows[WARM_FROM:] or rows
        means = [statistics.mean(column) for column in zip(*warm, strict=True)]
        print(
            f"hours {WARM_FROM}-{args.hours - 1}, mean: {means[0]:.2f} s wall, "
            f"JVM {means[1]:.2f} s CPU, Python {means[2]:.2f} s CPU, "
            f"{means[3]:.0f} classes compiled" + (f" (settings: {extra})" if extra else "")
        )
        expected = replay(spec, records)
        table = spark.read.format("delta").load(lake.table_path(spec.name))
        mirror = {row["id"]: row.asDict() for row in table.where("NOT _cdc_deleted").collect()}
        wrong = [
            k
            for k, row in expected.items()
            if k[0] not in mirror or any(mirror[k[0]][c] != row[c] for c in spec.columns)
        ]
        print(f"mirror against the replay: {len(expected)} keys, {len(wrong)} differ")
        return 1 if wrong or len(mirror) != len(expected) else 0
    finally:
        kafka_broker.stop(broker)


if __name__ == "__main__":
    raise SystemExit(main())
