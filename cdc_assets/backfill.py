r"""Backfills a range of hours of one or several mirrors from the command line, as the UI's
Backfill button does.

    python -m cdc_assets.backfill --from 2026-11-21-18:00 --to 2026-11-21-21:00 \
        [--table orders --table customers] [--host 127.0.0.1 --port 3000] [--no-wait]

`dagster asset materialize --partition-range` refuses the mirrors: Dagster's CLI runs a range
only for assets whose BackfillPolicy is single_run, because splitting a range into runs and
following them is the daemon's work, and the mirrors' policy is multi_run (at most
`hours_per_run` hours a run). So this asks the running webserver, through its GraphQL API, for
an asset backfill of the tables over the range (`--to` included); the daemon then launches it
exactly as one launched from the UI: runs of at most `hours_per_run` hours, each queued for
its tables' pool, retried by the same policies, visible under Overview → Backfills. Hours a
table has no partition for (before its first hour, in the future) and its hour still open are
refused before anything is launched, saying what to do instead.

By default it waits for the backfill to end and prints its runs, each failed one with its
reason, exiting 0 when every run succeeded, 1 when the backfill failed or was canceled, 2 on a
wrong argument or a webserver that refused the request (its reason printed, also behind an HTTP
error). `--no-wait` prints the backfill's id and exits.
Without `--table`, every table of the code location's mirrors group is backfilled.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from cdc_assets.hours import parse_hour_key
from cdc_assets.partitions import TRIGGER_TAG
from cdc_assets.webserver import Webserver, WebserverError, refuse_hours

MIRRORS_GROUP = "cdc_mirrors"
BACKFILL_TAG = {"key": TRIGGER_TAG, "value": "backfill_cli"}
DONE = {"COMPLETED", "COMPLETED_SUCCESS", "COMPLETED_FAILED", "FAILED", "CANCELED"}
SUCCEEDED = {"COMPLETED", "COMPLETED_SUCCESS"}

LAUNCH = """
mutation Backfill($params: LaunchBackfillParams!) {
  launchPartitionBackfill(backfillParams: $params) {
    __typename
    ... on LaunchBackfillSuccess { backfillId }
    ... on PythonError { message }
    ... on Error { message }
  }
}
"""

STATUS = """
query Backfill($id: String!) {
  partitionBackfillOrError(backfillId: $id) {
    __typename
    ... on PartitionBackfill {
      id
      status
      runs(limit: 1000) {
        runId
        status
        tags { key value }
      }
      error { message }
    }
    ... on PythonError { message }
    ... on Error { message }
  }
}
"""


class BackfillError(WebserverError):
    """An argument or the webserver's answer the backfill can't go on with; says why."""


def hour_keys_between(first: str, last: str) -> tuple[str, str]:
    """Checks the range's ends are hour keys, in order; returns them."""
    parsed = []
    for option, value in (("--from", first), ("--to", last)):
        when = parse_hour_key(value)
        if when is None:
            raise BackfillError(
                f"{option} '{value}' is not an hour key; write it like 2026-11-21-18:00 (UTC, "
                "on the hour)"
            )
        parsed.append(when)
    if parsed[1] < parsed[0]:
        raise BackfillError(f"--to {last} is before --from {first}; give --from the earlier hour")
    return first, last


def mirror_tables(
    server: Webserver, wanted: Sequence[str] | None, first: str, last: str
) -> list[str]:
    """The tables to backfill: `wanted`, each checked to be a mirror, or every mirror; each
    checked to have every hour of [first, last] closed (`refuse_hours`)."""
    partitions = server.partition_keys(MIRRORS_GROUP)
    mirrors = sorted(partitions)
    if not mirrors:
        raise BackfillError(f"the webserver at {server.url} has no assets in group {MIRRORS_GROUP}")
    tables = list(dict.fromkeys(wanted)) if wanted else mirrors
    unknown = [name for name in tables if name not in mirrors]
    if unknown:
        raise BackfillError(
            f"no mirror table named {', '.join(unknown)} in the code location; its tables are "
            f"{', '.join(mirrors)}"
        )
    refuse_hours({table: partitions[table] for table in tables}, first, last)
    return tables


def launch(server: Webserver, tables: Sequence[str], first: str, last: str) -> str:
    """Asks for the backfill of `tables` over [first, last]; returns its id."""
    params = {
        "partitionsByAssets": [
            {"assetKey": {"path": [table]}, "partitions": {"range": {"start": first, "end": last}}}
            for table in tables
        ],
        "tags": [BACKFILL_TAG],
        "title": f"{', '.join(tables)}: {first} to {last}",
    }
    answer = server.query(LAUNCH, {"params": params})["launchPartitionBackfill"]
    if answer["__typename"] != "LaunchBackfillSuccess":
        reason = (answer.get("message") or answer["__typename"]).strip().splitlines()[0]
        raise BackfillError(f"the webserver refused the backfill: {reason}")
    return answer["backfillId"]


def status(server: Webserver, backfill_id: str) -> dict:
    answer = server.query(STATUS, {"id": backfill_id})["partitionBackfillOrError"]
    if answer["__typename"] != "PartitionBackfill":
        raise BackfillError(
            f"backfill {backfill_id}: {answer.get('message', answer['__typename'])}"
        )
    return answer


def wait(server: Webserver, backfill_id: str, *, poll_s: float = 5) -> dict:
    """Polls the backfill until it ends; returns its last status."""
    while True:
        state = status(server, backfill_id)
        if state["status"] in DONE:
            return state
        time.sleep(poll_s)


def run_range(run: dict) -> str:
    tags = {t["key"]: t["value"] for t in run["tags"]}
    if "dagster/partition" in tags:
        return tags["dagster/partition"]
    start = tags.get("dagster/asset_partition_range_start", "?")
    return f"{start} to {tags.get('dagster/asset_partition_range_end', '?')}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cdc_assets.backfill",
        description="Backfill a range of hours of the mirrors through the running webserver.",
    )
    parser.add_argument("--from", dest="first", required=True, metavar="HOUR", help="first hour")
    parser.add_argument("--to", dest="last", required=True, metavar="HOUR", help="last hour")
    parser.add_argument(
        "--table", action="append", help="a mirror table; repeatable (default: every mirror)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="the webserver's host")
    parser.add_argument("--port", type=int, default=3000, help="the webserver's port")
    parser.add_argument(
        "--no-wait", action="store_true", help="print the backfill's id and exit at once"
    )
    args = parser.parse_args(argv)
    server = Webserver(args.host, args.port)
    try:
        first, last = hour_keys_between(args.first, args.last)
        tables = mirror_tables(server, args.table, first, last)
        backfill_id = launch(server, tables, first, last)
        print(f"backfill {backfill_id}: {', '.join(tables)}, {first} to {last}")  # noqa: T201
        print(f"  http://{args.host}:{args.port}/runs/b/{backfill_id}")  # noqa: T201
        if args.no_wait:
            return 0
        state = wait(server, backfill_id)
        runs = sorted(state["runs"] or [], key=run_range)
        for run in runs:
            print(f"  run {run['runId']} {run['status']}: {run_range(run)}")  # noqa: T201
            if run["status"] == "FAILURE":
                try:
                    reason = server.run_failure(run["runId"]) or "no failure event recorded"
                except WebserverError as exc:  # the backfill ran: report it whole anyway
                    reason = f"reason unavailable: {exc}"
                print("    " + reason.replace("\n", "\n    "))  # noqa: T201
    except WebserverError as exc:
        sys.stderr.write(f"cdc_assets.backfill: {exc}\n")
        return 2
    error = (state.get("error") or {}).get("message")
    print(f"backfill {backfill_id} {state['status']}" + (f": {error}" if error else ""))  # noqa: T201
    succeeded = all(run["status"] == "SUCCESS" for run in runs)
    return 0 if state["status"] in SUCCEEDED and succeeded else 1


if __name__ == "__main__":
    sys.exit(main())
