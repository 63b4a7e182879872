"""A Spark Connect server on loopback: one warm Spark driver that Dagster's runs use as clients.

pyspark's wheel is a whole Spark distribution with Spark Connect's server in it
(``jars/spark-connect_*.jar``): ``start(config)`` runs
``org.apache.spark.sql.connect.service.SparkConnectServer`` through its ``bin/spark-submit``, as
a detached process in its own process group, with the settings of the project's embedded
session (``resources.spark.SparkResource.spark_config``: the jars from ``.jars/``, Delta's SQL
extension and catalog, the S3A class path and log store, the class-data archive) and its Python
workers on this checkout's interpreter and package (the Spark-read decoder's ``mapInArrow``,
masking and sealing run there). It serves ``sc://127.0.0.1:<port>`` once the gRPC port accepts
connections; ``stop(config)`` ends it. Everything it owns (pid file, log, an empty
``SPARK_CONF_DIR``, Spark's scratch space) lives in ``ConnectConfig.data_dir``.

The server reads the project's code when it starts: after a deploy of new code, restart it, or
a run's Python workers use the old code.

Command line::

    python -m devtools.spark_connect start|stop|status [--port N] [--data-dir PATH]
        [--driver-memory SIZE]

``--port`` defaults to ``CDC_SPARK_CONNECT_PORT``, then to 15002 (Spark Connect's own default);
``--data-dir`` to ``<repo>/.local/spark-connect``.
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import pyspark

from devtools import cli, processes
from devtools.processes import HOST, port_free
from devtools.server import LocalServer, NotReady

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PORT = 15002
PORT_ENV = "CDC_SPARK_CONNECT_PORT"
SPARK_HOME = Path(pyspark.__file__).resolve().parent
SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"
# What makes pyspark a Connect client, left out of the server's environment.
_CLIENT_MODE = (
    "SPARK_REMOTE",
    "SPARK_CONNECT_MODE_ENABLED",
    "SPARK_LOCAL_REMOTE",
    "SPARK_API_MODE",
)


class SparkConnectError(RuntimeError):
    pass


@dataclass(frozen=True)
class ConnectConfig:
    """Where and how the local Spark Connect server runs.

    Attributes:
        port: The gRPC port; clients use ``sc://127.0.0.1:<port>``.
        data_dir: Holds the pid file, the server's log and Spark's scratch space.
        driver_memory: The server's heap: every run's queries share it.
    """

    port: int = DEFAULT_PORT
    data_dir: Path = REPO_ROOT / ".local" / "spark-connect"
    driver_memory: str = "2g"

    def __post_init__(self) -> None:
        object.__setattr__(self, "data_dir", Path(self.data_dir).expanduser().resolve())

    @property
    def remote(self) -> str:
        """What a client connects to (``SparkSession.builder.remote``)."""
        return f"sc://{HOST}:{self.port}"

    @property
    def log_file(self) -> Path:
        return self.data_dir / "server.log"

    @property
    def pid_file(self) -> Path:
        return self.data_dir / "server.pid"


def server_conf(config: ConnectConfig) -> dict[str, str]:
    """The server's Spark settings: the embedded session's (`SparkResource`), on a local master,
    with the gRPC endpoint on loopback. They hold no secret (they are the server's command
    line). No class-data archive: the archive is made for the embedded session's class path,
    which the server's (its own conf dir on it) is not, and the server starts once."""
    from resources.spark import SparkResource  # the session's settings are the resource's

    resource = SparkResource(
        app_name="cdc-spark-connect", driver_memory=config.driver_memory, jvm_archive_dir=None
    )
    return {
        **resource.spark_config(),
        "spark.master": "local[*]",
        "spark.connect.grpc.binding.address": HOST,
        "spark.connect.grpc.binding.port": str(config.port),
        "spark.local.dir": str(config.data_dir / "local"),
    }


def start(config: ConnectConfig, timeout_s: float = 120) -> str:
    """Start the server unless it runs, and wait until it accepts connections.

    Returns:
        The address clients connect to, ``sc://127.0.0.1:<port>``.

    Raises:
        SparkConnectError: The port is taken, Java is missing, or the server died or did not
            serve in time (the message quotes its log).
        SparkJarsMissingError: The project's jars were never resolved (scripts/install.sh).
    """
    server = _server(config)

    def launch() -> int:
        if not port_free(config.port):
            raise SparkConnectError(
                f"Port {config.port} on {HOST} is already in use by another process; choose "
                f"another (--port or {PORT_ENV})."
            )
        processes.java()
        for folder in (config.data_dir / "conf", config.data_dir / "local"):
            folder.mkdir(parents=True, exist_ok=True)
        return server.launch(_command(config), _env(config))

    server.start(timeout_s, launch)
    return config.remote


def stop(config: ConnectConfig, timeout_s: float = 30) -> bool:
    """Stop the server: SIGTERM, SIGKILL after ``timeout_s``. Returns whether it was running."""
    return _server(config).stop(timeout_s)


def status(config: ConnectConfig) -> dict[str, object]:
    """The server's pid (None when not running), its address, log and data dir."""
    return _server(config).status(
        remote=config.remote, log=str(config.log_file), data_dir=str(config.data_dir)
    )


def _command(config: ConnectConfig) -> list[str]:
    submit = SPARK_HOME / "bin" / "spark-submit"
    if not submit.is_file():
        raise SparkConnectError(f"{submit} is missing: is pyspark installed completely?")
    settings = [f"--conf={name}={value}" for name, value in server_conf(config).items()]
    return ["bash", str(submit), "--class", SERVER_CLASS, *settings]


def _env(config: ConnectConfig) -> dict[str, str]:
    # Not the caller's own settings (a test's S3 keys, the Kafka password) nor a Connect
    # client's mode: the server runs a local driver.
    inherited = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith("CDC_") and name not in _CLIENT_MODE
    }
    env = {
        **inherited,
        "SPARK_HOME": str(SPARK_HOME),
        # An empty conf dir: no spark-env.sh or spark-defaults.conf from anywhere else.
        "SPARK_CONF_DIR": str(config.data_dir / "conf"),
        "SPARK_LOCAL_IP": HOST,
        # The Python workers: this interpreter, with this checkout's package importable.
        "PYSPARK_PYTHON": sys.executable,
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p
        ),
    }
    return env


def _server(config: ConnectConfig) -> LocalServer:
    return LocalServer(
        title="Spark Connect server",
        module="devtools.spark_connect",
        data_dir=config.data_dir,
        pid_file=config.pid_file,
        log_file=config.log_file,
        identifies=lambda args: SERVER_CLASS in args and _binds(args, config.port),
        probe=lambda _timeout_s: _accepts(config),
        awaits=f"accept connections on {config.remote}",
        poll_s=0.5,
        whole_group=True,
        error=SparkConnectError,
    )


def _binds(args: list[str], port: int) -> bool:
    """Whether a command line sets the server's port to `port` (spark-submit's `--conf=k=v`, or
    `--conf k=v` as its launcher passes it on to the JVM)."""
    setting = f"spark.connect.grpc.binding.port={port}"
    return setting in args or f"--conf={setting}" in args


def _accepts(config: ConnectConfig) -> None:
    """Whether the gRPC port takes connections: the server binds it once its Spark driver has
    started."""
    try:
        with socket.create_connection((HOST, config.port), timeout=2):
            return
    except OSError as exc:
        raise NotReady(str(exc)) from None


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (`devtools.cli`)."""
    return cli.run(
        argv,
        prog="python -m devtools.spark_connect",
        description="Run a Spark Connect server (a warm Spark driver for the runs) on loopback.",
        options=[
            cli.Option("--port", type=int, default=DEFAULT_PORT, env=PORT_ENV),
            cli.Option("--data-dir", type=Path, default=ConnectConfig.data_dir),
            cli.Option("--driver-memory", default=ConnectConfig.driver_memory),
        ],
        make_config=lambda args: ConnectConfig(
            port=args.port, data_dir=args.data_dir, driver_memory=args.driver_memory
        ),
        start=lambda config, timeout: start(config, 120 if timeout is None else timeout),
        stop=lambda config, timeout: stop(config, 30 if timeout is None else timeout),
        status=status,
        errors=(SparkConnectError,),
    )


if __name__ == "__main__":
    sys.exit(main())
