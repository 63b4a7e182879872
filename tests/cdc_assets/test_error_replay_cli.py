"""`python -m cdc_assets.error_replay` refuses what it can't start with, saying why, before any
Spark session or broker is touched (the replay itself: tests/faults/test_masking.py)."""

from __future__ import annotations

import pytest

from cdc_assets import error_replay


@pytest.fixture
def env(monkeypatch, tmp_path):
    monkeypatch.setenv("CDC_KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:1")
    monkeypatch.setenv("CDC_LAKE_ROOT", str(tmp_path / "lake"))
    monkeypatch.delenv("CDC_TABLES_FILE", raising=False)
    return monkeypatch


@pytest.mark.parametrize(
    ("argv", "unset", "said"),
    [
        (["--table", "orders", "--hour", "2026-11-05-14:30"], None,
         "--hour '2026-11-05-14:30' is not an hour key"),
        (["--table", "nope"], None, "no table 'nope' in the tables file"),
        (["--table", "orders"], "CDC_LAKE_ROOT", "CDC_LAKE_ROOT not set"),
    ],
)  # fmt: skip
def test_a_replay_that_cannot_start_says_why_and_exits_2(env, capsys, argv, unset, said):
    if unset:
        env.delenv(unset)
    with pytest.raises(SystemExit) as refused:
        error_replay.main(argv)
    assert refused.value.code == 2
    assert said in capsys.readouterr().err
