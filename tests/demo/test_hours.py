"""`python -m demo.hours`: the demo's hours as its tables file says, or why it can't say."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from demo import hours
from demo.shop import write_tables_file


def test_prints_the_demos_first_closed_and_open_hours(tmp_path, monkeypatch, capsys):
    now = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    first = now - timedelta(hours=3)
    write_tables_file(first, tmp_path / "tables.yaml")
    monkeypatch.setenv("DEMO_DIR", str(tmp_path))
    key = "%Y-%m-%d-%H:%M"

    assert hours.main(["--first"]) == 0
    assert hours.main(["--first", "--plus", "2"]) == 0
    assert hours.main(["--last-closed"]) == 0
    printed = capsys.readouterr().out.split()
    assert printed == [first.strftime(key), (first + timedelta(hours=2)).strftime(key),
                       (now - timedelta(hours=1)).strftime(key)]  # fmt: skip

    assert hours.main([]) == 0
    text = capsys.readouterr().out
    assert f"{first.strftime(key)} .. {(now - timedelta(hours=1)).strftime(key)}" in text
    assert now.strftime(key) in text


def test_a_demo_not_started_yet_is_said_and_exits_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DEMO_DIR", str(tmp_path / "nothing"))
    assert hours.main(["--first"]) == 2
    assert "Run scripts/demo.sh first" in capsys.readouterr().err
