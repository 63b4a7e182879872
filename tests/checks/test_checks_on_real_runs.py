"""Every check, made to fail and made to pass, on the real broker, real Spark and real Delta."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta

import dagster as dg
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from kafka import KafkaAdminClient, TopicPartition

from cdc_assets.config import TableSpec
from cdc_assets.factory import build_table_asset
from cdc_assets.hour_run import run_hour
from checks.table_checks import MIRROR_CHECKS, build_retention_check_for, evaluate_run_checks
from demo.reference import replay
from tests.faults.figures import compare, record
from tests.support import diff_rows, mirror_rows, read_topic, run_daily_checks

pytestmark = pytest.mark.integration

HOUR = datetime(2026, 11, 4, 10, tzinfo=UTC)
KEYS = [(HOUR + timedelta(hours=n)).strftime("%Y-%m-%d-%H:%M") for n in range(3)]


def _spec(topic: str, **overrides) -> TableSpec:
    return TableSpec.model_validate(
        {
            "name": "accounts",
            "topic": topic,
            "primary_key": ["id"],
            "columns": {"id": "bigint", "name": "string", "balance": "decimal(10,2)"},
            "start_hour": "2026-11-01-00:00",
            "decimal_handling": "string",
        }
        | overrides
    )


def _change(op, row_id, lsn, *, name="n", balance="1.00", ts=HOUR, **extra) -> bytes:
    row = {"id": row_id, "name": name, "balance": balance, **extra}
    return json.dumps(
        {
            "op": op,
            "before": row if op == "d" else None,
            "after": None if op == "d" else row,
            "source": {"lsn": lsn, "ts_ms": int(ts.timestamp() * 1000)},
        }
    ).encode()


def _ms(moment: datetime) -> int:
    return int(moment.timestamp() * 1000)


def _key(row_id: int) -> bytes:
    return json.dumps({"id": row_id}).encode()


@pytest.fixture
def hour(spark, kafka, lake):
    """hour(spec, key): runs one hour and evaluates its checks; returns (result, checks)."""

    def _hour(spec: TableSpec, key: str = KEYS[0], target=lake):
        result = run_hour(
            checks=MIRROR_CHECKS, spark=spark, kafka=kafka, lake=target, spec=spec, hour_key=key
        )
        checks = evaluate_run_checks(
            spark=spark, spec=spec, path=target.table_path(spec.name), result=result
        )
        return result, {c.check_name: c for c in checks}

    return _hour


def _metadata_text(check: dg.AssetCheckResult) -> str:
    values = {name: str(value.value) for name, value in check.metadata.items()}
    return json.dumps(values) + (check.description or "")


def test_hard_expectations_keep_failing_changes_out_of_the_mirror(
    hour, create_topic, send, broker, spark, lake
):
    topic = create_topic("hard", partitions=2)
    spec = _spec(
        topic,
        expectations=[
            {"column": "balance", "expect": "between", "min": 0, "hard": True},
            {"column": "name", "expect": "regex", "regex": "^[a-z]+$", "hard": True},
            {"column": "name", "expect": "not_null"},
        ],
    )
    t = _ms(HOUR)
    records = [
        (1, _change("c", 1, 10, name="ann", balance="5.00")),
        (1, _change("u", 1, 11, name="ann", balance="-3.00")),  # balance: held back
        (2, _change("c", 2, 12, name="SecretBob", balance="1.00")),  # name: held back
        (3, _change("c", 3, 13, name="Cy9Secret", balance="-1.00")),  # both: held back
        (4, _change("c", 4, 14, name=None, balance="2.00")),  # soft not_null fails, written
        (5, _change("c", 5, 15, name="eve", balance="3.00")),
        (5, _change("d", 5, 16, name="eve", balance="-9.00")),  # deletes are never held back
    ]
    for n, (row_id, value) in enumerate(records):
        send(topic, _key(row_id), value, t + n, partition=row_id % 2)

    result, checks = hour(spec)

    # The reference: a plain replay of the changes that satisfy the hard rules.
    def passes(value: bytes) -> bool:
        envelope = json.loads(value)
        if envelope["op"] == "d":
            return True
        row = envelope["after"]
        name_ok = row["name"] is None or re.fullmatch("^[a-z]+$", row["name"]) is not None
        return float(row["balance"]) >= 0 and name_ok

    committed = read_topic(broker, topic)
    expected = replay(spec, [(p, o, v) for p, o, v, _ in committed if passes(v)])
    actual = mirror_rows(lake.table_path(spec.name), spec)
    assert diff_rows(actual, expected) == {"missing": [], "unexpected": [], "different": []}
    assert sorted(actual) == [(1,), (4,)]

    held = {
        (r["offset"], r["partition"]): r
        for r in spark.read.format("delta").load(lake.table_path(spec.error_table_name)).collect()
    }
    by_value = {r["value"]: r["reason"] for r in held.values()}
    assert by_value == {
        records[1][1]: "expectation 'balance_between' failed",
        records[2][1]: "expectation 'name_regex' failed",
        records[3][1]: "failed expectations: balance_between, name_regex",
    }
    assert result.counts.errors == 3 and checks["accounting"].passed

    assert not checks["balance_between"].passed
    assert checks["balance_between"].metadata["held_back"].value == 2
    assert checks["balance_between"].metadata["element_count"].value == 6  # deletes excepted
    assert checks["name_regex"].metadata["held_back"].value == 2
    assert checks["name_regex"].metadata["parameters"].value == {"regex": "^[a-z]+$"}
    not_null = checks["name_not_null"]
    assert not not_null.passed and not_null.severity == dg.AssetCheckSeverity.ERROR
    assert not_null.metadata["unexpected_count"].value == 1
    assert not_null.metadata["element_count"].value == 2  # the live rows the hour wrote
    assert checks["primary_key_not_null"].passed and checks["primary_key_unique"].passed
    for check in checks.values():  # counts and parameters only, never a row's values
        assert "Secret" not in _metadata_text(check)


def _accounting_hour(create_topic, send, name: str) -> TableSpec:
    topic = create_topic(name, partitions=1)
    t = _ms(HOUR)
    for n, (op, row_id) in enumerate([("c", 1), ("u", 1), ("c", 2), ("d", 2), ("c", 3)]):
        send(topic, _key(row_id), _change(op, row_id, 10 + n), t + n)
    send(topic, _key(4), None, t + 9)  # a tombstone
    send(topic, _key(5), b"{not json", t + 10)  # an error row
    return _spec(topic)


def test_the_accounting_adds_up_figures_counted_apart(hour, create_topic, send):
    result, checks = hour(_accounting_hour(create_topic, send, "accounting"))
    counts = result.counts
    # 7 records: 5 changes of 3 keys (2 superseded), 3 applied, a tombstone and an error.
    assert (counts.consumed, counts.applied, counts.superseded, counts.stale) == (7, 3, 2, 0)
    assert (counts.tombstones, counts.errors) == (1, 1)
    assert counts.distinct_keys == counts.merge_source_rows == 3
    assert checks["accounting"].passed


def test_the_accounting_fails_when_a_key_is_doubled_on_its_way_to_the_merge(
    hour, create_topic, send, monkeypatch
):
    """The newest-change-per-key step made to keep one key twice: Delta's count of the MERGE's
    source rows no longer matches the batch's distinct keys, and the identity breaks. The key is
    new, so Delta inserts both rows (it refuses two source rows only for a key it matches):
    the hour's `primary_key_unique` is the guard that catches it."""
    from cdc_assets import hour_batch

    original = hour_batch.newest_per_key

    def doubled(changes, spec):
        latest = original(changes, spec)
        return pa.concat_tables([latest, latest.filter(pc.equal(latest.column("id"), 3))])

    monkeypatch.setattr(hour_batch, "newest_per_key", doubled)
    result, checks = hour(_accounting_hour(create_topic, send, "doubled"))
    assert result.counts.merge_source_rows == result.counts.distinct_keys + 1
    accounting = checks["accounting"]
    assert not accounting.passed
    assert "3 distinct keys but the MERGE took 4 source rows" in accounting.description
    assert "consumed 7 but accounted for 8" in accounting.description
    unique = checks["primary_key_unique"]
    assert not unique.passed and unique.metadata["unexpected_count"].value == 1


def test_the_accounting_fails_when_the_decoder_loses_a_record(
    hour, create_topic, send, monkeypatch
):
    """The decoder made to skip the slice's last record: the reader's count of what Kafka
    returned is more than every category the decoder and the MERGE counted."""
    from cdc_assets import hour_run

    original = hour_run.decode_locally

    def lossy(records, spec, **kwargs):
        return original(records.slice(0, records.num_rows - 1), spec, **kwargs)

    monkeypatch.setattr(hour_run, "decode_locally", lossy)
    accounting = hour(_accounting_hour(create_topic, send, "lossy"))[1]["accounting"]
    assert not accounting.passed
    assert "consumed 7 but accounted for 6" in accounting.description


def test_the_accounting_fails_when_the_reader_loses_a_record(hour, create_topic, send, monkeypatch):
    """The reader made to drop the slice's last record: every category adds up to what it
    read, but Kafka's own consumers count 7 committed records in the slice's offsets."""
    from cdc_assets import hour_run

    original = hour_run.read_slice_locally

    def lossy(consumer, hour_slice, **kwargs):
        records = original(consumer, hour_slice, **kwargs)
        return records.slice(0, records.num_rows - 1)

    monkeypatch.setattr(hour_run, "read_slice_locally", lossy)
    accounting = hour(_accounting_hour(create_topic, send, "unread"))[1]["accounting"]
    assert not accounting.passed
    assert "Kafka holds 7 committed records" in accounting.description
    assert "the run read 6" in accounting.description
    assert accounting.metadata["aborted_records"].value == 0


def test_unique_is_judged_among_the_live_rows(hour, create_topic, send):
    topic = create_topic("unique", partitions=1)
    spec = _spec(topic, expectations=[{"column": "name", "expect": "unique", "severity": "WARN"}])
    t0, t1, t2 = (_ms(HOUR + timedelta(hours=n)) for n in range(3))
    send(topic, _key(1), _change("c", 1, 10, name="alpha"), t0)
    send(topic, _key(2), _change("c", 2, 11, name="beta"), t0 + 1)
    send(topic, _key(3), _change("c", 3, 20, name="alpha"), t1)  # collides with row 1
    send(topic, _key(2), _change("u", 2, 21, name="beta", balance="2.00"), t1 + 1)
    send(topic, _key(1), _change("d", 1, 30, name="alpha"), t2)
    send(topic, _key(9), _change("c", 9, 40, name="zeta"), t2 + 3_600_000)

    first = hour(spec, KEYS[0])[1]["name_unique"]
    assert first.passed and first.metadata["element_count"].value == 2
    second = hour(spec, KEYS[1])[1]["name_unique"]
    assert not second.passed and second.severity == dg.AssetCheckSeverity.WARN
    # Rows 1 and 3 share a value; row 1 was not written this hour but is live.
    assert second.metadata["unexpected_count"].value == 2
    assert second.metadata["element_count"].value == 3
    third = hour(spec, KEYS[2])[1]["name_unique"]  # row 1 deleted: no live collision left
    assert third.passed


def test_continuity_reports_the_gap_an_accepted_loss_leaves(hour, create_topic, send, broker):
    topic = create_topic("continuity", partitions=1)
    spec = _spec(topic, accept_data_loss=True)
    for n in range(10):
        send(topic, _key(n), _change("c", n, 100 + n), _ms(HOUR) + n)
    for n in range(10, 20):
        send(topic, _key(n), _change("c", n, 100 + n), _ms(HOUR + timedelta(hours=1)) + n)
    send(topic, _key(99), _change("c", 99, 999), _ms(HOUR + timedelta(hours=2)))

    first = hour(spec, KEYS[0])[1]["continuity"]
    assert first.passed and first.metadata["previous_hour_recorded"].value is False
    admin = KafkaAdminClient(bootstrap_servers=broker)
    admin.delete_records({TopicPartition(topic, 0): 15})
    admin.close()
    second = hour(spec, KEYS[1])[1]["continuity"]
    assert not second.passed
    assert second.description == "partition 0: gap, offsets [10, 15) were skipped"
    assert second.severity == dg.AssetCheckSeverity.ERROR
    third = hour(spec, KEYS[2])[1]["continuity"]
    assert third.passed and third.metadata["previous_end_offsets"].value == {"0": 20}


def test_schema_drift_error_rate_and_freshness_fail_on_a_bad_hour_and_pass_on_a_good_one(
    hour, create_topic, send
):
    topic = create_topic("drift", partitions=1)
    spec = _spec(
        topic,
        checks={"error_rate": {"max_share": 0.2}, "freshness": {"max_lag_minutes": 60}},
    )
    old = HOUR - timedelta(hours=5)  # the connector is five hours behind the source
    t = _ms(HOUR)
    for n in range(6):
        send(topic, _key(n), _change("c", n, 10 + n, ts=old, nickname="x"), t + n)
    for n in range(6, 8):  # the source now sends balance as a boolean: errors
        send(topic, _key(n), _change("c", n, 10 + n, ts=old, balance=True, nickname="x"), t + n)
    fresh = HOUR + timedelta(hours=1, minutes=50)
    for n in range(8, 12):
        send(topic, _key(n), _change("c", n, 10 + n, ts=fresh), t + 3_600_000 + n)
    send(topic, _key(99), _change("c", 99, 99, ts=fresh), t + 7_200_000)

    result, bad = hour(spec, KEYS[0])
    drift = bad["schema_drift"]
    assert not drift.passed
    assert "appeared: nickname" in drift.description
    assert (
        "column 'balance' (decimal(10,2)) arrives as JSON boolean, but the table's config reads "
        "it as Connect string" in drift.description
    )
    assert (
        not bad["error_rate"].passed and "2 of 8 changes (25.00%)" in bad["error_rate"].description
    )
    assert not bad["freshness"].passed and bad["freshness"].metadata["lag_minutes"].value == 360.0
    assert bad["accounting"].passed and result.counts.errors == 2

    _, good = hour(spec, KEYS[1])
    assert good["schema_drift"].passed and good["error_rate"].passed
    assert good["freshness"].passed and good["freshness"].metadata["lag_minutes"].value == 10.0


def test_a_failed_blocking_check_stops_downstream_in_a_real_run(
    create_topic, send, broker, kafka, spark_resource, lake
):
    topic = create_topic("blocking", partitions=1)
    spec = _spec(
        topic,
        expectations=[{"column": "name", "expect": "not_null", "blocking": True}],
    )
    send(topic, _key(1), _change("c", 1, 10, name=None), _ms(HOUR))
    send(topic, _key(2), _change("c", 2, 11, name="ok"), _ms(HOUR + timedelta(hours=1)))
    send(topic, _key(3), _change("c", 3, 12, name="ok"), _ms(HOUR + timedelta(hours=2)))
    mirror = build_table_asset(checks=MIRROR_CHECKS, spec=spec)
    retention = build_retention_check_for(spec=spec)

    @dg.asset(deps=[mirror.key], partitions_def=mirror.partitions_def)
    def accounts_report(context) -> None:
        context.log.info(f"read accounts {context.partition_key}")

    defs = [mirror, accounts_report, retention]
    resources = {"kafka": kafka, "spark": spark_resource, "lake": lake}
    with dg.instance_for_test() as instance:
        failed = dg.materialize(
            defs,
            partition_key=KEYS[0],
            resources=resources,
            instance=instance,
            raise_on_error=False,
        )
        evaluations = {c.check_name: c for c in failed.get_asset_check_evaluations()}
        assert not evaluations["name_not_null"].passed
        assert [m.asset_key for m in failed.get_asset_materialization_events()] == [mirror.key]
        # The separate retention check waits on the asset's blocking checks, so it is held too.
        assert "retention_risk" not in evaluations

        passed = dg.materialize(defs, partition_key=KEYS[1], resources=resources, instance=instance)
        materialized = {e.asset_key for e in passed.get_asset_materialization_events()}
        assert materialized == {mirror.key, accounts_report.key}
        evaluations = {c.check_name: c for c in passed.get_asset_check_evaluations()}
        assert evaluations["retention_risk"].passed  # the test broker keeps records unlimited
        assert evaluations["retention_risk"].metadata["retention_ms"].value == -1
        # The held hour did not stop the mirror: after the next hour it equals the replay of
        # both hours (fault suite, scenario 16).
        until = _ms(HOUR + timedelta(hours=2))
        records = [(p, o, v) for p, o, v, ts in read_topic(broker, topic) if ts < until]
        path, expected = lake.table_path(spec.name), replay(spec, records)
        comparison = compare(path, spec, expected, {(1,), (2,)})
        record("blocking_check_holds_downstream", comparison, faults=1)
        assert comparison.clean, comparison.details

        # Retention removes the first hour's offsets: re-running its check alone shows it.
        admin = KafkaAdminClient(bootstrap_servers=broker)
        admin.delete_records({TopicPartition(topic, 0): 2})
        admin.close()
        recheck = dg.define_asset_job(
            "recheck_retention",
            selection=dg.AssetSelection.checks(retention),
            partitions_def=mirror.partitions_def,
        )
        job = dg.Definitions(
            assets=[mirror], asset_checks=[retention], jobs=[recheck], resources=resources
        ).resolve_job_def("recheck_retention")
        # A check-only run names its hour by tag, as the UI's "Execute" on a check does
        # (execute_in_process's partition_key wants a selected asset).
        rechecked = job.execute_in_process(
            tags={"dagster/partition": KEYS[0]}, instance=instance, raise_on_error=False
        )
        (evaluation,) = rechecked.get_asset_check_evaluations()
        assert not evaluation.passed
        assert "offsets [0, 2) are already deleted" in evaluation.description
        assert rechecked.get_asset_materialization_events() == []


def test_a_duplicated_key_passes_the_hours_and_fails_the_daily_whole_table_check(
    hour, create_topic, send, kafka, spark_resource, spark, lake
):
    """A mirror row written twice (what a lost race with a second writer would leave): the
    hours after it pass `primary_key_unique`, which guards what each hour wrote, and the daily
    `primary_key_unique_table`, which judges the whole mirror, fails naming how many keys and
    rows; it passed on the same mirror before the duplicate. A duplicate made outside the
    pipeline is thus found within a day, not in the next hour that touches its key."""
    topic = create_topic("pk-unique", partitions=1)
    spec = _spec(topic)
    t0, t1, t2 = (_ms(HOUR + timedelta(hours=n)) for n in range(3))
    for row_id in (1, 2, 3):
        send(topic, _key(row_id), _change("c", row_id, 10 + row_id), t0 + row_id)
    send(topic, _key(2), _change("u", 2, 20, name="again"), t1)
    send(topic, _key(100), _change("c", 100, 30), t2)
    send(topic, _key(101), _change("c", 101, 31), t2 + 1)
    send(topic, _key(9), _change("c", 9, 40), t2 + 3_600_000)  # closes hour 2
    resources = {"kafka": kafka, "spark": spark_resource, "lake": lake}
    daily = (spec.name, "primary_key_unique_table")

    first = hour(spec, KEYS[0])[1]["primary_key_unique"]
    assert first.passed and first.metadata["element_count"].value == 3
    unique = run_daily_checks([spec], resources)[daily]
    assert unique.passed and unique.metadata["keys"].value == 3
    assert unique.metadata["duplicated_keys"].value == 0
    path = lake.table_path(spec.name)
    mirror = spark.read.format("delta").load(path)
    mirror.where("id = 3").write.format("delta").mode("append").save(path)  # row 3 twice

    second = hour(spec, KEYS[1])[1]["primary_key_unique"]
    assert second.passed and second.metadata["element_count"].value == 1
    result, checks = hour(spec, KEYS[2])
    third = checks["primary_key_unique"]
    assert third.passed and third.metadata["element_count"].value == 2
    duplicated = run_daily_checks([spec], resources)[daily]
    assert not duplicated.passed and duplicated.severity == dg.AssetCheckSeverity.ERROR
    figures = {name: value.value for name, value in duplicated.metadata.items()}
    assert figures["duplicated_keys"] == 1 and figures["duplicated_rows"] == 2
    assert (figures["keys"], figures["live_rows"]) == (5, 6)
    assert figures["delta_version"] == result.delta_version  # the third hour's commit
    described = duplicated.description
    assert "1 of its 5 live keys has more than one live row (2 rows in all)" in described
    assert "GROUP BY id HAVING count(*) > 1" in described
    # An hour that touches the duplicated key: its MERGE updates both rows, and its own check
    # (what the hour wrote: one source row per key) passes. The delay the daily check trades
    # for no scan of the mirror per hour.
    send(topic, _key(3), _change("u", 3, 50, name="touched"), t2 + 3_600_001)
    send(topic, _key(9), _change("u", 9, 60), t2 + 7_200_000)  # closes hour 3
    fourth_key = (HOUR + timedelta(hours=3)).strftime("%Y-%m-%d-%H:%M")
    fourth = hour(spec, fourth_key)[1]["primary_key_unique"]
    assert fourth.passed and fourth.metadata["element_count"].value == 2  # keys 3 and 9


def test_an_hour_over_its_error_share_fails_the_run_unless_the_table_accepts_it(
    create_topic, send, kafka, spark_resource, lake
):
    """5 % undecodable changes (1 of 20): the error_rate check blocks by default, so the run
    fails naming the column and the fix, and Dagster shows it red; a table that says
    `error_rate: {severity: WARN}` materializes the same hour green, its check red."""
    topic = create_topic("error-share", partitions=1)
    for n in range(19):
        send(topic, _key(n), _change("c", n, 10 + n), _ms(HOUR) + n)
    send(topic, _key(19), _change("c", 19, 29, balance=True), _ms(HOUR) + 19)  # undecodable
    send(topic, _key(99), _change("c", 99, 99), _ms(HOUR + timedelta(hours=1)))
    resources = {"kafka": kafka, "spark": spark_resource, "lake": lake}
    send(topic, _key(98), _change("c", 98, 98), _ms(HOUR + timedelta(hours=2)))
    strict, ranged, lenient = (
        _spec(topic, name=name, **extra)
        for name, extra in (
            ("strict", {}),
            ("ranged", {}),
            ("lenient", {"checks": {"error_rate": {"severity": "WARN"}}}),
        )
    )
    with dg.instance_for_test() as instance:
        failed = dg.materialize(
            [build_table_asset(checks=MIRROR_CHECKS, spec=strict)],
            partition_key=KEYS[0],
            resources=resources,
            instance=instance,
            raise_on_error=False,
        )
        assert not failed.success
        (check,) = [c for c in failed.get_asset_check_evaluations() if c.check_name == "error_rate"]
        assert not check.passed and check.severity == dg.AssetCheckSeverity.ERROR
        assert "1 of 20 changes (5.00%)" in check.description
        assert "column 'balance'" in check.description  # the reason names the column and fix
        assert "error_rate: {severity: WARN}" in check.description

        # A run over a range of hours (a backfill) fails the same way.
        over_range = dg.materialize(
            [build_table_asset(checks=MIRROR_CHECKS, spec=ranged)],
            tags={
                "dagster/asset_partition_range_start": KEYS[0],
                "dagster/asset_partition_range_end": KEYS[1],
            },
            resources=resources,
            instance=instance,
            raise_on_error=False,
        )
        assert not over_range.success
        rates = {
            c.partition: c.passed
            for c in over_range.get_asset_check_evaluations()
            if c.check_name == "error_rate"
        }
        assert rates == {KEYS[0]: False, KEYS[1]: True}

        accepted = dg.materialize(
            [build_table_asset(checks=MIRROR_CHECKS, spec=lenient)],
            partition_key=KEYS[0],
            resources=resources,
            instance=instance,
        )
        assert accepted.success
        (check,) = [
            c for c in accepted.get_asset_check_evaluations() if c.check_name == "error_rate"
        ]
        assert not check.passed and check.severity == dg.AssetCheckSeverity.WARN
