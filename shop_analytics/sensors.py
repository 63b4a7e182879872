"""The trigger of the downstream assets: Dagster's automation sensor, on by default.

The downstream assets carry their own automation conditions (shop_analytics/assets.py): an
hour is built when its upstream mirror hours are materialized and their blocking checks
passed, so never on a failed or partial (forced-open) hour. This sensor evaluates those
conditions every 30 seconds in the daemon and launches what they ask for.
"""

from __future__ import annotations

from collections.abc import Sequence

import dagster as dg

DOWNSTREAM_SENSOR = "shop_analytics_automation"


def build_downstream_sensor(
    assets: Sequence[dg.AssetsDefinition], *, minimum_interval_seconds: int = 30
) -> dg.AutomationConditionSensorDefinition:
    return dg.AutomationConditionSensorDefinition(
        DOWNSTREAM_SENSOR,
        target=dg.AssetSelection.assets(*assets),
        default_status=dg.DefaultSensorStatus.RUNNING,
        minimum_interval_seconds=minimum_interval_seconds,
        description=(
            "Builds the downstream assets once their upstream hours are materialized and "
            "their blocking checks passed."
        ),
    )
