"""Which hours a tick requests, and the cursor it leaves: `plan_tick` on topic states written
out by hand (no broker). The same rules end to end: tests/sensors/test_offset_progress.py."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from cdc_assets.config import TableSpec
from sensors.cursor import Cursor
from sensors.hours import HOUR, hour_key
from sensors.planning import HourRange, HourState, plan_tick, refresh_slot
from sensors.topic_reads import TopicProgress

H0 = datetime(2026, 11, 4, 8, tzinfo=UTC)
KEYS = [hour_key(H0 + HOUR * n) for n in range(8)]


def _spec(*, lateness: int = 60, hours_per_run: int = 3) -> TableSpec:
    return TableSpec(
        name="t",
        topic="t",
        primary_key=("id",),
        columns={"id": "bigint"},
        start_hour=KEYS[0],
        allowed_lateness_minutes=lateness,
        hours_per_run=hours_per_run,
    )


def _progress(
    boundaries: list[dict[int, int | None]],
    *,
    ends: dict[int, int],
    log_starts: dict[int, int] | None = None,
    in_transaction: frozenset[int] = frozenset(),
) -> TopicProgress:
    """`boundaries[n]`: per partition, the first offset stamped at or after H0 + n hours."""
    return TopicProgress(
        partitions=tuple(sorted(ends)),
        log_starts=log_starts or dict.fromkeys(ends, 0),
        stable_ends=ends,
        in_transaction=in_transaction,
        boundaries={H0 + HOUR * n: found for n, found in enumerate(boundaries)},
        newest_ms={},
        first_data_hour=H0,
    )


def _plan(progress, cursor=None, *, now, spec=None, done=frozenset(), watch_hours=24, asked=None):
    def already_materialized(hours: list[HourState]) -> set[str]:
        if asked is not None:
            asked.append([h.key for h in hours])
        return {h.key for h in hours} & set(done)

    return plan_tick(
        spec or _spec(),
        progress,
        cursor or Cursor(),
        now=now,
        watch_from=H0 + HOUR * KEYS.index((cursor or Cursor()).watch_from or KEYS[0]),
        watch_hours=watch_hours,
        already_materialized=already_materialized,
    )


def _spans(plan) -> list[tuple[str, str]]:
    return [(r.first, r.last) for r in plan.ranges]


def test_closed_hours_run_in_ranges_of_at_most_hours_per_run_and_settle():
    busy = [{0: n, 1: 10 + n} for n in range(5)]  # both partitions move past every hour
    plan = _plan(_progress(busy, ends={0: 9, 1: 19}), now=H0 + HOUR * 4 + timedelta(minutes=5))
    assert _spans(plan) == [(KEYS[0], KEYS[2]), (KEYS[3], KEYS[3])]
    hour = plan.ranges[0].hours[1]
    assert (hour.start, hour.end) == ({0: 1, 1: 11}, {0: 2, 1: 12})
    assert hour.fingerprint == "0:1-2,1:11-12"
    assert hour.offsets == {
        "0": {"start": 1, "end": 2, "records": 1},
        "1": {"start": 11, "end": 12, "records": 1},
    }
    # Every partition moved past them: they can't change and leave the cursor.
    assert plan.cursor == Cursor(watch_from=KEYS[4], requested={})
    # The current hour is open by the clock, and the plan says so (the sensor's skipped tick).
    assert plan.waiting.startswith(f"hour {KEYS[4]} is open: the hour ends at ")


def test_an_idle_partition_holds_its_hour_until_lateness_then_the_hour_is_watched():
    # Partition 1 holds nothing stamped at or after H0 + 2 h: hour 1 waits for it.
    idle = [{0: 0, 1: 0}, {0: 1, 1: 1}, {0: 2, 1: None}, {0: 3, 1: None}]
    progress = _progress(idle, ends={0: 5, 1: 2})
    held = _plan(progress, now=H0 + HOUR * 2 + timedelta(minutes=30))
    assert _spans(held) == [(KEYS[0], KEYS[0])]
    assert held.waiting.startswith(f"hour {KEYS[1]} is open: partitions [1] hold no committed")
    # Lateness passed: hour 1 closes with partition 1's stable end as its end, and stays
    # watched (late data may still move that end).
    late = _plan(progress, held.cursor, now=H0 + HOUR * 3 + timedelta(minutes=10))
    assert _spans(late) == [(KEYS[1], KEYS[1])]
    assert late.ranges[0].hours[0].end == {0: 2, 1: 2}
    assert late.cursor.watch_from == KEYS[1]
    assert late.cursor.requested == {KEYS[1]: "0:1-2,1:1-2"}


def test_an_hour_is_requested_once_per_slice_and_again_when_late_data_moves_its_end():
    idle = [{0: 0, 1: 0}, {0: 1, 1: None}, {0: 2, 1: None}]
    now = H0 + HOUR * 2 + timedelta(minutes=5)
    spec = _spec(lateness=0, hours_per_run=1)
    first = _plan(_progress(idle, ends={0: 3, 1: 1}), now=now, spec=spec)
    assert _spans(first) == [(KEYS[0], KEYS[0]), (KEYS[1], KEYS[1])]
    again = _plan(_progress(idle, ends={0: 3, 1: 1}), first.cursor, now=now, spec=spec)
    assert again.ranges == [] and again.cursor == first.cursor
    # A late record of hour 0 lands on the idle partition 1: hour 0's end moves, and with it
    # hour 1's start; both run again, under new run keys.
    moved = _plan(_progress(idle, ends={0: 3, 1: 2}), first.cursor, now=now, spec=spec)
    assert _spans(moved) == [(KEYS[0], KEYS[0]), (KEYS[1], KEYS[1])]
    assert {r.run_key("t") for r in moved.ranges}.isdisjoint(r.run_key("t") for r in first.ranges)


def test_an_open_transaction_holds_the_hour_past_its_lateness():
    idle = [{0: 0}, {0: None}]
    progress = _progress(idle, ends={0: 1}, in_transaction=frozenset({0}))
    plan = _plan(progress, now=H0 + HOUR * 5)
    assert plan.ranges == [] and "open transaction" in plan.waiting


def test_hours_materialized_with_their_slice_are_not_requested_and_only_new_hours_are_asked():
    busy = [{0: n} for n in range(4)]
    asked: list[list[str]] = []
    plan = _plan(
        _progress(busy, ends={0: 5}),
        Cursor(watch_from=KEYS[0], requested={KEYS[0]: "0:0-0"}),  # an older slice of hour 0
        now=H0 + HOUR * 3 + timedelta(minutes=1),
        done={KEYS[1]},
        asked=asked,
    )
    assert _spans(plan) == [(KEYS[0], KEYS[0]), (KEYS[2], KEYS[2])]
    assert asked == [[KEYS[1], KEYS[2]]]  # hour 0 was requested before: no need to look


def test_an_hour_closed_by_lateness_settles_once_watch_hours_passed():
    idle = [{0: 0}, {0: None}, {0: None}]
    progress = _progress(idle, ends={0: 1})
    watched = _plan(progress, now=H0 + HOUR * 2 + timedelta(minutes=1), watch_hours=2)
    assert _spans(watched) == [(KEYS[0], KEYS[0])]
    assert watched.cursor.watch_from == KEYS[0]
    later = H0 + HOUR * 3 + timedelta(minutes=1)
    settled = _plan(progress, watched.cursor, now=later, watch_hours=2)
    assert settled.cursor.watch_from == KEYS[1]
    assert list(settled.cursor.requested) == [KEYS[1]]


def test_starts_never_lie_below_the_log_start():
    busy = [{0: 0}, {0: 4}, {0: 6}]
    plan = _plan(
        _progress(busy, ends={0: 7}, log_starts={0: 2}), now=H0 + HOUR * 2 + timedelta(minutes=1)
    )
    assert [(h.start, h.end) for h in plan.hours] == [({0: 2}, {0: 4}), ({0: 4}, {0: 6})]


def test_the_run_key_names_the_table_the_hours_and_the_end_offsets():
    hours = tuple(HourState(KEYS[n], {0: n}, {0: n + 1}, True, None) for n in range(2))
    one, both = HourRange(hours[:1]), HourRange(hours)
    assert one.run_key("t").startswith(f"t:{KEYS[0]}:ends[0=1]:")
    assert both.run_key("t").startswith(f"t:{KEYS[0]}..{KEYS[1]}:ends[0=2]:")
    other = HourRange((hours[0], HourState(KEYS[1], {0: 1}, {0: 2}, False, None)))
    assert other.run_key("t") == both.run_key("t")  # the slices decide, not how they closed


def test_a_tier0_tables_open_hours_are_refreshed_once_per_slot():
    spec = _spec().model_copy(update={"refresh_minutes": 15})
    progress = _progress([{0: 0}, {0: 5}], ends={0: 9})
    now = H0 + HOUR + timedelta(minutes=20)
    first = _plan(progress, now=now, spec=spec)
    assert first.refresh == [KEYS[1]] and first.cursor.refreshed == f"2026-11-04T09:15 {KEYS[1]}"
    # The same slot again: nothing to refresh, the mark kept.
    again = _plan(progress, first.cursor, now=now + timedelta(minutes=9), spec=spec)
    assert again.refresh == [] and again.cursor.refreshed == first.cursor.refreshed
    # The next slot: refreshed again.
    later = _plan(progress, again.cursor, now=now + timedelta(minutes=10), spec=spec)
    assert later.refresh == [KEYS[1]] and later.cursor.refreshed == f"2026-11-04T09:30 {KEYS[1]}"
    # An hourly table never.
    assert _plan(progress, now=now).refresh == []


def test_an_hour_opening_inside_a_refresh_slot_is_refreshed_in_it():
    """45-minute slots run across an hour's start: the hour that opens in one is refreshed
    then, not at the next slot."""
    spec = _spec(lateness=0).model_copy(update={"refresh_minutes": 45})
    progress = _progress([{0: 0}, {0: 5}, {0: 9}], ends={0: 9})
    before = H0 + HOUR + timedelta(minutes=50)  # 09:50, in the slot that ends at 10:30
    first = _plan(progress, now=before, spec=spec)
    assert first.refresh == [KEYS[1]]
    after = H0 + 2 * HOUR + timedelta(minutes=5)  # 10:05: same slot, hour 10:00 is open now
    assert refresh_slot(spec, before) == refresh_slot(spec, after)
    again = _plan(progress, first.cursor, now=after, spec=spec)
    assert again.refresh and again.refresh[-1] == KEYS[2]


def test_no_refresh_while_one_of_the_table_is_in_flight_and_one_right_after():
    spec = _spec().model_copy(update={"refresh_minutes": 15})
    progress = _progress([{0: 0}, {0: 5}], ends={0: 9})
    now = H0 + HOUR + timedelta(minutes=20)
    first = _plan(progress, now=now, spec=spec)
    later = now + timedelta(minutes=15)  # the next slot, its refresh still running
    busy = plan_tick(
        spec,
        progress,
        first.cursor,
        now=later,
        watch_from=H0,
        watch_hours=24,
        already_materialized=lambda hours: set(),
        refresh_in_flight=True,
    )
    assert busy.refresh == [] and busy.cursor.refreshed == first.cursor.refreshed
    # It ended: the slot's refresh now.
    free = _plan(progress, busy.cursor, now=later + timedelta(seconds=30), spec=spec)
    assert free.refresh == [KEYS[1]]
