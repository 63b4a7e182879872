"""The demo's hours: where its partitions start, which hours have closed, which one is open.

    .venv/bin/python -m demo.hours                  # all of them, to read
    .venv/bin/python -m demo.hours --first          # the first hour's key alone, for a command
    .venv/bin/python -m demo.hours --first --plus 2 # the hour two after it
    .venv/bin/python -m demo.hours --last-closed    # the hour before the current one

A demo's partitions start at its first seeded hour (`demo/shop.py` writes that into the demo's
tables file, `$DEMO_DIR/tables.yaml`, default `.local/demo/tables.yaml`), so the hours the
README's examples use differ on every machine: this prints them. Run it from the checkout, as
every README command. An hour counts as closed here
once the clock has passed its end (the demo's shop writes every few seconds, so Kafka shows it
closed moments later; the offset sensor then launches it). Exits 2 when the demo has not been
started yet (no tables file), saying so.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cdc_assets.config import load_tables
from cdc_assets.hours import hour_key, hour_start


def tables_file() -> Path:
    """The demo's tables file as scripts/demo.sh names it (relative to the checkout)."""
    return Path(os.environ.get("DEMO_DIR", ".local/demo")) / "tables.yaml"


def first_hour(path: Path) -> datetime:
    """The earliest `start_hour` of the demo's tables (they all start there)."""
    return min(hour_start(spec.start_hour) for spec in load_tables(path))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--first", action="store_true", help="the first hour's key alone")
    which.add_argument("--last-closed", action="store_true", help="the last closed hour's key")
    parser.add_argument("--plus", type=int, default=0, help="hours after the one named")
    args = parser.parse_args(argv)
    path = tables_file()
    if not path.is_file():
        print(
            f"demo.hours: {path} does not exist: the demo has not been started here. "
            "Run scripts/demo.sh first (its shop writes that file on its first start).",
            file=sys.stderr,
        )
        return 2
    first = first_hour(path)
    current = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    last_closed = current - timedelta(hours=1)
    if args.first or args.last_closed:
        print(hour_key((first if args.first else last_closed) + timedelta(hours=args.plus)))
        return 0
    closed = f"{hour_key(first)} .. {hour_key(last_closed)}" if last_closed >= first else "none yet"
    print(f"The demo's hours (UTC), from {path}:")
    for label, value in (
        ("first hour (its partitions start here)", hour_key(first)),
        ("closed hours", closed),
        ("the open hour (refused until it closes)", hour_key(current)),
    ):
        print(f"  {label + ':':<41} {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
