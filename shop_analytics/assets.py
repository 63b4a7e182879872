"""The shop's analytics on top of the demo mirrors: `order_facts` (hourly) and `daily_sales`.

`build_downstream_assets(specs)` builds both. `order_facts` holds one row per live order: the
order, its customer's country and activity (never the e-mail or name), and the sums of its live
items. Partition H reads the change data feed of exactly the mirror commits of H (found by the
hour in their userMetadata, `commits.hour_history`), derives the affected orders, recomputes
their rows from the mirrors' current live rows and MERGEs them by order_id.

A fact row is a function of the mirrors' current state, never of the hour's change alone: that
is why the hours converge in any order, any number of times. `_facts_hour` says which partition
last changed a row.

`daily_sales` aggregates order_facts per UTC day of `ordered_at`, per country and status, and
overwrites only its day. How both run, their metadata and limits: docs/downstream.md.
"""

import functools
import warnings
from datetime import UTC, date, datetime, timedelta

import dagster as dg
from delta.tables import DeltaTable
from pyspark import StorageLevel
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from cdc_assets.columns import DELETED
from cdc_assets.commits import change_feed, commit_metadata, hour_history
from cdc_assets.config import SHOP_ANALYTICS, TableConfigError, TableSpec, spark_type
from cdc_assets.partitions import hourly_partitions
from resources.lake import LakeResource
from resources.spark import SparkResource

GROUP = "shop_analytics"
ORDER_FACTS = "order_facts"
DAILY_SALES = "daily_sales"
CUSTOMERS, ORDERS, ORDER_ITEMS = "customers", "orders", "order_items"
UPSTREAM = (CUSTOMERS, ORDERS, ORDER_ITEMS)

# The mirror columns the facts read. Customers' e-mail and name stay out of the facts.
REQUIRED_COLUMNS = {
    CUSTOMERS: ("customer_id", "country", "is_active"),
    ORDERS: ("order_id", "customer_id", "status", "total", "ordered_at", "ship_date"),
    ORDER_ITEMS: ("order_id", "quantity", "unit_price"),
}
FACTS_HOUR = "_facts_hour"
FACTS_UPDATED_AT = "_facts_updated_at"
_LIVE = "_live"
# A backfill's range of facts hours is split into runs of at most a day, run hour by hour.
FACTS_HOURS_PER_RUN = 24

# Declarative automation, evaluated by the daemon's automation sensor. Not `eager()`: it only
# looks at the latest time window, so hours that landed during an outage would never catch up.
ORDER_FACTS_CONDITION = (
    dg.AutomationCondition.any_deps_updated().since_last_handled()
    & ~dg.AutomationCondition.any_deps_missing()
    & ~dg.AutomationCondition.any_deps_in_progress()
    & ~dg.AutomationCondition.in_progress()
    & dg.AutomationCondition.all_deps_blocking_checks_passed()
)
# No ~any_deps_missing: a day is recomputed each time one of its hours lands (today included).
DAILY_SALES_CONDITION = (
    dg.AutomationCondition.any_deps_updated().since_last_handled()
    & ~dg.AutomationCondition.any_deps_in_progress()
    & ~dg.AutomationCondition.in_progress()
    & dg.AutomationCondition.all_deps_blocking_checks_passed()
)


def build_downstream_assets(specs: list[TableSpec]) -> list[dg.AssetsDefinition]:
    """`[order_facts, daily_sales]` over the shop's three tables in `specs`.

    Called only when the tables file says `shop_analytics: true` (`TablesFile`): the analytics
    are the demo's, so its configuration switches them on, and a deployment whose tables are
    merely named customers, orders and order_items gets none. Switched on, the shop's tables
    must be there as the demo declares them: `TableConfigError` otherwise, naming each table
    and setting and the fix, so the code location fails to load rather than the first run.
    """
    by_name = {spec.name: spec for spec in specs}
    problems = [f"table '{name}' is missing" for name in UPSTREAM if name not in by_name]
    problems += [
        f"table '{name}' has no column '{column}'"
        for name, columns in REQUIRED_COLUMNS.items()
        if name in by_name
        for column in columns
        if column not in by_name[name].columns
    ]
    problems += [
        f"table '{name}' has change_data_feed false (the facts read each hour's changes from"
        " its change data feed: set it true)"
        for name in UPSTREAM
        if name in by_name and not by_name[name].change_data_feed
    ]
    if problems:
        raise TableConfigError(
            f"the tables file sets {SHOP_ANALYTICS}: true, which builds {ORDER_FACTS} and "
            f"{DAILY_SALES} over the shop's tables {', '.join(UPSTREAM)}, but "
            f"{'; '.join(problems)}. Fix the tables file: declare the shop's tables as "
            f"cdc_assets/tables.yaml does, or remove '{SHOP_ANALYTICS}: true' from it."
        )
    shop = {name: by_name[name] for name in UPSTREAM}
    with warnings.catch_warnings():
        # BackfillPolicy is a beta API; dagster is pinned, so the warning says nothing new.
        warnings.filterwarnings("ignore", category=dg.BetaWarning, message=".*backfill_policy")
        order_facts = build_order_facts(shop)
        return [order_facts, build_daily_sales(shop[ORDERS], order_facts)]


# -- order_facts ----------------------------------------------------------------------------


def build_order_facts(specs: dict[str, TableSpec]) -> dg.AssetsDefinition:
    """The hourly `order_facts` asset over the customers, orders and order_items mirrors."""
    partitions_def = hourly_partitions(specs[ORDERS])

    @dg.asset(
        name=ORDER_FACTS,
        group_name=GROUP,
        partitions_def=partitions_def,
        deps=[
            dg.AssetDep(dg.AssetKey(name), partition_mapping=dg.IdentityPartitionMapping())
            for name in UPSTREAM
        ],
        automation_condition=ORDER_FACTS_CONDITION,
        backfill_policy=dg.BackfillPolicy.multi_run(max_partitions_per_run=FACTS_HOURS_PER_RUN),
        pool=f"downstream_{ORDER_FACTS}",
        kinds={"spark", "delta"},
        metadata={"primary_key": "order_id"},
    )
    def order_facts(
        context: dg.AssetExecutionContext, spark: SparkResource, lake: LakeResource
    ) -> dg.MaterializeResult:
        """One row per live order with its customer's country and its items' sums.

        Hour H reads the change data feed of the mirror versions that hour H's runs committed,
        recomputes the orders those changes touch from the mirrors' live rows and MERGEs them by
        order_id (deleting the facts of orders no longer live). Any order of hours, any number
        of runs, converges to the plain recomputation. A backfill runs its hours in order, up to
        a day of hours per run.
        """
        session = spark.session
        lake.connect(session)
        paths = {name: lake.table_path(name) for name in (*UPSTREAM, ORDER_FACTS)}
        # One snapshot of each mirror for the whole run: its live rows are read at this version.
        logs = {name: hour_history(session, paths[name]) for name in UPSTREAM}
        snapshots = {name: current for name, (current, _) in logs.items()}
        for hour in context.partition_keys:  # a backfill's range arrives in time order
            _refresh_hour(context, session, specs, paths, logs, snapshots, hour)
        return dg.MaterializeResult()

    return order_facts


def _refresh_hour(context, session, specs, paths, logs, snapshots, hour: str) -> None:
    """One hour of `order_facts`: the orders that hour's mirror commits touched, recomputed
    and MERGEd; logged, and its metadata added under the hour's partition."""
    facts_path = paths[ORDER_FACTS]
    versions = {
        name: sorted(c["version"] for c in history if c.get("hour") == hour)
        for name, (_, history) in logs.items()
    }
    outcome = refresh_order_facts(
        session,
        specs,
        {name: paths[name] for name in UPSTREAM},
        facts_path,
        hour=hour,
        versions=versions,
        snapshots=snapshots,
    )
    context.log.info(
        f"{ORDER_FACTS} {hour}: read mirror versions {versions}; changed keys "
        f"{outcome['changed_keys']}; recomputed {outcome['orders_recomputed']} orders, "
        f"upserted {outcome['facts_upserted']}, deleted {outcome['facts_deleted']}; "
        f"Delta version {outcome['delta_version']}"
    )
    context.add_asset_metadata(
        facts_metadata(outcome, versions=versions, snapshots=snapshots, path=facts_path),
        partition_key=hour,
    )


def facts_metadata(
    outcome: dict, *, versions: dict, snapshots: dict, path: str
) -> dict[str, dg.MetadataValue]:
    """One facts hour's metadata: the versions read, counts, and the facts' Delta version."""
    return {
        # The mirror commits of the hour whose change feed was read ...
        "upstream_versions": dg.MetadataValue.json(versions),
        # ... and the mirror versions whose live rows the facts were recomputed from.
        "upstream_snapshots": dg.MetadataValue.json(snapshots),
        **{
            f"changed_keys_{name}": dg.MetadataValue.int(count)
            for name, count in outcome["changed_keys"].items()
        },
        "orders_recomputed": dg.MetadataValue.int(outcome["orders_recomputed"]),
        "facts_upserted": dg.MetadataValue.int(outcome["facts_upserted"]),
        "facts_deleted": dg.MetadataValue.int(outcome["facts_deleted"]),
        "delta_version": dg.MetadataValue.int(outcome["delta_version"]),
        "delta_path": dg.MetadataValue.path(path),
    }


def refresh_order_facts(
    spark: SparkSession,
    specs: dict[str, TableSpec],
    paths: dict[str, str],
    facts_path: str,
    *,
    hour: str,
    versions: dict[str, list[int]],
    snapshots: dict[str, int | None],
) -> dict:
    """Recomputes and MERGEs the facts of the orders that `versions` of the mirrors changed.

    The facts are recomputed from the mirrors' live rows as of `snapshots` (None: the mirror
    has never been written). Returns the changed keys per mirror, the orders recomputed, the
    facts upserted and deleted and the facts table's Delta version afterwards.
    """
    live = {name: _live_rows(spark, paths[name], specs[name], snapshots[name]) for name in UPSTREAM}
    changed = _changed_keys(spark, paths, specs, versions).persist(StorageLevel.MEMORY_AND_DISK)
    affected = pending = None
    try:
        found = {r["table"]: r["count"] for r in changed.groupBy("table").count().collect()}
        counts = {name: found.get(name, 0) for name in UPSTREAM}
        of_table = F.col("table")
        customers = changed.where(of_table == CUSTOMERS).select("customer_id")
        affected = (
            changed.where(of_table.isin(ORDERS, ORDER_ITEMS))
            .select("order_id")
            .unionByName(
                live[ORDERS].join(customers, "customer_id", "left_semi").select("order_id")
            )
            .distinct()
            .persist(StorageLevel.MEMORY_AND_DISK)
        )
        source = _fact_source(live, affected, hour=hour, now=datetime.now(UTC))
        table = _ensure_facts_table(spark, facts_path, source.drop(_LIVE).schema)
        n_affected = affected.count()
        pending = _pending(table, source).persist(StorageLevel.MEMORY_AND_DISK)
        upserted = deleted = 0
        if n_affected and not pending.isEmpty():
            with commit_metadata(
                spark, {"hour": hour, "asset": ORDER_FACTS, "upstream_versions": versions}
            ):
                metrics = _merge_facts(table, pending).first()
            upserted = metrics["num_inserted_rows"] + metrics["num_updated_rows"]
            deleted = metrics["num_deleted_rows"]
    finally:
        changed.unpersist()
        for frame in (affected, pending):
            if frame is not None:
                frame.unpersist()
    return {
        "changed_keys": counts,
        "orders_recomputed": n_affected,
        "facts_upserted": upserted,
        "facts_deleted": deleted,
        "delta_version": _version(table),
    }


def _live_rows(spark: SparkSession, path: str, spec: TableSpec, version: int | None) -> DataFrame:
    """The mirror's live rows at `version`; none, typed by the spec, when it was never written."""
    columns = REQUIRED_COLUMNS[spec.name]
    if version is None:
        return spark.createDataFrame([], _ddl(spec, columns))
    # commits.live_rows at a pinned version: every read of one run sees the same snapshot.
    mirror = spark.read.format("delta").option("versionAsOf", version).load(path)
    return mirror.where(~F.col(DELETED)).select(*columns)


def _ddl(spec: TableSpec, columns: tuple[str, ...]) -> str:
    """A Spark DDL schema of `columns` as the spec types them (names are validated identifiers)."""
    return ", ".join(f"`{c}` {spark_type(spec.columns[c])}" for c in columns)


def _changed_keys(
    spark: SparkSession,
    paths: dict[str, str],
    specs: dict[str, TableSpec],
    versions: dict[str, list[int]],
) -> DataFrame:
    """The distinct keys that the mirrors' commits `versions` changed, one row per table and key.

    Columns: table, key (the primary key as JSON), order_id (orders and items), customer_id
    (customers).
    """
    frames = []
    for name in UPSTREAM:
        spec = specs[name]
        for version in versions[name]:
            feed = change_feed(spark, paths[name], version)
            frames.append(
                feed.select(
                    F.lit(name).alias("table"),
                    F.to_json(F.struct(*spec.primary_key)).alias("key"),
                    (F.col("order_id") if name != CUSTOMERS else F.lit(None))
                    .cast("bigint")
                    .alias("order_id"),
                    (F.col("customer_id") if name == CUSTOMERS else F.lit(None))
                    .cast("bigint")
                    .alias("customer_id"),
                )
            )
    if not frames:
        return spark.createDataFrame(
            [], "table string, key string, order_id bigint, customer_id bigint"
        )
    keys = frames[0]
    for frame in frames[1:]:
        keys = keys.unionByName(frame)
    return keys.distinct()


def _utc_date(column: str) -> Column:
    # From epoch seconds, so the date is UTC whatever the session's time zone.
    return F.date_from_unix_date(F.floor(F.unix_seconds(F.col(column)) / 86_400).cast("int"))


def _fact_source(
    live: dict[str, DataFrame], affected: DataFrame, *, hour: str, now: datetime
) -> DataFrame:
    """Each affected order_id with its recomputed fact row, `_live` false when it has none."""
    orders = live[ORDERS].join(affected, "order_id", "left_semi")
    customers = live[CUSTOMERS].select(
        "customer_id",
        F.col("country").alias("customer_country"),
        F.col("is_active").alias("customer_is_active"),
    )
    items = (
        live[ORDER_ITEMS]
        .join(affected, "order_id", "left_semi")
        .groupBy("order_id")
        .agg(
            F.count("*").alias("item_lines"),
            F.sum("quantity").cast("bigint").alias("item_quantity"),
            F.sum(F.col("quantity") * F.col("unit_price")).alias("items_amount"),
        )
    )
    facts = (
        orders.join(customers, "customer_id", "left")
        .join(items, "order_id", "left")
        .select(
            "order_id",
            "customer_id",
            "customer_country",
            "customer_is_active",
            "status",
            "total",
            "ordered_at",
            "ship_date",
            _utc_date("ordered_at").alias("order_date"),
            F.coalesce("item_lines", F.lit(0)).cast("bigint").alias("item_lines"),
            F.coalesce("item_quantity", F.lit(0)).cast("bigint").alias("item_quantity"),
            F.coalesce("items_amount", F.lit(0)).alias("items_amount"),
            F.lit(hour).alias(FACTS_HOUR),
            F.lit(now).cast("timestamp").alias(FACTS_UPDATED_AT),
            F.lit(True).alias(_LIVE),
        )
    )
    return affected.join(facts, "order_id", "left").withColumn(
        _LIVE, F.coalesce(F.col(_LIVE), F.lit(False))
    )


def _ensure_facts_table(spark: SparkSession, path: str, schema: T.StructType) -> DeltaTable:
    """Creates the facts table (change data feed on) the first time."""
    nullable = T.StructType([T.StructField(f.name, f.dataType, True) for f in schema.fields])
    return (
        DeltaTable.createIfNotExists(spark)
        .location(path)
        .addColumns(nullable)
        .property("delta.enableChangeDataFeed", "true")
        .execute()
    )


def _differs(columns: list[str]) -> Column:
    """True where fact row `t` and recomputed row `s` differ in a value (not the bookkeeping)."""
    same = [
        F.col(f"t.`{c}`").eqNullSafe(F.col(f"s.`{c}`"))
        for c in columns
        if c not in (FACTS_HOUR, FACTS_UPDATED_AT)
    ]
    return ~functools.reduce(lambda a, b: a & b, same)


def _pending(table: DeltaTable, source: DataFrame) -> DataFrame:
    """The recomputed rows that change the facts: new or different live rows, dead stored ones.

    An unchanged row is left out, so a rerun makes no commit and the facts' change feed holds
    only real changes.
    """
    columns = [c for c in source.columns if c != _LIVE]
    stored = F.col("t.order_id").isNotNull()
    live = F.col(f"s.`{_LIVE}`")
    return (
        source.alias("s")
        .join(table.toDF().alias("t"), F.col("s.order_id") == F.col("t.order_id"), "left")
        .where((~live & stored) | (live & (~stored | _differs(columns))))
        .select("s.*")
    )


def _merge_facts(table: DeltaTable, source: DataFrame) -> DataFrame:
    """One MERGE by order_id: insert, update where a value differs, delete when not live."""
    columns = [c for c in source.columns if c != _LIVE]
    values = {c: F.col(f"s.`{c}`") for c in columns}
    live = F.col(f"s.`{_LIVE}`")
    return (
        table.alias("t")
        .merge(source.alias("s"), F.col("t.order_id") == F.col("s.order_id"))
        .whenMatchedDelete(condition=~live)
        .whenMatchedUpdate(condition=live & _differs(columns), set=values)
        .whenNotMatchedInsert(condition=live, values=values)
        .execute()
    )


# -- daily_sales ----------------------------------------------------------------------------


def build_daily_sales(
    orders_spec: TableSpec, order_facts: dg.AssetsDefinition
) -> dg.AssetsDefinition:
    """The daily `daily_sales` asset over `order_facts`."""
    partitions_def = dg.DailyPartitionsDefinition(
        start_date=orders_spec.start_datetime.strftime("%Y-%m-%d"), timezone="UTC", end_offset=1
    )

    @dg.asset(
        name=DAILY_SALES,
        group_name=GROUP,
        partitions_def=partitions_def,
        deps=[order_facts.key],
        automation_condition=DAILY_SALES_CONDITION,
        backfill_policy=dg.BackfillPolicy.single_run(),
        pool=f"downstream_{DAILY_SALES}",
        kinds={"spark", "delta"},
        metadata={"primary_key": "day, country, status"},
    )
    def daily_sales(
        context: dg.AssetExecutionContext, spark: SparkResource, lake: LakeResource
    ) -> dg.MaterializeResult:
        """Orders, revenue, items and customers per UTC day of ordering, country and status.

        Recomputed from order_facts each time one of the day's hours lands, so today shows the
        day so far (a day does not wait for all of its hours). Figures follow order_facts as it
        is when the day runs: a later change to that day's orders shows once the day runs again.
        """
        session = spark.session
        lake.connect(session)
        facts_path = lake.table_path(ORDER_FACTS)
        path = lake.table_path(DAILY_SALES)
        for key in context.partition_keys:
            outcome = write_daily_sales(session, facts_path, path, day=date.fromisoformat(key))
            context.log.info(
                f"{DAILY_SALES} {key}: {outcome['orders']} orders in {outcome['rows']} rows; "
                f"Delta version {outcome['delta_version']}"
            )
            context.add_asset_metadata(
                {
                    "orders": dg.MetadataValue.int(outcome["orders"]),
                    "revenue": dg.MetadataValue.float(outcome["revenue"]),
                    "rows": dg.MetadataValue.int(outcome["rows"]),
                    "day_ended": dg.MetadataValue.bool(outcome["day_ended"]),
                    "order_facts_version": dg.MetadataValue.int(outcome["facts_version"]),
                    "delta_version": dg.MetadataValue.int(outcome["delta_version"]),
                    "delta_path": dg.MetadataValue.path(path),
                },
                partition_key=key,
            )
        return dg.MaterializeResult()

    return daily_sales


def daily_sales_frame(facts: DataFrame, day: date) -> DataFrame:
    """The day's sales per country and status, from order_facts rows."""
    return (
        facts.where(F.col("order_date") == F.lit(day))
        .groupBy(F.col("customer_country").alias("country"), "status")
        .agg(
            F.count("*").alias("orders"),
            F.sum("total").alias("revenue"),
            F.sum("item_quantity").alias("items"),
            F.count_distinct("customer_id").alias("customers"),
        )
        .select(
            F.lit(day).alias("day"), "country", "status", "orders", "revenue", "items", "customers"
        )
    )


def write_daily_sales(spark: SparkSession, facts_path: str, path: str, *, day: date) -> dict:
    """Overwrites `day` of the daily_sales table from the facts; returns its totals."""
    if not DeltaTable.isDeltaTable(spark, facts_path):
        raise FileNotFoundError(
            f"{DAILY_SALES} {day.isoformat()}: {ORDER_FACTS} has no Delta table at {facts_path} "
            f"yet. Materialize {ORDER_FACTS} for the day's hours first."
        )
    facts_version = _version(DeltaTable.forPath(spark, facts_path))
    # Pinned to the version just looked up, so the metadata names what was read.
    facts = spark.read.format("delta").option("versionAsOf", facts_version).load(facts_path)
    sales = daily_sales_frame(facts, day).persist(StorageLevel.MEMORY_AND_DISK)
    try:
        totals = sales.agg(
            F.count("*").alias("rows"),
            F.sum("orders").alias("orders"),
            F.sum("revenue").cast("double").alias("revenue"),
        ).first()
        table = (
            DeltaTable.createIfNotExists(spark)
            .location(path)
            .addColumns(sales.schema)
            .partitionedBy("day")
            .property("delta.enableChangeDataFeed", "true")
            .execute()
        )
        # `day` is a parsed date rendered back as ISO: the predicate holds no outside text.
        (
            sales.write.format("delta")
            .mode("overwrite")
            .option("replaceWhere", f"day = DATE'{day.isoformat()}'")
            .save(path)
        )
    finally:
        sales.unpersist()
    day_end = datetime(day.year, day.month, day.day, tzinfo=UTC) + timedelta(days=1)
    return {
        "rows": totals["rows"],
        "orders": totals["orders"] or 0,
        "revenue": totals["revenue"] or 0.0,
        "day_ended": day_end <= datetime.now(UTC),
        "facts_version": facts_version,
        "delta_version": _version(table),
    }


def _version(table: DeltaTable) -> int:
    return table.history(1).select("version").first()["version"]
