"""What a small table-hour costs on a started session, and where the JVM's CPU goes.

    PYTHONPATH=. .venv/bin/python -m benchmarks.small_hours   # 10 hours of 200 changes
    PYTHONPATH=. .venv/bin/python -m benchmarks.small_hours --conf spark.sql.adaptive.enabled=true
    PYTHONPATH=. .venv/bin/python -m benchmarks.small_hours --stages   # and each stage's time
    PYTHONPATH=. .venv/bin/python -m benchmarks.small_hours --jobs     # the last hour's Spark jobs
    PYTHONPATH=. .venv/bin/python -m benchmarks.small_hours --history  # with `history: true`
    PYTHONPATH=. .venv/bin/python -m benchmarks.small_hours --history --stages --hot-keys 5
    PYTHONPATH=. .venv/bin/python -m benchmarks.small_hours --history --tracked --stages
    PYTHONPATH=. .venv/bin/python -m benchmarks.small_hours --interpreted-max-bytes 0

Starts its own Kafka broker (`.local/bench/small-hours`), sends HOURS hours of CHANGES creates
and updates of an accounts table over 500 keys, then runs the hours in order through `run_hour`
with every check, on one Spark session configured as the tests' (`local[2]`, 2g driver, 4
shuffle partitions, one partition for a Delta log's replay), plus any `--conf`. For each hour it
prints its wall time, the CPU seconds of the Spark JVM and of this process, and the classes
Spark's code generation compiled. The first hours warm the JVM up (its JIT compilers take a
large share of its CPU for minutes); the summary is the mean over the hours from the fourth on.
Every mirror is compared with the plain-Python replay of its topic at the end. Not part of the
tests; run it on an idle machine.

`--stages` also times the hour run's stages (`cdc_assets.hour_run`) and the steps inside them
that cost a Spark job or a Delta commit (`STAGES`), and prints each one's mean over the warm
hours: a stage's time includes the steps listed under it. `--jobs` lists the Spark jobs of the
last hour (Spark's status store: each job's time, stages, tasks, call site and description), to
set against its wall time: the rest is the driver's work between jobs.

`--hot-keys N` sends a tenth of each hour's changes to N keys, the rest over all 500: those keys
gain ~20/N versions an hour, so a history run that read a key's whole past would grow hour by
hour; with `--stages` each hour's line gives its history stage's time to show it does not.

`--tracked` (with `--history`) tracks no column (`history_columns: []`): every update folds
into its key's one version, the most a fold can do; the history's changes go to
`accounts__history_changes` and each hour also folds them (its own stage with `--stages`).

`--toasted` (with `--history`) declares `name` a TOASTed column (every change carries it): the
mirror's and the history's TOASTed-value work runs, the history's look for primary-key moves
(`cdc_assets.history_moves`, its own stage with `--stages`) included, though none is sent.

`--interpreted-max-bytes 0` has every hour generate code for its expressions (`run_hour`'s
setting; by default hours into a mirror under 1 MiB run interpreted), to compare the two.

The floor: after each hour, the same session runs a bare guarded MERGE of that hour's newest
changes (the run's own MERGE source, captured) into a second table that takes every hour's
MERGE the same way (`<work>/lake/floor`, created with the mirror's properties):
`whenMatchedUpdateAll(condition="s._cdc_sequence > t._cdc_sequence").whenNotMatchedInsertAll()`,
nothing else, under the hour's own session settings (`hour_run.sized_shuffles`). Each hour's
line prints it and ours/floor; the summary gives the warm hours' mean ratio: the figure the
hour's Spark budget is judged by (DESIGN.md).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psutil
from kafka import KafkaAdminClient, KafkaProducer
from kafka.admin import NewTopic

from cdc_assets.commits import stored_table
from cdc_assets.config import TableSpec
from cdc_assets.hour_run import run_hour
from checks.table_checks import MIRROR_CHECKS
from demo.reference import history, replay, tracked_history
from devtools import kafka_broker
from devtools.processes import port_free
from resources.kafka import KafkaResource
from resources.lake import LakeResource
from resources.spark import INTERPRETED_MAX_BYTES, SparkResource, compiled_classes

REPO = Path(__file__).resolve().parents[1]
# The mirror's properties the floor table is created with (what changes a MERGE's work).
FLOOR_PROPERTIES = ("delta.enableDeletionVectors", "delta.enableChangeDataFeed")
FIRST = datetime(2026, 11, 4, 8, tzinfo=UTC)
HOUR_FORMAT = "%Y-%m-%d-%H:%M"
PARTITIONS = 3
KEYS = 500
WARM_FROM = 3  # hours before this one warm the JVM up and are left out of the mean


def _spec(history: bool = False, tracked: bool = False, toasted: bool = False) -> TableSpec:
    return TableSpec(
        name="accounts",
        topic="small-hours",
        primary_key=("id",),
        columns={"id": "bigint", "name": "string", "balance": "bigint"},
        start_hour="2026-11-01-00:00",
        decimal_handling="string",
        history=history,
        history_columns=() if tracked else None,
        toasted_columns=("name",) if toasted else (),
    )


def _events(hours: int, changes: int, hot_keys: int = 0) -> list[tuple[int, bytes, bytes]]:
    """(timestamp ms, key, value): creates and updates, LSNs increasing, seconds into each hour;
    with `hot_keys`, a tenth of the changes go to keys 0 to hot_keys - 1."""
    rng, lsn, out = random.Random(1), 1_000, []
    for hour in range(hours):
        for n in range(changes):
            lsn += 10
            hot = hot_keys and rng.random() < 0.1
            row_id = rng.randrange(hot_keys) if hot else rng.randrange(KEYS)
            at = int((FIRST + timedelta(hours=hour, seconds=1 + n)).timestamp() * 1000)
            envelope = {
                "op": rng.choice("cu"),
                "before": None,
                "after": {"id": row_id, "name": f"n{lsn}", "balance": lsn},
                "source": {"lsn": lsn, "ts_ms": at},
                "ts_ms": at,
            }
            key = json.dumps({"id": row_id}).encode()
            out.append((at, key, json.dumps(envelope).encode()))
    return out


def _send(bootstrap: str, topic: str, hours: int, changes: int, hot_keys: int) -> list[tuple]:
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        admin.create_topics([NewTopic(topic, num_partitions=PARTITIONS, replication_factor=1)])
    finally:
        admin.close()
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
    records = []
    try:
        for at, key, value in _events(hours, changes, hot_keys):
            meta = producer.send(topic, key=key, value=value, timestamp_ms=at).get(timeout=30)
            records.append((meta.partition, meta.offset, value, key, ()))
        # A tombstone of an unused key past the last hour on every partition closes the hours.
        close = int((FIRST + timedelta(hours=hours, seconds=1)).timestamp() * 1000)
        for p in range(PARTITIONS):
            key = json.dumps({"id": 10**9}).encode()
            producer.send(topic, key=key, value=None, timestamp_ms=close, partition=p).get(30)
    finally:
        producer.close()
    return records


HISTORY_STAGE = "keep history (history: true)"
# (module, function, label): what `--stages` times, outermost first. A step is timed where its
# caller looks it up (the module attribute the caller reads), so the caller's module is named.
STAGES = [
    ("cdc_assets.hour_run", "HourContext.start", "start (the mirror's log, read without Spark)"),
    ("cdc_assets.hour_run", "plan", "plan (Kafka offsets, the slice)"),
    ("cdc_assets.hour_run", "stored_mirror", "stored mirror (its schema, from its log)"),
    ("cdc_assets.hour_run", "read", "read"),
    ("cdc_assets.hour_run", "decode_hour", "decode"),
    ("cdc_assets.hour_run", "audit", "audit (hard expectations)"),
    ("cdc_assets.hour_run", "apply", "apply"),
    ("cdc_assets.hour_run", "_run_record", "  the run's record"),
    ("cdc_assets.hour_batch", "DriverBatch.applicable", "  the changes it takes, counted"),
    ("cdc_assets.hour_batch", "DriverBatch.latest", "  newest change per key (in memory)"),
    ("cdc_assets.merge", "ensure_mirror_table", "  create or check the mirror"),
    ("delta.tables", "DeltaMergeBuilder.execute", "  MERGE"),
    ("cdc_assets.merge", "_outcome", "  its figures, from its commit"),
    ("cdc_assets.toast", "resolve_moves", "  moved rows' TOASTed values"),
    ("cdc_assets.hour_run", "keep_history", HISTORY_STAGE),
    ("cdc_assets.hour_run", "write_history", "  its MERGE (the keys' versions re-derived)"),
    ("cdc_assets.hour_run", "follow_moves", "  its moves' TOASTed values (--toasted)"),
    ("cdc_assets.hour_run", "fold_history", "  its fold (--tracked)"),
    ("cdc_assets.hour_run", "validate", "validate (expectations)"),
    ("checks.expectations", "_validate", "  great-expectations"),
    ("cdc_assets.hour_run", "account", "account"),
]


@contextmanager
def _timed_stages(times: dict[str, float]) -> Iterator[None]:
    """Wraps each of `STAGES` to add its wall time to `times[label]` while inside."""
    import importlib

    undo = []
    for module_name, attribute, label in STAGES:
        owner = importlib.import_module(module_name)
        *path, name = attribute.split(".")
        for part in path:
            owner = getattr(owner, part)
        original = owner.__dict__[name]
        function = original.__func__ if isinstance(original, classmethod) else original

        def timed(*args, _f=function, _label=label, **kwargs):
            began = time.monotonic()
            try:
                return _f(*args, **kwargs)
            finally:
                times[_label] += time.monotonic() - began

        setattr(owner, name, classmethod(timed) if isinstance(original, classmethod) else timed)
        undo.append((owner, name, original))
    try:
        yield
    finally:
        for owner, name, original in reversed(undo):
            setattr(owner, name, original)


def _cmdline(process: psutil.Process) -> str:
    """A child's command line; "" for one that has exited (a zombie until it is reaped)."""
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


def _cpu(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


@contextmanager
def _nothing() -> Iterator[None]:
    yield


@contextmanager
def _captured_sources(sources: list) -> Iterator[None]:
    """Keeps each mirror MERGE's source (`merge_changes`' `latest`) the run makes, for the
    floor to MERGE the same rows."""
    from cdc_assets import hour_run

    original = hour_run.merge_changes

    def capturing(spark, spec, path, latest, **kwargs):
        sources.append(latest)
        return original(spark, spec, path, latest, **kwargs)

    hour_run.merge_changes = capturing
    try:
        yield
    finally:
        hour_run.merge_changes = original


def _floor(
    spark, spec: TableSpec, path: str, latest, properties: dict[str, str], interpreted: bool
) -> float:
    """Seconds of a bare guarded MERGE of `latest` into the floor table at `path` (created
    with `properties` by the first call), under a small hour's session settings (`interpreted`
    as the run's: its mirror stays under `--interpreted-max-bytes`)."""
    from delta.tables import DeltaTable
    from pyspark.sql import functions as F

    from cdc_assets.columns import INGESTED_AT
    from cdc_assets.hour_run import merge_source, sized_shuffles
    from cdc_assets.rule import mirror_columns

    source = latest.withColumn(INGESTED_AT, F.current_timestamp()).select(*mirror_columns(spec))
    if not DeltaTable.isDeltaTable(spark, path):
        builder = DeltaTable.createIfNotExists(spark).location(path).addColumns(source.schema)
        for name, value in properties.items():
            builder = builder.property(name, value)
        builder.execute()
    table = DeltaTable.forPath(spark, path)
    on = " AND ".join(f"t.`{k}` = s.`{k}`" for k in spec.primary_key)
    with (
        sized_shuffles(spark, 1, adaptive=False, interpreted=interpreted),
        merge_source(spark, materialized=False),
    ):
        began = time.monotonic()
        (
            table.alias("t")
            .merge(source.alias("s"), on)
            .whenMatchedUpdateAll(condition="s._cdc_sequence > t._cdc_sequence")
            .whenNotMatchedInsertAll()
            .execute()
        )
        return time.monotonic() - began


def _jobs(spark) -> list:
    """Spark's record of every job this session ran (its status store, kept for the UI)."""
    listed = spark._jsparkSession.sparkContext().statusStore().jobsList(None)
    return sorted((listed.apply(i) for i in range(listed.size())), key=lambda j: j.jobId())


def _print_jobs(jobs: list, wall_s: float) -> None:
    """One line per job: its time, stages, tasks, call site and description."""
    total = 0
    for job in jobs:
        began, ended = job.submissionTime(), job.completionTime()
        ms = ended.get().getTime() - began.get().getTime() if ended.isDefined() else 0
        total += ms
        what = job.description().get() if job.description().isDefined() else ""
        print(
            f"  job {job.jobId():4d} {ms:5d} ms, {job.stageIds().size()} stages, "
            f"{job.numTasks()} tasks: {job.name()[:60]} | {what[:60]}"
        )
    print(f"  {len(jobs)} jobs, {total / 1000:.2f} s of the hour's {wall_s:.2f} s wall")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hours", type=int, default=10)
    parser.add_argument("--changes", type=int, default=200, help="changes per hour")
    parser.add_argument("--conf", action="append", default=[], help="KEY=VALUE, a Spark setting")
    parser.add_argument("--stages", action="store_true", help="time the hour run's stages")
    parser.add_argument("--jobs", action="store_true", help="list the last hour's Spark jobs")
    parser.add_argument("--history", action="store_true", help="the table keeps its history")
    parser.add_argument("--tracked", action="store_true", help="and tracks no column in it")
    parser.add_argument(
        "--toasted", action="store_true", help="and `name` is a TOASTed column (history only)"
    )
    parser.add_argument(
        "--hot-keys", type=int, default=0, help="a tenth of the changes go to this many keys"
    )
    parser.add_argument(
        "--interpreted-max-bytes",
        type=int,
        default=INTERPRETED_MAX_BYTES,
        help="run_hour's setting: mirrors smaller than this run interpreted (0: never)",
    )
    parser.add_argument("--work", default=str(REPO / ".local" / "bench" / "small-hours"))
    args = parser.parse_args(argv)
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    extra = dict(item.split("=", 1) for item in args.conf)
    port = 29092  # away from the tests' free ports and the ingest benchmark's 19092
    while not (port_free(port) and port_free(port + 1)):
        port += 2
    broker = kafka_broker.BrokerConfig(port=port, data_dir=work / "kafka")
    bootstrap = kafka_broker.start(broker)
    try:
        if (args.tracked or args.toasted) and not args.history:
            parser.error("--tracked and --toasted need --history")
        spec = _spec(args.history, args.tracked, args.toasted)
        records = _send(bootstrap, spec.topic, args.hours, args.changes, args.hot_keys)
        resource = SparkResource(
            master="local[2]", shuffle_partitions=4, delta_snapshot_partitions=1, extra_conf=extra
        )
        spark = resource.session
        me = psutil.Process()
        # The session's JVM (the broker is a child of this process too).
        (jvm,) = [c for c in me.children(recursive=True) if "SparkSubmit" in _cmdline(c)]
        kafka = KafkaResource(bootstrap_servers=bootstrap)
        lake = LakeResource(root=str(work / "lake"))
        rows, stages = [], []
        timed_history = args.history and args.stages
        for hour in range(args.hours):
            key = (FIRST + timedelta(hours=hour)).strftime(HOUR_FORMAT)
            stages.append(defaultdict(float))
            # The newest job id before the last hour (the store keeps only the newest jobs).
            jobs_before = (
                max((j.jobId() for j in _jobs(spark)), default=-1)
                if args.jobs and hour == args.hours - 1
                else None
            )
            before = (time.monotonic(), _cpu(jvm), _cpu(me), compiled_classes(spark))
            sources: list = []
            with (
                _timed_stages(stages[-1]) if args.stages else _nothing(),
                _captured_sources(sources),
            ):
                result = run_hour(
                    spark=spark, kafka=kafka, lake=lake, spec=spec, hour_key=key,
                    checks=MIRROR_CHECKS, interpreted_max_bytes=args.interpreted_max_bytes,
                )  # fmt: skip
            after = (time.monotonic(), _cpu(jvm), _cpu(me), compiled_classes(spark))
            wall, jvm_s, python_s, compiles = (a - b for a, b in zip(after, before, strict=True))
            failed = [c.expectation.name for c in result.expectations if not c.success]
            stored = stored_table(spark, lake.table_path(spec.name))
            properties = {k: v for k, v in stored.properties.items() if k in FLOOR_PROPERTIES}
            floor = _floor(
                spark,
                spec,
                str(work / "lake" / "floor"),
                sources[0],
                properties,
                interpreted=args.interpreted_max_bytes > 0,
            )
            rows.append((wall, jvm_s, python_s, compiles, floor, wall / floor))
            if jobs_before is not None:
                last_jobs = ([j for j in _jobs(spark) if j.jobId() > jobs_before], wall)
            print(
                f"hour {hour}: {wall:5.2f} s wall, JVM {jvm_s:5.2f} s CPU, Python "
                f"{python_s:4.2f} s CPU, {compiles:3d} classes compiled, "
                f"{result.counts.applied} changes applied, floor {floor:.2f} s, "
                f"ours/floor {wall / floor:.2f}"
                + (f", history {stages[-1][HISTORY_STAGE]:.2f} s" if timed_history else "")
                + (f", FAILED {failed}" if failed else ""),
                flush=True,
            )
        warm = rows[WARM_FROM:] or rows
        means = [statistics.mean(column) for column in zip(*warm, strict=True)]
        print(
            f"hours {WARM_FROM}-{args.hours - 1}, mean: {means[0]:.2f} s wall, "
            f"JVM {means[1]:.2f} s CPU, Python {means[2]:.2f} s CPU, "
            f"{means[3]:.0f} classes compiled, floor {means[4]:.2f} s, ours/floor "
            f"{means[5]:.2f}" + (f" (settings: {extra})" if extra else "")
        )
        if args.jobs:
            print(f"hour {args.hours - 1}'s Spark jobs:")
            _print_jobs(*last_jobs)
        if args.stages:
            warm_stages = stages[WARM_FROM:] or stages
            for _, _, label in STAGES:
                mean = statistics.mean(s[label] for s in warm_stages)
                print(f"  {label:<52} {mean:5.2f} s")
        expected = replay(spec, records)
        table = spark.read.format("delta").load(lake.table_path(spec.name))
        mirror = {row["id"]: row.asDict() for row in table.where("NOT _cdc_deleted").collect()}
        wrong = [
            k
            for k, row in expected.items()
            if k[0] not in mirror or any(mirror[k[0]][c] != row[c] for c in spec.columns)
        ]
        print(f"mirror against the replay: {len(expected)} keys, {len(wrong)} differ")
        versions_differ = False
        if args.history:
            stored = spark.read.format("delta").load(lake.table_path(f"{spec.name}__history"))
            reference = tracked_history if args.tracked else history
            versions = sum(len(v) for v in reference(spec, records).values())
            versions_differ = stored.count() != versions
            print(f"history: {stored.count()} versions, the reference's {versions}")
        return 1 if wrong or len(mirror) != len(expected) or versions_differ else 0
    finally:
        kafka_broker.stop(broker)


if __name__ == "__main__":
    raise SystemExit(main())
