"""Faults in what Kafka delivers and in how hours are run, judged against the reference replay.

Scenarios 1, 3, 5 and 7 of the fault suite: a connector restart's duplicates, two runs of
one hour at once, deletes and re-inserts, and snapshot reads that arrive after newer changes
(scenario 4, hours in any order with repeats, is the property in test_convergence.py). Each
compares the mirror with `demo.reference` replayed over what Kafka committed and records its
figures for the report.
"""

from __future__ import annotations

import logging
import multiprocessing
import random
import threading

import pytest

from cdc_assets import commits, merge
from cdc_assets.hour_run import run_hour
from checks.table_checks import MIRROR_CHECKS
from resources.lake import LakeResource
from tests.faults import table
from tests.faults.figures import compare, record

pytestmark = pytest.mark.integration

PARTITIONS = 3


@pytest.fixture
def scenario(broker, kafka, spark, create_topic, lake):
    """Creates the topic; returns (spec, run(hour, lake=lake), check() -> Comparison)."""

    def make(name: str):
        spec = table.spec(create_topic(f"faults-{name}", partitions=PARTITIONS))

        def run(hour: int, on: LakeResource = lake):
            return run_hour(
                checks=MIRROR_CHECKS,
                spark=spark,
                kafka=kafka,
                lake=on,
                spec=spec,
                hour_key=table.hour_key(hour),
            )

        def check(on: LakeResource = lake, upto_hour: int | None = None):
            ref = table.reference(broker, spec, upto_hour=upto_hour)
            return compare(on.table_path(spec.name), spec, ref.expected, ref.seen_keys)

        return spec, run, check

    return make


def _history(seed: int, hours: int, keys: int, per_hour: int) -> list[table.Change]:
    """Inserts, updates and deletes (with their tombstones) of a few hot keys, LSN in order."""
    rng = random.Random(seed)
    live: set[int] = set()
    lsn, out = 100, []
    for hour in range(hours):
        for second in range(per_hour):
            row_id = rng.randrange(keys)
            lsn += 1
            if row_id not in live:
                out.append(table.change("c", row_id, lsn, hour=hour, second=second))
                live.add(row_id)
            elif rng.random() < 0.25:
                out.append(table.change("d", row_id, lsn, hour=hour, second=second))
                out.append(table.tombstone(row_id, hour=hour, second=second))
                live.discard(row_id)
            else:
                out.append(table.change("u", row_id, lsn, hour=hour, second=second))
    return out


def test_a_connector_restart_replays_the_last_events(broker, scenario):
    spec, run, check = scenario("replay")
    first = _history(1, hours=1, keys=20, per_hour=60)
    replayed = [
        table.Change(1, c.value, c.key, c.partition, 600 + n) for n, c in enumerate(first[-25:])
    ]
    fresh = [
        table.change("u", c, 500 + c, hour=1, second=900 + c) for c in range(5)
    ]  # after the restart
    table.send_all(broker, spec.topic, [*first, *replayed, *fresh])
    table.close_hours(broker, spec.topic, PARTITIONS, after_hour=1)

    run(0)
    second = run(1)
    comparison = check()
    record("connector_restart_duplicates", comparison, faults=len(replayed))
    assert comparison.clean, comparison.details
    # A duplicate carries its original LSN but a later offset: applied again with the same
    # values, or superseded within the hour; every record is accounted for (I2) either way.
    c = second.counts
    assert c.consumed == c.applied + c.superseded + c.stale + c.tombstones + c.errors


def test_deletes_reinserts_and_primary_key_updates(broker, scenario):
    spec, run, check = scenario("reinsert")
    changes = [
        # Within one hour: insert, delete, insert again.
        table.change("c", 1, 101, second=1),
        table.change("d", 1, 102, second=2),
        table.tombstone(1, second=2),
        table.change("c", 1, 103, second=3, name="back"),
        # Deleted in hour 0, inserted again in hour 1.
        table.change("c", 2, 104, second=4),
        table.change("d", 2, 105, second=5),
        table.tombstone(2, second=5),
        table.change("c", 2, 201, hour=1, second=1, name="again"),
        # A primary-key update: Debezium sends a delete of the old key and a create of the new.
        table.change("c", 3, 106, second=6),
        table.change("d", 3, 202, hour=1, second=2),
        table.tombstone(3, hour=1, second=2),
        table.change("c", 30, 203, hour=1, second=2, name="was 3"),
        # Deleted, and the delete's hour runs after the re-insert's hour.
        table.change("c", 4, 107, second=7),
        table.change("d", 4, 204, hour=1, second=3),
        table.change("c", 4, 301, hour=2, second=1, name="after"),
    ]
    table.send_all(broker, spec.topic, changes)
    table.close_hours(broker, spec.topic, PARTITIONS, after_hour=2)

    for hour in (2, 0, 1, 2):
        run(hour)
    comparison = check()
    record("delete_reinsert_and_key_update", comparison, faults=5)
    assert comparison.clean, comparison.details
    assert set(table.reference(broker, spec).expected) == {(1,), (2,), (4,), (30,)}


def test_snapshot_reads_after_newer_changes_do_not_win(broker, scenario):
    spec, run, check = scenario("snapshot")
    changes = [
        table.change("c", 1, 500, second=1, name="streamed"),
        table.change("u", 2, 501, second=2, name="updated"),
        table.change("c", 3, 502, second=3),
        table.change("d", 3, 503, second=4),
        # The snapshot's reads, taken at LSN 400, reach Kafka after the streamed changes.
        table.change("r", 1, 400, second=10, name="snapshot"),
        table.change("r", 2, 400, second=11, name="snapshot"),
        table.change("r", 3, 400, second=12, name="snapshot"),
        table.change("r", 4, 400, hour=1, second=1, name="snapshot"),
        table.change("r", 1, 400, hour=1, second=2, name="snapshot"),
    ]
    table.send_all(broker, spec.topic, changes)
    table.close_hours(broker, spec.topic, PARTITIONS, after_hour=1)

    run(1)
    run(0)
    comparison = check()
    record("late_snapshot_reads", comparison, faults=5)
    assert comparison.clean, comparison.details
    assert table.reference(broker, spec).expected[(1,)]["name"] == "streamed"


def _concurrent_run(bootstrap, spec_json, lake_root, hour_key, barrier, results):
    """A run in its own process and Spark session, held at the MERGE until both are there."""
    from cdc_assets.config import TableSpec
    from resources.kafka import KafkaResource
    from resources.spark import SparkResource

    conflicts = []

    class Count(logging.Handler):
        def emit(self, rec):
            if "commit conflict" in rec.getMessage():
                conflicts.append(rec.getMessage())

    # Conflicts are retried, and logged, by commits.retry_on_conflict.
    logging.getLogger(commits.__name__).addHandler(Count())
    original, held = merge._merge_once, threading.Event()

    def hold_then_merge(*args, **kwargs):
        if not held.is_set():
            held.set()
            barrier.wait(timeout=240)
        return original(*args, **kwargs)

    merge._merge_once = hold_then_merge
    spark = SparkResource(master="local[1]", shuffle_partitions=2, driver_memory="512m").session
    try:
        run_hour(
            checks=MIRROR_CHECKS,
            spark=spark,
            kafka=KafkaResource(bootstrap_servers=bootstrap),
            lake=LakeResource(root=lake_root),
            spec=TableSpec.model_validate_json(spec_json),
            hour_key=hour_key,
        )
        results.put(("ok", len(conflicts)))
    except Exception as exc:  # reported to the parent, which fails the test with it
        results.put(("failed", f"{type(exc).__name__}: {exc}"))
    finally:
        spark.stop()


def test_two_runs_of_one_hour_at_once_retry_the_conflict(broker, scenario, lake):
    spec, run, check = scenario("concurrent")
    table.send_all(broker, spec.topic, _history(3, hours=2, keys=25, per_hour=80))
    table.close_hours(broker, spec.topic, PARTITIONS, after_hour=1)
    run(0)  # the table exists; both runs of hour 1 read the same version and race to commit

    spawn = multiprocessing.get_context("spawn")
    barrier, results = spawn.Barrier(2), spawn.Queue()
    args = (broker, spec.model_dump_json(), lake.root, table.hour_key(1), barrier, results)
    children = [spawn.Process(target=_concurrent_run, args=args) for _ in range(2)]
    for child in children:
        child.start()
    outcomes = [results.get(timeout=300) for _ in children]
    for child in children:
        child.join(timeout=60)
    assert [kind for kind, _ in outcomes] == ["ok", "ok"], outcomes
    conflicts = sum(n for _, n in outcomes)
    comparison = check()
    record("two_runs_of_one_hour_at_once", comparison, faults=conflicts)
    assert conflicts >= 1, "both MERGEs committed without a conflict: the race was not run"
    assert comparison.clean, comparison.details
