"""Which Kafka offsets belong to an hour, and whether the hour may be read yet.

The slice of hour [t0, t1) in partition p is [b_p(t0), b_p(t1)), where b_p(t) is the first
offset stamped at or after t (`offsets_for_times`), or the partition's last stable offset when
there is none. b_p is monotonic in t even when producer timestamps are not ({o : ts(o) >= t1} is
a subset of {o : ts(o) >= t0}), so consecutive hours share their boundaries and every offset
belongs to exactly one hour (I1): slices follow the log, never reorder it. Where the previous
hour's end is on record (the mirror's Delta log holds every run's slice), the hour starts there
instead, so a late record that lands after an idle hour closed falls into the next hour.

An hour is closed (I5) when each partition holds a committed message stamped at or after t1, or
has been idle past the table's allowed lateness. An open transaction (last stable offset below
the high watermark) may still commit records of the hour and keeps it open until Kafka ends it.
An open hour is sliced only when forced, up to the current ends. `open_reason` is the one place
this rule lives; the offset sensor (sensors/) applies it before it requests an hour.

Retention (I6): offsets below Kafka's log start are gone. When the hour's known start (an earlier
run of it, or the previous hour's end) lies below the log start, the offsets between are lost;
with no such record, a slice that begins exactly at a non-zero log start is reported too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timedelta

from kafka import KafkaConsumer, TopicPartition
from kafka.structs import OffsetAndTimestamp


class SliceError(RuntimeError):
    """The hour can't be sliced as asked; the message names the table, hour and what to do."""


class OpenHourError(SliceError):
    pass


class DataLossError(SliceError):
    pass


@dataclass(frozen=True)
class PartitionSlice:
    partition: int
    start: int  # inclusive
    end: int  # exclusive
    log_start: int
    moved_past: bool  # holds a committed message stamped at or after the hour's end

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class LostRange:
    partition: int
    first: int | None  # None: unknown, no earlier run recorded where the hour began
    end: int  # exclusive: the log start offset

    def describe(self) -> str:
        first = "?" if self.first is None else str(self.first)
        return f"partition {self.partition}: offsets [{first}, {self.end})"


@dataclass(frozen=True)
class HourSlice:
    topic: str
    hour_start: datetime
    hour_end: datetime
    partitions: tuple[PartitionSlice, ...]
    closed: bool
    open_reason: str | None
    lost: tuple[LostRange, ...] = ()

    @property
    def size(self) -> int:
        return sum(p.size for p in self.partitions)

    def start_offsets(self) -> dict[int, int]:
        return {p.partition: p.start for p in self.partitions}

    def end_offsets(self) -> dict[int, int]:
        return {p.partition: p.end for p in self.partitions}

    def as_dict(self) -> dict:
        return {
            "topic": self.topic,
            "hour_start": self.hour_start.isoformat(),
            "hour_end": self.hour_end.isoformat(),
            "partitions": {
                str(p.partition): {"start": p.start, "end": p.end} for p in self.partitions
            },
            "closed": self.closed,
        }


def _to_ms(moment: datetime) -> int:
    return int(moment.timestamp() * 1000)


def open_reason(
    *,
    hour_end: datetime,
    now: datetime,
    allowed_lateness: timedelta,
    waiting: list[int],
    in_transaction: list[int],
) -> str | None:
    """Why the hour that ends at `hour_end` is still open, or None when it has closed.

    `waiting`: partitions holding no committed message stamped at or after `hour_end`;
    `in_transaction`: those of them with an open transaction.
    """
    if now < hour_end:
        return f"the hour ends at {hour_end.isoformat()}, after now ({now.isoformat()})"
    if in_transaction:
        return (
            f"partitions {in_transaction} have an open transaction that may still commit "
            "records of the hour"
        )
    if waiting and now < hour_end + allowed_lateness:
        return (
            f"partitions {waiting} hold no committed message stamped at or after "
            f"{hour_end.isoformat()} yet, and the allowed lateness of {allowed_lateness} "
            f"runs until {(hour_end + allowed_lateness).isoformat()}"
        )
    return None


def open_transactions(
    consumer: KafkaConsumer,
    stable_ends: Mapping[TopicPartition, int],
    *,
    timeout_ms: int | None = None,
    committed: KafkaConsumer | None = None,
) -> set[TopicPartition]:
    """Partitions whose last stable offset (read_committed end) lies below the high watermark.

    `consumer` must read uncommitted, so that its end offsets are the high watermarks.
    `timeout_ms`: how long the lookup may take (default: the consumer's request timeout).
    `committed` (a read_committed consumer): the stable ends are read again after the high
    watermarks, so a record written between the two look-ups is not taken for a transaction
    (without an open transaction the stable end reaches the high watermark at once).
    """
    high_watermarks = consumer.end_offsets(list(stable_ends), timeout_ms=timeout_ms)
    if committed is not None:
        stable_ends = committed.end_offsets(list(stable_ends))
    return {tp for tp, stable in stable_ends.items() if high_watermarks[tp] > stable}


def topic_partitions(consumer: KafkaConsumer, *, table: str, topic: str) -> list[TopicPartition]:
    """The topic's partitions, failing with the fix when the topic is missing."""
    partition_ids = consumer.partitions_for_topic(topic)
    if not partition_ids:
        raise SliceError(
            f"table '{table}': topic '{topic}' does not exist or has no partitions on the "
            "configured Kafka cluster; check the table's 'topic' setting and the cluster."
        )
    return [TopicPartition(topic, p) for p in sorted(partition_ids)]


def compute_slice(
    consumer: KafkaConsumer,
    *,
    table: str,
    topic: str,
    hour_start: datetime,
    now: datetime,
    allowed_lateness: timedelta,
    known_starts: Mapping[int, int] | None = None,
    starts_cover_topic: bool = False,
    uncommitted: KafkaConsumer | None = None,
) -> HourSlice:
    """Looks up the hour's offsets per partition and decides whether it has closed.

    `known_starts` holds, per partition, where this hour begins by earlier runs (the end of
    the previous hour, or this hour's last start); the slice starts there, and data loss is
    reported exactly from it. `starts_cover_topic`: `known_starts` named every partition the
    topic had when they were recorded (the previous hour's end), so a partition they lack was
    added since and starts at offset 0: its records stamped before this hour, written after the
    previous hour ran, are this hour's (the log's order), not offsets of no hour.
    `uncommitted` (a read_uncommitted consumer) finds open transactions, which keep the hour
    open; it is asked only when a partition has no record at or after the hour's end yet.
    """
    hour_end = hour_start + timedelta(hours=1)
    tps = topic_partitions(consumer, table=table, topic=topic)
    known_starts = known_starts or {}
    offsets = _look_up_offsets(consumer, tps, hour_start, hour_end)
    slices = [_partition_slice(tp, offsets, known_starts, starts_cover_topic) for tp in tps]
    waiting = [tp for tp in tps if offsets.at_end[tp] is None]
    # Only a partition still waiting for the hour's end can be held open by a transaction.
    pending = (
        open_transactions(
            uncommitted, {tp: offsets.stable_ends[tp] for tp in waiting}, committed=consumer
        )
        if waiting and uncommitted is not None
        else set()
    )
    reason = open_reason(
        hour_end=hour_end,
        now=now,
        allowed_lateness=allowed_lateness,
        waiting=[tp.partition for tp in waiting],
        in_transaction=[tp.partition for tp in waiting if tp in pending],
    )
    return HourSlice(
        topic=topic,
        hour_start=hour_start,
        hour_end=hour_end,
        partitions=tuple(slices),
        closed=reason is None,
        open_reason=reason,
        lost=tuple(_lost_ranges(slices, known_starts)),
    )


@dataclass(frozen=True)
class _Offsets:
    """What Kafka holds at the hour's edges, per partition (`_look_up_offsets`)."""

    log_starts: Mapping[TopicPartition, int]
    at_start: Mapping[TopicPartition, OffsetAndTimestamp | None]  # first stamped >= hour start
    at_end: Mapping[TopicPartition, OffsetAndTimestamp | None]  # first stamped >= hour end
    stable_ends: Mapping[TopicPartition, int]  # last stable offsets (read_committed ends)


def _look_up_offsets(
    consumer: KafkaConsumer,
    tps: list[TopicPartition],
    hour_start: datetime,
    hour_end: datetime,
) -> _Offsets:
    """The log starts, the offsets at the hour's edges and the stable ends."""
    log_starts = consumer.beginning_offsets(tps)
    at_start = consumer.offsets_for_times({tp: _to_ms(hour_start) for tp in tps})
    at_end = consumer.offsets_for_times({tp: _to_ms(hour_end) for tp in tps})
    # Last stable offsets (read_committed), fetched last: every offset found above lies below.
    stable_ends = consumer.end_offsets(tps)
    return _Offsets(log_starts, at_start, at_end, stable_ends)


def _partition_slice(
    tp: TopicPartition,
    offsets: _Offsets,
    known_starts: Mapping[int, int],
    starts_cover_topic: bool,
) -> PartitionSlice:
    """One partition's slice: from the recorded start (else the hour's first offset) to the
    hour's end (else the stable end), never below the log start."""
    stable_end = offsets.stable_ends[tp]
    at_start, at_end = offsets.at_start[tp], offsets.at_end[tp]
    end = at_end.offset if at_end is not None else stable_end
    start = known_starts.get(tp.partition)
    if start is None and starts_cover_topic:
        start = 0  # added since the previous hour ran; below the log start it is loss
    if start is None:
        start = at_start.offset if at_start is not None else stable_end
    # Never read below what retention left; the loss is reported by `_lost_ranges`.
    start = min(max(start, offsets.log_starts[tp]), end)
    return PartitionSlice(
        partition=tp.partition,
        start=start,
        end=end,
        log_start=offsets.log_starts[tp],
        moved_past=at_end is not None,
    )


def remainder(hour_slice: HourSlice, read_to: Mapping[int, int]) -> HourSlice:
    """What a run of an hour reads after a refresh of it (a partial run) read each partition up
    to `read_to`: the slice from there on. The hour's slice starts where it did; a partition the
    refresh did not know is read whole. Offsets retention deleted below the refresh's end are
    lost only if this run would have read them."""
    parts, lost = [], []
    hour_lost = {r.partition: r for r in hour_slice.lost}
    for part in hour_slice.partitions:
        done = read_to.get(part.partition)
        if done is None:
            parts.append(part)
            if part.partition in hour_lost:
                lost.append(hour_lost[part.partition])
            continue
        parts.append(replace(part, start=min(max(part.start, done), part.end)))
        if done < part.log_start:
            lost.append(LostRange(part.partition, done, part.log_start))
    return replace(hour_slice, partitions=tuple(parts), lost=tuple(lost))


def _lost_ranges(slices: list[PartitionSlice], known_starts: Mapping[int, int]) -> list[LostRange]:
    lost = []
    for part in slices:
        known = known_starts.get(part.partition)
        if known is not None:
            if known < part.log_start:
                lost.append(LostRange(part.partition, known, part.log_start))
        elif part.log_start > 0 and part.start == part.log_start and part.size > 0:
            lost.append(LostRange(part.partition, None, part.log_start))
    return lost
