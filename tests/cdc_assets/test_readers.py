"""Reading the mirrors without Spark, as docs/reading.md shows: deltalake's query engine
(DataFusion) and polars read a mirror with deletion vectors, and a table with
`deletion_vectors: false` also reads through deltalake's pyarrow dataset, which refuses them.

Each mirror is built by the real pipeline (demo topics on the real broker, the mirrors'
multi-asset on the real Spark session and Delta), with updates and deletes in every hour, so
the MERGEs leave deletion vectors; each reader's live rows must equal Spark's, row for row.
A mirror whose stored setting differs from its table's fails the run naming the table, the
setting and the fix, and the fix it names works. `customers` keeps its history there, and
docs/reading.md's as-of and per-key queries give, through polars and deltalake, the rows Spark
gives (`cdc_assets.history.as_of`); as of now, the mirror's live rows.
"""

from __future__ import annotations

import json
import re
import uuid
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

import dagster as dg
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from deltalake import DeltaTable, QueryBuilder

from cdc_assets.commits import live_rows
from cdc_assets.factory import build_mirror_assets
from checks.table_checks import MIRROR_CHECKS
from resources.lake import LakeResource
from tests.support import FIRST_HOUR, demo_specs, hour_keys, seed_demo

pytestmark = pytest.mark.integration

HOURS = 2


@pytest.fixture(scope="module")
def demo(broker):
    specs = demo_specs(f"readers{uuid.uuid4().hex[:8]}")
    seed_demo(broker, specs, hours=HOURS, changes_per_hour=80)
    return specs, hour_keys(FIRST_HOUR, HOURS)


def _run(specs, keys, *, kafka, spark_resource, lake, raise_on_error=True):
    results = []
    for key in keys:
        results.append(
            dg.materialize(
                build_mirror_assets(specs, checks=MIRROR_CHECKS),
                partition_key=key,
                resources={"kafka": kafka, "spark": spark_resource, "lake": lake},
                raise_on_error=raise_on_error,
            )
        )
    return results


def _rows(table: pa.Table, key: tuple[str, ...]) -> list[dict]:
    """Rows sorted by primary key, each value as Python compares it across engines."""

    def value(v):
        if isinstance(v, datetime) and v.tzinfo is None:
            return v.replace(tzinfo=UTC)  # Spark's session time zone is UTC
        if isinstance(v, Decimal):
            return v.normalize()
        return v

    rows = [{name: value(v) for name, v in row.items()} for row in table.to_pylist()]
    return sorted(rows, key=lambda row: tuple(row[k] for k in key))


def _spark_live(spark, path: str) -> pa.Table:
    return live_rows(spark, path).toArrow()


def _deletion_vectors_in_log(path: str) -> int:
    count = 0
    for commit in sorted(Path(path, "_delta_log").glob("*.json")):
        for line in commit.read_text().splitlines():
            add = json.loads(line).get("add")
            count += bool(add and add.get("deletionVector"))
    return count


@pytest.fixture(scope="module")
def with_dvs(demo, kafka, spark_resource, spark, tmp_path_factory):
    """The demo hours into mirrors with deletion vectors (the default), written from the first
    MERGE on (small mirrors rewrite files instead unless `deletion_vectors_from_bytes: 0`)."""
    specs, keys = demo
    specs = [
        s.model_copy(update={"deletion_vectors_from_bytes": 0, "history": s.name == "customers"})
        for s in specs
    ]
    lake = LakeResource(root=str(tmp_path_factory.mktemp("dv") / "lake"))
    assert all(
        r.success for r in _run(specs, keys, kafka=kafka, spark_resource=spark_resource, lake=lake)
    )
    return lake


def test_deltalake_and_polars_read_live_rows_of_a_mirror_with_deletion_vectors(
    demo, with_dvs, spark
):
    specs, _ = demo
    dv_tables = 0
    for spec in specs:
        path = with_dvs.table_path(spec.name)
        dv_tables += _deletion_vectors_in_log(path) > 0
        expected = _rows(_spark_live(spark, path), spec.primary_key)
        assert expected, spec.name

        # deltalake's pyarrow reader refuses the table: the reason this page exists.
        with pytest.raises(Exception, match="deletionVectors"):
            DeltaTable(path).to_pyarrow_dataset()

        # As docs/reading.md: deltalake's DataFusion engine applies the deletion vectors.
        live = (
            QueryBuilder()
            .register("mirror", DeltaTable(path))
            .execute("SELECT * FROM mirror WHERE NOT _cdc_deleted")
        )
        assert _rows(pa.table(live), spec.primary_key) == expected, spec.name

        # polars' Delta reader too.
        frame = pl.scan_delta(path).filter(~pl.col("_cdc_deleted")).collect()
        assert _rows(frame.to_arrow(), spec.primary_key) == expected, spec.name
    # Updates and deletes were marked in deletion vectors, so the readers had to apply them.
    assert dv_tables == len(specs)


def test_the_history_reads_as_of_a_moment_as_docs_reading_shows(demo, with_dvs, spark):
    from pyspark.sql import functions as F

    from cdc_assets.history import as_of

    specs, _ = demo
    (spec,) = [s for s in specs if s.name == "customers"]
    path = with_dvs.table_path("customers__history")
    versions = spark.read.format("delta").load(path)
    assert versions.where("NOT _cdc_current").count() > 0  # keys with more than one version
    starts = sorted({r[0] for r in versions.select("_cdc_valid_from").collect()})
    moment = starts[len(starts) // 2].replace(tzinfo=UTC)  # Spark's session time zone is UTC
    naive = moment.replace(tzinfo=None)
    columns = [*spec.columns]
    expected = _rows(
        as_of(versions, F.lit(naive).cast("timestamp")).select(*columns).toArrow(),
        spec.primary_key,
    )
    assert expected

    # As docs/reading.md: polars, the table as it was at `moment`, and one key's versions.
    history = pl.scan_delta(path)
    frame = history.filter(
        (pl.col("_cdc_valid_from") <= moment)
        & (pl.col("_cdc_valid_to").is_null() | (pl.col("_cdc_valid_to") > moment))
        & ~pl.col("_cdc_deleted")
    ).collect()
    assert _rows(frame.select(columns).to_arrow(), spec.primary_key) == expected
    key = expected[0]["customer_id"]
    one_key = history.filter(pl.col("customer_id") == key).sort("_cdc_sequence").collect()
    assert one_key["_cdc_current"].to_list()[-1] is True

    # deltalake's query engine with the page's SQL.
    at = moment.strftime("%Y-%m-%d %H:%M:%S.%f")
    sql = (
        f"SELECT {', '.join(columns)} FROM history WHERE _cdc_valid_from <= TIMESTAMP '{at}' "
        f"AND (_cdc_valid_to IS NULL OR _cdc_valid_to > TIMESTAMP '{at}') AND NOT _cdc_deleted"
    )
    table = QueryBuilder().register("history", DeltaTable(path)).execute(sql)
    assert _rows(pa.table(table), spec.primary_key) == expected

    # As of now: the mirror's live rows.
    now = F.current_timestamp()
    current = as_of(versions, now).select(*columns).toArrow()
    mirror = _spark_live(spark, with_dvs.table_path("customers")).select(columns)
    assert _rows(current, spec.primary_key) == _rows(mirror, spec.primary_key)


def test_a_mirror_without_deletion_vectors_reads_through_pyarrow_with_the_same_rows(
    demo, with_dvs, kafka, spark_resource, spark, tmp_path
):
    specs, keys = demo
    plain = [s.model_copy(update={"deletion_vectors": False}) for s in specs]
    lake = LakeResource(root=str(tmp_path / "lake"))
    assert all(
        r.success for r in _run(plain, keys, kafka=kafka, spark_resource=spark_resource, lake=lake)
    )
    for spec in plain:
        path = lake.table_path(spec.name)
        assert _deletion_vectors_in_log(path) == 0
        table = DeltaTable(path)
        assert "deletionVectors" not in (table.protocol().reader_features or [])
        assert table.protocol().min_reader_version == 1
        dataset = table.to_pyarrow_dataset()
        live = dataset.to_table(filter=~pc.field("_cdc_deleted"))
        rows = _rows(live, spec.primary_key)
        assert rows == _rows(_spark_live(spark, path), spec.primary_key)
        # The same mirror as with deletion vectors, but _cdc_ingested_at (when each ran).
        other = _rows(_spark_live(spark, with_dvs.table_path(spec.name)), spec.primary_key)
        strip = lambda rows: [{k: v for k, v in r.items() if k != "_cdc_ingested_at"} for r in rows]  # noqa: E731
        assert strip(rows) == strip(other)


def test_a_changed_setting_is_refused_naming_the_table_the_setting_and_a_fix_that_works(
    demo, kafka, spark_resource, spark, tmp_path
):
    specs, keys = demo
    orders = [s for s in specs if s.name == "orders"]
    lake = LakeResource(root=str(tmp_path / "lake"))
    assert _run(orders, keys[:1], kafka=kafka, spark_resource=spark_resource, lake=lake)[0].success
    path = lake.table_path("orders")

    turned_off = [orders[0].model_copy(update={"deletion_vectors": False})]
    (refused,) = _run(
        turned_off,
        keys[1:2],
        kafka=kafka,
        spark_resource=spark_resource,
        lake=lake,
        raise_on_error=False,
    )
    assert not refused.success
    messages = []
    for event in refused.get_step_failure_events():
        error = event.step_failure_data.error
        while error is not None:
            messages.append(error.message)
            error = error.cause
    text = "\n".join(messages)
    assert "table 'orders'" in text and "deletion_vectors is false" in text, text
    # The hour wrote nothing to the mirror.
    assert DeltaTable(path).version() == _version_after_first_hour(path)

    # The fix the message names, run as it says, lets the hour run.
    fix = re.search(r"(ALTER TABLE delta\.`.*?` DROP FEATURE deletionVectors)", text)
    assert fix, text
    spark.sql(fix.group(1))
    (done,) = _run(turned_off, keys[1:2], kafka=kafka, spark_resource=spark_resource, lake=lake)
    assert done.success
    assert DeltaTable(path).protocol().min_reader_version == 1
    rows = DeltaTable(path).to_pyarrow_dataset().to_table(filter=~pc.field("_cdc_deleted"))
    assert _rows(rows, ("order_id",)) == _rows(_spark_live(spark, path), ("order_id",))


def _version_after_first_hour(path: str) -> int:
    """The newest version whose commit a pipeline run made (its metadata records a slice)."""
    newest = -1
    for commit in sorted(Path(path, "_delta_log").glob("*.json")):
        for line in commit.read_text().splitlines():
            info = json.loads(line).get("commitInfo")
            if info and "slice" in (info.get("userMetadata") or ""):
                newest = int(commit.stem)
    return newest
