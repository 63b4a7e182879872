"""The Spark Connect server of devtools/spark_connect.py, started for real: it serves the
project's session (Delta's catalog and SQL, UTC), a thin client's Delta SQL MERGE of a local
frame lands in the table (read back with deltalake, not through the server), its Python workers
import the project's package, and start, status and stop behave as the other local servers'."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from devtools import spark_connect
from tests.support import delta_rows, free_ports

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[spark_connect.ConnectConfig]:
    (port,) = free_ports(1)
    config = spark_connect.ConnectConfig(
        port=port, data_dir=tmp_path_factory.mktemp("spark-connect"), driver_memory="1g"
    )
    try:
        assert spark_connect.start(config) == f"sc://127.0.0.1:{port}"
        yield config
    finally:
        spark_connect.stop(config)


def test_a_thin_client_merges_into_delta_on_the_server(server, tmp_path: Path):
    # A second start finds the server running and returns its address.
    assert spark_connect.start(server) == server.remote
    assert spark_connect.status(server)["running"] is True
    spark = SparkSession.builder.remote(server.remote).create()
    try:
        assert spark.conf.get("spark.sql.session.timeZone") == "UTC"
        assert spark.conf.get("spark.sql.catalog.spark_catalog").endswith("DeltaCatalog")
        path = str(tmp_path / "accounts")
        spark.sql(
            f"CREATE TABLE delta.`{path}` (id BIGINT, name STRING, seq BIGINT) USING delta"
        ).collect()
        schema = "id bigint, name string, seq bigint"
        first = spark.createDataFrame([(1, "a", 1), (2, "b", 1)], schema)
        first.write.format("delta").mode("append").save(path)
        changes = spark.createDataFrame([(1, "a2", 2), (2, "stale", 0), (3, "c", 1)], schema)
        changes.createOrReplaceTempView("changes")
        spark.sql(
            f"MERGE INTO delta.`{path}` AS t USING changes AS s ON t.id = s.id "
            "WHEN MATCHED AND s.seq > t.seq THEN UPDATE SET * "
            "WHEN NOT MATCHED THEN INSERT *"
        ).collect()
        rows = sorted((r["id"], r["name"], r["seq"]) for r in delta_rows(path).to_pylist())
        assert rows == [(1, "a2", 2), (2, "b", 1), (3, "c", 1)]

        # The server's Python workers import this checkout's package.
        def tagged(batches):
            import pyarrow as pa

            from cdc_assets.columns import DELETED

            for batch in batches:
                yield batch.append_column(DELETED, pa.array([DELETED] * batch.num_rows))

        found = spark.range(2).mapInArrow(tagged, "id long, _cdc_deleted string").collect()
        assert {r["_cdc_deleted"] for r in found} == {"_cdc_deleted"}
    finally:
        spark.stop()


def test_stop_ends_the_server(server):
    assert spark_connect.stop(server) is True
    assert spark_connect.status(server)["running"] is False
    assert spark_connect.stop(server) is False  # nothing left to stop
