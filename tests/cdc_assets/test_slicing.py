"""The hour's slice per partition, [b(H), b(H+1)), and when an hour has closed: the boundary
rules of cdc_assets/slicing.py on an in-memory log (tests/fakes.py). The same rules against the
real broker: tests/cdc_assets/test_hour_edges.py and tests/sensors/."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from kafka import TopicPartition

from cdc_assets.commits import recorded_offsets, refreshed_to
from cdc_assets.slicing import LostRange, SliceError, compute_slice, remainder
from tests.fakes import FakeConsumer

H = datetime(2026, 11, 4, 8, tzinfo=UTC)
LATENESS = timedelta(minutes=30)


def _ms(hour: float, minutes: int = 0) -> int:
    return int((H + timedelta(hours=hour, minutes=minutes)).timestamp() * 1000)


def _slice(consumer, *, hour: int = 0, now: datetime | None = None, **options):
    return compute_slice(
        consumer,
        table="t",
        topic="t",
        hour_start=H + timedelta(hours=hour),
        now=now or H + timedelta(hours=6),
        allowed_lateness=LATENESS,
        **options,
    )


def test_consecutive_hours_share_their_boundary_and_a_record_follows_its_place_in_the_log():
    # Offset 2 is stamped inside hour 0 but written after a record of hour 1.
    consumer = FakeConsumer({"t": {0: [_ms(0, 10), _ms(1, 5), _ms(0, 50), _ms(2, 5)]}})
    first, second = _slice(consumer, hour=0), _slice(consumer, hour=1)
    assert (first.start_offsets(), first.end_offsets()) == ({0: 0}, {0: 1})
    assert (second.start_offsets(), second.end_offsets()) == ({0: 1}, {0: 3})
    assert first.closed and second.closed and first.partitions[0].moved_past


def test_an_idle_partition_ends_at_its_stable_end_and_holds_the_hour_until_lateness_passes():
    consumer = FakeConsumer({"t": {0: [_ms(0, 10), _ms(1, 10)], 1: [_ms(0, 20)]}})
    end = H + timedelta(hours=1)
    held = _slice(consumer, now=end + timedelta(minutes=10))
    assert not held.closed
    assert "partitions [1] hold no committed message stamped at or after" in held.open_reason
    assert held.end_offsets() == {0: 1, 1: 1}
    assert not held.partitions[1].moved_past
    closed = _slice(consumer, now=end + LATENESS)
    assert closed.closed and closed.open_reason is None


def test_an_hour_that_ends_after_now_is_open():
    consumer = FakeConsumer({"t": {0: [_ms(0, 10)]}})
    assert "after now" in _slice(consumer, now=H + timedelta(minutes=30)).open_reason


def test_an_open_transaction_on_an_idle_partition_keeps_the_hour_open_past_its_lateness():
    logs = {"t": {0: [_ms(0, 10)]}}
    uncommitted = FakeConsumer(logs, high_watermarks={TopicPartition("t", 0): 3})
    found = _slice(FakeConsumer(logs), uncommitted=uncommitted)
    assert not found.closed and "open transaction" in found.open_reason


def test_the_start_earlier_runs_recorded_wins_and_a_partition_added_since_starts_at_zero():
    consumer = FakeConsumer({"t": {0: [_ms(0, 10), _ms(0, 20), _ms(1, 5)], 1: [_ms(0, 30)]}})
    known = _slice(consumer, known_starts={0: 1})
    assert known.start_offsets() == {0: 1, 1: 0}
    # Partition 1's record stamped before the hour, written after the previous hour ran, is
    # this hour's: the previous hour's recorded end named every partition but 1.
    consumer.logs["t"][1] = [_ms(-1, 30)]
    assert _slice(consumer, known_starts={0: 1}, starts_cover_topic=True).start_offsets()[1] == 0
    assert _slice(consumer, known_starts={0: 1}).start_offsets()[1] == 1  # b(H): its end


def test_offsets_deleted_by_retention_are_reported_exactly_when_the_start_is_known():
    stamps = [_ms(0, m) for m in (1, 2, 3, 4, 5)] + [_ms(1, 1)]
    consumer = FakeConsumer({"t": {0: stamps}}, log_starts={TopicPartition("t", 0): 3})
    exact = _slice(consumer, known_starts={0: 1})
    assert exact.start_offsets() == {0: 3}  # never below what retention left
    assert exact.lost == (LostRange(0, 1, 3),)
    assert exact.lost[0].describe() == "partition 0: offsets [1, 3)"
    unknown = _slice(consumer)
    assert unknown.lost == (LostRange(0, None, 3),)
    assert unknown.lost[0].describe() == "partition 0: offsets [?, 3)"


def test_a_missing_topic_names_the_table_and_the_setting():
    with pytest.raises(SliceError, match="table 't': topic 't' does not exist.*'topic' setting"):
        _slice(FakeConsumer({}))


def test_after_a_refresh_the_next_run_reads_on_and_the_next_hour_starts_at_a_complete_end():
    """A refresh (a partial run) of hour 0 read partition 0 up to offset 2. The next run of the
    hour reads from there (`remainder`); a partition the refresh did not know is read whole;
    retention past the refresh's end is loss. Hour 1 starts at hour 0's end only as a run that
    read it closed recorded it, never at a refresh's end."""
    consumer = FakeConsumer(
        {"t": {0: [_ms(0, 1), _ms(0, 2), _ms(0, 3), _ms(1, 1)], 1: [_ms(0, 5)]}}
    )
    hour = _slice(consumer, now=H + timedelta(hours=2))
    piece = remainder(hour, {0: 2})
    assert piece.start_offsets() == {0: 2, 1: 0} and piece.end_offsets() == hour.end_offsets()
    assert piece.size == 2 and not piece.lost
    assert remainder(hour, {0: 9}).start_offsets()[0] == 3  # never past the hour's end

    trimmed = FakeConsumer(
        {"t": {0: [_ms(0, 1), _ms(0, 2), _ms(0, 3), _ms(1, 1)]}},
        log_starts={TopicPartition("t", 0): 3},
    )
    lost = remainder(_slice(trimmed, known_starts={0: 0}), {0: 1})
    assert lost.lost == (LostRange(0, 1, 3),) and lost.start_offsets() == {0: 3}

    refresh = {
        "hour": "h0",
        "partial": True,
        "slice": {"partitions": {"0": {"start": 0, "end": 2}}},
    }
    closed = {
        "hour": "h0",
        "partial": False,
        "slice": {"partitions": {"0": {"start": 0, "end": 3}}},
    }
    assert refreshed_to([refresh, closed], "h0", {0: 0}) == {0: 2}
    assert refreshed_to([refresh], "h0", {0: 1}) == {}  # the hour now starts elsewhere: all
    assert refreshed_to([closed, refresh], "h0", {0: 0}) == {}  # a rerun of a closed hour: all
    assert recorded_offsets([refresh, closed], "h0", "end", complete=True) == {0: 3}
    assert recorded_offsets([refresh], "h0", "end", complete=True) is None
