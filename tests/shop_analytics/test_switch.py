"""The shop's analytics are switched on by the tables file's `shop_analytics: true`, never by
table names; switched on over tables that lack what they read, the code location fails to load."""

from __future__ import annotations

import dagster as dg
import pytest
import yaml

from cdc_assets.config import DEFAULT_TABLES_FILE, TABLES_FILE_ENV, TableConfigError
from code_location.definitions import defs

SHOP_ASSETS = {"order_facts", "daily_sales"}


def _tables_file(tmp_path, monkeypatch, *, switch: bool | None, drop_column=None) -> None:
    """The demo's tables file, with the switch as given (None: left out), as CDC_TABLES_FILE."""
    raw = yaml.safe_load(DEFAULT_TABLES_FILE.read_text())
    raw.pop("shop_analytics", None)
    if switch is not None:
        raw["shop_analytics"] = switch
    if drop_column:
        table, column = drop_column
        del next(t for t in raw["tables"] if t["name"] == table)["columns"][column]
    path = tmp_path / "tables.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    monkeypatch.setenv(TABLES_FILE_ENV, str(path))


def _load() -> dg.Definitions:
    return defs() if callable(defs) else defs


def _asset_names(definitions: dg.Definitions) -> set[str]:
    return {key.to_user_string() for key in definitions.resolve_asset_graph().get_all_asset_keys()}


@pytest.mark.parametrize("switch", [None, False])
def test_tables_named_like_the_shops_without_the_switch_build_no_analytics(
    tmp_path, monkeypatch, switch
):
    _tables_file(tmp_path, monkeypatch, switch=switch)
    definitions = _load()
    names = _asset_names(definitions)
    assert {"customers", "orders", "order_items"} <= names
    assert names.isdisjoint(SHOP_ASSETS)
    assert [s.name for s in definitions.sensors] == ["cdc_offsets"]


def test_the_switch_builds_the_analytics(tmp_path, monkeypatch):
    _tables_file(tmp_path, monkeypatch, switch=True)
    assert SHOP_ASSETS <= _asset_names(_load())


def test_the_switch_over_a_table_without_a_column_fails_naming_the_fix(tmp_path, monkeypatch):
    _tables_file(tmp_path, monkeypatch, switch=True, drop_column=("customers", "is_active"))
    with pytest.raises(TableConfigError) as error:
        _load()
    message = str(error.value)
    assert "sets shop_analytics: true" in message
    assert "table 'customers' has no column 'is_active'" in message
    assert "Fix the tables file" in message
    assert "remove 'shop_analytics: true'" in message
