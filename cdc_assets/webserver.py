"""The running Dagster webserver's GraphQL API as the command-line tools use it.

`cdc_assets.backfill` and `demo.ui_materialize` launch runs through the webserver, as the
UI's buttons do. This module holds what they share, so each says why something failed:

- `Webserver.query` raises `WebserverError` with the server's own message, also when it
  answered with an HTTP error (the GraphQL error body says why);
- `refuse_hours` refuses, before anything is launched, hours a table has no partition for
  (before its first hour, in the future) and its hour still open, saying what to do instead;
- `run_failure` is why a run failed, as its step and run failure events say it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta

import requests

from cdc_assets.hours import hour_start

# The first partition key and the newest two of each asset, not all of them (a year of hours
# of 200 tables would be 1.7M keys).
ASSET_PARTITIONS = """
query MirrorAssets {
  assetNodes {
    assetKey { path }
    groupName
    isPartitioned
    first: partitionKeyConnection(limit: 1, ascending: true) { results }
    newest: partitionKeyConnection(limit: 2, ascending: false) { results }
  }
}
"""

RUN_EVENTS = """
query RunEvents($runId: ID!, $after: String) {
  logsForRun(runId: $runId, afterCursor: $after, limit: 1000) {
    __typename
    ... on EventConnection {
      cursor
      hasMore
      events {
        __typename
        ... on MessageEvent { message stepKey }
        ... on ErrorEvent { error { message cause { message cause { message } } } }
      }
    }
    ... on PythonError { message }
    ... on RunNotFoundError { message }
  }
}
"""


class WebserverError(Exception):
    """The webserver's answer, or an argument checked against it, that a tool can't go on
    with; the message says why and what to do."""


class Webserver:
    """The GraphQL API of a running Dagster webserver (the UI's)."""

    def __init__(self, host: str, port: int, *, timeout_s: float = 60) -> None:
        self.url = f"http://{host}:{port}/graphql"
        self.timeout_s = timeout_s

    def query(self, text: str, variables: dict | None = None) -> dict:
        try:
            response = requests.post(
                self.url, json={"query": text, "variables": variables or {}}, timeout=self.timeout_s
            )
        except requests.ConnectionError:
            raise WebserverError(
                f"no Dagster webserver answers at {self.url}; start it (scripts/demo.sh, or "
                "dagster-webserver in a deployment) or give its --host and --port"
            ) from None
        try:
            body = response.json()
        except ValueError:
            body = None
        if response.status_code != 200 or not isinstance(body, dict) or body.get("errors"):
            raise WebserverError(
                f"{self.url} answered HTTP {response.status_code}: {_reason(response, body)}"
            )
        return body["data"]

    def partition_keys(self, group: str) -> dict[str, list[str]]:
        """Every partitioned asset of `group`, by name: its first partition key and its newest
        two, oldest first (what `refuse_hours` needs)."""
        nodes = self.query(ASSET_PARTITIONS)["assetNodes"]
        return {
            "/".join(n["assetKey"]["path"]): list(
                dict.fromkeys(
                    [
                        *(n["first"] or {}).get("results", []),
                        *reversed((n["newest"] or {}).get("results", [])),
                    ]
                )
            )  # fmt: skip
            for n in nodes
            if n["groupName"] == group and n["isPartitioned"]
        }

    def run_failure(self, run_id: str) -> str | None:
        """Why run `run_id` failed: its steps' failure messages, else the run's; None when no
        event says."""
        steps, runs, after = [], [], None
        while True:
            found = self.query(RUN_EVENTS, {"runId": run_id, "after": after})["logsForRun"]
            if found["__typename"] != "EventConnection":
                return found.get("message")
            for event in found["events"]:
                kind = event["__typename"]
                if kind == "ExecutionStepFailureEvent":
                    error = _reason_of(event.get("error")) or event["message"]
                    steps.append(f"{event.get('stepKey') or 'step'}: {_first_lines(error)}")
                elif kind == "RunFailureEvent":
                    error = _reason_of(event.get("error"))
                    runs.append(_first_lines(error or event["message"]))
            if not found["hasMore"]:
                break
            after = found["cursor"]
        # A retried step fails once per attempt with the same reason: say it once.
        reasons = list(dict.fromkeys(steps)) or list(dict.fromkeys(runs))
        return "\n".join(reasons) or None


def _reason_of(error: dict | None) -> str | None:
    """An error's message; for a step that exhausted its retries ("Exceeded max_retries"), the
    message of the error that made it retry."""
    while (
        error and error.get("message", "").startswith("Exceeded max_retries") and error.get("cause")
    ):
        error = error["cause"]
    return (error or {}).get("message")


def _reason(response: requests.Response, body: object) -> str:
    """The server's own message for a refused query: the first GraphQL error's, else the
    start of the body."""
    if isinstance(body, dict) and body.get("errors"):
        return _first_lines(str(body["errors"][0].get("message", body["errors"][0])))
    return _first_lines(response.text) or "(empty body)"


def _first_lines(text: str, lines: int = 6) -> str:
    """A message's first lines, without the exception class Dagster puts before it."""
    kept = [line.rstrip() for line in text.strip().splitlines() if line.strip()][:lines]
    if kept and kept[0].startswith("dagster.") and ": " in kept[0]:
        kept[0] = kept[0].split(": ", 1)[1]
    return "\n".join(kept)


def refuse_hours(
    keys_by_table: Mapping[str, Sequence[str]],
    first: str,
    last: str,
    *,
    now: datetime | None = None,
) -> None:
    """Raises `WebserverError` when [first, last] reaches outside a table's partitions, or
    into its hour still open (the newest partition, while the clock is inside it)."""
    now = now or datetime.now(UTC)
    for table, keys in keys_by_table.items():
        if not keys:
            raise WebserverError(
                f"table '{table}' has no hour yet; its first hour is in the future"
            )
        if first < keys[0]:  # fixed-width keys: text order is time order
            raise WebserverError(
                f"{first} is before the first hour of table '{table}' ({keys[0]}); start the "
                f"range at {keys[0]} or later (the table's hours: {keys[0]} to {keys[-1]})"
            )
        open_ends = hour_start(keys[-1]) + timedelta(hours=1)
        if last > keys[-1]:
            raise WebserverError(
                f"{last} is in the future; the newest hour of table '{table}' is {keys[-1]}, "
                f"open until {open_ends:%H:%M} UTC"
            )
        if last == keys[-1] and now < open_ends:
            earlier = (
                f"; or end the range at {keys[-2]}" if len(keys) > 1 and first <= keys[-2] else ""
            )
            raise WebserverError(
                f"hour {last} of table '{table}' is still open (it ends at {open_ends:%H:%M} "
                "UTC); the offset sensor materializes it once it has closed. To see its changes "
                "so far, materialize it from the UI with the run config force_open_hour: true"
                + earlier
            )
