"""Security: the pipeline reads through SASL/SCRAM over TLS and its password leaks nowhere.

A broker of its own gets a SASL_SSL listener (SCRAM-SHA-512, self-signed certificate made
for this run) and one SCRAM user with a fresh random password. The hour is materialized with
Dagster through that listener, the password given only as `dg.EnvVar`; the mirror must equal
the reference replay row for row. Then every place a password could end up is searched for
it: Python logging, the process's stdout and stderr, the Spark driver's log (log4j, with the
Kafka clients' logged configuration), every event of the Dagster run and the files of its
instance, the materialization and check metadata, Spark's configuration and the plans of
every query Spark ran, and the Delta table's files and commit metadata. Each channel is
first shown to capture a canary, so a scan that cannot see anything does not pass.

A wrong password must fail within a bounded time, naming the SASL failure, in kafka-python
(the slice lookup) and in Spark's Kafka source alike.
"""

from __future__ import annotations

import json
import logging
import os
import random
import secrets
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import dagster as dg
import pytest
from dagster._serdes import serialize_value
from kafka import KafkaAdminClient, KafkaProducer
from kafka.admin import NewTopic

from cdc_assets.factory import build_table_asset
from cdc_assets.hour_run import run_hour
from cdc_assets.read import read_slice
from cdc_assets.slicing import HourSlice, PartitionSlice
from checks.table_checks import MIRROR_CHECKS
from demo.reference import replay
from devtools import kafka_broker
from resources.kafka import KafkaAuthenticationError, KafkaResource
from resources.lake import LakeResource
from resources.spark import SparkResource
from tests.faults.figures import compare, record
from tests.support import accounts_spec, free_ports, read_topic

pytestmark = pytest.mark.integration

PASSWORD_ENV = "CDC_TEST_KAFKA_PASSWORD"
USER = "cdc-reader"
MECHANISM = "SCRAM-SHA-512"
PARTITIONS = 3
HOUR = datetime(2026, 11, 5, 14, tzinfo=UTC)
KEY = HOUR.strftime("%Y-%m-%d-%H:%M")
# A wrong password must fail well inside this, not hang.
FAIL_WITHIN_S = 45


@dataclass(frozen=True)
class SecureBroker:
    config: kafka_broker.BrokerConfig
    # repr=False: pytest prints fixture values in a failure report.
    password: str = field(repr=False)

    def resource(self, password: str | dg.EnvVar, **overrides) -> KafkaResource:
        return KafkaResource(
            bootstrap_servers=self.config.sasl_ssl_bootstrap,
            security_protocol="SASL_SSL",
            sasl_mechanism=MECHANISM,
            sasl_username=USER,
            sasl_password=password,
            ssl_cafile=str(self.config.ca_file),
            **overrides,
        )


@pytest.fixture(scope="module")
def secure_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureBroker]:
    """A broker with PLAINTEXT (the test's own clients) and SASL_SSL (the pipeline)."""
    port, controller_port, sasl_port = free_ports(3)
    config = kafka_broker.BrokerConfig(
        port=port,
        controller_port=controller_port,
        sasl_ssl_port=sasl_port,
        data_dir=tmp_path_factory.mktemp("kafka-sasl"),
        heap="256m",
        scram_username=USER,
        scram_password_env=PASSWORD_ENV,
    )
    password = secrets.token_urlsafe(24)
    with pytest.MonkeyPatch.context() as env:
        env.setenv(PASSWORD_ENV, password)
        kafka_broker.start(config)
    try:
        yield SecureBroker(config, password)
    finally:
        kafka_broker.stop(config)


def _changes(seed: int, count: int) -> list[tuple[int, str, bytes]]:
    """(row id, op, Debezium value) of inserts, updates, deletes and re-inserts, LSN in order."""
    rng = random.Random(seed)
    live: set[int] = set()
    out = []
    for lsn in range(1000, 1000 + count):
        row_id = rng.randrange(12)
        if row_id not in live:
            op = "c"
            live.add(row_id)
        elif rng.random() < 0.25:
            op = "d"
            live.discard(row_id)
        else:
            op = "u"
        row = {"id": row_id, "name": f"n{lsn}", "balance": f"{rng.randrange(100000) / 100:.2f}"}
        envelope = {
            "op": op,
            "before": row if op == "d" else None,
            "after": None if op == "d" else row,
            "source": {"lsn": lsn, "ts_ms": int(HOUR.timestamp() * 1000)},
        }
        out.append((row_id, op, json.dumps(envelope).encode()))
    return out


def _produce(
    bootstrap: str, topic: str, changes: list[tuple[int, str, bytes]], partitions: int = PARTITIONS
) -> None:
    """Over PLAINTEXT: the SASL_SSL listener is for the pipeline under test only."""
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
    try:
        step = 3_000_000 // len(changes)
        for n, (row_id, _, value) in enumerate(changes):
            stamp = int((HOUR + timedelta(seconds=5)).timestamp() * 1000) + n * step
            key = json.dumps({"id": row_id}).encode()
            producer.send(
                topic, key=key, value=value, timestamp_ms=stamp, partition=row_id % partitions
            )
        producer.flush(30)
    finally:
        producer.close()


def _slice(topic: str, records: list[tuple[int, int, bytes | None, int]]) -> HourSlice:
    """The hour's slice: every record of `topic` (they are all stamped inside the hour)."""
    offsets: dict[int, list[int]] = {}
    for partition, offset, _, _ in records:
        offsets.setdefault(partition, []).append(offset)
    parts = tuple(
        PartitionSlice(p, min(o), max(o) + 1, log_start=0, moved_past=True)
        for p, o in sorted(offsets.items())
    )
    end = HOUR + timedelta(hours=1)
    return HourSlice(topic, HOUR, end, parts, closed=True, open_reason=None)


class SecretScan:
    """Counts the password's occurrences per place searched."""

    def __init__(self, secret: str) -> None:
        self.secret = secret
        self.hits: dict[str, int] = {}
        self.searched: dict[str, int] = {}

    def count(self, text: str | bytes) -> int:
        if isinstance(text, bytes):
            return text.count(self.secret.encode())
        return text.count(self.secret)

    def text(self, where: str, text: str | bytes) -> None:
        self.searched[where] = self.searched.get(where, 0) + len(text)
        found = self.count(text)
        if found:
            self.hits[where] = self.hits.get(where, 0) + found

    def files(self, where: str, root: Path) -> bytes:
        """Searches every file under `root`; returns their contents, for sanity checks."""
        contents = []
        for path in sorted(root.rglob("*")):
            if path.is_file():
                contents.append(path.read_bytes())
                self.text(f"{where}: {path.relative_to(root)}", contents[-1])
        return b"\n".join(contents)

    @property
    def total(self) -> int:
        return sum(self.hits.values())


class JvmLog:
    """Copies the Spark driver's log4j output (INFO and up) to a file while it is open.

    The shared session's JVM was started by another fixture, with its stderr where pytest
    had it then, so capfd cannot see it; an extra appender on the root logger can.
    """

    DEBUG_LOGGERS = ("org.apache.spark.sql.kafka010", "org.apache.spark.kafka010")

    def __init__(self, spark, path: Path) -> None:
        self.path = path
        jvm = spark._jvm
        self._jvm = jvm
        log4j = jvm.org.apache.logging.log4j
        self._context = log4j.LogManager.getContext(False)
        config = self._context.getConfiguration()
        layout = log4j.core.layout.PatternLayout.newBuilder().withPattern("%p %c: %m%n").build()
        self._appender = (
            log4j.core.appender.FileAppender.newBuilder()
            .withFileName(str(path))
            .setName("cdc-secret-scan")
            .setLayout(layout)
            .build()
        )
        self._appender.start()
        config.addAppender(self._appender)
        self._levels = {}
        for name in ("", *self.DEBUG_LOGGERS):
            level = log4j.Level.INFO if name == "" else log4j.Level.DEBUG
            logger = self._context.getLogger(name)
            self._levels[name] = logger.getLevel()
            logger.addAppender(self._appender)
            log4j.core.config.Configurator.setLevel(name, level)

    def log(self, message: str) -> None:
        self._jvm.org.apache.logging.log4j.LogManager.getLogger("cdc.test").info(message)

    def read(self) -> str:
        return self.path.read_text(errors="replace")

    def close(self) -> None:
        log4j = self._jvm.org.apache.logging.log4j
        for name, level in self._levels.items():
            self._context.getLogger(name).removeAppender(self._appender)
            log4j.core.config.Configurator.setLevel(name, level)
        self._appender.stop()


@pytest.fixture
def jvm_log(spark, tmp_path: Path) -> Iterator[JvmLog]:
    log = JvmLog(spark, tmp_path / "spark-driver.log")
    try:
        yield log
    finally:
        log.close()


def _spark_texts(spark) -> Iterator[tuple[str, str]]:
    """Spark's configuration, and the descriptions and plans of every SQL execution so far."""
    for key, value in spark.sparkContext.getConf().getAll():
        yield "spark conf", f"{key}={value}"
    for key, value in spark.conf.getAll.items():
        yield "spark session conf", f"{key}={value}"
    executions = spark._jsparkSession.sharedState().statusStore().executionsList()
    for n in range(executions.size()):
        execution = executions.apply(n)
        yield "spark SQL executions", execution.description()
        yield "spark SQL executions", execution.details()
        yield "spark SQL executions", execution.physicalPlanDescription()


def test_pipeline_reads_over_sasl_scram_tls_and_the_password_leaks_nowhere(
    secure_broker, spark, spark_resource, tmp_path, monkeypatch, caplog, capfd, jvm_log
):
    password, config = secure_broker.password, secure_broker.config
    topic = f"sasl-{secrets.token_hex(4)}"
    admin = KafkaAdminClient(bootstrap_servers=config.bootstrap)
    try:
        admin.create_topics([NewTopic(topic, num_partitions=PARTITIONS, replication_factor=1)])
    finally:
        admin.close()
    changes = _changes(seed=11, count=48)
    assert {op for _, op, _ in changes} == {"c", "u", "d"}
    _produce(config.bootstrap, topic, changes)
    spec = accounts_spec(topic)

    caplog.set_level(logging.INFO)
    caplog.set_level(logging.DEBUG, logger="kafka")
    monkeypatch.setenv(PASSWORD_ENV, password)
    kafka = secure_broker.resource(dg.EnvVar(PASSWORD_ENV))
    lake = LakeResource(root=str(tmp_path / "lake"))
    instance_dir = tmp_path / "dagster"
    instance_dir.mkdir()
    with dg.DagsterInstance.local_temp(tempdir=str(instance_dir)) as instance:
        # Spark's Kafka source reads the slice (its JAAS config carries the password); the
        # driver's kafka-python client logs in over SASL for the offsets as well.
        spark_reads = SparkResource(**{**spark_resource.model_dump(), "local_read_max_records": 0})
        result = dg.materialize(
            [build_table_asset(checks=MIRROR_CHECKS, spec=spec)],
            partition_key=KEY,
            resources={"kafka": kafka, "spark": spark_reads, "lake": lake},
            instance=instance,
        )
        assert result.success
        events = [serialize_value(e) for e in instance.all_logs(result.run_id)]
        run = serialize_value(instance.get_run_by_id(result.run_id))
    [materialization] = result.asset_materializations_for_node("accounts")
    assert materialization.metadata["consumed"].value == len(changes)
    checks = result.get_asset_check_evaluations()
    assert checks and all(c.passed for c in checks), [(c.check_name, c.passed) for c in checks]

    # The mirror against the reference replay of what Kafka committed.
    path = lake.table_path(spec.name)
    records = read_topic(config.bootstrap, topic)
    assert len(records) == len(changes)
    expected = replay(spec, [(p, o, v) for p, o, v, _ in records])
    seen = {(row_id,) for row_id, _, _ in changes}
    comparison = compare(path, spec, expected, seen)

    # The pipeline's read as run_hour builds it, planned (not run) for all its plans' text.
    resolved = secure_broker.resource(password)
    frame = read_slice(spark, resolved.spark_options(), _slice(topic, records))
    plans = frame._jdf.queryExecution().toString()
    assert topic in plans, plans

    # Canaries: each channel is shown to capture what passes through it.
    canary = secrets.token_urlsafe(16)
    logging.getLogger("cdc.test").info("log canary %s", canary)
    jvm_log.log(f"jvm canary {canary}")
    # At the file descriptors, where output of native code and child processes lands too.
    os.write(sys.stdout.fileno(), f"stdout canary {canary}\n".encode())
    os.write(sys.stderr.fileno(), f"stderr canary {canary}\n".encode())
    captured = capfd.readouterr()
    driver_log = jvm_log.read()
    for where, text in [
        ("python logging", caplog.text),
        ("stdout", captured.out),
        ("stderr", captured.err),
        ("spark driver log", driver_log),
    ]:
        assert canary in text, f"the {where} capture does not work"
    # The driver log holds the Kafka clients' logged configuration, with the JAAS hidden.
    assert "sasl.jaas.config = [hidden]" in driver_log
    assert f"sasl.mechanism = {MECHANISM}" in driver_log
    assert "security.protocol = SASL_SSL" in driver_log

    scan = SecretScan(password)
    # The scanner finds the password where it is.
    assert scan.count(f"x{password}y") == 1 and scan.count(json.dumps([password]).encode()) == 1
    assert scan.count(resolved.spark_options()["kafka.sasl.jaas.config"]) == 1
    scan.text("python logging", caplog.text)
    scan.text("python log records", "\n".join(str(r.__dict__) for r in caplog.records))
    scan.text("stdout", captured.out)
    scan.text("stderr", captured.err)
    scan.text("spark driver log", driver_log)
    for event in events:
        scan.text("dagster event log", event)
    scan.text("dagster run", run)
    stored = scan.files("dagster instance", instance_dir)
    scan.text("materialization metadata", serialize_value(materialization.metadata))
    for check in checks:
        scan.text("check metadata", serialize_value(check.metadata))
        scan.text("check metadata", check.description or "")
    spark_texts = list(_spark_texts(spark))
    for where, text in spark_texts:
        scan.text(where, text)
    scan.text("spark plans", plans)
    history = spark.sql(f"DESCRIBE HISTORY delta.`{path}`").toJSON().collect()
    scan.text("delta history", "\n".join(history))
    scan.files("lake", tmp_path / "lake")
    scan.text("kafka resource repr", repr(resolved) + str(resolved))

    # Every channel was searched and actually held something.
    for where in ("python logging", "spark driver log", "dagster event log", "spark plans"):
        assert scan.searched.get(where), f"nothing searched in {where}"
    # The instance's storage is searchable text: it holds the run's own log message.
    assert f"consumed {len(changes)}, applied".encode() in stored
    assert any(w.endswith(".err") and "compute_logs" in w for w in scan.searched)
    # Spark's record of executed queries includes the pipeline's Kafka read.
    executed = [t for w, t in spark_texts if w == "spark SQL executions"]
    assert any(topic in t for t in executed), "no executed Kafka read of the topic found"
    assert any(w.startswith("lake: accounts/_delta_log") for w in scan.searched)
    assert sum(s.count('"userMetadata":"') for s in history) > 0, history
    record("sasl_scram_tls", comparison, faults=0, secret_hits=scan.total)
    assert comparison.clean, comparison
    assert scan.total == 0, f"the password leaked: {scan.hits}"


def test_a_wrong_password_fails_in_bounded_time_naming_the_sasl_failure(
    secure_broker, spark, tmp_path
):
    wrong = secrets.token_urlsafe(24)
    bad = secure_broker.resource(wrong, request_timeout_ms=5_000)
    topic = f"sasl-bad-{secrets.token_hex(4)}"
    admin = KafkaAdminClient(bootstrap_servers=secure_broker.config.bootstrap)
    try:
        admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])
    finally:
        admin.close()
    _produce(secure_broker.config.bootstrap, topic, _changes(seed=3, count=4), partitions=1)

    # The slice lookup (kafka-python) fails first, naming the login settings.
    started = time.monotonic()
    with pytest.raises(KafkaAuthenticationError) as refused:
        run_hour(
            checks=MIRROR_CHECKS,
            spark=spark,
            kafka=bad,
            lake=LakeResource(root=str(tmp_path / "lake")),
            spec=accounts_spec(topic),
            hour_key=KEY,
        )
    assert time.monotonic() - started < FAIL_WITHIN_S
    message = str(refused.value)
    assert f"SASL {MECHANISM} login of user '{USER}'" in message
    assert "sasl_password" in message
    assert wrong not in message

    # Spark's Kafka source with the same wrong password: an error naming SASL, no hang.
    hour_slice = _slice(topic, read_topic(secure_broker.config.bootstrap, topic))
    assert hour_slice.size == 4
    started = time.monotonic()
    with pytest.raises(Exception, match=r"SaslAuthenticationException") as failed:
        read_slice(spark, bad.spark_options(), hour_slice).count()
    assert time.monotonic() - started < FAIL_WITHIN_S
    assert wrong not in str(failed.value)
