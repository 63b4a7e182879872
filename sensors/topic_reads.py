"""What one tick of the offset sensor reads from Kafka, for every watched topic at once.

Each Kafka request covers every topic (one per hour boundary for the offsets by time), so a
tick's cost follows the hours watched, not the number of tables. The tick has
`timeout_seconds` for all of it: every call is given what is left as kafka-python's own
`timeout_ms` (the bootstrap, each request), so a Kafka that does not answer fails the call
itself and leaves nothing running after the tick.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from kafka import KafkaConsumer, TopicPartition
from kafka.errors import KafkaError, KafkaTimeoutError

from cdc_assets.slicing import SliceError, open_transactions, topic_partitions
from resources.kafka import KafkaResource
from sensors.hours import HOUR, floor_hour, from_ms, to_ms

# Catching up after a long outage happens over several ticks, a week of hours at a time.
MAX_HOURS_PER_TICK = 24 * 7


class KafkaUnavailableError(RuntimeError):
    """Kafka did not answer the sensor in time; the tick fails and the cursor stays."""


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
class Watch:
    """What a tick reads of one table's topic: from `watch_from` (None on the table's first
    tick: from the hour of its oldest message since `floor`, the table's first hour) to now."""

    table: str
    topic: str
    watch_from: datetime | None
    floor: datetime


class KafkaDeadline:
    """The time a tick has left for Kafka, handed to each kafka-python call as its timeout."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self._end = time.monotonic() + seconds

    @property
    def expired(self) -> bool:
        return time.monotonic() >= self._end

    def ms(self) -> int:
        """Milliseconds left; `KafkaTimeoutError` once none are (as a timed-out call raises)."""
        left = self._end - time.monotonic()
        if left <= 0:
            raise KafkaTimeoutError(f"the tick's {self.seconds:g} s for Kafka are used up")
        return max(1, int(left * 1000))


def read_fleet_progress_within(
    kafka: KafkaResource,
    watches: Sequence[Watch],
    *,
    now: datetime,
    timeout_seconds: float,
    what: str,
) -> dict[str, TopicProgress | SliceError]:
    """`read_fleet_progress` on consumers of its own, within `timeout_seconds` in all.

    Raises `KafkaUnavailableError` naming `what` (the tables and bootstrap servers) when Kafka
    does not answer in time or fails.
    """
    deadline = KafkaDeadline(timeout_seconds)
    try:
        consumer = kafka.consumer(timeout_ms=deadline.ms())
        try:
            uncommitted = kafka.consumer(committed=False, timeout_ms=deadline.ms())
            try:
                return read_fleet_progress(
                    consumer, uncommitted, watches, now=now, deadline=deadline
                )
            finally:
                uncommitted.close()
        finally:
            consumer.close()
    except KafkaError as exc:
        fix = (
            "The tick is skipped and its cursor kept; check that the brokers are up and "
            "reachable, and the kafka resource's bootstrap_servers and security settings."
        )
        if isinstance(exc, KafkaTimeoutError) and deadline.expired:
            raise KafkaUnavailableError(
                f"{what}: Kafka did not answer within {timeout_seconds:g} s. {fix}"
            ) from None
        raise KafkaUnavailableError(
            f"{what}: Kafka failed ({type(exc).__name__}: {exc}). {fix}"
        ) from None


def read_fleet_progress(
    consumer: KafkaConsumer,
    uncommitted: KafkaConsumer,
    watches: Sequence[Watch],
    *,
    now: datetime,
    deadline: KafkaDeadline | None = None,
) -> dict[str, TopicProgress | SliceError]:
    """Reads what a tick needs of every watched topic at once: offsets per hour boundary from
    each table's `watch_from` to now, log starts, stable ends, open transactions, and the newest
    timestamps. A table whose topic is missing gets its error instead; the others are read.

    `deadline`: each call's timeout is the time it has left (else the consumers' request
    timeout).
    """
    timeout: Callable[[], int | None] = deadline.ms if deadline else lambda: None
    # One metadata request for every topic; the lookups below use it. It takes no timeout of
    # its own: the consumers' request timeout, capped to the tick's time, bounds it.
    consumer.topics()
    tps_of, out = _partitions_of(consumer, watches)
    every = sorted({tp for tps in tps_of.values() for tp in tps})
    if not every:
        return out
    log_starts = consumer.beginning_offsets(every, timeout_ms=timeout())
    first_hour = _first_data_hours(consumer, watches, tps_of, timeout)
    read = [w for w in watches if w.table in tps_of]
    starts = {w.table: w.watch_from or first_hour.get(w.table) or floor_hour(now) for w in read}
    offsets = _offsets_at_boundaries(consumer, read, tps_of, starts, now, timeout)
    # Fetched last: every offset found above lies below these.
    stable_ends = consumer.end_offsets(every, timeout_ms=timeout())
    pending = open_transactions(uncommitted, stable_ends, timeout_ms=timeout())
    newest = _newest_timestamps(consumer, every, log_starts, stable_ends, timeout)
    for watch in read:
        tps = tps_of[watch.table]
        out[watch.table] = TopicProgress(
            partitions=tuple(tp.partition for tp in tps),
            log_starts={tp.partition: log_starts[tp] for tp in tps},
            stable_ends={tp.partition: stable_ends[tp] for tp in tps},
            in_transaction=frozenset(tp.partition for tp in tps if tp in pending),
            boundaries={
                moment: {tp.partition: offsets[moment][tp] for tp in tps}
                for moment in _boundaries(starts[watch.table], now)
            },
            newest_ms={tp.partition: newest[tp] for tp in tps if tp in newest},
            first_data_hour=first_hour.get(watch.table),
        )
    return out


def _partitions_of(
    consumer: KafkaConsumer, watches: Sequence[Watch]
) -> tuple[dict[str, list[TopicPartition]], dict[str, TopicProgress | SliceError]]:
    """Each table's topic partitions, from the metadata read; the error of a table whose topic
    is missing, in the tick's results."""
    tps_of: dict[str, list[TopicPartition]] = {}
    out: dict[str, TopicProgress | SliceError] = {}
    for watch in watches:
        try:
            tps_of[watch.table] = topic_partitions(consumer, table=watch.table, topic=watch.topic)
        except SliceError as error:
            out[watch.table] = error
    return tps_of, out


def _first_data_hours(
    consumer: KafkaConsumer,
    watches: Sequence[Watch],
    tps_of: Mapping[str, list[TopicPartition]],
    timeout: Callable[[], int | None],
) -> dict[str, datetime | None]:
    """On a table's first tick, the hour its data begins: of its oldest message since its first
    hour (None: no message yet). One lookup per first hour, for the tables that share it."""
    first_hour: dict[str, datetime | None] = {}
    firsts = [w for w in watches if w.table in tps_of and w.watch_from is None]
    for floor in sorted({w.floor for w in firsts}):
        tps = sorted({tp for w in firsts if w.floor == floor for tp in tps_of[w.table]})
        at = consumer.offsets_for_times({tp: to_ms(floor) for tp in tps}, timeout_ms=timeout())
        for w in (w for w in firsts if w.floor == floor):
            stamps = [at[tp].timestamp for tp in tps_of[w.table] if at[tp] is not None]
            first_hour[w.table] = max(floor_hour(from_ms(min(stamps))), floor) if stamps else None
    return first_hour


def _boundaries(start: datetime, now: datetime) -> list[datetime]:
    """The hour boundaries a tick reads: from `start` to now's hour, MAX_HOURS_PER_TICK at most."""
    hours = min(int((floor_hour(now) - start) / HOUR), MAX_HOURS_PER_TICK)
    return [start + HOUR * n for n in range(hours + 1)]


def _offsets_at_boundaries(
    consumer: KafkaConsumer,
    watches: Sequence[Watch],
    tps_of: Mapping[str, list[TopicPartition]],
    starts: Mapping[str, datetime],
    now: datetime,
    timeout: Callable[[], int | None],
) -> dict[datetime, dict[TopicPartition, int | None]]:
    """Per hour boundary, each partition's first offset stamped at or after it (None: no such
    message yet): one lookup per boundary, for every table that needs it."""
    wanted: dict[datetime, set[TopicPartition]] = {}
    for watch in watches:
        for moment in _boundaries(starts[watch.table], now):
            wanted.setdefault(moment, set()).update(tps_of[watch.table])
    offsets: dict[datetime, dict[TopicPartition, int | None]] = {}
    for moment, tps in sorted(wanted.items()):
        at = consumer.offsets_for_times(
            {tp: to_ms(moment) for tp in sorted(tps)}, timeout_ms=timeout()
        )
        offsets[moment] = {tp: (None if at[tp] is None else at[tp].offset) for tp in tps}
    return offsets


def _newest_timestamps(
    consumer: KafkaConsumer,
    tps: list[TopicPartition],
    log_starts: Mapping[TopicPartition, int],
    stable_ends: Mapping[TopicPartition, int],
    timeout: Callable[[], int | None],
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
        left = timeout()
        for tp, records in consumer.poll(timeout_ms=min(200, left or 200)).items():
            newest[tp] = max([newest.get(tp, 0)] + [r.timestamp for r in records])
            if consumer.position(tp, timeout_ms=timeout()) >= stable_ends[tp]:
                remaining.discard(tp)
                consumer.pause(tp)
        if not remaining:
            break
    consumer.unsubscribe()
    return newest
