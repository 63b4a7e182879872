"""`python -m cdc_assets.history_refold` refuses what it can't start with, saying why, before
any Spark session is touched (the refold itself: tests/cdc_assets/test_history.py)."""

from __future__ import annotations

import pytest

from cdc_assets import history_refold


@pytest.mark.parametrize(
    ("argv", "lake", "said"),
    [
        (["--table", "customers"], False, "CDC_LAKE_ROOT not set"),
        (["--table", "nope"], True, "no table 'nope' in the tables file"),
        (["--table", "orders"], True, "table 'orders' keeps no history"),
    ],
)
def test_a_refold_that_cannot_start_says_why_and_exits_2(
    monkeypatch, tmp_path, capsys, argv, lake, said
):
    monkeypatch.delenv("CDC_TABLES_FILE", raising=False)
    monkeypatch.delenv("CDC_LAKE_ROOT", raising=False)
    if lake:
        monkeypatch.setenv("CDC_LAKE_ROOT", str(tmp_path / "lake"))
    with pytest.raises(SystemExit) as refused:
        history_refold.main(argv)
    assert refused.value.code == 2
    assert said in capsys.readouterr().err
