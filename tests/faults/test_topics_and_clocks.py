"""Operational faults in the topic itself: partitions added between hours, a producer clock
running ahead of the broker (then set back).

Each scenario runs the hours through the real pipeline on the real broker, compares the mirror
with the reference replay of what Kafka committed, and records its figures for the report.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from kafka import KafkaAdminClient
from kafka.admin import NewPartitions

from cdc_assets.config import CheckPolicy
from cdc_assets.hours import hour_start
from cdc_assets.slicing import OpenHourError
from checks.invariants import accounting_result, continuity_result
from tests.faults import table
from tests.faults.figures import compare, record
from tests.support import read_topic

pytestmark = pytest.mark.integration


def _checks_pass(result) -> None:
    for verdict in (
        accounting_result(result, CheckPolicy()),
        continuity_result(result, CheckPolicy()),
    ):
        assert verdict.passed, (verdict.check_name, verdict.metadata)


def test_partitions_added_between_two_hours_are_read_from_their_first_offset(
    broker, kafka, spark, create_topic, lake
):
    """The topic grows from 1 to 3 partitions after hour 0 ran. Hour 1 reads the new ones from
    offset 0, including a record stamped inside hour 0 that landed on a new partition after
    hour 0 ran (slices follow the log: it is hour 1's), and keys that moved to new partitions
    keep their order by the source's sequence, not by partition."""
    spec = table.spec(create_topic("faults-grown", partitions=1))

    run = table.runner(spark, kafka, lake, spec)

    table.send_all(
        broker,
        spec.topic,
        [table.change("c", n, 100 + n, second=n, partition=0) for n in range(1, 6)],
    )
    table.close_hours(broker, spec.topic, 1, after_hour=0)
    first = run(0)
    _checks_pass(first)

    admin = KafkaAdminClient(bootstrap_servers=broker)
    try:
        admin.create_partitions({spec.topic: NewPartitions(total_count=3)})
    finally:
        admin.close()
    grown = [
        # Late: stamped inside hour 0, written after hour 0 ran, on a partition hour 0 never saw.
        table.change("u", 1, 150, hour=0, second=3500, partition=2, name="late"),
        # Keys 2 and 3 move to the new partitions; 4 is deleted there; 6 is new.
        table.change("u", 2, 201, hour=1, second=1, partition=1),
        table.change("u", 3, 202, hour=1, second=2, partition=2),
        table.change("d", 4, 203, hour=1, second=3, partition=1),
        table.change("c", 6, 204, hour=1, second=4, partition=2),
        # An older change of key 2 still on partition 0: older by the sequence, not applied.
        table.change("u", 2, 199, hour=1, second=5, partition=0, name="older"),
    ]
    table.send_all(broker, spec.topic, grown)
    table.close_hours(broker, spec.topic, 3, after_hour=1)

    second = run(1)
    _checks_pass(second)
    starts = second.slice.start_offsets()
    assert starts[1] == 0 and starts[2] == 0, starts
    # Every record of the topic belongs to exactly one of the two hours, but hour 2's closers.
    assert second.counts.consumed == 1 + len(grown)  # hour 0's closer, then the grown topic
    assert first.slice.size + second.slice.size == len(read_topic(broker, spec.topic)) - 3

    ref = table.reference(broker, spec)
    comparison = compare(lake.table_path(spec.name), spec, ref.expected, ref.seen_keys)
    record("partitions_added_between_hours", comparison, faults=2)
    assert comparison.clean, comparison.details


def test_a_producer_clock_ahead_of_the_broker_then_set_back(
    broker, kafka, spark, create_topic, lake
):
    """The connector's clock runs 20 minutes ahead, then is set right (NTP), so its stamps run
    ahead of the wall clock and then go back in time inside the log.

    The topic stamps records with the producer's time (CreateTime, Debezium's default), so the
    broker's own clock plays no part in slicing; the wall clock decides when an hour may close.
    A clock ahead must not close an hour early (I5), and stamps that go back must not lose or
    double a record (I1): a record stamped inside an hour but written after a record stamped in
    the next one belongs to the next hour's slice."""
    spec = table.spec(create_topic("faults-skew", partitions=2))
    ahead = timedelta(minutes=20)
    base = hour_start(table.hour_key(0))

    def at(real_minute: float, skew: timedelta = ahead) -> tuple[int, int]:
        """(hour, second) of the stamp a record written at wall minute `real_minute` carries."""
        stamp = base + timedelta(minutes=real_minute) + skew
        offset = stamp - base
        return int(offset // timedelta(hours=1)), int(offset.total_seconds() % 3600)

    def written(op: str, row_id: int, lsn: int, real_minute: float, skew: timedelta = ahead):
        hour, second = at(real_minute, skew)
        return table.change(op, row_id, lsn, hour=hour, second=second, partition=row_id % 2)

    lsn = iter(range(1000, 2000))
    # Wall 0:30 to 1:30, stamped 0:50 to 1:50: the changes of wall hour 0 spill into hour 1.
    log = [written("c" if m < 40 else "u", m % 10, next(lsn), 30 + m) for m in range(60)]
    # Wall 1:30 to 1:45, stamped 1:50 to 2:05: both partitions move past hour 1 early.
    log += [written("u", m % 10, next(lsn), 90 + m) for m in range(15)]
    # The clock is set right at wall 1:45: stamps go back to 1:45..1:55, inside hour 1, after
    # records stamped in hour 2. They are hour 2's by the log.
    log += [written("u", m % 10, next(lsn), 105 + m, skew=timedelta(0)) for m in range(10)]
    log += [written("d", 3, next(lsn), 116, skew=timedelta(0))]
    table.send_all(broker, spec.topic, log)
    table.close_hours(broker, spec.topic, 2, after_hour=2)

    at_wall = table.runner(spark, kafka, lake, spec)

    def run(hour: int, wall_minute: float):
        return at_wall(hour, now=base + timedelta(minutes=wall_minute))

    # Wall 1:50: hour 1 has not ended by the wall clock, though every partition moved past it.
    with pytest.raises(OpenHourError, match="after now"):
        run(1, 110)
    results = [run(0, 61), run(1, 121), run(2, 181)]
    for result in results:
        _checks_pass(result)
    # Consecutive slices share their boundaries and cover the topic's records once.
    for earlier, later in zip(results, results[1:], strict=False):
        assert earlier.slice.end_offsets() == later.slice.start_offsets()
    assert sum(r.slice.size for r in results) == len(log)
    # Hour 2 holds, on each partition, everything after its first record stamped 2:00 or later:
    # 5 stamped ahead into hour 2, then the 11 set back into hour 1.
    assert results[2].counts.consumed == 5 + 11

    ref = table.reference(broker, spec)
    comparison = compare(lake.table_path(spec.name), spec, ref.expected, ref.seen_keys)
    record("producer_clock_ahead_then_back", comparison, faults=2)
    assert comparison.clean, comparison.details
