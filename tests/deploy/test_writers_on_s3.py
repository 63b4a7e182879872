"""One writer per table on S3: Delta's commits are a put-if-absent there, so two Spark drivers
writing one table lose nothing; without it the later of two commits of a version replaces the
earlier one.

Against moto's S3 server on loopback with signatures checked, handling one request at a time
(devtools/s3_server.py `serialized`: moto's own threaded server checks `If-None-Match` and
stores the object in two steps, where S3 decides a conditional PUT atomically).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import boto3
import pytest
from dagster_aws.s3 import S3Resource
from py4j.protocol import Py4JJavaError

from devtools import s3_server
from resources.lake import (
    LakeConfigError,
    LakeResource,
    check_multi_writer_log_store,
    delta_log_store,
    single_writer_from_env,
)
from resources.spark import (
    CONDITIONAL_PUT_LOG_STORE,
    LOG_STORE_CONF,
    SparkResource,
)
from tests.conftest import _free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
BUCKET = "race"
KEY_ENV, SECRET_ENV = "CDC_TEST_RACE_ACCESS_KEY_ID", "CDC_TEST_RACE_SECRET_ACCESS_KEY"
COMMITS = 8  # per writer


class RaceLake:
    """The serialized S3 server: its endpoint, its one user's key, its request log."""

    def __init__(self, config: s3_server.S3ServerConfig, key: s3_server.AccessKey):
        self.config, self.key = config, key

    def lake(self, prefix: str) -> LakeResource:
        return LakeResource(
            root=f"s3://{BUCKET}/{prefix}",
            s3=S3Resource(
                endpoint_url=self.config.endpoint,
                region_name=self.config.region,
                aws_access_key_id=self.key.key_id,
                aws_secret_access_key=self.key.secret,
            ),
        )

    def client(self):
        return boto3.client(
            "s3",
            endpoint_url=self.config.endpoint,
            region_name=self.config.region,
            aws_access_key_id=self.key.key_id,
            aws_secret_access_key=self.key.secret,
        )

    def read(self, key: str) -> bytes:
        return self.client().get_object(Bucket=BUCKET, Key=key)["Body"].read()

    def request_log(self) -> str:
        return (self.config.log_dir / "moto.log").read_text(errors="replace")


@pytest.fixture(scope="module")
def race_s3(tmp_path_factory: pytest.TempPathFactory):
    config = s3_server.S3ServerConfig(
        port=_free_port(),
        log_dir=tmp_path_factory.mktemp("race-s3"),
        users=["writer"],
        serialized=True,
    )
    key = s3_server.start(config)["writer"]
    try:
        lakes = RaceLake(config, key)
        lakes.client().create_bucket(Bucket=BUCKET)
        yield lakes
    finally:
        s3_server.stop(config)


def test_the_conditional_put_log_store_is_set_for_s3a_with_the_s3_jars(tmp_path):
    (tmp_path / "s3").mkdir()
    (tmp_path / "store").mkdir()
    jar = tmp_path / "store" / "conditional-put-log-store-0123456789ab.jar"
    jar.touch()
    spark = SparkResource(s3_jars_dir=str(tmp_path / "s3"), log_store_dir=str(tmp_path / "store"))
    # No S3A jars: no S3 lake possible, nothing to set.
    assert LOG_STORE_CONF not in spark.spark_config()

    resolved = SparkResource(log_store_dir=str(tmp_path / "store")).spark_config()
    assert resolved[LOG_STORE_CONF] == CONDITIONAL_PUT_LOG_STORE
    assert resolved["spark.jars"].split(",")[-1] == str(jar)


def test_a_single_driver_log_store_fails_naming_the_setting_unless_single_writer_is_declared(
    monkeypatch,
):
    with pytest.raises(LakeConfigError) as error:
        check_multi_writer_log_store("io.delta.storage.S3SingleDriverLogStore", "s3://b/lake")
    message = str(error.value)
    assert LOG_STORE_CONF in message and "scripts/install.sh" in message
    assert "CDC_LAKE_SINGLE_WRITER=true" in message
    check_multi_writer_log_store(CONDITIONAL_PUT_LOG_STORE, "s3://b/lake")
    check_multi_writer_log_store("io.delta.storage.S3DynamoDBLogStore", "s3://b/lake")

    assert single_writer_from_env({}) is False
    assert single_writer_from_env({"CDC_LAKE_SINGLE_WRITER": "true"}) is True
    with pytest.raises(LakeConfigError, match="CDC_LAKE_SINGLE_WRITER"):
        single_writer_from_env({"CDC_LAKE_SINGLE_WRITER": "sure"})


@pytest.mark.integration
def test_the_later_of_two_commits_replaces_the_earlier_without_a_put_if_absent(spark, race_s3):
    lake = race_s3.lake(f"interleaved-{uuid.uuid4().hex[:8]}")
    lake.connect(spark)
    jvm, conf = spark._jvm, spark._jsc.hadoopConfiguration()

    def commit_path(table: str):
        return jvm.org.apache.hadoop.fs.Path(f"{lake.table_path(table)}/_delta_log/{0:020d}.json")

    def key(path) -> str:
        return path.toUri().getPath().lstrip("/").removeprefix(f"{BUCKET}/")

    # Delta's default S3 log store, from two drivers: each finds the version free (its lock is
    # per JVM), then creates it. S3A checks for the file when the stream opens and PUTs it at
    # close: the writer that closes last replaces the other's commit, and nobody hears of it.
    plain = commit_path("plain")
    fs = plain.getFileSystem(conf)
    first = fs.create(plain, False)
    first.write(bytearray(b'{"writer":"first"}\n'))
    second = fs.create(plain, False)
    second.write(bytearray(b'{"writer":"second"}\n'))
    second.close()
    first.close()  # no error
    assert race_s3.read(key(plain)) == b'{"writer":"first"}\n'  # the second commit is gone

    # The log store Delta uses for this lake (resolved as Delta resolves it), in the same race:
    # the other driver's conditional create, opened first, is refused when it closes.
    assert delta_log_store(spark, lake.root_uri) == CONDITIONAL_PUT_LOG_STORE
    store = (
        jvm.org.apache.spark.sql.delta.storage.LogStore.apply(spark._jsparkSession)
        .getDelegate(jvm.org.apache.hadoop.fs.Path(lake.root_uri))
        .logStoreImpl()
    )
    guarded = commit_path("guarded")
    first = (
        fs.createFile(guarded)
        .overwrite(False)
        .must("fs.option.create.conditional.overwrite", True)
        .build()
    )
    first.write(bytearray(b'{"writer":"first"}\n'))

    def actions(line: str):
        return jvm.java.util.ArrayList([line]).iterator()

    store.write(guarded, actions('{"writer":"second"}'), False, conf)
    with pytest.raises(Py4JJavaError, match="RemoteFileChangedException"):
        first.close()
    assert race_s3.read(key(guarded)) == b'{"writer":"second"}\n'
    # And a writer that comes later gets the exception Delta resolves conflicts on.
    with pytest.raises(Py4JJavaError, match="java.nio.file.FileAlreadyExistsException"):
        store.write(guarded, actions('{"writer":"third"}'), False, conf)
    assert race_s3.read(key(guarded)) == b'{"writer":"second"}\n'
    # The same commit sent again (S3A resending a PUT whose first answer was lost): S3 refuses
    # it (412), and the store finds its own commit there: done, not a conflict Delta would
    # resolve by committing the same actions again on the next version.
    store.write(guarded, actions('{"writer":"second"}'), False, conf)
    assert race_s3.read(key(guarded)) == b'{"writer":"second"}\n'


@pytest.mark.integration
def test_two_drivers_racing_on_one_table_lose_no_commit(spark, race_s3, tmp_path):
    prefix = f"race-{uuid.uuid4().hex[:8]}"
    lake = race_s3.lake(prefix)
    lake.connect(spark)
    table = lake.table_path("orders")
    spark.createDataFrame([("setup", 0)], "writer string, seq int").write.format("delta").save(
        table
    )  # version 0: the writers race on an existing table, as hourly runs do

    writers = ["a", "b"]
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO_ROOT),
        KEY_ENV: race_s3.key.key_id,
        SECRET_ENV: race_s3.key.secret,
    }
    children = {}
    for name in writers:
        job = {
            "name": name,
            "table": table,
            "commits": COMMITS,
            "endpoint": race_s3.config.endpoint,
            "region": race_s3.config.region,
            "key_env": KEY_ENV,
            "secret_env": SECRET_ENV,
        }
        log = open(tmp_path / f"{name}.log", "wb")
        child = subprocess.Popen(
            [sys.executable, "-m", "tests.deploy.writer_child", str(tmp_path)],
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO_ROOT,
        )
        child.stdin.write(json.dumps(job).encode())
        child.stdin.close()
        children[name] = child

    def logs() -> str:
        return "\n".join(
            f"--- {name}:\n" + (tmp_path / f"{name}.log").read_text(errors="replace")[-3000:]
            for name in writers
        )

    def wait_for(names: list[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not all((tmp_path / n).exists() for n in names):
            # (a writer done with its last round exits 0 while the other commits on)
            assert all(c.poll() in (None, 0) for c in children.values()), logs()
            assert time.monotonic() < deadline, f"no {names} after {timeout_s} s\n{logs()}"
            time.sleep(0.1)

    try:
        wait_for([f"ready-{name}" for name in writers], 600)
        # Each round both writers start a transaction on the same version and commit it.
        for seq in range(COMMITS):
            (tmp_path / f"round-{seq}").touch()
            wait_for([f"committed-{name}-{seq}" for name in writers], 300)
        for child in children.values():
            assert child.wait(timeout=120) == 0, logs()
    finally:
        for child in children.values():
            if child.poll() is None:
                child.kill()

    # Every commit is in the log: versions 0..2N, one file each, none missing or replaced.
    log_prefix = f"{prefix}/orders/_delta_log/"
    listed = race_s3.client().list_objects_v2(Bucket=BUCKET, Prefix=log_prefix)["Contents"]
    versions = sorted(
        int(item["Key"].removeprefix(log_prefix).removesuffix(".json"))
        for item in listed
        if re.fullmatch(r"\d{20}\.json", item["Key"].removeprefix(log_prefix))
    )
    assert versions == list(range(2 * COMMITS + 1))
    # ... each holding one writer's one row, and every row of both writers is in the table.
    expected = [("setup", 0)] + [(name, seq) for name in writers for seq in range(COMMITS)]
    rows = spark.read.format("delta").load(table).collect()
    assert sorted((row.writer, row.seq) for row in rows) == sorted(expected)
    history = spark.sql(f"DESCRIBE HISTORY delta.`{table}`").collect()
    assert sorted(row.version for row in history) == versions

    # The writers did collide: S3 refused commit files that the other writer had created first
    # (412 on a PUT with If-None-Match), and Delta retried those commits on the next version.
    # (werkzeug colours a 4xx request line: escape codes may close it before the quote)
    refused = re.findall(
        rf"PUT /{BUCKET}/{re.escape(log_prefix)}\d{{20}}\.json HTTP/1\.1\S*\" 412",
        race_s3.request_log(),
    )
    assert refused, "the writers never committed the same version at once: no race was run"
