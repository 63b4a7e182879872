"""A MariaDB server on loopback: the tests' MySQL-family change-data-capture source.

Debian bookworm's MariaDB 10.11, which ``scripts/install.sh`` unpacks into ``.tools/mariadb/``
with the libraries it links; nothing of a system MariaDB is used. The server writes a row-based
binary log with full row images (what Debezium's MariaDB connector reads) and runs detached,
with everything it owns (data, socket, log) in ``MariaDBConfig.data_dir``.

``start`` creates the data directory on the first run (``mariadb-install-db``), then a database
and a user owning it with the replication privileges Debezium needs, whose password is passed in
(never written to a file or a command line: it is set through the root account over the Unix
socket, which only the server's own user can open).

Command line (the password from ``CDC_MARIADB_PASSWORD``)::

    python -m devtools.mariadb start|stop|status [--port N] [--data-dir PATH]
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pymysql

from devtools import cli
from devtools.processes import HOST, port_free
from devtools.server import LocalServer, NotReady

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PORT = 13306
PASSWORD_ENV = "CDC_MARIADB_PASSWORD"


@dataclass(frozen=True)
class MariaDBConfig:
    """Where and how the local MariaDB server runs.

    Attributes:
        port: TCP port on 127.0.0.1.
        data_dir: The server's data (``data/``), socket, pid file and log.
        database: The database ``start`` creates.
        username: The user ``start`` creates: owns ``database``, may read the binary log.
        server_id: The server's id in the replication topology (the connector has its own).
    """

    port: int = DEFAULT_PORT
    data_dir: Path = REPO_ROOT / ".local" / "mariadb"
    database: str = "shop"
    username: str = "cdc"
    server_id: int = 1
    tools_dir: Path = REPO_ROOT / ".tools" / "mariadb"

    def __post_init__(self) -> None:
        object.__setattr__(self, "data_dir", Path(self.data_dir).expanduser().resolve())
        object.__setattr__(self, "tools_dir", Path(self.tools_dir).expanduser().resolve())
        for name in ("database", "username"):
            if not getattr(self, name).isidentifier():
                raise ValueError(f"{name} {getattr(self, name)!r}: use letters, digits, _")

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def socket_file(self) -> Path:
        return self.data_dir / "mariadb.sock"

    @property
    def pid_file(self) -> Path:
        return self.data_dir / "mariadb.pid"

    @property
    def log_file(self) -> Path:
        return self.data_dir / "mariadb.log"


def server_options(config: MariaDBConfig) -> list[str]:
    """The server's options: a row-based binary log with full images; little memory."""
    return [
        "--no-defaults",
        f"--basedir={config.tools_dir / 'usr'}",
        f"--datadir={config.data_dir / 'data'}",
        f"--lc-messages-dir={config.tools_dir / 'usr/share/mysql'}",
        f"--socket={config.socket_file}",
        f"--pid-file={config.pid_file}",
        f"--port={config.port}",
        f"--bind-address={HOST}",
        "--user=root",
        "--skip-name-resolve",
        f"--server-id={config.server_id}",
        "--log-bin=mariadb-bin",
        "--binlog-format=ROW",
        "--binlog-row-image=FULL",
        "--innodb-buffer-pool-size=32M",
        "--innodb-log-file-size=16M",
        "--key-buffer-size=1M",
        "--performance-schema=OFF",
        "--max-connections=60",
        "--default-time-zone=+00:00",
        "--character-set-server=utf8mb4",
        "--collation-server=utf8mb4_general_ci",
    ]


def start(config: MariaDBConfig, password: str, timeout_s: float = 60) -> str:
    """Start the server unless it runs, create the database and user; returns host:port."""
    if not password:
        raise RuntimeError(f"No password given for the user {config.username!r}.")
    binary = config.tools_dir / "usr/sbin/mariadbd"
    if not binary.is_file():
        raise RuntimeError(
            f"MariaDB's server is missing ({binary}): run scripts/install.sh in {REPO_ROOT}."
        )
    server = _server(config)
    server.start(
        timeout_s,
        lambda: _launch(config, server),
        then=lambda: _create_user_and_database(config, password),
    )
    return config.address


def stop(config: MariaDBConfig, timeout_s: float = 30) -> bool:
    return _server(config).stop(timeout_s)


def status(config: MariaDBConfig) -> dict[str, object]:
    return _server(config).status(
        address=config.address,
        database=config.database,
        username=config.username,
        data_dir=str(config.data_dir),
        log_file=str(config.log_file),
    )


def connect(config: MariaDBConfig, password: str, **kwargs: object) -> pymysql.Connection:
    """A connection to ``config.database`` as ``config.username`` over TCP."""
    return pymysql.connect(
        host=HOST,
        port=config.port,
        user=config.username,
        password=password,
        database=config.database,
        connect_timeout=10,
        autocommit=True,
        **kwargs,
    )


def _server(config: MariaDBConfig) -> LocalServer:
    """The server as a local server: it writes its own pid file; it is recognised by its data
    dir and ready once root connects through the socket."""
    datadir = f"--datadir={config.data_dir / 'data'}"
    return LocalServer(
        title="MariaDB server",
        module="devtools.mariadb",
        data_dir=config.data_dir,
        pid_file=config.pid_file,
        log_file=config.log_file,
        identifies=lambda args: datadir in args,
        probe=lambda _timeout_s: _probe(config),
        awaits="accept connections",
        owns_pid_file=False,
        stop_signals=((signal.SIGTERM, False), (signal.SIGKILL, False)),
    )


def _launch(config: MariaDBConfig, server: LocalServer) -> int:
    """Checks the port, creates the data directory once and launches the server."""
    if not port_free(config.port):
        raise RuntimeError(f"Port {config.port} on {HOST} is already in use.")
    _install_db(config)
    command = [str(config.tools_dir / "usr/sbin/mariadbd"), *server_options(config)]
    return server.launch(command, _environment(config))


def _probe(config: MariaDBConfig) -> None:
    try:
        _root(config).close()
    except pymysql.err.OperationalError as exc:
        raise NotReady(str(exc)) from None


def _environment(config: MariaDBConfig) -> dict[str, str]:
    libs = [
        *config.tools_dir.glob("lib/*-linux-gnu*"),
        *config.tools_dir.glob("usr/lib/*-linux-gnu*"),
    ]
    return {
        "PATH": f"{config.tools_dir / 'usr/bin'}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        "LD_LIBRARY_PATH": ":".join(str(d) for d in sorted(libs)),
        "LC_ALL": "C",
        "TZ": "UTC",
    }


def _install_db(config: MariaDBConfig) -> None:
    data = config.data_dir / "data"
    if (data / "mysql").is_dir():
        return
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir(parents=True)
    command = [
        str(config.tools_dir / "usr/bin/mariadb-install-db"),
        f"--basedir={config.tools_dir / 'usr'}",
        f"--datadir={data}",
        "--user=root",
        "--auth-root-authentication-method=socket",
        "--skip-test-db",
        "--skip-name-resolve",
    ]
    result = subprocess.run(
        command,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        env=_environment(config),
        timeout=180,
        check=False,
    )
    if result.returncode != 0:
        shutil.rmtree(data, ignore_errors=True)
        raise RuntimeError(
            f"mariadb-install-db of {data} failed (exit {result.returncode}):\n"
            f"{result.stdout[-3000:]}{result.stderr[-3000:]}"
        )


def _root(config: MariaDBConfig) -> pymysql.Connection:
    return pymysql.connect(unix_socket=str(config.socket_file), user="root", autocommit=True)


def _create_user_and_database(config: MariaDBConfig, password: str) -> None:
    connection = _root(config)
    try:
        with connection.cursor() as cursor:
            cursor.execute(f"CREATE DATABASE IF NOT EXISTS `{config.database}`")
            # The password is a bound parameter, so it is in no statement text or log.
            cursor.execute(
                f"CREATE USER IF NOT EXISTS '{config.username}'@'%%' IDENTIFIED BY %s", (password,)
            )
            cursor.execute(f"ALTER USER '{config.username}'@'%%' IDENTIFIED BY %s", (password,))
            cursor.execute(
                f"GRANT ALL PRIVILEGES ON `{config.database}`.* TO '{config.username}'@'%'"
            )
            # What Debezium's connector reads: the binary log, and the schema of every table.
            cursor.execute(
                "GRANT SELECT, RELOAD, SHOW DATABASES, REPLICATION SLAVE, REPLICATION CLIENT, "
                f"BINLOG MONITOR, LOCK TABLES ON *.* TO '{config.username}'@'%'"
            )
    finally:
        connection.close()
    connect(config, password).close()


def main(argv: list[str] | None = None) -> int:
    return cli.run(
        argv,
        prog="python -m devtools.mariadb",
        description="Run a local MariaDB server (Debian's, from .tools/mariadb).",
        options=[
            cli.Option("--port", type=int, default=DEFAULT_PORT, env="CDC_MARIADB_PORT"),
            cli.Option("--data-dir", type=Path, default=MariaDBConfig.data_dir),
        ],
        make_config=lambda args: MariaDBConfig(port=args.port, data_dir=args.data_dir),
        start=lambda config, timeout: start(
            config, os.environ.get(PASSWORD_ENV, ""), timeout or 60
        ),
        stop=lambda config, timeout: stop(config, timeout or 30),
        status=status,
    )


if __name__ == "__main__":
    sys.exit(main())
