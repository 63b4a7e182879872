"""`python -m cdc_assets.backfill`, the README's command-line backfill of a range of hours.

Runs against the real services, as a user runs it: `dagster-webserver` and `dagster-daemon` on
the demo's instance file (deploy/local/dagster.yaml, SQLite) and the project's workspace.yaml,
two demo tables on private topics of the real broker, the lake in a temporary folder. The
offset sensor is stopped first (through the webserver, as from the UI), so every run is the
backfill's. The command, run as a subprocess, must wait for the backfill and exit 0; each table
then has both hours materialized by the backfill's runs, and equals the replay of its topic.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import yaml
from dagster_graphql import DagsterGraphQLClient

from cdc_assets import backfill
from cdc_assets.webserver import Webserver
from demo import ui_materialize
from demo.reference import replay
from resources.lake import LakeResource
from tests.dagster_ui import (
    RUNS,
    asset_status,
    graphql,
    start_service,
    stop_service,
    wait_for,
)
from tests.support import (
    FIRST_HOUR,
    demo_specs,
    free_ports,
    hour_keys,
    mirror_rows,
    read_topic,
    seed_demo,
)

REPO = Path(__file__).resolve().parents[2]
HOURS = 2
TABLES = ("customers", "orders")
DEADLINE_S = 600

STEP_EVENTS = """
query Events($runId: ID!) {
  logsForRun(runId: $runId, limit: 1000) { ... on EventConnection { events { __typename } } }
}
"""

SENSORS = """
query Sensors($selector: RepositorySelector!) {
  sensorsOrError(repositorySelector: $selector) {
    ... on Sensors { results { name jobOriginId sensorState { selectorId status } } }
  }
}
"""

STOP_SENSOR = """
mutation Stop($origin: String!, $selector: String!) {
  stopSensor(jobOriginId: $origin, jobSelectorId: $selector) {
    __typename
    ... on StopSensorMutationResult { instigationState { status } }
  }
}
"""


def test_argument_errors_name_the_option_and_the_fix(capsys):
    """Checked before any webserver is asked (none runs at this port)."""
    port = str(free_ports(1)[0])
    assert backfill.main(["--from", "2026-11-21-18:30", "--to", "2026-11-21-19:00"]) == 2
    assert "--from '2026-11-21-18:30' is not an hour key" in capsys.readouterr().err
    assert backfill.main(["--from", "2026-11-21-19:00", "--to", "2026-11-21-18:00"]) == 2
    assert "--to 2026-11-21-18:00 is before --from" in capsys.readouterr().err
    args = ["--from", "2026-11-21-18:00", "--to", "2026-11-21-19:00", "--port", port]
    assert backfill.main(args) == 2
    assert "no Dagster webserver answers at" in capsys.readouterr().err


@pytest.mark.integration
def test_a_range_of_hours_of_two_tables_is_backfilled_from_the_command_line(
    broker, spark, tmp_path, capsys
):
    start = FIRST_HOUR.strftime("%Y-%m-%d-%H:%M")
    demo = [
        s.model_copy(update={"start_hour": start})
        for s in demo_specs(f"bfcli{uuid.uuid4().hex[:8]}")
    ]
    # The demo source writes its three tables; the deployment mirrors two of them.
    seed_demo(broker, demo, hours=HOURS, changes_per_hour=40)
    specs = [s for s in demo if s.name in TABLES]
    keys = hour_keys(FIRST_HOUR, HOURS)

    tables = tmp_path / "tables.yaml"
    tables.write_text(yaml.safe_dump({"tables": [s.model_dump(mode="json") for s in specs]}))
    home = tmp_path / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text((REPO / "deploy/local/dagster.yaml").read_text())
    lake = LakeResource(root=str(tmp_path / "lake"))
    port = free_ports(1)[0]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CDC_", "DAGSTER_"))}
    env.update(
        {
            "DAGSTER_HOME": str(home),
            "CDC_TABLES_FILE": str(tables),
            "CDC_KAFKA_BOOTSTRAP_SERVERS": broker,
            "CDC_LAKE_ROOT": lake.root,
            # The worktree's modules, not an installed copy's.
            "PYTHONPATH": str(REPO),
        }
    )
    bin_dir = Path(sys.executable).parent
    workspace = ["-w", "workspace.yaml"]
    services = []
    try:
        services.append(
            start_service(
                "dagster-webserver",
                [
                    str(bin_dir / "dagster-webserver"),
                    *workspace,
                    "-h",
                    "127.0.0.1",
                    "-p",
                    str(port),
                ],
                env,
                tmp_path / "webserver.log",
                cwd=REPO,
            )
        )
        deadline = time.monotonic() + DEADLINE_S
        selector = {"repositoryName": "__repository__", "repositoryLocationName": "cdc_lake"}

        def sensors_listed():
            found = graphql(port, SENSORS, {"selector": selector})["sensorsOrError"]
            return bool(found and found.get("results"))

        wait_for(sensors_listed, what="the webserver", services=services, deadline=deadline)
        for sensor in graphql(port, SENSORS, {"selector": selector})["sensorsOrError"]["results"]:
            stopped = graphql(
                port,
                STOP_SENSOR,
                {"origin": sensor["jobOriginId"], "selector": sensor["sensorState"]["selectorId"]},
            )["stopSensor"]
            assert stopped["instigationState"]["status"] == "STOPPED", stopped
        services.append(
            start_service(
                "dagster-daemon",
                [str(bin_dir / "dagster-daemon"), "run", *workspace],
                env,
                tmp_path / "daemon.log",
                cwd=REPO,
            )
        )

        command = [
            sys.executable, "-m", "cdc_assets.backfill", "--from", keys[0], "--to", keys[-1],
            *(arg for table in TABLES for arg in ("--table", table)), "--port", str(port),
        ]  # fmt: skip
        done = subprocess.run(
            command,
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=DEADLINE_S,
        )
        logs = "".join(s.log.read_text(errors="replace")[-4000:] for s in services)
        assert done.returncode == 0, done.stdout + done.stderr + logs
        assert "COMPLETED_SUCCESS" in done.stdout, done.stdout

        for table in TABLES:
            materialized, _ = asset_status(port, table, keys)
            assert materialized == set(keys), (table, materialized)
        runs = graphql(port, RUNS)["runsOrError"]["results"]
        # Every run is the backfill's (the sensor was off); hours_per_run (24) holds both hours.
        assert runs and all(backfill.BACKFILL_TAG in r["tags"] for r in runs), runs
        assert all(r["status"] == "SUCCESS" for r in runs), runs
        assert len(runs) == 1, runs

        # An unknown table is refused before anything is launched.
        assert backfill.main(["--from", keys[0], "--to", keys[0], "--table", "nope", "--port",
                              str(port)]) == 2  # fmt: skip
        _refusals_say_why(port, keys, capsys)
    finally:
        for service in reversed(services):
            stop_service(service)

    for spec in specs:
        records = read_topic(broker, spec.topic)
        expected = replay(spec, [(p, o, v) for p, o, v, _ in records])
        assert mirror_rows(lake.table_path(spec.name), spec) == expected


def _refusals_say_why(port: int, keys: list[str], capsys) -> None:
    """Hours outside the tables' partitions and the open hour are refused before anything is
    launched, saying what to do; a run launched anyway (as a hand-made API call could) fails
    once, not retried, and the tools print its reason."""
    capsys.readouterr()
    now = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    current = now.strftime("%Y-%m-%d-%H:%M")
    future = (now + timedelta(hours=2)).strftime("%Y-%m-%d-%H:%M")
    before = (FIRST_HOUR - timedelta(hours=1)).strftime("%Y-%m-%d-%H:%M")
    cases = [  # backfill --from, --to, the hour ui_materialize is asked for, the reason
        (before, keys[0], before, f"{before} is before the first hour of table 'customers'"),
        (keys[0], future, future, f"{future} is in the future; the newest hour of table"),
        (current, current, current, f"hour {current} of table 'customers' is still open"),
    ]
    for first, last, hour, reason in cases:
        assert backfill.main(["--from", first, "--to", last, "--port", str(port)]) == 2
        assert reason in capsys.readouterr().err
        ui = ["--hour", hour, "--asset", "customers", "--port", str(port)]
        assert ui_materialize.main(ui) == 2
        assert reason in capsys.readouterr().err
    client = DagsterGraphQLClient("127.0.0.1", port_number=port)
    run_id, status, _ = ui_materialize.materialize(client, before, TABLES)
    assert status == "FAILURE"
    reason = Webserver("127.0.0.1", port).run_failure(run_id)
    assert reason is not None and f"hour {before} is before the tables' first hour" in reason
    assert "not retried" in reason and reason.count("is before") == 1, reason
    events = graphql(port, STEP_EVENTS, {"runId": run_id})["logsForRun"]["events"]
    kinds = [e["__typename"] for e in events]
    assert kinds.count("ExecutionStepFailureEvent") == 1, kinds
    assert "ExecutionStepUpForRetryEvent" not in kinds, kinds
