"""Sensitive columns are stored masked, and their raw values reach no log, metadata or commit.

One hour of changes with distinctive sensitive values (random emails and SSNs) goes through the
real asset (real broker, Spark, Delta, great-expectations, an ephemeral Dagster instance). The
hashed columns must equal an independent Python HMAC of the reference replay's values, the
dropped column must be absent, the other columns must equal the replay, and neither a raw
sensitive value nor the key may appear anywhere a person or a log collector could read it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import dagster as dg
import pytest
from delta.tables import DeltaTable
from pyspark.sql import functions as F
from pyspark.sql import types as T

from cdc_assets.config import TableSpec
from cdc_assets.factory import build_table_asset
from cdc_assets.masking import MASKING_FIELD, mask_changes, stored_spec
from demo.reference import replay
from resources.masking import MASKING_KEY_ENV, HmacKey, MaskingResource
from tests.faults.figures import compare, record
from tests.support import read_topic

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
        sensitive={"email": "hash", "ssn": "drop", "salary": "hash", "seen_at": "hash"},
        expectations=(
            {"column": "email", "expect": "not_null", "hard": True},
            {"column": "email", "expect": "unique"},
        ),
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
        raw_values.update({row["email"], row["ssn"]})
        send(topic, json.dumps({"id": row["id"]}).encode(), _envelope(op, row, lsn), base + second)

    for n in range(24):
        rows[n] = {
            "id": n,
            "name": f"patient-{n}",
            "email": f"{uuid.uuid4().hex}@example.org",
            "ssn": f"ssn-{uuid.uuid4().hex[:12]}",
            "salary": f"{1000 + 17 * n}.{n % 10}0",
            "seen_at": int((HOUR + timedelta(minutes=n, microseconds=n)).timestamp() * 1_000_000),
        }
        emit("c", rows[n], n)
    for n in range(0, 16, 2):
        rows[n] = {**rows[n], "email": f"{uuid.uuid4().hex}@example.net", "salary": "77.25"}
        emit("u", rows[n], 100 + n)
    for n in (1, 5, 9, 13):
        emit("d", rows[n], 200 + n)
    bad_email = f"{uuid.uuid4().hex}@bad.example.org"
    emit("c", {**rows[3], "id": 99, "email": bad_email, "salary": "not-a-number"}, 300)
    # Each partition moves past the hour, so it is closed.
    for partition in (0, 1):
        send(topic, b'{"id":1000}', b"{}", base + 3_600_000 + 1_000, partition=partition)

    asset = build_table_asset(spec=spec)
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
    assert "ssn" not in schema.fieldNames()
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
    comparison = compare(spark, path, stored, expected, {(n,) for n in range(24)})

    # Everywhere a value could leak: logs, the run's event log (materialization and check
    # metadata included), the run's config and job snapshot, the Delta commits' userMetadata
    # and statistics, the mirror's data files and change data feed, and the Spark plan.
    needles = raw_values | {key}
    materialization = result.asset_materializations_for_node("patients")[0]
    checks = result.get_asset_check_evaluations()
    # great-expectations judged the hashed column (not null, unique) and saw only hashes.
    passed = {c.check_name: c.passed for c in checks}
    assert passed["email_not_null"] and passed["email_unique"]
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
    frame = spark.createDataFrame([(1, "x", "y")], "id bigint, email string, ssn string")
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
    # The error table keeps a bad record's raw bytes (documented): not the key, though.
    errors_path = Path(lake.table_path(spec.error_table_name))
    sources["error table (key only)"] = _files(errors_path)
    found = {
        name: _hits(text, {key} if name.startswith("error table") else needles)
        for name, text in sources.items()
    }
    hits = sum(len(h) for h in found.values())
    record("sensitive_columns_masked", comparison, faults=0, secret_hits=hits)

    # The scan can fail: it finds the values where they are, and it read real output.
    assert _hits(b"\n".join(v for _, _, v, _ in read_topic(broker, topic) if v), needles) == (
        raw_values
    )
    error_values = (
        spark.read.format("delta").load(str(errors_path)).select(F.col("value").cast("string"))
    )
    assert _hits("\n".join(r[0] for r in error_values.collect()), {bad_email}) == {bad_email}
    assert "patients" in sources["stdout/stderr"] and "kafka.net" in sources["python logging"]
    assert "hmac_sha256" in plan and "ASSET_MATERIALIZATION" in sources["event log"]

    assert comparison.clean, comparison
    assert not hits, {name: sorted(h) for name, h in found.items() if h}
