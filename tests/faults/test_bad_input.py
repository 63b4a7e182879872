"""Bad and unusual input: scenarios 6, 8, 9, 10, 11 and 14 of the fault suite.

Tombstones, null and mismatched Kafka keys; truncates; transactions aborted inside a slice or
open across the hour's end; offsets deleted before an hour ran; a topic compacted between two
runs of an hour; malformed, mistyped, oversized records and unknown ops. Each compares the
mirror with the reference replay of what Kafka committed and records its figures.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta

import dagster as dg
import pytest
from kafka import KafkaAdminClient, KafkaProducer, TopicPartition
from kafka.admin import ConfigResource, ConfigResourceType, NewTopic

from cdc_assets import hour_run
from cdc_assets.commits import hour_history
from cdc_assets.config import CheckPolicy
from cdc_assets.factory import build_table_asset
from cdc_assets.hour_run import TruncateError, run_hour
from cdc_assets.hours import hour_start
from cdc_assets.slicing import DataLossError, OpenHourError
from checks.invariants import accounting_result
from checks.table_checks import MIRROR_CHECKS, build_retention_check_for
from resources.lake import LakeResource
from tests.faults import table
from tests.faults.figures import Comparison, compare, record
from tests.support import read_topic

pytestmark = pytest.mark.integration


@pytest.fixture
def scenario(broker, kafka, spark, create_topic, lake):
    """make(name, partitions=2, **spec) -> (spec, run(hour, **kw), check())."""

    def make(name: str, partitions: int = 2, topic: str | None = None, **overrides):
        spec = table.spec(topic or create_topic(f"faults-{name}", partitions), **overrides)

        def run(hour: int, lake: LakeResource = lake, **options):
            return run_hour(
                checks=MIRROR_CHECKS,
                spark=spark,
                kafka=kafka,
                lake=lake,
                spec=spec,
                hour_key=table.hour_key(hour),
                **options,
            )

        def check(upto_hour: int | None = None):
            ref = table.reference(broker, spec, upto_hour=upto_hour)
            return compare(lake.table_path(spec.name), spec, ref.expected, ref.seen_keys)

        return spec, run, check

    return make


def _accounted(result) -> bool:
    """I2 holds: every consumed record is applied, superseded, stale, a tombstone or an error."""
    return accounting_result(result, CheckPolicy()).passed


def _errors(spark, lake, spec) -> list[dict]:
    path = lake.table_path(spec.error_table_name)
    return [r.asDict() for r in spark.read.format("delta").load(path).collect()]


def test_tombstones_null_keys_and_keys_naming_another_row(broker, scenario, spark, lake):
    spec, run, check = scenario("keys")
    changes = [
        table.change("c", 1, 101, second=1),
        table.change("c", 2, 102, second=2, kafka_key=None),  # a null Kafka key: the row's own
        table.change("d", 1, 103, second=3),
        table.tombstone(1, second=3),
        table.change("u", 2, 104, second=5, kafka_key=None),
        table.change("c", 3, 105, second=6, kafka_key=4),  # keyed as row 4
        table.change("d", 2, 106, second=7, kafka_key=5),  # a delete keyed as row 5
        table.change("c", 6, 107, second=8),
    ]
    table.send_all(broker, spec.topic, changes)
    table.close_hours(broker, spec.topic, 2, after_hour=0)

    result = run(0)
    comparison = check()
    record("tombstones_null_and_mismatched_keys", comparison, faults=4)
    assert comparison.clean, comparison.details
    assert _accounted(result)
    mismatched = [e for e in _errors(spark, lake, spec) if "Kafka key" in e["reason"]]
    assert len(mismatched) == 2 and result.counts.errors == 2
    assert {e["reason"] for e in mismatched} == {
        "the Kafka key's 'id' differs from the row's primary key"
    }
    assert result.counts.tombstones == 1


def test_a_truncate_stops_the_run_unless_the_table_applies_it(
    broker, scenario, spark, lake, tmp_path
):
    spec, run, check = scenario("truncate")
    truncate = json.dumps({"op": "t", "before": None, "after": None, "source": {"lsn": 300}})
    changes = [
        *[table.change("c", n, 100 + n, second=n) for n in range(1, 6)],
        table.change("u", 1, 201, hour=1, second=1, name="before the truncate"),
        table.Change(1, truncate.encode(), None, partition=0, second=2),
        table.change("c", 7, 301, hour=1, second=3),
        table.change("u", 2, 302, hour=1, second=4, name="after the truncate"),
        table.change("u", 3, 250, hour=2, second=1, name="older than the truncate, late"),
    ]
    table.send_all(broker, spec.topic, changes)
    table.close_hours(broker, spec.topic, 2, after_hour=2)

    run(0)
    before = hour_history(spark, lake.table_path(spec.name))[0]
    with pytest.raises(TruncateError) as stopped:
        run(1)
    message = str(stopped.value)
    assert "'accounts'" in message and table.hour_key(1) in message
    assert "partition 0 offset" in message and "on_truncate: apply" in message
    # Nothing of the hour was written: the mirror has no new commit.
    assert hour_history(spark, lake.table_path(spec.name))[0] == before

    applying, run_applying, check_applying = scenario(
        "truncate", topic=spec.topic, on_truncate="apply"
    )
    faults = 0
    for hour in (2, 1, 0, 1, 2):  # the truncate's hour before and after the older hours
        result = run_applying(hour)
        assert _accounted(result), result.counts
        faults += 1
    comparison = check_applying()
    # From scratch, the truncate's hour first: the older hours' keys must stay out (the
    # watermark from the log), and the later hour's older change too.
    fresh = LakeResource(root=str(tmp_path / "fresh"))
    for hour in (1, 0, 2):
        assert _accounted(run_applying(hour, lake=fresh))
    ref = table.reference(broker, applying)
    on_fresh = compare(fresh.table_path(spec.name), spec, ref.expected, ref.seen_keys)
    record("truncate_fail_or_apply", comparison, faults=faults + 4)
    record("truncate_first_then_older_hours", on_fresh, faults=3)
    assert comparison.clean, comparison.details
    assert on_fresh.clean, on_fresh.details
    assert sorted(ref.expected) == [(2,), (7,)]


def test_aborted_and_open_transactions(broker, scenario, spark, tmp_path):
    # An aborted transaction inside hour 0: its records and markers take offsets, never rows.
    spec, run, check = scenario("txn-aborted", partitions=1)
    committed = [table.change("c", 1, 101, second=1), table.change("u", 1, 104, second=20)]
    table.send_all(broker, spec.topic, committed)
    producer = KafkaProducer(bootstrap_servers=broker, transactional_id=f"{spec.topic}-tx")
    producer.init_transactions()
    producer.begin_transaction()
    for n, change in enumerate([table.change("c", 2, 102), table.change("u", 1, 103)]):
        at = table.stamp(0, 10 + n)
        producer.send(spec.topic, key=change.key, value=change.value, timestamp_ms=at)
    producer.flush()
    producer.abort_transaction()
    producer.close()
    table.close_hours(broker, spec.topic, 1, after_hour=0)
    # The abort marker is stamped when it was written (today), so hour 0 ends at it; records
    # after a marker follow the log into the hour of the marker's time, like any late stamp.
    result = run(0)
    aborted = check(upto_hour=0)
    assert _accounted(result)
    # Only the 2 committed changes are read: the aborted records and the marker are offsets
    # without records, and the accounting check does not count them as loss.
    assert result.counts.consumed == 2 and result.slice.size == 4  # 2 changes, 2 aborted
    # Kafka's own count explains the gap (kafka-python here, Spark's Kafka source for a slice
    # Spark reads): 2 aborted records, no marker (the abort marker lies past the hour's end).
    for read in (
        result,
        run(0, lake=LakeResource(root=str(tmp_path / "spark-read")), local_read_max_records=0),
    ):
        assert _accounted(read) and read.counts.consumed == 2
        assert read.counts.census is not None
        assert (read.counts.census.committed, read.counts.census.uncommitted) == (2, 4)

    # A transaction open across the end of hour 0 keeps the hour open until it ends.
    spec, run, check = scenario("txn-open", partitions=1)
    table.send_all(broker, spec.topic, [table.change("c", 5, 501, second=1)])
    producer = KafkaProducer(bootstrap_servers=broker, transactional_id=f"{spec.topic}-tx")
    producer.init_transactions()
    producer.begin_transaction()
    late = table.change("c", 6, 502, second=3000)
    producer.send(spec.topic, key=late.key, value=late.value, timestamp_ms=table.stamp(0, 3000))
    producer.flush()
    table.close_hours(broker, spec.topic, 1, after_hour=0)  # above the open transaction
    fresh = LakeResource(root=str(tmp_path / "open"))
    try:
        with pytest.raises(OpenHourError, match="open transaction"):
            run(0, lake=fresh)
    finally:
        producer.commit_transaction()
        producer.close()
    held = run(0, lake=fresh)
    assert held.counts.consumed == 2 and _accounted(held)
    ref = table.reference(broker, spec)
    opened = compare(fresh.table_path(spec.name), spec, ref.expected, ref.seen_keys)
    figures = ("lost", "duplicates", "resurrected", "mismatches")
    total = Comparison(**{n: getattr(aborted, n) + getattr(opened, n) for n in figures})
    record("aborted_and_open_transactions", total, faults=2)
    assert total.clean, (aborted.details, opened.details)


def test_offsets_deleted_before_an_hour_ran(broker, scenario, kafka, spark, spark_resource, lake):
    spec, run, check = scenario("deleted", partitions=1)
    changes = [table.change("c", n, 100 + n, second=n) for n in range(10)]
    changes += [table.change("c", n, 200 + n, hour=1, second=n) for n in range(10, 20)]
    table.send_all(broker, spec.topic, changes)
    table.close_hours(broker, spec.topic, 1, after_hour=1)
    run(0)
    before_loss = table.reference(broker, spec, upto_hour=0)  # Kafka won't hold it for long
    admin = KafkaAdminClient(bootstrap_servers=broker)
    admin.delete_records({TopicPartition(spec.topic, 0): 15})
    admin.close()

    with pytest.raises(DataLossError, match=r"partition 0: offsets \[10, 15\)"):
        run(1)
    # The retention-risk check, re-run on hour 0, shows it can no longer be replayed either.
    retention = build_retention_check_for(spec=spec)
    asset = build_table_asset(checks=MIRROR_CHECKS, spec=spec)
    selection = dg.AssetSelection.checks(retention)
    partitions = asset.partitions_def
    recheck = dg.define_asset_job("recheck", selection=selection, partitions_def=partitions)
    job = dg.Definitions(
        assets=[asset],
        asset_checks=[retention],
        jobs=[recheck],
        resources={"kafka": kafka, "spark": spark_resource, "lake": lake},
    ).resolve_job_def("recheck")
    checked = job.execute_in_process(
        tags={"dagster/partition": table.hour_key(0)}, raise_on_error=False
    )
    (evaluation,) = checked.get_asset_check_evaluations()
    assert not evaluation.passed
    assert "offsets [0, 15) are already deleted" in evaluation.description
    # The hour-0 rows stay; the mirror holds what was read before the loss, nothing invented.
    path = lake.table_path(spec.name)
    comparison = compare(path, spec, before_loss.expected, before_loss.seen_keys)
    record("offsets_deleted_by_retention", comparison, faults=1)
    assert comparison.clean, comparison.details


def test_a_topic_compacted_between_two_runs_of_an_hour(broker, scenario, lake):
    admin = KafkaAdminClient(bootstrap_servers=broker)
    topic = f"faults-compacted-{time.time_ns()}"
    # The cleaner measures the lag from the records' own timestamps, which lie in a fixed past
    # hour: the lag must outlast their age, or the topic may be compacted before the first run.
    not_yet = int(time.time() * 1000) - table.stamp(0) + 24 * 3_600_000
    configs = {
        "cleanup.policy": "compact",
        "segment.ms": "100",
        "min.cleanable.dirty.ratio": "0.0001",
        "min.compaction.lag.ms": str(not_yet),  # not before the first run
    }
    admin.create_topics([NewTopic(topic, 1, 1, topic_configs=configs)])
    spec, run, check = scenario("compacted", topic=topic)
    try:
        changes = []
        for n in range(30):
            changes.append(table.change("u" if n >= 5 else "c", n % 5, 100 + n, second=n))
        table.send_all(broker, topic, changes)
        time.sleep(1)
        table.close_hours(broker, topic, 1, after_hour=0)
        first = run(0)
        assert first.counts.consumed == len(changes), "compacted before the first run"
        configs["min.compaction.lag.ms"] = "0"  # now the log cleaner may compact
        admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, topic, configs=configs)])
        time.sleep(1)
        table.close_hours(broker, topic, 1, after_hour=1)  # rolls the segment again
        deadline = time.monotonic() + 90
        while len(read_topic(broker, topic)) >= 32 and time.monotonic() < deadline:
            time.sleep(2)
        remaining = len(read_topic(broker, topic))
        assert remaining < 32, "the log cleaner did not compact the topic in 90 s"
        second = run(0)
        assert second.counts.consumed < first.counts.consumed
        assert _accounted(second)
        comparison = check()
        record("compacted_between_runs", comparison, faults=32 - remaining)
        assert comparison.clean, comparison.details
    finally:
        admin.delete_topics([topic])
        admin.close()


def test_malformed_mistyped_oversized_and_unknown_records(broker, scenario, spark, lake):
    spec, run, check = scenario("malformed", max_record_bytes=4096)
    big = table.change("c", 9, 109, name="x" * 5000)
    changes = [
        table.change("c", 1, 101, second=1),
        table.raw(b"{not json", key=table.key_bytes(2)),
        table.raw(
            json.dumps(
                {
                    "op": "c",
                    "after": {"id": 3, "name": "n", "balance": "many"},
                    "source": {"lsn": 103},
                }
            ).encode(),
            key=table.key_bytes(3),
        ),
        table.Change(0, big.value, big.key, None, 4),
        table.raw(
            json.dumps(
                {"op": "x", "after": {"id": 5, "name": "n", "balance": 1}, "source": {"lsn": 105}}
            ).encode(),
            key=table.key_bytes(5),
        ),
        table.change("u", 1, 106, second=6, name="still applied"),
    ]
    table.send_all(broker, spec.topic, changes)
    table.close_hours(broker, spec.topic, 2, after_hour=0)

    result = run(0)
    comparison = check()
    record("malformed_mistyped_oversized_unknown", comparison, faults=4)
    assert comparison.clean, comparison.details
    errors = _errors(spark, lake, spec)
    assert result.counts.errors == len(errors) == 4 and _accounted(result)
    reasons = sorted(e["reason"] for e in errors)
    assert reasons == sorted(
        [
            "value is not valid JSON",
            "column 'balance' holds a string where Connect int64 was expected; declare the column "
            "with the type the source sends",
            "value is larger than max_record_bytes (4096)",
            "unknown op",
        ]
    )
    assert all(e["value"] for e in errors)  # raw bytes kept
    assert hour_start(table.hour_key(0)) + timedelta(hours=1) == hour_start(table.hour_key(1))


def _with(change: table.Change, **extra) -> table.Change:
    """`change` with extra `after` columns, as a source table that gained a column sends it."""
    document = json.loads(change.value)
    document["after"].update(extra)
    return table.Change(change.hour, json.dumps(document).encode(), change.key, None, change.second)


def test_a_new_column_is_added_and_incompatible_values_are_errors(broker, scenario, spark, lake):
    spec, run, check = scenario("schema")
    changes = [
        table.change("c", 1, 101, second=1),
        table.change("c", 2, 102, second=2),
        # The source gains a nullable column `tier` in hour 1.
        _with(table.change("u", 1, 201, hour=1, second=1), tier="gold"),
        _with(table.change("c", 3, 202, hour=1, second=2), tier=None),
        table.change("u", 2, 203, hour=1, second=3),  # an old-format change, without it
        # A declared column changes type: the record is an error, nothing of it is applied.
        table.raw(
            json.dumps(
                {"op": "u", "after": {"id": 2, "name": "x", "balance": "12"}, "source": {"lsn": 4}}
            ).encode(),
            key=table.key_bytes(2),
        ),
        # In hour 2 the added column's type changes: an error too.
        _with(table.change("u", 3, 301, hour=2, second=1), tier=7),
        _with(table.change("c", 4, 302, hour=2, second=2), tier="silver"),
    ]
    changes[5] = table.Change(1, changes[5].value, changes[5].key, None, 4)
    table.send_all(broker, spec.topic, changes)
    table.close_hours(broker, spec.topic, 2, after_hour=2)

    results = [run(0), run(1), run(2), run(1)]
    added = {"tier": "string"}
    ref = table.reference(broker, spec, added_columns=added)
    with_tier = spec.model_copy(update={"columns": {**spec.columns, **added}})
    comparison = compare(lake.table_path(spec.name), with_tier, ref.expected, ref.seen_keys)
    record("schema_new_column_and_type_change", comparison, faults=3)
    assert comparison.clean, comparison.details
    assert all(_accounted(r) for r in results)
    path = lake.table_path(spec.name)
    mirror = spark.read.format("delta").load(path)
    assert dict(mirror.dtypes)["tier"] == "string"
    tiers = {r["id"]: r["tier"] for r in mirror.where("NOT _cdc_deleted").collect()}
    assert tiers == {1: "gold", 2: None, 3: None, 4: "silver"}
    assert results[1].error_reasons == {
        "column 'balance' holds a string where Connect int64 was expected; declare the column "
        "with the type the source sends": 1
    }
    assert results[2].error_reasons == {
        "column 'tier' holds a JSON integer where Connect string was expected; declare the "
        "column with the type the source sends": 1
    }


def test_an_unchanged_toasted_value_keeps_the_newest_known_one(broker, scenario, spark, tmp_path):
    spec, run, check = scenario("toast", toasted_columns=("name",))
    unchanged = "__debezium_unavailable_value"
    changes = [
        table.change("c", 1, 101, second=1, name="long text 1"),
        table.change("u", 1, 102, second=2, name=unchanged),  # only balance changed
        table.change("c", 2, 103, second=3, name="long text 2"),
        table.change("c", 3, 104, second=4, name="long text 3"),
        table.change("u", 2, 201, hour=1, second=1, name="long text 2, edited"),
        table.change("u", 1, 202, hour=1, second=2, name=unchanged),
        table.change("u", 2, 301, hour=2, second=1, name=unchanged),
        table.change("u", 3, 302, hour=2, second=2, name=unchanged),
        # The placeholder in a column not listed under toasted_columns is an error.
        table.raw(
            json.dumps(
                {
                    "op": "u",
                    "after": {"id": 3, "name": "x", "balance": unchanged},
                    "source": {"lsn": 303},
                }
            ).encode(),
            key=table.key_bytes(3),
        ),
    ]
    changes[-1] = table.Change(2, changes[-1].value, changes[-1].key, None, 3)
    table.send_all(broker, spec.topic, changes)
    table.close_hours(broker, spec.topic, 2, after_hour=2)

    outcomes = []
    for n, order in enumerate([(0, 1, 2), (2, 1, 0, 2)]):  # in order; newest first, repeated
        lake = LakeResource(root=str(tmp_path / f"order{n}"))
        for hour in order:
            assert _accounted(run(hour, lake=lake))
        ref = table.reference(broker, spec)
        outcomes.append(compare(lake.table_path(spec.name), spec, ref.expected, ref.seen_keys))
    figures = ("lost", "duplicates", "resurrected", "mismatches")
    total = Comparison(**{n: sum(getattr(c, n) for c in outcomes) for n in figures})
    record("toasted_value_unchanged", total, faults=5)
    assert total.clean, [c.details for c in outcomes]
    names = {k: row["name"] for k, row in table.reference(broker, spec).expected.items()}
    assert names == {(1,): "long text 1", (2,): "long text 2, edited", (3,): "long text 3"}


def test_a_moved_rows_unchanged_toasted_value_comes_from_its_old_key(
    broker, scenario, spark, tmp_path
):
    """A primary-key update under the default replica identity (Debezium: delete of the old
    key, create of the new one with the TOASTed value left out) keeps the value, in any order."""
    spec, run, check = scenario("toast-move", toasted_columns=("name",))
    unchanged = "__debezium_unavailable_value"
    changes = [
        table.change("c", 1, 101, second=1, name="text one"),
        table.change("c", 5, 102, second=2, name="five"),
        table.change("u", 1, 201, hour=1, second=1, name=unchanged),
        *table.move(1, 2, 202, hour=1, second=2),
        table.change("u", 2, 301, hour=2, second=1, name=unchanged),
        *table.move(2, 3, 302, hour=2, second=2),  # a chain: 1 → 2 → 3
        *table.move(5, 6, 304, hour=2, second=3),
        *table.move(7, 8, 401, hour=3, second=1),  # the old key's value never reached Kafka
    ]
    table.send_all(broker, spec.topic, changes)
    table.close_hours(broker, spec.topic, 2, after_hour=3)

    ref = table.reference(broker, spec)
    names = {k: row["name"] for k, row in ref.expected.items()}
    assert names == {(3,): "text one", (6,): "five", (8,): None}
    outcomes = []
    for n, order in enumerate([(0, 1, 2, 3), (3, 2, 1, 0), (2, 0, 3, 1, 2)]):
        lake = LakeResource(root=str(tmp_path / f"order{n}"))
        for hour in order:
            assert _accounted(run(hour, lake=lake))
        path = lake.table_path(spec.name)
        outcomes.append(compare(path, spec, ref.expected, ref.seen_keys))
        flags = {
            r["id"]: r["_cdc_unknown__name"]
            for r in spark.read.format("delta").load(path).where("NOT _cdc_deleted").collect()
        }
        assert flags == {3: False, 6: False, 8: True}, order  # unknown, and it says so
    figures = ("lost", "duplicates", "resurrected", "mismatches")
    total = Comparison(**{n: sum(getattr(c, n) for c in outcomes) for n in figures})
    record("toasted_value_moved_key", total, faults=4)
    assert total.clean, [c.details for c in outcomes]


def test_a_crash_between_the_merge_and_the_moved_rows_commit_is_repaired_by_the_rerun(
    broker, scenario, spark, lake, monkeypatch
):
    """A run that moves rows writes two commits: its MERGE, then the moved rows' TOASTed values
    from their old keys, marked `moved_rows` and carrying the run's record. The process dying
    between them (here: the second step raising, which leaves the table exactly as a kill there
    would) leaves the moved row's value unknown; running the hour again fills it, applies no
    change twice, and its commits say which hour and slice they belong to."""
    spec, run, check = scenario("toast-move-crash", toasted_columns=("name",))
    changes = [
        table.change("c", 1, 101, second=1, name="text one"),
        *table.move(1, 2, 202, hour=1, second=2),
    ]
    table.send_all(broker, spec.topic, changes)
    table.close_hours(broker, spec.topic, 2, after_hour=1)
    assert _accounted(run(0))

    def killed(*args, **kwargs):
        raise RuntimeError("the process died after the MERGE's commit")

    with monkeypatch.context() as patched:
        patched.setattr(hour_run.toast, "resolve_moves", killed)
        with pytest.raises(RuntimeError, match="died after the MERGE"):
            run(1)
    path = lake.table_path(spec.name)
    moved = spark.read.format("delta").load(path).where("id = 2").collect()
    assert [(r["name"], r["_cdc_unknown__name"]) for r in moved] == [(None, True)]

    again = run(1)
    assert _accounted(again) and again.counts.applied == 0  # every change already applied
    outcome = check()
    assert outcome.clean, outcome.details
    history = spark.sql(f"DESCRIBE HISTORY delta.`{path}`").collect()
    moved_commit = json.loads(history[0]["userMetadata"])
    assert moved_commit["moved_rows"] is True and moved_commit["hour"] == table.hour_key(1)
    assert again.delta_version == history[0]["version"]
