"""Unchanged TOASTed values: kept across updates and primary-key moves, in any hour order.

Postgres leaves a large ("TOASTed") value out of an update's new row when the update did not
change it, and Debezium sends `__debezium_unavailable_value` instead. The rule, stated once, for
each column C listed under `toasted_columns`:

- C holds the value of the newest change of the row that carried one (`_cdc_seq__C` is that
  change's sequence), whichever order the hours run in: a change stale for the row still fills C
  when its value is newer than the stored one.
- A primary-key update moves the row (Debezium: a delete of the old key, a create of the new one
  naming it in its `__debezium.oldkey` header). The new row records the move (`_cdc_moved_from`,
  `_cdc_moved_at`) and takes C from the old key's newest value older than the move
  (`resolve_moves`, after each MERGE, again whenever that value arrives later). Values the key
  held before the move (an earlier life of it) are not its values after.
- Where nothing tells C, C is null and `_cdc_unknown__C` is true: never a null that looks real.

When that happens, and replica identity: docs/debezium.md, 'TOASTed values and replica identity'.
"""

from __future__ import annotations

from collections.abc import Mapping

import pyarrow as pa
import pyarrow.compute as pc
from delta.tables import DeltaTable
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from cdc_assets.columns import DELETED, MOVED_FROM, SEQUENCE, has_value, value_sequence
from cdc_assets.config import TableSpec

MOVED_AT = "_cdc_moved_at"
# Resolution passes per run: one per link of a chain of moves (a → b → c needs two).
_MAX_PASSES = 8


def unknown_flag(column: str) -> str:
    """Mirror column: true when toasted `column`'s value is not known (see the module doc)."""
    return f"_cdc_unknown__{column}"


def mirror_columns(spec: TableSpec) -> list[str]:
    """The mirror columns this rule keeps for `spec`, after the source and metadata columns."""
    if not spec.toasted_columns:
        return []
    per_column = [value_sequence(c) for c in spec.toasted_columns]
    flags = [unknown_flag(c) for c in spec.toasted_columns]
    return [*per_column, *flags, MOVED_FROM, MOVED_AT]


def batch_columns(spec: TableSpec, changes: DataFrame) -> tuple[list[Column], list[Column]]:
    """For the newest-change-per-key aggregation: (aggregates, then the selected columns).

    Per key: each toasted column's newest carried value and its sequence, and the newest move
    into the key. A value older than that move belongs to the key's earlier life: dropped.
    """
    if not spec.toasted_columns:
        return [], []
    moves = F.col(MOVED_FROM).isNotNull()
    aggregates = [
        F.max_by(F.col(MOVED_FROM), F.when(moves, F.col(SEQUENCE))).alias("_move_from"),
        F.max(F.when(moves, F.col(SEQUENCE))).alias("_move_at"),
    ]
    for c in spec.toasted_columns:
        carried = F.when(F.col(has_value(c)), F.col(SEQUENCE))
        aggregates += [
            F.max_by(F.col(c), carried).alias(f"_value_{c}"),
            F.max(carried).alias(f"_seq_{c}"),
        ]
    move_at = F.col("_move_at")
    selected = []
    for c in spec.toasted_columns:
        valid = F.col(f"_seq_{c}").isNotNull() & (
            move_at.isNull() | (F.col(f"_seq_{c}") >= move_at)
        )
        selected += [
            F.when(valid, F.col(f"_value_{c}")).alias(c),
            F.when(valid, F.col(f"_seq_{c}")).alias(value_sequence(c)),
            (~valid).alias(unknown_flag(c)),
        ]
    selected += [F.col("_move_from").alias(MOVED_FROM), move_at.alias(MOVED_AT)]
    return aggregates, selected


def carried_ranks(spec: TableSpec, changes: pa.Table, ranks: pa.Array) -> dict[str, pa.Array]:
    """For `rule.newest_per_key` (changes held in memory): per change, its place in sequence
    order (`ranks`) where it carries each toasted column's value (`_carried_<C>`) and where it
    moves its row (`_move`), null elsewhere; each key's maximum is `newest_values`' input."""
    if not spec.toasted_columns:
        return {}
    carried = {"_move": pc.if_else(pc.is_valid(changes.column(MOVED_FROM)), ranks, None)}
    for c in spec.toasted_columns:
        carried[f"_carried_{c}"] = pc.if_else(changes.column(has_value(c)), ranks, None)
    return carried


def newest_values(
    spec: TableSpec, changes: pa.Table, order: pa.Array, grouped: pa.Table
) -> dict[str, pa.Array]:
    """`batch_columns`' selected columns for changes held in memory, per key of `grouped`
    (each `carried_ranks` column's maximum per key; `order`: the changes in sequence order):
    each toasted column's newest carried value and its sequence, unless the key's newest move
    came after it (the value belongs to the key's earlier life), and the newest move."""
    if not spec.toasted_columns:
        return {}
    move = grouped.column("_move_max")
    columns: dict[str, pa.Array] = {}
    for c in spec.toasted_columns:
        carried = grouped.column(f"_carried_{c}_max")
        after_move = pc.or_kleene(pc.is_null(move), pc.greater_equal(carried, move))
        valid = pc.and_kleene(pc.is_valid(carried), after_move)
        row = order.take(pc.if_else(valid, carried, None))
        columns[c] = changes.column(c).take(row)
        columns[value_sequence(c)] = changes.column(SEQUENCE).take(row)
        columns[unknown_flag(c)] = pc.invert(valid)
    moved = order.take(move)
    columns[MOVED_FROM] = changes.column(MOVED_FROM).take(moved)
    columns[MOVED_AT] = changes.column(SEQUENCE).take(moved)
    return columns


def merge_sets(spec: TableSpec) -> tuple[dict[str, Column], Column]:
    """What a MERGE sets on a matched row for this rule, and whether that changes anything.

    Applies whether or not the row's own change is newer (an older hour fills values too).
    """
    if not spec.toasted_columns:
        return {}, F.lit(False)

    def s(name: str) -> Column:
        return F.col(f"s.`{name}`")

    def t(name: str) -> Column:
        return F.col(f"t.`{name}`")

    new_move = s(MOVED_AT).isNotNull() & (t(MOVED_AT).isNull() | (s(MOVED_AT) > t(MOVED_AT)))
    sets: dict[str, Column] = {
        MOVED_FROM: F.when(new_move, s(MOVED_FROM)).otherwise(t(MOVED_FROM)),
        MOVED_AT: F.when(new_move, s(MOVED_AT)).otherwise(t(MOVED_AT)),
    }
    changed = new_move
    for c in spec.toasted_columns:
        ours, theirs = s(value_sequence(c)), t(value_sequence(c))
        # The stored value stays valid unless a newer move began a new life after it.
        kept = theirs.isNotNull() & (~new_move | (theirs >= s(MOVED_AT)))
        # The batch's value is already valid against its own move; against the stored one too?
        offered = ours.isNotNull() & (t(MOVED_AT).isNull() | new_move | (ours >= t(MOVED_AT)))
        take = offered & (~kept | (ours > theirs))
        value = F.when(take, s(c)).when(kept, t(c))
        sequence = F.when(take, ours).when(kept, theirs)
        sets[c], sets[value_sequence(c)] = value, sequence
        sets[unknown_flag(c)] = sequence.isNull()
        changed = changed | take | (theirs.isNotNull() & ~kept)
    return sets, changed


def resolve_moves(spark: SparkSession, spec: TableSpec, path: str) -> int:
    """Carries toasted values over from moved rows' old keys; returns the rows filled (each
    pass that fills any is a Delta commit of its own, which `hour_run` gives the run's record
    marked `moved_rows`).

    A pass fills each moved row's unknown (or older-than-available) values from its old key's
    row; a chain of moves takes a pass per link. Cheap when nothing is pending: Delta skips the
    files where `_cdc_moved_from` is null.
    """
    if not spec.toasted_columns or not DeltaTable.isDeltaTable(spark, path):
        return 0
    table = DeltaTable.forPath(spark, path)
    if MOVED_FROM not in table.toDF().columns:
        return 0
    # Most hours have no moved row left open: one filtered read (Delta skips the files whose
    # statistics show no moved row) instead of the join below.
    if not _pending(table.toDF(), spec).limit(1).count():
        return 0
    filled = 0
    for _ in range(_MAX_PASSES):
        updates = _resolvable(table.toDF(), spec)
        if updates is None:
            break
        on = " AND ".join(f"t.`{k}` = u.`{k}`" for k in spec.primary_key)
        sets: dict[str, Column] = {}
        for c in spec.toasted_columns:
            take = F.col(f"u.`_take_{c}`")
            sets[c] = F.when(take, F.col(f"u.`_value_{c}`")).otherwise(F.col(f"t.`{c}`"))
            sequence = F.when(take, F.col(f"u.`_seq_{c}`")).otherwise(
                F.col(f"t.`{value_sequence(c)}`")
            )
            sets[value_sequence(c)] = sequence
            sets[unknown_flag(c)] = sequence.isNull()
        metrics = (
            table.alias("t").merge(updates.alias("u"), on).whenMatchedUpdate(set=sets).execute()
        ).first()
        count = metrics["num_updated_rows"] if metrics is not None else 0
        if not count:
            break
        filled += count
    return filled


def _pending(mirror: DataFrame, spec: TableSpec) -> DataFrame:
    """Moved rows with a toasted value still open: unknown, or older than the move."""
    moved_at = F.col(MOVED_AT)
    open_columns = [
        F.col(value_sequence(c)).isNull() | (F.col(value_sequence(c)) < moved_at)
        for c in spec.toasted_columns
    ]
    return mirror.where(F.col(MOVED_FROM).isNotNull() & _any(open_columns))


def _resolvable(mirror: DataFrame, spec: TableSpec) -> DataFrame | None:
    """The moved rows an old key's row can fill now, with the values to take; None if none."""
    moved_at = F.col(f"p.{MOVED_AT}")
    pending = _pending(mirror, spec).alias("p")
    old = mirror.alias("o")
    on = [F.col(f"p.{MOVED_FROM}.`{k}`") == F.col(f"o.`{k}`") for k in spec.primary_key]
    joined = pending.join(old, _all(on))
    takes, columns = [], [F.col(f"p.`{k}`").alias(k) for k in spec.primary_key]
    for c in spec.toasted_columns:
        theirs, mine = F.col(f"o.`{value_sequence(c)}`"), F.col(f"p.`{value_sequence(c)}`")
        take = theirs.isNotNull() & (theirs < moved_at) & (mine.isNull() | (theirs > mine))
        takes.append(take)
        columns += [
            take.alias(f"_take_{c}"),
            F.col(f"o.`{c}`").alias(f"_value_{c}"),
            theirs.alias(f"_seq_{c}"),
        ]
    updates = joined.where(_any(takes)).select(*columns)
    return updates if updates.limit(1).count() else None


def unknown_live_rows(mirror: DataFrame, spec: TableSpec) -> Mapping[str, int]:
    """Live rows whose toasted value is unknown, per toasted column."""
    if not spec.toasted_columns:
        return {}
    flags = [unknown_flag(c) for c in spec.toasted_columns if unknown_flag(c) in mirror.columns]
    if not flags:
        return {}
    live = mirror.where(~F.col(DELETED) & _any([F.col(f) for f in flags]))
    row = live.agg(*[F.count_if(F.col(f)).alias(f) for f in flags]).first()
    return {
        c: int(row[unknown_flag(c)] or 0) for c in spec.toasted_columns if unknown_flag(c) in flags
    }


def _any(conditions: list[Column]) -> Column:
    result = conditions[0]
    for condition in conditions[1:]:
        result = result | condition
    return result


def _all(conditions: list[Column]) -> Column:
    result = conditions[0]
    for condition in conditions[1:]:
        result = result & condition
    return result
