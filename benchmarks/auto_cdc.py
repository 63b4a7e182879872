"""Spark's own AUTO CDC (Spark Declarative Pipelines, pyspark 4.2) beside the project's path.

Two uses:

- The benchmark's `auto-cdc` variant (`benchmarks/variants.py` calls `bench_variant`): the
  hour's Kafka slice, decoded with `from_json` as `naive` does, applied by one AUTO CDC flow
  (SCD type 1, keys `id`, sequence `source.lsn`, deletes where `op = 'd'`) into a Delta
  streaming table the pipeline owns.
- `python -m benchmarks.auto_cdc scenario`: the correctness scenario. Five keys over three
  hours; the hours reach AUTO CDC out of order (hour 3, then 1, then 2), one key is deleted in
  hour 3 and updated by older changes in hours 1 and 2, one is deleted in hour 2 after hour 3
  re-created it. The final table is compared with the plain-Python replay of the whole log in
  sequence order (newest change per key wins, a deleted key is absent), key by key.

Here (pyspark 4.2.0, delta-spark 4.4.0) the flow cannot start: AUTO CDC requires its target
table to implement Spark's `SupportsRowLevelOperations`, and no table of the installed jars
does (Delta's `DeltaTableV2` merges through Delta's own analyzer rule instead). Both uses then
report `AUTOCDC_TARGET_DOES_NOT_SUPPORT_MERGE` with the time spent up to it; docs/benchmark.md
("Spark's AUTO CDC") has what was tried.

The pipeline runs in-process, as `spark-pipelines run` does it: a local Spark Connect server
(a classic session with Spark's Connect plugin, the project's jars and Delta catalog, on a
free port), a Connect client session, a dataflow graph registered from Python and one run of
it. Every run is triggered (each flow reads what is available, then stops).

The starting table goes in as `r` events with sequence 0 (older than every event's lsn),
through the same flow: AUTO CDC allows exactly one flow into its target and the target must
be created by the pipeline, so the plain starting table can't be reused as it is. They reach
AUTO CDC through a bronze streaming table `changes` that two append flows fill: `start_rows`
(the plain Delta table, in the setup run) and `hour` (the Kafka slice, added for the hour's
run), so that the setup and the hour are two runs timed apart. The cost: the hour's events are
appended once more, to `changes`, before AUTO CDC reads them (the floor's work, about).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
UNSUPPORTED = "AUTOCDC_TARGET_DOES_NOT_SUPPORT_MERGE"
SEQUENCE, OP = "_lsn", "_op"  # the source's helper columns, not in the target
START_SEQUENCE = 0  # the starting rows' sequence: older than every event's lsn


class AutoCdcCannotRun(RuntimeError):
    """The pipeline refused to start the AUTO CDC flow (its first line of error)."""


# ---------------------------------------------------------------- the session and a run


@contextlib.contextmanager
def connect_session(work: Path, app: str, driver_memory: str = "4g") -> Iterator:
    """A Spark Connect session on a local server started here, with the project's jars and
    Delta catalog; managed tables go under `work/warehouse`. Stops both at the end."""
    from pyspark.sql import SparkSession
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    from devtools.processes import port_free
    from resources.spark import SparkResource

    port = 15102
    while not port_free(port):
        port += 1
    os.environ.setdefault("SPARK_CONNECT_AUTHENTICATE_TOKEN", str(uuid.uuid4()))
    conf = SparkResource(driver_memory=driver_memory).spark_config()
    builder = SparkSession.builder.appName(app)
    for key in (
        "spark.master",
        "spark.jars",
        "spark.driver.memory",
        "spark.sql.extensions",
        "spark.sql.catalog.spark_catalog",
        "spark.ui.enabled",
        "spark.ui.showConsoleProgress",
        "spark.sql.session.timeZone",
        "spark.sql.shuffle.partitions",
    ):
        builder = builder.config(key, conf[key])
    server = (
        builder.config("spark.plugins", "org.apache.spark.sql.connect.SparkConnectPlugin")
        .config("spark.connect.grpc.binding.port", str(port))
        .config("spark.sql.warehouse.dir", str(work / "warehouse"))
        # A failing flow fails the run at once (the default retries it twice, ~15 s of backoff).
        .config("spark.sql.pipelines.maxFlowRetryAttempts", "0")
        .getOrCreate()
    )
    # pyspark.sql.functions builds Connect columns from here on (as pyspark's own local mode).
    os.environ["SPARK_CONNECT_MODE_ENABLED"] = "1"
    spark = ConnectSession.builder.remote(f"sc://localhost:{port}").getOrCreate()
    try:
        yield spark
    finally:
        with contextlib.suppress(Exception):
            spark.stop()
        os.environ.pop("SPARK_CONNECT_MODE_ENABLED", None)
        server.stop()


def run_pipeline(spark, storage: Path, define: Callable[[], None]) -> list[str]:
    """Registers the graph `define` declares and runs it once (triggered); its event log.
    Raises AutoCdcCannotRun when the AUTO CDC flow cannot start on its target."""
    from pyspark.pipelines.add_pipeline_analysis_context import add_pipeline_analysis_context
    from pyspark.pipelines.graph_element_registry import graph_element_registration_context
    from pyspark.pipelines.spark_connect_graph_element_registry import (
        SparkConnectGraphElementRegistry,
    )
    from pyspark.pipelines.spark_connect_pipeline import create_dataflow_graph, start_run

    graph = create_dataflow_graph(spark, default_catalog=None, default_database=None, sql_conf={})
    registry = SparkConnectGraphElementRegistry(spark, graph)
    with (
        graph_element_registration_context(registry),
        add_pipeline_analysis_context(spark=spark, dataflow_graph_id=graph, flow_name=None),
    ):
        define()
    events: list[str] = []
    results = start_run(
        spark,
        graph,
        full_refresh=None,
        full_refresh_all=False,
        refresh=None,
        dry=False,
        storage=storage.resolve().as_uri(),
    )
    try:
        for result in results:
            if "pipeline_event_result" in result:
                event = result["pipeline_event_result"].event
                events.append(event.message)
                stamp = event.timestamp.ToDatetime()
                print(f"[pipeline {stamp:%H:%M:%S}] {event.message}", file=sys.stderr)
    except Exception as error:  # pyspark's Connect exceptions carry the server's error class
        first = str(error).splitlines()[0]
        if UNSUPPORTED in first:
            raise AutoCdcCannotRun(first) from error
        raise
    return events


# ---------------------------------------------------------------- the graph


def source_frame(kafka_frame):
    """A Kafka frame's Debezium values as AUTO CDC's source rows: the 15 columns of the
    after-image (the key from the before-image for a delete), the sequence and the op."""
    from pyspark.sql import functions as F

    from benchmarks.variants import _decoded_schema, _typed_columns
    from benchmarks.workload import COLUMNS, PRIMARY_KEY

    events = F.from_json(F.col("value").cast("string"), _decoded_schema()).alias("e")
    frame = kafka_frame.select(events).select(
        F.coalesce("e.after.id", "e.before.id").alias("_key"),
        F.col("e.source.lsn").alias(SEQUENCE),
        F.col("e.op").alias(OP),
        *_typed_columns("e.after"),
    )
    columns = [F.col("_key").alias(c) if c == PRIMARY_KEY else F.col(c) for c in COLUMNS]
    return frame.select(*columns, SEQUENCE, OP)


def kafka_stream(spark, kafka: dict):
    """The topic as a stream: from the slice's first offsets (`slice`), else from the earliest.
    A triggered run reads up to the end of the topic: the benchmark's topic holds one case."""
    reader = (
        spark.readStream.format("kafka")
        .option("kafka.bootstrap.servers", kafka["bootstrap"])
        .option("kafka.isolation.level", "read_committed")
    )
    topic = kafka["topic"]
    if "slice" in kafka:
        slice_ = kafka["slice"]
        reader = reader.option("assign", json.dumps({topic: [int(p) for p in slice_]})).option(
            "startingOffsets", json.dumps({topic: {p: r[0] for p, r in slice_.items()}})
        )
    else:
        reader = reader.option("subscribe", topic).option("startingOffsets", "earliest")
    return reader.load()


def define_graph(spark, *, start_table: str | None, kafka: dict | None) -> Callable[[], None]:
    """Bronze `changes` (append flows `start_rows` and `hour`) → one AUTO CDC flow → TABLE."""

    def define() -> None:
        from pyspark import pipelines as dp
        from pyspark.sql import functions as F

        from benchmarks.workload import COLUMNS, PRIMARY_KEY, TABLE

        dp.create_streaming_table("changes", format="delta")
        if start_table is not None:

            @dp.append_flow(target="changes", name="start_rows")
            def start_rows():
                rows = spark.readStream.format("delta").load(start_table)
                return rows.select(
                    *COLUMNS,
                    F.lit(START_SEQUENCE).cast("bigint").alias(SEQUENCE),
                    F.lit("r").alias(OP),
                )

        if kafka is not None:

            @dp.append_flow(target="changes", name="hour")
            def hour():
                return source_frame(kafka_stream(spark, kafka))

        dp.create_streaming_table(TABLE, format="delta")
        dp.create_auto_cdc_flow(
            target=TABLE,
            source="changes",
            keys=[PRIMARY_KEY],
            sequence_by=SEQUENCE,
            apply_as_deletes=f"{OP} = 'd'",
            except_column_list=[SEQUENCE, OP],
            stored_as_scd_type=1,
        )

    return define


def probe(spark, work: Path) -> None:
    """A one-row AUTO CDC flow into a Delta table of its own: raises AutoCdcCannotRun at once
    when the target is refused. (A run starts AUTO CDC after the flows it reads from, so the
    setup run would append every starting row before the refusal.)"""
    from pyspark import pipelines as dp

    source = work / "probe-source"
    spark.range(1).selectExpr("id", "1L AS seq").write.format("delta").save(str(source))

    def define() -> None:
        @dp.temporary_view(name="probe_changes")
        def probe_changes():
            return spark.readStream.format("delta").load(str(source))

        dp.create_streaming_table("probe_target", format="delta")
        dp.create_auto_cdc_flow(
            target="probe_target",
            source="probe_changes",
            keys=["id"],
            sequence_by="seq",
            stored_as_scd_type=1,
        )

    run_pipeline(spark, work / "probe-storage", define)


def _delta_version(table: Path) -> int:
    return max((int(p.stem) for p in (table / "_delta_log").glob("*.json")), default=-1)


# ---------------------------------------------------------------- the benchmark's variant


def bench_variant(job: dict, phases: dict, t0: float) -> dict:
    """The `auto-cdc` variant: a probe, the setup run (the starting rows), the hour's run.
    `{"cannot_run": error}` when the flow cannot start on its target (here: always)."""
    from kafka import KafkaConsumer, TopicPartition

    work = Path(job["table"]).parents[1]  # the run's folder: warehouse/<table> is the target
    kafka = {"bootstrap": job["bootstrap"], "topic": job["topic"], "slice": job["slice"]}
    consumer = KafkaConsumer(bootstrap_servers=job["bootstrap"], isolation_level="read_committed")
    try:  # a triggered run reads to the topic's end: that must be the slice's end
        tps = [TopicPartition(job["topic"], int(p)) for p in job["slice"]]
        ends = {str(tp.partition): end for tp, end in consumer.end_offsets(tps).items()}
    finally:
        consumer.close()
    if any(ends[p] != r[1] for p, r in job["slice"].items()):
        raise RuntimeError(f"the topic holds more than the slice: ends {ends}, {job['slice']}")
    with connect_session(work, f"bench-{job['variant']}") as spark:
        phases["session"] = time.monotonic() - t0
        try:
            probe(spark, work)
        except AutoCdcCannotRun as error:
            phases["probe"] = time.monotonic() - t0
            return {"cannot_run": str(error), "failed_in": "probe"}
        phases["probe"] = time.monotonic() - t0
        try:
            run_pipeline(
                spark, work / "storage", define_graph(spark, start_table=job["start"], kafka=None)
            )
        except AutoCdcCannotRun as error:
            phases["setup"] = time.monotonic() - t0
            return {"cannot_run": str(error), "failed_in": "setup"}
        phases["setup"] = time.monotonic() - t0
        setup_version = _delta_version(Path(job["table"]))
        run_pipeline(
            spark, work / "storage", define_graph(spark, start_table=job["start"], kafka=kafka)
        )
        phases["hour"] = time.monotonic() - t0
    return {"setup_version": setup_version}


# ---------------------------------------------------------------- the correctness scenario

HOUR_MS = 3_600_000
APPLIED = (3, 1, 2)  # the order the hours reach AUTO CDC
# (hour, key, op, lsn): the source's log. Each change's image names its lsn (`note`), so a
# row tells which change it holds.
LOG = (
    (1, 1, "c", 101),
    (1, 2, "c", 102),
    (1, 3, "c", 103),
    (1, 4, "c", 104),
    (1, 5, "c", 105),
    (1, 1, "u", 106),
    (2, 1, "u", 201),
    (2, 2, "u", 202),  # older than hour 3's update of key 2
    (2, 3, "u", 203),  # older than hour 3's delete of key 3: a late, older update
    (2, 4, "d", 204),  # older than hour 3's re-insert of key 4: a late, older delete
    (2, 5, "d", 205),
    (3, 2, "u", 301),
    (3, 3, "d", 302),
    (3, 4, "c", 303),
)


def scenario_events(first_hour_ms: int) -> dict[int, list]:
    """The log as Debezium events (benchmarks/workload.py's encoding), by hour."""
    from benchmarks.workload import Event, start_row

    state: dict[int, dict | None] = {}
    by_hour: dict[int, list] = {h: [] for h in (1, 2, 3)}
    for hour, key, op, lsn in LOG:
        before = state.get(key)
        row = None
        if op != "d":
            row = dict(start_row(key), status="paid" if op == "u" else "new")
            row["note"] = f"key {key} lsn {lsn}"
        state[key] = row
        stamp = first_hour_ms + (hour - 1) * HOUR_MS + lsn % 100 * 1000
        by_hour[hour].append(Event(key, op, lsn, stamp, row, before))
    return by_hour


def replay(changes: list[tuple[int, int, str, int]]) -> dict[int, str | None]:
    """The whole log in sequence order: key → the note of its newest change, None: deleted."""
    newest: dict[int, tuple[int, str]] = {}
    for _hour, key, op, lsn in sorted(changes, key=lambda c: c[3]):
        newest[key] = (lsn, op)
    return {k: None if op == "d" else f"key {k} lsn {lsn}" for k, (lsn, op) in newest.items()}


def merge_on_key(order: tuple[int, ...]) -> dict[int, str | None]:
    """What a MERGE on the key alone leaves (each hour deduplicated, newest per key, then
    applied over the table), the hours applied in `order`: naive's and delta-rs's logic."""
    table: dict[int, str | None] = {}
    for hour in order:
        for key, note in replay([c for c in LOG if c[0] == hour]).items():
            table[key] = note
    return table


def _differences(got: dict[int, str | None], want: dict[int, str | None]) -> list[dict]:
    out = []
    for key in sorted(set(got) | set(want)):
        g, w = got.get(key), want.get(key)
        if g != w:
            out.append({"key": key, "expected": w or "absent", "got": g or "absent"})
    return out


def scenario(work: Path) -> dict:
    """Runs the scenario through AUTO CDC on a broker of its own; the verdict."""
    from kafka import KafkaAdminClient, KafkaProducer

    from benchmarks.workload import TABLE
    from demo.produce import ensure_topics
    from devtools import kafka_broker
    from devtools.processes import port_free

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    want = {k: v for k, v in replay(list(LOG)).items() if v is not None}
    naive = {k: v for k, v in merge_on_key(APPLIED).items() if v is not None}
    out: dict = {
        "applied_order": list(APPLIED),
        "log": [f"hour {h}: {op} key {k} lsn {lsn}" for h, k, op, lsn in LOG],
        "expected": want,
        "merge_on_key": {"table": naive, "differences": _differences(naive, want)},
    }
    port = 19192
    while not (port_free(port) and port_free(port + 1)):
        port += 2
    broker = kafka_broker.BrokerConfig(port=port, data_dir=work / "kafka", heap="512m")
    bootstrap = kafka_broker.start(broker)
    topic = "scenario.auto_cdc"
    t0 = time.monotonic()
    producer = None
    try:
        admin = KafkaAdminClient(bootstrap_servers=bootstrap)
        try:
            ensure_topics(admin, [topic], partitions=1, configs={"retention.ms": "-1"})
        finally:
            admin.close()
        producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
        events = scenario_events(first_hour_ms=1_767_225_600_000)  # 2026-01-01 00:00 UTC
        kafka = {"bootstrap": bootstrap, "topic": topic}
        runs = []
        with connect_session(work, "auto-cdc-scenario", driver_memory="2g") as spark:
            define = define_graph(spark, start_table=None, kafka=kafka)
            for hour in APPLIED:  # the hour's events reach the topic, then a triggered run
                for event in events[hour]:
                    producer.send(
                        topic,
                        key=event.kafka_key(),
                        value=event.kafka_value(),
                        timestamp_ms=event.timestamp_ms,
                    )
                producer.flush()
                start = time.monotonic()
                try:
                    run_pipeline(spark, work / "storage", define)
                except AutoCdcCannotRun as error:
                    out["auto_cdc"] = {"cannot_run": str(error), "failed_at_hour": hour}
                    out["auto_cdc"]["runs_s"] = runs
                    return out
                runs.append({"hour": hour, "s": round(time.monotonic() - start, 1)})
            rows = spark.read.table(TABLE).select("id", "note").collect()
        got: dict[int, str | None] = {r["id"]: r["note"] for r in rows}
        out["auto_cdc"] = {
            "table": got,
            "rows": len(rows),
            "differences": _differences(got, want),
            "runs_s": runs,
        }
        return out
    finally:
        out["wall_s"] = round(time.monotonic() - t0, 1)
        if producer is not None:
            producer.close()
        kafka_broker.stop(broker)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="AUTO CDC's correctness scenario")
    parser.add_argument("command", choices=["scenario"])
    parser.add_argument("--work", default=str(REPO / ".local" / "auto-cdc-scenario"))
    args = parser.parse_args(argv)
    result = scenario(Path(args.work).resolve())
    print(json.dumps(result, indent=2))
    (Path(args.work) / "result.json").write_text(json.dumps(result, indent=2))
    auto = result["auto_cdc"]
    if auto.get("cannot_run"):
        print(f"\nAUTO CDC cannot run here: {auto['cannot_run']}", file=sys.stderr)
        return 2
    return 0 if not auto["differences"] else 1


if __name__ == "__main__":
    sys.exit(main())
