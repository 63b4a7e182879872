"""KafkaResource's settings as each client gets them (no broker): kafka-python's, Spark's
source options, the validation of its fields, and the log filter that keeps records out."""

from __future__ import annotations

import logging

import pytest
from pydantic import ValidationError

from resources.kafka import KafkaResource, _NoFetchedRecords

SASL = {
    "bootstrap_servers": "a:9092,b:9092",
    "security_protocol": "SASL_SSL",
    "sasl_mechanism": "SCRAM-SHA-512",
    "sasl_username": "cdc",
    "sasl_password": 'p"w\\d',
    "ssl_cafile": "/etc/ca.pem",
}


def test_kafka_python_gets_the_servers_timeouts_and_security_settings():
    settings = KafkaResource(**SASL, request_timeout_ms=7_000)._client_settings()
    assert settings == {
        "bootstrap_servers": ["a:9092", "b:9092"],
        "request_timeout_ms": 7_000,
        "bootstrap_timeout_ms": 7_000,
        "security_protocol": "SASL_SSL",
        "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_plain_username": "cdc",
        "sasl_plain_password": 'p"w\\d',
        "ssl_cafile": "/etc/ca.pem",
    }
    plain = KafkaResource(bootstrap_servers="a:9092")._client_settings()
    assert plain["security_protocol"] == "PLAINTEXT" and "sasl_mechanism" not in plain


def test_spark_reads_committed_records_with_the_same_login():
    options = KafkaResource(**SASL).spark_options()
    assert options["kafka.bootstrap.servers"] == "a:9092,b:9092"
    assert options["kafka.isolation.level"] == "read_committed"
    assert options["kafka.request.timeout.ms"] == "30000"
    assert options["kafka.sasl.mechanism"] == "SCRAM-SHA-512"
    # The password quoted for JAAS: a quote or backslash in it can't end the value.
    assert options["kafka.sasl.jaas.config"] == (
        "org.apache.kafka.common.security.scram.ScramLoginModule required "
        'username="cdc" password="p\\"w\\\\d";'
    )
    assert options["kafka.ssl.truststore.type"] == "PEM"
    assert options["kafka.ssl.truststore.location"] == "/etc/ca.pem"
    assert "kafka.sasl.jaas.config" not in KafkaResource(bootstrap_servers="a:1").spark_options()


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("security_protocol", "SASL", "security_protocol 'SASL' is not one of"),
        ("sasl_mechanism", "GSSAPI", "sasl_mechanism 'GSSAPI' is not supported"),
    ],
)
def test_an_unsupported_setting_is_named(field, value, named):
    with pytest.raises(ValidationError, match=named):
        KafkaResource(bootstrap_servers="a:1", **{field: value})


def test_the_password_is_not_in_the_resources_repr():
    assert 'p"w' not in repr(KafkaResource(**SASL))


def test_fetched_and_produced_records_never_reach_the_debug_log():
    class FetchResponse:
        pass

    record = logging.LogRecord(
        "kafka.net.connection",
        logging.DEBUG,
        __file__,
        1,
        "%s %s %s",
        (b"row", FetchResponse(), 3),
        None,
    )
    _NoFetchedRecords().filter(record)
    assert record.getMessage() == "<3 bytes> <FetchResponse: records not logged> 3"
    info = logging.LogRecord("kafka", logging.INFO, __file__, 1, "%s", (b"x",), None)
    _NoFetchedRecords().filter(info)
    assert info.args == (b"x",)  # only DEBUG records carry whole responses
