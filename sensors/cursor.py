"""The offset sensor's cursor, as Dagster stores it with the sensor: JSON holding, per table, the
oldest hour the sensor still watches and the slice it requested per watched hour, and when each
table's lag was last observed. A format change here must still parse the cursors stored before.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass
class Cursor:
    """What the sensor has requested: the oldest hour it still watches, per watched hour the
    slice (`fingerprint`) it requested last, and (tier-0 tables) the `refresh_minutes` slot and
    newest open hour of the refresh it requested last ("<slot> <hour>"), so a slot's refresh
    is requested and logged once."""

    watch_from: str | None = None
    requested: dict[str, str] = field(default_factory=dict)
    refreshed: str | None = None

    @classmethod
    def parse(cls, raw: str | None) -> Cursor:
        if not raw:
            return cls()
        data = json.loads(raw)
        return cls(
            watch_from=data.get("watch_from"),
            requested=dict(data.get("requested", {})),
            refreshed=data.get("refreshed"),
        )

    def dump(self) -> str:
        data = {"watch_from": self.watch_from, "requested": dict(sorted(self.requested.items()))}
        if self.refreshed:
            data["refreshed"] = self.refreshed
        return json.dumps(data, sort_keys=True)


@dataclass
class FleetCursor:
    """The sensor's cursor: each table's `Cursor`, and when its lag was last observed."""

    tables: dict[str, Cursor] = field(default_factory=dict)
    # table -> [lag_messages, epoch seconds] of the last lag observation recorded
    lag: dict[str, list] = field(default_factory=dict)

    @classmethod
    def parse(cls, raw: str | None) -> FleetCursor:
        if not raw:
            return cls()
        data = json.loads(raw)
        return cls(
            tables={name: Cursor.parse(json.dumps(c)) for name, c in data["tables"].items()},
            lag={name: list(v) for name, v in data.get("lag", {}).items()},
        )

    def dump(self) -> str:
        return json.dumps(
            {
                "tables": {n: json.loads(c.dump()) for n, c in sorted(self.tables.items())},
                "lag": dict(sorted(self.lag.items())),
            },
            sort_keys=True,
        )
