"""The hour's Spark budget (DESIGN.md): a small table-hour runs its writes and nothing else.

Each table below gets four hours of small changes, read and decoded in the driver; the root
Spark SQL executions of each run are counted in Spark's status store (a MERGE's own nested
executions count with it, as one). A warm hour of a plain table is its MERGE alone; keeping a
history adds its MERGE, an hour with error rows the error table's write, and a declared
`unique` expectation its one read of the mirror. The first hour creates the mirror with one
metadata commit before its MERGE, nothing more. None of these hours writes a Delta checkpoint
(fewer than ten commits per table).
"""

from __future__ import annotations

import pytest

from cdc_assets.ledger import DeltaLog
from tests.faults import table

pytestmark = pytest.mark.integration

HOURS = 4
# What each kind of table may run per warm hour, in root SQL executions.
BUDGETS = {
    "plain": 1,
    "history": 2,  # + the history's MERGE
    "errors": 2,  # + the error table's write
    "unique": 2,  # + the expectation's read of the mirror
}


def _changes(kind: str) -> list[table.Change]:
    """Twenty changes an hour over ten keys (creates, updates and deletes), and for `errors`
    one record an hour the decoder rejects."""
    changes, lsn = [], 1000
    for hour in range(HOURS):
        for n in range(20):
            lsn += 10
            op = "c" if hour == 0 and n < 10 else ("d" if n % 7 == 6 else "u")
            changes.append(table.change(op, n % 10, lsn, hour=hour, second=n + 1))
        if kind == "errors":
            changes.append(table.raw(b"not json", hour=hour, key=table.key_bytes(99)))
    return changes


def _spec(topic: str, kind: str):
    extra = {
        "history": {"history": True},
        "unique": {"expectations": [{"column": "name", "expect": "unique", "severity": "WARN"}]},
        # The undecodable record is one of 21: a table that takes that share.
        "errors": {"checks": {"error_rate": {"max_share": 0.1}}},
    }.get(kind, {})
    return table.spec(topic, **extra)


def _roots(spark) -> dict[int, str]:
    """The root SQL executions Spark's status store holds: id → description."""
    spark.sparkContext._jsc.sc().listenerBus().waitUntilEmpty()
    listed = spark._jsparkSession.sharedState().statusStore().executionsList()
    executions = (listed.apply(n) for n in range(listed.size()))
    return {
        e.executionId(): e.description()
        for e in executions
        if e.executionId() == e.rootExecutionId()
    }


@pytest.mark.parametrize("kind", list(BUDGETS))
def test_a_warm_small_hour_runs_only_its_writes(broker, kafka, spark, create_topic, lake, kind):
    spec = _spec(create_topic(f"budget-{kind}", partitions=2), kind)
    table.send_all(broker, spec.topic, _changes(kind))
    table.close_hours(broker, spec.topic, 2, after_hour=HOURS - 1)
    run = table.runner(spark, kafka, lake, spec)
    counted = []
    for hour in range(HOURS):
        before = _roots(spark)
        result = run(hour)
        assert result.counts.applied, hour  # a real hour: changes applied
        counted.append({i: d for i, d in _roots(spark).items() if i not in before})
    first, *warm = counted
    # The first hour: the mirror created (its metadata commit), then the MERGE; the error
    # table and the history are created by their first writes the same way.
    extra = {"history": 2, "errors": 2}.get(kind, 1 if kind == "unique" else 0)
    assert len(first) == 2 + extra, first
    log = DeltaLog(lake.table_path(spec.name))
    operations = [c.operation for c in reversed(log.commits())]
    assert operations[:2] == ["CREATE TABLE", "MERGE"], operations
    for hour, executions in enumerate(warm, start=1):
        assert len(executions) <= BUDGETS[kind], (hour, executions)
