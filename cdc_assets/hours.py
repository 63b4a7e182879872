"""Hour keys: the one format of an hourly partition's key, and the hour a key names.

Dagster's `HourlyPartitionsDefinition` keys partitions as `YYYY-MM-DD-HH:00` in UTC; the run,
the checks, the sensors and the command-line tools all read and write keys here, and nowhere
else. Pure: no Spark, no Dagster.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

HOUR_KEY_FORMAT = "%Y-%m-%d-%H:%M"
HOUR = timedelta(hours=1)


def hour_key(moment: datetime) -> str:
    """The key of the hour `moment` starts (a UTC hour start)."""
    return moment.strftime(HOUR_KEY_FORMAT)


def hour_start(key: str) -> datetime:
    """The UTC start of the hour `key` names."""
    return datetime.strptime(key, HOUR_KEY_FORMAT).replace(tzinfo=UTC)


def previous_key(key: str) -> str:
    return hour_key(hour_start(key) - HOUR)


def parse_hour_key(value: str) -> datetime | None:
    """The hour `value` names when it is a key exactly (on the hour, zero-padded), else None."""
    try:
        parsed = datetime.strptime(value, HOUR_KEY_FORMAT)
    except ValueError:
        return None
    if parsed.minute or parsed.strftime(HOUR_KEY_FORMAT) != value:
        return None
    return parsed.replace(tzinfo=UTC)
