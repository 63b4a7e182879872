"""The maintenance asset on a real mirror: OPTIMIZE and VACUUM change files, never rows.

One mirror for the module: the demo's `order_items` (a two-column key, and malformed records,
so its error table exists) over a few hours, each hour its own `run_hour` MERGE and so its own
small files. What is on disk is compared with what Delta's log says the table holds.
"""

import uuid
from fractions import Fraction
from pathlib import Path
from urllib.parse import unquote, urlparse

import dagster as dg
import pytest
from delta.tables import DeltaTable
from pyspark.errors import AnalysisException
from pyspark.sql import functions as F

from cdc_assets.commits import change_feed
from cdc_assets.hour_run import run_hour
from cdc_assets.maintenance import (
    RETENTION_PROPERTY,
    build_maintenance_asset,
    interval_hours,
    maintenance_asset_name,
)
from checks.table_checks import MIRROR_CHECKS
from resources.lake import LakeResource
from tests.support import FIRST_HOUR, demo_specs, hour_keys, seed_demo

pytestmark = pytest.mark.integration

HOURS = 3
CHANGES_PER_HOUR = 60  # enough for the demo to send malformed records every hour


@pytest.fixture(scope="module")
def mirror(broker, kafka, spark, tmp_path_factory):
    """(spec, lake): order_items mirrored hour by hour, HOURS MERGEs of small files, each
    writing deletion vectors as a large mirror's MERGE does (`deletion_vectors_from_bytes: 0`;
    a small mirror's rewrite the file they touch)."""
    specs = demo_specs(f"maint{uuid.uuid4().hex[:8]}")
    seed_demo(broker, specs, hours=HOURS, changes_per_hour=CHANGES_PER_HOUR)
    spec = next(s for s in specs if s.name == "order_items")
    spec = spec.model_copy(update={"deletion_vectors_from_bytes": 0})
    lake = LakeResource(root=str(tmp_path_factory.mktemp("maintenance") / "lake"))
    for key in hour_keys(FIRST_HOUR, HOURS):
        run_hour(checks=MIRROR_CHECKS, spark=spark, kafka=kafka, lake=lake, spec=spec, hour_key=key)
    return spec, lake


def _materialize(spec, spark_resource, lake, **config):
    return dg.materialize(
        [build_maintenance_asset(spec)],
        resources={"spark": spark_resource, "lake": lake},
        run_config={"ops": {maintenance_asset_name(spec): {"config": config}}},
        raise_on_error=False,
    )


def _metadata(result) -> dict:
    (materialization,) = [
        e.event_specific_data.materialization for e in result.get_asset_materialization_events()
    ]
    return {name: value.value for name, value in materialization.metadata.items()}


def _contents(spark, path: str) -> list[str]:
    """Every row of the table, every column, in a stable order."""
    return sorted(repr(row) for row in spark.read.format("delta").load(path).collect())


def _on_disk(path: str, *, directories: bool = False) -> set[str]:
    """The table's files (and, asked, folders) outside its log; Hadoop's .crc files aside."""
    root = Path(path)
    return {
        str(f.relative_to(root))
        for f in root.rglob("*")
        if (f.is_file() or (directories and f.is_dir()))
        and "_delta_log" not in f.relative_to(root).parts
        and not f.name.startswith(".")
    }


def _vacuumed(before: set[str], path: str, spark) -> int:
    """Files and folders gone since `before`, counting the files added meanwhile."""
    after = _on_disk(path, directories=True)
    added = _referenced(spark, path) - before
    return len((before | added) - after)


def _referenced(spark, path: str) -> set[str]:
    """The data files of the table's current version, relative to the table."""
    root = Path(path).resolve()
    return {
        str(Path(unquote(urlparse(f).path)).relative_to(root))
        for f in spark.read.format("delta").load(path).inputFiles()
    }


def _set_retention(spark, path: str, value: str) -> None:
    spark.sql(f"ALTER TABLE delta.`{path}` SET TBLPROPERTIES ('{RETENTION_PROPERTY}' = '{value}')")


def _failure_messages(result) -> list[str]:
    error, messages = result.get_step_failure_events()[0].step_failure_data.error, []
    while error is not None:
        messages.append(error.message)
        error = error.cause
    return messages


@pytest.mark.parametrize(
    ("value", "hours"),
    [
        ("interval 1 week", 168),
        ("interval 7 days", 168),
        ("interval 0 hours", 0),
        ("INTERVAL 36 HOURS 30 MINUTES", Fraction(73, 2)),
        ("2 days 1 hour", 49),
    ],
)
def test_retention_settings_read_in_hours(value, hours):
    assert interval_hours(value) == hours


@pytest.mark.parametrize("value", ["interval 1 month", "a week", "interval", "7"])
def test_a_retention_setting_that_is_not_an_interval_is_refused(value):
    with pytest.raises(ValueError, match="is not an interval"):
        interval_hours(value)


def test_a_retention_below_the_tables_fails_naming_the_fix_and_changes_nothing(
    mirror, spark, spark_resource
):
    spec, lake = mirror
    path = lake.table_path(spec.name)
    _set_retention(spark, path, "interval 48 hours")
    version = DeltaTable.forPath(spark, path).history(1).first()["version"]
    files = _on_disk(path)

    result = _materialize(spec, spark_resource, lake, retain_hours=24)

    assert not result.success
    message = "\n".join(_failure_messages(result))
    assert f"table '{spec.name}'" in message and path in message
    assert f"retain_hours 24 is below the table's {RETENTION_PROPERTY}" in message
    assert "'interval 48 hours', 48 hours" in message
    assert "retain_hours of at least 48" in message
    assert f"SET TBLPROPERTIES ('{RETENTION_PROPERTY}' = 'interval 24 hours')" in message
    # Refused before anything ran: no OPTIMIZE, no VACUUM, not a file touched.
    assert DeltaTable.forPath(spark, path).history(1).first()["version"] == version
    assert _on_disk(path) == files


def test_maintenance_compacts_and_vacuums_without_changing_a_row(mirror, spark, spark_resource):
    spec, lake = mirror
    paths = {"": lake.table_path(spec.name), "error_table_": lake.table_path(spec.error_table_name)}
    contents = {prefix: _contents(spark, path) for prefix, path in paths.items()}
    on_disk = {prefix: _on_disk(path, directories=True) for prefix, path in paths.items()}
    referenced = {prefix: _referenced(spark, path) for prefix, path in paths.items()}
    assert len(referenced[""]) >= HOURS, "each hour's MERGE leaves files of its own"
    assert contents["error_table_"], "the demo sends malformed records every hour"
    first_merge = (
        DeltaTable.forPath(spark, paths[""])
        .history()
        .where(F.col("operation") == "MERGE")
        .agg(F.min("version"))
        .first()[0]
    )
    # A retention the tables allow: VACUUM may delete every file the current version doesn't
    # need. Delta's retention check stays on.
    for path in paths.values():
        _set_retention(spark, path, "interval 0 hours")

    result = _materialize(spec, spark_resource, lake, retain_hours=0)

    assert result.success
    metadata = _metadata(result)
    assert metadata["table_exists"] and metadata["error_table_exists"]
    assert metadata["retain_hours"] == 0 and metadata["zorder"] is True
    for prefix, path in paths.items():
        m = {key.removeprefix(prefix): value for key, value in metadata.items()}
        # Not a row changed, in any column.
        assert _contents(spark, path) == contents[prefix], prefix
        # Fewer files: Z-ordering rewrote every file of the table into one.
        assert m["files_before"] == len(referenced[prefix])
        assert m["files_removed"] == m["files_before"] and m["files_added"] == 1
        assert m["files_after"] == m["files_before"] - m["files_removed"] + m["files_added"]
        assert m["files_after"] < m["files_before"]
        # What the metadata says is what Delta's log says.
        table = DeltaTable.forPath(spark, path)
        detail = table.detail().first()
        assert (m["files_after"], m["bytes_after"]) == (detail["numFiles"], detail["sizeInBytes"])
        history = {row["version"]: row for row in table.history().collect()}
        optimize = history[m["optimize_version"]]
        assert optimize["operation"] == "OPTIMIZE"
        assert optimize["operationParameters"]["zOrderBy"].count('"') == 4  # two key columns
        metrics = {k: int(v) for k, v in optimize["operationMetrics"].items()}
        assert metrics["numAddedFiles"] == m["files_added"]
        assert metrics["numRemovedFiles"] == m["files_removed"]
        assert metrics["numRemovedBytes"] == m["bytes_before"]
        assert metrics["numAddedBytes"] == m["bytes_after"]
        vacuum_end = history[m["delta_version"]]
        assert vacuum_end["operation"] == "VACUUM END"
        assert int(vacuum_end["operationMetrics"]["numDeletedFiles"]) == m["files_vacuumed"]
        assert m["retain_hours_effective"] == 0
        # VACUUM deleted every file the current version doesn't reference (replaced data files,
        # change-data files, deletion vectors), and only those.
        assert _on_disk(path) == _referenced(spark, path)
        assert m["files_vacuumed"] == _vacuumed(on_disk[prefix], path, spark)
        if prefix == "":  # the MERGEs' deletion vectors and change-data files went too
            assert m["files_vacuumed"] > m["files_removed"]
        assert m["bytes_vacuumed"] > 0

    # What order_facts would meet: a mirror commit older than the retention has no change feed.
    with pytest.raises(AnalysisException, match="BEYOND_DELETED_FILE_RETENTION_DURATION"):
        change_feed(spark, paths[""], first_merge).count()

    # A retain_hours above the table's retention: Delta vacuums by the table's setting (here 0)
    # and the metadata says so. Z-ordering rewrites even a table that is one file.
    before = _on_disk(paths[""], directories=True)
    again = _materialize(spec, spark_resource, lake, retain_hours=1)
    assert again.success
    m = _metadata(again)
    assert m["retain_hours"] == 1 and m["retain_hours_effective"] == 0
    assert m["files_before"] == m["files_removed"] == m["files_added"] == m["files_after"] == 1
    assert m["files_vacuumed"] == _vacuumed(before, paths[""], spark) >= 1  # the replaced file
    assert _contents(spark, paths[""]) == contents[""]
    assert _on_disk(paths[""]) == _referenced(spark, paths[""])


def test_a_table_never_written_is_left_alone(spark_resource, tmp_path):
    spec = next(s for s in demo_specs("unused") if s.name == "order_items")
    lake = LakeResource(root=str(tmp_path / "empty"))

    result = _materialize(spec, spark_resource, lake)

    assert result.success
    metadata = _metadata(result)
    assert metadata["table_exists"] is False and metadata["error_table_exists"] is False
    assert not (tmp_path / "empty").exists()


def test_vacuum_lists_with_one_task_per_core_unless_configured(spark):
    from cdc_assets.maintenance import (
        LISTING_PARALLELISM_CONF,
        VACUUM_LOGGING_CONF,
        vacuum_settings,
    )

    cores = spark.sparkContext.defaultParallelism
    assert vacuum_settings(spark, None) == {
        VACUUM_LOGGING_CONF: "true",
        LISTING_PARALLELISM_CONF: str(cores),
    }
    assert vacuum_settings(spark, 64)[LISTING_PARALLELISM_CONF] == "64"
