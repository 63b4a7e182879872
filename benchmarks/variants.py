"""One benchmark variant, run in a process of its own: `python -m benchmarks.variants JOB.json`.

The parent (benchmarks/run.py) measures the process from outside (wall time, peak RSS of its
tree) and reads what it wrote to the job's `result` file: phase times and counts.

- floor: Spark reads the slice, decodes it with `from_json` and appends it to Parquet.
- ours: the project's asset, materialized by Dagster (`dg.materialize`) as a run does.
- ours-history: the same with `history: true` (the table's history beside the mirror).
- naive: a fresh Spark session, window dedupe, MERGE on the key alone, default shuffle width.
- delta-rs: kafka-python reads the slice into Arrow, dedupe in Arrow, delta-rs MERGE.
- auto-cdc: Spark's own AUTO CDC (Spark Declarative Pipelines), `benchmarks/auto_cdc.py`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from checks.table_checks import MIRROR_CHECKS

T0 = time.monotonic()

# The driver heap of floor, ours and naive. 4g by default; CDC_BENCH_SPARK_MEMORY=2g runs them
# with SparkResource's default, the heap a deployment gets when it sets none.
SPARK_MEMORY_ENV = "CDC_BENCH_SPARK_MEMORY"
SPARK_MEMORY = os.environ.get(SPARK_MEMORY_ENV, "4g")


def _decoded_schema():
    from pyspark.sql import types as T

    from benchmarks.workload import COLUMNS

    raw = {"timestamp": T.LongType(), "date": T.IntegerType(), "decimal(12,2)": T.StringType()}
    plain = {
        "bigint": T.LongType(),
        "int": T.IntegerType(),
        "string": T.StringType(),
        "boolean": T.BooleanType(),
        "double": T.DoubleType(),
    }
    row = T.StructType([T.StructField(c, raw.get(t) or plain[t]) for c, t in COLUMNS.items()])
    return T.StructType(
        [
            T.StructField("before", row),
            T.StructField("after", row),
            T.StructField("source", T.StructType([T.StructField("lsn", T.LongType())])),
            T.StructField("op", T.StringType()),
        ]
    )


def _typed_columns(frame_row: str):
    """The business columns of struct `frame_row`, converted from Debezium's encoding."""
    from pyspark.sql import functions as F

    from benchmarks.workload import COLUMNS

    out = []
    for column, kind in COLUMNS.items():
        value = F.col(f"{frame_row}.{column}")
        if kind == "timestamp":
            value = F.timestamp_micros(value)
        elif kind == "date":
            value = F.date_from_unix_date(value)
        elif kind.startswith("decimal"):
            value = value.cast(kind)
        out.append(value.alias(column))
    return out


def _event_log(job: dict) -> dict[str, str]:
    """A profiled run's Spark event log, beside its result (`benchmarks.spark_profile`)."""
    if not job.get("profile"):
        return {}
    folder = Path(job["result"]).with_suffix(".events")
    folder.mkdir(parents=True, exist_ok=True)
    return {
        "spark.eventLog.enabled": "true",
        "spark.eventLog.dir": str(folder),
        "spark.eventLog.compress": "false",
    }


def _plain_session(job: dict, *, shuffle_partitions: int | None):
    """A Spark session with the project's jars, as a user's script would build one."""
    from pyspark.sql import SparkSession

    from resources import jvm_archive
    from resources.spark import SparkResource

    conf = SparkResource(driver_memory=SPARK_MEMORY).spark_config()
    builder = SparkSession.builder
    for key, value in _event_log(job).items():
        builder = builder.config(key, value)
    for key in (
        "spark.master",
        "spark.jars",
        "spark.driver.memory",
        "spark.sql.extensions",
        "spark.sql.catalog.spark_catalog",
        "spark.ui.enabled",
        "spark.sql.session.timeZone",
        jvm_archive.DRIVER_OPTIONS,  # the driver's class archive, as ours gets it
    ):
        if key in conf:
            builder = builder.config(key, conf[key])
    if shuffle_partitions is not None:
        builder = builder.config("spark.sql.shuffle.partitions", str(shuffle_partitions))
    return builder.appName(f"bench-{job['variant']}").getOrCreate()


def _kafka_frame(spark, job: dict):
    slice_ = job["slice"]
    topic = job["topic"]
    return (
        spark.read.format("kafka")
        .option("kafka.bootstrap.servers", job["bootstrap"])
        .option("kafka.isolation.level", "read_committed")
        .option("assign", json.dumps({topic: [int(p) for p in slice_]}))
        .option("startingOffsets", json.dumps({topic: {p: r[0] for p, r in slice_.items()}}))
        .option("endingOffsets", json.dumps({topic: {p: r[1] for p, r in slice_.items()}}))
        .load()
    )


def floor(job: dict, phases: dict) -> dict:
    from pyspark.sql import functions as F

    spark = _plain_session(job, shuffle_partitions=8)
    phases["session"] = time.monotonic() - T0
    events = F.from_json(F.col("value").cast("string"), _decoded_schema()).alias("e")
    frame = _kafka_frame(spark, job).select(events, "partition", "offset")
    frame.select(
        *_typed_columns("e.after"),
        "e.op",
        F.col("e.source.lsn").alias("lsn"),
        "partition",
        "offset",
    ).write.mode("append").parquet(job["table"])
    spark.stop()
    return {}


def naive(job: dict, phases: dict) -> dict:
    from delta.tables import DeltaTable
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    from benchmarks.workload import COLUMNS, PRIMARY_KEY

    spark = _plain_session(job, shuffle_partitions=None)  # Spark's default: 200
    phases["session"] = time.monotonic() - T0
    events = F.from_json(F.col("value").cast("string"), _decoded_schema()).alias("e")
    frame = _kafka_frame(spark, job).select(events)
    changes = frame.select(
        F.coalesce("e.after.id", "e.before.id").alias("_key"),
        F.col("e.op").alias("op"),
        F.col("e.source.lsn").alias("lsn"),
        *_typed_columns("e.after"),
    )
    newest = Window.partitionBy("_key").orderBy(F.col("lsn").desc())
    latest = (
        changes.withColumn("_rank", F.row_number().over(newest))
        .where("_rank = 1")
        .withColumn(PRIMARY_KEY, F.col("_key"))
    )
    values = {c: f"s.`{c}`" for c in COLUMNS}
    (
        DeltaTable.forPath(spark, job["table"])
        .alias("t")
        .merge(latest.alias("s"), f"t.{PRIMARY_KEY} = s.{PRIMARY_KEY}")
        .whenMatchedDelete(condition="s.op = 'd'")
        .whenMatchedUpdate(set=values)
        .whenNotMatchedInsert(condition="s.op <> 'd'", values=values)
        .execute()
    )
    spark.stop()
    return {}


def _is_json(value: bytes) -> bool:
    try:
        json.loads(value)
    except ValueError:
        return False
    return True


def delta_rs(job: dict, phases: dict) -> dict:
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.json as pj
    from deltalake import DeltaTable
    from kafka import KafkaConsumer, TopicPartition

    from benchmarks.workload import COLUMNS, PRIMARY_KEY, arrow_json_type, arrow_table_values

    consumer = KafkaConsumer(
        bootstrap_servers=job["bootstrap"],
        isolation_level="read_committed",
        enable_auto_commit=False,
        max_partition_fetch_bytes=8 * 1024 * 1024,
        fetch_max_bytes=64 * 1024 * 1024,
    )
    ends, values = {}, []
    for partition, (start, end) in job["slice"].items():
        if end > start:
            ends[TopicPartition(job["topic"], int(partition))] = end
    consumer.assign(list(ends))
    for tp in ends:
        consumer.seek(tp, job["slice"][str(tp.partition)][0])
    done = set()
    while len(done) < len(ends):
        for tp, records in consumer.poll(timeout_ms=1000, max_records=50_000).items():
            for record in records:
                if record.offset < ends[tp]:
                    values.append(record.value)
            if consumer.position(tp) >= ends[tp]:
                done.add(tp)
                consumer.pause(tp)
    consumer.close()
    if job.get("skip_invalid"):  # no error table here: a record that is no JSON is dropped
        values = [v for v in values if _is_json(v)]
    phases["read"] = time.monotonic() - T0

    row = pa.struct([(c, arrow_json_type(t)) for c, t in COLUMNS.items()])
    schema = pa.schema(
        [
            ("before", row),
            ("after", row),
            ("source", pa.struct([("lsn", pa.int64())])),
            ("op", pa.string()),
        ]
    )
    table = pj.read_json(
        pa.BufferReader(b"\n".join(values)),
        parse_options=pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore"),
    )
    del values
    after, before = table.column("after").combine_chunks(), table.column("before").combine_chunks()
    keys = pc.coalesce(after.field(PRIMARY_KEY), before.field(PRIMARY_KEY)).to_numpy()
    lsn = table.column("source").combine_chunks().field("lsn").to_numpy()
    order = np.lexsort((lsn, keys))  # by key, then sequence: the last of each key is newest
    last = np.append(keys[order][1:] != keys[order][:-1], True)
    take = pa.array(order[last])
    newest_after = after.take(take)
    columns = {c: arrow_table_values(newest_after.field(c), t) for c, t in COLUMNS.items()}
    columns[PRIMARY_KEY] = pa.array(keys[order[last]])
    columns["op"] = table.column("op").combine_chunks().take(take)
    source = pa.table(columns)
    phases["decode"] = time.monotonic() - T0
    metrics = (
        DeltaTable(job["table"])
        .merge(
            source=source,
            predicate=f"t.{PRIMARY_KEY} = s.{PRIMARY_KEY}",
            source_alias="s",
            target_alias="t",
        )
        .when_matched_delete(predicate="s.op = 'd'")
        .when_matched_update(updates={c: f"s.{c}" for c in COLUMNS})
        .when_not_matched_insert(updates={c: f"s.{c}" for c in COLUMNS}, predicate="s.op != 'd'")
        .execute()
    )
    return {"merge_metrics": {k: v for k, v in metrics.items() if isinstance(v, int | float)}}


def ours(job: dict, phases: dict) -> dict:
    import dagster as dg

    from cdc_assets.config import TableSpec
    from cdc_assets.factory import build_table_asset
    from resources.kafka import KafkaResource
    from resources.lake import LakeResource
    from resources.spark import SparkResource

    spec = TableSpec.model_validate(job["spec"])
    if job["variant"] == "ours-history":
        spec = spec.model_copy(update={"history": True})
    # The run's own resource: the session the run uses, started here first so that its start
    # is timed apart from the run's work (a run would start it the same way).
    spark = SparkResource(driver_memory=SPARK_MEMORY, extra_conf=_event_log(job))
    spark.session  # noqa: B018 - starts it
    phases["session"] = time.monotonic() - T0
    hours = job["hours"]
    tags = {}
    if len(hours) > 1:  # one run over the range, as a backfill launches it
        tags = {
            "dagster/asset_partition_range_start": hours[0],
            "dagster/asset_partition_range_end": hours[-1],
        }
    result = dg.materialize(
        [build_table_asset(checks=MIRROR_CHECKS, spec=spec)],
        partition_key=hours[0] if len(hours) == 1 else None,
        tags=tags,
        resources={
            "kafka": KafkaResource(bootstrap_servers=job["bootstrap"]),
            "spark": spark,
            "lake": LakeResource(root=job["lake_root"]),
        },
        raise_on_error=False,
    )
    failures = [
        str(event.event_specific_data.error)
        for event in result.all_events
        if event.is_step_failure and getattr(event.event_specific_data, "error", None)
    ]
    if not result.success:
        raise RuntimeError(f"the run failed: {failures}")
    consumed, failed_checks, versions = 0, [], 0
    for event in result.get_asset_materialization_events():
        metadata = event.event_specific_data.materialization.metadata
        consumed += int(metadata["consumed"].value)
        if "history_versions_opened" in metadata:
            versions += int(metadata["history_versions_opened"].value)
    for check in result.get_asset_check_evaluations():
        if not check.passed:
            failed_checks.append(f"{check.check_name} {check.partition}")
    phases["run"] = time.monotonic() - T0
    spark.session.stop()
    outcome = {"consumed": consumed, "failed_checks": failed_checks}
    return outcome | ({"history_versions_opened": versions} if spec.history else {})


def auto_cdc(job: dict, phases: dict) -> dict:
    from benchmarks.auto_cdc import bench_variant

    return bench_variant(job, phases, T0)


# ours-empty: an hour without events into the same table: the fixed cost of a run.
VARIANTS = {
    "floor": floor,
    "ours": ours,
    "ours-empty": ours,
    "ours-history": ours,
    "naive": naive,
    "delta-rs": delta_rs,
    "auto-cdc": auto_cdc,
}


def main(path: str) -> int:
    job = json.loads(Path(path).read_text())
    phases: dict[str, float] = {"imports": time.monotonic() - T0}
    if job.get("profile"):
        # Where the time goes, by Python call site: a py4j call blocks while Spark works, so
        # the cumulative times of the project's functions include their Spark jobs.
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        outcome = profiler.runcall(VARIANTS[job["variant"]], job, phases)
        with Path(job["result"]).with_suffix(".profile.txt").open("w") as out:
            stats = pstats.Stats(profiler, stream=out).sort_stats("cumulative")
            stats.print_stats(r"cdc_assets|checks|resources|delta|great_expectations", 60)
        events = Path(job["result"]).with_suffix(".events")
        if events.is_dir():
            from benchmarks.spark_profile import summary

            logs = sorted(events.glob("*"))
            text = "\n\n".join(summary(log) for log in logs)
            Path(job["result"]).with_suffix(".spark.txt").write_text(text + "\n")
    else:
        outcome = VARIANTS[job["variant"]](job, phases)
    phases["total"] = time.monotonic() - T0
    Path(job["result"]).write_text(json.dumps({"phases": phases, **outcome}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
