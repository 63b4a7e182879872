"""The accounting check (I2) on hand-made hour results: it passes when the counts balance and
fails, saying why, when they don't."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

from cdc_assets.hour_run import HourCounts, HourResult
from cdc_assets.slicing import HourSlice, PartitionSlice
from checks.invariants import accounting_result

START = datetime(2026, 11, 3, 9, tzinfo=UTC)


def _result(counts: HourCounts, slice_size: int = 10) -> HourResult:
    hour_slice = HourSlice(
        topic="t",
        hour_start=START,
        hour_end=START + timedelta(hours=1),
        partitions=(PartitionSlice(0, 5, 5 + slice_size, 0, True),),
        closed=True,
        open_reason=None,
    )
    return HourResult(
        table="t",
        hour_key="2026-11-03-09:00",
        slice=hour_slice,
        counts=counts,
        rows_inserted=0,
        rows_updated=0,
        rows_deleted=0,
        delta_version=1,
        partial=False,
        newest_source_ts=None,
        finished_at=START,
    )


BALANCED = HourCounts(consumed=10, applied=4, superseded=2, stale=1, tombstones=1, errors=2)


def test_balanced_counts_pass():
    check = accounting_result(_result(BALANCED))
    assert check.passed
    assert check.metadata["accounted"].value == 10
    assert check.metadata["offset_gaps"].value == 0


def test_unbalanced_counts_fail():
    check = accounting_result(_result(replace(BALANCED, errors=3)))
    assert not check.passed
    assert "consumed 10 but accounted for 11" in check.description


def test_a_merge_touching_more_rows_than_keys_fails():
    # applied > merged keys shows up as a negative stale count.
    check = accounting_result(_result(replace(BALANCED, applied=6, stale=-1)))
    assert not check.passed
    assert "negative counts: stale" in check.description


def test_reading_past_the_slice_fails_and_gaps_are_reported():
    assert not accounting_result(_result(BALANCED, slice_size=9)).passed
    with_gaps = accounting_result(_result(BALANCED, slice_size=12))
    assert with_gaps.passed and with_gaps.metadata["offset_gaps"].value == 2
