"""Sensitive columns are stored masked, and their raw values reach no log, metadata, commit or
error table.

One hour of changes with distinctive sensitive values (random emails, SSNs and an undeclared
phone column) goes through the real asset (real broker, Spark, Delta, great-expectations, an
ephemeral Dagster instance). The hashed columns must equal an independent Python HMAC of the
reference replay's values, the dropped and the undeclared column must be absent, the other
columns must equal the replay, and neither a raw sensitive value nor the key may appear anywhere
a person or a log collector could read it, the error table included (every column of every row,
and its files). The error rows must open, with the cipher library alone and the documented
scheme, to the bytes Kafka holds, and the operator's replay must produce those bytes again.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import shutil
import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import dagster as dg
import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESSIV
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from delta.tables import DeltaTable
from pyspark.sql import types as T

from cdc_assets.config import TableSpec
from cdc_assets.error_replay import replay_errors
from cdc_assets.error_table import ERROR_TABLE_SCHEMA
from cdc_assets.factory import build_table_asset
from cdc_assets.hour_run import run_hour
from cdc_assets.masking import MASKING_FIELD, mask_changes, stored_spec
from cdc_assets.sealing import ErrorTableSealingError, sealing_key, unsealed_errors
from checks.table_checks import MIRROR_CHECKS
from demo.reference import replay
from resources.masking import MASKING_KEY_ENV, HmacKey, MaskingResource
from tests.faults.figures import compare, record
from tests.support import read_records, read_topic

pytestmark = pytest.mark.integration

HOUR = datetime(2026, 11, 5, 14, tzinfo=UTC)
KEY = HOUR.strftime("%Y-%m-%d-%H:%M")


def _spec(topic: str) -> TableSpec:
    return TableSpec(
        name="patients",
        topic=topic,
        primary_key=("id",),
        columns={
            "id": "bigint",
            "name": "string",
            "email": "string",
            "ssn": "string",
            "salary": "decimal(10,2)",
            "seen_at": "timestamp",
        },
        start_hour="2026-11-01-00:00",
        decimal_handling="string",  # the events below carry salaries as text
        change_data_feed=True,  # the feed keeps before-images: no raw value may be there either
        sensitive={"email": "hash", "ssn": "drop", "salary": "hash", "seen_at": "hash"},
        expectations=(
            {"column": "email", "expect": "not_null", "hard": True},
            {"column": "email", "expect": "unique"},
        ),
        # The hour's bad records are on purpose (errors must not leak either): a run that
        # accepts them, with its error_rate check red.
        checks={"error_rate": {"severity": "WARN"}},
    )


def _envelope(op: str, row: dict, lsn: int) -> bytes:
    return json.dumps(
        {
            "op": op,
            "before": row if op == "d" else None,
            "after": None if op == "d" else row,
            "source": {"lsn": lsn, "ts_ms": int(HOUR.timestamp() * 1000)},
        }
    ).encode()


def _hmac(key: str, value: str) -> str:
    return hmac.new(key.encode(), value.encode(), hashlib.sha256).hexdigest()


def _canonical(value: str | Decimal | datetime) -> str:
    """The documented canonical string form, written independently of the pipeline."""
    if isinstance(value, datetime):
        return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return str(value)  # a Decimal at the declared scale, as the reference types it


def _hits(haystack: str | bytes, needles: set[str]) -> set[str]:
    if isinstance(haystack, bytes):
        return {n for n in needles if n.encode() in haystack}
    return {n for n in needles if n in haystack}


def _files(root: Path) -> bytes:
    return b"\n".join(p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file())


def _sealing_hits(haystack: str | bytes, sealing: bytes) -> set[str]:
    """{"sealing key"} when the seal's derived key is in `haystack`, raw or as hex."""
    text = haystack if isinstance(haystack, bytes) else haystack.encode()
    return {"sealing key"} if sealing in text or sealing.hex().encode() in text else set()


def _every_value(spark, path: str) -> bytes:
    """Every column of every row of the Delta table at `path`, binary columns as their bytes."""
    values = []
    for row in spark.read.format("delta").load(path).collect():
        for value in row:
            values.append(bytes(value) if isinstance(value, bytearray) else str(value).encode())
    return b"\n".join(values)


def _opened(key: str, row) -> tuple[bytes | None, bytes | None]:
    """An error row's key and value opened as the README documents the seal, with the cipher
    library alone: AES-256-SIV under HKDF-SHA256 of the masking key, the record's coordinates
    and field as associated data."""
    derived = HKDF(
        algorithm=hashes.SHA256(), length=64, salt=None, info=b"cdc-lake error table AES-256-SIV v1"
    ).derive(key.encode())
    where = [b"cdc-lake error table v1", row["topic"].encode(), b"%d" % row["partition"]]
    return tuple(
        None
        if row[field] is None
        else AESSIV(derived).decrypt(
            bytes(row[field]), [*where, b"%d" % row["offset"], field.encode()]
        )
        for field in ("key", "value")
    )


def test_sensitive_columns_are_masked_and_never_leak(
    create_topic, send, broker, kafka, spark_resource, spark, lake, monkeypatch, capfd, caplog
):
    caplog.set_level(logging.DEBUG)  # every library's DEBUG output is scanned too
    key = secrets.token_hex(32)
    monkeypatch.setenv(MASKING_KEY_ENV, key)
    topic = create_topic("masking", partitions=2)
    spec = _spec(topic)

    # 24 patients, 8 updated (new email and salary), 4 deleted, 1 bad record, all in the hour.
    rows, raw_values, lsn = {}, set(), 100
    base = int(HOUR.timestamp() * 1000)

    def emit(op: str, row: dict, second: int) -> None:
        nonlocal lsn
        lsn += 1
        raw_values.update({row["email"], row["ssn"], row["phone"]})
        send(topic, json.dumps({"id": row["id"]}).encode(), _envelope(op, row, lsn), base + second)

    for n in range(24):
        rows[n] = {
            "id": n,
            "name": f"patient-{n}",
            "email": f"{uuid.uuid4().hex}@example.org",
            "ssn": f"ssn-{uuid.uuid4().hex[:12]}",
            "salary": f"{1000 + 17 * n}.{n % 10}0",
            "seen_at": int((HOUR + timedelta(minutes=n, microseconds=n)).timestamp() * 1_000_000),
            # Undeclared: on a table with sensitive columns `new_columns: add` doesn't store it.
            "phone": f"+1-555-{uuid.uuid4().hex[:10]}",
        }
        emit("c", rows[n], n)
    for n in range(0, 16, 2):
        rows[n] = {**rows[n], "email": f"{uuid.uuid4().hex}@example.net", "salary": "77.25"}
        emit("u", rows[n], 100 + n)
    for n in (1, 5, 9, 13):
        emit("d", rows[n], 200 + n)
    bad_email = f"{uuid.uuid4().hex}@bad.example.org"
    emit("c", {**rows[3], "id": 99, "email": bad_email, "salary": "not-a-number"}, 300)
    # Malformed JSON around a sensitive value: an error whose value can't even be parsed.
    torn_ssn = f"ssn-{uuid.uuid4().hex[:12]}"
    raw_values.add(torn_ssn)
    torn = f'{{"op":"c","after":{{"id":98,"ssn":"{torn_ssn}"'.encode()
    send(topic, b'{"id":98}', torn, base + 301)
    # Each partition moves past the hour, so it is closed.
    for partition in (0, 1):
        send(topic, b'{"id":1000}', b"{}", base + 3_600_000 + 1_000, partition=partition)

    asset = build_table_asset(checks=MIRROR_CHECKS, spec=spec)
    instance = dg.DagsterInstance.ephemeral()
    resources = {
        "kafka": kafka,
        "spark": spark_resource,
        "lake": lake,
        "masking": MaskingResource(key=dg.EnvVar(MASKING_KEY_ENV)),
    }
    capfd.readouterr()
    caplog.clear()
    result = dg.materialize([asset], partition_key=KEY, resources=resources, instance=instance)
    run_output, run_logging = capfd.readouterr(), caplog.text
    assert result.success
    path = lake.table_path(spec.name)

    # Stored: hashed columns are marked strings, the dropped column is gone.
    schema = spark.read.format("delta").load(path).schema
    assert "ssn" not in schema.fieldNames() and "phone" not in schema.fieldNames()
    for column in ("email", "salary", "seen_at"):
        assert schema[column].dataType == T.StringType()
        assert schema[column].metadata.get(MASKING_FIELD) == "hmac-sha256"

    # Row for row: the reference replay, its sensitive values masked by Python's own hmac.
    stored = stored_spec(spec)
    in_hour = [
        (p, o, v, None) for p, o, v, ts in read_topic(broker, topic) if ts < base + 3_600_000
    ]
    reference = replay(spec, in_hour)
    expected = {
        k: {
            "id": row["id"],
            "name": row["name"],
            **{c: _hmac(key, _canonical(row[c])) for c in ("email", "salary", "seen_at")},
        }
        for k, row in reference.items()
    }
    assert len(expected) == 24 - 4
    comparison = compare(path, stored, expected, {(n,) for n in range(24)})

    # Everywhere a value could leak: logs, the run's event log (materialization and check
    # metadata included), the run's config and job snapshot, the Delta commits' userMetadata
    # and statistics, the mirror's data files and change data feed, and the Spark plan.
    needles = raw_values | {key}
    materialization = result.asset_materializations_for_node("patients")[0]
    checks = result.get_asset_check_evaluations()
    # great-expectations judged the hashed column (not null, unique) and saw only hashes.
    passed = {c.check_name: c.passed for c in checks}
    assert passed["email_not_null"] and passed["email_unique"]
    drift = next(c for c in checks if c.check_name == "schema_drift")
    assert not drift.passed and drift.metadata["withheld_columns"].value == "phone"
    run = instance.get_run_by_id(result.run_id)
    sources = {
        "stdout/stderr": run_output.out + run_output.err,
        "python logging": run_logging,
        "event log": "\n".join(dg.serialize_value(e) for e in instance.all_logs(result.run_id)),
        "materialization metadata": repr(materialization.metadata),
        "check metadata": repr([(c.metadata, c.description) for c in checks]),
        "run config and job snapshot": dg.serialize_value(run.run_config)
        + dg.serialize_value(instance.get_job_snapshot(run.job_snapshot_id)),
        "Delta history": "\n".join(
            repr(r.asDict(recursive=True))
            for r in DeltaTable.forPath(spark, path).history().collect()
        ),
        "mirror files": _files(Path(path)),
        "mirror rows and change feed": "\n".join(
            spark.read.format("delta").load(path).toJSON().collect()
            + spark.read.format("delta")
            .option("readChangeFeed", "true")
            .option("startingVersion", 0)
            .load(path)
            .toJSON()
            .collect()
        ),
    }
    # The key is in no Spark plan (plans are logged and shown in the Spark UI).
    # The key is in no Spark plan, neither the hashes' nor the seal's derived from it.
    frame = spark.createDataFrame(
        [(1, "x", "y", b"k", b"v", "plan", 0, 1)],
        "id bigint, email string, ssn string, key binary, value binary, topic string, "
        "_cdc_kafka_partition int, _cdc_kafka_offset bigint",
    )
    small = TableSpec(
        name="plan",
        topic="plan",
        primary_key=("id",),
        columns={"id": "bigint", "email": "string", "ssn": "string"},
        start_hour="2026-11-01-00:00",
        sensitive={"email": "hash", "ssn": "drop"},
    )
    mask_changes(frame, small, HmacKey(key.encode())).explain(mode="extended")
    plan = capfd.readouterr().out
    sources["Spark plan"] = plan
    sealing = sealing_key(HmacKey(key.encode()))
    # The error table: its bad records' bytes are sealed, so no value is readable there either.
    errors_path = lake.table_path(spec.error_table_name)
    sources["error table files"] = _files(Path(errors_path))
    sources["error table rows, every column"] = _every_value(spark, errors_path)
    found = {
        name: _hits(text, needles) | {"sealing key"} & _sealing_hits(text, sealing)
        for name, text in sources.items()
    }
    hits = sum(len(h) for h in found.values())
    record("sensitive_columns_masked", comparison, faults=0, secret_hits=hits)

    # The scan can fail: it finds the values where they are, and it read real output.
    records = {(p, o): (k, v) for p, o, v, k, _ in read_records(broker, topic)}
    assert _hits(b"\n".join(v for _, v in records.values() if v), needles) == raw_values
    assert "patients" in sources["stdout/stderr"] and "kafka.net" in sources["python logging"]
    assert "hmac_sha256" in plan and "ASSET_MATERIALIZATION" in sources["event log"]
    assert "aes_siv_seal(key" in plan and "aes_siv_seal(value" in plan  # the seal is in it

    # Sealed, and opened with the key (the documented scheme, the library alone), each error
    # row gives back the bytes Kafka holds at its coordinates: the bad salary, the torn JSON.
    errors = spark.read.format("delta").load(errors_path)
    assert {errors.schema[c].metadata.get(MASKING_FIELD) for c in ("key", "value")} == {
        "aes-256-siv"
    }
    rows = errors.collect()
    assert len(rows) == 2
    opened = {(r["partition"], r["offset"]): _opened(key, r) for r in rows}
    assert opened == {coordinates: records[coordinates] for coordinates in opened}
    assert _hits(b"\n".join(v for _, v in opened.values()), needles) >= {bad_email, torn_ssn}
    # The same through the project's own opener (Spark's Python workers) ...
    unsealed = unsealed_errors(errors, HmacKey(key.encode())).collect()
    assert {(r["partition"], r["offset"]): (r["key"], r["value"]) for r in unsealed} == opened
    # ... and the operator's replay: the same bytes produced to the topic once more.
    before = set(records)
    outcome = replay_errors(
        spark=spark, kafka=kafka, lake=lake, spec=spec, key=HmacKey(key.encode()), hours=[KEY]
    )
    assert (outcome.selected, outcome.produced, outcome.sealed) == (2, 2, True)
    replayed = sorted(
        (k, v) for p, o, v, k, _ in read_records(broker, topic) if (p, o) not in before
    )
    assert replayed == sorted(opened.values())

    assert comparison.clean, comparison
    assert not hits, {name: sorted(h) for name, h in found.items() if h}


def test_spark_workers_seal_the_error_rows_and_a_raw_error_table_is_refused(
    create_topic, send, broker, kafka, spark, lake
):
    """The other decode path (a slice read by Spark, decoded and sealed in its Python workers)
    seals the same way; an error table written raw before is never mixed with sealed rows."""
    key = secrets.token_hex(32)
    topic = create_topic("masking-spark", partitions=1)
    spec = _spec(topic)
    base = int(HOUR.timestamp() * 1000)
    secret_email = f"{uuid.uuid4().hex}@spark.example.org"
    row = {"id": 1, "name": "a", "email": secret_email, "ssn": "s", "salary": "x", "seen_at": 0}
    send(topic, b'{"id":1}', _envelope("c", row, 7), base + 5)  # salary isn't a number
    send(topic, b'{"id":1000}', b"{}", base + 3_600_000 + 1_000)
    errors_path = lake.table_path(spec.error_table_name)
    run = dict(spark=spark, kafka=kafka, lake=lake, spec=spec, hour_key=KEY)
    masking_key = HmacKey(key.encode())

    # An error table from before the table had sensitive columns: raw, so the run stops.
    lake.connect(spark)
    DeltaTable.createIfNotExists(spark).location(errors_path).addColumns(
        ERROR_TABLE_SCHEMA
    ).execute()
    with pytest.raises(ErrorTableSealingError, match="table 'patients', setting 'sensitive'"):
        run_hour(checks=MIRROR_CHECKS, **run, masking_key=masking_key, local_read_max_records=0)
    assert not DeltaTable.isDeltaTable(spark, lake.table_path(spec.name))  # nothing written

    shutil.rmtree(errors_path)
    result = run_hour(
        checks=MIRROR_CHECKS, **run, masking_key=masking_key, local_read_max_records=0
    )
    assert result.counts.errors == 1 and result.counts.consumed == 1
    hits = _hits(_every_value(spark, errors_path) + _files(Path(errors_path)), {secret_email, key})
    assert not hits, hits
    (error,) = spark.read.format("delta").load(errors_path).collect()
    record_bytes = {(p, o): (k, v) for p, o, v, k, _ in read_records(broker, topic)}
    assert _opened(key, error) == record_bytes[(error["partition"], error["offset"])]
    assert secret_email.encode() in _opened(key, error)[1]  # the scan would have found it
