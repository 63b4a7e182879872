"""One hour of one table materialized through Dagster in a process of its own, to be killed.

The crash scenarios (tests/faults/test_crashes.py) SIGKILL this process and its Spark JVM at a
chosen moment of the run. Started as `python -m tests.faults.hour_child WORKDIR`, it:

1. boots its own Spark session (local[1], its scratch space in WORKDIR/spark-local) and a
   persistent Dagster instance in WORKDIR/dagster, so the parent can prepare the table
   meanwhile, then creates WORKDIR/ready;
2. reads one job as JSON from stdin: `bootstrap`, `lake_root`, `spec` (a TableSpec as JSON),
   `hour_key`;
3. materializes the hour with `dg.materialize` into that instance, tagged `cdc/fault=child`,
   and writes WORKDIR/result.json (`success`, `run_id`) if it lives that long. The parent
   opens the instance afterwards to see what Dagster recorded.

Its output (Spark's and Dagster's logs) belongs in WORKDIR/child.log, which the parent opens.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import dagster as dg

from cdc_assets.config import TableSpec
from cdc_assets.factory import build_table_asset
from checks.table_checks import MIRROR_CHECKS
from resources.kafka import KafkaResource
from resources.lake import LakeResource
from resources.spark import SparkResource

TAGS = {"cdc/fault": "child"}


def spark_resource(workdir: Path) -> SparkResource:
    return SparkResource(
        master="local[1]",
        app_name="cdc-lake-fault-child",
        shuffle_partitions=2,
        driver_memory="512m",
        extra_conf={
            # A killed JVM leaves its block manager files behind: keep them in the test's tmp.
            "spark.local.dir": str(workdir / "spark-local"),
            # A short-lived JVM: the quick compiler only, which halves its CPU time.
            "spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
        },
    )


def dagster_home(workdir: Path) -> Path:
    return workdir / "dagster"


def main(workdir: Path) -> int:
    spark = spark_resource(workdir)
    spark.session.range(1).count()  # the JVM is up and has run a job
    dagster_home(workdir).mkdir()
    instance = dg.DagsterInstance.local_temp(tempdir=str(dagster_home(workdir)))
    instance.get_runs(limit=1)  # its storage exists
    (workdir / "ready").touch()

    job = json.loads(sys.stdin.read())
    spec = TableSpec.model_validate_json(job["spec"])
    try:
        result = dg.materialize(
            [build_table_asset(checks=MIRROR_CHECKS, spec=spec)],
            partition_key=job["hour_key"],
            instance=instance,
            resources={
                "kafka": KafkaResource(bootstrap_servers=job["bootstrap"]),
                "spark": spark,
                "lake": LakeResource(root=job["lake_root"]),
            },
            tags=TAGS,
            raise_on_error=False,
        )
    finally:
        instance.dispose()
    outcome = {"success": result.success, "run_id": result.run_id}
    (workdir / "result.json").write_text(json.dumps(outcome))
    return 0 if result.success else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
