"""What the command-line tools refuse before launching anything, and what a run refuses when it
is launched anyway (pure functions; the tools against a real webserver are in
test_backfill_cli.py)."""

from __future__ import annotations

from datetime import UTC, datetime

import dagster as dg
import pytest

from cdc_assets.config import TableSpec
from cdc_assets.factory import _refuse_hours_outside
from cdc_assets.partitions import hourly_partitions
from cdc_assets.webserver import WebserverError, _first_lines, _reason_of, refuse_hours

KEYS = ["2026-11-27-11:00", "2026-11-27-12:00", "2026-11-27-13:00"]
INSIDE_LAST = datetime(2026, 11, 27, 13, 20, tzinfo=UTC)
AFTER_LAST = datetime(2026, 11, 27, 14, 0, 1, tzinfo=UTC)


@pytest.mark.parametrize(
    ("first", "last", "now", "reason"),
    [
        ("2026-11-27-10:00", KEYS[0], INSIDE_LAST, "is before the first hour of table 'orders' "
         "(2026-11-27-11:00); start the range at 2026-11-27-11:00"),
        (KEYS[0], "2026-11-27-15:00", INSIDE_LAST, "2026-11-27-15:00 is in the future; the "
         "newest hour of table 'orders' is 2026-11-27-13:00"),
        (KEYS[2], KEYS[2], INSIDE_LAST, "hour 2026-11-27-13:00 of table 'orders' is still open "
         "(it ends at 14:00 UTC)"),
    ],
)  # fmt: skip
def test_hours_outside_the_tables_partitions_or_still_open_are_refused(first, last, now, reason):
    with pytest.raises(WebserverError) as refused:
        refuse_hours({"orders": KEYS}, first, last, now=now)
    assert reason in str(refused.value)


def test_the_open_hour_alone_is_not_told_to_end_before_it_starts():
    with pytest.raises(WebserverError) as refused:
        refuse_hours({"orders": KEYS}, KEYS[2], KEYS[2], now=INSIDE_LAST)
    assert "or end the range" not in str(refused.value)
    with pytest.raises(WebserverError) as refused:
        refuse_hours({"orders": KEYS}, KEYS[0], KEYS[2], now=INSIDE_LAST)
    assert "or end the range at 2026-11-27-12:00" in str(refused.value)


def test_a_step_that_exhausted_its_retries_gives_the_reason_it_retried():
    error = {
        "message": "Exceeded max_retries of 2\n",
        "cause": {"message": "dagster._core.definitions.events.Failure: orders: broker gone"},
    }
    assert _reason_of(error) == "dagster._core.definitions.events.Failure: orders: broker gone"
    assert _reason_of({"message": "orders: hour x", "cause": None}) == "orders: hour x"
    assert _reason_of(None) is None


def test_closed_hours_inside_the_partitions_pass():
    refuse_hours({"orders": KEYS}, KEYS[0], KEYS[1], now=INSIDE_LAST)
    # Once the clock passed the newest partition's end, it is closed too.
    refuse_hours({"orders": KEYS}, KEYS[0], KEYS[2], now=AFTER_LAST)


def test_a_failure_message_loses_dagsters_exception_class_and_keeps_its_first_lines():
    message = "dagster._core.definitions.events.Failure: orders: hour x\nline 2\n\n" + "more\n" * 9
    assert _first_lines(message) == "orders: hour x\nline 2\nmore\nmore\nmore\nmore"


def test_a_run_of_hours_outside_the_partitions_fails_without_a_retry():
    spec = TableSpec(
        name="orders",
        topic="shop.public.orders",
        primary_key=("id",),
        columns={"id": "bigint"},
        start_hour="2026-11-27-11:00",
    )
    partitions = hourly_partitions(spec)
    with pytest.raises(dg.Failure) as refused:
        _refuse_hours_outside(
            dg.PartitionKeyRange("2026-11-27-10:00", "2026-11-27-12:00"), partitions, [spec]
        )
    assert not refused.value.allow_retries
    assert "hour 2026-11-27-10:00 is before the tables' first hour 2026-11-27-11:00" in str(
        refused.value.description
    )
    with pytest.raises(dg.Failure, match="is in the future"):
        _refuse_hours_outside(
            dg.PartitionKeyRange("2026-11-27-12:00", "2099-01-01-00:00"), partitions, [spec]
        )
    _refuse_hours_outside(
        dg.PartitionKeyRange("2026-11-27-11:00", "2026-11-27-12:00"), partitions, [spec]
    )
