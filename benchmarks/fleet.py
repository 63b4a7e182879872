"""The fleet case: N tables made from one template, their hour run through Dagster as users run it.

`scripts/bench.sh --only fleet-50 fleet-200` (the `fleet` profile). For N tables (one topic each,
3 partitions) it produces two hours: H0 (~200 changes per table) is materialized first, in one
run straight through the mirrors' multi-asset (the tables then exist, as in steady state); then
the Dagster daemon is started on a fresh SQLite instance with the project's code location, and
the time is measured from its start (hour H1 has closed: its data is all in Kafka and its
lateness passed) until every table's H1 is materialized with all its checks: the one offset
sensor's tick, the queued run, its launch, the Spark session's start and every table-hour. In
H1 most tables have ~200 changes, some none, a few a malformed record.

Reported: the wall time, table-hours per minute, the sensor tick's duration, the peak RSS of
the daemon's process tree (code server, run worker and Spark JVM included), each table-hour's
time inside the run, the run's Spark jobs, and delta-rs doing the same N merges of H1 in one
process (tables it built from H0 itself; it reads no deletion vectors, so it gets its own).
Every mirror is then compared with the plain-Python replay of its topic up to the offsets its
materializations read (live rows of the keys the events changed, equal row for row).

The tier-0 case (`--profile tier0`, `FleetCase(200, tier0=50)`): the first `tier0` tables have
`refresh_minutes: 15`, and while the daemon runs, every table's changes of the current hour are
sent as the clock reaches their timestamps. The daemon runs from H1's close through the next
two 15-minute slot boundaries (15 to 30 minutes), then until its runs end. Reported besides:
each run's wait in the queue (created → started) by kind (refresh, tier-0 final, hourly), and
each tier-0 mirror's staleness just before each of its commits (the age of its newest applied
change then), against 15 minutes plus the longest refresh run. Its instance runs one run at a
time (`max_concurrent_runs: 1`) and its sensor's runs of closed hours carry at most
`TIER0_TABLES_PER_RUN` tables (`CDC_SENSOR_TABLES_PER_RUN`): docs/deploy.md's setting for a
2-core machine with tier-0 tables, where the run queue's order (refresh, tier-0 final, hourly)
decides the waits.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psutil
import yaml
from kafka import KafkaAdminClient, KafkaProducer

from benchmarks.workload import COLUMNS, PRIMARY_KEY, Workload
from cdc_assets.partitions import REFRESH_TAG, SENSOR_TRIGGER, TRIGGER_TAG
from checks.table_checks import MIRROR_CHECKS
from demo.produce import ensure_topics

REPO = Path(__file__).resolve().parents[1]
HOUR_FORMAT = "%Y-%m-%d-%H:%M"
PARTITIONS = 3
CHANGES = 200  # per table and hour
STARTING_KEYS = 2_000  # the template's keys the changes pick from (Zipf ranks)
REFRESH_MINUTES = 15  # the tier-0 tables'
TIER0_TABLES_PER_RUN = 25  # the tier-0 case's CDC_SENSOR_TABLES_PER_RUN


def table_name(n: int) -> str:
    return f"fleet_{n:03d}"


def kind_of(n: int) -> str:
    """What table n gets in the measured hour: most a small hour, some none, a few a bad one."""
    if n % 20 == 7:
        return "bad"
    if n % 8 == 3:
        return "empty"
    return "small"


def template(name: str, topic: str, start_hour: str, *, tier0: bool = False) -> dict:
    """The tables file entry every fleet table is made from (the benchmark's orders table)."""
    return ({"refresh_minutes": REFRESH_MINUTES} if tier0 else {}) | {
        "name": name,
        "topic": topic,
        "primary_key": [PRIMARY_KEY],
        "columns": COLUMNS,
        "decimal_handling": "string",
        "start_hour": start_hour,
        "allowed_lateness_minutes": 0,
        "expectations": [
            {"column": "status", "expect": "in_set", "values": list(_statuses())},
            {"column": "total", "expect": "between", "min": 0},
            {"column": "customer_id", "expect": "not_null", "hard": True},
        ],
        "checks": {"error_rate": {"max_share": 0.05}},
    }


def _statuses() -> tuple[str, ...]:
    from benchmarks.workload import STATUSES

    return STATUSES


def _log(message: str) -> None:
    print(f"[{datetime.now(UTC):%H:%M:%S}] {message}", flush=True)


# Per table, every change sent, in order: [partition, offset, key, row (None: deleted)].
Sent = dict[str, list[list]]


def produce(
    bootstrap: str, n: int, prefix: str, hours: list[datetime]
) -> tuple[Sent, dict[str, Workload]]:
    """Both hours of every table; returns what was sent and each table's workload (to go on)."""
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    topics = [f"{prefix}.{table_name(i)}" for i in range(n)]
    try:
        ensure_topics(admin, topics, partitions=PARTITIONS, configs={"retention.ms": "-1"})
    finally:
        admin.close()
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=20)
    pending, workloads = [], {}
    try:
        for i, topic in enumerate(topics):
            workload = workloads[table_name(i)] = Workload(rows=STARTING_KEYS, layout="a", seed=i)
            for h, hour in enumerate(hours):
                start_ms = int(hour.timestamp() * 1000)
                if h == 1 and kind_of(i) == "empty":
                    continue
                for event in workload.hour(CHANGES, start_ms):
                    future = producer.send(
                        topic,
                        key=event.kafka_key(),
                        value=event.kafka_value(),
                        timestamp_ms=event.timestamp_ms,
                    )
                    pending.append((table_name(i), future, event))
                if h == 1 and kind_of(i) == "bad":
                    producer.send(
                        topic, key=b'{"id": 1}', value=b"{not json", timestamp_ms=start_ms
                    )
        producer.flush()
    finally:
        producer.close()
    sent: Sent = {table_name(i): [] for i in range(n)}
    for name, future, event in pending:
        meta = future.get(timeout=60)
        sent[name].append([meta.partition, meta.offset, event.key, event.row])
    return sent, workloads


class LiveHour(threading.Thread):
    """The hour starting at `hour`, every table's changes sent as the clock reaches their
    timestamps (those already past at once), recorded in `sent`, until the hour ends or
    `stop` is set."""

    def __init__(self, bootstrap: str, topics: dict[str, str], workloads, hour, sent: Sent):
        super().__init__(daemon=True)
        self.bootstrap, self.topics, self.workloads = bootstrap, topics, workloads
        self.start_ms, self.sent, self.stop = int(hour.timestamp() * 1000), sent, threading.Event()
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            self._send()
        except BaseException as failure:  # reported by the case
            self.failure = failure

    def _send(self) -> None:
        producer = KafkaProducer(bootstrap_servers=self.bootstrap, acks="all", linger_ms=20)
        changes = {n: self.workloads[n].hour(CHANGES, self.start_ms) for n in self.topics}
        try:
            for i in range(CHANGES):
                due = (self.start_ms + i * 3_600_000 / CHANGES) / 1000
                if self.stop.wait(max(0.0, due - time.time())):
                    return
                pending = []
                for name, events in changes.items():
                    event = next(events)
                    future = producer.send(
                        self.topics[name],
                        key=event.kafka_key(),
                        value=event.kafka_value(),
                        timestamp_ms=event.timestamp_ms,
                    )
                    pending.append((name, future, event))
                producer.flush()
                for name, future, event in pending:
                    meta = future.get(timeout=60)
                    self.sent[name].append([meta.partition, meta.offset, event.key, event.row])
        finally:
            producer.close()


def run_case(n: int, bootstrap: str, work: Path, *, tier0: int = 0) -> dict:
    name = f"fleet-{n}" + (f"-tier0-{tier0}" if tier0 else "")
    case_dir = work / name
    shutil.rmtree(case_dir, ignore_errors=True)
    case_dir.mkdir(parents=True)
    if tier0:
        _at_the_top_of_an_hour(name)
    now_hour = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    hours = [now_hour - timedelta(hours=2), now_hour - timedelta(hours=1)]
    keys = [h.strftime(HOUR_FORMAT) for h in hours]
    prefix = f"fleet{n}.{int(time.time())}"
    _log(f"{name}: producing {n} tables x 2 hours")
    started = time.monotonic()
    sent, workloads = produce(bootstrap, n, prefix, hours)
    produce_s = time.monotonic() - started
    topics = {table_name(i): f"{prefix}.{table_name(i)}" for i in range(n)}
    tables = [
        template(table, topic, keys[0], tier0=i < tier0)
        for i, (table, topic) in enumerate(topics.items())
    ]
    tables_file = case_dir / "tables.yaml"
    tables_file.write_text(yaml.safe_dump({"tables": tables}, sort_keys=False))
    home = case_dir / "dagster"
    home.mkdir()
    instance = (REPO / "deploy" / "local" / "dagster.yaml").read_text()
    if tier0:  # one run at a time, in the queue's order (docs/deploy.md, 2 cores)
        assert "max_concurrent_runs: 2" in instance
        instance = instance.replace("max_concurrent_runs: 2", "max_concurrent_runs: 1")
    (home / "dagster.yaml").write_text(instance)
    env = {
        **os.environ,
        "DAGSTER_HOME": str(home),
        "CDC_TABLES_FILE": str(tables_file),
        "CDC_KAFKA_BOOTSTRAP_SERVERS": bootstrap,
        "CDC_LAKE_ROOT": str(case_dir / "lake"),
    }
    if tier0:
        from code_location.definitions import TABLES_PER_RUN_ENV  # dagster: imported late

        env[TABLES_PER_RUN_ENV] = str(TIER0_TABLES_PER_RUN)

    _log(f"{name}: H0 {keys[0]}, every table in one run (creates the tables)")
    warm = _timed_child(
        ["benchmarks.fleet", "warm", keys[0]], env, case_dir / "warm.log", watch=None
    )

    tick = _sensor_tick(env)
    _log(f"{name}: sensor tick {tick}")
    live = None
    if tier0:
        _pools(env)
        live = LiveHour(bootstrap, topics, workloads, now_hour, sent)
        live.start()
    _log(f"{name}: the daemon, from hour {keys[1]} closed to every table's hour and checks")
    try:
        measured = _measure_daemon(
            env, case_dir, n, keys[1], hold=_two_slots_on() if tier0 else None
        ) | {"sensor": tick}
    finally:
        if live is not None:
            live.stop.set()
            live.join()
    if live is not None and live.failure is not None:
        raise RuntimeError(f"{name}: sending the live hour failed: {live.failure!r}")
    (case_dir / "sent.json").write_text(json.dumps(sent))
    _log(f"{name}: {measured['wall_s']} s; delta-rs, the same {n} merges in one process")
    delta_rs = _timed_child(
        ["benchmarks.fleet", "delta-rs", str(case_dir), bootstrap, json.dumps(keys)],
        env,
        case_dir / "delta-rs.log",
        watch=None,
    )
    delta_rs |= json.loads((case_dir / "delta-rs.json").read_text())
    _log(f"{name}: checking every mirror against the replay")
    _timed_child(["benchmarks.fleet", "check", str(case_dir)], env, case_dir / "check.log", None)
    verdict = json.loads((case_dir / "check.json").read_text())
    return {
        "case": name,
        "tables": n,
        "tier0": tier0,
        "tables_per_run": TIER0_TABLES_PER_RUN if tier0 else None,
        "kinds": {k: sum(kind_of(i) == k for i in range(n)) for k in ("small", "empty", "bad")},
        "changes_per_hour": CHANGES,
        "produce_s": round(produce_s, 1),
        "first_hour": warm,
        "hour": measured,
        "delta_rs": delta_rs,
        "check": verdict,
    }


def _at_the_top_of_an_hour(name: str) -> None:
    """The tier-0 case's hours are the current one (live) and the two before it; its creating
    of the tables and its window take up to 50 minutes, which must end before the live hour
    does. Started later than 5 minutes past an hour, it waits for the next one."""
    now = datetime.now(UTC)
    if now.minute < 5:
        return
    start = now.replace(minute=0, second=30, microsecond=0) + timedelta(hours=1)
    _log(f"{name}: waiting for the top of the hour ({start:%H:%M:%S} UTC)")
    time.sleep((start - now).total_seconds())


def _two_slots_on() -> float:
    """When the tier-0 case's daemon may stop: 90 s after the second `REFRESH_MINUTES` slot
    boundary from now (the refresh it requests then has started), as `time.monotonic()`."""
    slot = REFRESH_MINUTES * 60
    boundary = (time.time() // slot + 2) * slot
    return time.monotonic() + (boundary - time.time()) + 90


def _pools(env: dict) -> None:
    """Both mirror pools at limit 1 before the first run is queued (as scripts/demo.sh does)."""
    dagster = Path(sys.executable).with_name("dagster")
    for pool in ("cdc_mirrors", "cdc_mirrors_tier0"):
        subprocess.run(
            [str(dagster), "instance", "concurrency", "set", pool, "1"],
            env=env, check=True, capture_output=True, cwd=REPO,
        )  # fmt: skip


def _sensor_tick(env: dict) -> dict:
    """One tick of the offset sensor over every table, evaluated here on the case's instance
    (the daemon's first tick does the same): its duration and what it asks for."""
    import dagster as dg

    from cdc_assets.config import load_tables
    from resources.kafka import KafkaResource
    from sensors.offset_progress import build_offset_sensor

    os.environ["DAGSTER_HOME"] = env["DAGSTER_HOME"]
    sensor = build_offset_sensor(specs=load_tables(env["CDC_TABLES_FILE"]))
    kafka = KafkaResource(bootstrap_servers=env["CDC_KAFKA_BOOTSTRAP_SERVERS"])
    with dg.DagsterInstance.get() as instance:
        timings, cursor, requests = [], None, 0
        for _ in range(2):  # the first tick (no cursor), then one that carries it
            context = dg.build_sensor_context(
                instance=instance, cursor=cursor, resources={"kafka": kafka}
            )
            started = time.monotonic()
            result = sensor(context)
            timings.append(round(time.monotonic() - started, 2))
            cursor = result.cursor
            requests = max(requests, len(result.run_requests))
    return {"first_tick_s": timings[0], "next_tick_s": timings[1], "runs_requested": requests}


def _timed_child(args: list[str], env: dict, log: Path, watch) -> dict:
    from benchmarks.run import run_child

    return run_child(args, log, env=env)


def _measure_daemon(
    env: dict, case_dir: Path, n: int, hour_key: str, *, hold: float | None = None
) -> dict:
    """Runs the daemon until every table's `hour_key` is materialized with its checks (the
    measured wall time), and with `hold` (a `time.monotonic()`) on until then and until its
    runs ended; the run figures, and each table's read frontier into frontier.json."""
    import dagster as dg

    log = case_dir / "daemon.log"
    started = time.monotonic()
    with log.open("wb") as out:
        daemon = subprocess.Popen(
            [str(Path(sys.executable).with_name("dagster-daemon")), "run", "-w",
             str(REPO / "workspace.yaml")],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    peak, stop = [0], threading.Event()

    def sample() -> None:
        from benchmarks.run import _tree_rss

        watched = psutil.Process(daemon.pid)
        while not stop.is_set():
            try:
                peak[0] = max(peak[0], _tree_rss(watched))
            except psutil.Error:
                return
            stop.wait(0.5)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    os.environ["DAGSTER_HOME"] = env["DAGSTER_HOME"]
    os.environ["CDC_TABLES_FILE"] = env["CDC_TABLES_FILE"]
    names = [table_name(i) for i in range(n)]
    try:
        with dg.DagsterInstance.get() as instance:
            done_at = None
            deadline = time.monotonic() + 3600
            while time.monotonic() < deadline:
                if daemon.poll() is not None:
                    raise RuntimeError(f"the daemon exited {daemon.returncode}; log {log}")
                state = _progress(instance, names, hour_key)
                if state == "done":
                    done_at = time.monotonic()
                    break
                if state == "failed":
                    raise RuntimeError(f"fleet-{n}: a run ended without every table; {log}")
                time.sleep(2)
            if done_at is None:
                raise RuntimeError(f"fleet-{n}: not every table's hour within an hour; {log}")
            if hold is not None:
                _log(
                    f"fleet-{n}: hour done; the daemon runs on for {hold - time.monotonic():.0f} s"
                )
                _hold(instance, daemon, hold, log)
            result = {"wall_s": round(done_at - started, 1), **_run_figures(instance, n)}
            materialized = _materializations(instance, names)
            if hold is not None:
                result["tier0"] = _tier0_figures(instance, materialized, hour_key)
            (case_dir / "frontier.json").write_text(json.dumps(_frontiers(materialized)))
    finally:
        stop.set()
        sampler.join()
        os.killpg(daemon.pid, signal.SIGTERM)
        try:
            daemon.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(daemon.pid, signal.SIGKILL)
    result["peak_rss_bytes"] = peak[0]
    result["table_hours_per_minute"] = round(n / result["wall_s"] * 60, 1)
    return result


def _progress(instance, names: list[str], hour_key: str) -> str:
    """ "done" when every table's hour and its checks are recorded, "failed" when the runs
    ended without them, else "running"."""
    import dagster as dg

    runs = instance.get_runs(
        filters=dg.RunsFilter(tags={TRIGGER_TAG: SENSOR_TRIGGER, "dagster/partition": hour_key})
    )
    runs = [r for r in runs if REFRESH_TAG not in r.tags]  # the hour's own runs
    finished = bool(runs) and all(r.is_finished for r in runs)
    records = instance.get_asset_records([dg.AssetKey(name) for name in names])
    materialized = {
        r.asset_entry.asset_key.to_user_string()
        for r in records
        if r.asset_entry.last_materialization is not None
        and r.asset_entry.last_materialization.dagster_event.partition == hour_key
    }
    if len(materialized) < len(names) or not finished:
        return "failed" if finished and len(materialized) < len(names) else "running"
    evaluations = 0
    for run in runs:
        evaluations += len(
            instance.get_records_for_run(
                run.run_id, of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION, limit=100_000
            ).records
        )
    wanted = sum(len(run_check_names_for(name)) for name in names)
    return "done" if evaluations >= wanted else "failed"


def run_check_names_for(name: str) -> list[str]:
    from cdc_assets.config import load_tables
    from checks.table_checks import run_check_names

    specs = _specs_cache.get("specs")
    if specs is None:
        specs = _specs_cache["specs"] = {
            s.name: s for s in load_tables(os.environ["CDC_TABLES_FILE"])
        }
    return run_check_names(specs[name])


_specs_cache: dict = {}


def _hold(instance, daemon, until: float, log: Path) -> None:
    """Lets the daemon run until `until`, then until no run is queued or in flight (at most
    20 minutes more)."""
    import dagster as dg

    while time.monotonic() < until:
        if daemon.poll() is not None:
            raise RuntimeError(f"the daemon exited {daemon.returncode}; log {log}")
        time.sleep(5)
    deadline = time.monotonic() + 1200
    while time.monotonic() < deadline:
        if not instance.get_runs(filters=dg.RunsFilter(statuses=_not_done())):
            return
        time.sleep(5)
    raise RuntimeError(f"runs still in flight 20 minutes after the window; {log}")


def _not_done():
    import dagster as dg

    return [
        dg.DagsterRunStatus.QUEUED,
        dg.DagsterRunStatus.NOT_STARTED,
        dg.DagsterRunStatus.STARTING,
        dg.DagsterRunStatus.STARTED,
    ]


def _materializations(instance, names: list[str]) -> dict[str, list]:
    """Every materialization record of each table (read once: the figures and the frontiers
    use them)."""
    import dagster as dg

    return {
        name: instance.fetch_materializations(dg.AssetKey(name), limit=10_000).records
        for name in names
    }


def _tier0_figures(instance, materialized: dict[str, list], hour_key: str) -> dict:
    """Each run's wait in the queue (created → started) by kind, and each tier-0 mirror's
    staleness just before each commit from its first commit in the hour after `hour_key`."""
    import dagster as dg

    from cdc_assets.config import load_tables
    from sensors.offset_progress import PRIORITIES, PRIORITY_TAG

    waits: dict[str, list[float]] = {"refresh": [], "tier0_final": [], "hourly": []}
    run_s: dict[str, list[float]] = {"refresh": [], "tier0_final": [], "hourly": []}
    for record in instance.get_run_records(
        filters=dg.RunsFilter(tags={TRIGGER_TAG: SENSOR_TRIGGER})
    ):
        run = record.dagster_run
        kind = (
            "refresh"
            if REFRESH_TAG in run.tags
            else "tier0_final"
            if run.tags.get(PRIORITY_TAG) == str(PRIORITIES["tier0"])
            else "hourly"
        )
        if record.start_time is None:
            continue
        created = record.create_timestamp
        created = created if created.tzinfo else created.replace(tzinfo=UTC)
        waits[kind].append(round(record.start_time - created.timestamp(), 1))
        if record.end_time is not None:
            run_s[kind].append(round(record.end_time - record.start_time, 1))
    tier0 = [s.name for s in load_tables(os.environ["CDC_TABLES_FILE"]) if s.refresh_minutes]
    live_key = (
        datetime.strptime(hour_key, HOUR_FORMAT).replace(tzinfo=UTC) + timedelta(hours=1)
    ).strftime(HOUR_FORMAT)
    stale, commits = [], 0
    for name in tier0:
        points = sorted(
            (r.timestamp, m.metadata["freshness_seconds"].value, m.partition)
            for r in materialized[name]
            if "freshness_seconds" in (m := r.asset_materialization).metadata
        )
        first = next((i for i, p in enumerate(points) if p[2] >= live_key), None)
        if first is None:
            continue
        points = points[first:]
        commits += len(points)
        for (t0, f0, _), (t1, _, _) in zip(points, points[1:], strict=False):
            stale.append(t1 - (t0 - f0))
    refresh_run = max(run_s["refresh"], default=0.0)
    return {
        "tables": len(tier0),
        "queue_wait_s": {k: max(v, default=None) for k, v in waits.items()},
        "runs": {k: len(v) for k, v in waits.items()},
        "run_s_max": {k: max(v, default=None) for k, v in run_s.items()},
        "commits_since_live_hour": commits,
        "staleness_max_s": round(max(stale), 1) if stale else None,
        "staleness_goal_s": round(REFRESH_MINUTES * 60 + refresh_run, 1),
    }


def _frontiers(materialized: dict[str, list]) -> dict[str, dict[str, int]]:
    """Per table and partition, the end offset of what its materializations read."""
    out = {}
    for name, materializations in materialized.items():
        ends: dict[str, int] = {}
        for record in materializations:
            offsets = record.asset_materialization.metadata.get("kafka_offsets")
            for partition, read in (offsets.value if offsets else {}).items():
                ends[partition] = max(ends.get(partition, 0), read["end"])
        out[name] = ends
    return out


_TABLE_TIME = re.compile(r"(fleet_\d+) \S+: consumed (\d+).*\(([\d.]+) s\)")


def _run_figures(instance, n: int) -> dict:
    """The sensor's tick, the runs, and each table-hour's time, from the instance."""
    import dagster as dg

    runs = instance.get_runs(filters=dg.RunsFilter(tags={TRIGGER_TAG: SENSOR_TRIGGER}))
    per_table = []
    run_walls = []
    for run in runs:
        stats = instance.get_run_stats(run.run_id)
        if stats.start_time and stats.end_time:
            run_walls.append(round(stats.end_time - stats.start_time, 1))
        for entry in instance.all_logs(run.run_id):
            match = _TABLE_TIME.search(entry.user_message or "")
            if match:
                per_table.append((match.group(1), int(match.group(2)), float(match.group(3))))
    small = sorted(s for _, consumed, s in per_table if consumed > 0)
    empty = sorted(s for _, consumed, s in per_table if consumed == 0)
    return {
        "runs": len(runs),
        "run_wall_s": run_walls,
        "table_hour_s": {
            "median_small": small[len(small) // 2] if small else None,
            "median_empty": empty[len(empty) // 2] if empty else None,
            "max": max((s for *_, s in per_table), default=None),
        },
    }


# ---------------------------------------------------------------- children


def warm(hour_key: str) -> int:
    """H0 of every table in one run of the mirrors' multi-asset, recorded in this instance (so
    the sensor finds it materialized with its slice and asks only for H1)."""
    import dagster as dg

    from cdc_assets.config import load_tables
    from cdc_assets.factory import build_mirror_assets
    from resources.environment import driver_jit_from_env
    from resources.kafka import KafkaResource
    from resources.lake import LakeResource
    from resources.spark import SparkResource

    specs = load_tables(os.environ["CDC_TABLES_FILE"])
    with dg.DagsterInstance.get() as instance:
        result = dg.materialize(
            build_mirror_assets(specs, checks=MIRROR_CHECKS),
            partition_key=hour_key,
            instance=instance,
            resources={
                "kafka": KafkaResource(bootstrap_servers=os.environ["CDC_KAFKA_BOOTSTRAP_SERVERS"]),
                "spark": SparkResource(driver_jit=driver_jit_from_env()),
                "lake": LakeResource(root=os.environ["CDC_LAKE_ROOT"]),
            },
            raise_on_error=False,
        )
    return 0 if result.success else 1


def replay(sent: list[list], frontier: dict[str, int]) -> dict[str, dict | None]:
    """A table's rows by key (as text; None: deleted) after the changes it was sent, in order,
    up to the offsets its materializations read (`frontier`: partition → end)."""
    rows: dict[str, dict | None] = {}
    for partition, offset, key, row in sent:
        if offset < frontier.get(str(partition), 0):
            rows[str(key)] = row
    return rows


def check(case_dir: str) -> int:
    """Every mirror's live rows of the changed keys against the replay, row for row."""
    from pyspark.sql import functions as F

    from resources.spark import SparkResource

    case = Path(case_dir)
    sent = json.loads((case / "sent.json").read_text())
    frontiers = json.loads((case / "frontier.json").read_text())
    references = {name: replay(changes, frontiers[name]) for name, changes in sent.items()}
    spark = SparkResource(master="local[2]", driver_memory="2g").session
    wrong = {}
    for name, reference in references.items():
        path = case / "lake" / name
        rows = spark.read.format("delta").load(str(path))
        live = {
            str(r[PRIMARY_KEY]): r.asDict()
            for r in rows.where(~F.col("_cdc_deleted")).select(*COLUMNS).collect()
        }
        expected = {k: v for k, v in reference.items() if v is not None}
        differ = [k for k in expected if k not in live or not _same(live[k], expected[k])]
        extra = [k for k in live if k not in expected]
        if differ or extra:
            wrong[name] = {"differ": len(differ), "extra": len(extra)}
    (case / "check.json").write_text(
        json.dumps(
            {"tables": len(references), "equal": len(references) - len(wrong), "wrong": wrong}
        )
    )
    return 0 if not wrong else 1


def _same(stored: dict, expected: dict) -> bool:
    from decimal import Decimal

    for column, kind in COLUMNS.items():
        got, want = stored[column], expected[column]
        if kind == "timestamp":
            got = None if got is None else int(got.timestamp() * 1_000_000)
        elif kind == "date":
            got = None if got is None else (got - datetime(1970, 1, 1).date()).days
        elif kind.startswith("decimal"):
            want = None if want is None else Decimal(want)
        if got != want:
            return False
    return True


def delta_rs(case_dir: str, bootstrap: str, keys_json: str) -> int:
    """delta-rs doing the same: each table's H0 then, timed, H1, merged table by table."""
    from benchmarks import variants

    case = Path(case_dir)
    tables = yaml.safe_load((case / "tables.yaml").read_text())["tables"]
    keys = json.loads(keys_json)
    from deltalake import write_deltalake

    slices = _hour_slices(bootstrap, [t["topic"] for t in tables], keys)
    root = case / "delta-rs"
    timings = []
    for h, key in enumerate(keys):
        started = time.monotonic()
        for table in tables:
            path = root / table["name"]
            if h == 0:
                write_deltalake(str(path), _empty_arrow_table())
            part = slices[table["topic"]][key]
            if not any(end > start for start, end in part.values()):
                continue
            job = {
                "bootstrap": bootstrap,
                "topic": table["topic"],
                "slice": part,
                "table": str(path),
                "skip_invalid": True,
            }
            variants.T0 = time.monotonic()
            variants.delta_rs(job, {})
        timings.append(round(time.monotonic() - started, 2))
    (case / "delta-rs.json").write_text(
        json.dumps({"first_hour_s": timings[0], "hour_s": timings[1], "tables": len(tables)})
    )
    return 0


def _empty_arrow_table():
    import pyarrow as pa

    from benchmarks.workload import arrow_json_type, arrow_table_values

    return pa.table(
        {
            c: arrow_table_values(pa.array([], arrow_json_type(kind)), kind)
            for c, kind in COLUMNS.items()
        }
    )


def _hour_slices(bootstrap: str, topics: list[str], keys: list[str]) -> dict:
    """Per topic and hour: partition → [start, end) by the records' timestamps."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, isolation_level="read_committed")
    try:
        out = {}
        bounds = [datetime.strptime(k, HOUR_FORMAT).replace(tzinfo=UTC) for k in keys]
        bounds.append(bounds[-1] + timedelta(hours=1))
        tps = [TopicPartition(t, p) for t in topics for p in range(PARTITIONS)]
        ends = consumer.end_offsets(tps)
        at = []
        for bound in bounds:
            found = consumer.offsets_for_times({tp: int(bound.timestamp() * 1000) for tp in tps})
            at.append({tp: ends[tp] if found[tp] is None else found[tp].offset for tp in tps})
        for topic in topics:
            out[topic] = {
                key: {
                    str(p): [at[h][TopicPartition(topic, p)], at[h + 1][TopicPartition(topic, p)]]
                    for p in range(PARTITIONS)
                }
                for h, key in enumerate(keys)
            }
        return out
    finally:
        consumer.close()


def figures(case_dir: str, hour_key: str) -> int:
    """`python -m benchmarks.fleet figures CASE_DIR HOUR`: a tier-0 case's queue waits, run
    times and staleness (`_tier0_figures`), and its sensor runs one per line, read from the
    case's Dagster instance after it stopped (a case that missed its deadline writes no
    results). HOUR is the measured hour, the one before the live hour."""
    import dagster as dg

    case = Path(case_dir).resolve()
    os.environ["DAGSTER_HOME"] = str(case / "dagster")
    os.environ["CDC_TABLES_FILE"] = str(case / "tables.yaml")
    names = [t["name"] for t in yaml.safe_load((case / "tables.yaml").read_text())["tables"]]
    with dg.DagsterInstance.get() as instance:
        materialized = _materializations(instance, names)
        print(json.dumps(_tier0_figures(instance, materialized, hour_key), indent=1))
        done = [n for n in names if any(
            r.asset_materialization.partition == hour_key for r in materialized[n]
        )]  # fmt: skip
        print(f"{len(done)} of {len(names)} tables materialized {hour_key}")
        records = instance.get_run_records(
            filters=dg.RunsFilter(tags={TRIGGER_TAG: SENSOR_TRIGGER})
        )
        print("created   started   ended     status    kind     tables")
        for record in sorted(records, key=lambda r: r.create_timestamp):
            run = record.dagster_run

            def at(stamp: float | None) -> str:
                return "-" if stamp is None else f"{datetime.fromtimestamp(stamp, UTC):%H:%M:%S}"

            kind = "refresh" if REFRESH_TAG in run.tags else run.tags.get("dagster/priority", "")
            print(
                f"{record.create_timestamp:%H:%M:%S}  {at(record.start_time):8}  "
                f"{at(record.end_time):8}  {run.status.value:8}  {kind:7}  "
                f"{len(run.asset_selection or [])}"
            )
    return 0


def main(argv: list[str]) -> int:
    command, *args = argv
    if command == "figures":  # the one a person runs (docs/benchmark.md)
        import argparse

        parser = argparse.ArgumentParser(prog="python -m benchmarks.fleet figures")
        parser.add_argument(
            "case_dir", help="the case's folder, e.g. .local/bench/fleet-200-tier0-50"
        )
        parser.add_argument("hour", help="the measured hour, YYYY-MM-DD-HH:00")
        parsed = parser.parse_args(args)
        return figures(parsed.case_dir, parsed.hour)
    return {"warm": warm, "check": check, "delta-rs": delta_rs}[command](*args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
