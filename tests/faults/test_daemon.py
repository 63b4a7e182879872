"""Fault scenarios 17 and 18: the real Dagster daemon SIGKILLed mid-tick, and a run killed while
it holds the mirrors' pool.

Both run a real `dagster-daemon run` (sensors, queued run coordinator, run monitoring, run
retries; its code server, run workers and their Spark JVMs) on a SQLite instance made from
deploy/local/dagster.yaml with shorter intervals, over two tables on the real broker, with
recent hours (allowed lateness 0, one hour per run), so the offset sensor asks for one run per
closed hour and the pool `cdc_mirrors` (limit 1, per run) makes them take turns. The code
location is tests/faults/daemon_location.py: the project's Definitions, the sensor allowed to
tick every 2 s.

18, a run killed holding its pool slot. Table b's two hours are queued as two runs; while the
first one runs (its step started, its Spark JVM up) and the second waits in the queue for the
pool, the first run's worker process and everything under it get SIGKILL (what the kernel's
OOM killer does to a run worker). Its code server notices the dead worker and fails the run,
which frees the pool: the second run must start within NEXT_RUN_BOUND_S, `run_retries` reruns
the killed one, and at the end no run holds the pool and the mirror equals the replay.

17, the daemon killed mid-tick. Table a's three hours arrive while the daemon is down. The
daemon is started with the run coordinator's pause point set to its 2nd submission: the sensor's
tick stores its three run requests and its new cursor with the tick, submits the first hour's
run (which then runs to its end) and stops while submitting the second, whose run exists but is
not queued; the third is not created. Then the daemon's whole process group gets SIGKILL: the
tick is STARTED and the sensor's stored cursor is still the old one. A new daemon must resume
the tick: every closed hour of a runs exactly once (one run, one materialization per hour), the
sensor's cursor covers them, and the mirror equals the replay.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import dagster as dg
import psutil
import pytest
import yaml
from kafka.admin import KafkaAdminClient, NewTopic

from cdc_assets.config import TableSpec
from cdc_assets.partitions import MIRRORS_POOL
from resources.lake import LakeResource
from sensors.cursor import Cursor, FleetCursor
from sensors.hours import hour_key
from tests.dagster_ui import Service, start_service, stop_service, wait_for
from tests.faults import table
from tests.faults.daemon_location import PAUSE_ENV, PAUSED_FILE
from tests.faults.figures import compare, record

pytestmark = pytest.mark.integration
log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
HOUR = timedelta(hours=1)
PARTITIONS = 3
SENSOR = "cdc_offsets"
RANGE_START, RANGE_END = "dagster/asset_partition_range_start", "dagster/asset_partition_range_end"
ACTIVE = [dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.CANCELING]
UNFINISHED = [*ACTIVE, dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED]
RUNS_DEADLINE_S = 900  # the daemon's runs of one scenario, each its own Spark session
NEXT_RUN_BOUND_S = 60  # from the worker's kill to the next run's start
POLL_S = 0.2


def _changes_a(first: datetime) -> list[table.Change]:
    """Table a, hours 0-2: creates, updates, deletes and a re-insert across the hours."""
    c = [table.change("c", i, 100 + i, hour=0, second=i, first=first) for i in range(1, 13)]
    c += [table.change("u", i, 200 + i, hour=1, second=i, first=first) for i in range(1, 7)]
    c += [table.change("d", i, 220 + i, hour=1, second=30 + i, first=first) for i in (7, 8, 9)]
    c += [table.change("c", i, 240 + i, hour=1, second=60 + i, first=first) for i in (13, 14)]
    c += [table.change("u", i, 300 + i, hour=2, second=i, first=first) for i in (1, 2, 13)]
    c += [table.change("d", 14, 320, hour=2, second=40, first=first)]
    c += [table.change("c", 7, 330, hour=2, second=50, first=first)]
    return c


def _changes_b(first: datetime) -> list[table.Change]:
    """Table b, hours 1-2."""
    c = [table.change("c", i, 100 + i, hour=1, second=i, first=first) for i in range(1, 11)]
    c += [table.change("u", i, 200 + i, hour=2, second=i, first=first) for i in range(1, 6)]
    c += [table.change("d", i, 220 + i, hour=2, second=30 + i, first=first) for i in (6, 7)]
    c += [table.change("c", i, 240 + i, hour=2, second=60 + i, first=first) for i in (11, 12)]
    return c


def instance_yaml() -> dict:
    """deploy/local/dagster.yaml with the test's intervals: the queue looked at every second
    (through the pausing coordinator), run monitoring every 2 s."""
    config = yaml.safe_load((REPO / "deploy" / "local" / "dagster.yaml").read_text())
    # What the scenarios rely on; a change to the local file must be looked at here.
    assert config["concurrency"]["pools"] == {"granularity": "run", "default_limit": 1}, config
    assert config["run_retries"]["enabled"] and config["run_retries"]["max_retries"] >= 1, config
    assert config["run_monitoring"]["enabled"], config
    assert "run_coordinator" not in config, "the local file names a run coordinator now"
    config["run_coordinator"] = {
        "module": "tests.faults.daemon_location",
        "class": "PausingRunCoordinator",
        "config": {"dequeue_interval_seconds": 1},
    }
    config["run_monitoring"]["poll_interval_seconds"] = 2
    return config


@dataclass
class Deployment:
    """The daemon of this module (one at a time, restarted between lives), its instance, the
    lake and the two tables."""

    broker: str
    home: Path
    env: dict
    lake: LakeResource
    specs: dict[str, TableSpec]
    first: datetime  # the start of hour 0
    instance: dg.DagsterInstance
    logs: Path
    lives: list[Service] = field(default_factory=list)

    @property
    def daemon(self) -> Service | None:
        live = self.lives[-1] if self.lives else None
        return live if live is not None and live.process.poll() is None else None

    def start(self, *, pause_at_submission: int | None = None) -> Service:
        assert self.daemon is None
        env = dict(self.env)
        if pause_at_submission:
            env[PAUSE_ENV] = str(pause_at_submission)
        command = [
            str(Path(sys.executable).with_name("dagster-daemon")),
            "run",
            "-m",
            "tests.faults.daemon_location",
            "-d",
            str(REPO),
        ]
        log = self.logs / f"daemon-{len(self.lives) + 1}.log"
        self.lives.append(start_service("dagster-daemon", command, env, log, cwd=REPO))
        return self.lives[-1]

    def stop(self, *, grace_s: float = 30) -> None:
        if self.daemon is not None:
            stop_service(self.daemon, grace_s=grace_s)

    def send(self, name: str, changes: list[table.Change]) -> None:
        """Changes sent while no daemon runs: its first tick sees the hours whole."""
        assert self.daemon is None, "a tick could see an hour half sent"
        table.send_all(self.broker, self.specs[name].topic, changes)

    def key(self, hour: int) -> str:
        return hour_key(self.first + HOUR * hour)


@pytest.fixture(scope="module")
def deployment(broker: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    work = tmp_path_factory.mktemp("daemon")
    first = datetime.now(UTC).replace(minute=0, second=0, microsecond=0) - 3 * HOUR
    suffix = f"{os.getpid()}-{time.monotonic_ns()}"
    specs = {
        name: TableSpec.model_validate(
            {
                **table.spec(f"ops-{name}-{suffix}").model_dump(),
                "name": f"ops_{name}",
                "start_hour": hour_key(first),
                # Closed at their end: the last hour is closed whatever minute the test starts.
                "allowed_lateness_minutes": 0,
                # One run per hour: a queue of runs behind the pool.
                "hours_per_run": 1,
            }
        )
        for name in ("a", "b")
    }
    admin = KafkaAdminClient(bootstrap_servers=broker)
    topics = [spec.topic for spec in specs.values()]
    admin.create_topics(
        [NewTopic(t, num_partitions=PARTITIONS, replication_factor=1) for t in topics]
    )
    tables_file = work / "tables.yaml"
    tables_file.write_text(
        yaml.safe_dump({"tables": [spec.model_dump(mode="json") for spec in specs.values()]})
    )
    home = work / "dagster"
    home.mkdir()
    (home / "dagster.yaml").write_text(yaml.safe_dump(instance_yaml()))
    lake = LakeResource(root=str(work / "lake"))
    env = {key: value for key, value in os.environ.items() if not key.startswith(("AWS_", "CDC_"))}
    env.update(
        {
            "DAGSTER_HOME": str(home),
            "CDC_TABLES_FILE": str(tables_file),
            "CDC_KAFKA_BOOTSTRAP_SERVERS": broker,
            "CDC_LAKE_ROOT": lake.root,
            # The daemon loads the pausing run coordinator from this checkout.
            "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])]),
        }
    )
    # As docs/deploy.md says a deployment does: the pool exists before any run is queued.
    subprocess.run(
        [str(REPO / ".venv/bin/dagster"), "instance", "concurrency", "set", MIRRORS_POOL, "1"],
        env=env,
        check=True,
        capture_output=True,
    )
    instance = dg.DagsterInstance.from_config(str(home))
    deployment = Deployment(
        broker=broker,
        home=home,
        env=env,
        lake=lake,
        specs=specs,
        first=first,
        instance=instance,
        logs=work,
    )
    try:
        yield deployment
    finally:
        deployment.stop()
        instance.dispose()
        admin.delete_topics(topics)
        admin.close()


# --- reading the instance -----------------------------------------------------------------


def _hours_of(run: dg.DagsterRun) -> list[str]:
    tags = run.tags
    if "dagster/partition" in tags:
        return [tags["dagster/partition"]]
    start, end = tags.get(RANGE_START), tags.get(RANGE_END)
    if not start:
        return []
    moment = datetime.strptime(start, table.KEY_FORMAT).replace(tzinfo=UTC)
    hours = []
    while hour_key(moment) <= end:
        hours.append(hour_key(moment))
        moment += HOUR
    return hours


def _runs_of(d: Deployment, name: str) -> list[dg.DagsterRun]:
    """Every run that materializes table `name`, oldest first (the sensor's and retries)."""
    key = dg.AssetKey(d.specs[name].name)
    runs = d.instance.get_runs()
    return [r for r in reversed(runs) if r.asset_selection and key in r.asset_selection]


def _materializations(d: Deployment, name: str) -> dict[str, list[str]]:
    """Hour -> the run ids that recorded a materialization of table `name` for it."""
    records = d.instance.fetch_materializations(dg.AssetKey(d.specs[name].name), limit=1000).records
    out: dict[str, list[str]] = {}
    for r in records:
        out.setdefault(r.asset_materialization.partition, []).append(r.run_id)
    return out


def _closed_hours(d: Deployment, from_hour: int) -> list[str]:
    """Every hour of the table from `from_hour` to the last one closed now (lateness 0)."""
    last = datetime.now(UTC).replace(minute=0, second=0, microsecond=0) - HOUR
    count = int((last - (d.first + HOUR * from_hour)) / HOUR) + 1
    return [d.key(from_hour + n) for n in range(count)]


def _all_hours_done(d: Deployment, name: str, from_hour: int):
    """True once every closed hour is materialized and no run of the table is unfinished."""
    wanted = _closed_hours(d, from_hour)
    done = _materializations(d, name)
    unfinished = [r.run_id for r in _runs_of(d, name) if r.status in UNFINISHED]
    missing = [h for h in wanted if h not in done]
    return (not missing and not unfinished) or {"missing": missing, "unfinished": unfinished}


def _pool_holders(d: Deployment) -> list[str]:
    """The runs holding a slot of the mirrors' pool: with `granularity: run` a run holds it
    from its launch until it ends (what the queue counts, not the op-slot table)."""
    records = d.instance.get_run_records(filters=dg.RunsFilter(statuses=ACTIVE))
    return sorted(
        r.dagster_run.run_id
        for r in records
        if r.dagster_run.run_op_concurrency
        and MIRRORS_POOL in (r.dagster_run.run_op_concurrency.all_pools or [])
    )


def _worker_pid(d: Deployment, run_id: str) -> int | None:
    """The run worker's pid, from the engine event its code server records at its start."""
    for entry in d.instance.all_logs(run_id, of_type=dg.DagsterEventType.ENGINE_EVENT):
        data = entry.dagster_event.engine_event_data if entry.dagster_event else None
        if data and "pid" in data.metadata and "Started process" in (entry.message or ""):
            return int(data.metadata["pid"].value)
    return None


def _sensor_state(d: Deployment):
    states = [s for s in d.instance.all_instigator_state() if s.name == SENSOR]
    assert len(states) == 1, states
    return states[0]


def _latest_tick(d: Deployment):
    state = _sensor_state(d)
    return d.instance.get_ticks(state.instigator_origin_id, state.selector_id, limit=1)[0]


def _tick(d: Deployment, tick_id: int):
    state = _sensor_state(d)
    ticks = d.instance.get_ticks(state.instigator_origin_id, state.selector_id, limit=200)
    return next(t for t in ticks if t.tick_id == tick_id)


def _stored_cursor(d: Deployment) -> FleetCursor:
    data = _sensor_state(d).instigator_data
    return FleetCursor.parse(data.cursor if data else None)


def _covers(cursor: Cursor, hours: list[str]) -> bool:
    """Every hour is in the cursor: requested, or settled (before the hour it watches from)."""
    return cursor.watch_from is not None and all(
        h in cursor.requested or h < cursor.watch_from for h in hours
    )


def _poll(condition, *, what: str, service: Service, deadline: float):
    """`condition()` every POLL_S until it returns something truthy (returned)."""
    while time.monotonic() < deadline:
        if service.process.poll() is not None:
            pytest.fail(f"the daemon exited while waiting for {what}: {service.log}")
        found = condition()
        if found:
            return found
        time.sleep(POLL_S)
    pytest.fail(f"timed out waiting for {what}; daemon log {service.log}")


def _reference_comparison(d: Deployment, name: str):
    spec = d.specs[name]
    reference = table.reference(d.broker, spec)
    return compare(d.lake.table_path(spec.name), spec, reference.expected, reference.seen_keys)


# --- 18: a run killed while it holds the pool -----------------------------------------------


def test_a_run_killed_holding_the_pool_frees_it_and_the_next_run_goes(deployment, spark):
    d = deployment
    d.stop()
    d.send("b", _changes_b(d.first))
    daemon = d.start()
    first_key, second_key = d.key(1), d.key(2)
    deadline = time.monotonic() + RUNS_DEADLINE_S

    def by_hour() -> dict[str, dg.DagsterRun]:
        return {
            h: r
            for r in _runs_of(d, "b")
            for h in _hours_of(r)
            if "dagster/parent_run_id" not in r.tags
        }

    def killable():
        """The first hour's run with its step started and its Spark JVM up, the second queued."""
        runs = by_hour()
        if first_key not in runs or second_key not in runs:
            return None
        killed = runs[first_key]
        assert killed.status in UNFINISHED, f"the first run ended before the kill: {killed.status}"
        if killed.status != dg.DagsterRunStatus.STARTED:
            return None
        if not d.instance.all_logs(killed.run_id, of_type=dg.DagsterEventType.STEP_START):
            return None
        pid = _worker_pid(d, killed.run_id)
        if pid is None:
            return None
        try:
            worker = psutil.Process(pid)
            tree = [worker, *worker.children(recursive=True)]
            if not any(p.name() == "java" for p in tree[1:]):
                return None
        except psutil.NoSuchProcess:
            return None
        return killed, runs[second_key], tree

    killed, waiting, tree = _poll(
        killable, what="the first hour's run at work", service=daemon, deadline=deadline
    )
    # The pool is what holds the second run back (two runs may run at once otherwise).
    assert _pool_holders(d) == [killed.run_id]
    assert d.instance.get_run_by_id(waiting.run_id).status == dg.DagsterRunStatus.QUEUED
    killed_at = time.time()
    for process in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.send_signal(signal.SIGKILL)
    psutil.wait_procs(tree, timeout=30)

    started = _poll(
        lambda: d.instance.get_run_record_by_id(waiting.run_id).start_time,
        what="the queued run to start",
        service=daemon,
        deadline=time.monotonic() + NEXT_RUN_BOUND_S,
    )
    failed = d.instance.get_run_record_by_id(killed.run_id)
    assert failed.dagster_run.status == dg.DagsterRunStatus.FAILURE, failed.dagster_run.status
    launched = d.instance.get_run_stats(waiting.run_id).launch_time
    log.info(
        "run killed holding the pool: failed %.1f s after the kill, the next run launched after "
        "%.1f s and running after %.1f s",
        failed.end_time - killed_at,
        launched - killed_at,
        started - killed_at,
    )

    wait_for(
        lambda: _all_hours_done(d, "b", 1),
        what="every hour of b after the kill",
        services=[daemon],
        deadline=deadline,
    )
    runs = _runs_of(d, "b")
    retries = [r for r in runs if r.tags.get("dagster/parent_run_id") == killed.run_id]
    assert [r.status for r in retries] == [dg.DagsterRunStatus.SUCCESS], retries
    assert d.instance.get_run_by_id(waiting.run_id).status == dg.DagsterRunStatus.SUCCESS
    # Each hour recorded once: the killed run recorded nothing, its retry the hour.
    recorded = _materializations(d, "b")
    assert {h: len(ids) for h, ids in recorded.items()} == dict.fromkeys(_closed_hours(d, 1), 1)
    assert recorded[first_key] == [retries[0].run_id]
    # Nothing holds the pool any more, and no op-level slot was left claimed.
    assert _pool_holders(d) == []
    info = d.instance.event_log_storage.get_concurrency_info(MIRRORS_POOL)
    assert (info.slot_count, info.active_slot_count, info.pending_step_count) == (1, 0, 0), info

    comparison = _reference_comparison(d, "b")
    record("run_killed_holding_pool_slot", comparison, faults=1)
    assert comparison.clean, comparison


# --- 17: the daemon killed mid-tick ----------------------------------------------------------


def test_the_daemon_killed_mid_tick_skips_no_hour_and_runs_none_twice(deployment, spark):
    d = deployment
    d.stop()
    d.send("a", _changes_a(d.first))
    hours = [d.key(n) for n in range(3)]
    daemon = d.start(pause_at_submission=2)
    deadline = time.monotonic() + RUNS_DEADLINE_S
    marker = d.home / PAUSED_FILE
    paused_run = _poll(
        lambda: marker.exists() and marker.read_text(),
        what="the tick to pause at its second run",
        service=daemon,
        deadline=deadline,
    )

    def first_run_done():
        runs = {h: r for r in _runs_of(d, "a") for h in _hours_of(r)}
        run = runs.get(hours[0])
        return (run is not None and run.status == dg.DagsterRunStatus.SUCCESS) or runs

    wait_for(first_run_done, what="the first hour's run", services=[daemon], deadline=deadline)
    tick = _latest_tick(d)
    reserved = [run_id for run_id, _ in tick.reserved_run_ids_with_requests]
    # Mid-tick: the tick holds its runs and its cursor, the sensor's stored cursor is the old
    # one; the first run went, the second exists unqueued, the third does not exist.
    assert tick.status.value == "STARTED", tick
    assert len(reserved) >= 3, reserved
    assert reserved[1] == paused_run
    assert d.instance.get_run_by_id(reserved[1]).status == dg.DagsterRunStatus.NOT_STARTED
    assert d.instance.get_run_by_id(reserved[2]) is None
    tick_cursor = FleetCursor.parse(tick.cursor).tables[d.specs["a"].name]
    assert _covers(tick_cursor, hours), tick_cursor
    assert d.specs["a"].name not in _stored_cursor(d).tables

    d.stop(grace_s=0)  # SIGKILL to the daemon's process group
    marker.unlink()
    daemon = d.start()
    wait_for(
        lambda: _all_hours_done(d, "a", 0),
        what="every hour of a after the restart",
        services=[daemon],
        deadline=deadline,
    )
    closed = _closed_hours(d, 0)

    # The new daemon resumed the tick: it queued the second run, created the third.
    resumed = _tick(d, tick.tick_id)
    assert resumed.status.value == "SUCCESS", resumed
    assert "interrupted part-way through, resuming" in daemon.log.read_text(errors="replace")
    assert d.instance.get_run_by_id(reserved[1]).status == dg.DagsterRunStatus.SUCCESS
    # No hour skipped, none run twice: one run per hour, one materialization per hour.
    runs = _runs_of(d, "a")
    per_hour: dict[str, list[dg.DagsterRun]] = {}
    for run in runs:
        for hour in _hours_of(run):
            per_hour.setdefault(hour, []).append(run)
    assert {h: len(r) for h, r in per_hour.items()} == dict.fromkeys(closed, 1), per_hour
    assert all(run.status == dg.DagsterRunStatus.SUCCESS for run in runs), runs
    assert len({run.tags["dagster/run_key"] for run in runs}) == len(runs)
    recorded = _materializations(d, "a")
    assert {h: len(ids) for h, ids in recorded.items()} == dict.fromkeys(closed, 1), recorded
    # The sensor's stored cursor covers every closed hour (requested, or settled before it).
    cursor = _stored_cursor(d).tables[d.specs["a"].name]
    assert _covers(cursor, closed), cursor

    comparison = _reference_comparison(d, "a")
    record("daemon_killed_mid_tick", comparison, faults=1)
    assert comparison.clean, comparison
