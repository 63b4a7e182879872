"""A Spark standalone cluster on loopback (one master, one worker), from pyspark's own distribution.

The pip-installed pyspark package is a complete Spark distribution (``bin/spark-class`` and
``jars/``), so it serves as ``SPARK_HOME``: ``start(config)`` runs
``org.apache.spark.deploy.master.Master`` and ``org.apache.spark.deploy.worker.Worker`` from
it, each as a detached process in its own process group, on 127.0.0.1, and waits until the
worker has registered with the master. ``stop(config)`` ends the worker (with the executors it
launched, which share its process group) and then the master. Everything the cluster owns
(pid files, the daemons' logs, the worker's work directory with each executor's stdout and
stderr, an empty ``SPARK_CONF_DIR``) lives in ``ClusterConfig.data_dir``.

An application reaches it with ``SparkResource(master=start(config), ...)``; its executors run
on this machine, so they find the jars ``SparkResource`` puts on their class path, and the
Python of the driver (``PYSPARK_PYTHON``) for its Python workers.

Command line::

    python -m devtools.spark_cluster start|stop|status [--port N] [--data-dir PATH]

``--port`` is the master's port (default 17077; its web UI and JSON at port + 1, the worker at
port + 2 and its web UI at port + 3); ``--data-dir`` defaults to ``<repo>/.local/spark-cluster``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.error import URLError
from urllib.request import urlopen

import pyspark

from devtools import cli, processes
from devtools.processes import HOST, port_free
from devtools.server import LocalServer, NotReady

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PORT = 17077
SPARK_HOME = Path(pyspark.__file__).resolve().parent
MASTER_CLASS = "org.apache.spark.deploy.master.Master"
WORKER_CLASS = "org.apache.spark.deploy.worker.Worker"


@dataclass(frozen=True)
class ClusterConfig:
    """Where and how the local standalone cluster runs.

    Attributes:
        port: The master's RPC port; applications use ``spark://127.0.0.1:<port>``.
        webui_port: The master's web UI (its state as JSON at ``/json/``); None: port + 1.
        worker_port: The worker's RPC port; None: port + 2.
        worker_webui_port: The worker's web UI; None: port + 3.
        data_dir: Holds the pid files, the logs and the worker's work directory.
        cores: Cores the worker offers to executors.
        memory: Memory the worker offers to executors (an application's
            ``spark.executor.memory`` must fit in it).
        daemon_memory: Heap of the master and worker daemons themselves.
    """

    port: int = DEFAULT_PORT
    webui_port: int | None = None
    worker_port: int | None = None
    worker_webui_port: int | None = None
    data_dir: Path = REPO_ROOT / ".local" / "spark-cluster"
    cores: int = 2
    memory: str = "1g"
    daemon_memory: str = "256m"

    def __post_init__(self) -> None:
        object.__setattr__(self, "data_dir", Path(self.data_dir).expanduser().resolve())
        ports = list(self.ports.values())
        if len(set(ports)) != len(ports):
            raise ValueError(f"the cluster's ports must differ ({self.ports})")

    @property
    def ports(self) -> dict[str, int]:
        """Every port the cluster listens on, by role (the defaults resolved)."""
        return {
            "master": self.port,
            "master web UI": self.port + 1 if self.webui_port is None else self.webui_port,
            "worker": self.port + 2 if self.worker_port is None else self.worker_port,
            "worker web UI": (
                self.port + 3 if self.worker_webui_port is None else self.worker_webui_port
            ),
        }

    @property
    def master_url(self) -> str:
        return f"spark://{HOST}:{self.port}"

    @property
    def master_json_url(self) -> str:
        """The master's state: workers, running and completed applications."""
        return f"http://{HOST}:{self.ports['master web UI']}/json/"

    @property
    def worker_json_url(self) -> str:
        """The worker's state: its running and finished executors."""
        return f"http://{HOST}:{self.ports['worker web UI']}/json/"

    @property
    def work_dir(self) -> Path:
        """The worker's work directory: one folder per application, one per executor in it
        (its stdout and stderr)."""
        return self.data_dir / "work"

    def log_file(self, role: str) -> Path:
        """The output of the ``master`` or ``worker`` daemon (Spark logs to it)."""
        return self.data_dir / f"{role}.log"

    def pid_file(self, role: str) -> Path:
        return self.data_dir / f"{role}.pid"


def start(config: ClusterConfig, timeout_s: float = 120) -> str:
    """Start the master and the worker, and wait until the worker has registered.

    Returns:
        The master URL, ``spark://127.0.0.1:<port>``.

    Raises:
        RuntimeError: A port is taken, Java is missing, a daemon died or the worker did not
            register in time (the message quotes the daemons' logs). Whatever was started is
            stopped again.
    """
    master, worker = _server(config, "master"), _server(config, "worker")
    pid = worker.running_pid()
    if master.running_pid() is not None and pid is not None:
        worker.wait_ready(pid, timeout_s)
        return config.master_url
    stop(config)
    for role, port in config.ports.items():
        if not port_free(port):
            raise RuntimeError(
                f"Port {port} on {HOST} (the Spark {role}) is already in use by another "
                "process; choose other ports (ClusterConfig, or --port)."
            )
    processes.java()
    config.data_dir.mkdir(parents=True, exist_ok=True)
    for folder in (config.work_dir, config.data_dir / "local", config.data_dir / "conf"):
        folder.mkdir(exist_ok=True)
    deadline, env = time.monotonic() + timeout_s, _daemon_env(config)
    try:
        master.wait_ready(master.launch(_command(config, "master"), env), timeout_s)
        # One deadline for both daemons.
        pid = worker.launch(_command(config, "worker"), env)
        worker.wait_ready(pid, round(deadline - time.monotonic(), 1))
    except BaseException:
        stop(config)  # half a cluster would hold the ports
        raise
    return config.master_url


def stop(config: ClusterConfig, timeout_s: float = 30) -> bool:
    """Stop the worker (and its executors), then the master: SIGTERM, SIGKILL after
    ``timeout_s``. Returns whether anything was running."""
    stopped = [_server(config, role).stop(timeout_s, lock=False) for role in ("worker", "master")]
    return any(stopped)


def status(config: ClusterConfig) -> dict[str, object]:
    """The daemons' pids (None when not running), the master URL, its workers and apps."""
    pids = {role: _server(config, role).running_pid() for role in ("master", "worker")}
    state = _get_json(config.master_json_url) if pids["master"] else None
    return {
        "running": all(pids.values()),
        "master_pid": pids["master"],
        "worker_pid": pids["worker"],
        "master_url": config.master_url,
        "master_json": config.master_json_url,
        "workers": [
            {k: w.get(k) for k in ("id", "state", "cores", "memory")}
            for w in (state or {}).get("workers", [])
        ],
        "active_apps": [a.get("id") for a in (state or {}).get("activeapps", [])],
        "data_dir": str(config.data_dir),
    }


def worker_state(config: ClusterConfig) -> dict:
    """The worker's JSON state (executors, finishedexecutors, each with its appid)."""
    state = _get_json(config.worker_json_url)
    if state is None:
        raise RuntimeError(f"The Spark worker does not answer on {config.worker_json_url}")
    return state


def _daemon_env(config: ClusterConfig) -> dict[str, str]:
    env = {
        **os.environ,
        "SPARK_HOME": str(SPARK_HOME),
        # An empty conf dir: no spark-env.sh or spark-defaults.conf from anywhere else.
        "SPARK_CONF_DIR": str(config.data_dir / "conf"),
        "SPARK_DAEMON_MEMORY": config.daemon_memory,
        # The daemons and the executors the worker launches (they inherit its environment)
        # bind to loopback.
        "SPARK_LOCAL_IP": HOST,
        "SPARK_WORKER_DIR": str(config.work_dir),
        # The executors' scratch space (shuffle, spilled blocks), removed with each app.
        "SPARK_LOCAL_DIRS": str(config.data_dir / "local"),
        # Finished applications' folders in work_dir (their copy of spark.jars, the executors'
        # logs) go after a day.
        "SPARK_WORKER_OPTS": (
            "-Dspark.worker.cleanup.enabled=true -Dspark.worker.cleanup.appDataTtl=86400"
        ),
        # Light daemons: the quick compiler and the serial collector cost the least CPU.
        "SPARK_DAEMON_JAVA_OPTS": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
    }
    # The master's address comes from the command line only.
    for name in ("SPARK_MASTER_HOST", "SPARK_MASTER_PORT", "SPARK_MASTER_OPTS"):
        env.pop(name, None)
    return env


def _server(config: ClusterConfig, role: str) -> LocalServer:
    """The ``master`` or ``worker`` daemon as a local server: recognised by its class and port;
    stopped with its whole process group (the worker's executors)."""
    if role == "master":
        cls, port, probe = MASTER_CLASS, config.port, _master_alive
        awaits = f"come up on {config.master_json_url}"
    else:
        cls, port, probe = WORKER_CLASS, config.ports["worker"], _worker_registered
        awaits = f"register with {config.master_url}"
    return LocalServer(
        title=f"Spark {role}",
        module="devtools.spark_cluster",
        data_dir=config.data_dir,
        pid_file=config.pid_file(role),
        log_file=config.log_file(role),
        identifies=lambda args: cls in args and f"--port {port}" in " ".join(args),
        probe=lambda _timeout_s: probe(config),
        awaits=awaits,
        logs=[config.log_file(r) for r in ("master", "worker")],
        poll_s=0.5,
        whole_group=True,
    )


def _command(config: ClusterConfig, role: str) -> list[str]:
    """The ``master`` or ``worker`` daemon through pyspark's spark-class, on loopback."""
    spark_class = SPARK_HOME / "bin" / "spark-class"
    if not spark_class.is_file():
        raise RuntimeError(f"{spark_class} is missing: is pyspark installed completely?")
    if role == "master":
        ports = ["--port", str(config.port), "--webui-port", str(config.ports["master web UI"])]
        arguments = [MASTER_CLASS, "--host", HOST, *ports]
    else:
        ports = ["--port", str(config.ports["worker"])]
        ports += ["--webui-port", str(config.ports["worker web UI"])]
        resources = ["--cores", str(config.cores), "--memory", config.memory]
        arguments = [WORKER_CLASS, config.master_url, "--host", HOST, *ports, *resources]
        arguments += ["--work-dir", str(config.work_dir)]
    return ["bash", str(spark_class), *arguments]


def _master_alive(config: ClusterConfig) -> None:
    state = _get_json(config.master_json_url)
    if state is None or state.get("status") != "ALIVE":
        raise NotReady()


def _worker_registered(config: ClusterConfig) -> None:
    master = _server(config, "master")
    if master.running_pid() is None:
        raise RuntimeError(f"The Spark master exited during startup.{master.log_report()}")
    worker = f"{HOST}:{config.ports['worker']}"
    state = _get_json(config.master_json_url) or {}
    if not any(
        w.get("state") == "ALIVE" and f"{w.get('host')}:{w.get('port')}" == worker
        for w in state.get("workers", [])
    ):
        raise NotReady()


def _get_json(url: str) -> dict | None:
    try:
        with urlopen(url, timeout=5) as response:
            return json.load(response)
    except (URLError, OSError, ValueError):
        return None


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (`devtools.cli`)."""
    return cli.run(
        argv,
        prog="python -m devtools.spark_cluster",
        description="Run a local Spark standalone cluster (one master, one worker) on loopback.",
        options=[
            cli.Option(
                "--port",
                type=int,
                default=DEFAULT_PORT,
                help="master port; web UI +1, worker +2, worker web UI +3",
            ),
            cli.Option("--data-dir", type=Path, default=ClusterConfig.data_dir),
            cli.Option("--cores", type=int, default=ClusterConfig.cores),
            cli.Option("--memory", default=ClusterConfig.memory, help="for executors"),
        ],
        make_config=lambda args: ClusterConfig(
            port=args.port, data_dir=args.data_dir, cores=args.cores, memory=args.memory
        ),
        start=lambda config, timeout: start(config, 120 if timeout is None else timeout),
        stop=lambda config, timeout: stop(config, 30 if timeout is None else timeout),
        status=status,
    )


if __name__ == "__main__":
    sys.exit(main())
