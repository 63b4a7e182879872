"""devtools.kafka_broker against a real single-node KRaft broker in a temporary data dir."""

import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import ConfigResource, ConfigResourceType, NewTopic

from devtools.kafka_broker import (
    SCRAM_PASSWORD_ENV,
    BrokerConfig,
    _render_properties,
    _scram_argument,
    server_properties,
    start,
    status,
    stop,
)
from tests.support import free_ports

pytestmark = pytest.mark.integration

TOPIC = "devtools.smoke"
# Far older than any retention period: the broker must keep it (log.retention.ms=-1).
OLD_TIMESTAMP_MS = 946_684_800_000  # 2000-01-01T00:00:00Z


@pytest.fixture
def config(tmp_path: Path) -> Iterator[BrokerConfig]:
    port, controller_port = free_ports(2)
    config = BrokerConfig(
        port=port, controller_port=controller_port, data_dir=tmp_path / "kafka", heap="256m"
    )
    yield config
    # Never leave a broker behind, whatever the test did.
    stop(config, timeout_s=10)


def _read(bootstrap: str, topic: str, count: int, timeout_s: float = 15) -> list:
    """Read the first ``count`` records of partition 0, without waiting for more."""
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    try:
        partition = TopicPartition(topic, 0)
        consumer.assign([partition])
        consumer.seek_to_beginning(partition)
        records: list = []
        deadline = time.monotonic() + timeout_s
        while len(records) < count and time.monotonic() < deadline:
            for batch in consumer.poll(timeout_ms=500).values():
                records.extend(batch)
        return records
    finally:
        consumer.close()


def test_lifecycle(config: BrokerConfig) -> None:
    started = time.monotonic()
    bootstrap = start(config, timeout_s=45)
    startup_s = time.monotonic() - started
    assert bootstrap == f"127.0.0.1:{config.port}"
    pid = status(config)["pid"]
    assert isinstance(pid, int)

    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        admin.create_topics([NewTopic(TOPIC, num_partitions=1, replication_factor=1)])
        assert TOPIC in admin.list_topics()
        broker_configs = admin.describe_configs(
            [ConfigResource(ConfigResourceType.BROKER, "1", ["log.retention.ms"])],
            config_filter="all",
        )
        assert broker_configs["broker"]["1"]["log.retention.ms"]["value"] == "-1"
    finally:
        admin.close()

    producer = KafkaProducer(bootstrap_servers=bootstrap)
    try:
        producer.send(TOPIC, key=b"k", value=b"hello", timestamp_ms=OLD_TIMESTAMP_MS).get(10)
    finally:
        producer.close()
    [record] = _read(bootstrap, TOPIC, count=1)
    assert (record.key, record.value, record.timestamp) == (b"k", b"hello", OLD_TIMESTAMP_MS)

    # Starting again finds the running broker instead of launching another.
    started = time.monotonic()
    assert start(config) == bootstrap
    assert time.monotonic() - started < min(5.0, startup_s)
    info = status(config)
    assert info["running"] is True
    assert info["pid"] == pid
    assert info["bootstrap"] == bootstrap
    assert info["data_dir"] == str(config.data_dir)
    assert Path(info["log_file"]).is_file()

    assert stop(config) is True
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", config.port), timeout=2).close()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not config.pid_file.exists()
    assert status(config)["running"] is False
    assert status(config)["pid"] is None
    assert stop(config) is False

    # A restart reuses the formatted storage: the data survives.
    assert start(config, timeout_s=45) == bootstrap
    assert status(config)["pid"] != pid
    [record] = _read(bootstrap, TOPIC, count=1)
    assert record.value == b"hello"
    assert stop(config) is True


@pytest.mark.parametrize("listen", [True, False], ids=["listening", "bound-only"])
@pytest.mark.parametrize("which", ["port", "controller_port"])
def test_start_fails_clearly_when_port_taken(
    config: BrokerConfig, which: str, listen: bool
) -> None:
    port = getattr(config, which)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as blocker:
        blocker.bind(("127.0.0.1", port))
        if listen:
            blocker.listen(1)
        with pytest.raises(RuntimeError, match=rf"Port {port} .*already in use.*--port N"):
            start(config, timeout_s=10)
    assert status(config)["running"] is False
    assert not config.pid_file.exists()


def test_sasl_ssl_listener_settings_hold_no_password(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The SASL_SSL option: listeners and TLS set up, the SCRAM password only in the env."""
    config = BrokerConfig(port=9, controller_port=10, sasl_ssl_port=11, data_dir=tmp_path)
    props = server_properties(config)
    assert props["listeners"].endswith(",SASL_SSL://127.0.0.1:11")
    assert props["advertised.listeners"] == "PLAINTEXT://127.0.0.1:9,SASL_SSL://127.0.0.1:11"
    assert "SASL_SSL:SASL_SSL" in props["listener.security.protocol.map"]
    assert props["sasl.enabled.mechanisms"] == "SCRAM-SHA-512"
    assert props["listener.name.sasl_ssl.ssl.keystore.location"] == str(config.keystore_file)
    assert config.sasl_ssl_bootstrap == "127.0.0.1:11"
    assert BrokerConfig(port=9, data_dir=tmp_path).sasl_ssl_bootstrap is None

    monkeypatch.delenv(SCRAM_PASSWORD_ENV, raising=False)
    with pytest.raises(RuntimeError, match=SCRAM_PASSWORD_ENV):
        _scram_argument(config)
    monkeypatch.setenv(SCRAM_PASSWORD_ENV, "Pw_of-this~test.1")
    assert _scram_argument(config) == "SCRAM-SHA-512=[name=cdc,password=Pw_of-this~test.1]"
    # With the password in the environment, the broker's properties still don't hold it.
    assert "Pw_of-this" not in _render_properties(server_properties(config))
    monkeypatch.setenv(SCRAM_PASSWORD_ENV, "no,commas]")
    with pytest.raises(RuntimeError, match="may only contain"):
        _scram_argument(config)
    with pytest.raises(ValueError, match="must differ"):
        BrokerConfig(port=9, controller_port=10, sasl_ssl_port=10, data_dir=tmp_path)
