"""Which hours of a table are due, decided from one tick's look at its topic.

Pure (no Kafka, no Dagster): the sensor reads the topic (sensors/topic_reads.py), then, hour
by hour from the oldest hour it still watches up to now, this decides:

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
- **refreshed** (tier-0 tables, `refresh_minutes`): the open hours, from the first open one to
  the current hour, once per slot of that many minutes (`refresh_hours`, `refresh_slot`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from cdc_assets.config import TableSpec
from cdc_assets.hours import hour_start
from cdc_assets.slicing import open_reason
from sensors.cursor import Cursor
from sensors.hours import HOUR, hour_key
from sensors.topic_reads import TopicProgress


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
    waiting: str | None  # why the oldest open hour is open (the current one in steady state)
    # The open hours to refresh in this tick's `refresh_minutes` slot (tier-0 tables only).
    refresh: list[str] = field(default_factory=list)


# At most this many open hours are refreshed per tick, the newest ones: the current hour, the
# one lateness still holds open, and one more for a clock that crossed an hour meanwhile.
_MOST_OPEN_HOURS = 3


def refresh_hours(
    spec: TableSpec, closed: list[HourState], *, now: datetime, watch_from: datetime
) -> list[str]:
    """A tier-0 table's open hours (`refresh_minutes` set): from the first open one to the
    current hour, the newest `_MOST_OPEN_HOURS` of them (a long lateness can hold older hours
    open, and the freshest changes are in the current one). Each is refreshed once per slot
    (`refresh_slot`); other tables get none."""
    if not spec.refresh_minutes:
        return []
    moment = hour_start(closed[-1].key) + HOUR if closed else watch_from
    keys = []
    while moment <= now:
        keys.append(hour_key(moment))
        moment += HOUR
    return keys[-_MOST_OPEN_HOURS:]


def refresh_slot(spec: TableSpec, now: datetime) -> str:
    """The `refresh_minutes` slot `now` falls in (minutes since the epoch, floored), as text:
    a refresh's run key carries it, so Dagster starts one refresh per hour and slot."""
    minutes = int(now.timestamp() // 60)
    start = minutes - minutes % (spec.refresh_minutes or 60)
    return datetime.fromtimestamp(start * 60, now.tzinfo).strftime("%Y-%m-%dT%H:%M")


def plan_tick(
    spec: TableSpec,
    progress: TopicProgress,
    cursor: Cursor,
    *,
    now: datetime,
    watch_from: datetime,
    watch_hours: int,
    already_materialized: Callable[[list[HourState]], set[str]],
    refresh_in_flight: bool = False,
) -> TickPlan:
    """Which hours to request, and the cursor after this tick. Pure, given the Kafka reads.
    `refresh_in_flight`: a refresh of the table is queued or running; no other is requested
    until it ends (it reads up to where Kafka is when it starts, so a second one queued behind
    it adds nothing, and refreshes queued back to back would keep the hour's final run, which
    ranks below them in the queue, waiting)."""
    lateness = timedelta(minutes=spec.allowed_lateness_minutes)
    hours, waiting = _closed_hours(progress, now=now, watch_from=watch_from, lateness=lateness)

    fresh = [h for h in hours if cursor.requested.get(h.key) != h.fingerprint]
    done = already_materialized([h for h in fresh if h.key not in cursor.requested])
    needed = {h.key for h in fresh if h.key not in done}
    requested = {**cursor.requested, **{h.key: h.fingerprint for h in hours}}
    ranges = _runs(hours, needed, hours_per_run=spec.hours_per_run)

    settled_until = _settled_until(hours, now=now, watch_from=watch_from, watch_hours=watch_hours)
    kept = {k: v for k, v in requested.items() if hour_start(k) >= settled_until}
    # A slot's refresh once: the run key would let Dagster drop a repeat anyway, but each tick
    # would log it again and show "0 runs requested" without saying why. The mark names the
    # newest open hour too: a slot that runs across an hour's start (`refresh_minutes` not
    # dividing 60) still refreshes the hour that opened in it.
    due = refresh_hours(spec, hours, now=now, watch_from=watch_from)
    mark = f"{refresh_slot(spec, now)} {due[-1]}" if due else None
    refresh = due if mark != cursor.refreshed and not refresh_in_flight else []
    return TickPlan(
        ranges=ranges,
        cursor=Cursor(
            watch_from=hour_key(settled_until),
            requested=kept,
            refreshed=mark if refresh else cursor.refreshed,
        ),
        hours=hours,
        waiting=waiting,
        refresh=refresh,
    )


def _closed_hours(
    progress: TopicProgress, *, now: datetime, watch_from: datetime, lateness: timedelta
) -> tuple[list[HourState], str | None]:
    """The closed hours from `watch_from` on, oldest first, up to the first open one; and why
    that one is open (in steady state the current hour, open until its end)."""
    hours: list[HourState] = []
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
            # Later hours can't have closed before it.
            return hours, f"hour {hour_key(moment)} is open: {reason}"
        hours.append(HourState(hour_key(moment), start, end, not idle, None))
        moment += HOUR
    reason = open_reason(
        hour_end=moment + HOUR, now=now, allowed_lateness=lateness, waiting=[], in_transaction=[]
    )
    return hours, f"hour {hour_key(moment)} is open: {reason or 'its end was not read yet'}"


def _runs(hours: list[HourState], needed: set[str], *, hours_per_run: int) -> list[HourRange]:
    """The `needed` hours as runs: consecutive hours together, at most `hours_per_run` a run."""
    ranges, current = [], []
    for hour in hours:
        if hour.key in needed and len(current) < hours_per_run:
            current.append(hour)
            continue
        if current:
            ranges.append(HourRange(tuple(current)))
        current = [hour] if hour.key in needed else []
    if current:
        ranges.append(HourRange(tuple(current)))
    return ranges


def _settled_until(
    hours: list[HourState], *, now: datetime, watch_from: datetime, watch_hours: int
) -> datetime:
    """The end of the settled hours at the start of `hours`, which leave the cursor: all
    partitions moved past them (and past the hour before, so their start is fixed too), or they
    closed longer ago than the watch window."""
    settled_until = watch_from
    for hour in hours:
        old = now - hour_start(hour.key) - HOUR > timedelta(hours=watch_hours)
        if not (hour.moved_past or old):
            break
        settled_until = hour_start(hour.key) + HOUR
    return settled_until


def _offsets_at(progress: TopicProgress, found: Mapping[int, int | None]) -> dict[int, int]:
    """b(t) per partition: the first offset stamped at or after t, else the stable end."""
    return {
        p: max(progress.log_starts[p], progress.stable_ends[p] if o is None else o)
        for p, o in found.items()
    }
