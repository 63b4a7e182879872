"""TOASTed values across primary-key moves, in the history: the mirror's rule, per version.

A primary-key update reaches the lake as a delete of the old key and a create of the new one
naming the old key (`_cdc_moved_from`); Postgres leaves an unchanged TOASTed value out of that
create. In the mirror, `toast.resolve_moves` gives the moved row the old key's value from just
before the move. Here every version of the life the move began (the new key's versions from the
create up to its next delete) that no change of that life carried a value to takes it the same
way: the value of the old key's version in force just before the move (itself filled, and
filled from a move of its own along a chain). Where that is not known, the versions say
unknown, as any other version does.

Runs after the history's MERGE (`history.write_history`) when that MERGE's counting found a
move the hour's keys take part in, each pass in a commit of its own carrying the run's record
marked `moved_rows`, as the mirror's do. The first pass takes the moves into and out of the
hour's keys, each next one the moves out of the keys the pass before moved into, whether it
changed them or not (a chain of moves needs a pass per link; a run that died between passes
is completed by running the hour again), so a value that arrives late reaches the moved
versions, in any hour order. A version belongs to one move's life: while the delete between
two moves into a key has not arrived, the later move ends the earlier one's life. A stored
version a move began passes its value on when a later run derives its key again
(`history._derived`); a delivery of that change read again with lower Kafka coordinates says
unknown in the MERGE's commit until this run's pass fills it again.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

from delta.tables import DeltaTable
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from cdc_assets.columns import DELETED, MOVED_FROM, SEQUENCE, has_value, source_fields
from cdc_assets.commits import MOVED_ROWS, commit_metadata
from cdc_assets.config import TableSpec
from cdc_assets.toast import unknown_flag

_log = logging.getLogger(__name__)
# Passes per run: one per link of a chain of moves (as `toast.resolve_moves`).
_MAX_PASSES = 8


@dataclass(frozen=True)
class MovedVersions:
    """The versions a run filled from their life's move (`filled`), and their keys and
    sequences (`versions`, None when none) for the fold and the audit to take as touched, and
    the history's version after them."""

    filled: int
    versions: DataFrame | None
    version: int | None  # the history's version after the last fill's commit


def follow_moves(
    spark: SparkSession, spec: TableSpec, path: str, changes: DataFrame, run_metadata: dict
) -> MovedVersions:
    """Fills the TOASTed values of the versions at `path` whose life began with a move the
    hour's keys (`changes`) are part of, and along chains of moves from there; see the module
    docstring. The history's MERGE counts those moves (`HistoryOutcome.moves`): the caller
    skips this where there are none, as most hours have."""
    if not spec.toasted_columns:
        return MovedVersions(0, None, None)
    table = DeltaTable.forPath(spark, path)
    if MOVED_FROM not in table.toDF().columns:
        return MovedVersions(0, None, None)  # a history written before moves were followed
    keys = list(spec.primary_key)
    # The first pass: the moves into and out of the hour's keys; each next one, the moves out
    # of the keys the pass before moved into, whether it changed them or not (a run that died
    # between passes is completed by running the hour again), but a move already followed only
    # when its old key changed since (a cycle of moves ends).
    candidates = moves_of(table.toDF(), spec, changes.select(*keys).distinct())
    filled, done, followed, changed = 0, [], set(), set()

    def move(row) -> tuple:
        return tuple(row[k] for k in keys), row["_moved_at"]

    def old_key(row) -> tuple:
        return tuple(row[MOVED_FROM][k] for k in keys)

    for _ in range(_MAX_PASSES):
        # Taken to the driver: a frame over the table would be computed again after the MERGE
        # (Delta refreshes what reads a table it writes), and a move's versions are few.
        found_moves = candidates.collect()
        moves = [m for m in found_moves if move(m) not in followed or old_key(m) in changed]
        if not moves:
            break
        followed |= {move(m) for m in moves}
        moves_frame = spark.createDataFrame(moves, candidates.schema)
        found = _fills(table.toDF(), spec, moves_frame)
        rows = found.collect()
        changed = {tuple(r[k] for k in keys) for r in rows}
        if rows:
            updates = spark.createDataFrame(rows, found.schema)
            _merge(spark, table, spec, updates, run_metadata)
            filled += len(rows)
            done.append(updates.select(*keys, SEQUENCE))
        candidates = _out_of(_moves(table.toDF(), spec), spec, moves_frame.select(*keys))
    else:
        _log.warning(
            "table '%s': its history's moves form a chain longer than %d links; the versions "
            "past them keep what they have until a later run follows it on",
            spec.name,
            _MAX_PASSES,
        )
    if not done:
        return MovedVersions(0, None, None)
    version = table.history(1).select("version").first()[0]
    return MovedVersions(filled, functools.reduce(DataFrame.unionByName, done), version)


def _merge(spark, table: DeltaTable, spec: TableSpec, updates: DataFrame, run_metadata: dict):
    """Writes `_fills`' values into their versions, in a commit carrying the run's record
    marked `moved_rows`."""
    keys = list(spec.primary_key)
    fields = source_fields(updates.schema[SEQUENCE].dataType)
    on = " AND ".join(
        [f"t.`{k}` <=> u.`{k}`" for k in keys]
        + [f"t.`{SEQUENCE}`.`{f}` <=> u.`{SEQUENCE}`.`{f}`" for f in fields]
    )
    sets: dict[str, Column] = {}
    for c in spec.toasted_columns:
        take = F.col(f"u.`_take_{c}`")
        sets[c] = F.when(take, F.col(f"u.`_value_{c}`")).otherwise(F.col(f"t.`{c}`"))
        flag = unknown_flag(c)
        sets[flag] = F.when(take, F.col(f"u.`_unknown_{c}`")).otherwise(F.col(f"t.`{flag}`"))
    with commit_metadata(spark, {**run_metadata, MOVED_ROWS: True}):
        table.alias("t").merge(updates.alias("u"), on).whenMatchedUpdate(set=sets).execute()


def moves_of(history: DataFrame, spec: TableSpec, touched: DataFrame) -> DataFrame:
    """The versions of `history` a primary-key move began whose new or old key is among
    `touched`' keys: the new key, the move's sequence (`_moved_at`) and the old key."""
    moves = _moves(history, spec)
    into = moves.join(touched, on=list(spec.primary_key), how="left_semi")
    return into.unionByName(_out_of(moves, spec, touched)).distinct()


def _moves(history: DataFrame, spec: TableSpec) -> DataFrame:
    """Every version a primary-key move began: its key, sequence (`_moved_at`), old key."""
    keys = list(spec.primary_key)
    # On the old key's fields, never null in a move: Delta skips the files without one where
    # it keeps statistics of them (the first 32 columns' by default).
    began = functools.reduce(
        lambda a, b: a & b, [F.col(f"{MOVED_FROM}.`{k}`").isNotNull() for k in keys]
    )
    return history.where(began).select(*keys, F.col(SEQUENCE).alias("_moved_at"), MOVED_FROM)


def _out_of(moves: DataFrame, spec: TableSpec, keys_frame: DataFrame) -> DataFrame:
    """The `moves` whose old key is one of `keys_frame`'s."""
    keys = list(spec.primary_key)
    old = keys_frame.select(*[F.col(k).alias(f"_old_{k}") for k in keys]).distinct()
    return moves.join(
        old,
        on=[F.col(f"{MOVED_FROM}.`{k}`").eqNullSafe(F.col(f"_old_{k}")) for k in keys],
        how="left_semi",
    )


def _fills(history: DataFrame, spec: TableSpec, moves: DataFrame) -> DataFrame:
    """The versions of `moves`' lives whose TOASTed values differ from what the move gives
    them: per version its key and sequence, and per column whether to take (`_take_C`) the
    value (`_value_C`) and flag (`_unknown_C`) the move gives."""
    keys = list(spec.primary_key)
    relevant = moves
    flags = [unknown_flag(c) for c in spec.toasted_columns]
    # What the old key held just before the move: its newest version before it.
    held = F.struct(*[F.col(f"o.`{c}`").alias(c) for c in [*spec.toasted_columns, *flags]])
    given = (
        relevant.alias("m")
        .join(
            history.alias("o"),
            on=[F.col(f"m.{MOVED_FROM}.`{k}`").eqNullSafe(F.col(f"o.`{k}`")) for k in keys]
            + [F.col(f"o.{SEQUENCE}") < F.col("m._moved_at")],
            how="left",
        )
        .groupBy(*[F.col(f"m.`{k}`").alias(k) for k in keys], F.col("m._moved_at"))
        .agg(F.max_by(held, F.col(f"o.{SEQUENCE}")).alias("_given"))
    )
    # The life the move began: the new key's versions from it to its next delete (or its next
    # move, while the delete between them has not arrived: each version is one move's), and per
    # column the first of them that carried a value of its own (the move's stops there; a
    # version written before the column was toasted has no mark and holds its own).
    life = given.join(history, on=keys).where(F.col(SEQUENCE) >= F.col("_moved_at"))
    later_move = F.col(MOVED_FROM).isNotNull() & (F.col(SEQUENCE) > F.col("_moved_at"))
    ends = life.groupBy(*keys, "_moved_at").agg(
        F.min(F.when(F.col(DELETED), F.col(SEQUENCE))).alias("_ends"),
        F.min(F.when(later_move, F.col(SEQUENCE))).alias("_next_move"),
        *[
            F.min(F.when(F.coalesce(F.col(has_value(c)), F.lit(True)), F.col(SEQUENCE))).alias(
                f"_carried_{c}"
            )
            for c in spec.toasted_columns
        ],
    )
    versions = life.join(ends, on=[*keys, "_moved_at"]).where(
        (F.col("_ends").isNull() | (F.col(SEQUENCE) <= F.col("_ends")))
        & (F.col("_next_move").isNull() | (F.col(SEQUENCE) < F.col("_next_move")))
    )
    columns, takes = [*[F.col(k) for k in keys], F.col(SEQUENCE)], []
    for c in spec.toasted_columns:
        carried = F.col(f"_carried_{c}")
        within = carried.isNull() | (F.col(SEQUENCE) < carried)
        # No version of the old key before the move, or one whose value was not known: unknown.
        flag = F.col(f"_given.`{unknown_flag(c)}`")
        unknown = F.col("_given").isNull() | F.coalesce(flag, F.lit(False))
        value = F.when(~unknown, F.col(f"_given.`{c}`"))
        same = F.col(c).eqNullSafe(value) & F.col(unknown_flag(c)).eqNullSafe(unknown)
        take = within & ~same
        takes.append(take)
        columns += [
            take.alias(f"_take_{c}"),
            value.alias(f"_value_{c}"),
            unknown.alias(f"_unknown_{c}"),
        ]
    return versions.where(functools.reduce(lambda a, b: a | b, takes)).select(*columns)
