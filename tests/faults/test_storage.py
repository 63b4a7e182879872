"""Operational faults in the lake's storage: the disk filling up during a MERGE, S3 answering
503 SlowDown.

Each scenario runs hours through the real pipeline (real broker, Spark, Delta), checks the table
stays at its version while the fault lasts, reruns the hour once it is gone, and compares the
mirror with the reference replay of what Kafka committed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
from dagster_aws.s3 import S3Resource

from resources.lake import LakeResource, LakeWriteError
from tests.conftest import S3_KEY_ENV, S3_SECRET_ENV
from tests.faults import table
from tests.faults.figures import compare, record
from tests.faults.throttle import ThrottlingProxy

pytestmark = pytest.mark.integration

DISK_MB = 48


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A filesystem of its own, DISK_MB in size (tmpfs: the tests run as root, as
    scripts/install.sh does), so filling it up touches nothing else."""
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={DISK_MB}m", "tmpfs", str(mount)], check=True
    )
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _fill(disk: Path, leave_bytes: int) -> Path:
    """Fills `disk` up to `leave_bytes` of free space with one file; returns it."""
    filler = disk / "filler"
    free = shutil.disk_usage(disk).free
    with filler.open("wb") as out:
        out.truncate(0)
        chunk = b"\0" * (1 << 20)
        remaining = free - leave_bytes
        while remaining > 0:
            out.write(chunk[: min(len(chunk), remaining)])
            remaining -= len(chunk)
    return filler


def _versions(table_dir: Path) -> list[int]:
    return sorted(int(p.stem) for p in (table_dir / "_delta_log").glob("*.json"))


def test_the_lake_disk_full_during_a_merge(broker, kafka, spark, create_topic, small_disk):
    """The lake's disk fills up while an hour's MERGE writes its files: the run fails naming
    the full disk, the table stays at its version, and once space is freed the rerun completes
    the hour."""
    spec = table.spec(create_topic("faults-disk", partitions=2))
    lake = LakeResource(root=str(small_disk / "lake"))

    run = table.runner(spark, kafka, lake, spec)

    # Values that don't compress, so the hour's files need far more than the space left.
    noise = lambda n: os.urandom(600).hex()  # noqa: E731
    changes = [table.change("c", n, 100 + n, second=n % 3600) for n in range(200)]
    changes += [
        table.change("c", 1_000 + n, 10_000 + n, hour=1, second=n % 3600, name=noise(n))
        for n in range(1_500)
    ]
    table.send_all(broker, spec.topic, changes)
    table.close_hours(broker, spec.topic, 2, after_hour=1)
    run(0)
    table_dir = Path(lake.table_path(spec.name))
    before = _versions(table_dir)

    filler = _fill(small_disk, leave_bytes=256 * 1024)
    with pytest.raises(LakeWriteError) as failed:
        run(1)
    message = str(failed.value)
    assert "disk the run writes to is full" in message, message
    assert "('No space left on device')" in message, message
    assert f"'{spec.name}'" in message and table.hour_key(1) in message, message[:2000]
    assert _versions(table_dir) == before, "a commit landed on a full disk"

    filler.unlink()
    rerun = run(1)
    assert rerun.merge_version is not None and rerun.counts.applied > 0
    ref = table.reference(broker, spec)
    comparison = compare(str(table_dir), spec, ref.expected, ref.seen_keys)
    record("lake_disk_full_during_merge", comparison, faults=1)
    assert comparison.clean, comparison.details


def test_s3_answering_503_slowdown(broker, kafka, spark, create_topic, s3):
    """S3 throttles the lake: first one request in seven answers 503 SlowDown (retried by S3A
    and boto3, the hours complete), then every write does (the run fails naming S3 throttling,
    the table stays at its version), then S3 recovers and the rerun completes the hour."""
    bucket = "throttled"
    upstream = boto3.client(
        "s3",
        endpoint_url=s3.endpoint,
        region_name=s3.region,
        aws_access_key_id=os.environ[S3_KEY_ENV],
        aws_secret_access_key=os.environ[S3_SECRET_ENV],
    )
    upstream.create_bucket(Bucket=bucket)
    # Fewer, quicker retries than S3A's defaults (20 throttle retries, SDK attempts on top),
    # for this bucket only, so the lasting throttle fails within the test's time.
    hadoop = spark.sparkContext._jsc.hadoopConfiguration()
    for key, value in {
        "retry.throttle.limit": "4",
        "retry.throttle.interval": "50ms",
        "attempts.maximum": "2",
    }.items():
        hadoop.set(f"fs.s3a.bucket.{bucket}.{key}", value)

    spec = table.spec(create_topic("faults-s3-503", partitions=2))
    changes = [table.change("c", n, 100 + n, second=n) for n in range(50)]
    changes += [table.change("u", n, 1_000 + n, hour=1, second=n) for n in range(0, 50, 2)]
    changes += [table.change("u", n, 2_000 + n, hour=2, second=n) for n in range(1, 50, 2)]
    changes += [table.change("d", 7, 3_000, hour=2, second=99)]
    table.send_all(broker, spec.topic, changes)
    table.close_hours(broker, spec.topic, 2, after_hour=2)

    every_seventh = lambda method, n: n % 7 == 0  # noqa: E731
    with ThrottlingProxy(s3.endpoint, every_seventh) as proxy:
        lake = LakeResource(
            root=f"s3://{bucket}/mirrors",
            s3=S3Resource(
                endpoint_url=proxy.endpoint,
                region_name=s3.region,
                aws_access_key_id=os.environ[S3_KEY_ENV],
                aws_secret_access_key=os.environ[S3_SECRET_ENV],
            ),
        )

        run = table.runner(spark, kafka, lake, spec)

        run(0)
        run(1)
        transient = proxy.slowdowns
        assert transient > 0

        def commits() -> list[str]:
            listed = upstream.list_objects_v2(Bucket=bucket, Prefix="mirrors/accounts/_delta_log/")
            return sorted(
                o["Key"] for o in listed.get("Contents", []) if o["Key"].endswith(".json")
            )

        before = commits()
        proxy.throttled = lambda method, n: method in ("PUT", "POST")
        with pytest.raises(LakeWriteError) as failed:
            run(2)
        message = str(failed.value)
        assert "503 SlowDown" in message and f"'{spec.name}'" in message, message
        assert commits() == before, "a commit landed while S3 refused every write"
        lasting = proxy.slowdowns - transient

        proxy.throttled = lambda method, n: False
        rerun = run(2)
        assert rerun.merge_version is not None and rerun.counts.applied > 0
        ref = table.reference(broker, spec)
        comparison = compare(lake.table_path(spec.name), spec, ref.expected, ref.seen_keys)
    record("s3_503_slowdown", comparison, faults=transient + lasting)
    assert comparison.clean, comparison.details
