"""A range of hours of the demo tables materialized in one Dagster run, on a Spark cluster.

The pytest process already owns a local SparkContext (one per JVM), so the backfill test of
tests/cdc_assets/test_mirror.py runs its range here, in a process of its own whose driver
uses the standalone cluster the test started (devtools/spark_cluster.py). Started as
`python -m tests.cdc_assets.range_child WORKDIR`, it:

1. reads WORKDIR/job.json: `master` (the cluster's URL), `bootstrap`, `s3` (the `S3Lakes`
   fields of the test's S3 server) and `prefix` (the lake's prefix in its bucket), `specs`
   (TableSpecs as JSON), `keys` (the hours, in order);
2. materializes all the tables over `keys[0]`..`keys[-1]` with `dg.materialize` and the range
   tags a backfill's run carries, the lake's credentials read by Dagster from the environment
   (the parent's, which the `s3` fixture filled);
3. pickles what the test compares into WORKDIR/result.pickle: the run's success and id, every
   materialization (table, hour, metadata values), every check evaluation (table, check,
   hour, passed, description, target run), and where the work ran: the session's master, its
   application id and each executor's id, address and completed tasks.

Its output (Spark's and Dagster's logs) belongs in WORKDIR/child.log, which the parent quotes.
"""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path

import dagster as dg
from pyspark import SparkContext

from cdc_assets.config import TableSpec
from cdc_assets.factory import build_mirror_assets
from checks.table_checks import MIRROR_CHECKS
from resources.kafka import KafkaResource
from resources.spark import SparkResource
from tests.conftest import S3Lakes

# The hours run in the child's driver; the executors on the cluster's one worker do the work.
EXECUTOR_MEMORY = "768m"  # within the worker's 1g
# A short-lived JVM: the quick compiler only, and the serial collector (two shared cores).
QUICK_JVM = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


def spark_resource(master: str, workdir: Path) -> SparkResource:
    return SparkResource(
        master=master,
        app_name="cdc-lake-cluster-backfill",
        shuffle_partitions=4,  # as the tests' local session
        driver_memory="1g",
        # The executors' Python workers: this interpreter (the venv's), found at the same
        # path on the worker, which is this machine.
        python_executable=sys.executable,
        extra_conf={
            # Executors connect back to the driver: on loopback, as the cluster is.
            "spark.driver.host": "127.0.0.1",
            "spark.driver.bindAddress": "127.0.0.1",
            "spark.executor.memory": EXECUTOR_MEMORY,
            "spark.cores.max": "2",
            "spark.local.dir": str(workdir / "spark-local"),
            "spark.driver.extraJavaOptions": QUICK_JVM,
            "spark.executor.extraJavaOptions": QUICK_JVM,
        },
    )


def main(workdir: Path) -> int:
    job = json.loads((workdir / "job.json").read_text())
    specs = [TableSpec.model_validate_json(spec) for spec in job["specs"]]
    keys = job["keys"]
    spark = spark_resource(job["master"], workdir)
    result = dg.materialize(
        build_mirror_assets(specs, checks=MIRROR_CHECKS),
        tags={
            "dagster/asset_partition_range_start": keys[0],
            "dagster/asset_partition_range_end": keys[-1],
        },
        resources={
            "kafka": KafkaResource(bootstrap_servers=job["bootstrap"]),
            "spark": spark,
            "lake": S3Lakes(**job["s3"]).lake(job["prefix"]),
        },
        raise_on_error=False,
    )
    materializations = []
    for event in result.get_asset_materialization_events():
        materialization = event.event_specific_data.materialization
        materializations.append(
            (
                materialization.asset_key.path[-1],
                materialization.partition,
                {name: value.value for name, value in materialization.metadata.items()},
            )
        )
    checks = [
        (
            c.asset_key.path[-1],
            c.check_name,
            c.partition,
            c.passed,
            c.description,
            c.target_materialization_data.run_id if c.target_materialization_data else None,
        )
        for c in result.get_asset_check_evaluations()
    ]
    failures = [
        str(event.event_specific_data.error)
        for event in result.all_events
        if event.is_step_failure or event.is_run_failure
        if getattr(event.event_specific_data, "error", None) is not None
    ]
    outcome = {
        "success": result.success,
        "run_id": result.run_id,
        "failures": failures,
        "materializations": materializations,
        "checks": checks,
        **_where_it_ran(),
    }
    (workdir / "result.pickle").write_bytes(pickle.dumps(outcome))
    return 0 if result.success else 1


def _where_it_ran() -> dict:
    """The run's SparkContext (this process's one, which Dagster's initialized copy of the
    resource created): its master, application id, and each executor's id, address and
    completed tasks, as Spark's status store recorded them."""
    context = SparkContext._active_spark_context
    if context is None:
        return {"master": None, "app_id": None, "executors": []}
    executors = context._jsc.sc().statusStore().executorList(False)
    where = {
        "master": context.master,
        "app_id": context.applicationId,
        "executors": [
            (e.id(), e.hostPort(), e.completedTasks())
            for e in (executors.apply(i) for i in range(executors.size()))
        ],
    }
    context.stop()
    return where


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
