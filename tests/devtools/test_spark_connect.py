"""The Spark Connect server of devtools/spark_connect.py, started for real: it serves the
project's session (Delta's catalog and SQL, UTC), a thin client's Delta SQL MERGE of a local
frame lands in the table (read back with deltalake, not through the server), its Python workers
import this checkout's modules, another process finds it by its pid file and command line, and
start, status and stop behave as the other local servers'.

The client runs in a process of its own (tests/devtools/connect_client.py), as a run would: a
Connect session turns its whole process into a Connect client, which this one must not become.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from devtools import spark_connect
from tests.support import delta_rows, free_ports

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[spark_connect.ConnectConfig]:
    (port,) = free_ports(1)
    config = spark_connect.ConnectConfig(
        port=port, data_dir=tmp_path_factory.mktemp("spark-connect"), driver_memory="1g"
    )
    try:
        assert spark_connect.start(config) == f"sc://127.0.0.1:{port}"
        yield config
    finally:
        spark_connect.stop(config)


def _cli(server: spark_connect.ConnectConfig, command: str) -> subprocess.CompletedProcess:
    """`python -m devtools.spark_connect COMMAND` for `server`, from another process."""
    return subprocess.run(
        [sys.executable, "-m", "devtools.spark_connect", command, "--port", str(server.port),
         "--data-dir", str(server.data_dir)],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_a_thin_client_merges_into_delta_on_the_server(server, tmp_path: Path):
    # Another process finds the server running, by its pid file and command line.
    status = _cli(server, "status")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["running"] is True
    # A second start finds it running and returns its address.
    assert spark_connect.start(server) == server.remote

    path = str(tmp_path / "accounts")
    done = subprocess.run(
        [sys.executable, "-m", "tests.devtools.connect_client", server.remote, path],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["time_zone"] == "UTC"
    assert found["catalog"].endswith("DeltaCatalog")
    assert found["worker_modules"] == ["devtools.processes"]
    rows = sorted((r["id"], r["name"], r["seq"]) for r in delta_rows(path).to_pylist())
    assert rows == [(1, "a2", 2), (2, "b", 1), (3, "c", 1)]  # the stale change not applied


def test_stop_ends_the_server(server):
    assert spark_connect.stop(server) is True
    assert spark_connect.status(server)["running"] is False
    assert spark_connect.stop(server) is False  # nothing left to stop
    status = _cli(server, "status")
    assert status.returncode == 3 and json.loads(status.stdout)["running"] is False
