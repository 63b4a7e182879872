"""The fault handling's pure rules, without Spark: conflict retries, truncate watermarks and
the types of columns a mirror gains."""

from __future__ import annotations

import pytest
from delta.exceptions import ConcurrentAppendException
from pydantic import ValidationError

from cdc_assets import commits
from cdc_assets.commits import truncate_watermark
from cdc_assets.config import TableSpec
from cdc_assets.decoding.shape import SourceShape, added_column_types


def test_a_lost_commit_race_is_retried_then_named(monkeypatch):
    monkeypatch.setattr(commits.time, "sleep", lambda _: None)
    calls = []

    def write():
        calls.append(1)
        if len(calls) < 3:
            raise ConcurrentAppendException("another writer committed")
        return "done"

    assert commits.retry_on_conflict(write, table="accounts", path="/lake/accounts") == "done"
    assert len(calls) == 3

    def always():
        raise ConcurrentAppendException("again")

    with pytest.raises(commits.CommitConflictError) as lost:
        commits.retry_on_conflict(always, table="accounts", path="/lake/accounts", attempts=2)
    assert "table 'accounts'" in str(lost.value) and "ConcurrentAppendException" in str(lost.value)

    def other():
        raise ValueError("not a conflict")

    with pytest.raises(ValueError):  # anything else is not retried
        commits.retry_on_conflict(other, table="accounts", path="/lake/accounts")


def test_the_truncate_watermark_is_the_newest_truncate():
    history = [
        {"hour": "h3", "truncated_before": [300, 0, 5]},
        {"hour": "h2"},
        {"hour": "h1", "truncated_before": [120, 1, 9]},
    ]
    assert truncate_watermark(history, None) == [300, 0, 5]
    assert truncate_watermark(history, [300, 1, 0]) == [300, 1, 0]
    assert truncate_watermark([{"hour": "h"}], None) is None
    assert truncate_watermark([], [7, 0, 0]) == [7, 0, 0]


def test_added_columns_take_their_type_from_their_values():
    # Without a schema: from the JSON kinds their values arrived as.
    types = {
        "id": {"bigint"},  # declared
        "visits": {"bigint"},
        "score": {"double", "bigint"},
        "ratio": {"double"},
        "vip": {"boolean"},
        "tier": {"string"},
        "mixed": {"bigint", "string"},
        "later": set(),  # only nulls so far: waits
        "nested": {"object (declare it)"},  # waits for a declaration
        "Value": {"string"},  # the raw record's column name
        "_cdc_op": {"string"},
        "bad-name": {"string"},
    }
    assert added_column_types(SourceShape(types=types), ["id"]) == {
        "visits": "bigint",
        "score": "double",
        "ratio": "double",
        "vip": "boolean",
        "tier": "string",
        "mixed": "string",
    }
    shape = SourceShape(types={"Tier": {"string"}})
    assert added_column_types(shape, ["tier"]) == {}  # Spark's names ignore case
    # With a schema: the type its encoding calls for.
    schema = SourceShape(types={"amount": {"decimal(12,2)"}, "at": {"timestamp"}})
    assert added_column_types(schema, ["id"]) == {"amount": "decimal(12,2)", "at": "timestamp"}


def test_toasted_columns_must_be_declared_non_key_columns():
    base = {
        "name": "t",
        "topic": "t",
        "primary_key": ["id"],
        "columns": {"id": "bigint", "body": "string"},
        "start_hour": "2026-11-01-00:00",
    }
    assert TableSpec(**base, toasted_columns=["body"]).toasted_columns == ("body",)
    for wrong in (["id"], ["nope"]):
        with pytest.raises(ValidationError, match="not a non-key column"):
            TableSpec(**base, toasted_columns=wrong)
