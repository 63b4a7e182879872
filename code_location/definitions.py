"""The code location: the one Definitions object, a mirror and a maintenance asset per
configured table with its checks, the schedule of the maintenance, the offset sensor, the demo
shop's analytics (shop_analytics/) when the tables file switches them on, and the resources.

The only module that puts every package together: the mirror (cdc_assets) receives its checks
(checks) here, so no package below imports one above it (tests/test_layers.py)."""

from __future__ import annotations

import os
from collections.abc import Mapping

import dagster as dg

from cdc_assets.config import DEFAULT_TABLES_FILE, TABLES_FILE_ENV, TableSpec, load_tables_file
from cdc_assets.factory import build_mirror_assets
from cdc_assets.maintenance import build_maintenance_asset, build_maintenance_schedule
from checks.table_checks import MIRROR_CHECKS, build_retention_check_for
from resources.environment import resources_from_env
from sensors.offset_progress import build_offset_sensor
from shop_analytics.assets import build_downstream_assets
from shop_analytics.sensors import build_downstream_sensor

SENSOR_INTERVAL_ENV = "CDC_SENSOR_INTERVAL_SECONDS"
DEFAULT_SENSOR_INTERVAL_S = 30


class SensorIntervalError(ValueError):
    """CDC_SENSOR_INTERVAL_SECONDS is not a whole number of seconds of at least 1."""


def sensor_interval_seconds(environ: Mapping[str, str] = os.environ) -> int:
    """How often the sensors may tick: CDC_SENSOR_INTERVAL_SECONDS, else 30 s."""
    raw = environ.get(SENSOR_INTERVAL_ENV, "").strip()
    if not raw:
        return DEFAULT_SENSOR_INTERVAL_S
    if not (raw.isascii() and raw.isdigit()) or int(raw) < 1:
        raise SensorIntervalError(
            f"{SENSOR_INTERVAL_ENV}={raw!r} is not a whole number of seconds of at least 1. "
            f"Set it to how often the sensors may tick (for example 30), or unset it for "
            f"{DEFAULT_SENSOR_INTERVAL_S}."
        )
    return int(raw)


def build_definitions(
    specs: list[TableSpec],
    *,
    shop_analytics: bool = False,
    offset_sensor_interval_seconds: int = DEFAULT_SENSOR_INTERVAL_S,
    downstream_sensor_interval_seconds: int = DEFAULT_SENSOR_INTERVAL_S,
) -> dg.Definitions:
    """Everything of `specs`, and the demo shop's analytics when `shop_analytics` (the tables
    file's switch, `TablesFile`); the intervals are how often the offset sensor and the
    downstream assets' automation sensor may tick (the daemon fault scenarios tick the offset
    sensor every few seconds)."""
    downstream = build_downstream_assets(specs) if shop_analytics else []
    # OPTIMIZE and VACUUM per table, daily once its schedule is turned on.
    maintenance = [build_maintenance_asset(spec) for spec in specs]
    return dg.Definitions(
        assets=[*build_mirror_assets(specs, checks=MIRROR_CHECKS), *downstream, *maintenance],
        asset_checks=[build_retention_check_for(spec=spec) for spec in specs],
        sensors=[
            # One sensor for every table: one Kafka read per tick, one run per closed hour.
            *(
                [
                    build_offset_sensor(
                        specs=specs, minimum_interval_seconds=offset_sensor_interval_seconds
                    )
                ]
                if specs
                else []
            ),
            *(
                [
                    build_downstream_sensor(
                        downstream, minimum_interval_seconds=downstream_sensor_interval_seconds
                    )
                ]
                if downstream
                else []
            ),
        ],
        schedules=[build_maintenance_schedule(maintenance)] if maintenance else [],
        # One process and one Spark session for all the assets of a run (the maintenance run
        # does every table in one session, table after table).
        executor=dg.in_process_executor,
        resources=resources_from_env(),
    )


@dg.definitions
def defs() -> dg.Definitions:
    # Read when Dagster loads the code location, never at import time.
    interval = sensor_interval_seconds()
    tables = load_tables_file(os.environ.get(TABLES_FILE_ENV, DEFAULT_TABLES_FILE))
    return build_definitions(
        tables.tables,
        shop_analytics=tables.shop_analytics,
        offset_sensor_interval_seconds=interval,
        downstream_sensor_interval_seconds=interval,
    )
