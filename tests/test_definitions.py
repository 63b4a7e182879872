"""The code location loads: `dagster definitions validate` on workspace.yaml, and in-process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest

from cdc_assets.maintenance import MAINTENANCE_JOB, MAINTENANCE_SCHEDULE
from checks.daily import DAILY_CHECKS_JOB, DAILY_CHECKS_SCHEDULE
from code_location.definitions import (
    SENSOR_INTERVAL_ENV,
    TABLES_PER_RUN_ENV,
    SensorSettingError,
    defs,
    sensor_interval_seconds,
    sensor_tables_per_run,
)

REPO = Path(__file__).resolve().parents[1]


def test_definitions_validate_on_workspace(tmp_path):
    env = {**os.environ, "DAGSTER_HOME": str(tmp_path)}
    dagster = Path(sys.executable).with_name("dagster")
    result = subprocess.run(
        [str(dagster), "definitions", "validate", "-w", str(REPO / "workspace.yaml")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "All code locations passed validation" in result.stdout + result.stderr


def test_one_hourly_asset_per_table_all_in_the_mirrors_pool():
    definitions = defs() if callable(defs) else defs
    graph = definitions.resolve_asset_graph()
    mirrors = {"customers", "orders", "order_items"}
    keys = {key.to_user_string() for key in graph.get_all_asset_keys()}
    maintenance = {f"{table}_maintenance" for table in mirrors}
    assert keys == mirrors | {"order_facts", "daily_sales"} | maintenance
    pools = set()
    for key in graph.get_all_asset_keys():
        if key.to_user_string() not in mirrors:
            continue
        node = graph.get(key)
        assert isinstance(node.partitions_def, dg.HourlyPartitionsDefinition)
        assert node.group_name == "cdc_mirrors"
        assert {"kafka", "spark", "delta"} <= set(node.kinds)
        assets_def = definitions.get_assets_def(key)
        assert assets_def.can_subset  # a run may carry any of the tables
        pools.add(assets_def.op.pool)
    # One multi-asset (the tables share their first hour) in the one pool of mirror writers.
    assert pools == {"cdc_mirrors"}


def test_tier0_tables_have_a_multi_asset_and_a_pool_of_their_own():
    """A tier-0 table's refreshes must not queue behind the hourly tables' runs: its mirror and
    its maintenance hold `cdc_mirrors_tier0`, every other table `cdc_mirrors`."""
    from cdc_assets.config import TableSpec
    from cdc_assets.factory import build_mirror_assets
    from cdc_assets.maintenance import build_maintenance_asset
    from checks.table_checks import MIRROR_CHECKS

    def spec(name, refresh=None):
        return TableSpec(
            name=name,
            topic=f"shop.public.{name}",
            primary_key=("id",),
            columns={"id": "bigint"},
            start_hour="2026-11-01-00:00",
            refresh_minutes=refresh,
        )

    specs = [spec("a"), spec("b"), spec("c", 15), spec("d", 5)]
    assets = build_mirror_assets(specs, checks=MIRROR_CHECKS)
    groups = {a.op.name: ({k.to_user_string() for k in a.keys}, a.op.pool) for a in assets}
    assert groups == {
        "mirrors": ({"a", "b"}, "cdc_mirrors"),
        "mirrors_tier0": ({"c", "d"}, "cdc_mirrors_tier0"),
    }
    assert build_maintenance_asset(specs[2]).op.pool == "cdc_mirrors_tier0"
    assert build_maintenance_asset(specs[0]).op.pool == "cdc_mirrors"


def test_each_table_has_a_maintenance_asset_in_its_pool_on_a_daily_schedule_that_is_off():
    definitions = defs() if callable(defs) else defs
    graph = definitions.resolve_asset_graph()
    for table in ("customers", "orders", "order_items"):
        key = dg.AssetKey(f"{table}_maintenance")
        node = graph.get(key)
        assert node.partitions_def is None and node.group_name == "cdc_maintenance"
        assert node.parent_keys == {dg.AssetKey(table)}
        assets_def = definitions.get_assets_def(key)
        # The mirrors' pool: maintenance never runs beside a MERGE into the same table.
        assert assets_def.op.pool == "cdc_mirrors"
        assert {"spark", "lake"} <= assets_def.required_resource_keys
    job = definitions.resolve_job_def(MAINTENANCE_JOB)
    assert {node.name for node in job.nodes_in_topological_order} == {
        "customers_maintenance",
        "orders_maintenance",
        "order_items_maintenance",
    }
    assert job.executor_def is dg.in_process_executor  # one Spark session for every table
    schedule = definitions.resolve_schedule_def(MAINTENANCE_SCHEDULE)
    assert schedule.job_name == MAINTENANCE_JOB
    assert (schedule.cron_schedule, schedule.execution_timezone) == ("0 3 * * *", "UTC")
    assert schedule.default_status == dg.DefaultScheduleStatus.STOPPED
    assert [s.name for s in definitions.schedules] == [MAINTENANCE_SCHEDULE, DAILY_CHECKS_SCHEDULE]


def test_each_table_is_judged_whole_by_daily_checks_on_a_schedule_that_is_on():
    """The checks that scan a whole table (checks/daily.py) are not partitioned and never block;
    their job materializes nothing; its schedule runs after maintenance's, on by default. A
    history table's check holds the table's pool (it reads the mirror and the history)."""
    from cdc_assets.config import TableSpec
    from code_location.definitions import build_definitions

    definitions = defs() if callable(defs) else defs
    graph = definitions.resolve_asset_graph()
    for table in ("customers", "orders", "order_items"):
        key = dg.AssetCheckKey(dg.AssetKey(table), "primary_key_unique_table")
        spec = graph.get_check_spec(key)
        assert spec.partitions_def is None and not spec.blocking
    job = definitions.resolve_job_def(DAILY_CHECKS_JOB)
    assert job.partitions_def is None and job.executor_def is dg.in_process_executor
    assert {node.name for node in job.nodes_in_topological_order} == {
        "customers_primary_key_unique_table",
        "orders_primary_key_unique_table",
        "order_items_primary_key_unique_table",
    }
    schedule = definitions.resolve_schedule_def(DAILY_CHECKS_SCHEDULE)
    assert schedule.job_name == DAILY_CHECKS_JOB
    assert (schedule.cron_schedule, schedule.execution_timezone) == ("0 4 * * *", "UTC")
    assert schedule.default_status == dg.DefaultScheduleStatus.RUNNING

    tier0 = TableSpec(
        name="plans",
        topic="shop.public.plans",
        primary_key=("id",),
        columns={"id": "bigint"},
        start_hour="2026-11-01-00:00",
        history=True,
        refresh_minutes=15,
    )
    job = build_definitions([tier0]).resolve_job_def(DAILY_CHECKS_JOB)
    pools = {node.name: node.definition.pool for node in job.nodes_in_topological_order}
    assert pools == {
        "plans_primary_key_unique_table": None,
        "plans_history_table": "cdc_mirrors_tier0",
    }


def test_the_sensors_are_on_by_default(monkeypatch):
    monkeypatch.delenv(SENSOR_INTERVAL_ENV, raising=False)
    definitions = defs() if callable(defs) else defs
    sensors = {s.name: s for s in definitions.sensors}
    # One offset sensor for every table.
    assert set(sensors) == {"cdc_offsets", "shop_analytics_automation"}
    assert all(s.default_status == dg.DefaultSensorStatus.RUNNING for s in sensors.values())
    assert sensors["cdc_offsets"].minimum_interval_seconds == 30


def test_the_demo_instance_limits_each_table_to_one_run_and_retries_dead_runs(tmp_path):
    """deploy/local/dagster.yaml, the instance `dagster dev` runs the demo on (SQLite). The
    production file is proven by the end-to-end test, which runs on it."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text(
        (Path(__file__).resolve().parents[1] / "deploy" / "local" / "dagster.yaml").read_text()
    )
    instance = dg.DagsterInstance.from_config(str(home))
    try:
        concurrency = instance.get_concurrency_config()
        assert concurrency.pool_config.default_pool_limit == 1  # one mirror writer at a time
        assert concurrency.run_queue_config.max_concurrent_runs == 2
        assert type(instance.run_storage).__name__ == "SqliteRunStorage"
        assert instance.run_retries_enabled and instance.run_retries_max_retries == 2
        assert instance.run_monitoring_enabled
    finally:
        instance.dispose()


def test_the_sensor_interval_comes_from_the_environment_and_a_bad_one_names_the_fix(monkeypatch):
    monkeypatch.setenv(SENSOR_INTERVAL_ENV, "5")
    built = defs() if callable(defs) else defs
    intervals = {s.name: s.minimum_interval_seconds for s in built.sensors}
    assert intervals == {"cdc_offsets": 5, "shop_analytics_automation": 5}
    assert sensor_interval_seconds({}) == 30
    for bad in ("0", "-3", "1.5", "soon", "²"):
        with pytest.raises(SensorSettingError, match=rf"{SENSOR_INTERVAL_ENV}='{bad}'.*unset it"):
            sensor_interval_seconds({SENSOR_INTERVAL_ENV: bad})


def test_the_tables_per_run_of_the_offset_sensor_come_from_the_environment():
    assert sensor_tables_per_run({}) is None  # every table whose same hours closed, one run
    assert sensor_tables_per_run({TABLES_PER_RUN_ENV: " 25 "}) == 25
    for bad in ("0", "many", "2.5"):
        with pytest.raises(SensorSettingError, match=rf"{TABLES_PER_RUN_ENV}='{bad}'.*unset it"):
            sensor_tables_per_run({TABLES_PER_RUN_ENV: bad})
