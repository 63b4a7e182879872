"""The tables file: the shipped one loads; every bad entry is reported with table and setting."""

from __future__ import annotations

import dagster as dg
import pytest

from cdc_assets.config import (
    TableConfigError,
    load_tables,
    load_tables_file,
    parse_tables,
    parse_tables_file,
)
from cdc_assets.factory import build_table_asset
from cdc_assets.masking import stored_spec
from checks.table_checks import MIRROR_CHECKS
from resources.kafka import KafkaResource
from resources.lake import LakeResource
from resources.masking import MASKING_KEY_ENV, MaskingResource
from resources.spark import SparkResource


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
            {"expectations": [{"column": "email", "expect": "regex", "regex": r"\bx"}]},
            "expectation 'email_regex': regex '\\bx' can't be judged alike by Java (Spark) and "
            "Python (rows in memory): it uses the word boundary \\b",
        ),
        (
            {"expectations": [{"column": "id", "expect": "regex", "regex": "^1"}]},
            "expectation 'id_regex' on the bigint column 'id' matches a regex, which judges text",
        ),
        (
            {"expectations": [{"column": "email", "expect": "between", "min": 0}]},
            "between takes number and decimal columns",
        ),
        (
            {"expectations": [{"column": "email", "expect": "in_set", "values": ["a", 1]}]},
            "lists 1, which a string column can't hold (quote it to make it text)",
        ),
        (
            {"expectations": [{"column": "id", "expect": "in_set", "values": [1, True]}]},
            "lists True, which a bigint column can't hold",
        ),
        (
            {
                "columns": {"id": "bigint", "day": "date"},
                "expectations": [{"column": "day", "expect": "in_set", "values": ["2026-01-01"]}],
            },
            "in_set takes string, boolean, number and decimal columns",
        ),
        (
            {"expectations": [{"column": "id", "expect": "between", "max": 2**53}]},
            "'between' bound 9007199254740992 is not within ±(2**53 - 1)",
        ),
        (
            {"expectations": [{"column": "id", "expect": "between", "min": float("inf")}]},
            "'between' takes finite bounds, not inf",
        ),
        (
            {"expectations": [{"column": "id", "expect": "in_set", "values": [float("nan")]}]},
            "'in_set' takes no NaN",
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
        (
            {"sensitive": {"phone": "hash"}},
            "setting 'sensitive': column 'phone' is not listed under columns",
        ),
        ({"sensitive": {"email": "encrypt"}}, "setting 'sensitive.email': Input should be 'hash'"),
        ({"sensitive": {"id": "hash"}}, "column 'id' is part of the primary_key, which can't be"),
        (
            {
                "sensitive": {"email": "drop"},
                "expectations": [{"column": "email", "expect": "not_null"}],
            },
            "column 'email' is dropped, so expectation 'email_not_null' has nothing to check",
        ),
        (
            {
                "sensitive": {"email": "hash"},
                "expectations": [
                    {"column": "email", "expect": "regex", "regex": "@", "hard": True}
                ],
            },
            "expectation 'email_regex' would judge the hash, not the value",
        ),
        (
            {"deletion_vectors": "false"},
            "setting 'deletion_vectors': 'false' is not true or false; write deletion_vectors: "
            "false for readers",
        ),
        ({"deletion_vectors": 0}, "setting 'deletion_vectors': 0 is not true or false"),
        ({"name": "customers__history"}, "ends in '__history', which names history tables"),
        (
            {"history": True, "on_truncate": "apply"},
            "history: true with on_truncate: apply is not supported yet",
        ),
        (
            {"history_except_columns": ["email"]},
            "history_except_columns is set, but history is off; set history: true",
        ),
        (
            {"history": True, "history_columns": ["id"]},
            "history_columns names 'id', which is not a non-key column listed under columns",
        ),
        (
            {"history": True, "history_columns": ["email"], "history_except_columns": ["email"]},
            "history_columns and history_except_columns are both set",
        ),
        (
            {"name": "customers__history_changes"},
            "ends in '__history_changes', which names tracked histories' changes",
        ),
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


def test_sensitive_columns_are_stored_masked():
    (spec,) = parse_tables(
        {
            "tables": [
                _entry(
                    columns={"id": "bigint", "email": "string", "ssn": "bigint", "x": "int"},
                    sensitive={"email": "hash", "ssn": "hash", "x": "drop"},
                    # Null stays null and equal values hash equally: these keep their meaning.
                    expectations=[
                        {"column": "email", "expect": "not_null", "hard": True},
                        {"column": "ssn", "expect": "unique"},
                    ],
                )
            ]
        }
    )
    assert stored_spec(spec).columns == {"id": "bigint", "email": "string", "ssn": "string"}
    assert "masking" in build_table_asset(checks=MIRROR_CHECKS, spec=spec).required_resource_keys
    # A table that only drops needs the key too: its error table's raw bytes are sealed with it.
    dropping = spec.model_copy(update={"sensitive": {"x": "drop"}, "expectations": ()})
    assert (
        "masking" in build_table_asset(checks=MIRROR_CHECKS, spec=dropping).required_resource_keys
    )
    # A table without sensitive columns runs without the masking resource.
    plain = spec.model_copy(update={"sensitive": {}, "expectations": ()})
    assert (
        "masking" not in build_table_asset(checks=MIRROR_CHECKS, spec=plain).required_resource_keys
    )


def _hashing_run(tmp_path, masking: MaskingResource, mode: str = "hash"):
    (spec,) = parse_tables({"tables": [_entry(sensitive={"email": mode})]})
    resources = {
        # Never contacted: the masking setup is checked before anything is read.
        "kafka": KafkaResource(bootstrap_servers="127.0.0.1:9"),
        "spark": SparkResource(),
        "lake": LakeResource(root=str(tmp_path / "lake")),
        "masking": masking,
    }
    return dg.materialize(
        [build_table_asset(checks=MIRROR_CHECKS, spec=spec)],
        partition_key="2026-11-01-05:00",
        resources=resources,
        raise_on_error=False,
    )


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        (None, f"no masking key is configured. Set the environment variable {MASKING_KEY_ENV}"),
        ("short", f"the masking key in {MASKING_KEY_ENV} has 5 bytes; HMAC-SHA256 needs at least"),
    ],
)
@pytest.mark.parametrize("mode", ["hash", "drop"])
def test_a_masking_table_without_a_usable_key_fails_fast(tmp_path, key, expected, mode):
    result = _hashing_run(tmp_path, MaskingResource(key=key), mode)
    assert not result.success
    (failure,) = result.get_step_failure_events()
    message = failure.step_failure_data.user_failure_data.description
    assert "table 'customers', setting 'sensitive'" in message and expected in message
    assert not (tmp_path / "lake").exists()
    # Not retried: another attempt can't find a key.
    assert not [e for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_RESTARTED]


def test_an_unset_key_variable_is_refused_at_launch(tmp_path, monkeypatch):
    monkeypatch.delenv(MASKING_KEY_ENV, raising=False)
    with pytest.raises(dg.DagsterInvalidConfigError, match=MASKING_KEY_ENV):
        _hashing_run(tmp_path, MaskingResource(key=dg.EnvVar(MASKING_KEY_ENV)))


def test_deletion_vectors_are_on_unless_a_table_turns_them_off():
    assert parse_tables({"tables": [_entry()]})[0].deletion_vectors is True
    assert parse_tables({"tables": [_entry(deletion_vectors=False)]})[0].deletion_vectors is False


def test_the_shipped_file_switches_the_shop_analytics_on_and_others_are_off_unless_set():
    assert load_tables_file().shop_analytics is True
    assert parse_tables_file({"tables": [_entry()]}).shop_analytics is False
    assert parse_tables_file({"tables": [_entry()], "shop_analytics": True}).shop_analytics
    # A block of YAML anchors under an x- key is the file's own, not a setting.
    assert parse_tables_file({"tables": [_entry()], "x-defaults": {"group": "g"}}).tables


@pytest.mark.parametrize(
    "settings, expected",
    [
        (
            {"shop_analytics": "yes"},
            "setting 'shop_analytics': 'yes' is not true or false; write shop_analytics: true",
        ),
        ({"shop_analytic": True}, "unknown top-level setting 'shop_analytic'"),
    ],
)
def test_a_bad_file_setting_is_named_beside_the_tables_problems(settings, expected):
    with pytest.raises(TableConfigError) as error:
        parse_tables_file({"tables": [_entry(start_hour="soon")], **settings}, source="t.yaml")
    lines = str(error.value).splitlines()
    assert any(line.startswith(f"t.yaml: {expected}") for line in lines)
    assert any("table 'customers', setting 'start_hour'" in line for line in lines)
