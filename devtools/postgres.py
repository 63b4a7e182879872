"""PostgreSQL server on loopback, for the Dagster instance on Postgres in development and tests.

The server is Debian bookworm's PostgreSQL 15, which ``scripts/install.sh`` unpacks into
``.tools/postgresql/`` together with the libraries it links (all but glibc and the C++
runtime): nothing of a system PostgreSQL is used. It runs as a detached process, so it
outlives the Python process that started it; everything it owns (the cluster, its socket,
its log) lives in ``PostgresConfig.data_dir``.

``start`` creates the cluster on its first run, then a database and a login role owning it
whose password is passed in. The password never reaches a file, a command line or the server
log: the role is given its SCRAM-SHA-256 verifier, computed by the client. The superuser
``postgres`` has no password and connects only through the Unix socket, which only the
server's user (and root) can open. Clients connect to 127.0.0.1 with the role's password.

PostgreSQL refuses to run as root. Started by root, initdb and the server run as ``nobody``
(through ``setpriv``) with only the capability to read and write files regardless of their
permissions, since the data dir may sit under root-only folders such as pytest's temporary
directory; the cluster and socket folders are handed to ``nobody``.

Command line (the environment variables are the ones deploy/production/dagster.yaml reads)::

    DAGSTER_PG_PASSWORD=... python -m devtools.postgres start [--port N] [--data-dir PATH]
        [--database NAME] [--username NAME]
    python -m devtools.postgres stop|status [--port N] [--data-dir PATH]

``--port``, ``--database`` and ``--username`` default to ``DAGSTER_PG_PORT``, ``DAGSTER_PG_DB``
and ``DAGSTER_PG_USERNAME``, then to 15432, ``dagster`` and ``dagster``; ``--data-dir`` to
``<repo>/.local/postgres``.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import psycopg2
from psycopg2 import sql
from psycopg2.extensions import encrypt_password

from devtools import cli
from devtools.processes import HOST, port_free
from devtools.server import LocalServer, NotReady

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PORT = 15432
PORT_ENV = "DAGSTER_PG_PORT"
DATABASE_ENV = "DAGSTER_PG_DB"
USERNAME_ENV = "DAGSTER_PG_USERNAME"
PASSWORD_ENV = "DAGSTER_PG_PASSWORD"
SUPERUSER = "postgres"
# Where scripts/install.sh unpacks Debian's packages (their file system layout kept).
DEFAULT_TOOLS_DIR = REPO_ROOT / ".tools" / "postgresql"
_BIN = Path("usr/lib/postgresql/15/bin")
_RUN_AS_WHEN_ROOT = "nobody"
_IDENTIFIER = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")
# sockaddr_un.sun_path holds 108 bytes, the terminating NUL included.
_MAX_SOCKET_PATH = 107


@dataclass(frozen=True)
class PostgresConfig:
    """Where and how the local PostgreSQL server runs.

    Attributes:
        port: TCP port on 127.0.0.1 (and the number in the Unix socket's name).
        data_dir: Holds the cluster (``data/``), the socket folder and the server log.
        database: The database ``start`` creates, owned by ``username``.
        username: The login role ``start`` creates (not a superuser).
        tools_dir: Where ``scripts/install.sh`` unpacked Debian's PostgreSQL packages.
        shared_buffers: The server's shared memory cache; small, the machine runs Kafka,
            Spark and Dagster too.
        max_connections: Dagster opens a connection per storage call (no pool), from the
            webserver, the daemon and every run.
        logical_replication: A change-data-capture source: ``wal_level=logical``, replication
            connections over TCP, the role may replicate (``REPLICATION``), and a publication
            of all tables (``PUBLICATION``, what Debezium's Postgres connector reads through
            pgoutput by default) exists in the database.
    """

    port: int = DEFAULT_PORT
    data_dir: Path = REPO_ROOT / ".local" / "postgres"
    database: str = "dagster"
    username: str = "dagster"
    tools_dir: Path = DEFAULT_TOOLS_DIR
    shared_buffers: str = "32MB"
    max_connections: int = 60
    logical_replication: bool = False

    def __post_init__(self) -> None:
        # Absolute paths: the running server is recognised by the data dir on its command line.
        object.__setattr__(self, "data_dir", Path(self.data_dir).expanduser().resolve())
        object.__setattr__(self, "tools_dir", Path(self.tools_dir).expanduser().resolve())
        for field in ("database", "username"):
            if not _IDENTIFIER.match(getattr(self, field)):
                raise ValueError(
                    f"{field} {getattr(self, field)!r}: use [a-z0-9_], not first a digit"
                )
        if self.username == SUPERUSER:
            raise ValueError(f"username {SUPERUSER!r} is the superuser; choose another")
        if len(str(self.socket_file)) > _MAX_SOCKET_PATH:
            raise ValueError(
                f"The Unix socket path {self.socket_file} is longer than {_MAX_SOCKET_PATH} "
                "bytes; choose a shorter data_dir."
            )

    @property
    def bin_dir(self) -> Path:
        return self.tools_dir / _BIN

    @property
    def cluster_dir(self) -> Path:
        """The PostgreSQL data directory (``PGDATA``)."""
        return self.data_dir / "data"

    @property
    def socket_dir(self) -> Path:
        return self.data_dir / "socket"

    @property
    def socket_file(self) -> Path:
        return self.socket_dir / f".s.PGSQL.{self.port}"

    @property
    def log_file(self) -> Path:
        """The server's output: its log, and any start-up failure."""
        return self.data_dir / "postgres.log"

    @property
    def pid_file(self) -> Path:
        """The server's own ``postmaster.pid``."""
        return self.cluster_dir / "postmaster.pid"

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"


# Debezium's Postgres connector reads this publication by default (publication.name).
PUBLICATION = "dbz_publication"


def server_settings(config: PostgresConfig) -> dict[str, str]:
    """The ``postgresql.conf`` settings of ``config``, as PostgreSQL literals."""
    replication = {}
    if config.logical_replication:
        replication = {
            "wal_level": "logical",
            "max_wal_senders": "20",
            "max_replication_slots": "20",
            # A connector stopped for good must not fill the disk with WAL it will never read.
            "max_slot_wal_keep_size": "'1GB'",
        }
    return {
        **replication,
        "listen_addresses": f"'{HOST}'",
        "port": str(config.port),
        "unix_socket_directories": f"'{config.socket_dir}'",
        "unix_socket_permissions": "0700",
        "max_connections": str(config.max_connections),
        "shared_buffers": config.shared_buffers,
        "work_mem": "4MB",
        "maintenance_work_mem": "32MB",
        "effective_cache_size": "256MB",
        "min_wal_size": "32MB",
        "max_wal_size": "256MB",
        "huge_pages": "off",
        # Dagster commits an event at a time; a crash may lose the last few commits, never
        # corrupt the cluster (fsync stays on).
        "synchronous_commit": "off",
        # No LLVM is shipped in .tools/postgresql.
        "jit": "off",
        "password_encryption": "'scram-sha-256'",
        # GMT is built into PostgreSQL; any other zone name reads the system's tzdata.
        "timezone": "'GMT'",
        "log_timezone": "'GMT'",
        "datestyle": "'iso, mdy'",
        "lc_messages": "'C'",
        "lc_monetary": "'C'",
        "lc_numeric": "'C'",
        "lc_time": "'C'",
        "default_text_search_config": "'pg_catalog.english'",
        "log_line_prefix": "'%m [%p] %q%u@%d '",
    }


# The superuser only through the socket (mode 0700); everyone else with a SCRAM password.
_HBA = """\
# Written by devtools/postgres.py on every start.
local all postgres trust
local all all scram-sha-256
host all all 127.0.0.1/32 scram-sha-256
"""
_HBA_REPLICATION = "host replication all 127.0.0.1/32 scram-sha-256\n"


def start(config: PostgresConfig, password: str, timeout_s: float = 60) -> str:
    """Start the server unless it already runs, create the role and database, wait until ready.

    Args:
        config: Which server.
        password: The password of ``config.username``; set on every start, so a restart
            with another password changes it. Never written anywhere in clear.
        timeout_s: How long to wait for the server to accept connections.

    Returns:
        The address clients connect to, ``"127.0.0.1:<port>"``.

    Raises:
        RuntimeError: The binaries are missing (run scripts/install.sh), the port is taken,
            initdb failed, or the server died or did not answer in time (the message quotes
            its log).
    """
    if not password:
        raise RuntimeError(f"No password given for the role {config.username!r}.")
    _check_binaries(config)
    server = _server(config)
    server.start(
        timeout_s,
        lambda: _launch(config, server),
        settings=(config.cluster_dir / "postgresql.conf", _render_conf(config)),
        then=lambda: _create_role_and_database(config, password),
    )
    return config.address


def stop(config: PostgresConfig, timeout_s: float = 30) -> bool:
    """Stop the server: fast shutdown, then immediate shutdown and SIGKILL after ``timeout_s``.

    Returns:
        Whether a server was running.
    """
    return _server(config).stop(timeout_s)


def status(config: PostgresConfig) -> dict[str, object]:
    """Describe the server of ``config.data_dir`` without changing anything."""
    return _server(config).status(
        address=config.address,
        database=config.database,
        username=config.username,
        data_dir=str(config.data_dir),
        log_file=str(config.log_file),
    )


def connect(config: PostgresConfig, password: str, **kwargs: object):
    """A psycopg2 connection to ``config.database`` as ``config.username`` over TCP."""
    return psycopg2.connect(
        host=HOST,
        port=config.port,
        dbname=config.database,
        user=config.username,
        password=password,
        connect_timeout=10,
        **kwargs,
    )


def _server(config: PostgresConfig) -> LocalServer:
    """The server as a local server: its postmaster writes the pid file; it is recognised by
    its cluster dir and ready once the superuser connects through the socket."""
    return LocalServer(
        title="PostgreSQL server",
        module="devtools.postgres",
        data_dir=config.data_dir,
        pid_file=config.pid_file,
        log_file=config.log_file,
        identifies=lambda args: "-D" in args and str(config.cluster_dir) in args,
        probe=lambda _timeout_s: _probe(config),
        awaits=f"accept connections on {config.socket_file}",
        owns_pid_file=False,
        # SIGINT: fast shutdown (roll back, disconnect, checkpoint); SIGQUIT: immediate
        # shutdown; SIGKILL to the group: the server's children too.
        stop_signals=(
            (signal.SIGINT, False),
            (signal.SIGQUIT, False),
            (signal.SIGKILL, True),
        ),
    )


def _launch(config: PostgresConfig, server: LocalServer) -> int:
    """Checks the port, creates the cluster once, writes its configs and launches the server."""
    config.socket_file.unlink(missing_ok=True)
    if not port_free(config.port):
        raise RuntimeError(
            f"Port {config.port} on {HOST} is already in use by another process; "
            f"choose another with --port N, {PORT_ENV}=N or PostgresConfig(port=N)."
        )
    _initdb(config)
    _write_configs(config)
    # setpriv execs postgres, so the pid is the postmaster's.
    command = [*_run_as(config), str(config.bin_dir / "postgres"), "-D", str(config.cluster_dir)]
    return server.launch(command, _environment(config))


def _probe(config: PostgresConfig) -> None:
    try:
        _superuser_connection(config).close()
    except psycopg2.OperationalError as exc:
        raise NotReady(str(exc).strip()) from None


def _check_binaries(config: PostgresConfig) -> None:
    missing = [name for name in ("postgres", "initdb") if not (config.bin_dir / name).is_file()]
    if missing:
        raise RuntimeError(
            f"PostgreSQL's {' and '.join(missing)} are missing from {config.bin_dir}: run "
            f"scripts/install.sh in {REPO_ROOT} (it unpacks Debian's PostgreSQL 15 there)."
        )
    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        raise RuntimeError(
            "PostgreSQL refuses to run as root, and setpriv (util-linux), which runs it as "
            f"{_RUN_AS_WHEN_ROOT!r}, is not on PATH."
        )


def _library_path(config: PostgresConfig) -> str:
    # Debian puts libraries in lib/<multiarch> and usr/lib/<multiarch>.
    dirs = [
        *config.tools_dir.glob("lib/*-linux-gnu*"),
        *config.tools_dir.glob("usr/lib/*-linux-gnu*"),
    ]
    return ":".join(str(d) for d in sorted(dirs) if d.is_dir())


def _environment(config: PostgresConfig) -> dict[str, str]:
    """A clean environment: no PG* variables of the caller, the C locale, the shipped libraries."""
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "LD_LIBRARY_PATH": _library_path(config),
        "LC_ALL": "C",
        "LANG": "C",
        # initdb takes the time zone from TZ; GMT needs no tzdata on the machine.
        "TZ": "GMT",
    }


def _run_as(config: PostgresConfig) -> list[str]:
    """The command prefix that drops root, empty when not root."""
    if os.geteuid() != 0:
        return []
    user = _server_user()
    return [
        "setpriv",
        f"--reuid={user.pw_uid}",
        f"--regid={user.pw_gid}",
        "--clear-groups",
        # Only file access: reach and use the data dir wherever it is (e.g. in pytest's
        # root-only temporary directory) and the binaries wherever the checkout is.
        "--inh-caps=-all,+dac_override",
        "--ambient-caps=+dac_override",
        "--bounding-set=-all,+dac_override",
    ]


def _server_user() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(_RUN_AS_WHEN_ROOT)
    except KeyError:
        raise RuntimeError(
            f"PostgreSQL refuses to run as root, and there is no user {_RUN_AS_WHEN_ROOT!r} to "
            "run it as."
        ) from None


def _own(config: PostgresConfig, *paths: Path) -> None:
    """Hand ``paths`` to the server's user (when root), as PostgreSQL requires of PGDATA."""
    if os.geteuid() != 0:
        return
    user = _server_user()
    for path in paths:
        os.chown(path, user.pw_uid, user.pw_gid)


def _initdb(config: PostgresConfig) -> None:
    """Create the cluster once; an initialised cluster has PG_VERSION."""
    if (config.cluster_dir / "PG_VERSION").is_file():
        return
    if config.cluster_dir.exists():
        shutil.rmtree(config.cluster_dir)  # a half-created cluster of a failed first start
    config.cluster_dir.mkdir(mode=0o700, parents=True)
    _own(config, config.cluster_dir)
    command = [
        *_run_as(config),
        str(config.bin_dir / "initdb"),
        f"--pgdata={config.cluster_dir}",
        f"--username={SUPERUSER}",
        "--auth-local=trust",
        "--auth-host=scram-sha-256",
        "--encoding=UTF8",
        "--locale=C",
        "--no-sync",
        "--no-instructions",
    ]
    try:
        result = subprocess.run(
            command,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            env=_environment(config),
            timeout=120,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"initdb of {config.cluster_dir} took over 120 s") from None
    if result.returncode != 0:
        shutil.rmtree(config.cluster_dir, ignore_errors=True)
        raise RuntimeError(
            f"initdb of {config.cluster_dir} failed (exit {result.returncode}):\n"
            f"{result.stdout}{result.stderr}"
        )


def _render_conf(config: PostgresConfig) -> str:
    lines = ["# Written by devtools/postgres.py on every start; change PostgresConfig instead."]
    lines += [f"{key} = {value}" for key, value in server_settings(config).items()]
    return "\n".join(lines) + "\n"


def _write_configs(config: PostgresConfig) -> None:
    # Replaces initdb's files, whose time zone setting would read the system's tzdata.
    (config.cluster_dir / "postgresql.conf").write_text(_render_conf(config))
    hba = _HBA + (_HBA_REPLICATION if config.logical_replication else "")
    (config.cluster_dir / "pg_hba.conf").write_text(hba)
    config.socket_dir.mkdir(mode=0o700, exist_ok=True)
    _own(config, config.socket_dir)


def _superuser_connection(config: PostgresConfig, timeout_s: float = 5, database: str = "postgres"):
    return psycopg2.connect(
        host=str(config.socket_dir),
        port=config.port,
        dbname=database,
        user=SUPERUSER,
        connect_timeout=max(int(timeout_s), 2),
    )


def _create_role_and_database(config: PostgresConfig, password: str) -> None:
    connection = _superuser_connection(config)
    connection.autocommit = True
    try:
        with connection.cursor() as cursor:
            # The verifier, computed here, is all the server ever sees of the password.
            verifier = encrypt_password(password, config.username, connection, "scram-sha-256")
            role = sql.Identifier(config.username)
            cursor.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (config.username,))
            verb = sql.SQL("ALTER" if cursor.fetchone() else "CREATE")
            replicates = sql.SQL(" REPLICATION" if config.logical_replication else "")
            cursor.execute(
                sql.SQL("{} ROLE {} WITH LOGIN{} PASSWORD %s").format(verb, role, replicates),
                (verifier,),
            )
            cursor.execute("SELECT 1 FROM pg_database WHERE datname = %s", (config.database,))
            if cursor.fetchone() is None:
                cursor.execute(
                    sql.SQL("CREATE DATABASE {} OWNER {}").format(
                        sql.Identifier(config.database), role
                    )
                )
    finally:
        connection.close()
    if config.logical_replication:
        _create_publication(config)
    # What the clients will do: the role's password over TCP.
    try:
        connect(config, password).close()
    except psycopg2.OperationalError as exc:
        raise RuntimeError(
            f"{config.username}@{config.address}/{config.database} refused its password: "
            f"{str(exc).strip()}{_server(config).log_report()}"
        ) from None


def _create_publication(config: PostgresConfig) -> None:
    """The publication of all tables Debezium reads; only a superuser may create it."""
    connection = _superuser_connection(config, database=config.database)
    connection.autocommit = True
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1 FROM pg_publication WHERE pubname = %s", (PUBLICATION,))
            if cursor.fetchone() is None:
                cursor.execute(
                    sql.SQL("CREATE PUBLICATION {} FOR ALL TABLES").format(
                        sql.Identifier(PUBLICATION)
                    )
                )
    finally:
        connection.close()


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (`devtools.cli`)."""

    def _start(config: PostgresConfig, timeout: float | None) -> str:
        password = os.environ.get(PASSWORD_ENV)
        if not password:
            raise RuntimeError(f"Set the role's password in the environment: {PASSWORD_ENV}")
        return start(config, password, 60 if timeout is None else timeout)

    return cli.run(
        argv,
        prog="python -m devtools.postgres",
        description="Run a local PostgreSQL server (Debian's, from .tools/postgresql).",
        options=[
            cli.Option("--port", type=int, default=DEFAULT_PORT, env=PORT_ENV),
            cli.Option("--data-dir", type=Path, default=PostgresConfig.data_dir),
            cli.Option("--database", default="dagster", env=DATABASE_ENV),
            cli.Option("--username", default="dagster", env=USERNAME_ENV),
        ],
        make_config=lambda args: PostgresConfig(
            port=args.port, data_dir=args.data_dir, database=args.database, username=args.username
        ),
        start=_start,
        stop=lambda config, timeout: stop(config, 30 if timeout is None else timeout),
        status=status,
    )


if __name__ == "__main__":
    sys.exit(main())
