"""The tables file: the shipped one loads; every bad entry is reported with table and setting."""

from __future__ import annotations

import pytest

from cdc_assets.config import TableConfigError, load_tables, parse_tables


def _entry(**overrides) -> dict:
    entry = {
        "name": "customers",
        "topic": "shop.customers",
        "primary_key": ["id"],
        "columns": {"id": "bigint", "email": "string"},
        "start_hour": "2026-11-01-00:00",
    }
    entry.update(overrides)
    return entry


def test_shipped_tables_file_loads():
    specs = load_tables()
    assert [s.name for s in specs] == ["customers", "orders", "order_items"]
    assert next(s for s in specs if s.name == "order_items").primary_key == ("order_id", "line_no")
    assert all(s.sequence[0].field == "source.lsn" for s in specs)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"columns": {"id": "varchar"}}, "setting 'columns': column 'id' has type 'varchar'"),
        ({"primary_key": ["missing"]}, "primary_key columns ['missing'] are not listed"),
        ({"start_hour": "2026-11-01"}, "setting 'start_hour': '2026-11-01' is not an hour"),
        ({"start_hour": "2026-11-01-00:30"}, "must be on the hour"),
        ({"delete_mode": "purge"}, "setting 'delete_mode'"),
        ({"sequence": [{"field": "source..lsn"}]}, "is not a dotted path"),
        ({"colums": {}}, "setting 'colums': Extra inputs are not permitted"),
        ({"name": "bad-name"}, "setting 'name': 'bad-name' must be an identifier"),
        ({"expectations": [{"column": "nope", "expect": "not_null"}]}, "names column 'nope'"),
        ({"expectations": [{"column": "id", "expect": "in_set"}]}, "'in_set' needs values"),
        ({"expectations": [{"column": "id", "expect": "between"}]}, "needs min, max or both"),
        (
            {"expectations": [{"column": "id", "expect": "between", "min": 5, "max": 1}]},
            "min 5 above max 1",
        ),
        (
            {"expectations": [{"column": "email", "expect": "regex", "regex": "("}]},
            "regex '(' does not compile",
        ),
        (
            {"expectations": [{"column": "email", "expect": "unique", "hard": True}]},
            "'unique' can't be hard",
        ),
        (
            {"expectations": [{"column": "id", "expect": "not_null", "values": [1]}]},
            "'not_null' takes no values",
        ),
        (
            {
                "expectations": [
                    {"column": "id", "expect": "not_null", "severity": "WARN", "blocking": True}
                ]
            },
            "a blocking check needs severity ERROR",
        ),
        (
            {"expectations": [{"column": "id", "expect": "not_null"}] * 2},
            "expectation 'id_not_null' is declared twice",
        ),
        ({"checks": {"error_rate": {"max_share": 2}}}, "setting 'checks.error_rate.max_share'"),
    ],
)
def test_each_bad_setting_is_named(overrides, expected):
    with pytest.raises(TableConfigError) as error:
        parse_tables({"tables": [_entry(**overrides)]}, source="tables.yaml")
    assert expected in str(error.value)
    assert "table '" in str(error.value)


def test_all_problems_are_reported_at_once():
    entries = [
        _entry(name="a", topic="shop.a", columns={"id": "varchar"}),
        _entry(name="b", topic="shop.customers", start_hour="soon"),
        _entry(name="c", topic="shop.customers"),
    ]
    with pytest.raises(TableConfigError) as error:
        parse_tables({"tables": entries}, source="tables.yaml")
    lines = str(error.value).splitlines()
    assert any("table 'a'" in line for line in lines)
    assert any("table 'b'" in line and "start_hour" in line for line in lines)
    assert any("topic 'shop.customers' is used by 2 tables" in line for line in lines)


def test_missing_file_says_how_to_point_at_one(tmp_path):
    with pytest.raises(TableConfigError, match="CDC_TABLES_FILE"):
        load_tables(tmp_path / "nope.yaml")
