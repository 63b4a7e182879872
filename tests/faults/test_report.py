"""The fault report's table: one line per scenario and a total line that sums the figures."""

from __future__ import annotations

import json

from tests.faults import figures
from tests.faults.figures import SCENARIOS
from tests.faults.report import format_table, main


def _row(name: str, passed: bool = True, **figures) -> dict:
    base = dict.fromkeys(("faults", "lost", "duplicates", "resurrected", "mismatches"), 0)
    return {"scenario": name, "passed": passed, "secret_hits": 0, **base, **figures}


def test_the_table_totals_every_figure_and_marks_failures():
    table = format_table([_row("b", faults=2), _row("a", False, faults=1, lost=3, secret_hits=1)])
    lines = table.splitlines()
    assert lines[2] == "| a | NO | 1 | 3 | 0 | 0 | 0 | 1 |"
    assert lines[3] == "| b | yes | 2 | 0 | 0 | 0 | 0 | 0 |"
    assert lines[4] == "| total (2 scenarios) | 1/2 | 3 | 3 | 0 | 0 | 0 | 1 |"


def test_the_command_fails_on_a_failed_or_missing_scenario(tmp_path, capsys):
    assert main([str(tmp_path / "missing.json")]) == 1
    path = tmp_path / "figures.json"
    path.write_text(json.dumps([_row(name) for name in SCENARIOS]))
    assert main([str(path)]) == 0
    assert f"| total ({len(SCENARIOS)} scenarios) |" in capsys.readouterr().out
    path.write_text(json.dumps([_row(name) for name in SCENARIOS[1:]]))
    assert main([str(path)]) == 1
    assert f"no figures for: {SCENARIOS[0]}" in capsys.readouterr().out
    failed = [_row(SCENARIOS[0], False, duplicates=1)] + [_row(n) for n in SCENARIOS[1:]]
    path.write_text(json.dumps(failed))
    assert main([str(path)]) == 1


def test_figures_of_a_partial_run_replace_only_their_scenarios(tmp_path):
    path = tmp_path / "figures.json"
    path.write_text(json.dumps([_row("a", faults=1), _row("b", faults=2)]))
    session = list(figures._RECORDED)  # what the suite's other tests recorded so far
    figures._RECORDED[:] = [figures.Figures("b", True, 5, 0, 0, 0, 0, 0)]
    try:
        figures.save(path)
    finally:
        figures._RECORDED[:] = session
    saved = {r["scenario"]: r for r in json.loads(path.read_text())}
    assert saved["a"]["faults"] == 1 and saved["b"]["faults"] == 5 and "measured" in saved["b"]


def test_figures_of_a_failed_test_are_reported_as_failed():
    session = list(figures._RECORDED), list(figures._OWNERS)
    try:
        with figures.recording_for("tests/x.py::test_a"):
            figures.record("a", figures.Comparison(), faults=1)
        with figures.recording_for("tests/x.py::test_b"):
            figures.record("b", figures.Comparison(), faults=1)
        figures.fail_recorded_by("tests/x.py::test_a")
        passed = {f.scenario: f.passed for f in figures._RECORDED[-2:]}
        assert passed == {"a": False, "b": True}
    finally:
        figures._RECORDED[:], figures._OWNERS[:] = session
