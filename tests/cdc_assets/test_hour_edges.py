"""Open hours (I5), offsets lost to retention (I6) and bad records (I7), on the real broker."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import dagster as dg
import polars as pl
import pyarrow as pa
import pytest
from deltalake import DeltaTable, QueryBuilder
from kafka import KafkaAdminClient, KafkaConsumer, TopicPartition
from pyarrow.dataset import ParquetReadOptions

from cdc_assets.commits import hour_history
from cdc_assets.config import TableSpec
from cdc_assets.factory import TableFailure, build_table_asset, tables_failure
from cdc_assets.hour_run import ADAPTIVE, SequenceConfigError, run_hour, sized_shuffles
from cdc_assets.partitions import REFRESH_TAG
from cdc_assets.slicing import DataLossError, OpenHourError
from checks.invariants import accounting_result, continuity_result
from checks.table_checks import MIRROR_CHECKS
from demo.reference import replay_with_errors
from resources.lake import LakeResource
from resources.spark import session_settings
from tests.support import accounts_spec, diff_rows, mirror_rows, read_topic

pytestmark = pytest.mark.integration

HOUR = datetime(2026, 11, 3, 9, tzinfo=UTC)
KEY = HOUR.strftime("%Y-%m-%d-%H:%M")


@pytest.fixture
def run(spark, kafka):
    """run(spec, lake, hour_key=KEY, **options): one hour through `run_hour`."""

    def _run(spec: TableSpec, lake, hour_key: str = KEY, **options):
        return run_hour(
            checks=MIRROR_CHECKS,
            spark=spark,
            kafka=kafka,
            lake=lake,
            spec=spec,
            hour_key=hour_key,
            **options,
        )

    return _run


def _change(
    op: str, row_id: int, lsn: int, name: str = "n", balance="1.00", ts_ms: int = 0
) -> bytes:
    row = {"id": row_id, "name": name, "balance": balance}
    envelope = {
        "op": op,
        "before": row if op == "d" else None,
        "after": None if op == "d" else row,
        "source": {"lsn": lsn, "ts_ms": ts_ms},
    }
    return json.dumps(envelope).encode()


def _ms(moment: datetime) -> int:
    return int(moment.timestamp() * 1000)


def test_an_open_hour_is_refused_until_forced(run, create_topic, send, kafka, spark, lake):
    topic = create_topic("open-hour", partitions=2)
    spec = accounts_spec(topic)
    send(topic, b'{"id":1}', _change("c", 1, 10), _ms(HOUR) + 1_000, partition=0)
    send(topic, b'{"id":2}', _change("c", 2, 11), _ms(HOUR) + 2_000, partition=1)
    # Partition 1 has moved past the hour, partition 0 has not.
    send(topic, b'{"id":3}', _change("c", 3, 12), _ms(HOUR) + 3_601_000, partition=1)
    hour_end = HOUR + timedelta(hours=1)

    with pytest.raises(OpenHourError, match="ends at .* after now"):
        run(spec, lake, now=hour_end - timedelta(minutes=1))
    with pytest.raises(OpenHourError) as refused:
        run(spec, lake, now=hour_end + timedelta(minutes=5))
    message = str(refused.value)
    assert "'accounts'" in message and KEY in message and "partitions [0]" in message
    assert "force_open_hour: true" in message

    forced = run(spec, lake, now=hour_end + timedelta(minutes=5), force_open_hour=True)
    assert forced.partial and forced.counts.applied == 2

    # A late record stamped inside the hour lands before partition 0 moves past it.
    send(topic, b'{"id":4}', _change("c", 4, 13), _ms(HOUR) + 5_000, partition=0)
    send(topic, b'{"id":5}', _change("c", 5, 14), _ms(HOUR) + 3_602_000, partition=0)
    completed = run(spec, lake, now=hour_end + timedelta(minutes=5))
    assert not completed.partial and completed.slice.closed
    # The closed hour is read whole, so its checks judge all of it: the late record applies,
    # the two the forced run applied are stale.
    assert completed.counts.consumed == 3 and completed.refreshed_to is None
    assert completed.counts.applied == 1 and completed.counts.stale == 2
    assert sorted(mirror_rows(lake.table_path(spec.name), spec)) == [(1,), (2,), (4,)]


def test_the_current_hour_is_refused_in_dagster_and_forcing_marks_it_partial(
    create_topic, send, kafka, spark_resource, lake
):
    topic = create_topic("current-hour", partitions=1)
    spec = accounts_spec(topic)
    now = datetime.now(UTC)
    send(topic, b'{"id":1}', _change("c", 1, 10), _ms(now))
    key = now.strftime("%Y-%m-%d-%H:00")
    asset = build_table_asset(checks=MIRROR_CHECKS, spec=spec)
    resources = {"kafka": kafka, "spark": spark_resource, "lake": lake}

    # Not closed yet is not a failure: nothing is materialized and no check result is written
    # (the run's planned checks show as skipped, not as failed executions, so the hour's last
    # real results stay visible); an observation on the hour says why and what to do.
    refused = dg.materialize([asset], partition_key=key, resources=resources, raise_on_error=False)
    assert refused.success
    assert refused.asset_materializations_for_node("accounts") == []
    assert refused.get_asset_check_evaluations() == []
    (observation,) = refused.asset_observations_for_node("accounts")
    assert observation.partition == key
    left_open = observation.metadata["left_open"].value
    assert f"hour {key} is still open" in left_open and "force_open_hour: true" in left_open

    forced = dg.materialize(
        [asset],
        partition_key=key,
        resources=resources,
        run_config={"ops": {"accounts": {"config": {"force_open_hour": True}}}},
        raise_on_error=False,
    )
    materialization = forced.asset_materializations_for_node("accounts")[0]
    assert materialization.metadata["partial_hour"].value is True
    assert materialization.metadata["applied"].value == 1
    # The partial hour is written but fails its blocking check: nothing downstream builds on it.
    complete = {c.check_name: c for c in forced.get_asset_check_evaluations()}["complete_hour"]
    assert not complete.passed and "still open" in complete.description
    assert not forced.success

    # The offset sensor's refresh of a tier-0 table: the run's tag forces the open hour, and
    # the refresh reads only what arrived since the forced run. The partial hour still fails
    # complete_hour, as a warning: the run succeeds, downstream automation waits.
    send(topic, b'{"id":2}', _change("c", 2, 11), _ms(now) + 1)
    tier0 = build_table_asset(
        checks=MIRROR_CHECKS, spec=spec.model_copy(update={"refresh_minutes": 15})
    )
    refreshed = dg.materialize(
        [tier0],
        partition_key=key,
        resources=resources,
        tags={REFRESH_TAG: "true"},
        raise_on_error=False,
    )
    metadata = refreshed.asset_materializations_for_node("accounts")[0].metadata
    assert metadata["partial_hour"].value is True and metadata["consumed"].value == 1
    assert metadata["hour_start_offsets"].value == {"0": 0}
    assert metadata["freshness_seconds"].value >= 0
    complete = {c.check_name: c for c in refreshed.get_asset_check_evaluations()}["complete_hour"]
    assert not complete.passed and complete.severity == dg.AssetCheckSeverity.WARN
    assert refreshed.success

    # The offset sensor's run of an hour it took for closed fails on it instead: that needs a
    # person (the sensor and the run disagree), and a red run says so.
    by_sensor = dg.materialize(
        [asset], partition_key=key, resources=resources, raise_on_error=False,
        tags={"cdc/trigger": "offset_sensor"},
    )  # fmt: skip
    assert not by_sensor.success and by_sensor.asset_materializations_for_node("accounts") == []

    # A range that ends in the open hour (the UI's "materialize all"): the closed hour before
    # it is materialized with its checks, the open one left as it was, and the run succeeds.
    before = (now - timedelta(hours=1)).strftime("%Y-%m-%d-%H:00")
    ranged = dg.materialize(
        [asset],
        resources=resources,
        tags={"dagster/asset_partition_range_start": before,
              "dagster/asset_partition_range_end": key},
        raise_on_error=False,
    )  # fmt: skip
    assert ranged.success
    assert [m.partition for m in ranged.asset_materializations_for_node("accounts")] == [before]
    assert {c.partition for c in ranged.get_asset_check_evaluations()} == {before}
    assert [o.partition for o in ranged.asset_observations_for_node("accounts")] == [key]


def test_offsets_lost_to_retention_fail_the_hour_and_name_the_range(
    run, create_topic, send, broker, kafka, spark, lake, tmp_path
):
    topic = create_topic("retention", partitions=1)
    spec = accounts_spec(topic)
    for n in range(10):
        send(topic, b"{}", _change("c", n, 100 + n), _ms(HOUR) + n)
    nxt = HOUR + timedelta(hours=1)
    for n in range(10, 20):
        send(topic, b"{}", _change("c", n, 100 + n), _ms(nxt) + n)
    send(topic, b"{}", _change("c", 99, 999), _ms(nxt + timedelta(hours=1)))
    next_key = nxt.strftime("%Y-%m-%d-%H:%M")

    run(spec, lake)
    admin = KafkaAdminClient(bootstrap_servers=broker)
    admin.delete_records({TopicPartition(topic, 0): 15})
    admin.close()

    # The previous hour recorded where this one starts: the exact range is named.
    with pytest.raises(DataLossError, match=r"partition 0: offsets \[10, 15\)") as lost:
        run(spec, lake, hour_key=next_key)
    assert "'accounts'" in str(lost.value) and next_key in str(lost.value)
    assert "accept_data_loss" in str(lost.value)

    # Without that record, the loss below the log start is still reported.
    fresh = LakeResource(root=str(tmp_path / "fresh"))
    with pytest.raises(DataLossError, match=r"partition 0: offsets \[\?, 15\)"):
        run(spec, fresh, hour_key=next_key)

    # A table that accepts the loss materializes what is left and says what was lost.
    accepting = accounts_spec(topic, accept_data_loss=True)
    result = run(accepting, lake, hour_key=next_key)
    assert [r.describe() for r in result.slice.lost] == ["partition 0: offsets [10, 15)"]
    assert result.counts.consumed == 5 and result.counts.applied == 5


def test_bad_records_go_to_the_error_table_and_the_counts_add_up(
    run, create_topic, send, broker, kafka, spark, lake
):
    topic = create_topic("bad-records", partitions=2)
    spec = accounts_spec(topic)
    t = _ms(HOUR)
    good = [
        (b'{"id":1}', _change("c", 1, 10, balance="5.00")),
        (b'{"id":1}', _change("u", 1, 11, name="newer", balance="6.50")),
        (b'{"id":2}', _change("c", 2, 12)),
        (b'{"id":2}', _change("d", 2, 13)),
        (b'{"id":2}', None),
    ]
    bad = [
        (b'{"id":3}', b"\xff\xfe not json"),
        (b'{"id":3}', json.dumps({"after": {"id": 3}, "source": {"lsn": 20}}).encode()),
        (b'{"id":3}', _change("x", 3, 21)),
        (b'{"id":3}', _change("c", 3, 23, balance="lots")),
        (
            b'{"id":3}',
            json.dumps({"op": "c", "after": {"name": "no key"}, "source": {"lsn": 24}}).encode(),
        ),
        (b'{"id":3}', json.dumps({"op": "c", "after": {"id": 3}, "source": {}}).encode()),
        (b'{"id":3}', _change("c", 3, 25, balance="123456789.00")),  # overflows decimal(10,2)
    ]
    for n, (key, value) in enumerate(good + bad):
        send(topic, key, value, t + n, partition=n % 2)

    result = run(spec, lake)
    counts = result.counts
    assert counts.consumed == len(good) + len(bad)
    assert counts.errors == len(bad) and counts.tombstones == 1
    assert (
        accounting_result(result, spec.checks.accounting).passed
        and counts.applied == 2
        and counts.superseded == 2
    )
    assert sum(result.error_reasons.values()) == len(bad)
    assert "value is not valid JSON" in result.error_reasons
    assert "unknown op" in result.error_reasons  # the raw op value is never quoted

    errors = spark.read.format("delta").load(lake.table_path(spec.error_table_name)).collect()
    records = read_topic(broker, topic)
    raw = {(p, o): v for p, o, v, _ in records}
    assert sorted(bytes(r.value) for r in errors) == sorted(v for _, v in bad)
    assert all(bytes(r.value) == raw[(r.partition, r.offset)] for r in errors)
    assert all(r.reason and r.hour == KEY for r in errors)

    expected, expected_errors = replay_with_errors(spec, [(p, o, v) for p, o, v, _ in records])
    assert len(expected_errors) == len(bad)
    assert diff_rows(mirror_rows(lake.table_path(spec.name), spec), expected) == {
        "missing": [],
        "unexpected": [],
        "different": [],
    }

    # Running the hour again adds no error twice.
    run(spec, lake)
    again = spark.read.format("delta").load(lake.table_path(spec.error_table_name)).count()
    assert again == len(bad)


def _envelope(op: str, lsn, before=None, after=None, ts_ms: int = 0) -> bytes:
    return json.dumps(
        {"op": op, "before": before, "after": after, "source": {"lsn": lsn, "ts_ms": ts_ms}}
    ).encode()


def test_deletes_need_only_their_key(run, create_topic, send, broker, kafka, spark, lake):
    """Key-only before-images (Postgres' default replica identity), a null before-image with
    the key in the Kafka key, and a before-image with a bad non-key value all delete the row.
    The mirror keeps a change data feed, so the hour's live rows are split by its commit's
    change rows: one live insert, three deletes (of keys the mirror did not hold yet)."""
    topic = create_topic("key-only-deletes", partitions=1)
    spec = accounts_spec(topic, change_data_feed=True)
    t = _ms(HOUR)
    for n in (1, 2, 3, 4):
        send(topic, b'{"id":%d}' % n, _change("c", n, n), t + n)
    send(
        topic,
        b'{"id":1}',
        _envelope("d", 11, before={"id": 1, "name": None, "balance": None}),
        t + 11,
    )
    send(topic, b'{"schema":{},"payload":{"id":2}}', _envelope("d", 12, before=None), t + 12)
    send(topic, b'{"id":3}', _envelope("d", 13, before={"id": 3, "balance": "lots"}), t + 13)
    send(topic, None, _envelope("d", 14, before={"name": "no key anywhere"}), t + 14)

    result = run(spec, lake)
    assert result.counts.errors == 1 and result.rows_counted_from == "change data feed"
    assert (result.rows_inserted, result.rows_updated, result.rows_deleted) == (1, 0, 3)
    assert list(result.error_reasons) == ["primary key column 'id' is missing or invalid"]
    records = [
        (p, o, v, k)
        for (p, o, v, _), k in zip(read_topic(broker, topic), _keys(broker, topic), strict=True)
    ]
    expected = replay_with_errors(spec, records)[0]
    assert sorted(expected) == [(4,)]
    assert mirror_rows(lake.table_path(spec.name), spec) == expected
    tombstones = spark.read.format("delta").load(lake.table_path(spec.name)).where("_cdc_deleted")
    assert sorted(r.id for r in tombstones.collect()) == [1, 2, 3]


def _keys(broker: str, topic: str) -> list[bytes | None]:
    consumer = KafkaConsumer(bootstrap_servers=broker, consumer_timeout_ms=3_000)
    tp = TopicPartition(topic, 0)
    consumer.assign([tp])
    consumer.seek_to_beginning(tp)
    keys = [m.key for m in consumer]
    consumer.close()
    return keys


def test_timestamps_in_each_unit_and_bad_source_times(
    run, create_topic, send, broker, kafka, spark, lake
):
    topic = create_topic("timestamp-units", partitions=1)
    spec = TableSpec(
        name="events",
        topic=topic,
        primary_key=("id",),
        columns={
            "id": "bigint",
            "at_us": "timestamp",  # MicroTimestamp, the connector's default
            "at_ms": {"type": "timestamp", "encoding": "Timestamp"},
            "at_ns": "timestamp(ns)",  # shorthand of encoding NanoTimestamp
            "at_iso": {"type": "timestamp", "encoding": "ZonedTimestamp"},
            "day": "date",
        },
        start_hour="2026-11-01-00:00",
    )
    row = {
        "id": 1,
        "at_us": 1_793_491_657_373_712,
        "at_ms": 1_793_491_657_373,
        "at_ns": 1_793_491_657_373_712_000,
        "at_iso": "2026-11-03T10:15:00.5+01:00",
        "day": 20_395,
    }
    t = _ms(HOUR)
    send(topic, b"{}", _envelope("c", 1, after=row, ts_ms=10**18), t)  # absurd source time
    send(topic, b"{}", _envelope("c", 2, after={**row, "id": 2, "at_ms": 10**18}), t + 1)
    # Columns a schema-less row lacks did not exist yet when it was written: null, no error.
    send(topic, b"{}", _envelope("c", 3, after={"id": 3, "at_us": None}), t + 2)
    # Nanoseconds a microsecond timestamp can't hold, and an ISO text in an epoch column.
    send(
        topic,
        b"{}",
        _envelope("c", 4, after={**row, "id": 4, "at_ns": 1_793_491_657_373_712_123}),
        t + 3,
    )
    send(
        topic,
        b"{}",
        _envelope("c", 5, after={**row, "id": 5, "at_us": "2026-11-03T09:15:00Z"}),
        t + 4,
    )

    result = run(spec, lake)
    assert result.counts.applied == 2 and result.counts.errors == 3
    assert set(result.error_reasons) == {
        "column 'at_ms' holds a timestamp outside years 1 to 9999",
        "column 'at_ns' holds a NanoTimestamp with sub-microsecond digits, which timestamp "
        "(microseconds) would cut; declare it string to keep them",
        "column 'at_us' holds an ISO-8601 timestamp (ZonedTimestamp?) where MicroTimestamp "
        "(int64) was expected; enable the connector's schemas "
        "(value.converter.schemas.enable=true) or declare the column's encoding to match the "
        "connector's settings (docs/debezium.md)",
    }
    expected, errors = replay_with_errors(
        spec, [(p, o, v) for p, o, v, _ in read_topic(broker, topic)]
    )
    assert len(errors) == 3
    actual = mirror_rows(lake.table_path(spec.name), spec)
    assert actual == expected
    first = actual[(1,)]
    assert first["at_ms"] == first["at_us"].replace(microsecond=373_000)
    assert first["at_ns"] == first["at_us"]
    assert first["at_iso"] == datetime(2026, 11, 3, 9, 15, 0, 500_000, tzinfo=UTC)


EDGE_TIMES = [
    datetime(1, 1, 1, tzinfo=UTC),
    datetime(1000, 1, 1, tzinfo=UTC),
    datetime(1583, 1, 1, tzinfo=UTC),
    datetime(1970, 1, 1, tzinfo=UTC),
    datetime(9999, 12, 31, 23, 59, 59, 999_999, tzinfo=UTC),
]


def test_timestamps_of_years_1_to_9999_read_back_right_in_deltalake_and_polars(
    run, create_topic, send, spark, lake, tmp_path
):
    """The mirror's Parquet files store microseconds, not Spark's INT96 (nanoseconds in 64
    bits), so readers other than Spark read every value Debezium can send as the source has it;
    a file written as INT96 (an older version of this project) reads right with pyarrow's
    coerce_int96_timestamp_unit, as docs/reading.md says."""
    topic = create_topic("timestamp-edges", partitions=1)
    spec = TableSpec(
        name="edges",
        topic=topic,
        primary_key=("id",),
        columns={"id": "bigint", "at": "timestamp", "day": "date"},
        start_hour="2026-11-01-00:00",
    )
    epoch = datetime(1970, 1, 1, tzinfo=UTC)
    for n, moment in enumerate(EDGE_TIMES, start=1):
        micros = (moment - epoch) // timedelta(microseconds=1)
        row = {"id": n, "at": micros, "day": (moment.date() - epoch.date()).days}
        send(topic, b'{"id":%d}' % n, _envelope("c", n, after=row), _ms(HOUR) + n)
    result = run(spec, lake)
    assert result.counts.applied == len(EDGE_TIMES) and result.counts.errors == 0
    path = lake.table_path(spec.name)
    expected = [(n, t, t.date()) for n, t in enumerate(EDGE_TIMES, start=1)]

    def as_utc(rows):
        return sorted((i, t.replace(tzinfo=UTC) if t.tzinfo is None else t, d) for i, t, d in rows)

    live = (
        QueryBuilder()
        .register("mirror", DeltaTable(path))
        .execute("SELECT id, at, day FROM mirror WHERE NOT _cdc_deleted")
    )
    assert as_utc(tuple(r.values()) for r in pa.table(live).to_pylist()) == expected
    frame = pl.read_delta(path).filter(~pl.col("_cdc_deleted")).select("id", "at", "day")
    assert as_utc(frame.rows()) == expected
    # Through Arrow: PySpark's collect() can't make a Python datetime of year 1 in UTC.
    spark_rows = spark.read.format("delta").load(path).select("id", "at", "day").toArrow()
    assert as_utc(tuple(r.values()) for r in spark_rows.to_pylist()) == expected

    # A file written as INT96, as Spark's default did before: pyarrow reads it with the option.
    old = str(tmp_path / "int96")
    with session_settings(spark, {"spark.sql.parquet.outputTimestampType": "INT96"}):
        spark.read.format("delta").load(path).select("id", "at").write.format("delta").save(old)
    dataset = DeltaTable(old).to_pyarrow_dataset(
        parquet_read_options=ParquetReadOptions(coerce_int96_timestamp_unit="us")
    )
    rows = sorted(tuple(r.values()) for r in dataset.to_table().to_pylist())
    assert [(i, t.replace(tzinfo=UTC)) for i, t in rows] == [(n, t) for n, t, _ in expected]


def test_hard_deletes_remove_rows(run, create_topic, send, broker, kafka, spark, lake):
    topic = create_topic("hard-deletes", partitions=2)
    spec = accounts_spec(topic, delete_mode="hard")
    t = _ms(HOUR)
    send(topic, b'{"id":1}', _change("c", 1, 1), t, partition=0)
    send(topic, b'{"id":2}', _change("c", 2, 2), t + 1, partition=1)
    send(topic, b'{"id":3}', _change("d", 3, 3), t + 2, partition=1)  # never existed
    run(spec, lake)
    nxt = HOUR + timedelta(hours=1)
    send(topic, b'{"id":1}', _change("d", 1, 4), _ms(nxt), partition=0)
    result = run(spec, lake, hour_key=nxt.strftime("%Y-%m-%d-%H:%M"))
    assert result.rows_deleted == 1 and result.counts.applied == 1
    table = spark.read.format("delta").load(lake.table_path(spec.name))
    assert [r.id for r in table.collect()] == [2]
    expected = replay_with_errors(spec, [(p, o, v) for p, o, v, _ in read_topic(broker, topic)])[0]
    assert sorted(expected) == [(2,)]


def test_a_late_record_after_an_idle_close_lands_in_the_next_hour(
    run, create_topic, send, kafka, spark, lake
):
    """I1 with the slice log: an idle partition closed by lateness ends at its end offset; a
    record stamped inside that hour arriving later is read by the next hour, not skipped."""
    topic = create_topic("idle-close", partitions=1)
    spec = accounts_spec(topic)
    t = _ms(HOUR)
    send(topic, b'{"id":1}', _change("c", 1, 1), t + 10)
    first = run(spec, lake, now=HOUR + timedelta(hours=1, minutes=20))
    assert first.slice.closed and first.slice.end_offsets() == {0: 1}
    send(topic, b'{"id":2}', _change("c", 2, 2), t + 20)  # late, stamped inside HOUR
    nxt = HOUR + timedelta(hours=1)
    send(topic, b'{"id":3}', _change("c", 3, 3), _ms(nxt) + 5)
    second = run(spec, lake, hour_key=nxt.strftime("%Y-%m-%d-%H:%M"))
    assert second.slice.start_offsets() == {0: 1}
    assert second.counts.applied == 2
    assert sorted(mirror_rows(lake.table_path(spec.name), spec)) == [(1,), (2,), (3,)]


def test_a_sequence_the_connector_does_not_send_fails_fast(
    run, create_topic, send, kafka, spark, lake
):
    topic = create_topic("mysql-style", partitions=1)
    spec = accounts_spec(topic)  # expects source.lsn; this "MySQL" connector sends file/pos
    mysql = json.dumps(
        {
            "op": "c",
            "after": {"id": 1, "name": "a", "balance": "1.00"},
            "source": {"file": "binlog.000003", "pos": 4711},
        }
    ).encode()
    send(topic, b'{"id":1}', mysql, _ms(HOUR))
    with pytest.raises(SequenceConfigError, match="'sequence' setting") as failure:
        run(spec, lake)
    assert "'accounts'" in str(failure.value) and "source.file" in str(failure.value)
    assert not Path(lake.table_path(spec.error_table_name)).exists()
    assert not Path(lake.table_path(spec.name)).exists()


def test_an_empty_hour_reads_nothing_records_its_slice_and_the_next_hour_continues(
    create_topic, send, kafka, spark, spark_resource, lake
):
    topic = create_topic("empty-hour", partitions=2)
    spec = accounts_spec(
        topic,
        expectations=({"column": "name", "expect": "not_null", "hard": True},),
        checks={"freshness": {"max_lag_minutes": 150}},
    )
    keys = [(HOUR + timedelta(hours=n)).strftime("%Y-%m-%d-%H:%M") for n in range(3)]
    at = [_ms(HOUR) + ms for ms in (1_000, 2_000, 7_201_000, 7_202_000)]
    send(topic, b'{"id":1}', _change("c", 1, 10, ts_ms=at[0]), at[0], partition=0)
    send(topic, b'{"id":2}', _change("c", 2, 11, ts_ms=at[1]), at[1], partition=1)
    # Nothing in the second hour (at its end the mirror's newest change is 2 hours old, within
    # the freshness limit); the third changes both rows.
    send(topic, b'{"id":1}', _change("u", 1, 20, name="m", ts_ms=at[2]), at[2], partition=0)
    send(topic, b'{"id":2}', _change("d", 2, 21, ts_ms=at[3]), at[3], partition=1)
    for partition in (0, 1):
        send(topic, b'{"id":9}', b"{}", _ms(HOUR) + 3 * 3_600_000 + 1_000, partition=partition)

    asset = build_table_asset(checks=MIRROR_CHECKS, spec=spec)
    resources = {"kafka": kafka, "spark": spark_resource, "lake": lake}
    instance = dg.DagsterInstance.ephemeral()

    def materialize(key: str) -> dg.ExecuteInProcessResult:
        return dg.materialize([asset], partition_key=key, resources=resources, instance=instance)

    first = materialize(keys[0])
    context = spark.sparkContext
    context.setJobGroup("empty-hour", "the empty hour's run")
    try:
        empty = materialize(keys[1])
    finally:
        context.setJobGroup("after", "")
    # The empty hour launched no Spark job: no read, decode, MERGE, scan or validation.
    assert list(context.statusTracker().getJobIdsForGroup("empty-hour")) == []
    last = materialize(keys[2])

    for result in (first, empty, last):
        assert result.success
        failed = [e.check_name for e in result.get_asset_check_evaluations() if not e.passed]
        assert failed == []
    (recorded,) = empty.asset_materializations_for_node("accounts")
    assert recorded.metadata["consumed"].value == 0
    # Its freshness is judged by the newest change the mirror holds, as recorded by the first
    # hour's commit: 09:00:02 seen from the empty hour's end, 11:00.
    (freshness,) = [e for e in empty.get_asset_check_evaluations() if e.check_name == "freshness"]
    assert freshness.metadata["lag_minutes"].value == round((2 * 3600 - 2) / 60, 2)
    path = lake.table_path(spec.name)
    assert mirror_rows(path, spec) == {(1,): {"id": 1, "name": "m", "balance": Decimal("1.00")}}
    # The third hour starts where the empty one ended (continuity), which is where the first
    # ended: the empty hour's slice is on record.
    history = hour_history(spark, path)[1]
    slices = {c["hour"]: c["slice"]["partitions"] for c in history}
    ended = {p: s["end"] for p, s in slices[keys[0]].items()}
    assert slices[keys[1]] == {p: {"start": end, "end": end} for p, end in ended.items()}
    assert {p: s["start"] for p, s in slices[keys[2]].items()} == ended


@pytest.mark.parametrize(
    ("records", "read_here", "partitions", "adaptive"),
    [
        (0, True, "1", "false"),
        (20_000, True, "1", "false"),
        (20_000, False, "1", "true"),  # read by Spark: its size is learned at run time
        (100_001, False, "2", "true"),
        (10**9, False, "4", "true"),
    ],
)
def test_an_hours_shuffle_width_and_adaptive_execution_follow_its_size_and_are_restored(
    spark, records, read_here, partitions, adaptive
):
    session = spark.newSession()  # a table's session in a run (cdc_assets.fleet)
    session.conf.set("spark.sql.shuffle.partitions", "4")
    before = session.conf.get(ADAPTIVE)
    with sized_shuffles(session, records, adaptive=not read_here):
        assert session.conf.get("spark.sql.shuffle.partitions") == partitions
        assert session.conf.get(ADAPTIVE) == adaptive
    assert session.conf.get("spark.sql.shuffle.partitions") == "4"
    assert session.conf.get(ADAPTIVE) == before == "true"


def test_an_hour_whose_every_change_is_stale_reports_the_version_it_committed(
    run, create_topic, send, spark, lake
):
    """A rerun finds every change already applied: no data commit, but the run's record is a
    metadata-only commit, and that commit's version is what the materialization reports."""
    topic = create_topic("stale-only", partitions=1)
    spec = accounts_spec(topic)
    send(topic, b'{"id":1}', _change("c", 1, 10), _ms(HOUR) + 1)
    send(topic, b'{"id":2}', _change("c", 2, 11), _ms(HOUR) + 2)
    first = run(spec, lake)
    again = run(spec, lake)
    assert again.counts.applied == 0 and again.counts.stale == 2 and again.merge_version is None
    path = lake.table_path(spec.name)
    (newest,) = spark.sql(f"DESCRIBE HISTORY delta.`{path}` LIMIT 1").collect()
    assert again.delta_version == newest["version"] > first.delta_version
    assert json.loads(newest["userMetadata"])["hour"] == KEY


def test_refreshes_read_only_what_is_new_and_the_final_run_completes_the_hour(
    run, create_topic, send, broker, kafka, spark, lake, monkeypatch
):
    """An open hour refreshed three times while changes keep arriving (forced, as the sensor's
    `refresh_minutes` does), one refresh crashing before its MERGE and one after its commit,
    then closed: after every run the mirror equals the replay of the records up to that run's
    end; each refresh reads from where the previous one ended and the refreshes' counts add
    up to the records they read; the run after the hour closed reads it whole (its checks
    judge the whole hour), applying only what the refreshes had not; and the hour's recorded
    slice still starts where the hour does."""
    from cdc_assets import hour_run

    topic = create_topic("refreshes", partitions=2)
    spec = accounts_spec(topic)
    path = lake.table_path(spec.name)
    lsn, sent = iter(range(100, 10_000)), []

    def wave(minute: int, ids: list[int], op: str = "u") -> None:
        for n, row_id in enumerate(ids):
            value = _change(op if row_id > 2 else "c", row_id, next(lsn), f"m{minute}", ts_ms=1)
            at = _ms(HOUR + timedelta(minutes=minute, seconds=n))
            sent.append(send(topic, json.dumps({"id": row_id}).encode(), value, at, row_id % 2))

    def agrees(result) -> None:
        ends = result.slice.end_offsets()
        records = [(p, o, v) for p, o, v, _ in read_topic(broker, topic) if o < ends.get(p, 0)]
        assert diff_rows(mirror_rows(path, spec), replay_with_errors(spec, records)[0]) == {
            "missing": [],
            "unexpected": [],
            "different": [],
        }
        assert accounting_result(result, spec.checks.accounting).passed
        assert continuity_result(result, spec.checks.continuity).passed

    runs = []

    def refresh(minute: int, **options) -> None:
        result = run(spec, lake, now=HOUR + timedelta(minutes=minute), **options)
        agrees(result)  # the mirror as of this run's end, before more changes arrive
        runs.append(result)

    wave(1, [1, 2, 3, 4])
    refresh(15, force_open_hour=True)
    wave(16, [3, 5, 6, 3])
    with monkeypatch.context() as crash:  # before its MERGE: nothing of it is recorded
        crash.setattr(hour_run, "merge_changes", _raise)
        with pytest.raises(RuntimeError, match="crash"):
            run(spec, lake, now=HOUR + timedelta(minutes=30), force_open_hour=True)
    refresh(30, force_open_hour=True)
    wave(31, [4, 7, 1])
    with monkeypatch.context() as crash:  # after its commit: the next run reads on from it
        crash.setattr(hour_run, "validate", _raise)
        with pytest.raises(RuntimeError, match="crash"):
            run(spec, lake, now=HOUR + timedelta(minutes=45), force_open_hour=True)
    wave(46, [8, 5, 2])
    refresh(50, force_open_hour=True)
    wave(55, [9, 6])
    # Both partitions move past the hour: it closes.
    for partition in (0, 1):
        at = _ms(HOUR + timedelta(hours=1, minutes=1))
        send(topic, b'{"id":99}', _change("c", 99, next(lsn)), at, partition)
    refresh(80)
    final = runs[-1]

    assert [r.partial for r in runs] == [True, True, True, False]
    for result in runs:
        assert result.hour_start_offsets() == {0: 0, 1: 0}
    # The refreshes read each record once, the crashed-after-commit one included (its commit
    # recorded its counts); the closed hour's run read all of them and applied the rest.
    _, history = hour_history(spark, path)
    recorded = [c for c in history if c["hour"] == KEY and not c.get("moved_rows")]
    refreshed = sum(c["consumed"] for c in recorded if c["partial"])
    assert final.counts.consumed == len(sent) and final.refreshed_to is None
    assert final.counts.applied + final.counts.stale + final.counts.superseded == len(sent)
    last_refresh = runs[2].slice.end_offsets()
    assert refreshed == sum(1 for p, o in sent if o < last_refresh[p])
    assert all(
        offsets["start"] == 0 for c in recorded for offsets in c["slice"]["partitions"].values()
    )
    # Oldest first: each refresh read on from where the one before it ended; the final run
    # from the hour's start.
    recorded.reverse()
    assert len(recorded) == 5 and "read_from" not in recorded[0]
    assert "read_from" not in recorded[-1] and not recorded[-1]["partial"]
    for earlier, later in zip(recorded, recorded[1:-1], strict=False):
        ends = {p: o["end"] for p, o in earlier["slice"]["partitions"].items()}
        assert later["read_from"] == ends
    assert not final.partial and final.slice.closed
    assert sorted(final.slice.end_offsets().items()) == sorted(
        {p: max(o for q, o in sent if q == p) + 1 for p in (0, 1)}.items()
    )


def _raise(*args, **kwargs):
    raise RuntimeError("crash")


def test_a_runs_failure_names_the_tables_it_left_open_apart():
    failure = tables_failure(
        [TableFailure("a", "2026-11-27-10:00", "boom", [], retriable=True)], total=3, left_open=1
    )
    head = failure.description.splitlines()[0]
    assert head == (
        "1 of 3 tables failed; 1 left an open hour as it was, the other 1 were materialized:"
    )
