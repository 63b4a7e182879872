"""The Kafka cluster the CDC topics live on, for kafka-python (slicing) and Spark (reading)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import dagster as dg
from kafka import KafkaConsumer, KafkaProducer
from kafka.admin import ConfigResource, ConfigResourceType, KafkaAdminClient
from kafka.errors import KafkaTimeoutError
from pydantic import Field, field_validator


class _NoFetchedRecords(logging.Filter):
    """Keeps the records a fetch brought out of kafka-python's DEBUG log: its connection and
    protocol parser log every request and response whole, and the raw bytes received, and a
    fetch holds the topic's rows, which a small slice read in the driver (cdc_assets/read.py)
    would otherwise write to the log; a produce request (the error replay) holds them too.
    Those arguments are replaced by their type and size."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and record.levelno <= logging.DEBUG:
            record.args = tuple(_without_records(arg) for arg in record.args)
        return True


def _without_records(arg: Any) -> Any:
    if isinstance(arg, bytes | bytearray | memoryview):
        return f"<{len(arg)} bytes>"
    if "Fetch" in type(arg).__name__ or "Produce" in type(arg).__name__:
        return f"<{type(arg).__name__}: records not logged>"
    return arg


_RECORDS_FILTER = _NoFetchedRecords()
# The loggers that write responses or received bytes (kafka-python 3.0).
_RESPONSE_LOGGERS = ("kafka.net.connection", "kafka.net.transport", "kafka.protocol.parser")


def _keep_records_out_of_logs() -> None:
    for name in _RESPONSE_LOGGERS:
        logger = logging.getLogger(name)
        if _RECORDS_FILTER not in logger.filters:
            logger.addFilter(_RECORDS_FILTER)


# kafka-python requires request_timeout_ms above fetch_max_wait_ms.
_MIN_REQUEST_TIMEOUT_MS = 1_000
# How long a fetch may wait at the broker for records (kafka-python's default is 500 ms).
_FETCH_MAX_WAIT_MS = 50

_LOGIN_MODULES = {
    "PLAIN": "org.apache.kafka.common.security.plain.PlainLoginModule",
    "SCRAM-SHA-256": "org.apache.kafka.common.security.scram.ScramLoginModule",
    "SCRAM-SHA-512": "org.apache.kafka.common.security.scram.ScramLoginModule",
}


def _jaas_quote(value: str | None) -> str:
    return '"' + (value or "").replace("\\", "\\\\").replace('"', '\\"') + '"'


class KafkaAuthenticationError(RuntimeError):
    """The brokers refused the configured SASL login (wrong user, password or mechanism)."""


@dataclass(frozen=True)
class TopicRetention:
    """How long Kafka keeps a topic's records (None: no limit of that kind)."""

    retention_ms: int | None
    retention_bytes: int | None
    compacted: bool


class KafkaResource(dg.ConfigurableResource):
    """Connection settings shared by the offset lookups and the Spark reads.

    Security settings are passed through unchanged to both clients. Give secrets as
    `dg.EnvVar("...")`; they are never written to metadata or logs.
    """

    bootstrap_servers: str = Field(description="Comma-separated host:port list.")
    security_protocol: str = Field(
        default="PLAINTEXT", description="PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL."
    )
    sasl_mechanism: str | None = Field(
        default=None, description="PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512."
    )
    sasl_username: str | None = None
    # repr=False: a resource printed in a log or an error shows no password.
    sasl_password: str | None = Field(
        default=None, repr=False, description='Give it as dg.EnvVar("...").'
    )
    ssl_cafile: str | None = Field(default=None, description="PEM file with the CA to trust.")
    request_timeout_ms: int = 30_000

    @field_validator("security_protocol")
    @classmethod
    def _protocol(cls, value: str) -> str:
        allowed = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
        if value not in allowed:
            raise ValueError(f"kafka resource: security_protocol '{value}' is not one of {allowed}")
        return value

    @field_validator("sasl_mechanism")
    @classmethod
    def _mechanism(cls, value: str | None) -> str | None:
        if value is not None and value not in _LOGIN_MODULES:
            raise ValueError(
                f"kafka resource: sasl_mechanism '{value}' is not supported; use one of "
                f"{sorted(_LOGIN_MODULES)}"
            )
        return value

    def _client_settings(self) -> dict[str, Any]:
        settings: dict[str, Any] = {
            "bootstrap_servers": self.bootstrap_servers.split(","),
            "request_timeout_ms": self.request_timeout_ms,
            "bootstrap_timeout_ms": self.request_timeout_ms,
            "security_protocol": self.security_protocol,
        }
        if self.sasl_mechanism:
            settings |= {
                "sasl_mechanism": self.sasl_mechanism,
                "sasl_plain_username": self.sasl_username,
                "sasl_plain_password": self.sasl_password,
            }
        if self.ssl_cafile:
            settings["ssl_cafile"] = self.ssl_cafile
        return settings

    def consumer(self, *, committed: bool = True, timeout_ms: int | None = None) -> KafkaConsumer:
        """A consumer for offset lookups and slice reads: no group, no commits, committed reads.

        A fetch with nothing new waits at most `_FETCH_MAX_WAIT_MS` at the broker: a slice's
        read ends where records go on, and a long-polling fetch would hold up the offset
        lookup queued behind it on the same connection.

        `committed=False` reads uncommitted, to see high watermarks (open transactions).
        `timeout_ms` caps its bootstrap and each request below `request_timeout_ms` (the offset
        sensor gives it the time its tick has left).
        """
        _keep_records_out_of_logs()
        settings = self._client_settings()
        if timeout_ms is not None:
            settings["bootstrap_timeout_ms"] = min(settings["bootstrap_timeout_ms"], timeout_ms)
            settings["request_timeout_ms"] = min(
                settings["request_timeout_ms"], max(timeout_ms, _MIN_REQUEST_TIMEOUT_MS)
            )
        with self._explained_bootstrap(settings["bootstrap_timeout_ms"]):
            return KafkaConsumer(
                enable_auto_commit=False,
                group_id=None,
                isolation_level="read_committed" if committed else "read_uncommitted",
                fetch_max_wait_ms=_FETCH_MAX_WAIT_MS,
                **settings,
            )

    def producer(self) -> KafkaProducer:
        """A producer that waits for every in-sync replica: only the error replay writes
        (`cdc_assets.error_replay`)."""
        _keep_records_out_of_logs()
        with self._explained_bootstrap():
            return KafkaProducer(acks="all", **self._client_settings())

    @contextlib.contextmanager
    def _explained_bootstrap(self, bootstrap_timeout_ms: int | None = None) -> Iterator[None]:
        """Names the login settings when a SASL client can't bootstrap.

        kafka-python reports a refused login only as a bootstrap timeout ("socket
        disconnected"), so the likely causes are named instead.
        """
        if not self.sasl_mechanism:
            yield
            return
        try:
            yield
        except KafkaTimeoutError as exc:
            raise KafkaAuthenticationError(
                f"Kafka at {self.bootstrap_servers}: no broker completed the SASL "
                f"{self.sasl_mechanism} login of user '{self.sasl_username}' within "
                f"{bootstrap_timeout_ms or self.request_timeout_ms} ms ({exc}). A refused "
                "password ends this way: check "
                "the kafka resource's sasl_username, sasl_password and sasl_mechanism, its "
                "ssl_cafile, and that the brokers are reachable."
            ) from exc

    def topic_retention(self, topic: str) -> TopicRetention:
        """The topic's effective retention settings, as the brokers apply them."""
        wanted = {"retention.ms": None, "retention.bytes": None, "cleanup.policy": None}
        with self._explained_bootstrap():
            admin = KafkaAdminClient(**self._client_settings())
        try:
            described = admin.describe_configs(
                [ConfigResource(ConfigResourceType.TOPIC, topic, wanted)], config_filter="all"
            )
        finally:
            admin.close()
        configs = described.get("topic", {}).get(topic) or {}
        if not configs:
            raise RuntimeError(
                f"Kafka returned no configuration for topic '{topic}'; check that it exists"
            )

        def limit(name: str) -> int | None:
            value = int(configs[name]["value"])
            return None if value < 0 else value

        return TopicRetention(
            retention_ms=limit("retention.ms"),
            retention_bytes=limit("retention.bytes"),
            compacted="compact" in configs["cleanup.policy"]["value"],
        )

    def spark_options(self) -> dict[str, str]:
        """Options for `spark.read.format("kafka")` (Spark redacts the JAAS config in its logs)."""
        options = {
            "kafka.bootstrap.servers": self.bootstrap_servers,
            "kafka.security.protocol": self.security_protocol,
            "kafka.isolation.level": "read_committed",
            "kafka.request.timeout.ms": str(self.request_timeout_ms),
        }
        if self.sasl_mechanism:
            options["kafka.sasl.mechanism"] = self.sasl_mechanism
            options["kafka.sasl.jaas.config"] = (
                f"{_LOGIN_MODULES[self.sasl_mechanism]} required "
                f"username={_jaas_quote(self.sasl_username)} "
                f"password={_jaas_quote(self.sasl_password)};"
            )
        if self.ssl_cafile:
            options["kafka.ssl.truststore.type"] = "PEM"
            options["kafka.ssl.truststore.location"] = self.ssl_cafile
        return options
