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

import pytest

from cdc_assets.hour_run import run_hour
from resources.lake import LakeResource, LakeWriteError
from tests.faults import table
from tests.faults.figures import compare, record

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

    def run(hour: int):
        return run_hour(
            spark=spark, kafka=kafka, lake=lake, spec=spec, hour_key=table.hour_key(hour)
        )

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
    assert "disk is full ('No space left on device')" in message, message
    assert f"'{spec.name}'" in message and table.hour_key(1) in message, message[:2000]
    assert _versions(table_dir) == before, "a commit landed on a full disk"

    filler.unlink()
    rerun = run(1)
    assert rerun.merge_version is not None and rerun.counts.applied > 0
    ref = table.reference(broker, spec)
    comparison = compare(spark, str(table_dir), spec, ref.expected, ref.seen_keys)
    record("lake_disk_full_during_merge", comparison, faults=1)
    assert comparison.clean, comparison.details
