"""The asset factory: the mirror assets of the table specs, by one builder.

`build_mirror_assets` makes one multi-asset per set of tables with the same first hour and
pool (hourly or tier-0), each table its own hourly-partitioned asset. A run materializes any
of its tables over one hour or a range, by a `MirrorRunner`: in this process (`IN_PROCESS`: the
tables in parallel on the run's Spark session) or through Pipes (`emr.assets.PIPES`). Each
hour is still its own slice, MERGE commit, metadata and check results (`cdc_assets.reporting`),
so a range gives exactly what running its hours one by one gives.
"""

import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import dagster as dg
from pydantic import Field

from cdc_assets import rule
from cdc_assets.checking import MirrorChecks
from cdc_assets.config import TableSpec
from cdc_assets.fleet import TableRun, TableWork, run_tables
from cdc_assets.hour_run import SequenceConfigError, TruncateError
from cdc_assets.masking import MaskedMirrorError
from cdc_assets.merge import MirrorSettingError
from cdc_assets.partitions import (
    REFRESH_TAG,
    SENSOR_TRIGGER,
    TIER0_POOL,
    TRIGGER_TAG,
    hourly_partitions,
    mirrors_pool,
)
from cdc_assets.reporting import (
    HourReport,
    hour_summary,
    partial_warning,
    report_done_hours,
    report_hours,
    result_metadata,
)
from cdc_assets.sealing import ErrorTableSealingError
from cdc_assets.slicing import OpenHourError, SliceError
from resources.lake import LakeConfigError, LakeResource
from resources.masking import HmacKey, MaskingKeyError
from resources.spark import SparkResource


class HourRunConfig(dg.Config):
    force_open_hour: bool = Field(
        default=False,
        description=(
            "Slice an hour that has not closed yet. The result is marked partial; run the hour "
            "again after it closes to complete it."
        ),
    )


# A wrong slice or config: retrying can't help (the hour is open, its offsets are gone, the
# config is wrong), so a run failing with one of these is not retried.
NOT_RETRIED: tuple[type[Exception], ...] = (
    SliceError,
    SequenceConfigError,
    TruncateError,
    MaskedMirrorError,
    ErrorTableSealingError,
    LakeConfigError,
    MirrorSettingError,
)


def asset_description(spec: TableSpec) -> str:
    """The mirror asset's description, as the UI shows it."""
    description = (
        f"{spec.description or f'Mirror of the source table behind {spec.topic}.'}\n\n"
        f"Delta mirror of Kafka topic `{spec.topic}` (Debezium change events), key "
        f"{', '.join(spec.primary_key)}. {rule.describe(spec)} Bad records go to "
        f"`{spec.error_table_name}`."
    )
    if spec.sensitive:
        masked = ", ".join(f"{column} ({mode})" for column, mode in spec.sensitive.items())
        description += (
            f" Sensitive columns are masked before anything stores them: {masked}; hashed "
            "columns hold HMAC-SHA256 hex strings. The error table's raw bytes are sealed "
            "(AES-256-SIV), and undeclared source columns are not stored until declared."
        )
    return description


def hour_failure(message: str, done: list[str]) -> dg.Failure:
    """The failure of an hour that retrying can't fix; `done`: the run's earlier hours."""
    written = ""
    if done:
        written = (
            f" The run's earlier hours {done[0]} to {done[-1]} are "
            "committed to Delta; running them again finds their changes already applied."
        )
    return dg.Failure(description=f"{message}{written}", allow_retries=False)


@dataclass(frozen=True)
class MirrorsRun:
    """One run of a mirrors asset, as its runner gets it: the selected tables, each with the
    hours this run (or this attempt of it) still has to materialize, and their checks."""

    work: list[tuple[TableSpec, list[str]]]
    config: HourRunConfig
    checks: MirrorChecks
    check_specs: Mapping[str, list[dg.AssetCheckSpec]]


@dataclass(frozen=True)
class MirrorRunner:
    """How a mirrors asset's run materializes its tables' hours: `run` yields the run's events
    (`report_hours`); `resources(specs)` are the resources it uses for those tables; `note`
    ends the assets' descriptions. In this process (`IN_PROCESS`) or as Pipes jobs
    (`emr.assets.PIPES`)."""

    run: Callable[[dg.AssetExecutionContext, MirrorsRun], Iterator]
    resources: Callable[[Sequence[TableSpec]], set[str]]
    note: str = ""


def build_mirror_assets(
    specs: Sequence[TableSpec], *, checks: MirrorChecks, runner: MirrorRunner | None = None
) -> list[dg.AssetsDefinition]:
    """The mirrors of `specs`: one multi-asset per set of tables whose hourly partitions start
    at the same hour and which share a pool (hourly or tier-0, `mirrors_pool`), each table
    still its own asset (partitions, checks, metadata). Each hour of a table is audited,
    validated and checked by `checks` (`checks.table_checks`).

    A run materializes any subset of its tables over one hour or a range, by `runner` (in this
    process by default: the tables in parallel on the run's Spark session, `cdc_assets.fleet`);
    each table-hour is its own materialization, check results and Delta commit.
    """
    groups: dict[tuple[str, str], list[TableSpec]] = {}
    for spec in specs:
        groups.setdefault((spec.start_hour, mirrors_pool(spec)), []).append(spec)
    starts = len({start for start, _ in groups})
    return [
        _mirrors_asset(
            group, name=_op_name(group, starts), checks=checks, runner=runner or IN_PROCESS
        )
        for group in groups.values()
    ]


def _op_name(group: list[TableSpec], starts: int) -> str:
    """A table alone is named after itself; a set of tables `mirrors` (with their first hour
    when the sets start at several hours, and `_tier0` for tier-0 tables)."""
    if len(group) == 1:
        return group[0].name
    start = group[0].start_hour
    name = f"mirrors_{start[:10].replace('-', '')}_{start[11:13]}" if starts > 1 else "mirrors"
    return name + ("_tier0" if mirrors_pool(group[0]) == TIER0_POOL else "")


def build_table_asset(*, spec: TableSpec, checks: MirrorChecks) -> dg.AssetsDefinition:
    """The hourly Delta mirror of `spec.topic` alone (a mirrors multi-asset of one table)."""
    (asset,) = build_mirror_assets([spec], checks=checks)
    return asset


def _asset_spec(
    spec: TableSpec, partitions_def: dg.PartitionsDefinition, note: str
) -> dg.AssetSpec:
    return dg.AssetSpec(
        key=spec.name,
        description=asset_description(spec) + note,
        group_name=spec.group,
        partitions_def=partitions_def,
        kinds={"kafka", "spark", "delta"},
        # A run may carry only some of its tables' hours (a failed table's, say).
        skippable=True,
        metadata={
            "kafka_topic": spec.topic,
            "primary_key": ", ".join(spec.primary_key),
            "delete_mode": spec.delete_mode,
            "error_table": spec.error_table_name,
            # Names and modes only: what is masked, never a value.
            **({"sensitive_columns": dict(spec.sensitive)} if spec.sensitive else {}),
        },
    )


def _mirrors_asset(
    specs: list[TableSpec], *, name: str, checks: MirrorChecks, runner: MirrorRunner
) -> dg.AssetsDefinition:
    partitions_def = hourly_partitions(specs[0])
    checks_of = {
        spec.name: checks.check_specs(spec, partitions_def=partitions_def) for spec in specs
    }
    by_key = {dg.AssetKey(spec.name): spec for spec in specs}

    def _mirrors(context: dg.AssetExecutionContext, config: HourRunConfig) -> Iterator:
        selected = [spec for key, spec in by_key.items() if key in context.selected_asset_keys]
        _refuse_hours_outside(context.partition_key_range, partitions_def, selected)
        done = _materialized_in_this_run(context) if context.retry_number else set()
        work = [
            (spec, [h for h in context.partition_keys if (spec.name, h) not in done])
            for spec in selected
        ]
        work = [(spec, hours) for spec, hours in work if hours]
        if context.run.tags.get(REFRESH_TAG) == "true":  # the sensor's refresh of an open hour
            config = HourRunConfig(force_open_hour=True)
        yield from runner.run(context, MirrorsRun(work, config, checks, checks_of))

    with warnings.catch_warnings():
        # BackfillPolicy is a beta API; dagster is pinned, so the warning says nothing new.
        warnings.filterwarnings("ignore", category=dg.BetaWarning, message=".*backfill_policy")
        return dg.multi_asset(
            name=name,
            specs=[_asset_spec(spec, partitions_def, runner.note) for spec in specs],
            check_specs=[check for checks in checks_of.values() for check in checks],
            can_subset=True,
            partitions_def=partitions_def,
            # One writer per table: every run that writes these mirrors, and their
            # maintenance, holds this pool (limit 1).
            pool=mirrors_pool(specs[0]),
            # A backfill runs as few runs as possible, each over a bounded range of hours.
            backfill_policy=dg.BackfillPolicy.multi_run(
                max_partitions_per_run=min(spec.hours_per_run for spec in specs)
            ),
            # Transient failures (a broker or Spark hiccup) are retried, and a retry runs only
            # the table-hours not yet materialized; a wrong slice or config is not retried.
            retry_policy=dg.RetryPolicy(
                max_retries=2, delay=20, backoff=dg.Backoff.EXPONENTIAL, jitter=dg.Jitter.PLUS_MINUS
            ),
            required_resource_keys=runner.resources(specs),
        )(_mirrors)


def _refuse_hours_outside(
    asked: dg.PartitionKeyRange,
    partitions_def: dg.HourlyPartitionsDefinition,
    specs: Sequence[TableSpec],
) -> None:
    """A run of hours its tables have no partition for (launched through the API or with a
    partition tag by hand) fails at once and is not retried, naming the tables' hours; Dagster
    would fail it on its own invariant, and retry it, with no word of what to do."""
    first = partitions_def.get_first_partition_key()
    last = partitions_def.get_last_partition_key()
    if first is None or last is None:
        return
    names = ", ".join(spec.name for spec in specs)
    if asked.start < first:  # fixed-width hour keys: text order is time order
        problem = f"hour {asked.start} is before the tables' first hour {first} (start_hour)"
    elif asked.end > last:
        problem = f"hour {asked.end} is in the future (the newest hour is {last}, still open)"
    else:
        return
    raise dg.Failure(
        description=f"{names}: {problem}; run hours from {first} to the newest closed one "
        "(not retried: retrying cannot help)",
        allow_retries=False,
    )


def _run_in_process(context: dg.AssetExecutionContext, run: MirrorsRun) -> Iterator:
    """The run's tables in parallel on its Spark session (`cdc_assets.fleet`), hour after hour;
    a table that fails leaves the others materialized, and fails the run at the end."""
    spark: SparkResource = context.resources.spark
    lake: LakeResource = context.resources.lake
    work = [TableWork(spec, hours, _masking_key(context, spec)) for spec, hours in run.work]
    run.checks.preload()  # while the Spark session starts
    outcomes = run_tables(
        spark=spark.session,
        kafka=context.resources.kafka,
        lake=lake,
        work=work,
        checks=run.checks,
        parallelism=spark.parallel_tables,
        force_open_hour=run.config.force_open_hour,
        local_read_max_records=spark.local_read_max_records,
        interpreted_max_bytes=spark.interpreted_max_bytes,
        on_done=lambda outcome: _log_table(context, outcome),
    )
    failed, left_open, asked = [], 0, {spec.name: hours for spec, hours in run.work}
    for outcome in outcomes:
        spec, check_specs = outcome.spec, run.check_specs[outcome.spec.name]
        reports = [
            HourReport(
                hour.result.hour_key,
                result_metadata(hour.result, table_path=lake.table_path(spec.name)),
                hour.checks,
            )
            for hour in outcome.hours
        ]
        if outcome.error is None:
            yield from report_hours(context, spec, check_specs, reports)
        elif _leaves_open(context, outcome.error):
            # A person asked for an hour not closed yet: not a failure. The hours before it
            # are recorded, the open one is left as it was (its checks show as skipped, not
            # as failed executions, and no partition turns red); the sensor runs it once it
            # closes. The sensor's own run fails on one instead: it asked for it as closed.
            yield from report_done_hours(context, spec, check_specs, reports)
            yield from _left_open(spec, outcome, asked[spec.name])
            left_open += 1
        else:
            failed.append(outcome)
            yield from report_done_hours(context, spec, check_specs, reports)
    if failed:
        raise tables_failure(
            [
                TableFailure(
                    outcome.spec.name,
                    outcome.failed_hour,
                    _describe(outcome.error),
                    [hour.result.hour_key for hour in outcome.hours],
                    retriable=not isinstance(outcome.error, NOT_RETRIED),
                )
                for outcome in failed
            ],
            total=len(work),
            left_open=left_open,
        )


def _leaves_open(context: dg.AssetExecutionContext, error: BaseException | None) -> bool:
    """Whether the run leaves a table's hour it found still open as it was (a run a person
    launched) rather than failing on it (the offset sensor's run: it asked for a closed hour)."""
    return isinstance(error, OpenHourError) and (
        context.run.tags.get(TRIGGER_TAG) != SENSOR_TRIGGER
    )


def _left_open(spec: TableSpec, outcome: TableRun, asked: Sequence[str]) -> Iterator:
    """What a run records of a table whose hour it found still open (`OpenHourError`): an
    observation on that hour and on each hour of the run after it (open too), in the asset's
    events, saying why and what to do."""
    reason = f"not materialized by this run: {outcome.error}"
    for hour in asked[asked.index(outcome.failed_hour) :]:
        yield dg.AssetObservation(
            asset_key=dg.AssetKey(spec.name), partition=hour, metadata={"left_open": reason}
        )


def _in_process_resources(specs: Sequence[TableSpec]) -> set[str]:
    # Every table with sensitive columns needs the key: hashes, and its error table's seal.
    masking = {"masking"} if any(spec.sensitive for spec in specs) else set()
    return {"kafka", "spark", "lake"} | masking


IN_PROCESS = MirrorRunner(run=_run_in_process, resources=_in_process_resources)


def _log_table(context: dg.AssetExecutionContext, outcome: TableRun) -> None:
    spec = outcome.spec
    for hour in outcome.hours:
        context.log.info(f"{hour_summary(spec, hour.result)} ({hour.seconds:.1f} s)")
        if hour.result.partial:
            context.log.warning(partial_warning(spec, hour.result))
    if _leaves_open(context, outcome.error):
        context.log.warning(f"{spec.name} {outcome.failed_hour} left open: {outcome.error}")
    elif outcome.error is not None:
        context.log.error(f"{spec.name} {outcome.failed_hour}: {_describe(outcome.error)}")


def _describe(error: BaseException) -> str:
    return str(error) if isinstance(error, NOT_RETRIED) else f"{type(error).__name__}: {error}"


@dataclass(frozen=True)
class TableFailure:
    """A table a run could not finish: the hour that failed, why, the hours committed before."""

    table: str
    hour_key: str | None
    reason: str
    done: list[str]
    retriable: bool


def tables_failure(failed: list[TableFailure], *, total: int, left_open: int = 0) -> dg.Failure:
    """The run's failure when some of its tables failed: each named with its hour and reason
    (`left_open`: how many others the run left at an open hour, not materialized).
    Retried only when retrying can help one of them; a retry runs what is not yet done."""
    lines = [
        f"{f.table} {f.hour_key}: {f.reason}"
        + (
            f" (its hours {f.done[0]} to {f.done[-1]} were committed and recorded)"
            if f.done
            else ""
        )
        for f in failed
    ]
    retriable = any(f.retriable for f in failed)
    if len(failed) == total:
        head = "every table failed" if total > 1 else "the table failed"
    elif not left_open:
        head = f"{len(failed)} of {total} tables failed; the others were materialized"
    else:
        head = (
            f"{len(failed)} of {total} tables failed; {left_open} left an open hour as it was, "
            f"the other {total - len(failed) - left_open} were materialized"
        )
    return dg.Failure(
        description=f"{head}{'' if retriable else ' (not retried: retrying cannot help)'}:\n"
        + "\n".join(lines),
        allow_retries=retriable,
    )


def _materialized_in_this_run(context: dg.AssetExecutionContext) -> set[tuple[str, str]]:
    """(table, hour) pairs an earlier attempt of this run already materialized."""
    records = context.instance.get_records_for_run(
        context.run_id, of_type=dg.DagsterEventType.ASSET_MATERIALIZATION, limit=100_000
    ).records
    done = set()
    for record in records:
        materialization = record.asset_materialization
        if materialization is not None and materialization.partition:
            done.add((materialization.asset_key.to_user_string(), materialization.partition))
    return done


def _masking_key(context: dg.AssetExecutionContext, spec: TableSpec) -> HmacKey | None:
    """Checks the table's masking setup before anything is read; a wrong one isn't retried."""
    if not spec.sensitive:
        return None
    try:
        return context.resources.masking.hmac_key(table=spec.name, columns=list(spec.sensitive))
    except MaskingKeyError as exc:
        raise dg.Failure(description=str(exc), allow_retries=False) from exc
