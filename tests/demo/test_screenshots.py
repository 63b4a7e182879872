"""demo.screenshots without a demo: it refuses, saying what is missing; the hour it clicks."""

from __future__ import annotations

import socket
from datetime import UTC, datetime

from demo import screenshots


def test_refuses_with_exit_2_naming_what_is_missing(capsys):
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    assert screenshots.main(["--port", str(port), "--out", "unused"]) == 2
    err = capsys.readouterr().err
    # Whichever is missing first here: Playwright, chromium, or the webserver.
    assert any(
        what in err
        for what in (
            '-e ".[docs]"',
            "apt-get install chromium",
            f"no Dagster webserver answers at http://127.0.0.1:{port}",
        )
    ), err


def test_the_partition_it_selects_is_the_hour_before_the_newest_closed_one():
    now = datetime(2026, 11, 28, 0, 5, tzinfo=UTC)
    assert screenshots.settled_hour(now) == "2026-11-27-22:00"
