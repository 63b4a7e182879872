"""Shared fixtures: one real Kafka broker, one real Spark session, a fresh lake per test."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import boto3
import dagster as dg
import pytest
from dagster_aws.s3 import S3Resource
from hypothesis import settings
from hypothesis.database import DirectoryBasedExampleDatabase
from pyspark.sql import SparkSession

from devtools import kafka_broker, s3_server
from resources.kafka import KafkaResource
from resources.lake import LakeResource
from resources.spark import SparkResource
from tests import support
from tests.faults import figures

# Hypothesis profiles, sized for property tests whose every example runs the real pipeline
# (seconds each, hence no deadline); a cheap property test sets its own max_examples. The
# examples a test pins (`@example`) run first, on top of these.
# `ci` (the default when CI is set) draws the same examples every run and keeps no database;
# `dev` draws new ones each run and keeps the failing ones in .local/hypothesis, replayed
# first next time; `deep` explores longer. Pick one with --hypothesis-profile=NAME.
# Hypothesis's own files (its examples, its cache of the code's constants) go under .local/.
HYPOTHESIS_HOME = figures.REPO / ".local" / "hypothesis"
os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", str(HYPOTHESIS_HOME))
settings.register_profile(
    "ci", max_examples=6, deadline=None, derandomize=True, database=None, print_blob=True
)
settings.register_profile(
    "dev",
    max_examples=6,
    deadline=None,
    database=DirectoryBasedExampleDatabase(str(HYPOTHESIS_HOME / "examples")),
)
settings.register_profile("deep", settings.get_profile("dev"), max_examples=200)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A fault scenario whose test failed after recording its figures is reported as failed."""
    report = yield
    if report.failed:
        figures.fail_recorded_by(item.nodeid)
    return report


@pytest.fixture(autouse=True)
def _fault_figures_owner(request):
    """Ties the figures a test records to it (see `pytest_runtest_makereport`)."""
    with figures.recording_for(request.node.nodeid):
        yield


# The fixtures that start a real service (a Kafka broker, Spark, the S3 server, a database and
# Kafka Connect): a test that uses one, directly or through another fixture, is an integration
# test, marked at collection whatever its module says, so `-m "not integration"` (the inner
# loop, docs/testing.md) can't drift into starting them. A test that starts a service in its
# own body marks itself.
SERVICE_FIXTURES = frozenset({"broker", "spark_resource", "s3", "sources"})


def pytest_collection_modifyitems(items):
    for item in items:
        if SERVICE_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.integration)


def pytest_sessionfinish(session, exitstatus):
    figures.save()  # the fault scenarios' figures, for `python -m tests.faults.report`


SLOWEST_MODULES = 15


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The run's total and its slowest modules (setup, call and teardown summed per file): the
    suite's budget, docs/testing.md."""
    seconds: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            duration, nodeid = getattr(report, "duration", None), getattr(report, "nodeid", "")
            if duration is not None and nodeid:
                module = nodeid.split("::")[0]
                seconds[module] = seconds.get(module, 0.0) + duration
    if not seconds:
        return
    terminalreporter.write_sep("=", f"the {SLOWEST_MODULES} slowest test modules")
    for module, spent in sorted(seconds.items(), key=lambda item: -item[1])[:SLOWEST_MODULES]:
        terminalreporter.write_line(f"{spent:8.1f} s  {module}")
    total = sum(seconds.values())
    terminalreporter.write_line(f"{total:8.1f} s  in all, over {len(seconds)} modules")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real single-node KRaft broker for the whole test session; yields bootstrap servers."""
    config = kafka_broker.BrokerConfig(
        port=_free_port(),
        controller_port=_free_port(),
        data_dir=tmp_path_factory.mktemp("kafka"),
    )
    bootstrap = kafka_broker.start(config)
    yield bootstrap
    kafka_broker.stop(config)


@pytest.fixture(scope="session")
def kafka(broker: str) -> KafkaResource:
    return KafkaResource(bootstrap_servers=broker)


@pytest.fixture(scope="session")
def spark_resource() -> SparkResource:
    # Small shuffles (the suite shares two cores with the broker) and the default 2g driver:
    # with 1g, one session running the whole suite's table-hours ran out of heap in CI.
    # One partition for a Delta log's replay: the suite's tables are small, and four tasks per
    # replay cost a warm table-hour ~0.9 s
    # (python -m benchmarks.small_hours --conf spark.databricks.delta.snapshotPartitions=1).
    return SparkResource(master="local[2]", shuffle_partitions=4, delta_snapshot_partitions=1)


@pytest.fixture(scope="session")
def spark(spark_resource: SparkResource) -> Iterator[SparkSession]:
    session = spark_resource.session
    yield session
    session.stop()


@pytest.fixture
def lake(tmp_path: Path) -> LakeResource:
    return LakeResource(root=str(tmp_path / "lake"))


# Where the S3 fixture's access key is, as a deployment passes it: environment variables read
# through dg.EnvVar, so the key is in no config, log or metadata.
S3_KEY_ENV, S3_SECRET_ENV = "CDC_TEST_S3_ACCESS_KEY_ID", "CDC_TEST_S3_SECRET_ACCESS_KEY"


@dataclass(frozen=True)
class S3Lakes:
    """A local S3 server with one bucket; `lake(prefix)` is a lake under that prefix."""

    endpoint: str
    bucket: str
    region: str

    def lake(self, prefix: str, *, resolved: bool = False) -> LakeResource:
        """The lake resource as Dagster gets it (credentials as dg.EnvVar), or `resolved` for
        use outside Dagster."""
        key, secret = dg.EnvVar(S3_KEY_ENV), dg.EnvVar(S3_SECRET_ENV)
        if resolved:
            key, secret = key.get_value(), secret.get_value()
        return LakeResource(
            root=f"s3://{self.bucket}/{prefix}",
            s3=S3Resource(
                endpoint_url=self.endpoint,
                region_name=self.region,
                aws_access_key_id=key,
                aws_secret_access_key=secret,
            ),
        )

    def reader(self, prefix: str, spark: SparkSession) -> LakeResource:
        """The same lake outside Dagster, with `spark` connected to it."""
        lake = self.lake(prefix, resolved=True)
        lake.connect(spark)
        return lake


@pytest.fixture(scope="session")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Lakes]:
    """moto's S3 server on loopback for the session, enforcing signatures: only the key of its
    one IAM user (exported as S3_KEY_ENV / S3_SECRET_ENV) is let in."""
    config = s3_server.S3ServerConfig(
        port=_free_port(), log_dir=tmp_path_factory.mktemp("s3"), users=["lake"]
    )
    key = s3_server.start(config)["lake"]
    os.environ[S3_KEY_ENV], os.environ[S3_SECRET_ENV] = key.key_id, key.secret
    try:
        boto3.client(
            "s3",
            endpoint_url=config.endpoint,
            region_name=config.region,
            aws_access_key_id=key.key_id,
            aws_secret_access_key=key.secret,
        ).create_bucket(Bucket="lake")
        support.S3_OPTIONS.update(  # the oracles' deltalake reads of the lake
            AWS_ENDPOINT_URL=config.endpoint,
            AWS_REGION=config.region,
            AWS_ACCESS_KEY_ID=key.key_id,
            AWS_SECRET_ACCESS_KEY=key.secret,
            AWS_ALLOW_HTTP="true",
        )
        yield S3Lakes(endpoint=config.endpoint, bucket="lake", region=config.region)
    finally:
        support.S3_OPTIONS.clear()
        s3_server.stop(config)
        os.environ.pop(S3_KEY_ENV, None)
        os.environ.pop(S3_SECRET_ENV, None)


@pytest.fixture
def topic_prefix() -> str:
    """A fresh topic namespace per test, so tests never see each other's records."""
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
def create_topic(broker: str) -> Iterator:
    """Creates topics for a test and deletes them afterwards."""
    from kafka import KafkaAdminClient
    from kafka.admin import NewTopic

    admin = KafkaAdminClient(bootstrap_servers=broker)
    created: list[str] = []

    def create(name: str, partitions: int = 3) -> str:
        admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=1)])
        created.append(name)
        return name

    yield create
    if created:
        admin.delete_topics(created)
    admin.close()


@pytest.fixture
def send(broker: str) -> Iterator:
    """send(topic, key, value, timestamp_ms, partition=None) -> (partition, offset)."""
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=broker, acks="all", linger_ms=0)

    def _send(topic, key, value, timestamp_ms, partition=None):
        meta = producer.send(
            topic, key=key, value=value, timestamp_ms=timestamp_ms, partition=partition
        ).get(timeout=30)
        return meta.partition, meta.offset

    yield _send
    producer.close()
