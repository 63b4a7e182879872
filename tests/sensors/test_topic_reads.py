"""What a tick reads, and that every Kafka call of it is bounded by the tick's time: on an
in-memory log (tests/fakes.py). Against the real broker: tests/sensors/test_offset_progress.py."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import pytest
from kafka import TopicPartition
from kafka.errors import KafkaTimeoutError

from cdc_assets.slicing import SliceError
from sensors.hours import HOUR, to_ms
from sensors.topic_reads import KafkaDeadline, Watch, read_fleet_progress
from tests.fakes import FakeConsumer

H0 = datetime(2026, 11, 4, 8, tzinfo=UTC)


def _logs():
    at = [to_ms(H0 + timedelta(minutes=m)) for m in (10, 70, 130)]
    return {"orders": {0: at, 1: at[:1]}, "customers": {0: at[1:]}}


def test_every_topic_is_read_at_once_and_a_missing_one_gets_its_error():
    consumer = FakeConsumer(_logs())
    uncommitted = FakeConsumer(_logs(), high_watermarks={TopicPartition("orders", 1): 2})
    watches = [
        Watch("orders", "orders", None, H0),
        Watch("customers", "customers", H0 + HOUR, H0),
        Watch("gone", "gone", None, H0),
    ]
    found = read_fleet_progress(consumer, uncommitted, watches, now=H0 + HOUR * 2 + HOUR / 2)
    assert isinstance(found["gone"], SliceError)
    orders, customers = found["orders"], found["customers"]
    assert orders.first_data_hour == H0
    assert orders.boundaries == {
        H0: {0: 0, 1: 0},
        H0 + HOUR: {0: 1, 1: None},
        H0 + HOUR * 2: {0: 2, 1: None},
    }
    assert orders.stable_ends == {0: 3, 1: 1} and orders.in_transaction == {1}
    assert orders.newest_ms == {
        0: to_ms(H0 + timedelta(minutes=130)),
        1: to_ms(H0 + timedelta(minutes=10)),
    }
    # A table past its first tick starts at its cursor's hour.
    assert list(customers.boundaries) == [H0 + HOUR, H0 + HOUR * 2]
    assert customers.first_data_hour is None
    # One request per hour boundary for all topics, not one per table.
    boundary_lookups = [c for c in consumer.timeouts if c[0] == "offsets_for_times"]
    assert len(boundary_lookups) == 1 + 3  # the first tick's start, then H0, H0+1h, H0+2h


def test_each_call_is_given_the_time_the_tick_has_left():
    consumer, uncommitted = FakeConsumer(_logs()), FakeConsumer(_logs())
    deadline = KafkaDeadline(30)
    watches = [Watch("orders", "orders", None, H0)]
    read_fleet_progress(consumer, uncommitted, watches, now=H0 + HOUR * 3, deadline=deadline)
    calls = consumer.timeouts + uncommitted.timeouts
    assert {name for name, _ in calls} >= {"offsets_for_times", "end_offsets", "poll", "position"}
    assert all(ms is not None and 0 < ms <= 30_000 for _, ms in calls), calls


def test_a_deadline_that_is_used_up_times_out_as_kafka_python_does():
    deadline = KafkaDeadline(0.05)
    assert 0 < deadline.ms() <= 50 and not deadline.expired
    time.sleep(0.06)
    assert deadline.expired
    with pytest.raises(KafkaTimeoutError, match="0.05 s for Kafka are used up"):
        deadline.ms()
