r"""Per-hour check results of one mirror table, from outside the UI.

    python -m checks.report --table orders --from 2026-11-02-06:00 --to 2026-11-02-09:00 \
        [--json report.json] [--tables-file path]

Reads the Dagster instance named by DAGSTER_HOME (the one the webserver and daemon use) and
nothing else: no Kafka, no Spark, no Delta. For each hour in the range (UTC, `--to` inclusive)
and each of the table's checks (those run with every hour's materialization, then the
standalone `retention_risk`), it takes the newest *evaluated* result the instance's event log
holds for that check and hour; a check with no evaluated result for the hour is NOT RUN. A run
that planned a check but never evaluated it (it crashed, or is still running) does not replace
an older result. It prints one line per hour with one column per check, then the failing
checks with their descriptions, and with `--json` also writes every result with its metadata.

The metadata is what the checks record: counts, offsets, thresholds, never row values.
It exits 1 when a check of severity ERROR failed in the range (a WARN one is reported only),
and when no check has a result in the range, saying then which of the table's hours the
instance has.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

import dagster as dg

from cdc_assets.config import (
    DEFAULT_TABLES_FILE,
    TABLES_FILE_ENV,
    TableConfigError,
    TableSpec,
    load_tables,
)
from cdc_assets.hours import hour_key, parse_hour_key
from cdc_assets.partitions import hourly_partitions
from checks.invariants import RETENTION_RISK
from checks.table_checks import run_check_specs

PASSED = "PASSED"
FAILED_ERROR = "FAILED(ERROR)"
FAILED_WARN = "FAILED(WARN)"
NOT_RUN = "NOT RUN"

# Short marks for the table, with the legend printed under it.
MARKS = {PASSED: "ok", FAILED_ERROR: "FAIL", FAILED_WARN: "warn", NOT_RUN: "-"}
LEGEND = "ok passed | FAIL failed, severity ERROR | warn failed, severity WARN | - not run"

_PAGE_SIZE = 100


class ReportError(Exception):
    """A setting the report needs is missing or wrong; the message says which and the fix."""


def check_names(spec: TableSpec) -> list[str]:
    """The table's checks in the order the UI lists them: run checks, then retention_risk."""
    specs = run_check_specs(spec, partitions_def=hourly_partitions(spec))
    return [check.name for check in specs] + [RETENTION_RISK]


def hour_range(first: str, last: str) -> list[str]:
    """The hour keys from `first` to `last`, both included."""
    start, end = _parse_hour(first, "--from"), _parse_hour(last, "--to")
    if end < start:
        raise ReportError(f"--to {last} is before --from {first}; give --from the earlier hour")
    count = int((end - start) / timedelta(hours=1)) + 1
    return [hour_key(start + timedelta(hours=n)) for n in range(count)]


def _parse_hour(value: str, option: str) -> datetime:
    parsed = parse_hour_key(value)
    if parsed is None:
        raise ReportError(
            f"{option} '{value}' is not an hour key; write it like 2026-11-02-06:00 (UTC, on "
            "the hour)"
        )
    return parsed


def _evaluated_records(
    instance: dg.DagsterInstance, check_key: dg.AssetCheckKey, hour: str
) -> Iterator[Any]:
    """The check's evaluated execution records for one hour, newest first.

    Reads dagster internals (as `cdc_assets.factory` does for a range's check results): the
    per-partition, per-status filters of the execution history have no public type. Pages with
    the record id as cursor.
    """
    from dagster._core.event_api import PartitionKeyFilter
    from dagster._core.storage.asset_check_execution_record import (
        COMPLETED_ASSET_CHECK_EXECUTION_RECORD_STATUSES,
    )

    cursor = None
    while True:
        page = instance.event_log_storage.get_asset_check_execution_history(
            check_key,
            limit=_PAGE_SIZE,
            cursor=cursor,
            status=COMPLETED_ASSET_CHECK_EXECUTION_RECORD_STATUSES,
            partition_filter=PartitionKeyFilter(key=hour),
        )
        yield from page
        if len(page) < _PAGE_SIZE:
            return
        cursor = page[-1].id


def _evaluation(record: Any) -> dg.AssetCheckEvaluation | None:
    dagster_event = record.event.dagster_event if record.event else None
    data = dagster_event.event_specific_data if dagster_event else None
    return data if isinstance(data, dg.AssetCheckEvaluation) else None


def build_report(
    instance: dg.DagsterInstance, spec: TableSpec, hours: Sequence[str]
) -> list[dict[str, Any]]:
    """One row per hour and check, hour by hour, checks in `check_names` order.

    Each row: hour, check, status (PASSED, FAILED(ERROR), FAILED(WARN) or NOT RUN), severity,
    description, metadata (plain JSON values), run_id and evaluated_at (ISO, UTC); the last
    five are empty when the check did not run on the hour.
    """
    asset_key = dg.AssetKey(spec.name)
    names = check_names(spec)
    rows = []
    for hour in hours:
        for name in names:
            found = _newest(instance, dg.AssetCheckKey(asset_key, name), hour)
            rows.append(_row(hour, name, found))
    return rows


def _newest(
    instance: dg.DagsterInstance, check_key: dg.AssetCheckKey, hour: str
) -> tuple[Any, dg.AssetCheckEvaluation] | None:
    for record in _evaluated_records(instance, check_key, hour):
        evaluation = _evaluation(record)
        if evaluation is not None:
            return record, evaluation
    return None


def _row(hour: str, check: str, found: tuple[Any, dg.AssetCheckEvaluation] | None) -> dict:
    if found is None:
        return {
            "hour": hour,
            "check": check,
            "status": NOT_RUN,
            "severity": None,
            "description": None,
            "metadata": {},
            "run_id": None,
            "evaluated_at": None,
        }
    record, evaluation = found
    severity = evaluation.severity.value
    return {
        "hour": hour,
        "check": check,
        "status": PASSED if evaluation.passed else f"FAILED({severity})",
        "severity": severity,
        "description": evaluation.description,
        "metadata": plain_metadata(evaluation.metadata),
        "run_id": record.run_id,
        "evaluated_at": _iso(record.event.timestamp),
    }


def _iso(epoch_seconds: float) -> str:
    return datetime.fromtimestamp(epoch_seconds, UTC).isoformat()


def plain_metadata(metadata: Mapping[str, dg.MetadataValue]) -> dict[str, Any]:
    """Metadata as JSON values: each MetadataValue's value, timestamps as ISO strings."""
    return {
        str(name): _iso(value.value)
        if isinstance(value, dg.TimestampMetadataValue)
        else _plain(value.value if isinstance(value, dg.MetadataValue) else value)
        for name, value in metadata.items()
    }


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_plain(v) for v in value]
    if isinstance(value, datetime | date):
        return value.isoformat()
    return str(value)


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """One line per hour, one column of status marks per check, a legend, then the failures."""
    hours = list(dict.fromkeys(row["hour"] for row in rows))
    checks = list(dict.fromkeys(row["check"] for row in rows))
    status = {(row["hour"], row["check"]): row["status"] for row in rows}
    hour_width = max([len("hour"), *(len(h) for h in hours)])
    widths = [max(len(c), *(len(m) for m in MARKS.values())) for c in checks]

    def line(first: str, cells: Sequence[str]) -> str:
        padded = [cell.ljust(width) for cell, width in zip(cells, widths, strict=True)]
        return "  ".join([first.ljust(hour_width), *padded]).rstrip()

    lines = [line("hour", checks)]
    for hour in hours:
        lines.append(line(hour, [MARKS[status.get((hour, c), NOT_RUN)] for c in checks]))
    lines += ["", LEGEND, ""]
    failing = [row for row in rows if row["status"] in (FAILED_ERROR, FAILED_WARN)]
    if all(row["status"] == NOT_RUN for row in rows):
        lines.append("No check ran on these hours.")
    elif not failing:
        lines.append("No failing checks.")
    else:
        lines.append(f"Failing checks ({len(failing)}):")
        lines += [
            f"  {row['hour']}  {row['check']}  {row['status']}: "
            f"{' '.join((row['description'] or '(no description)').split())}"
            for row in failing
        ]
    return "\n".join(lines) + "\n"


def _table_spec(name: str, tables_file: str | None) -> TableSpec:
    path = tables_file or os.environ.get(TABLES_FILE_ENV) or str(DEFAULT_TABLES_FILE)
    try:
        specs = load_tables(path)
    except TableConfigError as exc:
        raise ReportError(str(exc)) from None
    by_name = {spec.name: spec for spec in specs}
    if name not in by_name:
        raise ReportError(
            f"--table '{name}' is not in the tables file {path}; use one of "
            f"{', '.join(sorted(by_name))}, or name another file with --tables-file "
            f"(or {TABLES_FILE_ENV})"
        )
    return by_name[name]


def _check_first_hour(spec: TableSpec, hours: Sequence[str]) -> None:
    if hours and hours[0] < spec.start_hour:  # same fixed-width format: text order is time order
        raise ReportError(
            f"--from {hours[0]} is before the first partition of table '{spec.name}' "
            f"(start_hour {spec.start_hour}); start the range there or later"
        )


def open_instance() -> dg.DagsterInstance:
    """The instance of DAGSTER_HOME (relative to the current directory, or absolute), refusing a
    home that is unset or holds no instance."""
    fix = "set it to the Dagster instance directory the webserver and daemon use"
    home = os.environ.get("DAGSTER_HOME", "").strip()
    if not home:
        raise ReportError(f"DAGSTER_HOME is not set; {fix}")
    # A relative home (the README's `DAGSTER_HOME=.local/dagster`) is the one under the current
    # directory; Dagster itself takes only absolute paths, so it is given the resolved one.
    path = Path(home).expanduser().absolute()
    if not path.is_dir():
        raise ReportError(f"DAGSTER_HOME '{home}' is not a directory; {fix}")
    # Opening a directory that holds nothing would create an empty instance there, and every
    # check would read NOT RUN. An instance has its dagster.yaml or, after a run, its storage.
    if not any((path / entry).exists() for entry in ("dagster.yaml", "history", "storage")):
        raise ReportError(
            f"DAGSTER_HOME '{home}' holds no Dagster instance (no dagster.yaml, no runs); {fix}"
        )
    os.environ["DAGSTER_HOME"] = str(path)
    try:
        instance = dg.DagsterInstance.get()
    except dg.DagsterError as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ReportError(
            f"DAGSTER_HOME '{home}': cannot open the instance: {first_line}"
        ) from None
    if not instance.event_log_storage.supports_asset_checks:
        instance.dispose()
        raise ReportError(
            f"the instance at DAGSTER_HOME '{home}' cannot store asset checks; run "
            "`dagster instance migrate` with the same DAGSTER_HOME"
        )
    return instance


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m checks.report",
        description="Print the check results of one table per hour, from DAGSTER_HOME's instance.",
    )
    parser.add_argument("--table", required=True, help="table name, as in the tables file")
    parser.add_argument("--from", dest="first", required=True, metavar="HOUR", help="first hour")
    parser.add_argument("--to", dest="last", required=True, metavar="HOUR", help="last hour")
    parser.add_argument("--json", dest="json_path", metavar="PATH", help="also write JSON here")
    parser.add_argument(
        "--tables-file", help=f"tables YAML (default: ${TABLES_FILE_ENV} or the packaged one)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The command: exit 0 with the report printed, 1 when a check of severity ERROR failed in
    the range or no check of it has a result (saying which hours the instance has), 2 on a
    setting to fix."""
    args = _parser().parse_args(argv)
    try:
        hours = hour_range(args.first, args.last)
        spec = _table_spec(args.table, args.tables_file)
        _check_first_hour(spec, hours)
        instance = open_instance()
        try:
            rows = build_report(instance, spec, hours)
            nothing = None
            if all(row["status"] == NOT_RUN for row in rows):
                nothing = _why_nothing(instance, spec, hours)
        finally:
            instance.dispose()
    except ReportError as exc:
        sys.stderr.write(f"checks.report: {exc}\n")
        return 2
    print(f"{spec.name}: checks per hour, {hours[0]} to {hours[-1]} (UTC)\n")  # noqa: T201
    print(format_table(rows), end="")  # noqa: T201
    if args.json_path:
        report = {"table": spec.name, "from": hours[0], "to": hours[-1], "rows": rows}
        Path(args.json_path).write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nWrote {len(rows)} results to {args.json_path}")  # noqa: T201
    if nothing:
        sys.stderr.write(f"checks.report: {nothing}\n")
        return 1
    failed = sum(row["status"] == FAILED_ERROR for row in rows)
    if failed:
        # A failed ERROR check needs a person (a WARN one is reported, not a failure).
        sys.stderr.write(
            f"checks.report: {failed} check result(s) of severity ERROR failed in the range\n"
        )
        return 1
    return 0


def _why_nothing(instance: dg.DagsterInstance, spec: TableSpec, hours: Sequence[str]) -> str:
    """Why no check has a result in `hours`: which of the table's hours the instance has."""
    done = sorted(instance.get_materialized_partitions(dg.AssetKey(spec.name)))
    where = f"the instance at DAGSTER_HOME={os.environ.get('DAGSTER_HOME', '')}"
    if not done:
        return (
            f"{where} has no materialization of table '{spec.name}'; give DAGSTER_HOME the "
            "instance the webserver and daemon use (the demo's: $PWD/.local/dagster)"
        )
    return (
        f"no check of table '{spec.name}' has a result from {hours[0]} to {hours[-1]}; "
        f"{where} has its hours from {done[0]} to {done[-1]} materialized ({len(done)} hours)"
    )


if __name__ == "__main__":
    sys.exit(main())
