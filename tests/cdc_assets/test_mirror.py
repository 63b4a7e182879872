"""The spine end to end: demo CDC topics on a real broker → hourly assets → Delta mirrors.

The reference run and the backfill write their lake to S3 (moto's server on loopback, which
checks every request's signature): the mirrors, error tables and checks work there unchanged.
The backfill runs on a Spark standalone cluster on loopback (devtools/spark_cluster.py), in a
process of its own (tests/cdc_assets/range_child.py), and must equal the hours run locally.
Every comparison is against `demo.reference.replay` of the records read back from Kafka (plain
Python, no code shared with the pipeline) and against the demo source database's own state.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import random
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import dagster as dg
import pytest

from cdc_assets.factory import build_mirror_assets
from cdc_assets.hour_run import run_hour
from cdc_assets.hours import hour_start
from cdc_assets.partitions import hourly_partitions
from cdc_assets.slicing import compute_slice
from checks.table_checks import MIRROR_CHECKS, run_check_specs
from demo.reference import replay, replay_with_errors
from devtools import spark_cluster as spark_cluster_tool
from resources.lake import LakeResource
from tests.support import (
    FIRST_HOUR,
    demo_specs,
    diff_rows,
    free_ports,
    full_table,
    hour_keys,
    mirror_rows,
    read_topic,
    seed_demo,
)

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]

HOURS = 4
CHANGES_PER_HOUR = 120


@pytest.fixture(scope="module")
def demo(broker):
    """The demo topics, seeded once for the module (each test writes its own lake)."""
    specs = demo_specs(f"mirror{uuid.uuid4().hex[:8]}")
    source, produced = seed_demo(broker, specs, hours=HOURS, changes_per_hour=CHANGES_PER_HOUR)
    return specs, source, produced, hour_keys(FIRST_HOUR, HOURS)


@pytest.fixture(scope="module")
def in_order(demo, kafka, spark_resource, spark, s3):
    """The demo hours materialized one run per hour, in order, into a lake on S3: the
    reference run."""
    specs, _, _, keys = demo
    prefix = f"in_order-{uuid.uuid4().hex[:8]}"
    s3.reader(prefix, spark)  # the test's own reads go to the same bucket
    lake = s3.lake(prefix)  # credentials as dg.EnvVar, resolved by Dagster in the run
    assert lake.table_path("x").startswith("s3a://")
    metadata = _materialize(specs, keys, kafka=kafka, spark_resource=spark_resource, lake=lake)
    return lake, metadata


def _materialize(specs, keys, *, kafka, spark_resource, lake):
    """Runs each hour of `keys` as one in-process Dagster run over all tables, in that order."""
    assets = build_mirror_assets(specs, checks=MIRROR_CHECKS)
    metadata = {}
    for key in keys:
        result = dg.materialize(
            assets,
            partition_key=key,
            resources={"kafka": kafka, "spark": spark_resource, "lake": lake},
        )
        assert result.success
        # Every check of every table ran on the hour and passed (the demo data is clean
        # apart from the malformed records the error tables catch).
        checks = result.get_asset_check_evaluations()
        assert sorted((c.asset_key.path[-1], c.check_name) for c in checks) == sorted(
            (spec.name, check.name)
            for spec in specs
            for check in run_check_specs(spec, partitions_def=hourly_partitions(spec))
        )
        failed = [
            (c.asset_key.path[-1], c.check_name, c.description) for c in checks if not c.passed
        ]
        assert failed == []
        for event in result.get_asset_materialization_events():
            materialization = event.event_specific_data.materialization
            metadata[(materialization.asset_key.path[-1], key)] = {
                name: value.value for name, value in materialization.metadata.items()
            }
    return metadata


def test_every_demo_table_matches_the_source(demo, in_order, broker, spark):
    specs, source, produced, keys = demo
    lake, metadata = in_order

    for spec in specs:
        records = read_topic(broker, spec.topic)
        expected, expected_errors = replay_with_errors(spec, [(p, o, v) for p, o, v, _ in records])
        assert expected == source.state(spec.name), "reference and source disagree"
        actual = mirror_rows(lake.table_path(spec.name), spec)
        assert diff_rows(actual, expected) == {"missing": [], "unexpected": [], "different": []}
        assert len(actual) > 0

        # Deletes happened and are kept as tombstone rows, not as live rows.
        tombstoned = spark.read.format("delta").load(lake.table_path(spec.name))
        assert tombstoned.where("_cdc_deleted").count() > 0

        # Malformed records: exactly the reference's rejects, each once, with raw bytes.
        errors = spark.read.format("delta").load(lake.table_path(spec.error_table_name))
        stored = {(r.partition, r.offset): r for r in errors.collect()}
        assert set(stored) == {(p, o) for p, o, _ in expected_errors}
        raw = {(p, o): v for p, o, v, _ in records}
        assert all(bytes(r.value) == raw[k] for k, r in stored.items())

        # I2 per hour, and the hours together consumed exactly the topic.
        per_hour = [metadata[(spec.name, key)] for key in keys]
        for m in per_hour:
            accounted = m["applied"] + m["superseded"] + m["stale"] + m["tombstones"] + m["errors"]
            assert m["consumed"] == accounted == m["slice_records"]
        assert sum(m["consumed"] for m in per_hour) == len(records)
        assert sum(m["errors"] for m in per_hour) == len(expected_errors)
        assert sum(m["tombstones"] for m in per_hour) == sum(v is None for _, _, v, _ in records)


def test_consecutive_slices_share_boundaries(demo, broker, kafka):
    specs, _, _, keys = demo
    consumer = kafka.consumer()
    misplaced = out_of_order = 0
    try:
        for spec in specs:
            slices = [
                compute_slice(
                    consumer,
                    table=spec.name,
                    topic=spec.topic,
                    hour_start=hour_start(key),
                    now=datetime.now(UTC),
                    allowed_lateness=timedelta(minutes=15),
                )
                for key in keys
            ]
            records = read_topic(broker, spec.topic)
            misplaced += _check_slices(slices, records)
            out_of_order += sum(
                b[0] == a[0] and b[3] < a[3] for a, b in zip(records, records[1:], strict=False)
            )
    finally:
        consumer.close()
    # Some records sit in the slice of an hour other than their timestamp's hour: slices follow
    # the log, and the out-of-order case was really exercised.
    assert misplaced > 0
    assert out_of_order > 0


def _check_slices(slices, records) -> int:
    """Asserts I1 for one topic's consecutive slices; returns how many records are misplaced."""
    by_partition = {}
    for p, o, _, ts in records:
        by_partition.setdefault(p, []).append((o, ts))
    assert len(by_partition) == 3
    for earlier, later in zip(slices, slices[1:], strict=False):
        assert earlier.end_offsets() == later.start_offsets()
    for partition, offsets in by_partition.items():
        sizes = [s.end_offsets()[partition] - s.start_offsets()[partition] for s in slices]
        assert sizes == [
            sum(s.start_offsets()[partition] <= o < s.end_offsets()[partition] for o, _ in offsets)
            for s in slices
        ]
        assert slices[0].start_offsets()[partition] == 0
        assert slices[-1].end_offsets()[partition] == len(offsets)
    misplaced = 0
    for s in slices:
        lo, hi = (int(t.timestamp() * 1000) for t in (s.hour_start, s.hour_end))
        for p, o, _, ts in records:
            if s.start_offsets()[p] <= o < s.end_offsets()[p] and not lo <= ts < hi:
                misplaced += 1
    return misplaced


def test_reruns_and_any_hour_order_converge(demo, in_order, kafka, spark, tmp_path):
    specs, source, _, keys = demo
    reference, _ = in_order
    shuffled = LakeResource(root=str(tmp_path / "shuffled"))
    # Later hours first, then two of them again: out of order, with repeats. The runs go
    # straight through `run_hour` (the asset's own code path, without its checks, which the
    # in-order run has judged): convergence is about the MERGE, not the checks. One table, the
    # one with a composite key (the fault suite shuffles hours of another table, 3 seeds).
    order = list(reversed(keys)) + random.Random(3).sample(keys, 2)
    specs = [s for s in specs if s.name == "order_items"]
    for key in order:
        for spec in specs:
            run_hour(
                checks=MIRROR_CHECKS,
                spark=spark,
                kafka=kafka,
                lake=shuffled,
                spec=spec,
                hour_key=key,
            )

    for spec in specs:
        expected = full_table(reference.table_path(spec.name))
        actual = full_table(shuffled.table_path(spec.name))
        assert actual == expected
        assert mirror_rows(shuffled.table_path(spec.name), spec) == source.state(spec.name)


# Per-run values: when the run finished, and where its lake is.
_PER_RUN = {"lag_seconds", "newest_source_ts", "delta_path", "freshness_seconds"}


@pytest.fixture(scope="module")
def spark_cluster(tmp_path_factory) -> Iterator[spark_cluster_tool.ClusterConfig]:
    """A Spark standalone cluster on loopback (a master and a worker with 2 cores and 1g for
    executors, from pyspark's own distribution), stopped with its executors afterwards."""
    master, webui, worker, worker_webui = free_ports(4)
    config = spark_cluster_tool.ClusterConfig(
        port=master,
        webui_port=webui,
        worker_port=worker,
        worker_webui_port=worker_webui,
        data_dir=tmp_path_factory.mktemp("spark-cluster"),
    )
    try:
        spark_cluster_tool.start(config)
        yield config
    finally:
        spark_cluster_tool.stop(config)


RANGE_CHILD_S = 900  # the child's whole run: its driver and executor JVMs boot cold


def _run_range_on_cluster(workdir: Path, job: dict) -> dict:
    """Runs tests/cdc_assets/range_child.py on `job`; returns what it reported."""
    workdir.mkdir()
    (workdir / "job.json").write_text(json.dumps(job))
    log = workdir / "child.log"
    with open(log, "wb") as output:
        # The parent's environment: the lake's credentials are in it (the s3 fixture's).
        child = subprocess.Popen(
            [sys.executable, "-m", "tests.cdc_assets.range_child", str(workdir)],
            cwd=REPO,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            child.wait(timeout=RANGE_CHILD_S)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)  # the child and its driver JVM
            child.wait()
    result = workdir / "result.pickle"
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-60:])
    assert result.exists(), f"the range child (exit {child.returncode}) reported nothing:\n{tail}"
    outcome = pickle.loads(result.read_bytes())
    assert outcome["success"], f"the range run failed: {outcome['failures']}\n{tail}"
    return outcome


def test_a_backfill_on_a_spark_cluster_equals_the_hours_run_one_by_one_locally(
    demo, in_order, broker, spark, s3, spark_cluster, tmp_path
):
    """One run over the whole range (as a backfill or the sensor launches it), on a Spark
    standalone cluster, writes the same tables, the same per-hour metadata and the same
    per-hour check results as the hours run one by one on the local master.

    One table (orders) is enough to prove the run went to the cluster and equals the local
    hours; the other tables' cluster runs would add minutes on the 2-core test machine and
    prove the same again."""
    specs, _, _, keys = demo
    specs = [spec for spec in specs if spec.name == "orders"]
    reference, hourly_metadata = in_order
    prefix = f"backfill-{uuid.uuid4().hex[:8]}"
    outcome = _run_range_on_cluster(
        tmp_path / "child",
        {
            "master": spark_cluster.master_url,
            "bootstrap": broker,
            "s3": dataclasses.asdict(s3),
            "prefix": prefix,
            "specs": [spec.model_dump_json() for spec in specs],
            "keys": keys,
        },
    )

    # The work ran on the cluster: the driver used its master, and the worker's executor (no
    # local mode's "driver" executor) ran the tasks, reading Kafka and writing S3.
    assert outcome["master"] == spark_cluster.master_url
    on_worker = [(i, host, tasks) for i, host, tasks in outcome["executors"] if i != "driver"]
    assert on_worker and all(host.startswith("127.0.0.1:") for _, host, _ in on_worker)
    assert sum(tasks for _, _, tasks in on_worker) > 0, outcome["executors"]
    worker = spark_cluster_tool.worker_state(spark_cluster)
    ran = worker["executors"] + worker["finishedexecutors"]
    assert outcome["app_id"] in {executor["appid"] for executor in ran}

    assert len(outcome["materializations"]) == len(specs) * len(keys)
    for table, hour, metadata in outcome["materializations"]:
        actual = {k: v for k, v in metadata.items() if k not in _PER_RUN}
        expected = {k: v for k, v in hourly_metadata[(table, hour)].items() if k not in _PER_RUN}
        assert actual == expected, (table, hour)

    checks = outcome["checks"]
    assert sorted((table, name, hour) for table, name, hour, *_ in checks) == sorted(
        (spec.name, check.name, key)
        for spec in specs
        for check in run_check_specs(spec, partitions_def=hourly_partitions(spec))
        for key in keys
    )
    assert [c for c in checks if not c[3]] == []
    # Each result points at its own hour's materialization, so Dagster counts it as current.
    assert {target for *_, target in checks} == {outcome["run_id"]}

    lake = s3.reader(prefix, spark)
    for spec in specs:
        assert full_table(lake.table_path(spec.name)) == full_table(reference.table_path(spec.name))


def test_rerunning_an_hour_leaves_rows_unchanged(demo, in_order, kafka, spark, spark_resource):
    specs, _, _, keys = demo
    lake, _ = in_order  # a rerun adds only a ledger commit, so the shared tables stay as they are
    before = {s.name: full_table(lake.table_path(s.name)) for s in specs}
    metadata = _materialize(specs, keys[1:2], kafka=kafka, spark_resource=spark_resource, lake=lake)
    for spec in specs:
        assert full_table(lake.table_path(spec.name)) == before[spec.name]
        m = metadata[(spec.name, keys[1])]
        assert m["applied"] == 0 and m["rows_inserted"] == m["rows_updated"] == 0
        assert m["stale"] > 0


def test_reference_would_catch_a_wrong_mirror(demo, broker, spark, kafka, lake):
    """The comparison used above fails when the mirror misses the last hour's changes."""
    specs, _, _, keys = demo
    spec = next(s for s in specs if s.name == "customers")
    for key in keys[:-1]:
        run_hour(checks=MIRROR_CHECKS, spark=spark, kafka=kafka, lake=lake, spec=spec, hour_key=key)
    expected = replay(spec, [(p, o, v) for p, o, v, _ in read_topic(broker, spec.topic)])
    diff = diff_rows(mirror_rows(lake.table_path(spec.name), spec), expected)
    assert any(diff.values())
