"""What the read-and-decode job of a large hour costs, part by part, on a warm session.

    PYTHONPATH=. .venv/bin/python -m benchmarks.decode_stage                # 1M events, layout a
    PYTHONPATH=. .venv/bin/python -m benchmarks.decode_stage --case hour-b-1Mev-10Mrows-1p

Reads the topic of a case the ingest benchmark produced (run `scripts/bench.sh --only CASE
--variants ours` first: it leaves the broker's data and the case's job files in `.local/bench`)
with the pipeline's own reader (`read.read_slice`), and times, in this order and REPEAT times
each:

- read: Spark's Kafka read alone (a count);
- arrow: the same records handed to a Python worker and dropped there: with the columns the
  decoder got before `db1c0ba` (every Kafka column Spark's read has, the headers array
  included), and with the ones it gets now (`decoding.spark.decoder_input`), for the case's
  table and for the same table with a toasted column (it also gets the old key's header);
- decode: the job an hour runs (`hour_run._decode`: decode, cache, collect each batch's tally).

The first job of a session also warms the JVM and starts the Python workers, so the first
repetition of each part is slower; the summary is the last repetition. Not part of the tests;
run it on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from benchmarks.run import topic_slice
from benchmarks.variants import SPARK_MEMORY
from cdc_assets import hour_run
from cdc_assets.config import TableSpec
from cdc_assets.decoding.plan import DecodePlan
from cdc_assets.decoding.spark import decoder_input
from cdc_assets.read import read_slice
from cdc_assets.slicing import HourSlice, PartitionSlice
from devtools import kafka_broker
from devtools.processes import port_free
from resources.kafka import KafkaResource
from resources.spark import SparkResource

REPO = Path(__file__).resolve().parents[1]
HOUR_FORMAT = "%Y-%m-%d-%H:%M"
# What the decoder got of Spark's Kafka rows before db1c0ba.
BEFORE = ("key", "value", "topic", "partition", "offset", "timestamp", "headers")
TOASTED = "note"  # a string column of the benchmark's table, declared toasted for one part


def _slice(job: dict) -> HourSlice:
    """The case's hour: the whole topic (the job names its offsets)."""
    start = datetime.strptime(job["hours"][0], HOUR_FORMAT).replace(tzinfo=UTC)
    parts = tuple(
        PartitionSlice(int(p), first, end, first, True) for p, (first, end) in job["slice"].items()
    )
    return HourSlice(
        job["topic"], start, start + timedelta(hours=1), parts, closed=True, open_reason=None
    )


def _check_topic(bootstrap: str, job: dict) -> None:
    """The topic must still hold the job's slice (a later benchmark run makes it anew)."""
    held = topic_slice(bootstrap, job["topic"])
    if held != job["slice"]:
        raise SystemExit(
            f"topic {job['topic']} holds {held}, not the case's slice {job['slice']}: run "
            "scripts/bench.sh --only CASE --variants ours again"
        )


def _dropped(frame: DataFrame) -> int:
    """Hands every row to a Python worker as Arrow and drops it there: the transfer's cost."""

    def count(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        yield pa.RecordBatch.from_pydict({"n": [sum(b.num_rows for b in batches)]})

    return frame.mapInArrow(count, "n long").agg(F.sum("n")).first()[0]


def _decoded(spark: SparkSession, records: DataFrame, spec: TableSpec, hour: str) -> int:
    decoded = hour_run._decode(spark, records, spec, hour, {}, None, {})
    decoded.release()
    return decoded.tally.records


def parts(
    spark: SparkSession, records: Callable[[], DataFrame], spec: TableSpec, hour: str
) -> dict[str, Callable[[], int]]:
    toasted = spec.model_copy(update={"toasted_columns": (TOASTED,)})

    def sent(frame_spec: TableSpec) -> int:
        frame = records()
        plan = DecodePlan.of(frame_spec, hour_key=hour)
        return _dropped(frame.select(*decoder_input(frame, plan)))

    return {
        "read": lambda: records().count(),
        "arrow, before db1c0ba": lambda: _dropped(records().select(*BEFORE)),
        "arrow, the decoder's input": lambda: sent(spec),
        "arrow, same, toasted table": lambda: sent(toasted),
        "decode, cache, tallies": lambda: _decoded(spark, records(), spec, hour),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", default="hour-a-1Mev-10Mrows-1p")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--work", default=str(REPO / ".local" / "bench"))
    args = parser.parse_args(argv)
    work = Path(args.work)
    jobs = sorted((work / args.case / "ours").glob("job-*.json"))
    if not jobs or not (work / "kafka").exists():
        parser.error(
            f"no events of case {args.case} in {work}: run scripts/bench.sh --only {args.case} "
            "first"
        )
    job = json.loads(jobs[-1].read_text())
    # The ingest benchmark's broker settings (benchmarks.run) on a port of its own: a broker
    # already running on that data (a benchmark run) has other settings, and start refuses.
    port = 19192
    while not (port_free(port) and port_free(port + 1)):
        port += 2
    broker = kafka_broker.BrokerConfig(port=port, data_dir=work / "kafka", heap="1g")
    bootstrap = kafka_broker.start(broker)
    timed: dict[str, list[float]] = {}
    try:
        _check_topic(bootstrap, job)
        spec = TableSpec.model_validate(job["spec"])
        hour_slice = _slice(job)
        spark = SparkResource(driver_memory=SPARK_MEMORY).session
        options = KafkaResource(bootstrap_servers=bootstrap).spark_options()
        try:

            def records() -> DataFrame:
                return read_slice(spark, options, hour_slice)

            for name, run in parts(spark, records, spec, job["hours"][0]).items():
                for _ in range(args.repeat):
                    started = time.monotonic()
                    run()
                    timed.setdefault(name, []).append(time.monotonic() - started)
                    print(f"{name}: {timed[name][-1]:.1f} s", flush=True)
        finally:
            spark.stop()
    finally:
        kafka_broker.stop(broker)
    print(f"\n{args.case}, {hour_slice.size:,} records; the last of {args.repeat} runs, s:")
    for name, seconds in timed.items():
        print(f"  {name:<30} {seconds[-1]:6.1f}   (all: {', '.join(f'{s:.1f}' for s in seconds)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
