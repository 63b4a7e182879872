"""A Kafka Connect worker on loopback running Debezium's connectors, for the demo and the tests.

One worker in distributed mode (its connectors' configs, offsets and status live in Kafka topics
of its own, so a restarted worker resumes its connectors where they committed), run from
`.jars/connect/` with Debezium's Postgres and MariaDB connectors as plugins
(`.jars/connect-plugins/`, resolved by `mvn package` from the pom). The worker's converters are
Kafka Connect's defaults: JSON, with the schema in every record (`schemas.enable=true`); a
connector may override them (`connector_settings(..., schemas=False)`).

Secrets: a connector's database password is never in its config; the config names an
environment variable (`${env:NAME}`, Kafka's EnvVarConfigProvider) that the worker was started
with (`ConnectConfig.secrets`), so it is on no command line, in no file and in no REST answer.

The clock: the pipeline slices Kafka by the records' timestamps, which the worker stamps from
its own wall clock (Debezium's processing time). With `fake_clock`,
a producer interceptor of ours (`jvm/connect-clock`, built by scripts/install.sh) stamps each
record with the wall clock plus the offset `ConnectConfig.clock_file` holds, and `set_clock`
moves it: the demo seeds past hours and the tests make changes in several closed hours this
way, with the real database, connector and broker. Only the stamps move; the worker's own clock
stays real. (It ran under libfaketime before: the JVM's timed waits then returned at once and
its idle threads spun over a core for as long as it ran.)

Command line::

    python -m devtools.kafka_connect start --bootstrap 127.0.0.1:19092 [--port 18083]
        [--data-dir PATH]
    python -m devtools.kafka_connect stop|status [--data-dir PATH]
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from devtools import cli
from devtools.processes import HOST, java, port_free
from devtools.server import LocalServer, NotReady

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PORT = 18083
DEFAULT_DATA_DIR = REPO_ROOT / ".local" / "connect"
CLOCK_JARS = REPO_ROOT / ".jars" / "connect-clock"
CLOCK_INTERCEPTOR = "io.cdclake.connect.ShiftedClockInterceptor"
# The interceptor reads the clock file again at most this often (seconds).
_CLOCK_REFRESH_S = 0.2
_ENV_PROVIDER = "org.apache.kafka.common.config.provider.EnvVarConfigProvider"


class ConnectError(RuntimeError):
    """The worker or a connector failed; the message says what and quotes the logs or trace."""


@dataclass(frozen=True)
class ConnectConfig:
    """Where and how the local Kafka Connect worker runs.

    Attributes:
        bootstrap: The Kafka cluster the worker reads and writes.
        port: The REST API's port on 127.0.0.1.
        data_dir: The generated config, pid file, logs (and the clock file).
        heap: JVM maximum heap.
        secrets: Environment variables the worker gets (names → values), for `${env:NAME}` in
            connector configs; never written to a file or a command line.
        fake_clock: Stamp records by a settable clock (see `set_clock`).
    """

    bootstrap: str
    port: int = DEFAULT_PORT
    data_dir: Path = DEFAULT_DATA_DIR
    heap: str = "384m"
    secrets: Mapping[str, str] = field(default_factory=dict, repr=False, compare=False)
    fake_clock: bool = False
    jars_dir: Path = REPO_ROOT / ".jars" / "connect"
    plugins_dir: Path = REPO_ROOT / ".jars" / "connect-plugins"

    def __post_init__(self) -> None:
        object.__setattr__(self, "data_dir", Path(self.data_dir).expanduser().resolve())

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def properties_file(self) -> Path:
        return self.data_dir / "worker.properties"

    @property
    def pid_file(self) -> Path:
        return self.data_dir / "worker.pid"

    @property
    def log_file(self) -> Path:
        """The worker's output: its log, and any start-up failure."""
        return self.data_dir / "worker.log"

    @property
    def clock_file(self) -> Path:
        return self.data_dir / "clock"

    @property
    def group_id(self) -> str:
        """The worker group and the prefix of its topics: one per data dir."""
        digest = hashlib.sha1(str(self.data_dir).encode()).hexdigest()[:10]
        return f"cdc-lake-connect-{digest}"


def worker_properties(config: ConnectConfig) -> dict[str, str]:
    group = config.group_id
    return {
        "bootstrap.servers": config.bootstrap,
        "group.id": group,
        "listeners": f"http://{HOST}:{config.port}",
        "rest.advertised.host.name": HOST,
        "rest.advertised.port": str(config.port),
        # Kafka Connect's own defaults, stated: JSON with the schema in each record.
        "key.converter": "org.apache.kafka.connect.json.JsonConverter",
        "value.converter": "org.apache.kafka.connect.json.JsonConverter",
        "config.storage.topic": f"_{group}-configs",
        "offset.storage.topic": f"_{group}-offsets",
        "status.storage.topic": f"_{group}-status",
        "config.storage.replication.factor": "1",
        "offset.storage.replication.factor": "1",
        "status.storage.replication.factor": "1",
        "offset.storage.partitions": "1",
        "status.storage.partitions": "1",
        # Offsets committed every second: a restart re-sends little (Debezium is at least once).
        "offset.flush.interval.ms": "1000",
        # One worker: a restarted worker takes its connectors back at once.
        "scheduled.rebalance.max.delay.ms": "0",
        # Each folder under it is one plugin, loaded in isolation; found through the plugins'
        # service manifests rather than by scanning every class (seconds faster to start).
        "plugin.path": str(config.plugins_dir),
        "plugin.discovery": "service_load",
        "config.providers": "env",
        "config.providers.env.class": _ENV_PROVIDER,
        # Connectors may set the partitions of the table topics they create.
        "topic.creation.enable": "true",
        # The records' timestamps by the settable clock (see the module doc).
        **({"producer.interceptor.classes": CLOCK_INTERCEPTOR} if config.fake_clock else {}),
    }


def _log4j(config: ConnectConfig) -> str:
    return "\n".join(
        [
            "log4j.rootLogger=INFO, file",
            "log4j.appender.file=org.apache.log4j.FileAppender",
            f"log4j.appender.file.File={config.data_dir / 'connect.log'}",
            "log4j.appender.file.layout=org.apache.log4j.PatternLayout",
            "log4j.appender.file.layout.ConversionPattern=[%d] %p %m (%c)%n",
            "log4j.logger.org.reflections=ERROR",
            "log4j.logger.org.apache.kafka.clients=WARN",
        ]
    )


def start(config: ConnectConfig, timeout_s: float = 120) -> str:
    """Start the worker unless it runs, and wait until its REST API answers; returns its URL."""
    server = _server(config)
    server.start(timeout_s, lambda: _launch(config, server))
    return config.url


def stop(config: ConnectConfig, timeout_s: float = 30) -> bool:
    """Stop the worker (SIGTERM, then SIGKILL); returns whether one was running."""
    return _server(config).stop(timeout_s)


def kill(config: ConnectConfig) -> bool:
    """SIGKILL the worker (a crash: nothing is flushed); returns whether one was running."""
    return _server(config).kill()


def status(config: ConnectConfig) -> dict[str, object]:
    return _server(config).status(
        url=config.url,
        data_dir=str(config.data_dir),
        log_file=str(config.data_dir / "connect.log"),
    )


def set_clock(config: ConnectConfig, moment: datetime) -> None:
    """Moves the clock that stamps the worker's records to `moment` (it keeps ticking from there).

    Call it once the connector has published what it owes: a record is stamped when it is sent,
    so a change still on its way when the clock moves gets the new time.
    """
    if not config.fake_clock:
        raise ConnectError("set_clock needs a worker started with fake_clock=True")
    offset = moment.timestamp() - time.time()
    tmp = config.clock_file.with_suffix(".tmp")
    tmp.write_text(f"{offset:+.3f}s\n")
    tmp.replace(config.clock_file)
    time.sleep(_CLOCK_REFRESH_S * 2)  # the interceptor has read it again


# --- connectors ----------------------------------------------------------------------------------


def put_connector(config: ConnectConfig, name: str, settings: Mapping[str, str]) -> None:
    """Creates or replaces connector `name`, retrying while the worker rebalances."""
    _request(config, "PUT", f"/connectors/{name}/config", dict(settings), retry_s=60)


def delete_connector(config: ConnectConfig, name: str) -> None:
    with contextlib.suppress(ConnectError):
        _request(config, "DELETE", f"/connectors/{name}", None, retry_s=30)


def restart_connector(config: ConnectConfig, name: str) -> None:
    """Restarts the connector and its tasks (as an operator would; offsets are kept)."""
    _request(config, "POST", f"/connectors/{name}/restart?includeTasks=true&onlyFailed=false", None)


def connector_status(config: ConnectConfig, name: str) -> dict:
    return _request(config, "GET", f"/connectors/{name}/status", None)


def wait_running(config: ConnectConfig, name: str, timeout_s: float = 120) -> None:
    """Waits until the connector and all its tasks run; a failed one raises with its trace."""
    deadline = time.monotonic() + timeout_s
    last: dict = {}
    while time.monotonic() < deadline:
        with contextlib.suppress(ConnectError):
            last = connector_status(config, name)
            states = [last["connector"]["state"], *(t["state"] for t in last.get("tasks", []))]
            failed = [t for t in last.get("tasks", []) if t["state"] == "FAILED"]
            if last["connector"]["state"] == "FAILED" or failed:
                trace = (failed[0] if failed else last["connector"]).get("trace", "")
                raise ConnectError(f"connector {name} failed:\n{trace[:4000]}")
            if last.get("tasks") and all(state == "RUNNING" for state in states):
                return
        time.sleep(0.5)
    report = _server(config).log_report()
    raise ConnectError(
        f"connector {name} did not run within {timeout_s:g}s (status {last}){report}"
    )


def connector_settings(
    *,
    kind: str,
    topic_prefix: str,
    host: str,
    port: int,
    database: str,
    user: str,
    password_env: str,
    tables: list[str],
    schemas: bool = True,
    partitions: int = 3,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """A Debezium connector's config with the connector's defaults for everything but what it
    needs: where the database is, which tables, and the topics' name prefix.

    `kind`: "postgres" (pgoutput, through the publication devtools/postgres.py creates) or
    "mariadb" (schema history in a topic of its own). `schemas=False` sets the JSON converters'
    `schemas.enable=false`, the setting users turn off most. The table topics are created with
    `partitions` partitions.
    """
    settings = {
        "tasks.max": "1",
        "topic.prefix": topic_prefix,
        "database.hostname": host,
        "database.port": str(port),
        "database.user": user,
        "database.password": f"${{env:{password_env}}}",
        "topic.creation.default.partitions": str(partitions),
        "topic.creation.default.replication.factor": "1",
        # The table topics keep every record: the tests' hours are days in the past.
        "topic.creation.default.retention.ms": "-1",
    }
    if kind == "postgres":
        slot = "cdc_" + hashlib.sha1(topic_prefix.encode()).hexdigest()[:12]
        settings |= {
            "connector.class": "io.debezium.connector.postgresql.PostgresConnector",
            "plugin.name": "pgoutput",
            "database.dbname": database,
            "slot.name": slot,
            "table.include.list": ",".join(tables),
        }
    elif kind == "mariadb":
        server_id = 10_000 + int(hashlib.sha1(topic_prefix.encode()).hexdigest()[:6], 16) % 50_000
        settings |= {
            "connector.class": "io.debezium.connector.mariadb.MariaDbConnector",
            "database.server.id": str(server_id),
            "database.include.list": database,
            "table.include.list": ",".join(tables),
            "schema.history.internal.kafka.topic": f"_{topic_prefix}-schema-history",
            "schema.history.internal.kafka.bootstrap.servers": "${env:CDC_CONNECT_BOOTSTRAP}",
        }
    else:
        raise ValueError(f"kind {kind!r}: use 'postgres' or 'mariadb'")
    if not schemas:
        settings |= {
            "key.converter": "org.apache.kafka.connect.json.JsonConverter",
            "value.converter": "org.apache.kafka.connect.json.JsonConverter",
            "key.converter.schemas.enable": "false",
            "value.converter.schemas.enable": "false",
        }
    return settings | dict(extra or {})


def topic_sizes(bootstrap: str, topics: list[str]) -> dict[str, int]:
    """How many records each topic holds (0 for one that doesn't exist yet)."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    try:
        sizes = {}
        for topic in topics:
            tps = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or ()]
            starts, ends = consumer.beginning_offsets(tps), consumer.end_offsets(tps)
            sizes[topic] = sum(ends[tp] - starts[tp] for tp in tps)
        return sizes
    finally:
        consumer.close()


def wait_published(
    config: ConnectConfig, name: str, expected: Mapping[str, int], timeout_s: float = 120
) -> dict[str, int]:
    """Waits until each topic holds at least its expected records (the connector published
    every change made so far); raises with the connector's status when it doesn't in time."""
    deadline = time.monotonic() + timeout_s
    while True:
        sizes = topic_sizes(config.bootstrap, list(expected))
        if all(sizes[t] >= n for t, n in expected.items()):
            return sizes
        if time.monotonic() > deadline:
            raise ConnectError(
                f"connector {name} published {sizes}, expected at least {dict(expected)} "
                f"within {timeout_s:g}s; status {connector_status(config, name)}"
            )
        time.sleep(0.3)


# --- the process ---------------------------------------------------------------------------------


def _server(config: ConnectConfig) -> LocalServer:
    """The worker as a local server: recognised by its properties file, ready once its REST API
    answers."""
    return LocalServer(
        title="Kafka Connect worker",
        module="devtools.kafka_connect",
        data_dir=config.data_dir,
        pid_file=config.pid_file,
        log_file=config.log_file,
        identifies=lambda args: str(config.properties_file) in args,
        probe=lambda _timeout_s: _probe(config),
        awaits=f"answer on {config.url}",
        logs=(config.log_file, config.data_dir / "connect.log"),
        poll_s=0.3,
        error=ConnectError,
    )


def _launch(config: ConnectConfig, server: LocalServer) -> int:
    """Checks the port and the jars, writes the worker's configs and launches it."""
    if not port_free(config.port):
        raise ConnectError(
            f"Port {config.port} on {HOST} is already in use; choose another with --port N"
        )
    jars = _jars(config)
    config.properties_file.write_text(
        "\n".join(f"{k}={v}" for k, v in worker_properties(config).items()) + "\n"
    )
    (config.data_dir / "log4j.properties").write_text(_log4j(config) + "\n")
    if config.fake_clock and not config.clock_file.exists():
        config.clock_file.write_text("+0\n")
    command = [
        java(),
        f"-Xmx{config.heap}",
        "-Xms64m",
        "-XX:+UseSerialGC",
        "-XX:TieredStopAtLevel=1",
        "-Djava.awt.headless=true",
        f"-Dlog4j.configuration=file:{config.data_dir / 'log4j.properties'}",
        "-cp",
        ":".join(str(j) for j in jars),
        "org.apache.kafka.connect.cli.ConnectDistributed",
        str(config.properties_file),
    ]
    return server.launch(command, _environment(config))


def _jars(config: ConnectConfig) -> list[Path]:
    """The worker's class path: Kafka Connect's jars, and the shifted clock's with fake_clock."""
    jars = sorted(config.jars_dir.glob("*.jar"))
    if not jars or not any(config.plugins_dir.glob("*/debezium-core-*.jar")):
        raise ConnectError(
            f"Kafka Connect's jars ({config.jars_dir}) or Debezium's connectors "
            f"({config.plugins_dir}) are missing: run scripts/install.sh in {REPO_ROOT}."
        )
    if config.fake_clock:
        jars += sorted(CLOCK_JARS.glob("shifted-clock-*.jar"))[-1:]
        if not jars[-1].name.startswith("shifted-clock-"):
            raise ConnectError(
                f"The worker's shifted clock ({CLOCK_JARS}) is missing: run "
                f"scripts/install.sh in {REPO_ROOT}."
            )
    return jars


def _probe(config: ConnectConfig) -> None:
    try:
        with urllib.request.urlopen(f"{config.url}/connectors", timeout=5) as answer:
            if answer.status == 200:
                return
    except (urllib.error.URLError, OSError):
        pass
    raise NotReady()


def _environment(config: ConnectConfig) -> dict[str, str]:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "LANG": "C.UTF-8",
        "TZ": "UTC",
        "CDC_CONNECT_BOOTSTRAP": config.bootstrap,
        **config.secrets,
    }
    if os.environ.get("JAVA_HOME"):
        env["JAVA_HOME"] = os.environ["JAVA_HOME"]
    if config.fake_clock:
        env["CDC_CONNECT_CLOCK_FILE"] = str(config.clock_file)
    return env


def _request(
    config: ConnectConfig, method: str, path: str, body: object, retry_s: float = 0
) -> dict:
    data = None if body is None else json.dumps(body).encode()
    deadline = time.monotonic() + retry_s
    while True:
        request = urllib.request.Request(
            f"{config.url}{path}",
            data=data,
            method=method,
            headers={"Content-Type": "application/json", "Accept": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as answer:
                text = answer.read().decode()
                return json.loads(text) if text else {}
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")[:2000]
            # 409: the worker is rebalancing; 5xx while it joins its group.
            if (error.code == 409 or error.code >= 500) and time.monotonic() < deadline:
                time.sleep(0.5)
                continue
            raise ConnectError(f"{method} {path}: HTTP {error.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as error:
            if time.monotonic() < deadline:
                time.sleep(0.5)
                continue
            raise ConnectError(f"{method} {path}: {error}{_server(config).log_report()}") from None


def main(argv: list[str] | None = None) -> int:
    return cli.run(
        argv,
        prog="python -m devtools.kafka_connect",
        description="Run the local Kafka Connect worker with Debezium's connectors.",
        options=[
            cli.Option(
                "--bootstrap", help="the Kafka cluster (start)", env="CDC_KAFKA_BOOTSTRAP_SERVERS"
            ),
            cli.Option("--port", type=int, default=DEFAULT_PORT, env="CDC_CONNECT_PORT"),
            cli.Option(
                "--data-dir", type=Path, default=DEFAULT_DATA_DIR, env="CDC_CONNECT_DATA_DIR"
            ),
        ],
        make_config=lambda args: ConnectConfig(
            bootstrap=args.bootstrap or "", port=args.port, data_dir=args.data_dir
        ),
        start=lambda config, timeout: start(config, timeout or 120),
        stop=lambda config, timeout: stop(config, timeout or 30),
        status=status,
        errors=(ConnectError,),
    )


if __name__ == "__main__":
    sys.exit(main())
