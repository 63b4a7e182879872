"""The offset-progress sensor: one for every mirrored table, launching each hour once Kafka says
it closed.

Every tick reads every watched topic at once (`sensors.topic_reads`), then decides for each
table, hour by hour from the oldest hour it still watches up to now, which hours are closed,
which to request and which have settled (`sensors.planning`, where the rules are). The tables
whose same hours closed are requested together, in one run of the mirrors' multi-asset.

The cursor (`sensors.cursor`: the oldest watched hour, and the slice requested per watched
hour) is stored by Dagster with the sensor, so it survives daemon restarts. Each tick also
records the table's consumer lag as an asset observation (`sensors.lag`).

A Kafka that does not answer fails the tick within `kafka_timeout_seconds`, naming the table and
the bootstrap servers; the cursor stays where it was, so the next tick starts over.

Tier-0 tables (`refresh_minutes`) also get a refresh of their open hours once per slot of that
many minutes, the tables due in the same hour and slot in one run tagged `cdc/refresh`, and
none while a refresh of the table is still queued or running (back-to-back refreshes would
keep the hour's final run, below them in the queue, waiting). Their
runs (refreshes and final runs) are requested apart from the hourly tables' runs: they hold
the tier-0 pool (`cdc_assets.partitions`). The run queue launches refreshes first, then the
tier-0 tables' final runs, then the hourly tables' (`dagster/priority`, `PRIORITIES`; the tick
requests them in that order, so the daemon creates them in it), and
`tables_per_run` splits the tables whose same hours closed into runs of at most that many: on
a machine that runs one mirror run at a time, a refresh then waits for one such run at most,
not for every table's hour.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping, Sequence
from datetime import UTC, datetime, timedelta

import dagster as dg

from cdc_assets.config import TableSpec
from cdc_assets.hours import hour_start
from cdc_assets.partitions import (
    REFRESH_TAG,
    SENSOR_TRIGGER,
    TIER0_POOL,
    TRIGGER_TAG,
    mirrors_pool,
)
from cdc_assets.slicing import SliceError
from checks.table_checks import run_check_names
from resources.kafka import KafkaResource
from sensors.cursor import Cursor, FleetCursor
from sensors.lag import lag_if_due
from sensors.planning import HourRange, HourState, TickPlan, plan_tick, refresh_slot
from sensors.topic_reads import TopicProgress, Watch, read_fleet_progress_within

RANGE_START_TAG = "dagster/asset_partition_range_start"
PRIORITY_TAG = "dagster/priority"
# Dagster's queue launches runs of a higher `dagster/priority` first (default 0): a refresh
# before a tier-0 table's final run before an hourly table's run.
PRIORITIES = {"refresh": 20, "tier0": 10, "hourly": 0}
RANGE_END_TAG = "dagster/asset_partition_range_end"

# The tables requested together, by their pool and the span of hours (partition keys) they run.
Together = dict[tuple[str, tuple[str, ...]], list[tuple[TableSpec, HourRange]]]
# The tier-0 tables to refresh, by open hour and `refresh_minutes` slot.
Refreshes = dict[tuple[str, str], list[TableSpec]]


def build_offset_sensor(
    *,
    specs: Sequence[TableSpec],
    name: str = "cdc_offsets",
    minimum_interval_seconds: int = 30,
    watch_hours: int = 24,
    kafka_timeout_seconds: float = 20.0,
    tables_per_run: int | None = None,
    default_status: dg.DefaultSensorStatus = dg.DefaultSensorStatus.RUNNING,
) -> dg.SensorDefinition:
    """The offset-progress sensor of every mirror in `specs` (see the module docstring).

    One tick reads every topic at once (`read_fleet_progress`) and plans each table's hours
    (`plan_tick`); the tables whose same hours closed are requested together, in one run of
    the mirrors' multi-asset, which works on them in parallel (`tables_per_run`: in runs of at
    most that many tables, by name; None: one run).
    """
    if tables_per_run is not None and tables_per_run < 1:
        raise ValueError(f"tables_per_run must be at least 1 (or None), not {tables_per_run}")

    @dg.sensor(
        name=name,
        description=(
            f"Watches the Kafka topics of {len(specs)} mirrored tables and materializes each "
            "table's hours once every partition of its topic has moved past them (or its "
            "allowed lateness passed), tables with the same hours together in one run; "
            "records each table's consumer lag as an observation."
        ),
        target=[dg.AssetKey(spec.name) for spec in specs],
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=default_status,
    )
    def _offsets(context: dg.SensorEvaluationContext, kafka: KafkaResource) -> dg.SensorResult:
        return _tick(
            context,
            kafka,
            specs,
            watch_hours=watch_hours,
            kafka_timeout_seconds=kafka_timeout_seconds,
            tables_per_run=tables_per_run,
        )

    return _offsets


def _tick(
    context: dg.SensorEvaluationContext,
    kafka: KafkaResource,
    specs: Sequence[TableSpec],
    *,
    watch_hours: int,
    kafka_timeout_seconds: float,
    tables_per_run: int | None = None,
) -> dg.SensorResult:
    """One tick: read every watched topic, plan each table's hours, request the closed ones
    (the tables whose same hours closed in one run), and leave the cursor after them."""
    now = datetime.now(UTC)
    cursor = FleetCursor.parse(context.cursor)
    watches = _watches(specs, cursor)
    progress = read_fleet_progress_within(
        kafka,
        watches,
        now=now,
        timeout_seconds=kafka_timeout_seconds,
        what=f"table {_table_names(specs)}, bootstrap servers {kafka.bootstrap_servers}",
    )
    refreshing = _refreshing(context, now) if any(spec.refresh_minutes for spec in specs) else set()
    together, waiting, events, refreshes = _plan_tables(
        context,
        specs,
        watches,
        progress,
        cursor,
        now=now,
        watch_hours=watch_hours,
        refreshing=refreshing,
    )
    runs = _split(together, tables_per_run)
    requests = [_run_request(span, tables) for _, span, tables in runs]
    requests += [_refresh_request(*due, tables) for due, tables in sorted(refreshes.items())]
    # The daemon creates a tick's runs one after another (seconds each on a busy machine), and
    # the queue launches what exists: requested in the queue's order, a tier-0 run is never
    # created after an hourly run the queue has already launched.
    requests.sort(key=lambda request: -int(request.tags.get(PRIORITY_TAG, 0)))
    _log_requests(context, runs)
    for (hour, slot), tables in sorted(refreshes.items()):
        context.log.info(
            f"refreshing open hour {hour} (slot {slot}) of {len(tables)} tables: "
            + ", ".join(spec.name for spec in tables)
        )
    skip = None
    if not requests:
        more = f"; and {len(waiting) - 5} more tables" if len(waiting) > 5 else ""
        skip = ("; ".join(waiting[:5]) + more) or "every closed hour was requested"
    return dg.SensorResult(
        run_requests=requests, cursor=cursor.dump(), asset_events=events, skip_reason=skip
    )


def _watches(specs: Sequence[TableSpec], cursor: FleetCursor) -> list[Watch]:
    """What to read of each table's topic: from the oldest hour its cursor still watches (none
    on its first tick) on."""
    return [
        Watch(
            spec.name,
            spec.topic,
            hour_start(known.watch_from)
            if (known := cursor.tables.get(spec.name)) and known.watch_from
            else None,
            spec.start_datetime,
        )
        for spec in specs
    ]


def _table_names(specs: Sequence[TableSpec]) -> str:
    """The first three tables by name, and how many more: for an error about all of them."""
    return ", ".join(f"'{spec.name}'" for spec in specs[:3]) + (
        f" and {len(specs) - 3} more" if len(specs) > 3 else ""
    )


def _plan_tables(
    context: dg.SensorEvaluationContext,
    specs: Sequence[TableSpec],
    watches: Sequence[Watch],
    progress: Mapping[str, TopicProgress | SliceError],
    cursor: FleetCursor,
    *,
    now: datetime,
    watch_hours: int,
    refreshing: Collection[str] = frozenset(),
) -> tuple[Together, list[str], list[dg.AssetObservation], Refreshes]:
    """Plans each table's hours, table by table, and updates its cursor and lag in `cursor`.

    Returns the tables to request per pool and span of hours (a run holds one pool, so a
    tier-0 table's hour never waits for an hourly table's run), why the others wait, the lag
    observations due, and the tier-0 tables to refresh per open hour and slot.
    """
    by_name = {spec.name: spec for spec in specs}
    together: Together = {}
    refreshes: Refreshes = {}
    waiting, events = [], []
    for watch in watches:
        spec, found = by_name[watch.table], progress[watch.table]
        if isinstance(found, SliceError):
            context.log.error(str(found))
            waiting.append(f"{spec.name}: {found}")
            continue
        plan = _plan_table(
            context,
            spec,
            watch,
            found,
            cursor,
            now=now,
            watch_hours=watch_hours,
            refresh_in_flight=spec.name in refreshing,
        )
        if plan is None:
            waiting.append(f"{spec.name}: no message since {spec.start_hour}")
        else:
            cursor.tables[spec.name] = plan.cursor
            for hours in plan.ranges:
                span = tuple(h.key for h in hours.hours)
                together.setdefault((mirrors_pool(spec), span), []).append((spec, hours))
            if not plan.ranges and plan.waiting:
                waiting.append(f"{spec.name}: {plan.waiting}")
            for hour in plan.refresh:
                refreshes.setdefault((hour, refresh_slot(spec, now)), []).append(spec)
        observation = lag_if_due(context, spec, found, cursor, now)
        if observation is not None:
            events.append(observation)
    return together, waiting, events, refreshes


def _plan_table(
    context: dg.SensorEvaluationContext,
    spec: TableSpec,
    watch: Watch,
    found: TopicProgress,
    cursor: FleetCursor,
    *,
    now: datetime,
    watch_hours: int,
    refresh_in_flight: bool = False,
) -> TickPlan | None:
    """The table's plan for this tick (`plan_tick`); None while its topic holds no message
    since the table's first hour."""
    watch_from = watch.watch_from or found.first_data_hour
    if watch_from is None:
        return None
    key = dg.AssetKey(spec.name)
    return plan_tick(
        spec,
        found,
        cursor.tables.get(spec.name, Cursor()),
        now=now,
        watch_from=watch_from,
        watch_hours=watch_hours,
        already_materialized=lambda hours: _materialized_with_slice(context, key, hours),
        refresh_in_flight=refresh_in_flight,
    )


# A run in one of these states holds or waits for its pool's slot.
_IN_FLIGHT = [
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
]
# A refresh started longer ago than this is taken as dead and no longer holds its table's next
# refresh back: the default run launcher can't tell a dead run worker, so run monitoring only
# fails such a run after `max_runtime_seconds` (deploy/*/dagster.yaml: 6 hours).
REFRESH_DEAD_AFTER = timedelta(hours=1)


def _refreshing(context: dg.SensorEvaluationContext, now: datetime) -> set[str]:
    """The tables with a refresh queued or running (one query of the instance's run table)."""
    records = context.instance.get_run_records(
        filters=dg.RunsFilter(statuses=_IN_FLIGHT, tags={REFRESH_TAG: "true"})
    )
    tables = set()
    for record in records:
        started = record.start_time or record.create_timestamp.timestamp()
        if (
            record.dagster_run.status
            in (
                dg.DagsterRunStatus.STARTING,
                dg.DagsterRunStatus.STARTED,
            )
            and now - datetime.fromtimestamp(started, UTC) > REFRESH_DEAD_AFTER
        ):
            context.log.warning(
                f"refresh run {record.dagster_run.run_id} has been running for over "
                f"{REFRESH_DEAD_AFTER}: taken as dead, its tables' refreshes go on"
            )
            continue
        tables |= {key.to_user_string() for key in (record.dagster_run.asset_selection or ())}
    return tables


def _split(
    together: Together, tables_per_run: int | None
) -> list[tuple[str, tuple[str, ...], list[tuple[TableSpec, HourRange]]]]:
    """(pool, span, tables) per run: each group's tables by name, at most `tables_per_run` a
    run (None: all of them)."""
    runs = []
    for (pool, span), tables in sorted(together.items()):
        ordered = sorted(tables, key=lambda table: table[0].name)
        size = tables_per_run or len(ordered)
        runs += [(pool, span, ordered[n : n + size]) for n in range(0, len(ordered), size)]
    return runs


def _log_requests(
    context: dg.SensorEvaluationContext,
    runs: list[tuple[str, tuple[str, ...], list[tuple[TableSpec, HourRange]]]],
) -> None:
    """One line per run requested: its hours and its tables."""
    for pool, span, tables in runs:
        context.log.info(
            f"requesting {span[0]}"
            + (f"..{span[-1]}" if len(span) > 1 else "")
            + f" of {len(tables)}{' tier-0' if pool == TIER0_POOL else ''} tables: "
            + ", ".join(spec.name for spec, _ in tables)
        )


def _run_request(span: tuple[str, ...], tables: list[tuple[TableSpec, HourRange]]) -> dg.RunRequest:
    """One run for the tables whose same hours closed. The run key names each table's slices,
    so Dagster starts them once; a table whose slice later changes is requested again."""
    keys = [dg.AssetKey(spec.name) for spec, _ in tables]
    if len(tables) == 1:
        run_key = tables[0][1].run_key(tables[0][0].name)
    else:
        digest = hashlib.sha1(
            "|".join(hours.run_key(spec.name) for spec, hours in tables).encode()
        ).hexdigest()
        span_text = span[0] + (f"..{span[-1]}" if len(span) > 1 else "")
        run_key = f"{len(tables)} tables:{span_text}:{digest[:16]}"
    tags = {
        TRIGGER_TAG: SENSOR_TRIGGER,
        "cdc/tables": str(len(tables)),
        **_priority(tables[0][0], refresh=False),
    }
    if len(tables) == 1:
        tags["cdc/table"] = tables[0][0].name
    # The checks evaluated in each hour's own run; retention_risk is re-run on its own.
    checks = [
        dg.AssetCheckKey(key, name)
        for (spec, _), key in zip(tables, keys, strict=True)
        for name in run_check_names(spec)
    ]
    if len(span) == 1:
        return dg.RunRequest(
            run_key=run_key,
            asset_selection=keys,
            asset_check_keys=checks,
            partition_key=span[0],
            tags=tags,
        )
    # A range of hours in one run, as a backfill launches it.
    return dg.RunRequest(
        run_key=run_key,
        asset_selection=keys,
        asset_check_keys=checks,
        tags={**tags, RANGE_START_TAG: span[0], RANGE_END_TAG: span[-1]},
    )


def _refresh_request(hour: str, slot: str, tables: list[TableSpec]) -> dg.RunRequest:
    """One run refreshing open hour `hour` of the tier-0 tables due in `slot`, tagged
    `REFRESH_TAG` (the run slices the open hour; each refresh reads what arrived since the
    last). Its run key names the hour, the slot and the tables: one refresh per slot."""
    names = sorted(spec.name for spec in tables)
    digest = hashlib.sha1("|".join(names).encode()).hexdigest()[:16]
    who = names[0] if len(names) == 1 else f"{len(names)} tables:{digest}"
    tags = {
        TRIGGER_TAG: SENSOR_TRIGGER,
        REFRESH_TAG: "true",
        "cdc/tables": str(len(names)),
        **_priority(tables[0], refresh=True),
    }
    return dg.RunRequest(
        run_key=f"refresh:{who}:{hour}:{slot}",
        asset_selection=[dg.AssetKey(spec.name) for spec in tables],
        asset_check_keys=[
            dg.AssetCheckKey(dg.AssetKey(spec.name), name)
            for spec in tables
            for name in run_check_names(spec)
        ],
        partition_key=hour,
        tags=tags,
    )


def _priority(spec: TableSpec, *, refresh: bool) -> dict[str, str]:
    """The run's place in Dagster's queue (`PRIORITIES`): refreshes first, then tier-0 tables'
    final runs, then the hourly tables' runs (no tag: Dagster's default, 0)."""
    kind = "refresh" if refresh else "tier0" if mirrors_pool(spec) == TIER0_POOL else "hourly"
    return {PRIORITY_TAG: str(PRIORITIES[kind])} if PRIORITIES[kind] else {}


def _materialized_with_slice(
    context: dg.SensorEvaluationContext, asset_key: dg.AssetKey, hours: list[HourState]
) -> set[str]:
    """Hours whose latest materialization read exactly their current slice."""
    if not hours:
        return set()
    wanted = {h.key: h for h in hours}
    records = context.instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=asset_key, asset_partitions=list(wanted)),
        limit=len(wanted) * 4,
    ).records
    latest: dict[str, dict] = {}
    for record in records:  # newest first
        materialization = record.asset_materialization
        if materialization.partition in latest:
            continue
        latest[materialization.partition] = completed_hour_offsets(materialization.metadata)
    return {key for key, offsets in latest.items() if offsets == wanted[key].offsets}


def completed_hour_offsets(metadata: Mapping[str, dg.MetadataValue]) -> dict:
    """The hour's slice a materialization completed, as `HourState.offsets` writes it: {} for a
    partial one (a refresh, or a forced open hour), which the hour's run after it completes.
    (A complete run reads its hour whole, so its `kafka_offsets` are the hour's slice.)"""
    partial = metadata.get("partial_hour")
    offsets = metadata.get("kafka_offsets")
    if offsets is None or (partial is not None and partial.value):
        return {}
    return offsets.value
