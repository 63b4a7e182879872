"""One writer of a Delta table on S3 in a Spark driver (a JVM) of its own, for the race of
tests/deploy/test_writers_on_s3.py.

Started as `python -m tests.deploy.writer_child WORKDIR` with a job as JSON on stdin: `name`,
`table` (the table's s3:// path), `commits`, `endpoint`, `region`, and the names of the
environment variables holding the access key (`key_env`, `secret_env`). It:

1. starts its Spark session as the pipeline does (SparkResource: the jars, the log store) and
   connects to the lake (LakeResource.connect: S3A's settings, the log store's checks), then
   creates WORKDIR/ready-<name>;
2. appends `commits` one-row commits (`writer` = its name, `seq` = 0..commits-1), each when
   WORKDIR/round-<seq> appears, so both writers start each transaction at once, from the same
   version; after each it creates WORKDIR/committed-<name>-<seq>.

Its output belongs in WORKDIR/<name>.log, which the parent opens on failure.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from dagster_aws.s3 import S3Resource

from resources.lake import LakeResource
from resources.spark import SparkResource


def main(workdir: Path) -> int:
    job = json.loads(sys.stdin.read())
    name = job["name"]
    spark = SparkResource(
        master="local[1]",
        app_name=f"cdc-lake-writer-{name}",
        shuffle_partitions=1,
        driver_memory="512m",
        extra_conf={
            "spark.local.dir": str(workdir / f"spark-local-{name}"),
            # A short-lived JVM: the quick compiler only, which halves its CPU time.
            "spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
        },
    ).session
    lake = LakeResource(
        root=job["table"].rsplit("/", 1)[0],
        s3=S3Resource(
            endpoint_url=job["endpoint"],
            region_name=job["region"],
            aws_access_key_id=os.environ[job["key_env"]],
            aws_secret_access_key=os.environ[job["secret_env"]],
        ),
    )
    lake.connect(spark)
    spark.range(1).count()  # the JVM has run a job
    (workdir / f"ready-{name}").touch()
    for seq in range(job["commits"]):
        rows = spark.createDataFrame([(name, seq)], "writer string, seq int")
        while not (workdir / f"round-{seq}").exists():
            time.sleep(0.02)
        rows.write.format("delta").mode("append").save(job["table"])
        (workdir / f"committed-{name}-{seq}").touch()
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
