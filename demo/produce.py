"""Writes generated `DemoRecord`s to Kafka, and a command line that seeds topics with them.

The generated events (demo/source.py) cover what a real database can't be made to produce on
demand (malformed records, late producer timestamps, foreign keys); the demo itself runs on a
real Postgres and its Debezium connector (demo/shop.py).

Keys are partitioned by kafka-python's default partitioner (murmur2, as in the Java client),
so one primary key always lands in one partition. Records carry their own CreateTime
(`DemoRecord.timestamp_ms`), late ones included.

Command line (seeds the last N closed UTC hours, default 6, and exits)::

    python -m demo.produce --bootstrap 127.0.0.1:19092 --hours 6 --changes-per-hour 200 --seed 7
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from kafka import KafkaAdminClient, KafkaProducer
from kafka.errors import TopicAlreadyExistsError

from cdc_assets.config import DEFAULT_TABLES_FILE, load_tables
from demo.source import RECORD_KINDS, DemoRecord, DemoSource

# CreateTime is Kafka's default; stated so a broker default of LogAppendTime cannot replace
# the demo's (deliberately late) producer timestamps.
DEFAULT_TOPIC_CONFIGS: Mapping[str, str] = {"message.timestamp.type": "CreateTime"}
_SEND_TIMEOUT_S = 60


@dataclass(frozen=True)
class ProducedRecord:
    """Where Kafka stored one `DemoRecord`."""

    record: DemoRecord
    topic: str
    partition: int
    offset: int
    timestamp_ms: int


def ensure_topics(
    admin: KafkaAdminClient,
    topics: Iterable[str],
    *,
    partitions: int,
    configs: Mapping[str, str] = DEFAULT_TOPIC_CONFIGS,
) -> list[str]:
    """Creates the missing `topics` (replication 1) and returns the names it created."""
    existing = set(admin.list_topics())
    missing = sorted(set(topics) - existing)
    if not missing:
        return []
    request = {
        topic: {"num_partitions": partitions, "replication_factor": 1, "configs": dict(configs)}
        for topic in missing
    }
    try:
        admin.create_topics(request, wait_for_metadata=True)
    except TopicAlreadyExistsError:
        # Another producer created it between list and create; it exists, as wanted.
        admin.wait_for_topics(missing)
    return missing


def new_producer(bootstrap_servers: str, client_id: str) -> KafkaProducer:
    """A producer that keeps each partition's records in send order, acknowledged by all."""
    return KafkaProducer(
        bootstrap_servers=bootstrap_servers,
        client_id=client_id,
        acks="all",
        linger_ms=5,
        # Without idempotence, one request in flight keeps retries from reordering records.
        enable_idempotence=False,
        max_in_flight_requests_per_connection=1,
        retries=5,
    )


def produce(
    records: Iterable[DemoRecord],
    bootstrap_servers: str,
    *,
    partitions: int = 3,
    create_topics: bool = True,
    topic_configs: Mapping[str, str] = DEFAULT_TOPIC_CONFIGS,
) -> list[ProducedRecord]:
    """Sends `records` in order and returns where each one was stored, in send order.

    Args:
        records: The records; a None value is sent as a tombstone.
        bootstrap_servers: "host:port[,host:port]".
        partitions: Partition count for topics this call creates (existing ones are kept).
        create_topics: Create missing topics first (replication factor 1).
        topic_configs: Topic configs for created topics.
    """
    records = list(records)
    if create_topics:
        admin = KafkaAdminClient(bootstrap_servers=bootstrap_servers, client_id="demo-admin")
        try:
            ensure_topics(
                admin, {r.topic for r in records}, partitions=partitions, configs=topic_configs
            )
        finally:
            admin.close()
    producer = new_producer(bootstrap_servers, "demo-producer")
    try:
        futures = [
            producer.send(r.topic, key=r.key, value=r.value, timestamp_ms=r.timestamp_ms)
            for r in records
        ]
        producer.flush()
        produced = []
        for record, future in zip(records, futures, strict=True):
            metadata = future.get(timeout=_SEND_TIMEOUT_S)
            produced.append(
                ProducedRecord(
                    record=record,
                    topic=metadata.topic,
                    partition=metadata.partition,
                    offset=metadata.offset,
                    timestamp_ms=metadata.timestamp,
                )
            )
        return produced
    finally:
        producer.close()


def closed_hours(now: datetime, count: int) -> list[datetime]:
    """The `count` whole UTC hours that ended at or before `now`, oldest first."""
    end = now.astimezone(UTC).replace(minute=0, second=0, microsecond=0)
    return [end - timedelta(hours=n) for n in range(count, 0, -1)]


def summarize(produced: Sequence[ProducedRecord]) -> str:
    """Counts per topic and record kind, plus the partitions used."""
    lines = []
    for topic in sorted({p.topic for p in produced}):
        rows = [p for p in produced if p.topic == topic]
        kinds = Counter(p.record.kind for p in rows)
        per_kind = ", ".join(f"{kind} {kinds[kind]}" for kind in RECORD_KINDS)
        partitions = Counter(p.partition for p in rows)
        spread = ", ".join(f"p{part}: {n}" for part, n in sorted(partitions.items()))
        lines.append(f"{topic}: {len(rows)} records ({per_kind}); {spread}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Seeds the demo topics with the last N closed hours of changes, or follows the clock."""
    parser = argparse.ArgumentParser(
        prog="python -m demo.produce", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--bootstrap", default="127.0.0.1:19092", help="Kafka bootstrap servers")
    parser.add_argument(
        "--hours",
        type=int,
        default=None,
        help="closed UTC hours to seed (default 6)",
    )
    parser.add_argument("--changes-per-hour", type=int, default=200)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--partitions", type=int, default=3, help="for topics created here")
    parser.add_argument("--tables-file", default=str(DEFAULT_TABLES_FILE))
    parser.add_argument(
        "--wrapped",
        default="orders",
        help="comma-separated tables sent with the schema/payload wrapper ('' for none)",
    )
    args = parser.parse_args(argv)
    if args.changes_per_hour < 1:
        parser.error("--changes-per-hour must be at least 1")
    args.hours = 6 if args.hours is None else args.hours
    if args.hours < 1:
        parser.error("--hours must be at least 1")

    specs = load_tables(args.tables_file)
    wrapped = {name for name in args.wrapped.split(",") if name}
    source = DemoSource(specs, seed=args.seed, wrapped=wrapped)
    hours = closed_hours(datetime.now(UTC), args.hours)
    records = source.generate(hours, args.changes_per_hour)
    produced = produce(records, args.bootstrap, partitions=args.partitions)
    print(
        f"produced {len(produced)} records for {hours[0]:%Y-%m-%d %H:00} to "
        f"{hours[-1] + timedelta(hours=1):%Y-%m-%d %H:00} UTC to {args.bootstrap}"
    )
    print(summarize(produced))
    return 0


if __name__ == "__main__":
    sys.exit(main())
