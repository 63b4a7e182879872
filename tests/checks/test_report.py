"""The check report: read back from a Dagster instance's event log, per hour and check.

The fast tests use a stand-in `orders` asset with the real check names, whose results the test
chooses; the integration test reads what real hourly runs of the orders mirror recorded.
"""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import pytest
import yaml

from cdc_assets.config import ExpectationSpec, RetentionPolicy, TableSpec, load_tables
from cdc_assets.factory import build_table_asset
from cdc_assets.partitions import hourly_partitions
from checks.invariants import RETENTION_RISK
from checks.report import (
    FAILED_ERROR,
    FAILED_WARN,
    LEGEND,
    NOT_RUN,
    PASSED,
    build_report,
    check_names,
    format_table,
    main,
    plain_metadata,
)
from checks.table_checks import MIRROR_CHECKS, build_retention_check_for, run_check_specs
from tests.support import FIRST_HOUR, demo_specs, hour_keys, seed_demo

H1, H2, H3 = hour_keys(FIRST_HOUR, 3)


def _orders() -> TableSpec:
    return next(spec for spec in load_tables() if spec.name == "orders")


def _write_tables_file(path: Path, spec: TableSpec) -> Path:
    path.write_text(yaml.safe_dump({"tables": [spec.model_dump(mode="json")]}))
    return path


def _status(evaluation: dg.AssetCheckEvaluation) -> str:
    return PASSED if evaluation.passed else f"FAILED({evaluation.severity.value})"


# --- format_table -----------------------------------------------------------------------------


def _hand_row(hour: str, check: str, status: str, description: str | None = None) -> dict:
    return {
        "hour": hour,
        "check": check,
        "status": status,
        "severity": None if status == NOT_RUN else "ERROR",
        "description": description,
        "metadata": {},
        "run_id": None,
        "evaluated_at": None,
    }


def test_format_table_marks_each_hour_and_lists_failures():
    rows = [
        _hand_row(H1, "accounting", PASSED),
        _hand_row(H1, "customer_id_not_null", FAILED_ERROR, "3 of 40 rows\n are unexpected"),
        _hand_row(H2, "accounting", FAILED_WARN, None),
        _hand_row(H2, "customer_id_not_null", NOT_RUN),
    ]
    lines = format_table(rows).splitlines()

    assert lines[0].split() == ["hour", "accounting", "customer_id_not_null"]
    assert lines[1].split() == [H1, "ok", "FAIL"]
    assert lines[2].split() == [H2, "warn", "-"]
    # Marks sit under their check's name.
    assert lines[1].index("FAIL") == lines[0].index("customer_id_not_null")
    assert LEGEND in lines
    failing = lines[lines.index("Failing checks (2):") + 1 :]
    assert failing == [
        f"  {H1}  customer_id_not_null  FAILED(ERROR): 3 of 40 rows are unexpected",
        f"  {H2}  accounting  FAILED(WARN): (no description)",
    ]


def test_format_table_says_when_nothing_failed():
    text = format_table([_hand_row(H1, "accounting", PASSED), _hand_row(H2, "accounting", NOT_RUN)])
    assert text.splitlines()[-1] == "No failing checks."


# --- fail fast --------------------------------------------------------------------------------


@pytest.fixture
def no_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv("CDC_TABLES_FILE", raising=False)
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    return monkeypatch


def _fails(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and "Traceback" not in err
    return err


def test_missing_dagster_home_fails_fast(no_env, capsys):
    err = _fails(capsys, ["--table", "orders", "--from", H1, "--to", H2])
    assert "DAGSTER_HOME is not set" in err and "set it to" in err


def test_dagster_home_without_an_instance_fails_fast(no_env, capsys, tmp_path):
    no_env.setenv("DAGSTER_HOME", str(tmp_path))
    err = _fails(capsys, ["--table", "orders", "--from", H1, "--to", H2])
    assert "holds no Dagster instance" in err
    assert list(tmp_path.iterdir()) == []  # and nothing was created there


def test_unknown_table_fails_fast(no_env, capsys):
    err = _fails(capsys, ["--table", "ordrs", "--from", H1, "--to", H2])
    assert "--table 'ordrs'" in err and "orders" in err and "--tables-file" in err


@pytest.mark.parametrize(
    ("first", "last", "named"),
    [
        ("2026-11-02 06:00", H2, "--from"),
        (H1, "2026-11-02-07:30", "--to"),
        (H1, "2026-11-2-7:00", "--to"),
        (H2, H1, "--to"),
        ("2020-01-01-00:00", H1, "start_hour"),
    ],
)
def test_malformed_hours_fail_fast(no_env, capsys, first, last, named):
    err = _fails(capsys, ["--table", "orders", "--from", first, "--to", last])
    assert named in err


# --- build_report on a stand-in asset ---------------------------------------------------------


def _stand_in(spec: TableSpec, outcomes: dict[str, tuple[bool, str]], *, crash: bool = False):
    """An asset named like the table, with its check specs, reporting `outcomes` by name."""
    partitions_def = hourly_partitions(spec)

    @dg.asset(
        name=spec.name,
        partitions_def=partitions_def,
        check_specs=run_check_specs(spec, partitions_def=partitions_def),
    )
    def _asset(context) -> dg.MaterializeResult:  # a string hint (PEP 563) is refused
        if crash:
            raise RuntimeError("the run died before its checks")
        return dg.MaterializeResult(
            check_results=[
                dg.AssetCheckResult(
                    check_name=name,
                    passed=passed,
                    severity=dg.AssetCheckSeverity(severity),
                    description=None if passed else f"{name} failed on {context.partition_key}",
                    metadata={
                        "count": 3,
                        "share": 0.5,
                        "offsets": dg.MetadataValue.json({"0": [1, 2]}),
                        "newest": dg.MetadataValue.timestamp(1_793_000_000.0),
                    },
                )
                for name, (passed, severity) in outcomes.items()
            ]
        )

    return _asset


def test_build_report_takes_the_newest_evaluated_result(tmp_path):
    spec = _orders()
    names = check_names(spec)
    run_checks = names[:-1]
    assert names[-1] == RETENTION_RISK
    all_pass = {name: (True, "ERROR") for name in run_checks}
    some_fail = {**all_pass, "freshness": (False, "WARN"), "customer_id_not_null": (False, "ERROR")}

    with dg.instance_for_test(temp_dir=str(tmp_path)) as instance:
        first = dg.materialize([_stand_in(spec, all_pass)], partition_key=H1, instance=instance)
        second = dg.materialize([_stand_in(spec, some_fail)], partition_key=H1, instance=instance)
        # A later run of H1 that planned the checks and died: the report keeps the evaluations.
        crashed = dg.materialize(
            [_stand_in(spec, all_pass, crash=True)],
            partition_key=H1,
            instance=instance,
            raise_on_error=False,
        )
        assert not crashed.success
        h2 = dg.materialize([_stand_in(spec, all_pass)], partition_key=H2, instance=instance)
        instance.report_runless_asset_event(
            dg.AssetCheckEvaluation(
                asset_key=dg.AssetKey(spec.name),
                check_name=RETENTION_RISK,
                passed=False,
                severity=dg.AssetCheckSeverity.WARN,
                description="12.0 hours left",
                partition=H2,
            )
        )
        rows = build_report(instance, spec, [H1, H2, H3])

    assert [(r["hour"], r["check"]) for r in rows] == [(h, n) for h in (H1, H2, H3) for n in names]
    by_key = {(r["hour"], r["check"]): r for r in rows}
    assert first.run_id not in {r["run_id"] for r in rows}
    for name in run_checks:
        h1 = by_key[(H1, name)]
        assert h1["run_id"] == second.run_id
        assert h1["status"] == {"freshness": FAILED_WARN, "customer_id_not_null": FAILED_ERROR}.get(
            name, PASSED
        )
        assert by_key[(H2, name)]["run_id"] == h2.run_id
        assert by_key[(H2, name)]["status"] == PASSED
    assert by_key[(H1, "freshness")]["description"] == f"freshness failed on {H1}"
    assert by_key[(H1, "freshness")]["metadata"] == {
        "count": 3,
        "share": 0.5,
        "offsets": {"0": [1, 2]},
        "newest": "2026-10-26T07:33:20+00:00",
    }
    assert by_key[(H1, RETENTION_RISK)]["status"] == NOT_RUN
    assert by_key[(H2, RETENTION_RISK)]["status"] == FAILED_WARN
    assert by_key[(H2, RETENTION_RISK)]["description"] == "12.0 hours left"
    assert all(by_key[(H3, name)] == _hand_row(H3, name, NOT_RUN) for name in names)
    assert json.loads(json.dumps(rows)) == rows


# --- the real pipeline ------------------------------------------------------------------------


@pytest.fixture
def seeded_orders(broker, topic_prefix) -> TableSpec:
    """The demo's orders table on private topics, two hours of changes, with two expectations
    that fail on the demo's data: one ERROR, one WARN (non-blocking, so the runs go on)."""
    specs = demo_specs(topic_prefix)
    seed_demo(broker, specs, hours=2, changes_per_hour=30)
    orders = next(spec for spec in specs if spec.name == "orders")
    failing = (
        ExpectationSpec(column="customer_id", expect="between", max=0),
        ExpectationSpec(column="ship_date", expect="not_null", severity="WARN"),
    )
    # min_hours_left given as a float: RetentionPolicy's default is the int 24 (pydantic does
    # not validate defaults), which dg.MetadataValue.float refuses when retention_risk runs.
    checks = orders.checks.model_copy(
        update={"retention_risk": RetentionPolicy(min_hours_left=24.0)}
    )
    return orders.model_copy(
        update={"expectations": (*orders.expectations, *failing), "checks": checks}
    )


@pytest.mark.integration
def test_report_reads_what_the_hourly_runs_recorded(
    seeded_orders, kafka, spark_resource, lake, tmp_path, monkeypatch, capsys
):
    spec = seeded_orders
    home = tmp_path / "dagster_home"
    home.mkdir()
    resources = {"kafka": kafka, "spark": spark_resource, "lake": lake}
    recorded: dict[tuple[str, str], tuple[dg.AssetCheckEvaluation, str]] = {}

    with dg.instance_for_test(temp_dir=str(home)) as instance:
        for key in (H1, H2):
            result = dg.materialize(
                [
                    build_table_asset(checks=MIRROR_CHECKS, spec=spec),
                    build_retention_check_for(spec=spec),
                ],
                partition_key=key,
                resources=resources,
                instance=instance,
            )
            assert result.success
            for evaluation in result.get_asset_check_evaluations():
                recorded[(key, evaluation.check_name)] = (evaluation, result.run_id)
        rows = build_report(instance, spec, [H1, H2, H3])

    names = check_names(spec)
    assert sorted(recorded) == sorted((h, n) for h in (H1, H2) for n in names)
    assert [(r["hour"], r["check"]) for r in rows] == [(h, n) for h in (H1, H2, H3) for n in names]
    for row in rows:
        if row["hour"] == H3:
            assert row["status"] == NOT_RUN
            assert row["run_id"] is None
            continue
        evaluation, run_id = recorded[(row["hour"], row["check"])]
        assert row["status"] == _status(evaluation), row["check"]
        assert row["severity"] == evaluation.severity.value
        assert row["description"] == evaluation.description
        assert row["metadata"] == plain_metadata(evaluation.metadata)
        assert row["run_id"] == run_id
        assert row["evaluated_at"].endswith("+00:00")
    statuses = {row["status"] for row in rows}
    assert {FAILED_ERROR, FAILED_WARN, PASSED, NOT_RUN} <= statuses

    # The command, against the same instance read back from disk, as a person would run it.
    tables_file = _write_tables_file(tmp_path / "tables.yaml", spec)
    report_path = tmp_path / "report.json"
    # As README writes it: DAGSTER_HOME relative to the directory the command runs in.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DAGSTER_HOME", home.name)
    argv = ["--table", spec.name, "--from", H1, "--to", H3, "--json", str(report_path)]
    # A failed ERROR check in the range: exit 1, saying so (WARN ones are only reported).
    assert main([*argv, "--tables-file", str(tables_file)]) == 1
    captured = capsys.readouterr()
    out = captured.out
    errors = sum(row["status"] == FAILED_ERROR for row in rows)
    assert f"{errors} check result(s) of severity ERROR failed" in captured.err
    written = json.loads(report_path.read_text())
    assert written == {"table": spec.name, "from": H1, "to": H3, "rows": rows}
    header = next(line for line in out.splitlines() if line.startswith("hour"))
    assert header.split() == ["hour", *names]
    assert "customer_id_between  FAILED(ERROR)" in out
    assert "ship_date_not_null  FAILED(WARN)" in out
    print(out)  # noqa: T201  (shown with -s)

    # A range the runs never reached: the report says which hours the instance has, exit 1.
    argv = ["--table", spec.name, "--from", H3, "--to", H3, "--tables-file", str(tables_file)]
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert "No check ran on these hours." in captured.out
    assert f"has its hours from {H1} to {H2} materialized (2 hours)" in captured.err
