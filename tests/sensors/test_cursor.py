"""The offset sensor's cursor format: what Dagster stores must parse back to the same cursor."""

from __future__ import annotations

import json

from sensors.cursor import Cursor, FleetCursor


def test_a_table_cursor_round_trips_and_an_empty_one_is_a_fresh_start():
    cursor = Cursor(watch_from="2026-11-04-09:00", requested={"2026-11-04-10:00": "0:1-2"})
    assert Cursor.parse(cursor.dump()) == cursor
    assert json.loads(cursor.dump())["watch_from"] == "2026-11-04-09:00"
    assert Cursor.parse(None) == Cursor() == Cursor.parse("")


def test_the_sensor_cursor_round_trips_with_stable_text():
    cursor = FleetCursor(
        tables={
            "orders": Cursor("2026-11-04-09:00", {"2026-11-04-10:00": "0:1-2"}, "2026-11-04T10:15"),
            "customers": Cursor(None, {}),
        },
        lag={"orders": [3, 1793700000]},
    )
    text = cursor.dump()
    assert FleetCursor.parse(text) == cursor
    assert FleetCursor.parse(text).dump() == text  # evaluating a tick twice stores the same text
    assert list(json.loads(text)["tables"]) == ["customers", "orders"]
    assert FleetCursor.parse(None) == FleetCursor()


def test_a_cursor_stored_before_lag_was_recorded_still_parses():
    stored = json.dumps({"tables": {"orders": {"watch_from": "2026-11-04-09:00"}}})
    parsed = FleetCursor.parse(stored)
    assert parsed.tables == {"orders": Cursor("2026-11-04-09:00", {})} and parsed.lag == {}


def test_a_cursor_stored_before_refresh_slots_still_parses_and_dumps_the_same():
    stored = json.dumps({"requested": {}, "watch_from": "2026-11-04-09:00"}, sort_keys=True)
    assert Cursor.parse(stored).refreshed is None
    assert Cursor.parse(stored).dump() == stored
