"""Where interpreting a small hour stops paying: a MERGE of 200 keys, compiled and interpreted.

    PYTHONPATH=. .venv/bin/python -m benchmarks.codegen_crossover
    PYTHONPATH=. .venv/bin/python -m benchmarks.codegen_crossover --rows 20000 8000000

For each size it writes a Delta table of N rows of 5 columns (`.local/bench/codegen-crossover`),
then times REPS rounds of what a small hour does to it: a count of the rows under 200 random
keys (as `prior_rows` does) and a guarded MERGE of those keys, with Spark's code generation on
(`FALLBACK`, its default) and off (`NO_CODEGEN`, what `run_hour` sets under
`SparkResource.interpreted_max_bytes`), alternating which goes first; the first two rounds warm
up and are not counted. Prints each size's data bytes and the mean seconds of each mode. One
session as the tests' (`local[2]`, one shuffle partition, adaptive execution off, as a small
hour runs). Not part of the tests; run it on an idle machine.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import time
from pathlib import Path

from delta.tables import DeltaTable
from pyspark.sql import functions as F

from resources.spark import SparkResource

REPO = Path(__file__).resolve().parent.parent
MODES = ("FALLBACK", "NO_CODEGEN")
KEYS = 200


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[20_000, 50_000, 100_000, 500_000])
    parser.add_argument("--reps", type=int, default=8, help="rounds per size, two of them warm-up")
    parser.add_argument("--work", default=str(REPO / ".local" / "bench" / "codegen-crossover"))
    args = parser.parse_args(argv)
    spark = SparkResource(
        master="local[2]", shuffle_partitions=4, delta_snapshot_partitions=1
    ).session
    spark.conf.set("spark.sql.adaptive.enabled", "false")
    spark.conf.set("spark.sql.shuffle.partitions", "1")
    for n in args.rows:
        path = Path(args.work) / f"rows-{n}"
        shutil.rmtree(path, ignore_errors=True)
        spark.range(n).select(
            F.col("id"),
            F.concat(F.lit("name-"), F.col("id")).alias("name"),
            (F.col("id") * 1.5).alias("balance"),
            F.col("id").alias("seq"),
            F.lit(False).alias("deleted"),
        ).write.format("delta").option("delta.enableDeletionVectors", "true").save(str(path))
        size = sum(f.stat().st_size for f in path.glob("*.parquet"))
        times: dict[str, list[float]] = {mode: [] for mode in MODES}
        for rep in range(args.reps):
            for mode in MODES if rep % 2 else reversed(MODES):
                spark.conf.set("spark.sql.codegen.factoryMode", mode)
                seq = 10**9 + 2 * rep + (mode == "FALLBACK")
                rows = [(k, f"x{rep}", 1.0, seq, False) for k in random.sample(range(n), KEYS)]
                source = spark.createDataFrame(
                    rows, "id long, name string, balance double, seq long, deleted boolean"
                )
                started = time.perf_counter()
                target = spark.read.format("delta").load(str(path))
                keyed = target.join(source.select("id"), "id", "left_semi")
                keyed.groupBy("id").agg(F.max("seq")).count()
                (
                    DeltaTable.forPath(spark, str(path))
                    .alias("t")
                    .merge(source.alias("s"), "t.id = s.id")
                    .whenMatchedUpdateAll(condition="s.seq > t.seq")
                    .whenNotMatchedInsertAll()
                    .execute()
                )
                if rep >= 2:
                    times[mode].append(time.perf_counter() - started)
        means = ", ".join(f"{m} {statistics.mean(t):.2f} s" for m, t in times.items())
        print(f"{n:>10,} rows, {size / 2**20:6.1f} MiB: {means}", flush=True)
    spark.conf.unset("spark.sql.codegen.factoryMode")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
