"""The code location: the one Definitions object, a mirror and a maintenance asset per
configured table with its checks (each hour's, and the daily ones that judge the table whole),
the schedules of the maintenance and of the daily checks, the offset sensor, the demo shop's
analytics (shop_analytics/) when the tables file switches them on, and the resources.

The only module that puts every package together: the mirror (cdc_assets) receives its checks
(checks) here, so no package below imports one above it (tests/test_layers.py)."""

from __future__ import annotations

import os
from collections.abc import Mapping

import dagster as dg

from cdc_assets.config import DEFAULT_TABLES_FILE, TABLES_FILE_ENV, TableSpec, load_tables_file
from cdc_assets.factory import build_mirror_assets
from cdc_assets.maintenance import build_maintenance_asset, build_maintenance_schedule
from checks.daily import build_daily_checks, build_daily_checks_schedule
from checks.table_checks import MIRROR_CHECKS, build_retention_check_for
from resources.environment import resources_from_env
from sensors.offset_progress import build_offset_sensor
from shop_analytics.assets import build_downstream_assets
from shop_analytics.sensors import build_downstream_sensor

SENSOR_INTERVAL_ENV = "CDC_SENSOR_INTERVAL_SECONDS"
DEFAULT_SENSOR_INTERVAL_S = 30
TABLES_PER_RUN_ENV = "CDC_SENSOR_TABLES_PER_RUN"


class SensorSettingError(ValueError):
    """A sensor setting from the environment is not a whole number of at least 1."""


def _whole_number(environ: Mapping[str, str], name: str, what: str, unset: str) -> int | None:
    """The environment's `name` as a whole number of at least 1; None when unset or empty."""
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    if not (raw.isascii() and raw.isdigit()) or int(raw) < 1:
        raise SensorSettingError(
            f"{name}={raw!r} is not a whole number of at least 1. Set it to {what}, or unset "
            f"it for {unset}."
        )
    return int(raw)


def sensor_interval_seconds(environ: Mapping[str, str] = os.environ) -> int:
    """How often the sensors may tick: CDC_SENSOR_INTERVAL_SECONDS, else 30 s."""
    interval = _whole_number(
        environ,
        SENSOR_INTERVAL_ENV,
        "how often the sensors may tick, in seconds (for example 30)",
        f"{DEFAULT_SENSOR_INTERVAL_S}",
    )
    return interval or DEFAULT_SENSOR_INTERVAL_S


def sensor_tables_per_run(environ: Mapping[str, str] = os.environ) -> int | None:
    """The most tables the offset sensor puts in one run: CDC_SENSOR_TABLES_PER_RUN, else all
    the tables whose same hours closed (`build_offset_sensor`'s `tables_per_run`)."""
    return _whole_number(
        environ,
        TABLES_PER_RUN_ENV,
        "the most tables one run of the offset sensor may carry (for example 25)",
        "one run of every table whose same hours closed",
    )


def build_definitions(
    specs: list[TableSpec],
    *,
    shop_analytics: bool = False,
    offset_sensor_interval_seconds: int = DEFAULT_SENSOR_INTERVAL_S,
    downstream_sensor_interval_seconds: int = DEFAULT_SENSOR_INTERVAL_S,
    tables_per_run: int | None = None,
) -> dg.Definitions:
    """Everything of `specs`, and the demo shop's analytics when `shop_analytics` (the tables
    file's switch, `TablesFile`); the intervals are how often the offset sensor and the
    downstream assets' automation sensor may tick (the daemon fault scenarios tick the offset
    sensor every few seconds); `tables_per_run` bounds the tables in one run of the offset
    sensor (`build_offset_sensor`)."""
    downstream = build_downstream_assets(specs) if shop_analytics else []
    # OPTIMIZE and VACUUM per table, daily once its schedule is turned on.
    maintenance = [build_maintenance_asset(spec) for spec in specs]
    # The scans no hour pays for: each mirror (and history) judged whole, daily, on by default.
    daily = [check for spec in specs for check in build_daily_checks(spec)]
    return dg.Definitions(
        assets=[*build_mirror_assets(specs, checks=MIRROR_CHECKS), *downstream, *maintenance],
        asset_checks=[*(build_retention_check_for(spec=spec) for spec in specs), *daily],
        sensors=[
            # One sensor for every table: one Kafka read per tick, one run per closed hour.
            *(
                [
                    build_offset_sensor(
                        specs=specs,
                        minimum_interval_seconds=offset_sensor_interval_seconds,
                        tables_per_run=tables_per_run,
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
        schedules=(
            [build_maintenance_schedule(maintenance), build_daily_checks_schedule(daily)]
            if specs
            else []
        ),
        # One process and one Spark session for all the assets of a run (the maintenance run
        # does every table in one session, table after table).
        executor=dg.in_process_executor,
        resources=resources_from_env(),
    )


@dg.definitions
def defs() -> dg.Definitions:
    # Read when Dagster loads the code location, never at import time.
    interval, tables_per_run = sensor_interval_seconds(), sensor_tables_per_run()
    tables = load_tables_file(os.environ.get(TABLES_FILE_ENV, DEFAULT_TABLES_FILE))
    return build_definitions(
        tables.tables,
        shop_analytics=tables.shop_analytics,
        offset_sensor_interval_seconds=interval,
        downstream_sensor_interval_seconds=interval,
        tables_per_run=tables_per_run,
    )
