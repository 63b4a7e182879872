"""An hour's decoded changes as the run's stages take them: held in the driver, or in Spark.

A slice read in the driver (`read.read_slice_locally`) is decoded in the driver into an Arrow
table (`DriverBatch`). Its counts, its audit and its expectations read that table in memory,
and its newest change per key is taken there by the rule's Arrow form (`rule.newest_per_key`);
Spark sees only what the hour writes, each write's source a local relation made from the table.
So such an hour runs no Spark query but its writes (DESIGN.md, "The hour's Spark budget").

A slice Spark read stays a cached Spark frame (`SparkBatch`): the same values, each counted by
a Spark job, the expectations run by great-expectations' Spark engine.

Sensitive columns are masked before anything reads them: every frame Spark writes goes through
`masking.mask_changes`, and the rows the checks read in memory show a hashed column only as
stand-ins (`masking.stand_ins`), never its values.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
from pyspark import StorageLevel
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from cdc_assets.checking import AuditVerdict, MirrorChecks
from cdc_assets.columns import (
    DELETED,
    ERROR,
    KAFKA_FIELDS,
    KAFKA_OFFSET,
    KAFKA_PARTITION,
    MOVED_FROM,
    OP,
    SEQUENCE,
    SHAPE,
    SOURCE_TS,
    TALLY,
    TOMBSTONE,
    TRUNCATE,
    source_fields,
)
from cdc_assets.config import TableSpec
from cdc_assets.decoding.shape import SourceShape
from cdc_assets.decoding.tally import Tally
from cdc_assets.masking import mask_changes, stand_ins
from cdc_assets.rule import latest_per_key, newest_per_key, sequence_ranks
from resources.masking import HmacKey

# A cached hour stays in memory as Spark's columnar batches, not serialized again (what
# MEMORY_AND_DISK adds for a frame), and spills to disk when memory is short.
CACHED = StorageLevel.MEMORY_AND_DISK_DESER

# The audit's verdict per change, joined to a frame Spark holds by the change's coordinates.
_EXPECTATION = "_cdc_expectation"


@dataclass(frozen=True)
class Applicable:
    """The changes the mirror takes (no error, tombstone or truncate, none older than the
    table's newest truncate): as the writes read them (`frame`, masked) and, for a batch held
    in the driver, in memory (`rows`, raw: for the newest-per-key step); how many were older
    than a truncate, and the distinct keys among them (the accounting's own count of the
    hour's keys, apart from the newest-per-key step that Delta's metrics count)."""

    frame: DataFrame
    rows: pa.Table | None
    older_than_truncate: int
    distinct_keys: int


@dataclass(frozen=True)
class Latest:
    """The newest change per key: the MERGE's source (`frame`, masked), what the expectations
    judge (`checked`: its live rows, in memory with stand-ins for hashed columns, or a frame),
    and how many there are (`rows`, the batch's count)."""

    frame: DataFrame
    checked: pa.Table | DataFrame
    rows: int


class DriverBatch:
    """A slice decoded in the driver (see the module docstring). `rows` is the decoder's Arrow
    table, `schema` its Spark schema; the audit marks the changes it holds back in `rows`."""

    def __init__(
        self,
        spark: SparkSession,
        spec: TableSpec,
        rows: pa.Table,
        schema: T.StructType,
        masking_key: HmacKey | None,
    ) -> None:
        self.spark, self.spec, self.rows, self.schema = spark, spec, rows, schema
        self.masking_key = masking_key
        marked = rows.filter(pc.is_valid(rows.column(TALLY))).column(TALLY).to_pylist()
        shapes = rows.filter(pc.is_valid(rows.column(SHAPE))).column(SHAPE).to_pylist()
        self.tally = Tally.combine(marked)
        self.shape = SourceShape.combine(shapes)
        self._newest_ms = _ms(self.tally.newest_source_us)

    def frame(self, rows: pa.Table) -> DataFrame:
        """`rows` as a masked Spark frame (a local relation: building it runs no query)."""
        sequence = self.schema[SEQUENCE].dataType
        # The newest-per-key step's own columns (toasted values' sequences and flags, moves).
        extra = {
            f.name: T.BooleanType() if pa.types.is_boolean(f.type) else sequence
            for f in rows.schema
            if f.name not in self.schema.fieldNames() and f.name != MOVED_FROM
        }
        schema = T.StructType(
            [
                self.schema[name] if name not in extra else T.StructField(name, extra[name])
                for name in rows.column_names
            ]
        )
        if rows.num_rows == 0:  # every column one empty chunk: PySpark takes no chunk at all
            rows = pa.table([pa.array([], f.type) for f in rows.schema], schema=rows.schema)
        frame = self.spark.createDataFrame(rows, schema=schema)
        return mask_changes(frame, self.spec, self.masking_key)

    def audit(self, checks: MirrorChecks, spec: TableSpec) -> AuditVerdict | None:
        """The hard expectations of `spec` (the table as the mirror stores it) on the
        applicable changes, in memory; the ones held back get their reason in `rows`' error
        column."""
        applicable = self.rows.filter(_applicable(self.rows))
        verdict = checks.audit(self.spark, spec, stand_ins(applicable, self.spec))
        if verdict is None or not verdict.failed:
            return verdict
        held = [
            verdict.failed.get((p, o))
            for p, o in zip(
                self.rows.column(KAFKA_PARTITION).to_pylist(),
                self.rows.column(KAFKA_OFFSET).to_pylist(),
                strict=True,
            )
        ]
        errors = pc.coalesce(self.rows.column(ERROR), pa.array(held, pa.string()))
        self.rows = self.rows.set_column(self.rows.schema.get_field_index(ERROR), ERROR, errors)
        # The changes held back are not in the mirror: its newest source time without them.
        kept = pc.if_else(pc.is_null(errors), self.rows.column(SOURCE_TS), None)
        self._newest_ms = _ms(pc.max(pc.cast(kept, pa.int64())).as_py())
        return verdict

    def newest_ms(self) -> int | None:
        """The newest source time (ms) among the changes the mirror takes (no error)."""
        return self._newest_ms

    def errors(self) -> DataFrame:
        """The error rows (the decoder's and the audit's), for the error table."""
        return self.frame(self.rows.filter(pc.is_valid(self.rows.column(ERROR))))

    def applicable(self, watermark: list | None) -> Applicable:
        rows = self.rows.filter(_applicable(self.rows))
        older = 0
        if watermark is not None:
            newer = _newer_than(rows, watermark)
            older = pc.sum(pc.invert(newer)).as_py() or 0
            rows = rows.filter(newer)
        keys = list(self.spec.primary_key)
        distinct = rows.select(keys).group_by(keys).aggregate([]).num_rows
        return Applicable(self.frame(rows), rows, older, distinct)

    def versions(self, applicable: Applicable) -> int:
        """The history's versions among the applicable changes: distinct key and source
        sequence (a change delivered twice is one version)."""
        rows = applicable.rows
        sequence = rows.column(SEQUENCE).combine_chunks()
        parts = {
            f"_v_{sequence.type.field(n).name}": sequence.field(n)
            for n in range(sequence.type.num_fields)
            if sequence.type.field(n).name not in KAFKA_FIELDS
        }
        keys = {k: rows.column(k) for k in self.spec.primary_key}
        return pa.table({**keys, **parts}).group_by([*keys, *parts]).aggregate([]).num_rows

    def latest(self, applicable: Applicable, spec: TableSpec) -> Latest:
        """The newest change per key by the rule of `spec` (the table as the mirror stores
        it), taken in memory; the MERGE's source built from it."""
        newest = newest_per_key(applicable.rows, spec)
        live = newest.filter(pc.invert(newest.column(DELETED)))
        return Latest(self.frame(newest), stand_ins(live, self.spec), newest.num_rows)

    def release(self) -> None:
        """Nothing is cached for a batch held in the driver."""


class SparkBatch:
    """A slice Spark read and decoded (`decoding.spark.decode`): a cached frame; one Spark job
    fills the cache and brings back each batch's tally and shape."""

    def __init__(self, spark: SparkSession, spec: TableSpec, frame: DataFrame) -> None:
        self.spark, self.spec = spark, spec
        self.frame = frame.persist(CACHED)
        self.cached = [self.frame]
        rows = self.frame.where(F.col(TALLY).isNotNull()).select(SHAPE, TALLY).collect()
        self.tally = Tally.combine(row[TALLY] for row in rows)
        self.shape = SourceShape.combine(row[SHAPE] for row in rows)
        self._newest_ms = _ms(self.tally.newest_source_us)

    def audit(self, checks: MirrorChecks, spec: TableSpec) -> AuditVerdict | None:
        verdict = checks.audit(self.spark, spec, self.frame.where(applicable()))
        if verdict is None or not verdict.failed:
            return verdict
        failed = self.spark.createDataFrame(
            [(p, o, reason) for (p, o), reason in verdict.failed.items()],
            f"{KAFKA_PARTITION} int, {KAFKA_OFFSET} bigint, {_EXPECTATION} string",
        )
        self.frame = self._keep(
            self.frame.join(F.broadcast(failed), [KAFKA_PARTITION, KAFKA_OFFSET], "left")
            .withColumn(ERROR, F.coalesce(F.col(ERROR), F.col(_EXPECTATION)))
            .drop(_EXPECTATION)
        )
        # The changes held back are not in the mirror: its newest source time without them.
        kept = self.frame.where(F.col(ERROR).isNull())
        self._newest_ms = kept.agg(F.unix_millis(F.max(SOURCE_TS))).first()[0]
        return verdict

    def newest_ms(self) -> int | None:
        return self._newest_ms

    def errors(self) -> DataFrame:
        return self.frame.where(F.col(ERROR).isNotNull())

    def applicable(self, watermark: list | None) -> Applicable:
        good, older = self.frame.where(applicable()), 0
        if watermark is not None:
            bound = sequence_value(good.schema[SEQUENCE].dataType, watermark)
            older = good.where(F.col(SEQUENCE) < bound).count()
            good = good.where(F.col(SEQUENCE) > bound)
        distinct = good.select(*self.spec.primary_key).distinct().count()
        return Applicable(good, None, older, distinct)

    def versions(self, applicable: Applicable) -> int:
        fields = source_fields(applicable.frame.schema[SEQUENCE].dataType)
        identity = [F.col(f"{SEQUENCE}.{f}").alias(f"_v_{f}") for f in fields]
        return applicable.frame.select(*self.spec.primary_key, *identity).distinct().count()

    def latest(self, applicable: Applicable, spec: TableSpec) -> Latest:
        latest = self._keep(latest_per_key(applicable.frame, spec))
        rows = latest.count()  # fills the cache once: the MERGE and the expectations read it
        return Latest(latest, latest.where(~F.col(DELETED)), rows)

    def _keep(self, frame: DataFrame) -> DataFrame:
        frame = frame.persist(CACHED)
        self.cached.append(frame)
        return frame

    def release(self) -> None:
        for frame in self.cached:
            frame.unpersist()


def _ms(us: int | None) -> int | None:
    return None if us is None else us // 1000


def applicable() -> Column:
    """Decoded changes to rows: not errors, tombstones or truncates."""
    return F.col(ERROR).isNull() & ~F.col(TOMBSTONE) & (F.col(OP) != TRUNCATE)


def _applicable(rows: pa.Table) -> pa.Array:
    """`applicable` of rows held in memory."""
    # Spark's three-valued logic, and a null condition keeps no row, as `where` does.
    change = pc.and_kleene(
        pc.invert(rows.column(TOMBSTONE)), pc.not_equal(rows.column(OP), TRUNCATE)
    )
    return pc.fill_null(pc.and_kleene(pc.is_null(rows.column(ERROR)), change), False)


def _newer_than(rows: pa.Table, watermark: list) -> pa.Array:
    """Whether each change's sequence is newer than `watermark` (a truncate's sequence parts),
    in the order `rule.sequence_ranks` gives: the watermark ranked among the changes."""
    fields = rows.schema.field(SEQUENCE).type
    bound = pa.array([dict(zip([f.name for f in fields], watermark, strict=True))], fields)
    both = pa.table({SEQUENCE: pa.concat_arrays([bound, *rows.column(SEQUENCE).chunks])})
    ranks, _ = sequence_ranks(both)
    return pc.greater(ranks.slice(1), ranks[0])


def sequence_value(sequence_type: T.StructType, values: list) -> Column:
    """A literal of the `_cdc_sequence` struct, comparable with the column."""
    fields = zip(sequence_type.fields, values, strict=True)
    return F.struct(*[F.lit(v).cast(f.dataType).alias(f.name) for f, v in fields])
