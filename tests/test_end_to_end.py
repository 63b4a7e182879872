"""End to end, as production runs it: `dagster-webserver` and `dagster-daemon` as two services
on deploy/production/dagster.yaml, the instance in Debian's PostgreSQL 15 (from
.tools/postgresql, started here on a free port with a random password), the lake on S3 (moto's
server, signatures checked; the code location reaches it with the AWS variables only), seeded
demo topics on the real broker, and nobody clicking anything.

The offset sensors must find the closed hour and launch it through the queued run coordinator,
every hour's checks must pass, the automation sensor must then build the downstream assets, and
the mirrors must equal the plain-Python replay of the topics. Everything is read back through
the webserver's GraphQL API, as the UI reads it. Then the runs, events, sensor ticks, daemon
heartbeats and pools must be rows in Postgres, no SQLite file may exist under DAGSTER_HOME, and
neither the database password nor the S3 secret may appear in any file under DAGSTER_HOME, any
service or server log, or any stored run or event.

(`dagster dev` on deploy/local/dagster.yaml, the demo's instance, is the same webserver and
daemon on SQLite; tests/test_definitions.py loads that file.)
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import yaml
from kafka import KafkaAdminClient

from checks.daily import DAILY_CHECKS
from demo.produce import DEFAULT_TOPIC_CONFIGS, ensure_topics
from demo.reference import replay
from devtools import postgres
from tests.conftest import S3_KEY_ENV, S3_SECRET_ENV
from tests.dagster_ui import (
    RUNS,
    Service,
    asset_status,
    graphql,
    start_service,
    stop_service,
    wait_for,
)
from tests.support import demo_specs, free_ports, hour_keys, mirror_rows, read_topic, seed_demo

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]
HOURS = 1
DEADLINE_S = 900
SENSOR_TAG = {"key": "cdc/trigger", "value": "offset_sensor"}


@pytest.fixture(scope="module")
def pg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[postgres.PostgresConfig, str]]:
    """Debian's PostgreSQL on a free port, a database and role with a random password."""
    config = postgres.PostgresConfig(
        port=free_ports(1)[0],
        data_dir=tmp_path_factory.mktemp("postgres"),
        database="dagster_prod",
        username="dagster_app",
    )
    password = secrets.token_urlsafe(24)
    try:
        postgres.start(config, password)
        yield config, password
    finally:
        postgres.stop(config)


@pytest.fixture
def deployment(broker, pg, s3, spark, tmp_path):
    """The webserver and the daemon on the production instance, private topics, a lake on S3
    and a tables file; the seeded hours are the last closed ones, so the sensors have exactly
    these to run (every hour since a table's first message is materialized, empty ones too)."""
    config, password = pg
    first_hour = datetime.now(UTC).replace(minute=0, second=0, microsecond=0) - timedelta(
        hours=HOURS
    )
    prefix = f"e2e{os.getpid()}{int(time.time()) % 100000}"
    # Lateness 0: the last seeded hour closes at its end, whatever minute the test starts at.
    start = first_hour.strftime("%Y-%m-%d-%H:%M")
    specs = [
        s.model_copy(update={"start_hour": start, "allowed_lateness_minutes": 0})
        for s in demo_specs(prefix)
    ]
    # Topics that keep their records: the retention check would rightly warn about 7 days.
    admin = KafkaAdminClient(bootstrap_servers=broker)
    try:
        ensure_topics(
            admin,
            [s.topic for s in specs],
            partitions=3,
            configs={**DEFAULT_TOPIC_CONFIGS, "retention.ms": "-1"},
        )
    finally:
        admin.close()
    source, _ = seed_demo(broker, specs, hours=HOURS, changes_per_hour=60, first_hour=first_hour)

    tables = tmp_path / "tables.yaml"
    # The demo's tables with the demo's switch: order_facts and daily_sales are built.
    tables.write_text(
        yaml.safe_dump(
            {"shop_analytics": True, "tables": [s.model_dump(mode="json") for s in specs]}
        )
    )
    home = tmp_path / "dagster_home"
    home.mkdir()
    # The production instance file, with two changes: at most 2 runs at once (the test machine
    # has 2 cores, and 8 runs, each its own Spark driver, would only take turns on them), and
    # the queue looked at every second instead of every 5 (each of the test's three runs waited
    # 2.5 s on average to be dequeued).
    instance = (REPO / "deploy" / "production" / "dagster.yaml").read_text()
    assert "max_concurrent_runs: 8" in instance, "the production file's run limit moved"
    assert "dequeue_interval_seconds: 5" in instance, "the production file's dequeue moved"
    (home / "dagster.yaml").write_text(
        instance.replace("max_concurrent_runs: 8", "max_concurrent_runs: 2").replace(
            "dequeue_interval_seconds: 5", "dequeue_interval_seconds: 1"
        )
    )
    port = free_ports(1)[0]
    env = {key: value for key, value in os.environ.items() if not key.startswith(("AWS_", "CDC_"))}
    env.update(
        {
            "DAGSTER_HOME": str(home),
            "CDC_TABLES_FILE": str(tables),
            "CDC_KAFKA_BOOTSTRAP_SERVERS": broker,
            # The lake on S3, reached as a deployment reaches it: AWS's own variables, which
            # code_location/definitions.py hands to the lake's S3Resource (keys as dg.EnvVar).
            "CDC_LAKE_ROOT": f"s3://{s3.bucket}/{prefix}",
            "AWS_ACCESS_KEY_ID": os.environ[S3_KEY_ENV],
            "AWS_SECRET_ACCESS_KEY": os.environ[S3_SECRET_ENV],
            "AWS_ENDPOINT_URL_S3": s3.endpoint,
            "AWS_REGION": s3.region,
            "DAGSTER_PG_HOST": postgres.HOST,
            "DAGSTER_PG_PORT": str(config.port),
            "DAGSTER_PG_DB": config.database,
            "DAGSTER_PG_USERNAME": config.username,
            "DAGSTER_PG_PASSWORD": password,
        }
    )
    bin_dir = Path(sys.executable).parent
    workspace = ["-w", "workspace.yaml"]
    services: list[Service] = []
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
        services.append(
            start_service(
                "dagster-daemon",
                [str(bin_dir / "dagster-daemon"), "run", *workspace],
                env,
                tmp_path / "daemon.log",
                cwd=REPO,
            )
        )
        yield {
            "port": port,
            "broker": broker,
            "first_hour": first_hour,
            "specs": specs,
            "source": source,
            "lake": s3.reader(prefix, spark),
            "home": home,
            "services": services,
            "pg": config,
            "secrets": [password, os.environ[S3_SECRET_ENV]],
        }
    finally:
        for service in services:
            stop_service(service)


def test_the_sensors_materialize_every_closed_hour_and_its_downstream(deployment, spark):
    d = deployment
    port, specs = d["port"], d["specs"]
    keys = hour_keys(d["first_hour"], HOURS)
    deadline = time.monotonic() + DEADLINE_S
    state: dict = {}

    def sensor_runs() -> list[dict]:
        runs = graphql(port, RUNS)["runsOrError"]["results"]
        return [r for r in runs if SENSOR_TAG in r["tags"]]

    def mirrors_done():
        for spec in specs:
            materialized, checks = asset_status(port, spec.name, keys)
            state[spec.name] = (sorted(materialized), {k: len(v) for k, v in checks.items()})
            if materialized != set(keys):
                return state
            # Every check the hour's run evaluates passed on every hour (retention_risk runs
            # on its own and the daily checks on their schedule, neither in the sensor's runs;
            # schema_drift is a warning that the demo's deliberately mistyped records raise
            # whenever one lands in a column of a stricter kind, which depends on the hour the
            # test seeds).
            skipped = ("retention_risk", "schema_drift", *DAILY_CHECKS)
            if any(checks[name] != set(keys) for name in checks if name not in skipped):
                return state
        state["runs"] = [r["status"] for r in sensor_runs()]
        return all(status == "SUCCESS" for status in state["runs"]) or state

    services = d["services"]
    wait_for(
        mirrors_done,
        what="every seeded hour of every mirror, checks passed",
        services=services,
        deadline=deadline,
    )

    # The seeded hour was launched once, for every table in one run (the one offset sensor asks
    # for the tables whose same hours closed together): that hour alone, or a range starting
    # with it when the next hour closed before the first tick (the suite ran past the top of an
    # hour). An empty hour that closes while the test runs gets a run of its own.
    first = [
        {"key": "dagster/partition", "value": keys[0]},
        {"key": "dagster/asset_partition_range_start", "value": keys[0]},
    ]
    runs = [r for r in sensor_runs() if any(tag in r["tags"] for tag in first)]
    assert len(runs) == 1, [r["tags"] for r in sensor_runs()]
    assert {"key": "cdc/tables", "value": str(len(specs))} in runs[0]["tags"]

    days = sorted({key[:10] for key in keys})

    def downstream_done():
        facts, _ = asset_status(port, "order_facts", keys)
        daily, _ = asset_status(port, "daily_sales", days)
        state["downstream"] = (sorted(facts), sorted(daily))
        return (facts == set(keys) and daily == set(days)) or state

    wait_for(
        downstream_done,
        what="the downstream assets of the seeded hours",
        services=services,
        deadline=deadline,
    )

    # And the mirrors on S3 hold exactly what the topics say.
    lake = d["lake"]
    for spec in specs:
        records = read_topic(d["broker"], spec.topic)
        expected = replay(spec, [(p, o, v) for p, o, v, _ in records])
        assert mirror_rows(lake.table_path(spec.name), spec) == expected
        assert expected == d["source"].state(spec.name)

    _everything_lives_in_postgres(d, [r["runId"] for r in runs], keys[0])


def _everything_lives_in_postgres(d: dict, run_ids: list[str], hour: str) -> None:
    """What the UI showed are rows in Postgres; nothing in SQLite; no secret anywhere."""
    config, specs = d["pg"], d["specs"]
    connection = postgres.connect(config, d["secrets"][0])
    with contextlib.closing(connection), connection.cursor() as cursor:

        def one(query: str, *args):
            cursor.execute(query, args)
            return cursor.fetchone()[0]

        for run_id in run_ids:
            assert one("SELECT status FROM runs WHERE run_id = %s", run_id) == "SUCCESS"
            # Queued, then launched once by the daemon's run coordinator.
            events = {
                kind: one(
                    "SELECT count(*) FROM event_logs WHERE run_id = %s AND dagster_event_type = %s",
                    run_id,
                    kind,
                )
                for kind in ("PIPELINE_ENQUEUED", "PIPELINE_STARTING", "PIPELINE_SUCCESS")
            }
            assert events == dict.fromkeys(events, 1), events
        for spec in specs:
            materializations = one(
                "SELECT count(*) FROM event_logs WHERE dagster_event_type = 'ASSET_MATERIALIZATION'"
                " AND asset_key = %s AND partition = %s",
                f'["{spec.name}"]',
                hour,
            )
            assert materializations == 1, spec.name
        # The sensor's ticks (schedule storage): one sensor watches every table.
        ticks = one(
            "SELECT count(*) FROM job_ticks t JOIN jobs j ON t.job_origin_id = j.job_origin_id"
            " WHERE j.job_type = 'SENSOR' AND strpos(j.job_body, %s) > 0",
            '"cdc_offsets"',
        )
        assert ticks >= 1, "no tick of cdc_offsets in job_ticks"
        # The mirrors' pool, limit 1 (default_limit), is known to the instance.
        cursor.execute(
            'SELECT "limit" FROM concurrency_limits WHERE concurrency_key = %s', ("cdc_mirrors",)
        )
        assert cursor.fetchall() == [(1,)]
        cursor.execute("SELECT daemon_type FROM daemon_heartbeats")
        daemons = {row[0] for row in cursor.fetchall()}
        assert {"SENSOR", "QUEUED_RUN_COORDINATOR", "MONITORING"} <= daemons, daemons
        for secret in d["secrets"]:
            assert one("SELECT count(*) FROM runs WHERE strpos(run_body, %s) > 0", secret) == 0
            assert one("SELECT count(*) FROM event_logs WHERE strpos(event, %s) > 0", secret) == 0

    home: Path = d["home"]
    files = [path for path in home.rglob("*") if path.is_file()]
    sqlite = [path for path in files if path.read_bytes()[:16] == b"SQLite format 3\x00"]
    assert not sqlite, sqlite
    logs = [service.log for service in d["services"]] + [config.log_file]
    for secret in d["secrets"]:
        leaks = [path for path in files + logs if secret.encode() in path.read_bytes()]
        assert not leaks, leaks
