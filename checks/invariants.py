"""The pipeline's own invariants as asset checks, evaluated on every hour a run materializes.

`complete_hour` (I5), `accounting` (I2), `continuity` (I1), `changes_readable` and
`error_rate` (I7), `freshness`, `schema_drift`, `toasted_values` (tables with
`toasted_columns`), `history` (tables with `history: true`), each from the hour's result
(`<check>_result`); and `retention_risk` (I6), a separate, partitioned check that reads the
hour's recorded slice from the Delta log, so it can be re-run any time. Severity, blocking and
thresholds come from the table's `checks:` settings.

The `accounting` figures are counted apart (`HourCounts`): consumed by the reader, superseded
on the batch, applied and stale from the MERGE's operation metrics; so a record the decoder
dropped, or a key the newest-change-per-key step lost or doubled, breaks the identity.

What fails each check, and its defaults: docs/checks.md, 'The checks every table has'.
"""

from __future__ import annotations

from datetime import datetime, timedelta

import dagster as dg

from cdc_assets.config import (
    CheckPolicy,
    ErrorRatePolicy,
    FreshnessPolicy,
    RetentionPolicy,
    TableSpec,
)
from cdc_assets.hours import hour_start
from cdc_assets.results import HourResult
from resources.kafka import TopicRetention

COMPLETE_HOUR = "complete_hour"
ACCOUNTING = "accounting"
CONTINUITY = "continuity"
ERROR_RATE = "error_rate"
FRESHNESS = "freshness"
SCHEMA_DRIFT = "schema_drift"
RETENTION_RISK = "retention_risk"
CHANGES_READABLE = "changes_readable"
TOASTED_VALUES = "toasted_values"
HISTORY = "history"

DESCRIPTIONS = {
    COMPLETE_HOUR: "The hour had closed when it was read: not a partial, forced-open hour (I5).",
    ACCOUNTING: "Every consumed message is applied, superseded, stale, a tombstone or an error.",
    CONTINUITY: "The hour starts where the previous hour ended, partition by partition (I1).",
    ERROR_RATE: "The share of the hour's records quarantined in the error table is within bounds.",
    FRESHNESS: "The newest source change in the mirror trails the hour's end by the allowed lag.",
    SCHEMA_DRIFT: (
        "The source sends exactly the declared columns, with compatible types; a column added "
        "to the source later with a DEFAULT has it declared too."
    ),
    RETENTION_RISK: "Kafka still holds the hour's offsets long enough to replay it (I6).",
    CHANGES_READABLE: "Not every change of the hour went to the error table (something applied).",
    TOASTED_VALUES: "Live rows hold known values of their unchanged TOASTed columns.",
    HISTORY: (
        "The hour reached the history: its log holds the commit of this run (the mirror's "
        "record), with no more new versions than the hour's changes. Every key's versions "
        "against the mirror are judged by the daily history_table check."
    ),
}
# Checks computed inside the asset's run, from what the run saw.
RUN_CHECKS = (
    COMPLETE_HOUR,
    ACCOUNTING,
    CONTINUITY,
    CHANGES_READABLE,
    ERROR_RATE,
    FRESHNESS,
    SCHEMA_DRIFT,
)


def run_checks(spec: TableSpec) -> tuple[str, ...]:
    """The invariant checks a run of `spec` evaluates (toasted_values only where it applies)."""
    return (
        *RUN_CHECKS,
        *((TOASTED_VALUES,) if spec.toasted_columns else ()),
        *((HISTORY,) if spec.history else ()),
    )


def _verdict(
    name: str, policy: CheckPolicy, problems: list[str], metadata: dict, note: str | None = None
) -> dg.AssetCheckResult:
    """Passed when there are no problems; the description lists them (or says `note`)."""
    return dg.AssetCheckResult(
        check_name=name,
        passed=not problems,
        severity=dg.AssetCheckSeverity(policy.severity),
        description="; ".join(problems) or note,
        metadata=metadata,
    )


def _offsets(by_partition: dict[int, int]) -> dg.MetadataValue:
    return dg.MetadataValue.json({str(p): o for p, o in sorted(by_partition.items())})


def invariant_check_specs(
    spec: TableSpec, *, asset_key: dg.AssetKey, partitions_def: dg.PartitionsDefinition
) -> list[dg.AssetCheckSpec]:
    return [
        dg.AssetCheckSpec(
            name,
            asset=asset_key,
            partitions_def=partitions_def,
            blocking=getattr(spec.checks, name).blocking,
            description=DESCRIPTIONS[name],
        )
        for name in run_checks(spec)
    ]


def complete_hour_result(result: HourResult, policy: CheckPolicy) -> dg.AssetCheckResult:
    problems = []
    if result.partial:
        problems.append(
            f"hour {result.hour_key} was read while still open ({result.slice.open_reason}); "
            "the result is partial. Run the hour again after it closes to complete it (a "
            "tier-0 table's offset sensor does, reading on from this run's end)."
        )
    return _verdict(
        COMPLETE_HOUR,
        policy,
        problems,
        {
            "partial_hour": result.partial,
            "hour_end": dg.MetadataValue.timestamp(result.slice.hour_end),
        },
    )


def accounting_result(result: HourResult, policy: CheckPolicy) -> dg.AssetCheckResult:
    counts = result.counts
    parts = {
        "applied": counts.applied,
        "superseded": counts.superseded,
        "stale": counts.stale,
        "tombstones": counts.tombstones,
        "errors": counts.errors,
    }
    negative = sorted(name for name, value in parts.items() if value < 0)
    accounted = sum(parts.values())
    gaps = result.slice.size - counts.consumed
    problems = []
    if accounted != counts.consumed:
        problems.append(f"consumed {counts.consumed} but accounted for {accounted}")
    if counts.distinct_keys != counts.merge_source_rows:
        problems.append(
            f"the hour's changes have {counts.distinct_keys} distinct keys but the MERGE took "
            f"{counts.merge_source_rows} source rows (one newest change per key expected)"
        )
    if negative:
        problems.append(f"negative counts: {', '.join(negative)}")
    if gaps < 0:
        problems.append(f"read {counts.consumed} messages from a slice of {result.slice.size}")
    census = counts.census
    gap_figures: dict = {}
    if gaps > 0 and census is None:
        problems.append(
            f"{gaps} offsets of the slice gave the reader no record, and Kafka's own count of "
            "the slice is missing: nothing says they are transaction markers or aborted records"
        )
    elif gaps > 0:
        if census.committed != counts.consumed:
            problems.append(
                f"Kafka holds {census.committed} committed records in the slice's offsets but "
                f"the run read {counts.consumed}: records were lost between Kafka and the "
                "decoder (or read twice); run the hour again"
            )
        gap_figures = {
            "transaction_markers": result.slice.size - census.uncommitted,
            "aborted_records": census.uncommitted - census.committed,
        }
    return _verdict(
        ACCOUNTING,
        policy,
        problems,
        {
            "consumed": counts.consumed,
            "accounted": accounted,
            **parts,
            "distinct_keys": counts.distinct_keys,
            "merge_source_rows": counts.merge_source_rows,
            "slice_offsets": result.slice.size,
            "offset_gaps": gaps,
            **gap_figures,
        },
    )


def continuity_result(result: HourResult, policy: CheckPolicy) -> dg.AssetCheckResult:
    # The hour's start, also when a refresh read its beginning and this run the rest.
    starts = result.hour_start_offsets()
    log_starts = {p.partition: p.log_start for p in result.slice.partitions}
    previous = result.previous_end
    metadata = {"start_offsets": _offsets(starts)}
    if previous is None:
        return _verdict(
            CONTINUITY,
            policy,
            [],
            {**metadata, "previous_hour_recorded": False},
            note="The previous hour has no recorded run; nothing to compare with.",
        )
    problems = []
    for partition in sorted(set(starts) | set(previous)):
        start, end = starts.get(partition), previous.get(partition)
        if start is None:
            problems.append(f"partition {partition} ended the previous hour at {end} but is gone")
        elif end is None:
            if start > log_starts[partition]:
                problems.append(
                    f"partition {partition} is new since the previous hour: gap, offsets "
                    f"[{log_starts[partition]}, {start}) belong to no hour"
                )
        elif start > end:
            problems.append(f"partition {partition}: gap, offsets [{end}, {start}) were skipped")
        elif start < end:
            problems.append(f"partition {partition}: overlap, offsets [{start}, {end}) read twice")
    return _verdict(
        CONTINUITY,
        policy,
        problems,
        {
            **metadata,
            "previous_hour_recorded": True,
            "previous_end_offsets": _offsets(previous),
            "partitions_with_gap_or_overlap": len(problems),
        },
    )


def error_rate_result(result: HourResult, policy: ErrorRatePolicy) -> dg.AssetCheckResult:
    """The share of the hour's changes sent to the error table, against `max_share`; the
    description names the most frequent reasons, each of which says what to fix."""
    consumed, errors = result.counts.consumed, result.counts.errors
    changes = consumed - result.counts.tombstones
    share = errors / changes if changes else 0.0
    problems = []
    if share > policy.max_share:
        top = sorted(result.error_reasons.items(), key=lambda item: -item[1])[:3]
        reasons = "; ".join(f"{n} x {reason}" for reason, n in top)
        problems.append(
            f"{errors} of {changes} changes ({share:.2%}) of hour {result.hour_key} went to the "
            f"error table `{result.table}__errors`, above the table's {policy.max_share:.2%} "
            f"(checks: error_rate: max_share). Most frequent: {reasons}. Fix what the reasons "
            "name and run the hour again (python -m cdc_assets.error_replay replays the error "
            "rows once fixed); to accept such hours, set checks: error_rate: {severity: WARN} "
            "for the table"
        )
    return _verdict(
        ERROR_RATE,
        policy,
        problems,
        {
            "errors": errors,
            "consumed": consumed,
            "changes": changes,
            "error_share": dg.MetadataValue.float(round(share, 6)),
            "max_share": dg.MetadataValue.float(float(policy.max_share)),
            "error_reasons": dg.MetadataValue.json(result.error_reasons),
        },
    )


def freshness_result(
    result: HourResult, policy: FreshnessPolicy, *, mirror_newest: datetime | None
) -> dg.AssetCheckResult:
    """Lag at the hour's end: a past hour is judged by what the mirror held once it closed."""
    reference = min(result.finished_at, result.slice.hour_end)
    allowed = timedelta(minutes=policy.max_lag_minutes)
    metadata: dict = {"max_lag_minutes": policy.max_lag_minutes}
    if mirror_newest is None:
        note = "The mirror holds no change with a source timestamp yet."
        return _verdict(FRESHNESS, policy, [], metadata, note=note)
    lag = max(reference - mirror_newest, timedelta(0))
    problems = []
    if lag > allowed:
        problems.append(
            f"the newest source change in the mirror is {lag} older than "
            f"{reference.isoformat()}, more than the allowed {allowed}"
        )
    return _verdict(
        FRESHNESS,
        policy,
        problems,
        {
            **metadata,
            "lag_minutes": dg.MetadataValue.float(round(lag.total_seconds() / 60, 2)),
            "newest_source_ts": dg.MetadataValue.timestamp(mirror_newest),
        },
    )


def schema_drift_result(
    result: HourResult, spec: TableSpec, policy: CheckPolicy
) -> dg.AssetCheckResult:
    shape = result.source_fields
    observed = {column: sorted(kinds) for column, kinds in shape.fields.items()}
    metadata: dict = {
        "source_columns": dg.MetadataValue.json(observed),
        "connect_schema": dg.MetadataValue.text(
            {frozenset({True}): "yes", frozenset({False}): "no"}.get(
                frozenset(shape.schemas), "mixed"
            )
        ),
    }
    if not observed:
        note = "No insert, update or snapshot row in this hour to compare."
        return _verdict(SCHEMA_DRIFT, policy, [], metadata, note=note)
    appeared = sorted(set(observed) - set(spec.columns))
    vanished = sorted(set(spec.columns) - set(observed))
    changed = {column: sorted(reasons) for column, reasons in sorted(shape.drifted().items())}
    problems = []
    if appeared:
        problems.append(f"columns not in the tables file appeared: {', '.join(appeared)}")
    if result.withheld_columns:
        problems.append(
            f"not stored: {', '.join(result.withheld_columns)}; the table has sensitive columns, "
            "so new_columns: add waits until a column is declared under columns (marked "
            "sensitive or not)"
        )
    if vanished:
        problems.append(
            f"declared columns the hour's rows lack: {', '.join(vanished)} (added to the source "
            "after these changes were written, which then take the column's default, or no "
            "longer sent)"
        )
    problems += [reason for reasons in changed.values() for reason in reasons]
    lacked = sorted({*result.columns_lacked, *shape.absent})
    undeclared_defaults = _undeclared_defaults(shape, spec, lacked)
    if undeclared_defaults:
        problems.append(
            f"the source's schema gives {', '.join(undeclared_defaults)} a default that the "
            "tables file does not declare, and changes the mirror took were written before the "
            "source table had the column (ALTER TABLE ... ADD COLUMN): the rows they wrote hold "
            "null where the source shows the default. Declare it under columns as {type: ..., "
            "default: ...} with the default the connector's schema shows; rows written so keep "
            "null until a change or a re-snapshot of the table rewrites them"
        )
    return _verdict(
        SCHEMA_DRIFT,
        policy,
        problems,
        {
            **metadata,
            "appeared": ", ".join(appeared),
            "vanished": ", ".join(vanished),
            "type_changed": dg.MetadataValue.json(changed),
            "withheld_columns": ", ".join(result.withheld_columns),
            "undeclared_defaults": ", ".join(undeclared_defaults),
            "columns_some_changes_lack": ", ".join(lacked),
        },
    )


def _undeclared_defaults(shape, spec: TableSpec, lacked: list[str]) -> list[str]:
    """Declared columns whose default the source's schema shows and the tables file lacks, that
    some change the mirror took was written without (`lacked`). A column the source had from
    the mirror's first change on is in every change: no row holds null for want of a default."""
    return sorted(
        column
        for column in shape.source_defaults()
        if column in spec.columns
        and column in lacked
        and column not in {*spec.defaults, *spec.sensitive, *spec.primary_key}
    )


def changes_readable_result(result: HourResult, policy: CheckPolicy) -> dg.AssetCheckResult:
    """Fails when the hour had changes and every one of them went to the error table.

    Such an hour applied nothing: most likely the table's config does not match what the
    connector sends, and the top reason says how to fix it.
    """
    counts = result.counts
    changes = counts.consumed - counts.tombstones
    problems = []
    if changes and counts.errors >= changes:
        top = max(result.error_reasons.items(), key=lambda item: item[1], default=None)
        problems.append(
            f"all {changes} changes of hour {result.hour_key} went to the error table "
            f"`{result.table}__errors`, nothing was applied"
            + (f"; the most frequent reason ({top[1]}): {top[0]}" if top else "")
        )
    return _verdict(
        CHANGES_READABLE,
        policy,
        problems,
        {"changes": changes, "errors": counts.errors},
        note=None if changes else "No change in this hour.",
    )


def toasted_values_result(
    result: HourResult, policy: CheckPolicy, *, unknown: dict[str, int]
) -> dg.AssetCheckResult:
    """Live rows whose unchanged TOASTed value could not be carried over (flagged, not null)."""
    problems = [
        f"{count} live rows hold no known value of '{column}' (_cdc_unknown__{column} is true): "
        "a change left it unchanged and no earlier value reached the mirror. Set the source "
        "table's REPLICA IDENTITY FULL, or re-snapshot it"
        for column, count in sorted(unknown.items())
        if count
    ]
    return _verdict(
        TOASTED_VALUES,
        policy,
        problems,
        {f"unknown_{column}": count for column, count in sorted(unknown.items())},
    )


def history_result(result: HourResult, policy: CheckPolicy) -> dg.AssetCheckResult:
    """The history stage's verdict for the hour (`cdc_assets.history`), from the batch and
    the tables' logs, no scan: the history's log holds a commit of this run's record (the one
    the mirror's commit holds, so the two tables took the same slice and counts), and its MERGE
    inserted no more versions than the hour has (counted on the batch). With tracked columns
    the versions counted are the changes' (`<table>__history_changes`), and the folded
    history's log must hold the run too. The versions against the mirror, whole, are judged
    once a day (`checks.daily`)."""
    run = result.history
    if run is None:
        return _verdict(HISTORY, policy, [], {"versions": 0}, note="No change in this hour.")
    outcome, folded = run.outcome, run.folded
    problems = list(outcome.problems)
    if folded is not None and folded.recorded_version is None:
        problems.append(
            "the folded history's log holds no commit of this run: its fold did not commit (run "
            "the hour again: it folds the keys' changes again)"
        )
    metadata = {
        "versions": outcome.versions,
        "versions_opened": outcome.opened,
        "versions_rewritten": outcome.rewritten,
        "versions_filled_from_moves": outcome.filled_from_moves,
        "replayed": outcome.replayed,
    }
    if folded is None:
        if outcome.recorded_version is not None:
            metadata["history_version"] = outcome.recorded_version
    else:  # tracked columns: the changes' table, then the versions folded from it
        metadata |= {
            "tracked_versions_of_keys": folded.versions,
            "tracked_versions_inserted": folded.inserted,
            "tracked_versions_updated": folded.updated,
            "tracked_versions_joined": folded.deleted,
        }
        if outcome.recorded_version is not None:
            metadata["history_changes_version"] = outcome.recorded_version
        if folded.recorded_version is not None:
            metadata["history_version"] = folded.recorded_version
    return _verdict(HISTORY, policy, problems, metadata)


def retention_risk_result(
    *,
    hour_key: str,
    recorded_starts: dict[int, int] | None,
    log_starts: dict[int, int],
    retention: TopicRetention,
    now: datetime,
    policy: RetentionPolicy,
) -> dg.AssetCheckResult:
    """Whether the hour's recorded start offsets are still in Kafka, and for how long.

    Kafka deletes a segment once its newest record is older than retention.ms; the hour's
    records are stamped at or after its start, so they stay at least until start + retention.
    """
    metadata: dict = {
        "retention_ms": -1 if retention.retention_ms is None else retention.retention_ms,
        "retention_bytes": -1 if retention.retention_bytes is None else retention.retention_bytes,
        "compacted": retention.compacted,
        "min_hours_left": dg.MetadataValue.float(float(policy.min_hours_left)),
    }
    if recorded_starts is None:
        unknown = f"hour {hour_key} has no recorded run, so its offsets are unknown"
        return _verdict(RETENTION_RISK, policy, [unknown], metadata)
    deleted = {
        p: (start, log_starts[p])
        for p, start in sorted(recorded_starts.items())
        if p in log_starts and start < log_starts[p]
    }
    metadata["start_offsets"] = _offsets(recorded_starts)
    metadata["log_start_offsets"] = _offsets(log_starts)
    problems = [
        f"partition {p}: offsets [{start}, {log_start}) are already deleted"
        for p, (start, log_start) in deleted.items()
    ]
    if problems:
        problems.append("the hour can no longer be replayed from Kafka")
    elif retention.retention_ms is not None:
        expires = hour_start(hour_key) + timedelta(milliseconds=retention.retention_ms)
        hours_left = (expires - now).total_seconds() / 3600
        metadata["hours_left"] = dg.MetadataValue.float(round(hours_left, 2))
        if hours_left < policy.min_hours_left:
            problems.append(
                f"Kafka may delete the hour's offsets from {expires.isoformat()} "
                f"({hours_left:.1f} h from now, fewer than {policy.min_hours_left:g})"
            )
    return _verdict(RETENTION_RISK, policy, problems, metadata)
