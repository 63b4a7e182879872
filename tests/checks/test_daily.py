"""The daily checks (checks/daily.py): their verdicts from counts, and their job run as the
schedule launches it on tables a real hour wrote (nothing to judge before the first hour, a
history that agrees with its mirror, then a mirror row changed outside the pipeline). A
duplicated key through real hours is tests/checks/test_checks_on_real_runs.py's."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import dagster as dg
import pytest

from cdc_assets.history import HistoryAudit
from cdc_assets.hour_run import run_hour
from checks.daily import KeyDuplicates, history_table_result, primary_key_unique_table_result
from checks.table_checks import MIRROR_CHECKS
from tests.support import accounts_spec, run_daily_checks

HOUR = datetime(2026, 11, 4, 10, tzinfo=UTC)


def _change(op: str, row_id: int, lsn: int, name: str) -> bytes:
    row = {"id": row_id, "name": name, "balance": "1.00"}
    return json.dumps(
        {
            "op": op,
            "before": row if op == "d" else None,
            "after": None if op == "d" else row,
            "source": {"lsn": lsn, "ts_ms": int(HOUR.timestamp() * 1000) + lsn},
        }
    ).encode()


def test_the_verdicts_follow_the_tables_policy_and_never_name_a_key():
    spec = accounts_spec("t", checks={"primary_key": {"severity": "WARN"}}, history=True)
    found = KeyDuplicates(live_rows=10, keys=7, duplicated_keys=2, duplicated_rows=5)
    result = primary_key_unique_table_result(spec, found, path="/lake/accounts", version=4)
    assert not result.passed and result.severity == dg.AssetCheckSeverity.WARN
    assert "2 of its 7 live keys have more than one live row (5 rows in all)" in result.description
    assert "not blocking" in result.description
    assert {k: v.value for k, v in result.metadata.items()} == {
        "table_exists": True,
        "delta_version": 4,
        "live_rows": 10,
        "keys": 7,
        "duplicated_keys": 2,
        "duplicated_rows": 5,
        "primary_key": "id",
    }
    none_yet = primary_key_unique_table_result(spec, None, path="/lake/accounts", version=None)
    assert none_yet.passed and "no mirror yet" in none_yet.description

    audit = HistoryAudit(keys=7, current_not_one=1, broken_intervals=0, mirror_mismatches=0)
    result = history_table_result(spec, audit, history_version=9, mirror_version=4)
    assert not result.passed and result.severity == dg.AssetCheckSeverity.ERROR  # the default
    assert "1 keys have no current version or several" in result.description
    no_history = history_table_result(spec, None, history_version=None, mirror_version=4)
    assert no_history.passed and "`accounts__history` has not been written yet" in (
        no_history.description
    )


@pytest.mark.integration
def test_history_table_judges_every_key_of_the_history_against_the_mirror(
    create_topic, send, kafka, spark_resource, spark, lake
):
    topic = create_topic("daily-history", partitions=1)
    spec = accounts_spec(topic, history=True)
    resources = {"kafka": kafka, "spark": spark_resource, "lake": lake}
    history, unique = (spec.name, "history_table"), (spec.name, "primary_key_unique_table")

    # No hour has run: nothing to judge, and no Spark job to find that out.
    before = run_daily_checks([spec], resources)
    assert before[history].passed and before[unique].passed
    assert "has not been written yet" in before[history].description

    t = int(HOUR.timestamp() * 1000)
    changes = [
        (1, "c", 10, "ann"),
        (1, "u", 11, "anne"),  # two versions of key 1
        (2, "c", 12, "bob"),
        (3, "c", 13, "cy"),
        (3, "d", 14, "cy"),  # key 3's current version is its delete
    ]
    for n, (row_id, op, lsn, name) in enumerate(changes):
        send(topic, json.dumps({"id": row_id}).encode(), _change(op, row_id, lsn, name), t + n)
    send(topic, b'{"id": 9}', _change("c", 9, 20, "closes"), t + 3_600_000)
    run_hour(
        checks=MIRROR_CHECKS,
        spark=spark,
        kafka=kafka,
        lake=lake,
        spec=spec,
        hour_key=HOUR.strftime("%Y-%m-%d-%H:%M"),
    )

    agreed = run_daily_checks([spec], resources)
    assert agreed[history].passed and agreed[unique].passed
    figures = {name: value.value for name, value in agreed[history].metadata.items()}
    assert figures["keys"] == 3 and figures["keys_differing_from_mirror"] == 0

    # A writer outside the pipeline changes key 2's row: the history no longer matches it.
    spark.sql(f"UPDATE delta.`{lake.table_path(spec.name)}` SET name = 'edited' WHERE id = 2")
    differs = run_daily_checks([spec], resources)[history]
    assert not differs.passed and differs.severity == dg.AssetCheckSeverity.ERROR
    figures = {name: value.value for name, value in differs.metadata.items()}
    assert (figures["keys"], figures["keys_differing_from_mirror"]) == (3, 1)
    assert (figures["keys_without_one_current_version"], figures["broken_intervals"]) == (0, 0)
    assert figures["delta_version"] == agreed[history].metadata["delta_version"].value + 1
    assert "1 keys' current version differs from the mirror's row" in differs.description
    assert "edited" not in differs.description + json.dumps(figures)  # no user value
