"""The history (`history: true`) through the real pipeline, judged against the reference.

- A run that dies between the mirror's commit and the history's: the mirror holds the hour, the
  history does not; running the hour again completes the history and changes no mirror row.
  The death is an exception raised where the history's write begins: what it leaves on disk
  is a kill's there (the mirror's commit is in its log, the history's MERGE has not begun; a
  kill inside a MERGE leaves no commit, scenario 2 in test_crashes.py).
- TOASTed values and a chain of primary-key moves, hours in reverse: each version's value is
  the one the version before it carried, filled again when that version arrives later; a moved
  row's versions take the old key's value from just before the move, along the chain, once the
  hour that carried it runs (the newest hour ran first); the history check passes each hour.
  With tracked columns too: the fold takes the moved keys' filled changes.

Hours in any order with repeats, replays and refreshes: the convergence property
(test_convergence.py), whose first mirror keeps its history.
"""

from __future__ import annotations

import pytest

from cdc_assets import hour_run
from checks.invariants import accounting_result, history_result
from tests.faults import table
from tests.faults.figures import compare
from tests.support import read_records

pytestmark = pytest.mark.integration


def _checks(result, spec) -> dict[str, bool]:
    """The run's accounting and history checks, passed or not."""
    return {
        "accounting": accounting_result(result, spec.checks.accounting).passed,
        "history": history_result(result, spec.checks.history).passed,
    }


def test_a_run_dead_between_the_mirror_and_the_history_is_completed_by_its_rerun(
    broker, kafka, spark, create_topic, lake
):
    spec = table.spec(create_topic("faults-history-crash", partitions=2), history=True)
    changes = [
        table.change("c", 1, 1010, hour=0),
        table.change("c", 2, 1020, hour=0),
        table.change("u", 1, 1030, hour=1),
        table.change("d", 2, 1040, hour=1),
        table.change("c", 2, 1050, hour=1, second=5),
        table.change("u", 1, 1060, hour=1, second=9),
    ]
    table.send_all(broker, spec.topic, changes)
    table.close_hours(broker, spec.topic, 2, after_hour=1)
    run = table.runner(spark, kafka, lake, spec)
    history = lake.table_path(f"{spec.name}__history")
    records = read_records(broker, spec.topic, headers=True)
    hour0 = [r for r in records if table.hour_of(r[4]) == 0]

    assert _checks(run(0), spec) == {"accounting": True, "history": True}

    def dies(*args, **kwargs):
        raise RuntimeError("the run's process died here")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hour_run, "write_history", dies)
        with pytest.raises(RuntimeError, match="died here"):
            run(1)
    ref = table.reference(broker, spec, upto_hour=1)
    assert compare(lake.table_path(spec.name), spec, ref.expected, ref.seen_keys).clean
    assert table.history_differences(history, spec, hour0) == []  # hour 1 not in it

    rerun = run(1)
    assert rerun.counts.applied == 0 and rerun.merge_version is None  # the mirror had it all
    # Key 1's and key 2's versions from hour 0 end at hour 1's: rewritten.
    assert rerun.history.outcome.opened == 4 and rerun.history.outcome.rewritten == 2
    assert _checks(rerun, spec) == {"accounting": True, "history": True}
    assert table.history_differences(history, spec, records) == []

    again = run(1)  # once more: both logs hold the slice, a replay: nothing new, nothing doubled
    assert again.history.outcome.replayed and again.history.outcome.opened == 0
    assert table.history_differences(history, spec, records) == []


def test_a_run_dead_between_the_changes_and_the_fold_is_completed_by_its_rerun(
    broker, kafka, spark, create_topic, lake
):
    """Tracked columns (the balance left out): hour 1 dies after its changes' commit, before
    the fold's; hour 2 runs on it, then hour 1 again: the folded history equals the
    reference, whichever keys the hours share."""
    topic = create_topic("faults-history-fold-crash", partitions=1)
    spec = table.spec(topic, history=True, history_except_columns=("balance",))
    changes = [
        table.change("c", 1, 1010, hour=0, name="a"),
        table.change("c", 2, 1020, hour=0, name="a"),
        table.change("u", 1, 1030, hour=1, name="a"),  # the balance alone: folded
        table.change("u", 2, 1040, hour=1, name="b", second=1),
        table.change("u", 1, 1050, hour=2, name="c"),
    ]
    table.send_all(broker, spec.topic, changes)
    table.close_hours(broker, spec.topic, 1, after_hour=2)
    run = table.runner(spark, kafka, lake, spec)
    history = lake.table_path(f"{spec.name}__history")
    records = read_records(broker, spec.topic, headers=True)

    assert _checks(run(0), spec) == {"accounting": True, "history": True}

    def dies(*args, **kwargs):
        raise RuntimeError("the run's process died here")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hour_run, "fold_history", dies)
        with pytest.raises(RuntimeError, match="died here"):
            run(1)
    assert _checks(run(2), spec) == {"accounting": True, "history": True}
    rerun = run(1)
    assert _checks(rerun, spec) == {"accounting": True, "history": True}
    assert rerun.history.outcome.opened == 0  # the changes' table had them
    assert table.history_differences(history, spec, records, folded=True) == []
    versions = spark.read.format("delta").load(history).where("id = 1").count()
    assert versions == 2  # 1010 (its balance from 1030) and 1050


@pytest.mark.parametrize("tracked", [False, True], ids=["every-change", "balance-untracked"])
def test_toasted_values_fill_from_the_version_before_in_any_order(
    broker, kafka, spark, create_topic, lake, tracked
):
    spec = table.spec(
        create_topic(f"faults-history-toast-{tracked}".lower(), partitions=1),
        history=True,
        toasted_columns=("name",),
        **({"history_except_columns": ("balance",)} if tracked else {}),
    )
    unchanged = "__debezium_unavailable_value"
    changes = [
        table.change("c", 1, 1010, hour=0, name="first"),
        table.change("u", 1, 1020, hour=1, name=unchanged),
        table.change("u", 1, 1030, hour=1, name="second", second=1),
        table.change("u", 1, 1040, hour=2, name=unchanged),
        *table.move(1, 7, 1050, hour=2, second=2),
        table.change("u", 7, 1070, hour=2, name=unchanged, second=3),
        *table.move(7, 9, 1080, hour=2, second=4),
        table.change("u", 9, 1090, hour=2, name=unchanged, second=5),
    ]
    table.send_all(broker, spec.topic, changes)
    table.close_hours(broker, spec.topic, 1, after_hour=2)
    run = table.runner(spark, kafka, lake, spec)
    history = lake.table_path(f"{spec.name}__history")
    records = read_records(broker, spec.topic, headers=True)
    filled = {}
    judged = lake.table_path(f"{spec.name}__history")  # what readers query
    for hour in (2, 1, 0):
        result = run(hour)
        assert result.history.outcome.problems == [], hour
        # The daily check's judgement, after every hour: versions against the mirror, whole.
        assert table.history_audit(spark, spec, judged, lake).problems == [], hour
        filled[hour] = result.history.outcome.filled_from_moves
    # Hour 1 carried key 1's value: key 7's three versions, then key 9's two, took it.
    assert filled == {2: 0, 1: 5, 0: 0}
    if tracked:  # the fold took the moved keys' filled changes: a version per name
        assert table.history_differences(history, spec, records, folded=True) == []
        rows = spark.read.format("delta").load(history).orderBy("_cdc_sequence").collect()
        assert [(r["id"], r["name"], r["_cdc_unknown__name"]) for r in rows] == [
            (1, "first", False),
            (1, "second", False),
            (1, "second", False),
            (7, "second", False),
            (7, "second", False),
            (9, "second", False),
        ]
        history = lake.table_path(f"{spec.name}__history_changes")
    assert table.history_differences(history, spec, records) == []
    rows = spark.read.format("delta").load(history).orderBy("_cdc_sequence").collect()
    assert [(r["id"], r["name"], r["_cdc_unknown__name"]) for r in rows] == [
        (1, "first", False),
        (1, "first", False),
        (1, "second", False),
        (1, "second", False),
        (1, "second", False),  # the move's delete of key 1: its value before it
        (7, "second", False),  # the move's create: key 1's value from just before it
        (7, "second", False),
        (7, "second", False),  # the next move's delete of key 7
        (9, "second", False),  # along the chain
        (9, "second", False),
    ]
