"""Which Kafka offsets belong to an hour, and whether the hour may be read yet.

The slice of hour [t0, t1) in partition p is [b_p(t0), b_p(t1)), where b_p(t) is the first
offset whose timestamp is at or after t (Kafka's `offsets_for_times`), or the partition's end
(the last stable offset, since we read committed data only) when no such message exists.

b_p is monotonic in t even when producer timestamps are not, because {o : ts(o) >= t1} is a
subset of {o : ts(o) >= t0} for t1 > t0. So consecutive hours share their boundary offsets and
every offset belongs to exactly one hour (I1). A message whose producer timestamp lies in H
but which was written after a message stamped H+1 belongs to the slice of H+1: slices follow the
log, never reorder it.

The boundary can still move after an hour ran: when a partition was idle and the hour closed by
lateness, its end was the partition's end at the time, and a late record stamped inside the
hour may land there afterwards. So where the previous hour's end is on record (the Delta log
of the mirror holds every run's slice), the hour starts there instead of at b_p(t0): nothing
falls between two hours.

An hour is closed (I5) when each partition has moved past it, i.e. holds a message stamped at
or after t1 within its committed range, or has been idle past the table's allowed lateness.
A partition with an open transaction (its last stable offset below its high watermark) is not
idle: the transaction may still commit records of the hour, so it keeps the hour open until it
ends (Kafka aborts a transaction after its timeout, 15 minutes at most by default).
An open hour is only sliced when a person forces it; its end offsets are then the current
ends and the result says so. `cdc_assets/slicing.py` is the one place this rule lives: the
offset sensor (sensors/) applies the same `open_reason` before it requests an hour.

Retention (I6): Kafka's log start offset tells which offsets are gone. When what we know of
the hour's true start (a previous run of this hour, or the end of the hour before) lies below
the log start, the offsets in between are lost. With no such record, a slice that begins
exactly at a non-zero log start cannot prove nothing older belonged to it, and is reported too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta

from kafka import KafkaConsumer, TopicPartition


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
) -> set[TopicPartition]:
    """Partitions whose last stable offset (read_committed end) lies below the high watermark.

    `consumer` must read uncommitted, so that its end offsets are the high watermarks.
    `timeout_ms`: how long the lookup may take (default: the consumer's request timeout).
    """
    high_watermarks = consumer.end_offsets(list(stable_ends), timeout_ms=timeout_ms)
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
    open.
    """
    hour_end = hour_start + timedelta(hours=1)
    tps = topic_partitions(consumer, table=table, topic=topic)
    known_starts = known_starts or {}
    log_starts = consumer.beginning_offsets(tps)
    at_start = consumer.offsets_for_times({tp: _to_ms(hour_start) for tp in tps})
    at_end = consumer.offsets_for_times({tp: _to_ms(hour_end) for tp in tps})
    # Last stable offsets (read_committed), fetched last: every offset found above lies below.
    stable_ends = consumer.end_offsets(tps)
    pending = open_transactions(uncommitted, stable_ends) if uncommitted is not None else set()

    slices, waiting, in_transaction = [], [], []
    for tp in tps:
        stable_end = stable_ends[tp]
        end = at_end[tp].offset if at_end[tp] is not None else stable_end
        moved_past = at_end[tp] is not None
        start = known_starts.get(tp.partition)
        if start is None and starts_cover_topic:
            start = 0  # added since the previous hour ran; below the log start it is loss
        if start is None:
            start = at_start[tp].offset if at_start[tp] is not None else stable_end
        # Never read below what retention left; the loss is reported below.
        start = min(max(start, log_starts[tp]), end)
        if not moved_past:
            waiting.append(tp.partition)
            if tp in pending:
                in_transaction.append(tp.partition)
        slices.append(
            PartitionSlice(
                partition=tp.partition,
                start=start,
                end=end,
                log_start=log_starts[tp],
                moved_past=moved_past,
            )
        )
    reason = open_reason(
        hour_end=hour_end,
        now=now,
        allowed_lateness=allowed_lateness,
        waiting=waiting,
        in_transaction=in_transaction,
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
