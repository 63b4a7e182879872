"""Starting the real Dagster services, and reading a running webserver through its GraphQL API,
as the UI reads it.

Shared by the tests that start the real webserver and daemon: the end-to-end test on the
production instance (Postgres), and the daemon fault scenarios (tests/faults/test_daemon.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from subprocess import Popen

import pytest
import requests

STATUS = """
query Status($path: [String!]!) {
  assetNodeOrError(assetKey: {path: $path}) {
    __typename
    ... on AssetNode {
      assetPartitionStatuses {
        ... on TimePartitionStatuses { ranges { startKey endKey status } }
      }
      assetChecksOrError {
        ... on AssetChecks {
          checks {
            name
            partitionStatuses {
              ... on AssetCheckTimePartitionStatuses { ranges { startKey endKey status } }
            }
          }
        }
      }
    }
  }
}
"""

RUNS = """
query Runs {
  runsOrError(limit: 200) {
    ... on Runs { results { runId status tags { key value } } }
  }
}
"""


@dataclass(frozen=True)
class Service:
    """A Dagster process a test started: it must stay up while the test waits on it."""

    name: str
    process: Popen
    log: Path


def start_service(name: str, command: list[str], env: dict, log: Path, *, cwd: Path) -> Service:
    """`command` in a process group of its own, its output in `log`: stopping the service stops
    its code servers, run workers and their Spark JVMs with it."""
    with open(log, "wb") as out:
        process = subprocess.Popen(
            command,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return Service(name, process, log)


def stop_service(service: Service, *, grace_s: float = 30) -> None:
    """SIGTERM to the service's process group, SIGKILL after `grace_s` (at once when 0), then
    SIGKILL to what is left of the group (its code server, a run worker and its Spark JVM share
    it)."""
    pid = service.process.pid
    if grace_s:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            service.process.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    service.process.wait()


def graphql(port: int, query: str, variables: dict | None = None) -> dict:
    response = requests.post(
        f"http://127.0.0.1:{port}/graphql",
        json={"query": query, "variables": variables or {}},
        timeout=30,
    )
    response.raise_for_status()
    body = response.json()
    assert "errors" not in body, body["errors"]
    return body["data"]


def covered(ranges: list[dict], keys: list[str], status: str) -> set[str]:
    """The keys among `keys` that fall in a range with `status` (keys sort as times)."""
    return {
        key
        for key in keys
        for r in ranges
        if r["status"] == status and r["startKey"] <= key <= r["endKey"]
    }


def asset_status(port: int, asset: str, keys: list[str]) -> tuple[set[str], dict[str, set[str]]]:
    """(materialized keys, {check name: keys whose check passed}) of one asset."""
    node = graphql(port, STATUS, {"path": [asset]})["assetNodeOrError"]
    assert node["__typename"] == "AssetNode", node
    partitions = node["assetPartitionStatuses"] or {"ranges": []}
    materialized = covered(partitions["ranges"], keys, "MATERIALIZED")
    checks = {}
    for check in node["assetChecksOrError"]["checks"]:
        ranges = (check["partitionStatuses"] or {"ranges": []})["ranges"]
        checks[check["name"]] = covered(ranges, keys, "SUCCEEDED")
    return materialized, checks


def wait_for(
    condition: Callable[[], object],
    *,
    what: str,
    services: Sequence[Service],
    deadline: float,
    poll_s: float = 1.0,
) -> None:
    """Poll `condition` every `poll_s` until it returns True; fail with its last state and the
    logs when `deadline` (time.monotonic) passes or one of `services` exits. A poll is a few
    GraphQL queries: every second costs the webserver little and the test at most a second
    after the state it waits for (every 5 s cost each wait 2.5 s on average)."""
    last = None
    while time.monotonic() < deadline:
        for service in services:
            if service.process.poll() is not None:
                pytest.fail(
                    f"{service.name} exited while waiting for {what}:\n"
                    f"{service.log.read_text(errors='replace')[-5000:]}"
                )
        try:
            last = condition()
        except requests.ConnectionError:
            last = None
        if last is True:
            return
        time.sleep(poll_s)
    tails = "".join(
        f"\n--- {service.name} log ---\n{service.log.read_text(errors='replace')[-8000:]}"
        for service in services
    )
    pytest.fail(f"timed out waiting for {what}; last state: {last}{tails}")
