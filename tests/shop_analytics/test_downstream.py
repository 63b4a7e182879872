"""order_facts and daily_sales on real mirrors: demo CDC topics → hourly mirrors → analytics.

Expected rows are computed in plain Python from the mirrors' live rows (collected to the driver)
and from the demo source database's own state, never with the code under test. Runs go through
one Dagster instance, and declarative automation is evaluated against it between runs, so one
scenario covers both what the assets compute and when automation runs them (mirror runs are
what makes these tests slow, so they are shared).
"""

import json
import shutil
from collections import defaultdict
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

import dagster as dg
import pytest
from delta.tables import DeltaTable
from pyspark.sql import functions as F

from cdc_assets.config import ExpectationSpec, TableConfigError
from cdc_assets.factory import build_mirror_assets, build_table_asset
from checks.table_checks import MIRROR_CHECKS
from shop_analytics.assets import (
    DAILY_SALES_CONDITION,
    ORDER_FACTS_CONDITION,
    build_downstream_assets,
)
from tests.support import FIRST_HOUR, demo_specs, hour_keys, mirror_rows, seed_demo

pytestmark = pytest.mark.integration

HOURS = 2
CHANGES_PER_HOUR = 60
FACT_COLUMNS = (
    "order_id",
    "customer_id",
    "customer_country",
    "customer_is_active",
    "status",
    "total",
    "ordered_at",
    "ship_date",
    "order_date",
    "item_lines",
    "item_quantity",
    "items_amount",
)
RANGE_START = "dagster/asset_partition_range_start"
RANGE_END = "dagster/asset_partition_range_end"


@pytest.fixture
def demo(broker, topic_prefix):
    specs = demo_specs(topic_prefix)
    source, _ = seed_demo(broker, specs, hours=HOURS, changes_per_hour=CHANGES_PER_HOUR)
    return specs, source, hour_keys(FIRST_HOUR, HOURS)


def _resources(kafka, spark_resource, lake):
    return {"kafka": kafka, "spark": spark_resource, "lake": lake}


def _assets(specs):
    order_facts, daily_sales = build_downstream_assets(specs)
    return build_mirror_assets(specs, checks=MIRROR_CHECKS), order_facts, daily_sales


def _metadata(result, asset: str) -> dict[str, dict]:
    """Materialization metadata of `asset` in a run, by partition key, as plain values."""
    out = {}
    for event in result.get_asset_materialization_events():
        materialization = event.event_specific_data.materialization
        if materialization.asset_key == dg.AssetKey(asset):
            out[materialization.partition] = {
                k: v.value for k, v in materialization.metadata.items()
            }
    return out


def _state(lake, specs) -> dict[str, dict]:
    return {s.name: mirror_rows(lake.table_path(s.name), s) for s in specs}


def expected_facts(state: dict[str, dict]) -> dict[int, dict]:
    """order_facts recomputed in plain Python from the three tables' live rows."""
    items_of = defaultdict(list)
    for (order_id, _), item in state["order_items"].items():
        items_of[order_id].append(item)
    facts = {}
    for (order_id,), order in state["orders"].items():
        customer = state["customers"].get((order["customer_id"],))
        items = items_of[order_id]
        facts[order_id] = {
            "order_id": order_id,
            "customer_id": order["customer_id"],
            "customer_country": customer["country"] if customer else None,
            "customer_is_active": customer["is_active"] if customer else None,
            "status": order["status"],
            "total": order["total"],
            "ordered_at": order["ordered_at"],
            "ship_date": order["ship_date"],
            "order_date": order["ordered_at"].astimezone(UTC).date(),
            "item_lines": len(items),
            "item_quantity": sum(i["quantity"] for i in items),
            "items_amount": sum((i["quantity"] * i["unit_price"] for i in items), Decimal(0)),
        }
    return facts


def actual_facts(spark, path) -> dict[int, dict]:
    frame = spark.read.format("delta").load(path)
    columns = [
        F.unix_micros(F.col(c)).alias(c) if c == "ordered_at" else F.col(c) for c in FACT_COLUMNS
    ]
    rows = {}
    for row in frame.select(*columns).collect():
        values = row.asDict()
        values["ordered_at"] = datetime(1970, 1, 1, tzinfo=UTC) + timedelta(
            microseconds=values["ordered_at"]
        )
        assert values["order_id"] not in rows, "order_facts repeats an order_id"
        rows[values["order_id"]] = values
    return rows


def expected_sales(facts: dict[int, dict], day: date) -> dict[tuple, dict]:
    groups = defaultdict(list)
    for fact in facts.values():
        if fact["order_date"] == day:
            groups[(fact["customer_country"], fact["status"])].append(fact)
    return {
        key: {
            "orders": len(rows),
            "revenue": sum((r["total"] for r in rows), Decimal(0)),
            "items": sum(r["item_quantity"] for r in rows),
            "customers": len({r["customer_id"] for r in rows}),
        }
        for key, rows in groups.items()
    }


def actual_sales(spark, path, day: date) -> dict[tuple, dict]:
    frame = spark.read.format("delta").load(path).where(F.col("day") == F.lit(day))
    return {
        (r["country"], r["status"]): {k: r[k] for k in ("orders", "revenue", "items", "customers")}
        for r in frame.collect()
    }


def versions_of_hour(spark, path, hour) -> list[int]:
    """The mirror commits whose userMetadata names `hour`, read from DESCRIBE HISTORY: the
    run's own, not those that prepared its MERGE (the table's creation: `"prepares"`)."""
    history = DeltaTable.forPath(spark, path).history().select("version", "userMetadata")
    records = [(r["version"], json.loads(r["userMetadata"] or "{}")) for r in history.collect()]
    return sorted(v for v, meta in records if meta.get("hour") == hour and "prepares" not in meta)


def affected_orders(spark, lake, hour) -> set[int]:
    """Orders touched by the mirror rows that `hour` last wrote (tombstones included)."""

    def written(table, *columns):
        frame = spark.read.format("delta").load(lake.table_path(table))
        return frame.where(F.col("_cdc_hour") == hour).select(*columns).collect()

    customers = {r["customer_id"] for r in written("customers", "customer_id")}
    orders = spark.read.format("delta").load(lake.table_path("orders")).where("NOT _cdc_deleted")
    return (
        {r["order_id"] for r in written("orders", "order_id")}
        | {r["order_id"] for r in written("order_items", "order_id")}
        | {r["order_id"] for r in orders.collect() if r["customer_id"] in customers}
    )


def _run_daily_sales(daily_sales, day, facts, *, spark, lake, resources, instance):
    """Materializes `day` of daily_sales and compares it with `facts` aggregated in Python."""
    result = dg.materialize(
        [daily_sales], partition_key=day.isoformat(), resources=resources, instance=instance
    )
    meta = _metadata(result, "daily_sales")[day.isoformat()]
    expected = expected_sales(facts, day)
    assert actual_sales(spark, lake.table_path("daily_sales"), day) == expected
    assert meta["orders"] == sum(g["orders"] for g in expected.values())
    assert meta["rows"] == len(expected) and meta["day_ended"] is True
    assert meta["revenue"] == pytest.approx(float(sum(g["revenue"] for g in expected.values())))
    return expected


def _with_status_check(specs, *statuses):
    """The specs, the orders mirror with one blocking expectation: status in `statuses`."""
    expectation = ExpectationSpec(
        column="status", expect="in_set", values=statuses, severity="ERROR", blocking=True
    )
    return [
        s.model_copy(update={"expectations": (expectation,)}) if s.name == "orders" else s
        for s in specs
    ]


def test_facts_follow_the_mirrors_and_wait_for_blocking_checks(
    demo, kafka, spark, spark_resource, lake, tmp_path
):
    """Hour 0 is clean; hour 1 fails a blocking check of the orders mirror, is held back, then
    fixed and caught up; every step is compared with a plain recomputation.

    The orders mirror gets a blocking `status in_set` expectation: allowing only 'pending' the
    demo data fails it, allowing every status it passes. Both variants are the same check
    (orders/status_in_set, blocking), so one Definitions judges the instance's results.
    """
    specs, source, (hour0, hour1) = demo
    day = FIRST_HOUR.date()
    strict_mirrors, order_facts, daily_sales = _assets(_with_status_check(specs, "pending"))
    mirrors, _, _ = _assets(_with_status_check(specs, "pending", "paid", "shipped", "cancelled"))
    resources = _resources(kafka, spark_resource, lake)
    defs = dg.Definitions(assets=[*mirrors, order_facts, daily_sales], resources=resources)
    assert order_facts.automation_conditions_by_key[order_facts.key] == ORDER_FACTS_CONDITION
    assert daily_sales.automation_conditions_by_key[daily_sales.key] == DAILY_SALES_CONDITION
    facts_path = lake.table_path("order_facts")
    sales_path = lake.table_path("daily_sales")

    with dg.instance_for_test() as instance:
        cursor = None

        def tick() -> dict[str, set]:
            """One automation evaluation: the partitions requested per asset."""
            nonlocal cursor
            result = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=cursor)
            cursor = result.cursor
            return {
                name: result.get_requested_partitions(dg.AssetKey(name))
                for name in ("order_facts", "daily_sales")
            }

        def materialize(assets, key, **kwargs):
            return dg.materialize(
                assets, partition_key=key, resources=resources, instance=instance, **kwargs
            )

        nothing = {"order_facts": set(), "daily_sales": set()}
        daily = {"spark": spark, "lake": lake, "resources": resources, "instance": instance}
        assert tick() == nothing

        # Hour 0: its mirrors land with their checks passed, and automation requests its facts.
        assert all(c.passed for c in materialize(mirrors, hour0).get_asset_check_evaluations())
        assert tick() == {"order_facts": {hour0}, "daily_sales": set()}
        meta = _metadata(materialize([order_facts], hour0), "order_facts")[hour0]
        state = _state(lake, specs)
        assert actual_facts(spark, facts_path) == expected_facts(state)
        # The facts read exactly the mirror commits of hour 0, whose keys are the rows it wrote,
        # and recomputed the orders those rows touch, from the mirrors' current versions.
        for spec in specs:
            path = lake.table_path(spec.name)
            assert meta["upstream_versions"][spec.name] == versions_of_hour(spark, path, hour0)
            assert meta["upstream_versions"][spec.name]
            current = DeltaTable.forPath(spark, path).history(1).first()["version"]
            assert meta["upstream_snapshots"][spec.name] == current
            written = spark.read.format("delta").load(path).where(F.col("_cdc_hour") == hour0)
            assert meta[f"changed_keys_{spec.name}"] == written.count()
        assert meta["orders_recomputed"] == len(affected_orders(spark, lake, hour0))
        assert meta["facts_upserted"] > 0

        # (i) Hour 1's mirrors and facts in one run: the failed blocking check stops the facts.
        failing = materialize([*strict_mirrors, order_facts], hour1, raise_on_error=False)
        assert not failing.success  # Dagster fails the step whose blocking check failed
        failed = [
            (c.asset_key.path[-1], c.check_name)
            for c in failing.get_asset_check_evaluations()
            if not c.passed
        ]
        assert failed == [("orders", "status_in_set")]
        assert set(_metadata(failing, "orders")) == {hour1}
        assert _metadata(failing, "order_facts") == {}

        # (ii) Across runs: automation holds hour 1's facts back; hour 0's day goes ahead.
        assert tick() == {"order_facts": set(), "daily_sales": {day.isoformat()}}
        assert _run_daily_sales(daily_sales, day, expected_facts(state), **daily)

        # Only the orders mirror of hour 1 runs again, its checks passing: the check alone held
        # the facts back, and they catch up now, reading both of hour 1's orders commits (the
        # failed run's MERGE and the rerun's ledger commit).
        orders_only = materialize(mirrors, hour1, selection=dg.AssetSelection.assets("orders"))
        assert all(c.passed for c in orders_only.get_asset_check_evaluations())
        assert tick() == {"order_facts": {hour1}, "daily_sales": set()}
        meta = _metadata(materialize([order_facts], hour1), "order_facts")[hour1]
        orders_commits = versions_of_hour(spark, lake.table_path("orders"), hour1)
        assert meta["upstream_versions"]["orders"] == orders_commits
        assert len(orders_commits) == 2
        assert meta["facts_deleted"] > 0  # an order with a fact row was deleted, and its row
        truth = expected_facts({s.name: source.state(s.name) for s in specs})
        assert actual_facts(spark, facts_path) == expected_facts(_state(lake, specs))
        assert actual_facts(spark, facts_path) == truth
        assert all(f["total"] == f["items_amount"] for f in truth.values())

        # The day is requested again and its rows are replaced, not added to.
        assert tick() == {"order_facts": set(), "daily_sales": {day.isoformat()}}
        assert _run_daily_sales(daily_sales, day, truth, **daily)
        assert tick() == nothing

        # Convergence: from scratch, the later hour first, then both hours in one backfill run
        # (a range, in order): hour 1 again changes nothing.
        shutil.rmtree(tmp_path / "lake" / "order_facts")
        assert materialize([order_facts], hour1).success
        backfill = dg.materialize(
            [order_facts],
            resources=resources,
            instance=instance,
            tags={RANGE_START: hour0, RANGE_END: hour1},
        )
        per_hour = _metadata(backfill, "order_facts")
        assert sorted(per_hour) == [hour0, hour1]
        assert per_hour[hour0]["facts_upserted"] > 0
        assert per_hour[hour1]["orders_recomputed"] > 0
        assert per_hour[hour1]["facts_upserted"] == per_hour[hour1]["facts_deleted"] == 0
        assert per_hour[hour1]["delta_version"] == per_hour[hour0]["delta_version"]
        assert actual_facts(spark, facts_path) == truth

        # Another day's run leaves the hours' day alone.
        earlier = day - timedelta(days=1)
        _run_daily_sales(daily_sales, earlier, truth, **daily)
        assert actual_sales(spark, sales_path, day) == expected_sales(truth, day)
        assert spark.read.format("delta").load(sales_path).count() == sum(
            len(expected_sales(truth, d)) for d in (earlier, day)
        )


def test_built_over_the_shop_tables_and_a_missing_one_is_named(topic_prefix):
    specs = demo_specs(topic_prefix)
    with pytest.raises(TableConfigError, match="table 'customers' is missing.*Fix the tables"):
        build_downstream_assets([s for s in specs if s.name != "customers"])
    order_facts, daily_sales = build_downstream_assets(specs)
    for asset in (order_facts, daily_sales):
        assert asset.group_names_by_key[asset.key] == "shop_analytics"
        assert asset.op.pool == f"downstream_{asset.key.path[-1]}"
        assert set(asset.specs_by_key[asset.key].kinds) == {"spark", "delta"}
    orders = next(s for s in specs if s.name == "orders")
    assert (
        order_facts.partitions_def
        == build_table_asset(checks=MIRROR_CHECKS, spec=orders).partitions_def
    )
    broken = [
        s.model_copy(update={"columns": {k: v for k, v in s.columns.items() if k != "country"}})
        if s.name == "customers"
        else s
        for s in specs
    ]
    with pytest.raises(ValueError, match="table 'customers' has no column 'country'"):
        build_downstream_assets(broken)
