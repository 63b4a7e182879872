"""Offset-progress sensors: one per mirrored table, launching each hour once Kafka says it closed.

Every tick looks at the table's topic and decides, hour by hour from the oldest hour it still
watches up to now:

- **closed**: the rule of `cdc_assets.slicing.open_reason`, the same one the run applies: every
  partition holds a committed message stamped at or after the hour's end, or the end plus the
  table's allowed lateness has passed; an open transaction keeps the hour open.
- **requested once**: the hour's slice is [b(H), b(H+1)) per partition (offsets_for_times). Each
  closed hour whose slice was not requested before is requested, consecutive hours together in
  one run of at most `hours_per_run` hours (the asset runs a range hour by hour, in order).
  The run key names the table, the hours and the end offsets, so Dagster starts a slice once;
  when late data moves an hour's end (a partition that was idle when the hour closed by
  lateness), the slice changes and the hour, and the hours after it whose start moved, run
  again. An hour already materialized with the same slice (from the UI, or before the sensor's
  cursor was reset) is not requested again.
- **settled**: an hour whose every partition moved past its end can no longer change; it leaves
  the cursor. An hour closed by lateness is watched for `watch_hours` more; late data that
  arrives after that lands in the next hour to run (every hour starts where the previous
  recorded run ended), so it is read once, never lost.

The cursor (JSON: the oldest watched hour, and the slice requested per watched hour) is stored
by Dagster with the sensor, so it survives daemon restarts. Each tick also records the table's
consumer lag as an asset observation: committed messages the mirror has not read, and how many
seconds the newest of them is ahead of the mirror.

A Kafka that does not answer fails the tick within `kafka_timeout_seconds`, naming the table and
the bootstrap servers; the cursor stays where it was, so the next tick starts over.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TypeVar

import dagster as dg
from kafka import KafkaConsumer, TopicPartition
from kafka.errors import KafkaError

from cdc_assets.config import TableSpec
from cdc_assets.hour_run import HOUR_KEY_FORMAT, hour_start
from cdc_assets.slicing import SliceError, open_reason, open_transactions, topic_partitions
from checks.table_checks import run_check_names
from resources.kafka import KafkaResource

# Catching up after a long outage happens over several ticks, a week of hours at a time.
MAX_HOURS_PER_TICK = 24 * 7
RANGE_START_TAG = "dagster/asset_partition_range_start"
RANGE_END_TAG = "dagster/asset_partition_range_end"
HOUR = timedelta(hours=1)

T = TypeVar("T")


class KafkaUnavailableError(RuntimeError):
    """Kafka did not answer the sensor in time; the tick fails and the cursor stays."""


def hour_key(moment: datetime) -> str:
    return moment.strftime(HOUR_KEY_FORMAT)


def floor_hour(moment: datetime) -> datetime:
    return moment.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


@dataclass
class Cursor:
    """What the sensor has requested: the oldest hour it still watches, and per watched hour
    the slice (`fingerprint`) it requested last."""

    watch_from: str | None = None
    requested: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, raw: str | None) -> Cursor:
        if not raw:
            return cls()
        data = json.loads(raw)
        return cls(watch_from=data.get("watch_from"), requested=dict(data.get("requested", {})))

    def dump(self) -> str:
        return json.dumps(
            {"watch_from": self.watch_from, "requested": dict(sorted(self.requested.items()))},
            sort_keys=True,
        )


@dataclass(frozen=True)
class TopicProgress:
    """One look at the topic: what a tick needs, read from Kafka in one go."""

    partitions: tuple[int, ...]
    log_starts: dict[int, int]
    stable_ends: dict[int, int]  # read_committed end offsets (last stable offsets)
    in_transaction: frozenset[int]  # partitions with an open transaction
    # boundary hour start -> partition -> first committed offset stamped at or after it
    # (None: no such message yet)
    boundaries: dict[datetime, dict[int, int | None]]
    newest_ms: dict[int, int]  # partition -> timestamp of its newest committed message
    # Hour of the oldest message since the table's start; looked up on the first tick only.
    first_data_hour: datetime | None


@dataclass(frozen=True)
class HourState:
    key: str
    start: dict[int, int]
    end: dict[int, int]
    moved_past: bool  # every partition holds a committed message stamped past the hour
    open_reason: str | None

    @property
    def fingerprint(self) -> str:
        return ",".join(f"{p}:{self.start[p]}-{self.end[p]}" for p in sorted(self.end))

    @property
    def offsets(self) -> dict[str, dict[str, int]]:
        """As the materialization metadata `kafka_offsets` writes it."""
        return {
            str(p): {"start": self.start[p], "end": self.end[p], "records": self.end[p] - s}
            for p, s in self.start.items()
        }


@dataclass(frozen=True)
class HourRange:
    hours: tuple[HourState, ...]

    @property
    def first(self) -> str:
        return self.hours[0].key

    @property
    def last(self) -> str:
        return self.hours[-1].key

    def run_key(self, table: str) -> str:
        ends = ",".join(f"{p}={o}" for p, o in sorted(self.hours[-1].end.items()))
        span = self.first if len(self.hours) == 1 else f"{self.first}..{self.last}"
        digest = hashlib.sha1("|".join(h.fingerprint for h in self.hours).encode()).hexdigest()
        return f"{table}:{span}:ends[{ends}]:{digest[:10]}"


@dataclass(frozen=True)
class TickPlan:
    ranges: list[HourRange]
    cursor: Cursor
    hours: list[HourState]  # the closed hours looked at, oldest first
    waiting: str | None  # why the oldest open hour is open


@dataclass(frozen=True)
class Watch:
    """What a tick reads of one table's topic: from `watch_from` (None on the table's first
    tick: from the hour of its oldest message since `floor`, the table's first hour) to now."""

    table: str
    topic: str
    watch_from: datetime | None
    floor: datetime


def read_progress(
    consumer: KafkaConsumer,
    uncommitted: KafkaConsumer,
    *,
    table: str,
    topic: str,
    watch_from: datetime | None,
    floor: datetime,
    now: datetime,
) -> TopicProgress:
    """`read_fleet_progress` of one table; raises its error (a missing topic, say)."""
    found = read_fleet_progress(
        consumer, uncommitted, [Watch(table, topic, watch_from, floor)], now=now
    )[table]
    if isinstance(found, Exception):
        raise found
    return found


def read_fleet_progress(
    consumer: KafkaConsumer,
    uncommitted: KafkaConsumer,
    watches: Sequence[Watch],
    *,
    now: datetime,
) -> dict[str, TopicProgress | SliceError]:
    """Reads what a tick needs of every watched topic at once: offsets per hour boundary from
    each table's `watch_from` to now, log starts, stable ends, open transactions, and the newest
    timestamps. Each Kafka request covers every topic (one per hour boundary for the offsets by
    time), so a tick's cost follows the hours watched, not the number of tables. A table whose
    topic is missing gets its error instead; the others are read."""
    consumer.topics()  # one metadata request for every topic; the lookups below use it
    tps_of: dict[str, list[TopicPartition]] = {}
    out: dict[str, TopicProgress | SliceError] = {}
    for watch in watches:
        try:
            tps_of[watch.table] = topic_partitions(consumer, table=watch.table, topic=watch.topic)
        except SliceError as error:
            out[watch.table] = error
    every = sorted({tp for tps in tps_of.values() for tp in tps})
    if not every:
        return out
    log_starts = consumer.beginning_offsets(every)
    # First ticks look for where each table's data begins (by its own first hour).
    first_hour: dict[str, datetime | None] = {}
    firsts = [w for w in watches if w.table in tps_of and w.watch_from is None]
    for floor in sorted({w.floor for w in firsts}):
        tps = sorted({tp for w in firsts if w.floor == floor for tp in tps_of[w.table]})
        at = consumer.offsets_for_times({tp: _ms(floor) for tp in tps})
        for w in (w for w in firsts if w.floor == floor):
            stamps = [at[tp].timestamp for tp in tps_of[w.table] if at[tp] is not None]
            first_hour[w.table] = max(floor_hour(_from_ms(min(stamps))), floor) if stamps else None
    # The hour boundaries each table needs, looked up together per boundary.
    wanted: dict[datetime, set[TopicPartition]] = {}
    starts: dict[str, datetime] = {}
    for watch in (w for w in watches if w.table in tps_of):
        start = watch.watch_from or first_hour.get(watch.table) or floor_hour(now)
        starts[watch.table] = start
        hours = min(int((floor_hour(now) - start) / HOUR), MAX_HOURS_PER_TICK)
        for moment in (start + HOUR * n for n in range(hours + 1)):
            wanted.setdefault(moment, set()).update(tps_of[watch.table])
    offsets: dict[datetime, dict[TopicPartition, int | None]] = {}
    for moment, tps in sorted(wanted.items()):
        at = consumer.offsets_for_times({tp: _ms(moment) for tp in sorted(tps)})
        offsets[moment] = {tp: (None if at[tp] is None else at[tp].offset) for tp in tps}
    # Fetched last: every offset found above lies below these.
    stable_ends = consumer.end_offsets(every)
    pending = open_transactions(uncommitted, stable_ends)
    newest = _newest_timestamps(consumer, every, log_starts, stable_ends)
    for watch in (w for w in watches if w.table in tps_of):
        tps = tps_of[watch.table]
        start = starts[watch.table]
        hours = min(int((floor_hour(now) - start) / HOUR), MAX_HOURS_PER_TICK)
        out[watch.table] = TopicProgress(
            partitions=tuple(tp.partition for tp in tps),
            log_starts={tp.partition: log_starts[tp] for tp in tps},
            stable_ends={tp.partition: stable_ends[tp] for tp in tps},
            in_transaction=frozenset(tp.partition for tp in tps if tp in pending),
            boundaries={
                moment: {tp.partition: offsets[moment][tp] for tp in tps}
                for moment in (start + HOUR * n for n in range(hours + 1))
            },
            newest_ms={tp.partition: newest[tp] for tp in tps if tp in newest},
            first_data_hour=first_hour.get(watch.table),
        )
    return out


def _newest_timestamps(
    consumer: KafkaConsumer,
    tps: list[TopicPartition],
    log_starts: Mapping[TopicPartition, int],
    stable_ends: Mapping[TopicPartition, int],
) -> dict[TopicPartition, int]:
    """The newest committed message's timestamp per partition (a few records read at the end)."""
    wanted = [tp for tp in tps if stable_ends[tp] > log_starts[tp]]
    if not wanted:
        return {}
    consumer.assign(wanted)
    for tp in wanted:
        # A few records back: the very last offset may be a transaction marker.
        consumer.seek(tp, max(stable_ends[tp] - 5, log_starts[tp]))
    newest: dict[TopicPartition, int] = {}
    remaining = set(wanted)
    for _ in range(10 + len(wanted) // 50):
        for tp, records in consumer.poll(timeout_ms=200).items():
            newest[tp] = max([newest.get(tp, 0)] + [r.timestamp for r in records])
            if consumer.position(tp) >= stable_ends[tp]:
                remaining.discard(tp)
                consumer.pause(tp)
        if not remaining:
            break
    consumer.unsubscribe()
    return newest


def plan_tick(
    spec: TableSpec,
    progress: TopicProgress,
    cursor: Cursor,
    *,
    now: datetime,
    watch_from: datetime,
    watch_hours: int,
    already_materialized: Callable[[list[HourState]], set[str]],
) -> TickPlan:
    """Which hours to request, and the cursor after this tick. Pure, given the Kafka reads."""
    lateness = timedelta(minutes=spec.allowed_lateness_minutes)
    hours: list[HourState] = []
    waiting = None
    moment = watch_from
    while moment + HOUR in progress.boundaries:
        start = _offsets_at(progress, progress.boundaries[moment])
        at_end = progress.boundaries[moment + HOUR]
        end = _offsets_at(progress, at_end)
        idle = [p for p in progress.partitions if at_end[p] is None]
        reason = open_reason(
            hour_end=moment + HOUR,
            now=now,
            allowed_lateness=lateness,
            waiting=idle,
            in_transaction=[p for p in idle if p in progress.in_transaction],
        )
        if reason is not None:
            waiting = f"hour {hour_key(moment)} is open: {reason}"
            break  # later hours can't have closed before it
        hours.append(HourState(hour_key(moment), start, end, not idle, None))
        moment += HOUR

    fresh = [h for h in hours if cursor.requested.get(h.key) != h.fingerprint]
    done = already_materialized([h for h in fresh if h.key not in cursor.requested])
    needed = {h.key for h in fresh if h.key not in done}
    requested = {**cursor.requested, **{h.key: h.fingerprint for h in hours}}

    ranges, current = [], []
    for hour in hours:
        if hour.key in needed and len(current) < spec.hours_per_run:
            current.append(hour)
            continue
        if current:
            ranges.append(HourRange(tuple(current)))
        current = [hour] if hour.key in needed else []
    if current:
        ranges.append(HourRange(tuple(current)))

    # Settled hours leave the cursor: all partitions moved past them (and past the hour
    # before, so their start is fixed too), or they closed longer ago than the watch window.
    settled_until = watch_from
    for hour in hours:
        old = now - hour_start(hour.key) - HOUR > timedelta(hours=watch_hours)
        if not (hour.moved_past or old):
            break
        settled_until = hour_start(hour.key) + HOUR
    kept = {k: v for k, v in requested.items() if hour_start(k) >= settled_until}
    return TickPlan(
        ranges=ranges,
        cursor=Cursor(watch_from=hour_key(settled_until), requested=kept),
        hours=hours,
        waiting=waiting,
    )


def _offsets_at(progress: TopicProgress, found: Mapping[int, int | None]) -> dict[int, int]:
    """b(t) per partition: the first offset stamped at or after t, else the stable end."""
    return {
        p: max(progress.log_starts[p], progress.stable_ends[p] if o is None else o)
        for p, o in found.items()
    }


def consumer_lag(
    progress: TopicProgress, mirrored: tuple[datetime, dict[int, int]] | None
) -> dict[str, dg.MetadataValue]:
    """Messages the mirror has not read, and how far the newest one is ahead of the mirror.

    `mirrored`: (end of the newest materialized hour, its end offsets), or None.
    """
    until, ends = mirrored if mirrored else (None, {})
    behind = {
        p: max(progress.stable_ends[p] - ends.get(p, progress.log_starts[p]), 0)
        for p in progress.partitions
    }
    newest = max(progress.newest_ms.values(), default=None)
    seconds = 0.0
    if sum(behind.values()) and newest is not None:
        reference = until or _from_ms(min(progress.newest_ms.values()))
        seconds = max((_from_ms(newest) - reference).total_seconds(), 0.0)
    metadata = {
        "lag_messages": dg.MetadataValue.int(sum(behind.values())),
        "lag_seconds": dg.MetadataValue.float(round(seconds, 3)),
        "lag_messages_by_partition": dg.MetadataValue.json({str(p): n for p, n in behind.items()}),
    }
    if until is not None:
        metadata["mirrored_until"] = dg.MetadataValue.timestamp(until)
    return metadata


def with_deadline(seconds: float, what: str, read: Callable[[], T]) -> T:
    """`read()`, or a `KafkaUnavailableError` after `seconds`: the daemon never hangs on Kafka.

    A read still running then is left to finish in its own daemon thread.
    """
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kafka-tick")
    future = pool.submit(read)
    pool.shutdown(wait=False)
    try:
        return future.result(timeout=seconds)
    except concurrent.futures.TimeoutError:
        raise KafkaUnavailableError(
            f"{what}: Kafka did not answer within {seconds:g} s. The tick is skipped and its "
            "cursor kept; check that the brokers are up and reachable, and the kafka "
            "resource's bootstrap_servers and security settings."
        ) from None
    except KafkaError as exc:
        raise KafkaUnavailableError(
            f"{what}: Kafka failed ({type(exc).__name__}: {exc}). The tick is skipped and its "
            "cursor kept; check that the brokers are up and reachable, and the kafka "
            "resource's bootstrap_servers and security settings."
        ) from None


def _ms(moment: datetime) -> int:
    return int(moment.timestamp() * 1000)


def _from_ms(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, UTC)


@dataclass
class FleetCursor:
    """The sensor's cursor: each table's `Cursor`, and when its lag was last observed."""

    tables: dict[str, Cursor] = field(default_factory=dict)
    # table -> [lag_messages, epoch seconds] of the last lag observation recorded
    lag: dict[str, list] = field(default_factory=dict)

    @classmethod
    def parse(cls, raw: str | None) -> FleetCursor:
        if not raw:
            return cls()
        data = json.loads(raw)
        return cls(
            tables={name: Cursor.parse(json.dumps(c)) for name, c in data["tables"].items()},
            lag={name: list(v) for name, v in data.get("lag", {}).items()},
        )

    def dump(self) -> str:
        return json.dumps(
            {
                "tables": {n: json.loads(c.dump()) for n, c in sorted(self.tables.items())},
                "lag": dict(sorted(self.lag.items())),
            },
            sort_keys=True,
        )


# A table's lag is observed when its count of unread messages changes, and at least this often.
LAG_OBSERVATION_SECONDS = 300


def build_offset_sensor(
    *,
    specs: Sequence[TableSpec],
    name: str = "cdc_offsets",
    minimum_interval_seconds: int = 30,
    watch_hours: int = 24,
    kafka_timeout_seconds: float = 20.0,
    default_status: dg.DefaultSensorStatus = dg.DefaultSensorStatus.RUNNING,
) -> dg.SensorDefinition:
    """The offset-progress sensor of every mirror in `specs` (see the module docstring).

    One tick reads every topic at once (`read_fleet_progress`) and plans each table's hours
    (`plan_tick`); the tables whose same hours closed are requested together, in one run of
    the mirrors' multi-asset, which works on them in parallel.
    """
    by_name = {spec.name: spec for spec in specs}

    @dg.sensor(
        name=name,
        description=(
            f"Watches the Kafka topics of {len(specs)} mirrored tables and materializes each "
            "table's hours once every partition of its topic has moved past them (or its "
            "allowed lateness passed), tables with the same hours together in one run; "
            "records each table's consumer lag as an observation."
        ),
        target=[dg.AssetKey(spec.name) for spec in specs],
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=default_status,
    )
    def _offsets(context: dg.SensorEvaluationContext, kafka: KafkaResource) -> dg.SensorResult:
        now = datetime.now(UTC)
        cursor = FleetCursor.parse(context.cursor)
        watches = [
            Watch(
                spec.name,
                spec.topic,
                hour_start(known.watch_from)
                if (known := cursor.tables.get(spec.name)) and known.watch_from
                else None,
                spec.start_datetime,
            )
            for spec in specs
        ]

        def read() -> dict[str, TopicProgress | SliceError]:
            consumer, uncommitted = kafka.consumer(), kafka.consumer(committed=False)
            try:
                return read_fleet_progress(consumer, uncommitted, watches, now=now)
            finally:
                consumer.close()
                uncommitted.close()

        tables = ", ".join(f"'{spec.name}'" for spec in specs[:3]) + (
            f" and {len(specs) - 3} more" if len(specs) > 3 else ""
        )
        progress = with_deadline(
            kafka_timeout_seconds,
            f"table {tables}, bootstrap servers {kafka.bootstrap_servers}",
            read,
        )
        together: dict[tuple[str, ...], list[tuple[TableSpec, HourRange]]] = {}
        waiting, events = [], []
        for watch in watches:
            spec, found = by_name[watch.table], progress[watch.table]
            if isinstance(found, SliceError):
                context.log.error(str(found))
                waiting.append(f"{spec.name}: {found}")
                continue
            watch_from = watch.watch_from or found.first_data_hour
            if watch_from is None:
                waiting.append(f"{spec.name}: no message since {spec.start_hour}")
            else:
                key = dg.AssetKey(spec.name)
                plan = plan_tick(
                    spec,
                    found,
                    cursor.tables.get(spec.name, Cursor()),
                    now=now,
                    watch_from=watch_from,
                    watch_hours=watch_hours,
                    already_materialized=lambda hours, key=key: _materialized_with_slice(
                        context, key, hours
                    ),
                )
                cursor.tables[spec.name] = plan.cursor
                for hours in plan.ranges:
                    span = tuple(h.key for h in hours.hours)
                    together.setdefault(span, []).append((spec, hours))
                if not plan.ranges and plan.waiting:
                    waiting.append(f"{spec.name}: {plan.waiting}")
            observation = _lag_if_due(context, spec, found, cursor, now)
            if observation is not None:
                events.append(observation)
        requests = [_run_request(span, tables) for span, tables in sorted(together.items())]
        for span, tables in sorted(together.items()):
            context.log.info(
                f"requesting {span[0]}"
                + (f"..{span[-1]}" if len(span) > 1 else "")
                + f" of {len(tables)} tables: "
                + ", ".join(spec.name for spec, _ in tables)
            )
        skip = None
        if not requests:
            skip = "; ".join(waiting[:5]) or "every closed hour was requested"
        return dg.SensorResult(
            run_requests=requests, cursor=cursor.dump(), asset_events=events, skip_reason=skip
        )

    return _offsets


def _run_request(span: tuple[str, ...], tables: list[tuple[TableSpec, HourRange]]) -> dg.RunRequest:
    """One run for the tables whose same hours closed. The run key names each table's slices,
    so Dagster starts them once; a table whose slice later changes is requested again."""
    keys = [dg.AssetKey(spec.name) for spec, _ in tables]
    if len(tables) == 1:
        run_key = tables[0][1].run_key(tables[0][0].name)
    else:
        digest = hashlib.sha1(
            "|".join(hours.run_key(spec.name) for spec, hours in tables).encode()
        ).hexdigest()
        span_text = span[0] + (f"..{span[-1]}" if len(span) > 1 else "")
        run_key = f"{len(tables)} tables:{span_text}:{digest[:16]}"
    tags = {"cdc/trigger": "offset_sensor", "cdc/tables": str(len(tables))}
    if len(tables) == 1:
        tags["cdc/table"] = tables[0][0].name
    # The checks evaluated in each hour's own run; retention_risk is re-run on its own.
    checks = [
        dg.AssetCheckKey(key, name)
        for (spec, _), key in zip(tables, keys, strict=True)
        for name in run_check_names(spec)
    ]
    if len(span) == 1:
        return dg.RunRequest(
            run_key=run_key,
            asset_selection=keys,
            asset_check_keys=checks,
            partition_key=span[0],
            tags=tags,
        )
    # A range of hours in one run, as a backfill launches it.
    return dg.RunRequest(
        run_key=run_key,
        asset_selection=keys,
        asset_check_keys=checks,
        tags={**tags, RANGE_START_TAG: span[0], RANGE_END_TAG: span[-1]},
    )


def _lag_if_due(
    context: dg.SensorEvaluationContext,
    spec: TableSpec,
    progress: TopicProgress,
    cursor: FleetCursor,
    now: datetime,
) -> dg.AssetObservation | None:
    """The table's lag observation, when its unread count changed or the last one is old."""
    unread = sum(progress.stable_ends.values()) - sum(progress.log_starts.values())
    last = cursor.lag.get(spec.name)
    if (
        last is not None
        and last[0] == unread
        and now.timestamp() - last[1] < LAG_OBSERVATION_SECONDS
    ):
        return None
    cursor.lag[spec.name] = [unread, round(now.timestamp())]
    return _lag_observation(context, dg.AssetKey(spec.name), progress)


def _materialized_with_slice(
    context: dg.SensorEvaluationContext, asset_key: dg.AssetKey, hours: list[HourState]
) -> set[str]:
    """Hours whose latest materialization read exactly their current slice."""
    if not hours:
        return set()
    wanted = {h.key: h for h in hours}
    records = context.instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=asset_key, asset_partitions=list(wanted)),
        limit=len(wanted) * 4,
    ).records
    latest: dict[str, dict] = {}
    for record in records:  # newest first
        materialization = record.asset_materialization
        if materialization.partition in latest:
            continue
        offsets = materialization.metadata.get("kafka_offsets")
        latest[materialization.partition] = offsets.value if offsets else {}
    return {key for key, offsets in latest.items() if offsets == wanted[key].offsets}


def _lag_observation(
    context: dg.SensorEvaluationContext, asset_key: dg.AssetKey, progress: TopicProgress
) -> dg.AssetObservation:
    # The newest hour among the recent materializations (a rerun of an old hour is not it).
    records = context.instance.fetch_materializations(asset_key, limit=50).records
    materializations = [
        r.asset_materialization
        for r in records
        if r.asset_materialization.partition and "kafka_offsets" in r.asset_materialization.metadata
    ]
    mirrored = None
    if materializations:
        newest = max(materializations, key=lambda m: m.partition)
        mirrored = (
            hour_start(newest.partition) + HOUR,
            {int(p): o["end"] for p, o in newest.metadata["kafka_offsets"].value.items()},
        )
    return dg.AssetObservation(asset_key=asset_key, metadata=consumer_lag(progress, mirrored))
