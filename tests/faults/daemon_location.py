"""The code location and the run coordinator of the daemon fault scenarios
(tests/faults/test_daemon.py), loaded by a real `dagster-daemon run -m
tests.faults.daemon_location`.

`defs` is the project's Definitions over the tables file in CDC_TABLES_FILE, as
`code_location.definitions` builds them, with the offset sensor allowed to tick every
SENSOR_INTERVAL_S (the sensor daemon looks at its sensors every 5 s anyway), and each run's
Spark session made as the crash scenarios' children make theirs (`hour_child.spark_resource`:
local[1], the quick JIT compiler, its scratch space next to DAGSTER_HOME): every run starts a
JVM of its own on a two-core machine shared with the broker.

`PausingRunCoordinator`, named in the test instance's dagster.yaml, is Dagster's queued run
coordinator with one test-only pause point. The sensor daemon submits a tick's runs one by one
through it, after it has stored the tick's run requests and cursor. When PAUSE_ENV holds N, the
N-th submission of the process stops before the run is queued (the run exists, NOT_STARTED),
writes the run's id to DAGSTER_HOME/PAUSED_FILE and waits for good: the tick stays STARTED,
its earlier runs are queued and go on, its later ones are not created yet, until the test
SIGKILLs the daemon. A daemon started without PAUSE_ENV submits as Dagster's own does.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import dagster as dg

PAUSE_ENV = "CDC_TEST_PAUSE_BEFORE_SUBMIT"
PAUSED_FILE = "paused-before-submit"
SENSOR_INTERVAL_S = 2

_count_lock = threading.Lock()
_submitted = [0]


class PausingRunCoordinator(dg.QueuedRunCoordinator):
    """The queued run coordinator, stopping for good before the PAUSE_ENV-th submission."""

    def submit_run(self, context: dg.SubmitRunContext) -> dg.DagsterRun:
        pause_at = int(os.environ.get(PAUSE_ENV) or 0)
        with _count_lock:
            _submitted[0] += 1
            number = _submitted[0]
        if pause_at and number == pause_at:
            marker = Path(os.environ["DAGSTER_HOME"], PAUSED_FILE)
            marker.write_text(context.dagster_run.run_id)
            threading.Event().wait()  # until the test kills the daemon
        return super().submit_run(context)


@dg.definitions
def defs() -> dg.Definitions:
    from cdc_assets.config import TABLES_FILE_ENV, load_tables
    from code_location.definitions import build_definitions
    from tests.faults.hour_child import spark_resource

    built = build_definitions(
        load_tables(os.environ[TABLES_FILE_ENV]), offset_sensor_interval_seconds=SENSOR_INTERVAL_S
    )
    spark = spark_resource(Path(os.environ["DAGSTER_HOME"]).parent)
    return dg.Definitions(
        assets=built.assets,
        asset_checks=built.asset_checks,
        sensors=built.sensors,
        schedules=built.schedules,
        executor=built.executor,
        resources={**(built.resources or {}), "spark": spark},
    )
