"""A small accounts table, Debezium changes for it, and the reference to judge its mirror.

The scenarios write their own changes (with the op, key and LSN each fault needs), send them to
a private topic on the real broker, run hours through the real pipeline, and compare the mirror
with `demo.reference` replayed over what Kafka really committed (read back, read_committed).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from kafka import KafkaProducer

from cdc_assets.config import TableSpec
from cdc_assets.hour_run import run_hour
from checks.table_checks import MIRROR_CHECKS
from demo.reference import history as history_reference
from demo.reference import replay, tracked_history
from tests.support import accounts_spec, delta_rows, read_records

FIRST = datetime(2026, 11, 4, 8, tzinfo=UTC)
KEY_FORMAT = "%Y-%m-%d-%H:%M"


def spec(topic: str, **overrides) -> TableSpec:
    return accounts_spec(topic, balance="bigint", **overrides)


def hour_key(n: int) -> str:
    return (FIRST + timedelta(hours=n)).strftime(KEY_FORMAT)


def stamp(hour: int, second: int = 0, *, first: datetime = FIRST) -> int:
    """Kafka timestamp (ms) `second` seconds into hour number `hour` (counted from `first`)."""
    return int((first + timedelta(hours=hour, seconds=second)).timestamp() * 1000)


@dataclass(frozen=True)
class Change:
    """One Kafka record: value None is a tombstone; `key` None sends a null Kafka key."""

    hour: int
    value: bytes | None
    key: bytes | None
    partition: int | None = None
    second: int = 0
    headers: tuple[tuple[str, bytes], ...] = ()
    first: datetime = FIRST  # the start of hour 0 (the daemon scenarios use recent hours)


def key_bytes(row_id: int | None) -> bytes | None:
    return None if row_id is None else json.dumps({"id": row_id}).encode()


def change(
    op: str,
    row_id: int,
    lsn: int,
    *,
    hour: int = 0,
    name: str | None = None,
    balance: int | None = None,
    partition: int | None = None,
    second: int = 0,
    kafka_key: int | None | str = "row",
    first: datetime = FIRST,
) -> Change:
    """A Debezium change of account `row_id` at `lsn`; the Kafka key is the row's id by default."""
    row = {"id": row_id, "name": name if name is not None else f"n{lsn}", "balance": balance or lsn}
    at = stamp(hour, second, first=first)
    envelope = {
        "op": op,
        "before": row if op == "d" else None,
        "after": None if op == "d" else row,
        "source": {"lsn": lsn, "ts_ms": at},
        "ts_ms": at,
    }
    key = key_bytes(row_id) if kafka_key == "row" else key_bytes(kafka_key)  # type: ignore[arg-type]
    return Change(hour, json.dumps(envelope).encode(), key, partition, second, first=first)


def move(
    old_id: int,
    new_id: int,
    lsn: int,
    *,
    hour: int = 0,
    second: int = 0,
    name: str = "__debezium_unavailable_value",
) -> list[Change]:
    """A primary-key update as Debezium's Postgres connector sends it under the default
    replica identity: a delete of the old key (its `before` holds the key only), then a create
    of the new one whose unchanged TOASTed `name` is the placeholder, naming the old key in its
    `__debezium.oldkey` header (Kafka Connect's default header format)."""
    deleted = {
        "op": "d",
        "before": {"id": old_id, "name": None, "balance": None},
        "after": None,
        "source": {"lsn": lsn, "ts_ms": stamp(hour, second)},
    }
    created = json.loads(change("c", new_id, lsn + 1, hour=hour, name=name).value)
    header = (("__debezium.oldkey", json.dumps({"id": old_id}, separators=(",", ":")).encode()),)
    return [
        Change(hour, json.dumps(deleted).encode(), key_bytes(old_id), None, second),
        Change(hour, json.dumps(created).encode(), key_bytes(new_id), None, second, header),
    ]


def tombstone(row_id: int, *, hour: int = 0, partition: int | None = None, second: int = 0):
    return Change(hour, None, key_bytes(row_id), partition, second)


def raw(value: bytes, *, hour: int = 0, key: bytes | None = None, partition: int | None = None):
    return Change(hour, value, key, partition)


def send_all(bootstrap: str, topic: str, changes: Iterable[Change], **producer_options) -> None:
    """Sends `changes` in order (one partition order per key: Kafka's default partitioner)."""
    producer = KafkaProducer(
        bootstrap_servers=bootstrap,
        acks="all",
        linger_ms=5,
        max_in_flight_requests_per_connection=1,
        **producer_options,
    )
    try:
        futures = [
            producer.send(
                topic,
                key=c.key,
                value=c.value,
                partition=c.partition,
                timestamp_ms=stamp(c.hour, c.second, first=c.first),
                headers=list(c.headers) or None,
            )
            for c in changes
        ]
        producer.flush()
        for future in futures:
            future.get(timeout=30)
    finally:
        producer.close()


def close_hours(bootstrap: str, topic: str, partitions: int, after_hour: int) -> None:
    """A record stamped past `after_hour` on every partition, so the hours before it are closed.

    It is a tombstone of an id no scenario uses, so it changes nothing in the mirror.
    """
    send_all(
        bootstrap,
        topic,
        [tombstone(10**9, hour=after_hour + 1, partition=p) for p in range(partitions)],
    )


@dataclass
class Reference:
    expected: dict[tuple, dict]
    seen_keys: set[tuple]


def reference(
    bootstrap: str,
    spec_: TableSpec,
    *,
    upto_hour: int | None = None,
    added_columns: dict[str, str] | None = None,
) -> Reference:
    """The reference replay of every committed record of the topic (up to an hour's end)."""
    records = read_records(bootstrap, spec_.topic, headers=True)
    if upto_hour is not None:
        limit = stamp(upto_hour + 1)
        records = [r for r in records if r[4] < limit]
    return reference_of(spec_, records, added_columns=added_columns)


def hour_of(timestamp_ms: int) -> int:
    """The hour number (see `hour_key`) a Kafka timestamp falls in."""
    return (timestamp_ms - stamp(0)) // 3_600_000


def reference_of(
    spec_: TableSpec,
    records: Sequence[tuple],
    *,
    hours: Collection[int] | None = None,
    added_columns: dict[str, str] | None = None,
) -> Reference:
    """The reference replay of `records` (as `read_records(..., headers=True)` returns them),
    or of those stamped in `hours` only: what materializing exactly those hours must give."""
    if hours is not None:
        records = [r for r in records if hour_of(r[4]) in hours]
    rows = [(p, o, v, k, h) for p, o, v, k, _, h in records]
    expected = replay(spec_, rows, added_columns)
    seen = set()
    for _, _, value, _, _ in rows:
        if value is None:
            continue
        try:
            document = json.loads(value)
            image = document.get("after") or document.get("before") or {}
            if image.get("id") is not None:
                seen.add((image["id"],))
        except (ValueError, AttributeError):
            continue
    return Reference(expected, seen)


def hours_of(changes: Sequence[Change]) -> list[int]:
    return sorted({c.hour for c in changes})


def runner(spark, kafka, lake, spec_: TableSpec):
    """run(hour, **options): materializes hour number `hour` of `spec_` into `lake` through the
    real pipeline (`run_hour`), with any of its options (`now`, `local_read_max_records`)."""

    def run(hour: int, **options):
        return run_hour(
            checks=MIRROR_CHECKS,
            spark=spark,
            kafka=kafka,
            lake=lake,
            spec=spec_,
            hour_key=hour_key(hour),
            **options,
        )

    return run


def history_differences(
    path: str, spec_: TableSpec, records: Sequence[tuple], *, folded: bool = False
) -> list[str]:
    """`<table>__history` at `path` against `demo.reference.history` of `records` (as
    `read_records(..., headers=True)` returns them), version by version: each key's versions in
    sequence order with their values, op, start and end in sequence and source time, currency
    (and TOASTed values' unknown flags). Kafka coordinates are left out (a change delivered
    twice is one version, kept with whichever coordinates). `folded`: against
    `demo.reference.tracked_history` (a table with tracked columns). Returns what differs, []
    when nothing does. The history is read with deltalake (`tests.support.delta_rows`)."""
    from cdc_assets.columns import source_fields  # tests: imported where used

    reference = tracked_history if folded else history_reference
    expected = reference(spec_, [(p, o, v, k, h) for p, o, v, k, _, h in records])
    stored = delta_rows(path)
    fields = source_fields(stored.schema.field("_cdc_sequence").type)

    def position(struct) -> tuple | None:
        return None if struct is None else tuple(struct[f] for f in fields)

    flags = [f"_cdc_unknown__{c}" for c in spec_.toasted_columns]
    compared = [*spec_.columns, "_cdc_op", "_cdc_deleted", *flags]
    actual: dict[tuple, list[dict]] = {}
    for values in stored.to_pylist():
        version = {c: values[c] for c in compared}  # deltalake's times are UTC-aware
        version.update(
            _cdc_sequence=position(values["_cdc_sequence"]),
            _cdc_end_sequence=position(values["_cdc_end_sequence"]),
            _cdc_valid_from=values["_cdc_valid_from"],
            _cdc_valid_to=values["_cdc_valid_to"],
            _cdc_current=values["_cdc_current"],
        )
        actual.setdefault(tuple(values[k] for k in spec_.primary_key), []).append(version)
    problems = []
    for key in sorted(set(expected) | set(actual), key=repr):
        theirs = sorted(actual.get(key, []), key=lambda v: v["_cdc_sequence"])
        ours = [{c: v.get(c) for c in theirs[0]} if theirs else v for v in expected.get(key, [])]
        if theirs != ours:
            problems.append(f"key {key}: history {theirs} != reference {ours}")
    return problems


def history_audit(spark, spec_: TableSpec, path: str, lake):
    """The history at `path` judged whole against the mirror, as the daily check judges it
    (`cdc_assets.history.audit_history` over every key's versions)."""
    from cdc_assets.history import audit_history, data_columns  # tests: imported where used

    versions = spark.read.format("delta").load(path)
    keys = versions.select(*spec_.primary_key, "_cdc_sequence")
    mirror = lake.table_path(spec_.name)
    return audit_history(spark, spec_, path, mirror, keys, data_columns(spec_, versions))
