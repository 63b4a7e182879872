"""Hour keys and the hour arithmetic the offset sensor's modules share."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from cdc_assets.hour_run import HOUR_KEY_FORMAT

HOUR = timedelta(hours=1)


def hour_key(moment: datetime) -> str:
    return moment.strftime(HOUR_KEY_FORMAT)


def floor_hour(moment: datetime) -> datetime:
    return moment.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


def to_ms(moment: datetime) -> int:
    return int(moment.timestamp() * 1000)


def from_ms(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, UTC)
