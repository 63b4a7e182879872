"""A thin client of a Spark Connect server, as a run would be one, in a process of its own: a
Connect session marks its whole process as a Connect client (pyspark sets
SPARK_CONNECT_MODE_ENABLED in the environment), which the pytest process, owner of a classic
session, must never become. Started as `python -m tests.devtools.connect_client REMOTE PATH` by
tests/devtools/test_spark_connect.py, it:

1. reads the session's time zone and catalog;
2. creates a Delta table at PATH with Delta SQL, appends two rows from a local frame, and MERGEs
   a local frame of changes into it (one of them stale: older than the row it would replace);
3. runs a `mapInArrow` function on the server's Python workers that imports
   `devtools.processes`, a module of this checkout that is not in the installed package;

and prints what it found as one JSON line for the test to judge.
"""

from __future__ import annotations

import json
import sys

from pyspark.sql import SparkSession

SCHEMA = "id bigint, name string, seq bigint"


def _host_module(batches):
    """Each batch with a column naming the module the server's worker imported."""
    import pyarrow as pa

    from devtools import processes

    for batch in batches:
        yield batch.append_column("module", pa.array([processes.__name__] * batch.num_rows))


def main(remote: str, path: str) -> dict:
    spark = SparkSession.builder.remote(remote).create()
    try:
        found = {
            "time_zone": spark.conf.get("spark.sql.session.timeZone"),
            "catalog": spark.conf.get("spark.sql.catalog.spark_catalog"),
        }
        spark.sql(
            f"CREATE TABLE delta.`{path}` (id BIGINT, name STRING, seq BIGINT) USING delta"
        ).collect()
        spark.createDataFrame([(1, "a", 1), (2, "b", 1)], SCHEMA).write.format("delta").mode(
            "append"
        ).save(path)
        changes = spark.createDataFrame([(1, "a2", 2), (2, "stale", 0), (3, "c", 1)], SCHEMA)
        changes.createOrReplaceTempView("changes")
        spark.sql(
            f"MERGE INTO delta.`{path}` AS t USING changes AS s ON t.id = s.id "
            "WHEN MATCHED AND s.seq > t.seq THEN UPDATE SET * "
            "WHEN NOT MATCHED THEN INSERT *"
        ).collect()
        rows = spark.range(2).mapInArrow(_host_module, "id long, module string").collect()
        found["worker_modules"] = sorted({r["module"] for r in rows})
        return found
    finally:
        spark.stop()


if __name__ == "__main__":
    sys.stdout.write(json.dumps(main(*sys.argv[1:3])) + "\n")
