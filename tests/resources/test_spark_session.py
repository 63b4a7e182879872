"""The started session (tests/conftest.py's, built by SparkResource): what a table-hour costs it.

A table-hour's plans make Spark generate about 110 classes. With Spark's default cache of 100
generated classes (`spark.sql.codegen.cache.maxEntries`), an LRU cache cycled through more
entries than it holds missed on every one, and each hour compiled them all again (Janino, then
the JIT). SparkResource's `codegen_cache_entries` keeps them: from the third hour on, only the
classes whose code inlines a value of that hour (a key bound, a timestamp) are compiled. A small
hour into a small mirror generates none at all: it runs interpreted (`interpreted_max_bytes`).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from resources import jvm_archive
from resources.spark import compiled_classes
from tests.faults import table

pytestmark = pytest.mark.integration

PARTITIONS = 2
# Classes a later hour may compile: those with the hour's own literals (about 20 in
# benchmarks/small_hours), far from the ~110 every hour compiled with Spark's default cache.
AT_MOST = 45


def _four_hours(broker, kafka, spark, lake, spec):
    """Four closed hours of 5 accounts each (created, then updated to `100 * hour + id`) sent to
    `spec`'s topic; returns `table.runner`'s run(hour, **options) for them."""
    changes = [
        table.change("c" if hour == 0 else "u", row_id, 100 * hour + row_id, hour=hour, second=1)
        for hour in range(4)
        for row_id in range(1, 6)
    ]
    table.send_all(broker, spec.topic, changes)
    table.close_hours(broker, spec.topic, PARTITIONS, after_hour=3)
    return table.runner(spark, kafka, lake, spec)


def test_a_later_table_hour_reuses_the_classes_spark_generated_for_the_earlier_ones(
    broker, kafka, spark, create_topic, lake
):
    # The suite's session is SparkResource's (tests/conftest.py), with the resource's cache.
    assert spark.conf.get("spark.sql.codegen.cache.maxEntries") == "1000"
    spec = table.spec(create_topic("session-codegen", partitions=PARTITIONS))
    run = _four_hours(broker, kafka, spark, lake, spec)

    compiled = []
    for hour in range(4):
        before = compiled_classes(spark)
        result = run(hour, interpreted_max_bytes=0)  # code generated for every hour
        compiled.append(compiled_classes(spark) - before)
        assert result.counts.applied == 5, (hour, result.counts)
    # The first hour creates the table and the second is the first MERGE into rows: both
    # compile most of what later hours reuse.
    assert max(compiled[2:]) <= AT_MOST, compiled


def test_a_small_hour_into_a_small_mirror_runs_interpreted_a_larger_one_compiled(
    broker, kafka, spark, create_topic, lake, monkeypatch
):
    from cdc_assets import hour_run

    spec = table.spec(create_topic("session-interpreted", partitions=PARTITIONS))
    run = _four_hours(broker, kafka, spark, lake, spec)
    interpreted, original = [], hour_run.sized_shuffles

    def sized(spark, records, **kwargs):
        interpreted.append(kwargs.get("interpreted", False))
        return original(spark, records, **kwargs)

    monkeypatch.setattr(hour_run, "sized_shuffles", sized)
    compiled, setting = [], "spark.sql.codegen.factoryMode"
    # The default: the mirror (a few KB) is far under 1 MiB, so no hour generates a class.
    for hour, max_bytes in ((0, None), (1, None), (2, 1), (3, None)):
        options = {} if max_bytes is None else {"interpreted_max_bytes": max_bytes}
        before = compiled_classes(spark)
        result = run(hour, **options)
        compiled.append(compiled_classes(spark) - before)
        assert result.counts.applied == 5, (hour, result.counts)
        assert spark.conf.get(setting, None) is None, "the hour left its setting on the session"
    # Hour 2's mirror is larger than its 1-byte limit: it generates code (what it compiles
    # depends on what the session's cache holds from earlier tests, so the decision is what is
    # asserted). The interpreted hours after it compile nothing.
    assert interpreted == [True, True, False, True]
    assert compiled[3] == 0, compiled
    stored = spark.read.format("delta").load(lake.table_path(spec.name)).collect()
    assert {r["id"]: r["balance"] for r in stored} == {n: 300 + n for n in range(1, 6)}


def test_the_driver_jvm_maps_the_class_archive_install_made(spark, spark_resource):
    # scripts/install.sh makes the archive of this java and class path before the tests run; a
    # driver that started without it (none made, or its options lost) loads every class itself.
    archive = jvm_archive.archive_path(
        spark_resource.spark_config(), Path(spark_resource.jvm_archive_dir)
    )
    assert archive is not None and archive.is_file(), (
        "no class archive: scripts/install.sh's output says why it made none"
    )
    pid = spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid()
    # The kernel names a mapped file by its real path (a .jars/ that is a link shows its target).
    assert str(archive.resolve()) in Path(f"/proc/{pid}/maps").read_text()


def test_a_small_query_takes_a_page_of_the_resources_size_and_old_queries_are_let_go(spark):
    # With Spark's own page size (32 MB at a 2g driver on 2 cores, sized from the heap), every
    # aggregation takes a whole page for its first row: the suite's table-hours kept 140-508 MB
    # of long arrays live. SparkResource's 2 MB (less an array header) is what Spark uses.
    memory = spark.sparkContext._jsc.sc().env().memoryManager()
    assert memory.pageSizeBytes() == 2 * 1024 * 1024 - 16
    # The status store keeps the resource's 100 queries and jobs, not Spark's 1,000 (each query
    # with its plan's text and graph). Events reach it through the listener bus, and it trims
    # in the background: the bus is drained first, so a lagging bus can't pass the test.
    context = spark.sparkContext
    for n in range(130):
        context.setJobGroup("retention-test", "a query of one job")
        spark.range(n + 1).collect()
    context.setLocalProperty("spark.jobGroup.id", None)
    context.setLocalProperty("spark.job.description", None)
    context._jsc.sc().listenerBus().waitUntilEmpty()
    store = spark._jsparkSession.sharedState().statusStore()
    tracker = context.statusTracker()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (
        store.executionsCount() > 100 or len(tracker.getJobIdsForGroup("retention-test")) > 100
    ):
        time.sleep(0.2)
    assert store.executionsCount() <= 100
    assert 0 < len(tracker.getJobIdsForGroup("retention-test")) <= 100
