"""The history stage on real Spark and Delta, fed decoded changes directly: a late version
splits the interval it falls into, a replayed change is one version, a TOASTed value is filled
from the version before it (and again when that version arrives later), and the audit fails
when the history and the mirror disagree.

The whole pipeline's history, hours in any order against the plain-Python reference, is the
convergence property's (tests/faults/test_convergence.py); a crash between the mirror's commit
and the history's, and TOASTed values through the pipeline, are tests/faults/test_history.py's.
"""

from __future__ import annotations

import shutil
from datetime import UTC, datetime, timedelta

import pytest
from delta.tables import DeltaTable
from pyspark.sql import functions as F
from pyspark.sql import types as T

from cdc_assets.columns import (
    DELETED,
    HOUR,
    KAFKA_OFFSET,
    KAFKA_PARTITION,
    MOVED_FROM,
    OP,
    SEQUENCE,
    SOURCE_TS,
    has_value,
)
from cdc_assets.history import (
    CURRENT,
    END_SEQUENCE,
    VALID_FROM,
    VALID_TO,
    as_of,
    audit_history,
    write_history,
)
from cdc_assets.history_moves import follow_moves
from cdc_assets.history_refold import RefoldError, refold_history
from cdc_assets.history_tracking import check_tracking, fold_history
from cdc_assets.merge import MirrorSettingError
from cdc_assets.toast import unknown_flag
from tests.support import accounts_spec

pytestmark = pytest.mark.integration

T0 = datetime(2026, 11, 4, 8, tzinfo=UTC)
SEQUENCE_TYPE = T.StructType(
    [
        T.StructField("source_lsn", T.LongType()),
        T.StructField("kafka_partition", T.IntegerType()),
        T.StructField("kafka_offset", T.LongType()),
    ]
)


def _spec(**overrides):
    return accounts_spec("history-topic", balance="bigint", history=True, **overrides)


def _schema(toasted: bool) -> T.StructType:
    return T.StructType(
        [
            T.StructField("id", T.LongType()),
            T.StructField("name", T.StringType()),
            T.StructField("balance", T.LongType()),
            T.StructField(OP, T.StringType()),
            T.StructField(SEQUENCE, SEQUENCE_TYPE),
            T.StructField(SOURCE_TS, T.TimestampType()),
            T.StructField(KAFKA_PARTITION, T.IntegerType()),
            T.StructField(KAFKA_OFFSET, T.LongType()),
            T.StructField(HOUR, T.StringType()),
            T.StructField(DELETED, T.BooleanType()),
            *([T.StructField(has_value("name"), T.BooleanType())] if toasted else []),
            *(
                [T.StructField(MOVED_FROM, T.StructType([T.StructField("id", T.LongType())]))]
                if toasted
                else []
            ),
        ]
    )


def _change(op, row_id, lsn, *, offset=None, name=None, balance=None, carried=True, moved=None):
    """A decoded change (as the decoder's frame holds it) at `lsn` seconds after T0; `moved`:
    the old id of a create a primary-key update made (toasted frames only)."""
    offset = lsn if offset is None else offset
    return {
        "id": row_id,
        "name": name if name is not None or not carried else f"n{lsn}",
        "balance": balance if balance is not None else lsn,
        OP: op,
        SEQUENCE: (lsn, 0, offset),
        SOURCE_TS: (T0 + timedelta(seconds=lsn)).replace(tzinfo=None),
        KAFKA_PARTITION: 0,
        KAFKA_OFFSET: offset,
        HOUR: "2026-11-04-08:00",
        DELETED: op == "d",
        "_carried": carried,
        "_moved": None if moved is None else (moved,),
    }


def _frame(spark, changes, toasted=False):
    rows = []
    for c in changes:
        row = [c[f] for f in ("id", "name", "balance", OP, SEQUENCE, SOURCE_TS)]
        row += [c[KAFKA_PARTITION], c[KAFKA_OFFSET], c[HOUR], c[DELETED]]
        rows.append((*row, c["_carried"], c["_moved"]) if toasted else tuple(row))
    return spark.createDataFrame(rows, _schema(toasted))


def _write(spark, spec, path, changes, run, toasted=False):
    return write_history(
        spark,
        spec,
        path,
        _frame(spark, changes, toasted),
        versions=len({(c["id"], c[SEQUENCE][0]) for c in changes}),
        ingested_at=T0,
        # Each run its own slice: a run whose slice the history's log holds is a replay.
        run_metadata={"hour": "2026-11-04-08:00", "slice": {"run": run}},
    )


def _versions(spark, path):
    rows = spark.read.format("delta").load(path).orderBy("id", SEQUENCE).collect()
    return [
        (
            r["id"],
            r[SEQUENCE]["source_lsn"],
            None if r[END_SEQUENCE] is None else r[END_SEQUENCE]["source_lsn"],
            r[OP],
            r[CURRENT],
        )
        for r in rows
    ]


def test_a_late_version_splits_its_interval_and_a_replay_adds_nothing(spark, tmp_path):
    spec, path = _spec(), str(tmp_path / "accounts__history")
    later = [_change("u", 1, 30), _change("d", 1, 50), _change("c", 2, 40)]
    first = _write(spark, spec, path, later, run=1)
    assert (first.versions, first.opened, first.rewritten) == (3, 3, 0)

    earlier = [_change("c", 1, 10), _change("u", 1, 40, offset=7), _change("u", 1, 40, offset=9)]
    second = _write(spark, spec, path, earlier, run=2)
    # The u at 40 came twice (one version, the lower offset); it falls between 30 and 50, so
    # the version at 30 now ends at 40.
    assert (second.versions, second.opened, second.rewritten) == (2, 2, 1)
    assert _versions(spark, path) == [
        (1, 10, 30, "c", False),
        (1, 30, 40, "u", False),
        (1, 40, 50, "u", False),
        (1, 50, None, "d", True),
        (2, 40, None, "c", True),
    ]
    stored = spark.read.format("delta").load(path).where((F.col("id") == 1) & (F.col(OP) == "u"))
    assert sorted(r[KAFKA_OFFSET] for r in stored.collect()) == [7, 30]
    window = spark.read.format("delta").load(path).where("id = 1").orderBy(SEQUENCE).collect()
    assert [r[VALID_TO] for r in window[:-1]] == [r[VALID_FROM] for r in window[1:]]

    again = _write(spark, spec, path, earlier + later, run=3)
    assert (again.versions, again.opened, again.rewritten) == (5, 0, 0)
    assert again.version is None  # nothing changed: a metadata-only commit records the run
    assert again.recorded_version is not None and again.problems == []
    # The same slice again, as the history's log records it: a replay, nothing derived.
    replay = _write(spark, spec, path, earlier + later, run=3)
    assert replay.replayed and replay.version is None and replay.recorded_version is not None

    newer = _write(spark, spec, path, [_change("c", 2, 60)], run=4)
    assert (newer.opened, newer.rewritten) == (1, 1)  # the version at 40 ends at 60
    moment = F.lit((T0 + timedelta(seconds=45)).replace(tzinfo=None)).cast("timestamp")
    then = as_of(spark.read.format("delta").load(path), moment).collect()
    assert sorted((r["id"], r["balance"]) for r in then) == [(1, 40), (2, 40)]


def test_a_toasted_value_comes_from_the_version_before_it_whenever_that_arrives(spark, tmp_path):
    spec = _spec(toasted_columns=("name",))
    path = str(tmp_path / "accounts__history")
    unchanged = [_change("u", 1, 30, carried=False), _change("u", 1, 40, carried=False)]
    _write(spark, spec, path, unchanged, run=1, toasted=True)
    rows = spark.read.format("delta").load(path).orderBy(SEQUENCE).collect()
    assert [(r["name"], r["_cdc_unknown__name"]) for r in rows] == [(None, True), (None, True)]

    _write(spark, spec, path, [_change("c", 1, 10, name="first")], run=2, toasted=True)
    rows = spark.read.format("delta").load(path).orderBy(SEQUENCE).collect()
    assert [(r["name"], r["_cdc_unknown__name"]) for r in rows] == [("first", False)] * 3

    _write(spark, spec, path, [_change("u", 1, 35, name="second")], run=3, toasted=True)
    rows = spark.read.format("delta").load(path).orderBy(SEQUENCE).collect()
    assert [r["name"] for r in rows] == ["first", "first", "second", "second"]

    # A later version without the value: the run reads only the version in force before it (at
    # 40, filled from 35, which ended before the change) and takes the value it was filled with.
    _write(spark, spec, path, [_change("u", 1, 60, carried=False)], run=4, toasted=True)
    rows = spark.read.format("delta").load(path).orderBy(SEQUENCE).collect()
    assert [r["name"] for r in rows] == ["first", "first", "second", "second", "second"]
    assert not any(r["_cdc_unknown__name"] for r in rows)


def test_the_audit_fails_when_history_and_mirror_disagree(spark, tmp_path):
    spec, path = _spec(), str(tmp_path / "accounts__history")
    changes = [_change("c", 1, 10), _change("u", 1, 20), _change("c", 2, 30)]
    _write(spark, spec, path, changes, run=1)
    mirror = str(tmp_path / "accounts")
    newest = _frame(spark, [changes[1], changes[2]])  # the mirror: each key's newest change
    newest.select("id", "name", "balance", SEQUENCE, DELETED).write.format("delta").save(mirror)
    keys = _frame(spark, changes)
    columns = ["id", "name", "balance"]
    audit = audit_history(spark, spec, path, mirror, keys, columns)
    assert (audit.keys, audit.problems) == (2, [])

    # The mirror holds another balance for key 2: the check must say so.
    spark.sql(f"UPDATE delta.`{mirror}` SET balance = 31 WHERE id = 2")
    audit = audit_history(spark, spec, path, mirror, keys, columns)
    assert audit.mirror_mismatches == 1 and len(audit.problems) == 1

    # A version whose end was lost (two current versions of key 1): both failures named.
    spark.sql(f"UPDATE delta.`{path}` SET {CURRENT} = true, {END_SEQUENCE} = null WHERE id = 1")
    audit = audit_history(spark, spec, path, mirror, keys, columns)
    assert (audit.current_not_one, audit.broken_intervals) == (1, 1)


def test_a_toasted_value_stays_in_its_life_and_in_versions_from_before_toasting(spark, tmp_path):
    path = str(tmp_path / "accounts__history")
    # Stored while name was not toasted: the versions hold their own values, no flags.
    _write(spark, _spec(), path, [_change("c", 1, 10, name="a"), _change("u", 1, 20, name="b")], 1)
    toasted = _spec(toasted_columns=("name",))
    later = [
        _change("u", 1, 30, name="c"),
        _change("d", 1, 40, carried=False),
        _change("c", 1, 50, carried=False),  # a row moved to the key: no value of its own
    ]
    _write(spark, toasted, path, later, run=2, toasted=True)
    rows = spark.read.format("delta").load(path).orderBy(SEQUENCE).collect()
    assert [(r["name"], r["_cdc_unknown__name"]) for r in rows] == [
        ("a", None),  # ended before the run's changes: not read again, no flag (its own value)
        ("b", False),  # in force at the run's first change: re-derived
        ("c", False),
        ("c", False),  # the delete's before-image: the value it ended with
        (None, True),  # a new life: not the value of the key's life before
    ]


def test_a_row_a_hard_delete_order_put_back_is_reported_not_failed(spark, tmp_path):
    spec, path = _spec(delete_mode="hard"), str(tmp_path / "accounts__history")
    changes = [_change("c", 1, 10), _change("d", 1, 30), _change("u", 1, 20)]
    _write(spark, spec, path, changes, run=1)
    mirror = str(tmp_path / "accounts")
    # Hours out of order under delete_mode: hard: the update at 20 ran after the delete at 30.
    revived = _frame(spark, [changes[2]])
    revived.select("id", "name", "balance", SEQUENCE, DELETED).write.format("delta").save(mirror)
    audit = audit_history(spark, spec, path, mirror, _frame(spark, changes), ["id", "name"])
    assert (audit.revived_by_hard_delete_order, audit.problems) == (1, [])


def test_tracked_columns_fold_changes_and_late_ones_split_or_join_versions(spark, tmp_path):
    spec = _spec(history_except_columns=("balance",))
    path, changes_path = str(tmp_path / "accounts__history"), str(tmp_path / "changes")

    def run(changes, n):
        _write(spark, spec, changes_path, changes, run=n)
        return fold_history(
            spark,
            spec,
            path,
            changes_path,
            _frame(spark, changes),
            run_metadata={"hour": "2026-11-04-08:00", "slice": {"run": n}},
        )

    def versions():
        rows = spark.read.format("delta").load(path).orderBy(SEQUENCE).collect()
        return [
            (
                r[SEQUENCE]["source_lsn"],
                None if r[END_SEQUENCE] is None else r[END_SEQUENCE]["source_lsn"],
                r[OP],
                r["name"],
                r["balance"],
            )
            for r in rows
        ]

    # The balance alone changed at 30: the version opened at 10 holds it in place.
    first = run([_change("c", 1, 10, name="a"), _change("u", 1, 30, name="a")], 1)
    assert versions() == [(10, None, "c", "a", 30)]
    assert (first.inserted, first.updated, first.deleted) == (1, 0, 0)
    run([_change("u", 1, 50, name="b")], 2)
    assert versions() == [(10, 50, "c", "a", 30), (50, None, "u", "b", 50)]

    # A late rename at 20 splits the version: 30 differs from it, so opens one of its own.
    split = run([_change("u", 1, 20, name="x")], 3)
    assert versions() == [
        (10, 20, "c", "a", 10),
        (20, 30, "u", "x", 20),
        (30, 50, "u", "a", 30),
        (50, None, "u", "b", 50),
    ]
    assert (split.inserted, split.updated, split.deleted) == (2, 1, 0)

    # A late rename to b at 40: the change at 50 (name b too) joins its version.
    joined = run([_change("u", 1, 40, name="b")], 4)
    assert versions() == [
        (10, 20, "c", "a", 10),
        (20, 30, "u", "x", 20),
        (30, 40, "u", "a", 30),
        (40, None, "u", "b", 50),
    ]
    assert (joined.inserted, joined.deleted) == (1, 1)

    # Every change again: nothing to write, the run recorded in a metadata-only commit.
    replay = [_change("c", 1, 10, name="a"), _change("u", 1, 20, name="x")]
    replay += [_change("u", 1, n, name=name) for n, name in ((30, "a"), (40, "b"), (50, "b"))]
    again = run(replay, 5)
    assert (again.inserted, again.updated, again.deleted, again.version) == (0, 0, 0, None)

    # The audit judges the folded versions: the current one holds the newest values.
    mirror = str(tmp_path / "accounts")
    row = [(1, "b", 50, False, (50, 0, 50))]
    spark.createDataFrame(row, f"id bigint, name string, balance bigint, {DELETED} boolean, "
                          f"{SEQUENCE} struct<source_lsn:bigint,kafka_partition:int,"
                          "kafka_offset:bigint>").write.format("delta").save(mirror)  # fmt: skip
    audit = audit_history(
        spark, spec, path, mirror, _frame(spark, replay), ["id", "name", "balance"]
    )
    assert audit.problems == [] and audit.keys == 1

    # Another setting than the history was built with is refused before anything is read,
    # and so is a tracked history without its changes' table.
    built = r"built with history_except_columns: \[balance\]"
    changed_to = _spec(history_except_columns=("name",))
    for changed, fix in ((changed_to, "history_refold"), (_spec(), "rename")):
        with pytest.raises(MirrorSettingError, match=f"{built}.*{fix}"):
            check_tracking(spark, changed, path, changes_path)
    check_tracking(spark, spec, path, changes_path)
    shutil.move(changes_path, str(tmp_path / "elsewhere"))
    with pytest.raises(MirrorSettingError, match="changes' table .* is missing"):
        check_tracking(spark, spec, path, changes_path)


def test_refold_folds_the_history_again_under_a_new_setting(spark, tmp_path):
    """`cdc_assets.history_refold`: a per-change history becomes a tracked one (copied to the
    changes' table, then folded), a tracked one takes other tracked columns, and every case it
    can't do is refused naming what to do instead."""
    path, changes_path = str(tmp_path / "accounts__history"), str(tmp_path / "changes")
    changes = [
        _change("c", 1, 10, name="a", balance=1),
        _change("u", 1, 20, name="a", balance=2),
        _change("u", 1, 30, name="b", balance=2),
        _change("c", 2, 15, name="x", balance=5),
        _change("d", 2, 25, name="x", balance=5),
    ]
    marked = F.col("name").alias("name", metadata={"comment": "kept"})
    write_history(
        spark,
        _spec(),
        path,
        _frame(spark, changes).withColumn("name", marked),
        versions=len(changes),
        ingested_at=T0,
        run_metadata={"hour": "2026-11-04-08:00", "slice": {"run": 1}},
    )

    def versions():
        rows = spark.read.format("delta").load(path).orderBy("id", SEQUENCE).collect()
        return [
            (
                r["id"],
                r[SEQUENCE]["source_lsn"],
                None if r[END_SEQUENCE] is None else r[END_SEQUENCE]["source_lsn"],
                r[OP],
                r["name"],
                r["balance"],
            )
            for r in rows
        ]

    per_change = versions()
    assert len(per_change) == 5
    untracked_balance = _spec(history_except_columns=("balance",))
    with pytest.raises(MirrorSettingError, match="history_refold --table accounts"):
        check_tracking(spark, untracked_balance, path, changes_path)

    dry = refold_history(spark, untracked_balance, path, changes_path, dry_run=True)
    assert (dry.copied, dry.changes, dry.versions) == (True, 5, 0)
    assert not DeltaTable.isDeltaTable(spark, changes_path) and versions() == per_change

    # The balance alone changed at 20: that change folds into the version opened at 10.
    done = refold_history(spark, untracked_balance, path, changes_path)
    assert (done.copied, done.changes, done.versions) == (True, 5, 4)
    assert versions() == [
        (1, 10, 30, "c", "a", 2),
        (1, 30, None, "u", "b", 2),
        (2, 15, 25, "c", "x", 5),
        (2, 25, None, "d", "x", 5),
    ]
    check_tracking(spark, untracked_balance, path, changes_path)
    copied = spark.read.format("delta").load(changes_path)
    assert copied.count() == 5
    for table in (path, changes_path):
        assert spark.read.format("delta").load(table).schema["name"].metadata == {"comment": "kept"}

    # The runs after it go on with the new setting.
    later = [_change("u", 1, 40, name="b", balance=3)]
    _write(spark, untracked_balance, changes_path, later, run=2)
    fold_history(
        spark,
        untracked_balance,
        path,
        changes_path,
        _frame(spark, later),
        run_metadata={"hour": "2026-11-04-08:00", "slice": {"run": 2}},
    )
    assert versions()[1] == (1, 30, None, "u", "b", 3)

    # Tracking the balance instead: folded again from the changes' table, nothing copied.
    balance_only = _spec(history_columns=("balance",))
    with pytest.raises(MirrorSettingError, match="history_refold"):
        check_tracking(spark, balance_only, path, changes_path)
    again = refold_history(spark, balance_only, path, changes_path)
    assert (again.copied, again.changes, again.versions) == (False, 6, 5)
    assert versions() == [
        (1, 10, 20, "c", "a", 1),
        (1, 20, 40, "u", "b", 2),
        (1, 40, None, "u", "b", 3),
        (2, 15, 25, "c", "x", 5),
        (2, 25, None, "d", "x", 5),
    ]
    check_tracking(spark, balance_only, path, changes_path)

    # What it refuses: tracking taken away (the rename does it), a tracked history without
    # its changes' table, no history at all, and a stale changes' table beside a per-change one.
    with pytest.raises(RefoldError, match="rename"):
        refold_history(spark, _spec(), path, changes_path)
    shutil.move(changes_path, str(tmp_path / "aside"))
    with pytest.raises(RefoldError, match="missing"):
        refold_history(spark, balance_only, path, changes_path)
    with pytest.raises(RefoldError, match="no history"):
        refold_history(spark, balance_only, str(tmp_path / "none"), str(tmp_path / "none2"))
    plain = str(tmp_path / "plain")
    _write(spark, _spec(), plain, changes, run=3)
    stale = str(tmp_path / "stale")
    spark.read.format("delta").load(plain).limit(2).write.format("delta").save(stale)
    with pytest.raises(RefoldError, match="differ"):
        refold_history(spark, balance_only, plain, stale)
    # A copy a stopped refold made is taken as it is.
    whole = str(tmp_path / "whole")
    spark.read.format("delta").load(plain).write.format("delta").save(whole)
    resumed = refold_history(spark, balance_only, plain, whole)
    assert (resumed.copied, resumed.changes, resumed.versions) == (False, 5, 4)


def test_moved_rows_take_the_old_keys_value_along_chains_and_overlaps(spark, tmp_path, caplog):
    """`history_moves.follow_moves`: a chain of moves 1 -> 2 -> 3 fills every moved life from
    the key before it, a run that stopped between its passes is completed by the next, two
    moves into one key whose delete between them has not arrived fill a life each, and moves
    back and forth between two keys end their passes."""
    spec, path = _spec(toasted_columns=("name",)), str(tmp_path / "accounts__history")
    run = {"hour": "2026-11-04-08:00", "run": 1, "slice": {}}

    def hour(changes, n):
        _write(spark, spec, path, changes, run=n, toasted=True)
        return follow_moves(spark, spec, path, _frame(spark, changes, toasted=True), run)

    def names(*ids):
        rows = spark.read.format("delta").load(path).where(F.col("id").isin(*ids))
        rows = rows.orderBy(SEQUENCE).collect()
        return [
            (r["id"], r[SEQUENCE]["source_lsn"], r["name"], r[unknown_flag("name")]) for r in rows
        ]

    chain = [
        _change("c", 1, 10, name="v"),
        _change("d", 1, 20, carried=False),
        _change("c", 2, 21, carried=False, moved=1),
        _change("u", 2, 30, carried=False),
        _change("d", 2, 40, carried=False),
        _change("c", 3, 41, carried=False, moved=2),
    ]
    # Both moves are the hour's: the second is filled again once the first filled key 2.
    assert hour(chain, 1).filled == 4
    assert names(2, 3) == [(2, 21, "v", False), (2, 30, "v", False), (2, 40, "v", False),
                           (3, 41, "v", False)]  # fmt: skip
    # As if the run had died after its first pass: the next run touching key 1 still goes on.
    DeltaTable.forPath(spark, path).update(
        F.col("id") == 3, {"name": F.lit(None), unknown_flag("name"): F.lit(True)}
    )
    assert hour([_change("u", 1, 15, carried=False)], 2).filled == 1
    assert names(3) == [(3, 41, "v", False)]

    # Two moves into key 8, the delete between them not arrived yet: a life each.
    overlap = [
        _change("c", 7, 50, name="a"),
        _change("d", 7, 60, carried=False),
        _change("c", 8, 61, carried=False, moved=7),
        _change("u", 8, 65, carried=False),
        _change("c", 9, 5, name="b"),
        _change("d", 9, 79, carried=False),
        _change("c", 8, 80, carried=False, moved=9),
        _change("u", 8, 85, carried=False),
    ]
    assert hour(overlap, 3).filled == 4
    expected = [(8, 61, "a", False), (8, 65, "a", False), (8, 80, "b", False), (8, 85, "b", False)]
    assert names(8) == expected
    # The delete arrives: it takes its life's value, the life after it keeps the move's.
    moved = hour([_change("d", 8, 70, carried=False)], 4)
    assert moved.filled == 0
    assert names(8) == [*expected[:2], (8, 70, "a", False), *expected[2:]]

    # Key 20 moves to 21, and later back: each life takes the value, and the passes end.
    back_and_forth = [
        _change("c", 20, 200, name="p"),
        _change("d", 20, 210, carried=False),
        _change("c", 21, 211, carried=False, moved=20),
        _change("d", 21, 220, carried=False),
        _change("c", 20, 221, carried=False, moved=21),
        _change("u", 20, 230, carried=False),
    ]
    assert hour(back_and_forth, 5).filled == 4
    assert [(i, lsn, name) for i, lsn, name, _ in names(20, 21)] == [
        (20, 200, "p"), (20, 210, "p"), (21, 211, "p"), (21, 220, "p"), (20, 221, "p"),
        (20, 230, "p"),
    ]  # fmt: skip
    assert "chain longer" not in caplog.text
