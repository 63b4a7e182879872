"""A column with a default that a mirror gains while it holds rows (`merge.fill_defaults`):
the rows from before it hold the default, and a crash between adding the column and filling
it is filled by the next run. Real Spark and Delta."""

from __future__ import annotations

from delta.tables import DeltaTable

from cdc_assets.config import TableSpec
from cdc_assets.merge import FILLING_DEFAULT, fill_defaults

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


def test_rows_from_before_a_column_take_its_default_even_after_a_crash(spark, tmp_path):
    path = str(tmp_path / "mirror")
    spark.createDataFrame([(1,), (2,)], "id bigint").write.format("delta").save(path)
    source = spark.createDataFrame([], "id bigint, grade string").schema

    fill_defaults(spark, path, SPEC, source, SPEC.column_defaults())
    rows = spark.read.format("delta").load(path).orderBy("id").collect()
    assert [(r["id"], r["grade"]) for r in rows] == [(1, "B"), (2, "B")]
    assert _comments(spark, path)["grade"] != FILLING_DEFAULT

    # A crash right after the column was added: it carries the mark, its rows are null.
    crashed = str(tmp_path / "crashed")
    spark.createDataFrame([(1,)], "id bigint").write.format("delta").save(crashed)
    spark.sql(
        f"ALTER TABLE delta.`{crashed}` ADD COLUMNS (grade string COMMENT '{FILLING_DEFAULT}')"
    )
    fill_defaults(spark, crashed, SPEC, source, SPEC.column_defaults())
    assert [r["grade"] for r in spark.read.format("delta").load(crashed).collect()] == ["B"]

    # Once filled, a later run leaves the column alone (its nulls may be real ones).
    spark.sql(f"UPDATE delta.`{crashed}` SET grade = NULL")
    fill_defaults(spark, crashed, SPEC, source, SPEC.column_defaults())
    assert [r["grade"] for r in spark.read.format("delta").load(crashed).collect()] == [None]
