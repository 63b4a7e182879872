"""Materializes hours of the mirror assets through a running Dagster webserver's GraphQL API,
as the UI's Materialize button does, and reports each run's wall time.

    python -m demo.ui_materialize --hour 2026-11-21-21:00 [--host 127.0.0.1 --port 3000]

Used to check the demo end to end and to time one demo hour (queue to success). An hour a
table has no partition for, or its hour still open, is refused before anything is launched; a
run that fails is printed with its reason, and the command exits 1.
"""

from __future__ import annotations

import argparse
import sys
import time

from dagster_graphql import DagsterGraphQLClient, DagsterGraphQLClientError

from cdc_assets.backfill import MIRRORS_GROUP
from cdc_assets.webserver import Webserver, WebserverError, refuse_hours

ASSETS = ("customers", "orders", "order_items")
DONE = {"SUCCESS", "FAILURE", "CANCELED"}


def materialize(
    client: DagsterGraphQLClient, hour: str, assets: tuple[str, ...]
) -> tuple[str, str, float]:
    """Launches one run of `assets` for partition `hour`; returns (run id, status, seconds)."""
    started = time.monotonic()
    run_id = client.submit_job_execution(
        "__ASSET_JOB",
        tags={"dagster/partition": hour},
        asset_selection=[[name] for name in assets],
    )
    status = "QUEUED"
    while status not in DONE:
        time.sleep(1)
        status = client.get_run_status(run_id).value
    return run_id, status, time.monotonic() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hour", action="append", required=True, help="partition key; repeatable")
    parser.add_argument("--asset", action="append", help="asset name; default: all three")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=3000)
    args = parser.parse_args(argv)
    client = DagsterGraphQLClient(args.host, port_number=args.port)
    server = Webserver(args.host, args.port)
    assets = tuple(args.asset or ASSETS)
    failed = False
    try:
        partitions = server.partition_keys(MIRRORS_GROUP)
        unknown = [name for name in assets if name not in partitions]
        if unknown:
            raise WebserverError(
                f"no mirror table named {', '.join(unknown)}; the code location's tables are "
                f"{', '.join(sorted(partitions))}"
            )
        for hour in args.hour:
            refuse_hours({name: partitions[name] for name in assets}, hour, hour)
        for hour in args.hour:
            try:
                run_id, status, seconds = materialize(client, hour, assets)
            except DagsterGraphQLClientError as exc:
                print(f"{hour}: could not launch: {exc}", file=sys.stderr)
                return 1
            print(f"{hour}: run {run_id} {status} in {seconds:.1f} s")
            if status != "SUCCESS":
                failed = True
                reason = server.run_failure(run_id) or "no failure event recorded"
                print("  " + reason.replace("\n", "\n  "))
    except WebserverError as exc:
        print(f"demo.ui_materialize: {exc}", file=sys.stderr)
        return 2
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
