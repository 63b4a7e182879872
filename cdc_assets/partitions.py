"""A mirror's partitions and pools: what the asset, its checks, maintenance and the downstream
assets share, so none of them reaches into the asset factory for it.

Each table is partitioned by UTC hour from its `start_hour`. The runs that write mirrors (in
this process or through Pipes) and their maintenance hold their tables' pool (limit 1 in the
instance): one writer per table, since each table's hours and its maintenance run only in runs
holding it. Hourly tables share `cdc_mirrors`; tier-0 tables (`refresh_minutes`) share
`cdc_mirrors_tier0`, so their refreshes and final runs never queue behind the hourly tables'
runs (each table is in exactly one pool, so it still has one writer).
"""

from __future__ import annotations

import dagster as dg

from cdc_assets.config import TableSpec

MIRRORS_POOL = "cdc_mirrors"
TIER0_POOL = "cdc_mirrors_tier0"

# The tag of a run the offset sensor launches to refresh an open hour of tier-0 tables
# (`refresh_minutes`): the run slices the open hour as `force_open_hour` does, and its results
# are partial until the run after the hour closes completes them.
REFRESH_TAG = "cdc/refresh"
# Who launched a run: the offset sensor tags its runs so (`SENSOR_TRIGGER`). A run a person
# launched leaves an hour it finds still open as it was; the sensor's run fails on one, since
# the sensor asked for it as closed (cdc_assets.factory).
TRIGGER_TAG = "cdc/trigger"
SENSOR_TRIGGER = "offset_sensor"


def hourly_partitions(spec: TableSpec) -> dg.HourlyPartitionsDefinition:
    # end_offset=1: the current, still open hour exists as a partition so that a person can
    # force it (force_open_hour); run without forcing, it is refused with the reason.
    return dg.HourlyPartitionsDefinition(start_date=spec.start_hour, timezone="UTC", end_offset=1)


def mirrors_pool(spec: TableSpec) -> str:
    """The pool of every run that writes `spec`'s mirror (limit 1): one writer per table, since
    each table's hours, and its maintenance, run only in runs holding this pool. Tier-0 tables
    have a pool of their own, so a refresh waits at most for another tier-0 run."""
    return TIER0_POOL if spec.refresh_minutes else MIRRORS_POOL
