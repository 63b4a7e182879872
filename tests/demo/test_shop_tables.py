"""The demo's tables file: its partitions start at the demo's first seeded hour, and stay there
when the demo restarts (scripts/demo.sh points CDC_TABLES_FILE at it)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from cdc_assets.config import load_tables, load_tables_file
from demo.shop import _mark_followed, demo_first_hour, write_tables_file

HOUR = timedelta(hours=1)


def test_the_first_hour_is_the_first_seeded_one_across_restarts():
    first = datetime(2026, 11, 25, 18, tzinfo=UTC)
    started = {first, first + HOUR, first + 2 * HOUR}
    assert demo_first_hour(started, first + 3 * HOUR + timedelta(minutes=7)) == first
    # Restarted a day later: the last closed hours are seeded too, the start stays put.
    later = started | {first + 22 * HOUR, first + 23 * HOUR, first + 24 * HOUR}
    assert demo_first_hour(later, first + 25 * HOUR) == first


def test_nothing_seeded_starts_at_the_current_hour():
    now = datetime(2026, 11, 25, 21, 43, 5, tzinfo=UTC)
    assert demo_first_hour(set(), now) == datetime(2026, 11, 25, 21, tzinfo=UTC)


def test_the_tables_file_is_the_packaged_one_starting_at_the_first_hour(tmp_path):
    first = datetime(2026, 11, 25, 18, tzinfo=UTC)
    path = write_tables_file(first, tmp_path / "demo" / "tables.yaml")
    written = load_tables(path)
    packaged = load_tables()
    assert [s.name for s in written] == [s.name for s in packaged]
    assert {s.start_hour for s in written} == {"2026-11-25-18:00"}
    # The packaged tables, but for the first hour, the demo's tier-0 table and its history.
    tier0 = {"orders": 5}
    assert [s.model_copy(update={"start_hour": "x"}) for s in written] == [
        s.model_copy(
            update={
                "start_hour": "x",
                "refresh_minutes": tier0.get(s.name),
                "history": s.name == "customers",
            }
        )
        for s in packaged
    ]
    # The demo's analytics come with its tables: the copy keeps the file's switch.
    assert load_tables_file(path).shop_analytics is True


class _Recorder:
    """A DB-API connection that keeps the parameters of what it is asked to execute."""

    def __init__(self):
        self.rows = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def cursor(self):
        return self

    def execute(self, sql, params):
        assert sql.startswith("INSERT INTO demo_meta.seeded")
        self.rows.append(params[0])


def test_following_records_every_hour_it_passed_so_a_restart_seeds_none_of_them():

    db = _Recorder()
    start = datetime(2026, 11, 27, 23, 50, tzinfo=UTC)
    marked = _mark_followed(db, None, start)
    assert db.rows == [datetime(2026, 11, 27, 23, tzinfo=UTC)]
    # Within the hour: nothing more. Across midnight: the new hour.
    marked = _mark_followed(db, marked, start + timedelta(minutes=5))
    marked = _mark_followed(db, marked, start + timedelta(minutes=15))
    assert db.rows[1:] == [datetime(2026, 11, 28, 0, tzinfo=UTC)]
    # A machine asleep for three hours, or a whole day: every hour it passed, none seeded later.
    db.rows.clear()
    marked = _mark_followed(db, marked, datetime(2026, 11, 28, 3, 10, tzinfo=UTC))
    assert sorted(db.rows) == [datetime(2026, 11, 28, h, tzinfo=UTC) for h in (1, 2, 3)]
    db.rows.clear()
    _mark_followed(db, marked, datetime(2026, 11, 29, 3, 10, tzinfo=UTC))
    assert len(db.rows) == 24
