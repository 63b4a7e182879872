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

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pymysql

from devtools import cli
from devtools.processes import HOST, log_report, port_free, wait_until

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PORT = 13306
PASSWORD_ENV = "CDC_MARIADB_PASSWORD"
_KILL_WAIT_S = 10.0
# Servers this interpreter started, with their data dirs (a child's /proc entry shows the
# Python command line until it has exec'd the server).
_CHILDREN: dict[int, tuple[subprocess.Popen[bytes], Path]] = {}


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
    with cli.locked(config.data_dir):
        binary = config.tools_dir / "usr/sbin/mariadbd"
        if not binary.is_file():
            raise RuntimeError(
                f"MariaDB's server is missing ({binary}): run scripts/install.sh in {REPO_ROOT}."
            )
        pid = _running_pid(config)
        launched = pid is None
        if launched:
            if not port_free(config.port):
                raise RuntimeError(f"Port {config.port} on {HOST} is already in use.")
            _install_db(config)
            pid = _launch(config)
        try:
            _wait_until_ready(config, pid, timeout_s)
            _create_user_and_database(config, password)
        except BaseException:
            if launched:
                _terminate(config, pid, _KILL_WAIT_S)
            raise
    return config.address


def stop(config: MariaDBConfig, timeout_s: float = 30) -> bool:
    if not config.data_dir.is_dir():
        return False
    with cli.locked(config.data_dir):
        pid = _running_pid(config)
        if pid is not None:
            _terminate(config, pid, timeout_s)
    return pid is not None


def status(config: MariaDBConfig) -> dict[str, object]:
    pid = _running_pid(config)
    return {
        "running": pid is not None,
        "pid": pid,
        "address": config.address,
        "database": config.database,
        "username": config.username,
        "data_dir": str(config.data_dir),
        "log_file": str(config.log_file),
    }


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


def _launch(config: MariaDBConfig) -> int:
    command = [str(config.tools_dir / "usr/sbin/mariadbd"), *server_options(config)]
    with open(config.log_file, "ab") as log:
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=config.data_dir,
            env=_environment(config),
            close_fds=True,
            start_new_session=True,
        )
    _CHILDREN[process.pid] = (process, config.data_dir)
    return process.pid


def _running_pid(config: MariaDBConfig) -> int | None:
    pid = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        pid = int(config.pid_file.read_text().split()[0])
    if pid is None:
        pid = next((p for p, (_, d) in _CHILDREN.items() if d == config.data_dir), None)
    return pid if pid is not None and _is_ours(config, pid) else None


def _is_ours(config: MariaDBConfig, pid: int) -> bool:
    if pid in _CHILDREN:
        child, data_dir = _CHILDREN[pid]
        if child.poll() is None:
            return data_dir == config.data_dir
        del _CHILDREN[pid]
        return False
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return f"--datadir={config.data_dir / 'data'}".encode() in args


def _root(config: MariaDBConfig) -> pymysql.Connection:
    return pymysql.connect(unix_socket=str(config.socket_file), user="root", autocommit=True)


def _wait_until_ready(config: MariaDBConfig, pid: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if not _is_ours(config, pid):
            report = log_report([config.log_file])
            raise RuntimeError(f"The MariaDB server (pid {pid}) exited during startup.{report}")
        try:
            _root(config).close()
            return
        except pymysql.err.OperationalError as exc:
            last = str(exc)
        if time.monotonic() >= deadline:
            raise RuntimeError(
                f"The MariaDB server (pid {pid}) did not accept connections within "
                f"{timeout_s:g}s ({last}).{log_report([config.log_file])}"
            )
        time.sleep(0.2)


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


def _terminate(config: MariaDBConfig, pid: int, timeout_s: float) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    if wait_until(lambda: not _is_ours(config, pid), timeout_s):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    if not wait_until(lambda: not _is_ours(config, pid), _KILL_WAIT_S):
        raise RuntimeError(f"The MariaDB server (pid {pid}) survived SIGKILL.")


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
