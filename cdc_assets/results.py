"""What a table-hour's run returns: its counts (`HourCounts`, I2's terms) and `HourResult`.

Plain values, no Spark: the asset turns them into metadata and check results, the checks judge
them, the fleet collects them. The accounting (`HourCounts.counted`) sits beside the identity it
must satisfy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING

from cdc_assets.decoding.shape import SourceShape

if TYPE_CHECKING:
    from cdc_assets.checking import AuditVerdict
    from cdc_assets.decoding.tally import Tally
    from cdc_assets.history import HistoryOutcome
    from cdc_assets.history_tracking import FoldOutcome
    from cdc_assets.merge import MergeOutcome
    from cdc_assets.read import OffsetCensus
    from cdc_assets.slicing import HourSlice


@dataclass(frozen=True)
class KeyCounts:
    """The primary key's uniqueness in what the hour wrote: its distinct keys (counted on the
    batch) and the MERGE's source rows beyond them (Delta's count of its source rows, less
    the keys). Two source rows of one new key are both inserted by Delta, so this is the
    hour's guard; the whole mirror is judged once a day (`checks.daily`)."""

    keys: int
    duplicates: int


@dataclass(frozen=True)
class HourCounts:
    """I2: consumed = applied + superseded + stale + tombstones + errors (checks/invariants).

    Each figure is counted where it happens, not derived from the others, so the identity can
    fail: `consumed` by the reader (the records Kafka returned), `tombstones` and `errors` by the
    decoder and the audit, `superseded` on the batch (applicable changes minus the distinct keys
    among them), `applied` and `stale` from the MERGE's own operation metrics (the rows it wrote,
    and its source rows it did not write). `distinct_keys` and `merge_source_rows` are the two
    counts of the hour's keys (the batch's, Delta's): a newest-change-per-key step that lost or
    doubled a key makes them differ, and the identity fail.
    """

    consumed: int
    applied: int
    superseded: int
    stale: int
    tombstones: int
    errors: int
    distinct_keys: int = 0
    merge_source_rows: int = 0
    # Counted by Kafka's own consumers when the reader got fewer records than the slice has
    # offsets (transaction markers, aborted records, compaction); None when it got them all.
    census: OffsetCensus | None = None

    @classmethod
    def counted(
        cls,
        consumed: int,
        tally: Tally,
        errors: int,
        outcome: MergeOutcome,
        distinct_keys: int,
        older_than_truncate: int,
        census: OffsetCensus | None,
    ) -> HourCounts:
        """The figures of a run, each from where it was counted: `consumed` by the reader, the
        tally by the decoder, `errors` by the decoder and the audit, the MERGE's by Delta
        (operationMetrics). Truncate records count as applied, changes older than a truncate
        as stale; the audit's held-back changes are errors, not changes."""
        changes = tally.changes - (errors - tally.errors)
        return cls(
            consumed=consumed,
            applied=outcome.applied + tally.truncates,
            superseded=changes - older_than_truncate - distinct_keys,
            stale=outcome.merged_keys - outcome.applied + older_than_truncate,
            tombstones=tally.tombstones,
            errors=errors,
            distinct_keys=distinct_keys,
            merge_source_rows=outcome.merged_keys,
            census=census,
        )


@dataclass(frozen=True)
class HistoryRun:
    """A table-hour's history stage: what it wrote (a version per change; with tracked columns
    into `<table>__history_changes`, then `folded` into `<table>__history`)."""

    outcome: HistoryOutcome
    folded: FoldOutcome | None = None


@dataclass(frozen=True)
class HourResult:
    table: str
    hour_key: str
    slice: HourSlice
    counts: HourCounts
    # The live rows the hour inserted, updated and deleted (`merge.MergeOutcome`), and where
    # they were counted: the commit's change data, or the MERGE's metrics.
    rows_inserted: int
    rows_updated: int
    rows_deleted: int
    delta_version: int | None
    partial: bool
    newest_source_ts: datetime | None
    finished_at: datetime
    error_reasons: dict[str, int] = field(default_factory=dict)
    # The MERGE commit that wrote this hour's changes; None when nothing was newer.
    merge_version: int | None = None
    # The previous hour's recorded end offsets when this hour ran; None: no run on record.
    previous_end: dict[int, int] | None = None
    # What the hour's records told of the source's columns (encodings, mismatches, new ones).
    source_fields: SourceShape = field(default_factory=SourceShape)
    # The source columns some change the mirror's runs read was written without, this hour's
    # included (recorded in each run's commit: `shape.lacked_columns`).
    columns_lacked: tuple[str, ...] = ()
    # The hard expectations' verdict; None when the table declares none.
    audit: AuditVerdict | None = None
    # The other expectations' verdicts, on the hour's newest change per key (`MirrorChecks`).
    expectations: tuple[object, ...] = ()
    # The newest source timestamp among the changes the mirror has taken, this run's included
    # (recorded in each run's commit as a running maximum, so no run scans the table for it).
    mirror_newest: datetime | None = None
    # Undeclared columns `new_columns: add` did not add: the table has sensitive columns.
    withheld_columns: tuple[str, ...] = ()
    # Where the hour begins per partition (None: where `slice` begins), and where a refresh of
    # the hour had read up to, from where this run read on (None: it read the whole hour).
    hour_starts: dict[int, int] | None = None
    refreshed_to: dict[int, int] | None = None
    # A table with `history: true`: what the run wrote to its history, and the history of the
    # hour's keys judged afterwards (`cdc_assets.history`); None without history.
    history: HistoryRun | None = None
    rows_counted_from: str = "merge metrics"
    # The slice was applied by an earlier run on record: nothing was MERGEd again.
    replayed: bool = False

    def hour_start_offsets(self) -> dict[int, int]:
        """Where the hour begins, per partition: the slice's start unless a refresh came first."""
        return dict(self.hour_starts) if self.hour_starts else self.slice.start_offsets()

    @property
    def lag_seconds(self) -> float | None:
        if self.newest_source_ts is None:
            return None
        return (self.finished_at - self.newest_source_ts).total_seconds()
