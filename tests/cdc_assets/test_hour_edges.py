"""Open hours (I5), offsets lost to retention (I6) and bad records (I7), on the real broker."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import dagster as dg
import pytest
from kafka import KafkaAdminClient, TopicPartition

from cdc_assets.config import TableSpec
from cdc_assets.factory import build_table_asset
from cdc_assets.hour_run import run_hour
from cdc_assets.slicing import DataLossError, OpenHourError
from demo.reference import replay_with_errors
from tests.support import diff_rows, mirror_rows, read_topic

pytestmark = pytest.mark.integration

HOUR = datetime(2026, 11, 3, 9, tzinfo=UTC)
KEY = HOUR.strftime("%Y-%m-%d-%H:%M")


def _spec(topic: str, **overrides) -> TableSpec:
    return TableSpec(
        name="accounts",
        topic=topic,
        primary_key=("id",),
        columns={"id": "bigint", "name": "string", "balance": "decimal(10,2)"},
        start_hour="2026-11-01-00:00",
        **overrides,
    )


def _change(op: str, row_id: int, lsn: int, name: str = "n", balance="1.00") -> bytes:
    row = {"id": row_id, "name": name, "balance": balance}
    envelope = {
        "op": op,
        "before": row if op == "d" else None,
        "after": None if op == "d" else row,
        "source": {"lsn": lsn, "ts_ms": 0},
    }
    return json.dumps(envelope).encode()


def _ms(moment: datetime) -> int:
    return int(moment.timestamp() * 1000)


def test_an_open_hour_is_refused_until_forced(create_topic, send, kafka, spark, lake):
    topic = create_topic("open-hour", partitions=2)
    spec = _spec(topic)
    send(topic, b'{"id":1}', _change("c", 1, 10), _ms(HOUR) + 1_000, partition=0)
    send(topic, b'{"id":2}', _change("c", 2, 11), _ms(HOUR) + 2_000, partition=1)
    # Partition 1 has moved past the hour, partition 0 has not.
    send(topic, b'{"id":3}', _change("c", 3, 12), _ms(HOUR) + 3_601_000, partition=1)
    hour_end = HOUR + timedelta(hours=1)

    with pytest.raises(OpenHourError, match="ends at .* after now"):
        run_hour(
            spark=spark, kafka=kafka, lake=lake, spec=spec, hour_key=KEY,
            now=hour_end - timedelta(minutes=1),
        )
    with pytest.raises(OpenHourError) as refused:
        run_hour(
            spark=spark, kafka=kafka, lake=lake, spec=spec, hour_key=KEY,
            now=hour_end + timedelta(minutes=5),
        )
    message = str(refused.value)
    assert "'accounts'" in message and KEY in message and "partitions [0]" in message
    assert "force_open_hour: true" in message

    forced = run_hour(
        spark=spark, kafka=kafka, lake=lake, spec=spec, hour_key=KEY,
        now=hour_end + timedelta(minutes=5), force_open_hour=True,
    )
    assert forced.partial and forced.counts.applied == 2

    # A late record stamped inside the hour lands before partition 0 moves past it.
    send(topic, b'{"id":4}', _change("c", 4, 13), _ms(HOUR) + 5_000, partition=0)
    send(topic, b'{"id":5}', _change("c", 5, 14), _ms(HOUR) + 3_602_000, partition=0)
    completed = run_hour(
        spark=spark, kafka=kafka, lake=lake, spec=spec, hour_key=KEY,
        now=hour_end + timedelta(minutes=5),
    )
    assert not completed.partial and completed.slice.closed
    assert completed.counts.applied == 1 and completed.counts.stale == 2
    assert sorted(mirror_rows(spark, lake.table_path(spec.name), spec)) == [(1,), (2,), (4,)]


def test_the_current_hour_is_refused_in_dagster_and_forcing_marks_it_partial(
    create_topic, send, kafka, spark_resource, lake
):
    topic = create_topic("current-hour", partitions=1)
    spec = _spec(topic)
    now = datetime.now(UTC)
    send(topic, b'{"id":1}', _change("c", 1, 10), _ms(now))
    key = now.strftime("%Y-%m-%d-%H:00")
    asset = build_table_asset(spec=spec)
    resources = {"kafka": kafka, "spark": spark_resource, "lake": lake}

    refused = dg.materialize([asset], partition_key=key, resources=resources, raise_on_error=False)
    assert not refused.success
    error, messages = refused.get_step_failure_events()[0].step_failure_data.error, []
    while error is not None:
        messages.append(error.message)
        error = error.cause
    assert any(f"hour {key} is still open" in m for m in messages)

    forced = dg.materialize(
        [asset],
        partition_key=key,
        resources=resources,
        run_config={"ops": {"accounts": {"config": {"force_open_hour": True}}}},
    )
    materialization = forced.asset_materializations_for_node("accounts")[0]
    assert materialization.metadata["partial_hour"].value is True
    assert materialization.metadata["applied"].value == 1


def test_offsets_lost_to_retention_fail_the_hour_and_name_the_range(
    create_topic, send, broker, kafka, spark, lake, tmp_path
):
    from resources.lake import LakeResource

    topic = create_topic("retention", partitions=1)
    spec = _spec(topic)
    for n in range(10):
        send(topic, b"{}", _change("c", n, 100 + n), _ms(HOUR) + n)
    nxt = HOUR + timedelta(hours=1)
    for n in range(10, 20):
        send(topic, b"{}", _change("c", n, 100 + n), _ms(nxt) + n)
    send(topic, b"{}", _change("c", 99, 999), _ms(nxt + timedelta(hours=1)))
    next_key = nxt.strftime("%Y-%m-%d-%H:%M")

    run_hour(spark=spark, kafka=kafka, lake=lake, spec=spec, hour_key=KEY)
    admin = KafkaAdminClient(bootstrap_servers=broker)
    admin.delete_records({TopicPartition(topic, 0): 15})
    admin.close()

    # The previous hour recorded where this one starts: the exact range is named.
    with pytest.raises(DataLossError, match=r"partition 0: offsets \[10, 15\)") as lost:
        run_hour(spark=spark, kafka=kafka, lake=lake, spec=spec, hour_key=next_key)
    assert "'accounts'" in str(lost.value) and next_key in str(lost.value)
    assert "accept_data_loss" in str(lost.value)

    # Without that record, the loss below the log start is still reported.
    fresh = LakeResource(root=str(tmp_path / "fresh"))
    with pytest.raises(DataLossError, match=r"partition 0: offsets \[\?, 15\)"):
        run_hour(spark=spark, kafka=kafka, lake=fresh, spec=spec, hour_key=next_key)

    # A table that accepts the loss materializes what is left and says what was lost.
    accepting = _spec(topic, accept_data_loss=True)
    result = run_hour(spark=spark, kafka=kafka, lake=lake, spec=accepting, hour_key=next_key)
    assert [r.describe() for r in result.slice.lost] == ["partition 0: offsets [10, 15)"]
    assert result.counts.consumed == 5 and result.counts.applied == 5


def test_bad_records_go_to_the_error_table_and_the_counts_add_up(
    create_topic, send, broker, kafka, spark, lake
):
    topic = create_topic("bad-records", partitions=2)
    spec = _spec(topic)
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
        (b'{"id":3}', _change("t", 3, 22)),
        (b'{"id":3}', _change("c", 3, 23, balance="lots")),
        (b'{"id":3}', json.dumps({"op": "c", "after": {"name": "no key"},
                                  "source": {"lsn": 24}}).encode()),
        (b'{"id":3}', json.dumps({"op": "c", "after": {"id": 3}, "source": {}}).encode()),
        (b'{"id":3}', _change("c", 3, 25, balance="123456789.00")),  # overflows decimal(10,2)
    ]
    for n, (key, value) in enumerate(good + bad):
        send(topic, key, value, t + n, partition=n % 2)

    result = run_hour(spark=spark, kafka=kafka, lake=lake, spec=spec, hour_key=KEY)
    counts = result.counts
    assert counts.consumed == len(good) + len(bad)
    assert counts.errors == len(bad) and counts.tombstones == 1
    assert counts.balanced and counts.applied == 2 and counts.superseded == 2
    assert sum(result.error_reasons.values()) == len(bad)
    assert "value is not valid JSON" in result.error_reasons
    assert "unknown or unsupported op 't'" in result.error_reasons

    errors = spark.read.format("delta").load(lake.table_path(spec.error_table_name)).collect()
    records = read_topic(broker, topic)
    raw = {(p, o): v for p, o, v, _ in records}
    assert sorted(bytes(r.value) for r in errors) == sorted(v for _, v in bad)
    assert all(bytes(r.value) == raw[(r.partition, r.offset)] for r in errors)
    assert all(r.reason and r.hour == KEY for r in errors)

    expected, expected_errors = replay_with_errors(spec, [(p, o, v) for p, o, v, _ in records])
    assert len(expected_errors) == len(bad)
    assert diff_rows(mirror_rows(spark, lake.table_path(spec.name), spec), expected) == {
        "missing": [], "unexpected": [], "different": []
    }

    # Running the hour again adds no error twice.
    run_hour(spark=spark, kafka=kafka, lake=lake, spec=spec, hour_key=KEY)
    again = spark.read.format("delta").load(lake.table_path(spec.error_table_name)).count()
    assert again == len(bad)
