"""The CDC rule, stated once, and the code that applies it to a mirror.

What a change is (an insert, update, snapshot read, delete or truncate, or an error) is the
decoder's (`cdc_assets.decoding`). What the mirror does with the changes is this:

- Order. Changes of one key are ordered by the table's `sequence` (default `source.lsn`; MySQL:
  the binlog file's number, position and row), then Kafka partition and offset: together
  `_cdc_sequence`. Kafka offsets alone can't order them: a topic's partition count may change.
- Newest per key. An hour's changes of one key reduce to its newest (`latest_per_key`).
- Newer wins. A change applies only when its key has no row yet or its sequence is greater than
  the stored row's (`applies`): any set of hours, in any order, any number of times, ends in the
  table that applying the whole log in order gives (I3).
- Deletes. `delete_mode: soft` (default) keeps the key as a row with `_cdc_deleted = true`, the
  delete's sequence and its before-image, so an older change arriving later is stale against
  it; a delete of a key the mirror lacks is stored the same way. `delete_mode: hard` removes the
  row, so a later, older change inserts it again: hard deletes converge only in order.
- Truncates (`op` `t`). `on_truncate: fail` (default) stops the hour before writing. With `apply`,
  every row older than the truncate that no change of the hour replaces is deleted as
  `delete_mode` says, stamped with the truncate's sequence; older changes arriving later stay out
  (`cdc_assets.hour_run`).
- TOASTed values of `toasted_columns` follow their own rule (`cdc_assets.toast`).
- Readers see the source table as the live rows: `WHERE NOT _cdc_deleted`.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from delta.tables import DeltaMergeBuilder
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from cdc_assets import toast
from cdc_assets.columns import (
    DELETED,
    HOUR,
    INGESTED_AT,
    KAFKA_OFFSET,
    KAFKA_PARTITION,
    OP,
    SEQUENCE,
    SOURCE_TS,
)
from cdc_assets.config import TableSpec

# The metadata columns a change carries into the mirror (besides the source columns).
METADATA_COLUMNS = (OP, SEQUENCE, SOURCE_TS, KAFKA_PARTITION, KAFKA_OFFSET, HOUR, INGESTED_AT)


def mirror_columns(spec: TableSpec) -> list[str]:
    """The mirror's columns: the source columns, the metadata, the deleted flag, the TOASTed
    values' own columns."""
    return [*spec.columns, *METADATA_COLUMNS, DELETED, *toast.mirror_columns(spec)]


def latest_per_key(changes: DataFrame, spec: TableSpec) -> DataFrame:
    """The newest change of each primary key among `changes` (one aggregation, no sort).

    Toasted columns follow their own rule (`cdc_assets/toast.py`).
    """
    toasted = set(spec.toasted_columns)
    row = [c for c in [*spec.columns, *METADATA_COLUMNS, DELETED] if c != INGESTED_AT]
    newest = F.max_by(F.struct(*[F.col(c) for c in row if c not in toasted]), F.col(SEQUENCE))
    aggregates, toasts = toast.batch_columns(spec, changes)
    return (
        changes.groupBy(*spec.primary_key)
        .agg(newest.alias("_newest"), *aggregates)
        .select(*[F.col(f"_newest.{c}").alias(c) for c in row if c not in toasted], *toasts)
    )


def newest_per_key(changes: pa.Table, spec: TableSpec) -> pa.Table:
    """`latest_per_key` of changes held in memory (a slice the driver read and decoded): the
    same rows, columns and types, without a Spark query. The newest change of a key is the one
    latest in sequence order (`sequence_ranks`); toasted columns follow their own rule
    (`toast.newest_values`). tests/cdc_assets/test_rule.py holds the two forms to one output.
    """
    toasted = set(spec.toasted_columns)
    row = [c for c in [*spec.columns, *METADATA_COLUMNS, DELETED] if c != INGESTED_AT]
    keys = list(spec.primary_key)
    ranks, order = sequence_ranks(changes)
    per_key = {"_rank": ranks, **toast.carried_ranks(spec, changes, ranks)}
    grouped = pa.table({**{k: changes.column(k) for k in keys}, **per_key})
    grouped = grouped.group_by(keys, use_threads=False).aggregate([(c, "max") for c in per_key])
    newest = order.take(grouped.column("_rank_max"))
    columns = {c: changes.column(c).take(newest) for c in row if c not in toasted}
    return pa.table({**columns, **toast.newest_values(spec, changes, order, grouped)})


def sequence_ranks(changes: pa.Table) -> tuple[pa.Array, pa.Array]:
    """Each change's place in sequence order (0: the oldest), and the changes in that order
    (row indices): `_cdc_sequence` compared field by field, strings by their UTF-8 bytes, as
    Spark orders the struct. A slice's sequences are unique (they end with the Kafka partition
    and offset), so the order has no ties."""
    sequence = changes.column(SEQUENCE).combine_chunks()
    fields = [sequence.type.field(n).name for n in range(sequence.type.num_fields)]
    flat = pa.table(dict(zip(fields, sequence.flatten(), strict=True)))
    order = pc.sort_indices(flat, sort_keys=[(f, "ascending") for f in fields])
    ranks = np.empty(len(order), dtype=np.int64)
    ranks[order.to_numpy()] = np.arange(len(order), dtype=np.int64)
    return pa.array(ranks), order


def _col(alias: str, name: str) -> Column:
    return F.col(f"{alias}.`{name}`")


def applies(*, exists: Column, source: str = "s", target: str = "t") -> Column:
    """Whether the change `source` applies to the stored row `target` (exists: it has one)."""
    return ~exists | (_col(source, SEQUENCE) > _col(target, SEQUENCE))


def with_clauses(
    merge: DeltaMergeBuilder,
    spec: TableSpec,
    *,
    hour_key: str,
    ingested_at,
    truncate_before: Column | None = None,
) -> DeltaMergeBuilder:
    """The MERGE of the hour's newest change per key (`s`) into the mirror (`t`), clause by
    clause as the rule says; `truncate_before` is the hour's newest truncate's sequence."""
    newer = _col("s", SEQUENCE) > _col("t", SEQUENCE)
    deleting = _col("s", DELETED)
    inserted = {c: _col("s", c) for c in mirror_columns(spec)}
    # Toasted values and moves follow their own rule, even from a change stale for the row (an
    # older hour run later fills a value in).
    filled, fill = toast.merge_sets(spec)
    if spec.delete_mode == "hard":
        merge = merge.whenMatchedDelete(condition=newer & deleting)
    merge = merge.whenMatchedUpdate(condition=newer, set={**inserted, **filled})
    if filled:
        merge = merge.whenMatchedUpdate(condition=fill, set=filled)
    if spec.delete_mode == "hard":
        merge = merge.whenNotMatchedInsert(condition=~deleting, values=inserted)
    else:
        # A soft delete stores the delete's before-image (the row as the source last had it),
        # so the deleted row is the same whichever order the hours ran in.
        merge = merge.whenNotMatchedInsertAll()
    if truncate_before is not None:
        older = _col("t", SEQUENCE) < truncate_before
        if spec.delete_mode == "hard":
            merge = merge.whenNotMatchedBySourceDelete(condition=older)
        else:
            merge = merge.whenNotMatchedBySourceUpdate(
                condition=older & ~_col("t", DELETED),
                set={
                    DELETED: F.lit(True),
                    OP: F.lit("t"),
                    # The truncate's own sequence: any older change is stale against it.
                    SEQUENCE: truncate_before,
                    HOUR: F.lit(hour_key),
                    INGESTED_AT: F.lit(ingested_at).cast("timestamp"),
                },
            )
    return merge


def live_effects(
    spec: TableSpec, *, exists: Column, live: Column, fills: Column
) -> Mapping[str, Column]:
    """What each change `s` does to the live rows, against the row `t` it meets (`exists`: there
    is one; `live`: it is live; `fills`: the toasted rule fills a value of it), as `with_clauses`
    applies it: per change, whether it inserts, updates or deletes a live row, and whether the
    MERGE adds a row for it."""
    applied = applies(exists=exists)
    deleting = _col("s", DELETED)
    filling = exists & ~applied & fills
    if spec.delete_mode == "hard":
        # A delete removes the row it matches; one of a key the mirror lacks inserts nothing.
        deletes, adds_row = applied & deleting & exists, ~exists & ~deleting
    else:
        deletes, adds_row = applied & deleting & (live | ~exists), ~exists
    return {
        "inserted": applied & ~deleting & ~live,
        "updated": (applied & ~deleting & live) | (filling & live),
        "deleted": deletes,
        "adds_row": adds_row,
        # Whether the MERGE writes anything for the change (applies it, or fills a value).
        "writes": applied | filling,
    }


def describe(spec: TableSpec) -> str:
    """The rule as it applies to `spec`, in a sentence or two for the asset's description."""
    if spec.delete_mode == "hard":
        deletes = "deletes remove the row"
    else:
        deletes = "deletes are kept as rows with _cdc_deleted = true (read NOT _cdc_deleted)"
    text = (
        "Each hourly partition MERGEs that hour's slice of the topic: newest change per key by "
        f"{', '.join(part.field for part in spec.sequence)} (then Kafka partition and offset), "
        f"applied only when newer than the stored row; {deletes}."
    )
    if spec.on_truncate == "apply":
        text += " A truncate deletes every row older than it."
    if spec.toasted_columns:
        text += (
            f" Unchanged TOASTed values of {', '.join(spec.toasted_columns)} keep the newest "
            "value any change of the row carried."
        )
    return text
