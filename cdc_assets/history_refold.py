"""Folds a table's history again under the tracked columns its config sets now.

    python -m cdc_assets.history_refold --table customers [--dry-run]

When to use it: the table's `history_columns` or `history_except_columns` changed, or were set
for a history that kept every change as a version, and its runs now refuse the history
(`history_tracking.check_tracking`). No Kafka is needed: the changes are in the lake.
- Tracked columns changed: `<table>__history` is folded again, whole, from
  `<table>__history_changes`, in one commit that also records the new setting.
- Tracked columns set for a history that kept every change: that history is first copied, in
  one commit, to `<table>__history_changes` (it holds a version per change, as that table
  does), then folded as above.
- Tracked columns taken away: not this tool. Rename `<table>__history_changes` to
  `<table>__history`, as the run's refusal says: it already holds every change as a version.

Run it while no hour of the table runs (its sensor stopped, no backfill of it in flight): a
run that folds with the old setting between the two commits would write old versions into the
new history. Each step is one commit, so a tool stopped halfway is completed by running it
again; the copy is not made twice (an existing changes' table is the copy). Folding again is
idempotent: run on a history that already has the setting, it writes the same versions.

Configuration comes from the environment: `CDC_TABLES_FILE` and the lake's `CDC_LAKE_ROOT`
(with the AWS settings of an S3 lake). It prints counts only, never a row. It exits 2 when it
can't start (an argument, a setting, no history, a tracked one without its changes' table).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import dagster as dg
from delta.tables import DeltaTable
from pyspark.errors import AnalysisException
from pyspark.sql import SparkSession

from cdc_assets.commits import table_properties
from cdc_assets.config import (
    TableConfigError,
    TableSpec,
    named_table,
)
from cdc_assets.history import history_name
from cdc_assets.history_tracking import (
    TRACKING_PROPERTY,
    changes_name,
    fold_all,
    tracking,
    tracking_text,
)
from cdc_assets.merge import DELETION_VECTORS_PROPERTY
from resources.environment import LAKE_ROOT_ENV, resources_from_env


class RefoldError(RuntimeError):
    """The history can't be folded again: named in the message, with what to do instead."""


@dataclass(frozen=True)
class RefoldOutcome:
    table: str
    setting: str  # the tracked columns folded by, as `tracking` writes them
    copied: bool  # the per-change history was copied to the changes' table first
    changes: int  # the changes' table's rows (a version per change)
    versions: int  # the folded history's versions afterwards (0 on a dry run)


def refold_history(
    spark: SparkSession,
    spec: TableSpec,
    history_path: str,
    changes_path: str,
    *,
    dry_run: bool = False,
) -> RefoldOutcome:
    """Folds the history at `history_path` again, whole, by `spec`'s tracked columns, from the
    changes' table at `changes_path` (copied there first from a per-change history); see the
    module docstring."""
    wanted = tracking(spec)
    history = DeltaTable.isDeltaTable(spark, history_path)
    has_changes = DeltaTable.isDeltaTable(spark, changes_path)
    if wanted is None:
        raise RefoldError(
            f"table '{spec.name}' tracks no columns, so its history keeps every change as a "
            f"version and has nothing to fold; to get there from a tracked history, move "
            f"{history_path} aside and rename {changes_path} to {history_path} (it holds every "
            "change as one)"
        )
    if not history and not has_changes:
        raise RefoldError(
            f"table '{spec.name}' has no history at {history_path} yet; its first run creates "
            "it with the tracked columns it sets"
        )
    stored = table_properties(spark, history_path).get(TRACKING_PROPERTY) if history else None
    copy = not has_changes
    if copy and stored:
        raise RefoldError(
            f"table '{spec.name}': its history at {history_path} was folded from {changes_path}, "
            "which is missing; put it back (nothing else holds every change), or move the "
            "history aside and run the table's hours again from its first one while Kafka "
            "holds them"
        )
    if history and not stored and has_changes:
        _check_copy(spark, spec, history_path, changes_path)
    changes = spark.read.format("delta").load(history_path if copy else changes_path)
    if dry_run:
        return RefoldOutcome(spec.name, wanted, copy, changes.count(), 0)
    deletion_vectors = str(spec.deletion_vectors).lower()
    if copy:
        # One commit: a changes' table that exists is a whole copy (what a rerun relies on).
        try:
            (
                changes.writeTo(_identifier(changes_path))
                .using("delta")
                .tableProperty(DELETION_VECTORS_PROPERTY, deletion_vectors)
                .create()
            )
        except AnalysisException as exc:
            reason = str(exc).splitlines()[0]
            raise RefoldError(
                f"table '{spec.name}': could not copy the history to {changes_path} ({reason}); "
                "if a refold stopped before its copy's commit left files there without a Delta "
                "log, remove that folder and run this again"
            ) from exc
        changes = spark.read.format("delta").load(changes_path)
    # One commit: the versions and the setting they were folded by.
    (
        fold_all(spec, changes)
        .writeTo(_identifier(history_path))
        .using("delta")
        .tableProperty(DELETION_VECTORS_PROPERTY, deletion_vectors)
        .tableProperty(TRACKING_PROPERTY, wanted)
        .createOrReplace()
    )
    versions = spark.read.format("delta").load(history_path).count()
    return RefoldOutcome(spec.name, wanted, copy, changes.count(), versions)


def _check_copy(spark: SparkSession, spec: TableSpec, history_path: str, changes_path: str):
    """Refuses a changes' table beside a per-change history unless it holds the same rows (the
    copy a stopped refold made): one left from an earlier setting lacks the newer changes."""
    history = spark.read.format("delta").load(history_path)
    changes = spark.read.format("delta").load(changes_path)
    same = set(history.columns) == set(changes.columns)
    if same:
        changes = changes.select(*history.columns)
        same = not history.exceptAll(changes).union(changes.exceptAll(history)).take(1)
    if not same:
        raise RefoldError(
            f"table '{spec.name}': {changes_path} exists beside the history at {history_path}, "
            "which keeps every change as a version, and the two differ: it is left from an "
            "earlier setting, not a copy of this history. Move it aside, then run this again"
        )


def _identifier(path: str) -> str:
    return "delta.`{}`".format(path.replace("`", "``"))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cdc_assets.history_refold", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--table", required=True, help="the table's name in the tables file")
    parser.add_argument("--dry-run", action="store_true", help="count the changes, write nothing")
    args = parser.parse_args(argv)
    if not os.environ.get(LAKE_ROOT_ENV):
        parser.error(f"{LAKE_ROOT_ENV} not set; set it as the deployment does (the lake's root)")
    try:
        spec, tables_file = named_table(args.table)
    except TableConfigError as exc:
        parser.error(str(exc))
    if not spec.history:
        parser.error(f"table '{spec.name}' keeps no history (history: true in {tables_file})")
    resources = resources_from_env()
    try:
        # Resolved as a run resolves them: the lake's secrets read here, never printed.
        with dg.build_resources({n: resources[n] for n in ("spark", "lake")}) as built:
            spark, lake = built.spark.session, built.lake
            lake.connect(spark)
            outcome = refold_history(
                spark,
                spec,
                lake.table_path(history_name(spec)),
                lake.table_path(changes_name(spec)),
                dry_run=args.dry_run,
            )
    except RefoldError as exc:
        sys.stderr.write(f"cdc_assets.history_refold: {exc}\n")
        return 2
    setting = tracking_text(outcome.setting)
    if args.dry_run:
        copy = f"copy the history to {changes_name(spec)}, then " if outcome.copied else ""
        done = f"would {copy}fold {outcome.changes} changes by {setting}"
    else:
        copy = f"copied the history to {changes_name(spec)}, " if outcome.copied else ""
        done = f"{copy}folded {outcome.changes} changes into {outcome.versions} versions"
        done += f" by {setting}"
    print(f"table '{outcome.table}': {done}")  # noqa: T201  (the command's output: counts only)
    return 0


if __name__ == "__main__":
    sys.exit(main())
