"""What a Spark session costs a process that starts one: the session, then its first query and
its first Delta write, with the driver's class-data archive and without it (`scripts/install.sh`
makes the archive; resources/jvm_archive.py). Each measurement is a process of its own, as a
Dagster run worker, a crash child or a Pipes job is; the two kinds alternate.

    PYTHONPATH=. .venv/bin/python -m benchmarks.cold_start --runs 2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time


def _one(with_archive: bool, path: str) -> dict[str, float]:
    """In this process: start the session, sum a range, write a one-row Delta table."""
    started = time.monotonic()
    from resources import jvm_archive
    from resources.spark import SparkResource

    resource = SparkResource() if with_archive else SparkResource(jvm_archive_dir=None)
    driver_options = resource.spark_config().get(jvm_archive.DRIVER_OPTIONS, "")
    if with_archive and "SharedArchiveFile" not in driver_options:
        # SparkResource starts without one then: "with" would measure "without".
        sys.exit("no class-data archive for this java and class path: scripts/install.sh --archive")
    spark = resource.session
    ready = time.monotonic()
    spark.range(1000).selectExpr("sum(id)").collect()
    spark.createDataFrame([(1, "a")], "id long, s string").write.format("delta").save(path)
    done = time.monotonic()
    spark.stop()
    return {"session_s": ready - started, "first_write_s": done - ready, "total_s": done - started}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cold_start", description=__doc__)
    parser.add_argument("--runs", type=int, default=2, help="processes of each kind (2)")
    parser.add_argument("--child", choices=("with", "without"), help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_one(args.child == "with", args.path)))
        return 0
    for run in range(1, args.runs + 1):
        for kind in ("with", "without"):
            with tempfile.TemporaryDirectory() as folder:
                done = subprocess.run(
                    [sys.executable, "-m", "benchmarks.cold_start", "--child", kind,
                     "--path", f"{folder}/table"],
                    capture_output=True, text=True, check=False,
                )  # fmt: skip
            if done.returncode:
                sys.exit(f"the {kind}-archive process failed: {done.stderr.strip()[-2000:]}")
            figures = json.loads(done.stdout.strip().splitlines()[-1])
            shown = ", ".join(f"{k} {v:.1f}" for k, v in figures.items())
            print(f"run {run}, {kind} the archive: {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
