"""The hour arithmetic the offset sensor's modules share (hour keys: `cdc_assets.hours`)."""

from __future__ import annotations

from datetime import UTC, datetime

from cdc_assets.hours import HOUR, hour_key

__all__ = ["HOUR", "floor_hour", "from_ms", "hour_key", "to_ms"]


def floor_hour(moment: datetime) -> datetime:
    return moment.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


def to_ms(moment: datetime) -> int:
    return int(moment.timestamp() * 1000)


def from_ms(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, UTC)
