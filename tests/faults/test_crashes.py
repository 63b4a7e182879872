"""Fault scenarios 2 and 12: a run killed around its Delta commit, a broker restarted mid-read.

Scenario 2 (I4, atomic runs). The hour runs through Dagster in a child process
(tests/faults/hour_child.py) with its own Spark JVM, over a table that holds the previous hour,
and the child's whole process group gets SIGKILL

- (a) "files": as soon as a data file of the run's MERGE is on disk, before its commit is in
  `_delta_log`;
- (b) "commit": as soon as the commit is in `_delta_log`, before Dagster has recorded the
  materialization.

The parent finds the moment by polling the table directory every 2 ms. Afterwards it checks
which point was really hit (a: no new commit, orphaned data files; b: the commit, and no
materialization in the Dagster instance) and retries a kill that came too late on a fresh
copy of the table. The table must then read as its previous (a) or next (b) version, and a rerun
through Dagster gives the reference replay of Kafka, with no data-changing commit in (b).

Scenario 12. The broker of this module alone is stopped while Spark reads the hour's slice and
started again a few seconds later. The run fails with an exception or succeeds, within a bound;
either way a rerun gives the reference replay.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import dagster as dg
import pytest
from delta.tables import DeltaTable
from kafka import KafkaProducer
from kafka.admin import KafkaAdminClient, NewTopic

from cdc_assets.config import TableSpec
from cdc_assets.factory import build_table_asset
from cdc_assets.hour_run import run_hour
from checks.table_checks import MIRROR_CHECKS
from demo.reference import replay
from devtools import kafka_broker
from resources.kafka import KafkaResource
from resources.lake import LakeResource
from tests.conftest import _free_port
from tests.faults.figures import compare, record
from tests.faults.hour_child import TAGS as CHILD_TAGS
from tests.faults.hour_child import dagster_home
from tests.support import accounts_spec, read_topic

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
PREVIOUS = datetime(2026, 11, 3, 8, tzinfo=UTC)  # fills the table before the killed hour
HOUR = PREVIOUS + timedelta(hours=1)
HOUR_END = HOUR + timedelta(hours=1)
KEY = HOUR.strftime("%Y-%m-%d-%H:%M")
PREVIOUS_KEY = PREVIOUS.strftime("%Y-%m-%d-%H:%M")
PARTITIONS = 3

# Scenario 2: the table holds PREVIOUS_ROWS rows, the killed hour brings HOUR_CHANGES changes.
PREVIOUS_ROWS = 1_000
HOUR_CHANGES = 3_000
POINTS = ("files", "commit")
ATTEMPTS = 3  # per kill point, each on a fresh copy of the table
POLL_S = 0.002
CHILD_BOOT_S = 240  # a child's Spark session, on a busy two-core machine
CHILD_RUN_S = 240  # from the job to the kill point

# Scenario 12: a slice read in small fetches that each wait on the broker, so the read lasts
# a few seconds on any machine and the broker goes down under it.
RESTART_CHANGES = 1_500
RESTART_PAD = 200  # bytes of connector detail per change, so the slice spans many fetches
FETCH_BYTES = 16 * 1024
FETCH_WAIT_MS = 200
RESTART_PAUSE_S = 2
RUN_BOUND_S = 150  # longer than Spark's Kafka poll timeout (120 s): beyond it the run hangs


# --- Kafka: the hours and their reference ---------------------------------------------------


@dataclass(frozen=True)
class Change:
    partition: int
    row_id: int
    value: bytes
    timestamp_ms: int


def _ms(moment: datetime) -> int:
    return int(moment.timestamp() * 1000)


def _envelope(op: str, row_id: int, lsn: int, name: str, balance: str, pad: str = "") -> bytes:
    row = {"id": row_id, "name": name, "balance": balance}
    source = {"lsn": lsn, "ts_ms": 0}
    if pad:
        source["db"] = pad  # connector detail the mirror ignores
    return json.dumps(
        {
            "op": op,
            "before": row if op == "d" else None,
            "after": None if op == "d" else row,
            "source": source,
        }
    ).encode()


def _generate(
    *, previous_rows: int, changes: int, seed: int, pad: int = 0
) -> tuple[list[Change], list[Change]]:
    """(the previous hour: inserts of ids 0..previous_rows-1, the hour: creates, updates and
    deletes). A key keeps its partition (id mod PARTITIONS), the sequence (lsn) grows, the
    timestamps spread over each hour, and every partition gets one change stamped past the
    hour, so that it is closed."""
    rng = random.Random(seed)
    padding = "x" * pad
    lsn = 1_000
    previous: list[Change] = []

    def stamp(start: datetime, i: int, n: int) -> int:
        return _ms(start) + i * 3_500_000 // max(n, 1)

    for i in range(previous_rows):
        lsn += 1
        value = _envelope("c", i, lsn, f"n{i}", f"{i % 1000}.00", padding)
        previous.append(Change(i % PARTITIONS, i, value, stamp(PREVIOUS, i, previous_rows)))
    live, next_id = list(range(previous_rows)), previous_rows
    hour: list[Change] = []
    for i in range(changes):
        lsn += 1
        draw = rng.random()
        if draw < 0.4 and live:
            row_id, op = rng.choice(live), "u"
        elif draw < 0.5 and live:
            row_id, op = live.pop(rng.randrange(len(live))), "d"
        else:
            row_id, op, next_id = next_id, "c", next_id + 1
            live.append(row_id)
        value = _envelope(
            op, row_id, lsn, f"v{lsn}", f"{rng.randrange(100_000) / 100:.2f}", padding
        )
        hour.append(Change(row_id % PARTITIONS, row_id, value, stamp(HOUR, i, changes)))
    for p in range(PARTITIONS):
        lsn += 1
        row_id = 10_000_000 + p
        value = _envelope("c", row_id, lsn, "next hour", "0.00")
        hour.append(Change(p, row_id, value, _ms(HOUR_END) + 1_000 + p))
    return previous, hour


def _create_topic(bootstrap: str, topic: str) -> None:
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        admin.create_topics([NewTopic(topic, num_partitions=PARTITIONS, replication_factor=1)])
    finally:
        admin.close()


def _delete_topic(bootstrap: str, topic: str) -> None:
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        admin.delete_topics([topic])
    finally:
        admin.close()


def _produce(bootstrap: str, topic: str, changes: list[Change], batch_bytes: int) -> None:
    producer = KafkaProducer(
        bootstrap_servers=bootstrap, acks="all", linger_ms=20, batch_size=batch_bytes
    )
    try:
        for change in changes:
            producer.send(
                topic,
                key=json.dumps({"id": change.row_id}).encode(),
                value=change.value,
                timestamp_ms=change.timestamp_ms,
                partition=change.partition,
            )
        producer.flush(timeout=60)
    finally:
        producer.close()


@dataclass(frozen=True)
class Reference:
    """What Kafka committed before a moment, replayed: live rows by key, and every key seen."""

    expected: dict[tuple, dict]
    seen: set[tuple]


def _reference(spec: TableSpec, bootstrap: str, until: datetime) -> Reference:
    records = [(p, o, v) for p, o, v, ts in read_topic(bootstrap, spec.topic) if ts < _ms(until)]
    seen = set()
    for _, _, value in records:
        envelope = json.loads(value)
        seen.add(((envelope["after"] or envelope["before"])["id"],))
    return Reference(replay(spec, records), seen)


# --- The child process ----------------------------------------------------------------------


def _group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group `pgid`."""
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        state, _ppid, group = stat[stat.rindex(")") + 2 :].split()[:3]
        if int(group) == pgid and state != "Z":
            members.append(int(entry.name))
    return members


class Child:
    """A tests.faults.hour_child process: its own session, process group and Spark JVM."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        workdir.mkdir(parents=True)
        self.log_path = workdir / "child.log"
        paths = [str(REPO), os.environ.get("PYTHONPATH", "")]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.faults.hour_child", str(workdir)],
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=workdir,
                env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)},
                start_new_session=True,  # a process group of its own, the JVM included
            )
        self.signalled = False

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def wait_ready(self) -> None:
        deadline = time.monotonic() + CHILD_BOOT_S
        while not (self.workdir / "ready").exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"the child exited while booting:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the child took over {CHILD_BOOT_S}s to boot")
            time.sleep(0.05)

    def start(self, job: dict) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(job).encode())
        self.proc.stdin.close()

    def signal_kill(self) -> None:
        """SIGKILL to the whole process group: the Python process and its Spark JVM."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.signalled = True
        except ProcessLookupError:
            pass

    def reap(self) -> None:
        """Waits until no process of the group is left."""
        self.proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while survivors := _group_members(self.proc.pid):
            assert time.monotonic() < deadline, f"processes {survivors} survived SIGKILL"
            time.sleep(0.05)

    @property
    def result(self) -> dict | None:
        path = self.workdir / "result.json"
        return json.loads(path.read_text()) if path.exists() else None


class Children:
    """Children booted ahead of need, so their Spark start overlaps the parent's work."""

    def __init__(self, root: Path, warm: int):
        self.root = root
        self.all: list[Child] = []
        self.idle = [self._spawn() for _ in range(warm)]

    def _spawn(self) -> Child:
        child = Child(self.root / f"child{len(self.all)}")
        self.all.append(child)
        return child

    def take(self) -> Child:
        return self.idle.pop(0) if self.idle else self._spawn()

    def close(self) -> None:
        for child in self.all:
            if child.proc.poll() is None:
                child.signal_kill()
            child.reap()


# --- Watching the table ---------------------------------------------------------------------


def _data_files(table: Path) -> set[str]:
    """The table's data files (Parquet, change data, deletion vectors), relative paths."""
    names = set()
    for folder, prefix in ((table, ""), (table / "_change_data", "_change_data/")):
        try:
            with os.scandir(folder) as entries:
                for entry in entries:
                    if not entry.name.startswith(".") and entry.name.endswith((".parquet", ".bin")):
                        names.add(prefix + entry.name)
        except FileNotFoundError:
            pass
    return names


def _commit_file(table: Path, version: int) -> Path:
    return table / "_delta_log" / f"{version:020d}.json"


def _versions(table: Path) -> list[int]:
    names = os.listdir(table / "_delta_log")
    return sorted(int(n[:20]) for n in names if len(n) == 25 and n.endswith(".json"))


def _actions(table: Path, version: int) -> list[dict]:
    return [json.loads(line) for line in _commit_file(table, version).read_text().splitlines()]


def _data_changing(actions: list[dict]) -> bool:
    return any(a.get(kind, {}).get("dataChange") for a in actions for kind in ("add", "remove"))


def _operation(actions: list[dict]) -> str | None:
    return next((a["commitInfo"].get("operation") for a in actions if "commitInfo" in a), None)


# --- Scenario 2: killed around the Delta commit ---------------------------------------------


@dataclass
class Attempt:
    point: str
    child: Child
    lake: LakeResource
    home: Path  # the Dagster instance the child and the rerun share
    table: Path
    prior: int  # the table's version before the run
    before: set[str]  # its data files before the run
    orphans: set[str] | None = None  # data files the run left; None: it ended unkilled


@dataclass
class Kills:
    hit: dict[str, Attempt] = field(default_factory=dict)
    signals: dict[str, int] = field(default_factory=lambda: dict.fromkeys(POINTS, 0))
    misses: dict[str, list[str]] = field(default_factory=lambda: {p: [] for p in POINTS})


def _materializations(home: Path, spec: TableSpec) -> tuple[list, list]:
    """The hour's recorded materializations and the child's runs in the instance at `home`."""
    instance = dg.DagsterInstance.local_temp(tempdir=str(home))
    try:
        records = instance.fetch_materializations(dg.AssetKey(spec.name), limit=100).records
        runs = instance.get_runs(filters=dg.RunsFilter(tags=CHILD_TAGS))
    finally:
        instance.dispose()
    return [r for r in records if r.asset_materialization.partition == KEY], runs


def _watch_and_kill(attempts: list[Attempt]) -> None:
    """Polls every table each POLL_S and kills its child at its point, or sees the run end."""
    pending = list(attempts)
    deadline = time.monotonic() + CHILD_RUN_S
    while pending:
        for attempt in list(pending):
            if attempt.point == "files":
                hit = bool(_data_files(attempt.table) - attempt.before)
            else:
                hit = _commit_file(attempt.table, attempt.prior + 1).exists()
            if hit:
                attempt.child.signal_kill()
            if hit or attempt.child.proc.poll() is not None:
                pending.remove(attempt)
        if time.monotonic() > deadline:
            for attempt in pending:
                attempt.child.signal_kill()
            raise AssertionError(f"no kill point reached in {CHILD_RUN_S}s: {pending}")
        time.sleep(POLL_S)
    for attempt in attempts:
        attempt.child.reap()
        if attempt.child.signalled:
            attempt.orphans = _data_files(attempt.table) - attempt.before


def _judge(attempt: Attempt, spec: TableSpec) -> str | None:
    """Why the kill missed its point; None when it hit it."""
    if attempt.orphans is None:
        result = attempt.child.result
        if result is None or not result["success"]:
            return f"the run failed before the kill ({result}):\n{attempt.child.log_tail()}"
        return f"the run ended before the kill ({result})"
    versions = _versions(attempt.table)
    recorded, runs = _materializations(attempt.home, spec)
    if attempt.point == "files" and versions[-1] != attempt.prior:
        return f"its commit {versions[-1]} slipped in before the kill"
    if attempt.point == "commit" and recorded:
        return "Dagster recorded the materialization before the kill"
    # Hit: the run started in Dagster and never finished, nothing was recorded, and the log
    # ends at the previous (files) or at the next version (commit).
    assert len(runs) == 1 and runs[0].status != dg.DagsterRunStatus.SUCCESS, runs
    assert not recorded
    assert versions[-1] == attempt.prior + (attempt.point == "commit"), versions
    return None


@pytest.fixture(scope="module")
def children(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Children]:
    """One warm child per kill point, booting while the parent prepares the table."""
    pool = Children(tmp_path_factory.mktemp("children"), warm=len(POINTS))
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def crash_hours(broker: str) -> Iterator[tuple[TableSpec, Reference, Reference]]:
    """The topic: the previous hour and the hour; the references after each."""
    spec = accounts_spec(f"crash-{os.getpid()}-{time.monotonic_ns()}")
    _create_topic(broker, spec.topic)
    previous, hour = _generate(previous_rows=PREVIOUS_ROWS, changes=HOUR_CHANGES, seed=2)
    _produce(broker, spec.topic, previous + hour, batch_bytes=256 * 1024)
    yield spec, _reference(spec, broker, HOUR), _reference(spec, broker, HOUR_END)
    _delete_topic(broker, spec.topic)


@pytest.fixture(scope="module")
def kills(children, crash_hours, broker, spark_resource, tmp_path_factory) -> Kills:
    """Both kill points, their children running side by side; a miss retries on a fresh copy
    of the table, up to ATTEMPTS times per point."""
    spec = crash_hours[0]
    root = tmp_path_factory.mktemp("kills")
    template = LakeResource(root=str(root / "template"))
    run_hour(
        checks=MIRROR_CHECKS,
        spark=spark_resource.session,
        kafka=KafkaResource(bootstrap_servers=broker),
        lake=template,
        spec=spec,
        hour_key=PREVIOUS_KEY,
    )
    outcome = Kills()
    for round_ in range(ATTEMPTS):
        attempts = []
        for point in POINTS:
            if point in outcome.hit:
                continue
            lake = LakeResource(root=str(root / f"{point}{round_}" / "lake"))
            table = Path(lake.table_path(spec.name))
            shutil.copytree(template.table_path(spec.name), table)
            child = children.take()
            child.wait_ready()
            home = dagster_home(child.workdir)
            attempt = Attempt(point, child, lake, home, table, _versions(table)[-1], set())
            attempt.before = _data_files(table)
            attempts.append(attempt)
        if not attempts:
            break
        for attempt in attempts:
            attempt.child.start(
                {
                    "bootstrap": broker,
                    "lake_root": attempt.lake.root,
                    "spec": spec.model_dump_json(),
                    "hour_key": KEY,
                }
            )
        _watch_and_kill(attempts)
        for attempt in attempts:
            outcome.signals[attempt.point] += attempt.child.signalled
            miss = _judge(attempt, spec)
            if miss is None:
                outcome.hit[attempt.point] = attempt
            else:
                outcome.misses[attempt.point].append(f"attempt {round_}: {miss}")
    return outcome


def _killed(kills: Kills, point: str) -> Attempt:
    if point not in kills.hit:
        pytest.fail(
            f"the kill never hit '{point}' in {ATTEMPTS} attempts: {'; '.join(kills.misses[point])}"
        )
    return kills.hit[point]


def _rerun_in_dagster(attempt: Attempt, spec, broker, spark_resource) -> None:
    instance = dg.DagsterInstance.local_temp(tempdir=str(attempt.home))
    try:
        result = dg.materialize(
            [build_table_asset(checks=MIRROR_CHECKS, spec=spec)],
            partition_key=KEY,
            instance=instance,
            resources={
                "kafka": KafkaResource(bootstrap_servers=broker),
                "spark": spark_resource,
                "lake": attempt.lake,
            },
        )
        assert result.success
    finally:
        instance.dispose()
    recorded, _ = _materializations(attempt.home, spec)
    assert len(recorded) == 1


def _commits_after(attempt: Attempt, version: int) -> list[list[dict]]:
    return [_actions(attempt.table, v) for v in _versions(attempt.table) if v > version]


def test_a_run_killed_before_its_delta_commit_leaves_the_previous_version(
    kills, crash_hours, broker, spark_resource
):
    spec, before, after = crash_hours
    killed = _killed(kills, "files")
    spark, path = spark_resource.session, str(killed.table)
    # The MERGE's files are on disk, and no commit references them: readers see the previous
    # version, row for row.
    assert killed.orphans
    assert DeltaTable.forPath(spark, path).history(1).first()["version"] == killed.prior
    assert compare(path, spec, before.expected, before.seen).clean

    _rerun_in_dagster(killed, spec, broker, spark_resource)
    commits = _commits_after(killed, killed.prior)
    assert [_operation(c) for c in commits if _data_changing(c)] == ["MERGE"], commits
    comparison = compare(path, spec, after.expected, after.seen)
    record("killed_before_delta_commit", comparison, faults=kills.signals["files"])
    assert comparison.clean, comparison


def test_a_run_killed_after_its_commit_before_dagster_recorded_it_reruns_without_changes(
    kills, crash_hours, broker, spark_resource
):
    spec, _, after = crash_hours
    killed = _killed(kills, "commit")
    path = str(killed.table)
    committed = _actions(killed.table, killed.prior + 1)
    assert _operation(committed) == "MERGE" and _data_changing(committed)
    # The next version holds the whole hour already.
    assert compare(path, spec, after.expected, after.seen).clean

    _rerun_in_dagster(killed, spec, broker, spark_resource)
    commits = _commits_after(killed, killed.prior + 1)
    # The rerun finds every change applied: it records its slice and changes no data.
    assert not [c for c in commits if _data_changing(c)], commits
    assert "SET TBLPROPERTIES" in [_operation(c) for c in commits], commits
    comparison = compare(path, spec, after.expected, after.seen)
    record("killed_after_commit_before_dagster", comparison, faults=kills.signals["commit"])
    assert comparison.clean, comparison


# --- Scenario 12: the broker restarted mid-read ---------------------------------------------


@pytest.fixture(scope="module")
def private_broker(tmp_path_factory) -> Iterator[kafka_broker.BrokerConfig]:
    """A broker of this module alone: stopping it leaves the session's broker alone."""
    config = kafka_broker.BrokerConfig(
        port=_free_port(),
        controller_port=_free_port(),
        data_dir=tmp_path_factory.mktemp("kafka-restart"),
    )
    kafka_broker.start(config)
    yield config
    kafka_broker.stop(config)


class SlowFetchKafka(KafkaResource):
    """The same cluster, read by Spark in small fetches that each wait FETCH_WAIT_MS on the
    broker (fetch.min.bytes is never reached): the read takes seconds, not milliseconds."""

    def spark_options(self) -> dict[str, str]:
        return {
            **super().spark_options(),
            "kafka.max.partition.fetch.bytes": str(FETCH_BYTES),
            "kafka.fetch.min.bytes": str(32 * 1024 * 1024),
            "kafka.fetch.max.wait.ms": str(FETCH_WAIT_MS),
        }


def test_a_broker_restarted_mid_read_fails_the_run_cleanly_or_not_at_all(
    private_broker, spark, tmp_path
):
    bootstrap = private_broker.bootstrap
    spec = accounts_spec(f"restart-{os.getpid()}")
    _create_topic(bootstrap, spec.topic)
    _, hour = _generate(previous_rows=0, changes=RESTART_CHANGES, seed=12, pad=RESTART_PAD)
    # Small producer batches: a fetch returns whole batches.
    _produce(bootstrap, spec.topic, hour, batch_bytes=FETCH_BYTES // 2)
    reference = _reference(spec, bootstrap, HOUR_END)
    lake = LakeResource(root=str(tmp_path / "lake"))
    group = f"restart-{time.monotonic_ns()}"
    outcome: dict = {}

    def run() -> None:
        spark.sparkContext.setJobGroup(group, "the hour the broker restarts under")
        try:
            outcome["result"] = run_hour(
                checks=MIRROR_CHECKS,
                spark=spark,
                kafka=SlowFetchKafka(bootstrap_servers=bootstrap),
                lake=lake,
                spec=spec,
                hour_key=KEY,
                local_read_max_records=0,  # Spark's Kafka source reads it, however small
            )
        except Exception as exc:  # the clean failure the scenario allows
            outcome["error"] = exc

    tracker = spark.sparkContext.statusTracker()
    thread = threading.Thread(target=run, daemon=True)
    started = time.monotonic()
    thread.start()
    # The run's first Spark job reads the slice (kafka-python found its offsets before).
    while not (jobs := tracker.getJobIdsForGroup(group)):
        assert thread.is_alive(), f"the run ended before Spark read anything: {outcome}"
        assert time.monotonic() - started < RUN_BOUND_S, "the run started no Spark job"
        time.sleep(0.01)
    read_job = min(jobs)
    kafka_broker.stop(private_broker)
    # Still reading once the broker is gone (or failed by its going): it went down mid-read.
    info = tracker.getJobInfo(read_job)
    down_mid_read = info is not None and info.status in ("RUNNING", "FAILED")
    time.sleep(RESTART_PAUSE_S)
    kafka_broker.start(private_broker)
    thread.join(timeout=RUN_BOUND_S)
    if thread.is_alive():
        spark.sparkContext.cancelJobGroup(group)
        pytest.fail(f"the run still hangs {RUN_BOUND_S}s after the broker went down")
    assert down_mid_read, (
        f"the read (Spark job {read_job}) had ended before the broker was down: {info}"
    )
    if "result" in outcome:  # it rode out the restart: then it read the whole slice
        assert outcome["result"].counts.consumed == RESTART_CHANGES
    else:  # it failed while reading: before writing anything
        assert not Path(lake.table_path(spec.name), "_delta_log").exists(), outcome["error"]

    # Whichever way the run went, running the hour again gives the reference.
    kafka = KafkaResource(bootstrap_servers=bootstrap)
    run_hour(checks=MIRROR_CHECKS, spark=spark, kafka=kafka, lake=lake, spec=spec, hour_key=KEY)
    comparison = compare(lake.table_path(spec.name), spec, reference.expected, reference.seen)
    record("broker_restarted_mid_read", comparison, faults=1)
    assert comparison.clean, comparison
    _delete_topic(bootstrap, spec.topic)
