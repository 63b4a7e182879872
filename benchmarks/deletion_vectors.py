"""What `deletion_vectors: false` costs: the pipeline's MERGE of one hour's changes into the same
mirror, with deletion vectors (the default) and without.

    PYTHONPATH=. .venv/bin/python -m benchmarks.deletion_vectors [--rows 1000000] \\
        [--changes 10000] [--work .local/bench-dv]

Builds the benchmark's starting mirror (`benchmarks.tables`: `--rows` rows of the 15-column
benchmark table, in files of 250,000 rows sorted by id, as compaction leaves a mirror) twice,
the same rows in the same files, once per setting; writes one hour's newest changes once
(`--changes` keys spread over the whole table: 80% updates, 10% deletes, 10% inserts of new
keys), and MERGEs them into each copy with the pipeline's own `merge_changes`, in a process of
its own each (so neither warms the JVM for the other) after a MERGE into a small table warms
it. Reported per setting: the MERGE's wall seconds, the files it added and removed, the
deletion vectors it wrote and the bytes it added (from Delta's operation metrics), and the
seconds of a full read of the live rows after it. Prints a Markdown table.

With deletion vectors, a MERGE marks the replaced rows in a small file next to each touched data
file; without, it rewrites every data file holding a changed key. Changes spread over the whole
table (an hour of updates to old rows) are the case where the difference is largest; changes
to recent rows, clustered in a few files, cost about the same either way.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
START_HOUR = "2026-11-01-00:00"


def _spec(deletion_vectors: bool):
    from benchmarks.tables import bench_spec

    return bench_spec(START_HOUR).model_copy(update={"deletion_vectors": deletion_vectors})


def prepare(work: Path, rows: int, changes: int) -> None:
    """The starting mirror, its copy without deletion vectors, and the hour's changes."""
    from pyspark.sql import functions as F

    from benchmarks.tables import ROWS_PER_FILE, build, session
    from benchmarks.workload import PRIMARY_KEY
    from cdc_assets.columns import DELETED, HOUR, KAFKA_OFFSET, KAFKA_PARTITION, OP, SEQUENCE
    from cdc_assets.merge import ensure_mirror_table
    from cdc_assets.rule import mirror_columns

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    build(
        {
            "rows": rows,
            "plain": str(work / "plain"),
            "mirror": str(work / "mirror-dv"),
            "start_hour": START_HOUR,
        }
    )
    spark = session()
    start = spark.read.format("delta").load(str(work / "mirror-dv"))
    spec_off = _spec(False)
    ensure_mirror_table(spark, str(work / "mirror-nodv"), start.limit(0), spec_off)
    files = max(1, rows // ROWS_PER_FILE)
    start.repartitionByRange(files, PRIMARY_KEY).sortWithinPartitions(PRIMARY_KEY).write.format(
        "delta"
    ).mode("append").save(str(work / "mirror-nodv"))

    # One hour's newest change per key: existing keys picked evenly over the id range (ids are
    # 2, 4, ..., 2N), and new odd keys; each newer than the starting rows (sequence > id).
    step = max(1, rows // changes)
    chosen = start.where((F.col(PRIMARY_KEY) / 2) % step == 0).limit(changes)
    seq_type = start.schema[SEQUENCE].dataType
    kind = F.col(PRIMARY_KEY) / 2 / step % 10
    changed = chosen.select(
        *[
            (
                F.when(kind == 0, F.lit("d")).otherwise(F.lit("u")).alias(OP)
                if c == OP
                else (kind == 0).alias(DELETED)
                if c == DELETED
                else F.lit("paid").alias(c)
                if c == "status"
                else F.struct(F.col(PRIMARY_KEY) + 10**12, F.lit(0), F.lit(0))
                .cast(seq_type)
                .alias(c)
                if c == SEQUENCE
                else F.lit("bench").alias(c)
                if c == HOUR
                else F.col(c)
            )
            for c in mirror_columns(_spec(True))
        ]
    )
    inserted = (
        chosen.where(kind == 1)
        .withColumn(PRIMARY_KEY, F.col(PRIMARY_KEY) + 1)
        .withColumn(OP, F.lit("c"))
        .withColumn(
            SEQUENCE, F.struct(F.col(PRIMARY_KEY) + 10**12, F.lit(0), F.lit(0)).cast(seq_type)
        )
        .withColumn(HOUR, F.lit("bench"))
        .withColumn(KAFKA_PARTITION, F.lit(0))
        .withColumn(KAFKA_OFFSET, F.col(PRIMARY_KEY))
    )
    changed.unionByName(inserted).write.parquet(str(work / "changes"))
    spark.stop()


def merge(work: Path, deletion_vectors: bool) -> dict:
    """One MERGE of the hour's changes, in this process; returns its figures."""
    from pyspark.sql import functions as F

    from benchmarks.tables import session
    from cdc_assets.columns import DELETED
    from cdc_assets.commits import table_properties
    from cdc_assets.merge import check_deletion_vectors, merge_changes

    spark = session()
    spec = _spec(deletion_vectors)
    # Warm the JVM on a small copy of the change set, into a table of its own.
    warm = str(work / f"warm-{deletion_vectors}")
    shutil.rmtree(warm, ignore_errors=True)
    changes = spark.read.parquet(str(work / "changes"))
    now = datetime.now(UTC)
    merge_changes(
        spark, spec, warm, changes.limit(100), ingested_at=now, run_metadata={"hour": "warm"}
    )

    path = str(work / ("mirror-dv" if deletion_vectors else "mirror-nodv"))
    metadata = {"hour": "bench", "pipeline": "benchmarks.deletion_vectors"}
    started = time.monotonic()
    outcome = merge_changes(spark, spec, path, changes, ingested_at=now, run_metadata=metadata)
    seconds = time.monotonic() - started
    version = outcome.version
    commit = Path(path, "_delta_log", f"{version:020d}.json").read_text().splitlines()
    info = next(json.loads(line)["commitInfo"] for line in commit if "commitInfo" in line)
    metrics = info["operationMetrics"]

    started = time.monotonic()
    live = spark.read.format("delta").load(path).where(~F.col(DELETED)).count()
    read_s = time.monotonic() - started

    # What the setting's check costs through Spark (one SHOW TBLPROPERTIES), median of 5; a
    # run reads it from the mirror's log instead.
    checks = []
    for _ in range(5):
        started = time.monotonic()
        check_deletion_vectors(path, spec, table_properties(spark, path))
        checks.append(time.monotonic() - started)
    spark.stop()
    return {
        "deletion_vectors": deletion_vectors,
        "merge_s": round(seconds, 1),
        "files_added": int(metrics.get("numTargetFilesAdded", 0)),
        "files_removed": int(metrics.get("numTargetFilesRemoved", 0)),
        "deletion_vectors_added": int(metrics.get("numTargetDeletionVectorsAdded", 0)),
        "mb_added": round(int(metrics.get("numTargetBytesAdded", 0)) / 2**20, 1),
        "rows_copied": int(metrics.get("numTargetRowsCopied", 0)),
        "source_rows": int(metrics.get("numSourceRows", 0)),
        "read_s": round(read_s, 1),
        "live_rows": live,
        "check_ms": round(sorted(checks)[2] * 1000),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows of the mirror")
    parser.add_argument("--changes", type=int, default=10_000, help="keys the hour changes")
    parser.add_argument("--work", default=str(REPO / ".local" / "bench-dv"))
    parser.add_argument("--merge", choices=["on", "off"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    work = Path(args.work)
    if args.merge:  # the child: one MERGE, its figures as JSON on the last line
        print(json.dumps(merge(work, args.merge == "on")))
        return 0
    started = time.monotonic()
    prepare(work, args.rows, args.changes)
    results = []
    for setting in ("on", "off"):
        child = subprocess.run(
            [sys.executable, "-m", "benchmarks.deletion_vectors", "--work", str(work)]
            + ["--merge", setting],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=False,
        )
        if child.returncode:
            print(child.stderr[-4000:], file=sys.stderr)
            return 1
        results.append(json.loads(child.stdout.strip().splitlines()[-1]))
    assert results[0]["live_rows"] == results[1]["live_rows"], results
    print(
        f"\n{args.rows:,} rows, {results[0]['source_rows']:,} changed keys "
        f"({time.monotonic() - started:.0f} s in all)\n"
    )
    print("| deletion_vectors | MERGE s | files added | files removed | DVs added | MB added "
          "| rows copied | read s | setting check ms |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {str(r['deletion_vectors']).lower()} | {r['merge_s']} | {r['files_added']} | "
            f"{r['files_removed']} | {r['deletion_vectors_added']} | {r['mb_added']} | "
            f"{r['rows_copied']:,} | {r['read_s']} | {r['check_ms']} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
