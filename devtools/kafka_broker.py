"""Single-node KRaft Kafka broker on loopback, for development, the demo and the tests.

The broker runs from the jars Maven resolves into ``.jars/kafka-broker`` (``mvn -q package``)
as a detached process, so it outlives the Python process that started it. Everything it owns
(config files, pid file, logs, Kafka data) lives in ``BrokerConfig.data_dir``.

Command line::

    python -m devtools.kafka_broker start|stop|status [--port N] [--data-dir PATH]
        [--sasl-ssl-port N]

``--port`` and ``--data-dir`` default to the environment variables ``CDC_KAFKA_PORT`` and
``CDC_KAFKA_DATA_DIR``, then to 19092 and ``<repo>/.local/kafka``.

With ``BrokerConfig.sasl_ssl_port`` (``--sasl-ssl-port``) the broker also has a SASL_SSL
listener: SCRAM-SHA-512 over TLS with a self-signed certificate for 127.0.0.1 made with
``keytool`` (clients trust ``BrokerConfig.ca_file``). Its one SCRAM user is
``BrokerConfig.scram_username``, with the password in the environment variable named by
``BrokerConfig.scram_password_env`` when the storage is formatted (the first start of a data
dir); the broker keeps only the salted SCRAM hash, no file holds the password. The PLAINTEXT
listener stays, for readiness probes and the tests' own admin and producer clients.
"""

from __future__ import annotations

import base64
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

from kafka import KafkaAdminClient
from kafka.errors import KafkaError

from devtools import cli, processes
from devtools.processes import HOST, port_free
from devtools.server import LocalServer, NotReady

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PORT = 19092
PORT_ENV = "CDC_KAFKA_PORT"
DATA_DIR_ENV = "CDC_KAFKA_DATA_DIR"
SCRAM_PASSWORD_ENV = "CDC_KAFKA_SCRAM_PASSWORD"
SCRAM_MECHANISM = "SCRAM-SHA-512"
# Protects a throwaway self-signed key that sits next to it in data_dir: not a secret.
_KEYSTORE_PASSWORD = "cdc-dev-keystore"
# What Kafka's --add-scram parser takes unquoted; secrets.token_urlsafe() passwords qualify.
_SCRAM_SAFE = re.compile(r"^[A-Za-z0-9_.~-]+$")
# A "\tkey = value" line of the config dump Kafka logs at startup.
_CONFIG_DUMP_LINE = re.compile(r"^\t[\w.-]+ = ")


@dataclass(frozen=True)
class BrokerConfig:
    """Where and how the local broker runs.

    Attributes:
        port: PLAINTEXT listener port on 127.0.0.1; clients bootstrap from it.
        controller_port: KRaft CONTROLLER listener port; None means ``port + 1``.
        data_dir: Holds the generated config, the pid file, the logs and the Kafka data.
        heap: JVM maximum heap (``-Xmx``), e.g. ``"512m"``.
        jars_dir: Directory whose jars form the broker classpath.
        extra: Additional ``server.properties`` entries as (key, value) pairs; they override
            the defaults. The PLAINTEXT listener on ``port`` must stay, as readiness is
            probed through it.
        sasl_ssl_port: Port of an additional SASL_SSL listener (SCRAM-SHA-512 over TLS);
            None: no such listener.
        scram_username: The SCRAM user created when the storage is formatted.
        scram_password_env: The environment variable holding that user's password; read
            only when the storage is formatted, so a restart keeps the first password.
    """

    port: int = DEFAULT_PORT
    controller_port: int | None = None
    data_dir: Path = REPO_ROOT / ".local" / "kafka"
    heap: str = "512m"
    jars_dir: Path = REPO_ROOT / ".jars" / "kafka-broker"
    extra: tuple[tuple[str, str], ...] = ()
    sasl_ssl_port: int | None = None
    scram_username: str = "cdc"
    scram_password_env: str = SCRAM_PASSWORD_ENV

    def __post_init__(self) -> None:
        # Absolute paths: the running broker is recognised by the properties path on its
        # command line, which must not depend on the caller's working directory.
        object.__setattr__(self, "data_dir", Path(self.data_dir).expanduser().resolve())
        object.__setattr__(self, "jars_dir", Path(self.jars_dir).expanduser().resolve())
        object.__setattr__(self, "extra", tuple((str(k), str(v)) for k, v in self.extra))
        ports = [self.port, self.effective_controller_port, self.sasl_ssl_port]
        ports = [port for port in ports if port is not None]
        if len(set(ports)) != len(ports):
            raise ValueError(f"port, controller_port and sasl_ssl_port must differ ({ports})")
        if not _SCRAM_SAFE.match(self.scram_username):
            raise ValueError(f"scram_username {self.scram_username!r}: use [A-Za-z0-9_.~-] only")

    @property
    def effective_controller_port(self) -> int:
        """The controller listener port, resolving the ``port + 1`` default."""
        # Resolved lazily rather than stored, so dataclasses.replace(config, port=...) moves
        # the default controller port along with the port.
        return self.port + 1 if self.controller_port is None else self.controller_port

    @property
    def bootstrap(self) -> str:
        """Bootstrap servers string for Kafka clients."""
        return f"{HOST}:{self.port}"

    @property
    def sasl_ssl_bootstrap(self) -> str | None:
        """Bootstrap servers of the SASL_SSL listener, None without one."""
        return None if self.sasl_ssl_port is None else f"{HOST}:{self.sasl_ssl_port}"

    @property
    def ca_file(self) -> Path:
        """PEM certificate clients of the SASL_SSL listener trust (it is self-signed)."""
        return self.data_dir / "tls" / "ca.pem"

    @property
    def keystore_file(self) -> Path:
        """The broker's PKCS12 keystore: its TLS key and self-signed certificate."""
        return self.data_dir / "tls" / "broker.p12"

    @property
    def pid_file(self) -> Path:
        """Pid file of the running broker."""
        return self.data_dir / "broker.pid"

    @property
    def log_file(self) -> Path:
        """The broker process's stdout and stderr (JVM-level failures land here)."""
        return self.data_dir / "broker.log"

    @property
    def server_log(self) -> Path:
        """Kafka's own log4j log."""
        return self.data_dir / "logs" / "server.log"

    @property
    def properties_file(self) -> Path:
        """The generated ``server.properties``."""
        return self.data_dir / "server.properties"


def server_properties(config: BrokerConfig) -> dict[str, str]:
    """Return the broker settings for ``config``, ``config.extra`` applied last."""
    port, controller_port = config.port, config.effective_controller_port
    props = {
        "process.roles": "broker,controller",
        "node.id": "1",
        "controller.quorum.voters": f"1@{HOST}:{controller_port}",
        "listeners": f"PLAINTEXT://{HOST}:{port},CONTROLLER://{HOST}:{controller_port}",
        "advertised.listeners": f"PLAINTEXT://{HOST}:{port}",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "inter.broker.listener.name": "PLAINTEXT",
        "controller.listener.names": "CONTROLLER",
        "log.dirs": str(_kafka_data_dir(config)),
        "num.partitions": "3",
        "offsets.topic.replication.factor": "1",
        "transaction.state.log.replication.factor": "1",
        "transaction.state.log.min.isr": "1",
        "group.initial.rebalance.delay.ms": "0",
        # Topics are declared explicitly, so a typo fails instead of creating a topic.
        "auto.create.topics.enable": "false",
        # The demo and the tests produce events with old CreateTime timestamps; time-based
        # retention would delete them as soon as their segment rolls.
        "log.retention.ms": "-1",
        "log.message.timestamp.type": "CreateTime",
        # A development box, not a production broker: fewer threads, and a 32 MiB instead of
        # a 128 MiB log-cleaner buffer (compacted __consumer_offsets) so 512m of heap is ample.
        "num.network.threads": "2",
        "num.io.threads": "4",
        "num.recovery.threads.per.data.dir": "1",
        "log.cleaner.dedupe.buffer.size": str(32 * 1024 * 1024),
    }
    if config.sasl_ssl_port is not None:
        sasl = f"SASL_SSL://{HOST}:{config.sasl_ssl_port}"
        prefix = f"listener.name.sasl_ssl.{SCRAM_MECHANISM.lower()}"
        props |= {
            "listeners": f"{props['listeners']},{sasl}",
            "advertised.listeners": f"{props['advertised.listeners']},{sasl}",
            "listener.security.protocol.map": (
                f"{props['listener.security.protocol.map']},SASL_SSL:SASL_SSL"
            ),
            "sasl.enabled.mechanisms": SCRAM_MECHANISM,
            # Server side only: the broker checks clients against the SCRAM credentials in
            # its metadata, it logs in to nobody, so the JAAS entry holds no password.
            f"{prefix}.sasl.jaas.config": (
                "org.apache.kafka.common.security.scram.ScramLoginModule required;"
            ),
            "listener.name.sasl_ssl.ssl.keystore.type": "PKCS12",
            "listener.name.sasl_ssl.ssl.keystore.location": str(config.keystore_file),
            "listener.name.sasl_ssl.ssl.keystore.password": _KEYSTORE_PASSWORD,
            "listener.name.sasl_ssl.ssl.key.password": _KEYSTORE_PASSWORD,
        }
    props.update(config.extra)
    return props


def start(config: BrokerConfig, timeout_s: float = 60) -> str:
    """Start the broker unless it already runs, and wait until it answers.

    Args:
        config: Which broker.
        timeout_s: How long to wait for the broker to answer.

    Returns:
        The bootstrap servers, ``"127.0.0.1:<port>"``.

    Raises:
        RuntimeError: A port is taken, Java or the jars are missing, formatting failed, or the
            broker died or did not answer in time (the message quotes its logs).
    """
    server = _server(config)
    expected = _render_properties(server_properties(config))
    server.start(
        timeout_s, lambda: _launch(config, server), settings=(config.properties_file, expected)
    )
    return config.bootstrap


def stop(config: BrokerConfig, timeout_s: float = 30) -> bool:
    """Stop the broker: SIGTERM (controlled shutdown), then SIGKILL after ``timeout_s``.

    Returns:
        Whether a broker was running.
    """
    return _server(config).stop(timeout_s)


def status(config: BrokerConfig) -> dict[str, object]:
    """Describe the broker of ``config.data_dir`` without changing anything.

    Returns:
        ``running``, ``pid`` (None when not running), ``bootstrap``, ``data_dir``,
        ``log_file`` (process output) and ``server_log`` (Kafka's log).
    """
    return _server(config).status(
        bootstrap=config.bootstrap,
        # SASL_SSL (SCRAM over TLS) when the broker listens with it: its address, user and CA.
        **(
            {
                "sasl_ssl_bootstrap": config.sasl_ssl_bootstrap,
                "sasl_username": config.scram_username,
                "ca_file": str(config.ca_file),
            }
            if config.sasl_ssl_bootstrap
            else {}
        ),
        data_dir=str(config.data_dir),
        log_file=str(config.log_file),
        server_log=str(config.server_log),
    )


def _server(config: BrokerConfig) -> LocalServer:
    """The broker as a local server: recognised by its properties file, ready once it serves
    metadata requests."""
    return LocalServer(
        title="Kafka broker",
        module="devtools.kafka_broker",
        data_dir=config.data_dir,
        pid_file=config.pid_file,
        log_file=config.log_file,
        identifies=lambda args: "kafka.Kafka" in args and str(config.properties_file) in args,
        probe=lambda timeout_s: _probe(config.bootstrap, timeout_s),
        awaits=f"answer on {config.bootstrap}",
        logs=(config.log_file, config.server_log),
        # The config dump (hundreds of lines) would crowd the actual error out of the tail.
        log_skip=_CONFIG_DUMP_LINE,
        append_log=False,
    )


def _launch(config: BrokerConfig, server: LocalServer) -> int:
    """Checks the ports, writes the configs, formats the storage and launches the broker."""
    _check_ports_free(config)
    java = processes.java()
    classpath = _classpath(config)
    if config.sasl_ssl_port is not None:
        _make_certificate(config, java)
    _write_configs(config)
    _format_storage(config, java, classpath)
    heap = _jvm_options(config, config.heap)
    return server.launch(
        [java, *heap, "-cp", classpath, "kafka.Kafka", str(config.properties_file)]
    )


def _kafka_data_dir(config: BrokerConfig) -> Path:
    return config.data_dir / "kraft-data"


def _log4j_file(config: BrokerConfig) -> Path:
    return config.data_dir / "log4j.properties"


def _check_ports_free(config: BrokerConfig) -> None:
    ports = [(config.port, "PLAINTEXT"), (config.effective_controller_port, "CONTROLLER")]
    if config.sasl_ssl_port is not None:
        ports.append((config.sasl_ssl_port, "SASL_SSL"))
    for port, listener in ports:
        if not port_free(port):
            raise RuntimeError(_port_taken_message(port, listener))


def _port_taken_message(port: int, listener: str) -> str:
    return (
        f"Port {port} on {HOST} (the Kafka {listener} listener) is already in use by another "
        f"process. Choose another port with `python -m devtools.kafka_broker start --port N` "
        f"or the environment variable {PORT_ENV}=N (the controller listener uses N+1), "
        f"or BrokerConfig(port=N) from Python."
    )


def _classpath(config: BrokerConfig) -> str:
    if not any(config.jars_dir.glob("kafka_*.jar")):
        raise RuntimeError(
            f"No Kafka broker jars in {config.jars_dir}; resolve them with `mvn -q package` "
            f"in {REPO_ROOT}."
        )
    # The JVM expands the wildcard itself.
    return str(config.jars_dir / "*")


def _escape_property(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _render_properties(props: dict[str, str]) -> str:
    lines = ["# Generated by devtools/kafka_broker.py; rewritten on every start."]
    for raw_key, value in props.items():
        key = _escape_property(raw_key)
        for char in "=: ":
            key = key.replace(char, "\\" + char)
        lines.append(f"{key}={_escape_property(value)}")
    return "\n".join(lines) + "\n"


def _log4j_properties(config: BrokerConfig) -> dict[str, str]:
    logs = config.server_log.parent
    props = {"log4j.rootLogger": "INFO, server"}

    def appender(name: str, file_name: str) -> None:
        # Size-capped files: a long-lived dev broker must not fill the disk with logs.
        prefix = f"log4j.appender.{name}"
        props[prefix] = "org.apache.log4j.RollingFileAppender"
        props[f"{prefix}.File"] = str(logs / file_name)
        props[f"{prefix}.MaxFileSize"] = "20MB"
        props[f"{prefix}.MaxBackupIndex"] = "2"
        props[f"{prefix}.layout"] = "org.apache.log4j.PatternLayout"
        props[f"{prefix}.layout.ConversionPattern"] = "[%d] %p %m (%c)%n"

    appender("server", "server.log")
    appender("stateChange", "state-change.log")
    appender("controller", "controller.log")
    # Split off like in Kafka's distribution, so server.log stays readable.
    for logger, name, level in [
        ("state.change.logger", "stateChange", "INFO"),
        ("kafka.controller", "controller", "INFO"),
        ("org.apache.kafka.controller", "controller", "INFO"),
    ]:
        props[f"log4j.logger.{logger}"] = f"{level}, {name}"
        props[f"log4j.additivity.{logger}"] = "false"
    props["log4j.logger.kafka.request.logger"] = "WARN"
    return props


def _write_configs(config: BrokerConfig) -> None:
    config.server_log.parent.mkdir(parents=True, exist_ok=True)
    config.properties_file.write_text(_render_properties(server_properties(config)))
    _log4j_file(config).write_text(_render_properties(_log4j_properties(config)))


def _jvm_options(config: BrokerConfig, heap: str) -> list[str]:
    return [
        f"-Xmx{heap}",
        "-XX:+UseG1GC",
        "-XX:MaxGCPauseMillis=20",
        "-XX:+ExitOnOutOfMemoryError",
        "-Djava.awt.headless=true",
        f"-Dlog4j.configuration={_log4j_file(config).as_uri()}",
    ]


def _cluster_id(config: BrokerConfig) -> str:
    id_file = config.data_dir / "cluster.id"
    if id_file.is_file():
        return id_file.read_text().strip()
    # Kafka's Uuid string form: URL-safe base64 of 16 bytes without padding. Like Kafka's
    # Uuid.randomUuid, avoid a leading "-": a command line would take such an id for an option.
    cluster_id = "-"
    while cluster_id.startswith("-"):
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
    id_file.write_text(cluster_id + "\n")
    return cluster_id


def _make_certificate(config: BrokerConfig, java: str) -> None:
    """A self-signed certificate for 127.0.0.1, once per data dir, with keytool."""
    if config.keystore_file.is_file() and config.ca_file.is_file():
        return
    keytool = str(Path(java).resolve().parent / "keytool")
    if not Path(keytool).is_file():
        keytool = shutil.which("keytool") or "keytool"
    config.ca_file.parent.mkdir(parents=True, exist_ok=True)
    config.keystore_file.unlink(missing_ok=True)
    store = ["-keystore", str(config.keystore_file), "-storepass", _KEYSTORE_PASSWORD]
    for command in (
        [
            "-genkeypair",
            "-alias",
            "broker",
            "-keyalg",
            "EC",
            "-groupname",
            "secp256r1",
            "-validity",
            "3650",
            "-dname",
            f"CN={HOST}",
            "-ext",
            f"SAN=ip:{HOST},dns:localhost",
            "-storetype",
            "PKCS12",
            "-keypass",
            _KEYSTORE_PASSWORD,
        ],
        ["-exportcert", "-rfc", "-alias", "broker", "-file", str(config.ca_file)],
    ):
        try:
            result = subprocess.run(
                [keytool, *command, *store],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
        except OSError as exc:
            raise RuntimeError(f"keytool (part of Java) could not run: {exc}") from exc
        if result.returncode != 0:
            raise RuntimeError(
                f"keytool {command[0]} failed (exit {result.returncode}):\n"
                f"{result.stdout}{result.stderr}"
            )


def _scram_argument(config: BrokerConfig) -> str:
    password = os.environ.get(config.scram_password_env)
    if not password:
        raise RuntimeError(
            f"The SASL_SSL listener needs the SCRAM password of user "
            f"'{config.scram_username}' in the environment variable "
            f"{config.scram_password_env}."
        )
    if not _SCRAM_SAFE.match(password):
        raise RuntimeError(
            f"The password in {config.scram_password_env} may only contain [A-Za-z0-9_.~-] "
            "(e.g. secrets.token_urlsafe())."
        )
    return f"{SCRAM_MECHANISM}=[name={config.scram_username},password={password}]"


def _format_storage(config: BrokerConfig, java: str, classpath: str) -> None:
    """Format the KRaft storage once; a formatted log dir has meta.properties."""
    if (_kafka_data_dir(config) / "meta.properties").is_file():
        return
    # The SCRAM user goes into the bootstrap metadata: the broker stores its salted hash.
    scram = [] if config.sasl_ssl_port is None else [f"--add-scram={_scram_argument(config)}"]
    # Static controller.quorum.voters: Kafka 3.9 refuses --standalone/--initial-controllers
    # with it, so plain `format -t -c` is the right call.
    command = [
        java,
        *_jvm_options(config, "256m"),
        "-cp",
        classpath,
        "kafka.tools.StorageTool",
        "format",
        # The --opt=value form keeps argparse4j from reading a value as an option.
        f"--cluster-id={_cluster_id(config)}",
        f"--config={config.properties_file}",
        "--ignore-formatted",
        *scram,
    ]
    try:
        result = subprocess.run(
            command,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    except subprocess.TimeoutExpired:
        # Its message would quote the command line, the SCRAM argument included.
        raise RuntimeError(
            f"Formatting the KRaft storage in {_kafka_data_dir(config)} took over 120 s"
        ) from None
    if result.returncode != 0:
        output = f"{result.stdout}{result.stderr}"
        if scram:
            output = output.replace(os.environ[config.scram_password_env], "***")
        raise RuntimeError(
            f"Formatting the KRaft storage in {_kafka_data_dir(config)} failed "
            f"(exit {result.returncode}):\n{output}{_server(config).log_report()}"
        )


class _ProbeAdminClient(KafkaAdminClient):
    """KafkaAdminClient that does not leak its IO thread when bootstrapping fails."""

    def __init__(self, **configs: object) -> None:
        try:
            super().__init__(**configs)
        except BaseException:
            # kafka-python starts its IO thread before bootstrapping and leaves it running
            # when the bootstrap fails; a readiness poll would pile up such threads.
            if hasattr(self, "_net"):
                self._closed = False
                self.close()
            raise


def _probe(bootstrap: str, timeout_s: float) -> None:
    if not _answers(bootstrap, timeout_s):
        raise NotReady()


def _answers(bootstrap: str, timeout_s: float) -> bool:
    """Whether the broker serves metadata requests, not merely accepts connections."""
    host, port = bootstrap.rsplit(":", 1)
    try:
        # Cheap pre-check: a refused connection needs no Kafka client round.
        with socket.create_connection((host, int(port)), timeout=min(timeout_s, 1.0)):
            pass
    except OSError:
        return False
    timeout_ms = max(int(timeout_s * 1000), 100)
    try:
        admin = _ProbeAdminClient(
            bootstrap_servers=bootstrap,
            client_id="devtools-kafka-broker-probe",
            bootstrap_timeout_ms=timeout_ms,
            request_timeout_ms=timeout_ms,
        )
    except KafkaError:
        return False
    try:
        admin.list_topics()
    except KafkaError:
        return False
    finally:
        admin.close()
    return True


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (`devtools.cli`)."""
    # The readiness probe's connection errors are expected while the broker boots.
    logging.getLogger("kafka").setLevel(logging.CRITICAL)
    return cli.run(
        argv,
        prog="python -m devtools.kafka_broker",
        description="Run the local single-node KRaft Kafka broker.",
        options=[
            cli.Option(
                "--port",
                type=int,
                default=DEFAULT_PORT,
                env=PORT_ENV,
                help="PLAINTEXT port; the controller uses port+1",
            ),
            cli.Option(
                "--data-dir",
                type=Path,
                default=BrokerConfig.data_dir,
                env=DATA_DIR_ENV,
                help="broker state directory",
            ),
            cli.Option(
                "--sasl-ssl-port",
                type=int,
                help=(
                    f"also listen with SASL_SSL ({SCRAM_MECHANISM} over TLS, self-signed) on "
                    f"this port; user 'cdc', password from env {SCRAM_PASSWORD_ENV}"
                ),
            ),
        ],
        make_config=lambda args: BrokerConfig(
            port=args.port, data_dir=Path(args.data_dir), sasl_ssl_port=args.sasl_ssl_port
        ),
        start=lambda config, timeout: start(config, 60 if timeout is None else timeout),
        stop=lambda config, timeout: stop(config, 30 if timeout is None else timeout),
        status=status,
    )


if __name__ == "__main__":
    sys.exit(main())
