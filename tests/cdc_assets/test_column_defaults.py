"""A column with a default that a mirror gains while it holds rows (`merge.fill_defaults`):
the rows from before it hold the default, and a crash between adding the column and filling
it is filled by the next run, with the default the column's mark names. Real Spark and Delta."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta

from delta.tables import DeltaTable
from pyspark.sql.types import LongType, StructField, StructType

from cdc_assets.config import TableSpec
from cdc_assets.decoding.shape import SourceShape, lacked_columns
from cdc_assets.hour_run import (
    COLUMN_DEFAULTS,
    LACKED_COLUMNS,
    SOURCE_COLUMNS,
    HourContext,
    HourPlan,
    _record,
    column_defaults,
    fillable_defaults,
)
from cdc_assets.merge import FILLING_DEFAULT, fill_defaults
from cdc_assets.slicing import HourSlice

SPEC = TableSpec.model_validate(
    {
        "name": "accounts",
        "topic": "t",
        "primary_key": ["id"],
        "columns": {"id": "bigint", "grade": {"type": "string", "default": "B"}},
        "start_hour": "2026-11-01-00:00",
    }
)


def _comments(spark, path: str) -> dict[str, str | None]:
    schema = DeltaTable.forPath(spark, path).toDF().schema
    return {f.name: f.metadata.get("comment") for f in schema}


def _stored(spark, path: str) -> StructType:
    return DeltaTable.forPath(spark, path).toDF().schema


def _grades(spark, path: str) -> list:
    return [r["grade"] for r in spark.read.format("delta").load(path).orderBy("id").collect()]


def test_rows_from_before_a_column_take_its_default_even_after_a_crash(spark, tmp_path):
    path = str(tmp_path / "mirror")
    spark.createDataFrame([(1,), (2,)], "id bigint").write.format("delta").save(path)
    source = spark.createDataFrame([], "id bigint, grade string").schema

    quoting = {"grade": "O'Brien \\ B"}  # SQL's quote and escape characters, kept as they are
    assert fill_defaults(spark, path, SPEC, source, quoting, _stored(spark, path))
    assert _grades(spark, path) == [quoting["grade"]] * 2
    assert not _comments(spark, path)["grade"].startswith(FILLING_DEFAULT)

    # A crash right after the column was added: it carries the mark and its default, its rows
    # are null. The next run fills them, even one that knows no default itself.
    crashed = str(tmp_path / "crashed")
    spark.createDataFrame([(1,)], "id bigint").write.format("delta").save(crashed)
    mark = f'{FILLING_DEFAULT}"B"'
    spark.sql(f"ALTER TABLE delta.`{crashed}` ADD COLUMNS (grade string COMMENT '{mark}')")
    assert fill_defaults(spark, crashed, SPEC, source, {}, _stored(spark, crashed))
    assert _grades(spark, crashed) == ["B"]

    # Once filled, a later run leaves the column alone (its nulls may be real ones).
    spark.sql(f"UPDATE delta.`{crashed}` SET grade = NULL")
    assert not fill_defaults(
        spark, crashed, SPEC, source, SPEC.column_defaults(), _stored(spark, crashed)
    )
    assert _grades(spark, crashed) == [None]


def test_only_undeclared_columns_take_the_connectors_default_and_only_unseen_ones_fill():
    """A declared column takes the tables file's default alone (else hours from before it would
    hold null or the connector's default by the order they ran in); an undeclared one the
    connector's. A column the source sent while the mirror left it out is not filled."""
    connector = {"grade": "A", "memo": "none", "since": "2026-01-02", "odd": "x"}
    added = {"memo": "string", "since": "date", "odd": "bigint"}
    assert column_defaults(SPEC, added, connector) == {
        "grade": "B",  # declared: the tables file's, not the connector's "A"
        "memo": "none",
        "since": date(2026, 1, 2),
        # "odd" is no bigint: no default
    }
    stored = StructType([StructField("id", LongType())])
    fillable = fillable_defaults(SPEC, {"grade": "B", "memo": "none"}, stored, {"memo"})
    assert fillable == {"grade": "B"}


def test_a_column_joins_the_lacked_ones_when_some_change_the_runs_read_was_written_without_it():
    """schema_drift names an undeclared default only for such a column: one added to the source
    (`ADD COLUMN grade ... DEFAULT 7`) after changes the mirror holds. A column the table had
    since it was created (`flag`) is in every change and never joins."""
    hour = SourceShape(fields={"id": {"int64"}, "flag": {"int16"}, "grade": {"int32"}})
    assert lacked_columns(hour, [], []) == []  # the first run: nothing to compare with
    assert lacked_columns(hour, ["id", "flag", "grade"], []) == []
    # Earlier runs read the table before it had grade...
    assert lacked_columns(hour, ["id", "flag"], []) == ["grade"]
    # ... or this hour holds a change from before it (in any hour order)...
    hour.absent = {"grade"}
    assert lacked_columns(hour, [], []) == ["grade"]
    # ... and every later run keeps it, an empty hour's too.
    assert lacked_columns(None, ["id", "flag", "grade"], ["grade"]) == ["grade"]


def test_every_runs_record_carries_the_running_records_an_empty_hour_too():
    """The next run reads the column defaults and the source columns seen so far from the
    newest commit alone: an empty hour's commit must carry them on, or the hour after it
    would forget a column earlier hours saw (and fill rows whose values were never stored)."""
    start = datetime(2026, 11, 3, 9, tzinfo=UTC)
    hour = HourPlan(
        slice=HourSlice("t", start, start + timedelta(hours=1), (), True, None),
        previous_end=None,
        prior_newest=5,
        local=True,
    )
    newest = {"hour": "x", COLUMN_DEFAULTS: {"memo": "none"}, SOURCE_COLUMNS: ["id", "memo"]}
    newest[LACKED_COLUMNS] = ["memo"]
    ctx = HourContext(
        *([None] * 4), "2026-11-03-09:00", None, None, "/lake/t", None, 3, [newest], None
    )  # only the hour and the history matter here
    empty = _record(ctx, hour, consumed=0, tombstones=0, errors=0, newest_ms=None)
    assert empty[COLUMN_DEFAULTS] == {"memo": "none"}
    assert empty[SOURCE_COLUMNS] == ["id", "memo"]
    assert empty[LACKED_COLUMNS] == ["memo"]
    assert empty["mirror_newest_ms"] == 5
