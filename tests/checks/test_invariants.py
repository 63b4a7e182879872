"""The pipeline's own checks on hand-made hour results: each passes on a sound hour and fails,
saying why, on a broken one; severity comes from the table's policy."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import dagster as dg

from cdc_assets.config import (
    CheckPolicy,
    ErrorRatePolicy,
    FreshnessPolicy,
    RetentionPolicy,
    TableSpec,
)
from cdc_assets.decoding.shape import SourceShape
from cdc_assets.read import OffsetCensus
from cdc_assets.results import HourCounts, HourResult
from cdc_assets.slicing import HourSlice, PartitionSlice
from checks.invariants import (
    accounting_result,
    changes_readable_result,
    complete_hour_result,
    continuity_result,
    error_rate_result,
    freshness_result,
    history_result,
    retention_risk_result,
    schema_drift_result,
    toasted_values_result,
)
from resources.kafka import TopicRetention

START = datetime(2026, 11, 3, 9, tzinfo=UTC)


POLICY = CheckPolicy(severity="ERROR", blocking=True)
KEY = "2026-11-03-09:00"


def _result(
    counts: HourCounts = None, slice_size: int = 10, *, partitions=None, **fields
) -> HourResult:
    counts = counts or BALANCED
    hour_slice = HourSlice(
        topic="t",
        hour_start=START,
        hour_end=START + timedelta(hours=1),
        partitions=partitions or (PartitionSlice(0, 5, 5 + slice_size, 0, True),),
        closed=True,
        open_reason=None,
    )
    return HourResult(
        table="t",
        hour_key="2026-11-03-09:00",
        slice=hour_slice,
        counts=counts,
        rows_inserted=0,
        rows_updated=0,
        rows_deleted=0,
        delta_version=1,
        partial=False,
        newest_source_ts=None,
        finished_at=fields.pop("finished_at", START + timedelta(hours=2)),
        **fields,
    )


BALANCED = HourCounts(consumed=10, applied=4, superseded=2, stale=1, tombstones=1, errors=2)


def test_a_forced_open_hour_fails_complete_hour():
    closed = _result()
    assert complete_hour_result(closed, POLICY).passed
    still_open = replace(
        closed,
        partial=True,
        slice=replace(closed.slice, closed=False, open_reason="partitions [1] hold no message"),
    )
    check = complete_hour_result(still_open, POLICY)
    assert not check.passed and check.severity == dg.AssetCheckSeverity.ERROR
    assert "partitions [1] hold no message" in check.description
    assert "again after it closes" in check.description


def test_balanced_counts_pass():
    check = accounting_result(_result(BALANCED), POLICY)
    assert check.passed
    assert check.metadata["accounted"].value == 10
    assert check.metadata["offset_gaps"].value == 0


def test_unbalanced_counts_fail():
    check = accounting_result(_result(replace(BALANCED, errors=3)), POLICY)
    assert not check.passed
    assert "consumed 10 but accounted for 11" in check.description


def test_a_merge_touching_more_rows_than_keys_fails():
    # applied > merged keys shows up as a negative stale count.
    check = accounting_result(_result(replace(BALANCED, applied=6, stale=-1)), POLICY)
    assert not check.passed
    assert "negative counts: stale" in check.description


def test_reading_past_the_slice_fails():
    assert not accounting_result(_result(BALANCED, slice_size=9), POLICY).passed


def test_offset_gaps_pass_only_when_kafka_counts_them_as_markers_or_aborted_records():
    # 12 offsets, 10 read: Kafka's consumers find 11 records (1 marker), 10 of them committed.
    explained = replace(BALANCED, census=OffsetCensus(committed=10, uncommitted=11))
    check = accounting_result(_result(explained, slice_size=12), POLICY)
    assert check.passed, check.description
    assert check.metadata["offset_gaps"].value == 2
    assert check.metadata["transaction_markers"].value == 1
    assert check.metadata["aborted_records"].value == 1
    # The reader got 10 of the 12 committed records Kafka holds: 2 lost on the way.
    lost = replace(BALANCED, census=OffsetCensus(committed=12, uncommitted=12))
    check = accounting_result(_result(lost, slice_size=12), POLICY)
    assert not check.passed
    assert "Kafka holds 12 committed records" in check.description
    assert "the run read 10" in check.description
    # Gaps nobody counted are not explained.
    check = accounting_result(_result(BALANCED, slice_size=12), POLICY)
    assert not check.passed and "2 offsets of the slice" in check.description


# --- continuity (I1) -----------------------------------------------------------------------


def _parts(*starts_ends):
    return tuple(PartitionSlice(p, s, e, 0, True) for p, (s, e) in enumerate(starts_ends))


def test_continuity_passes_when_each_partition_starts_at_the_previous_end():
    check = continuity_result(
        _result(partitions=_parts((5, 9), (7, 7)), previous_end={0: 5, 1: 7}), POLICY
    )
    assert check.passed and check.severity == dg.AssetCheckSeverity.ERROR


def test_continuity_names_gaps_and_overlaps():
    check = continuity_result(
        _result(partitions=_parts((8, 9), (3, 9)), previous_end={0: 5, 1: 7}), POLICY
    )
    assert not check.passed
    assert "partition 0: gap, offsets [5, 8) were skipped" in check.description
    assert "partition 1: overlap, offsets [3, 7) read twice" in check.description
    assert check.metadata["partitions_with_gap_or_overlap"].value == 2


def test_continuity_on_new_and_vanished_partitions():
    new = _parts((5, 9), (0, 3), (4, 6))  # partition 2 is new and starts above its log start 0
    check = continuity_result(_result(partitions=new, previous_end={0: 5, 1: 0}), POLICY)
    assert not check.passed
    assert "partition 2 is new since the previous hour: gap, offsets [0, 4)" in check.description
    gone = continuity_result(_result(partitions=_parts((5, 9)), previous_end={0: 5, 1: 2}), POLICY)
    assert (
        not gone.passed
        and "partition 1 ended the previous hour at 2 but is gone" in gone.description
    )
    fresh = continuity_result(
        _result(partitions=_parts((5, 9), (0, 2)), previous_end={0: 5}), POLICY
    )
    assert fresh.passed


def test_continuity_without_a_previous_run_passes_and_says_so():
    check = continuity_result(_result(previous_end=None), POLICY)
    assert check.passed and check.metadata["previous_hour_recorded"].value is False


# --- error rate (I7) ----------------------------------------------------------------------


def test_error_rate_fails_above_the_configured_share():
    policy = ErrorRatePolicy(max_share=0.25, severity="WARN")  # WARN alone: not blocking
    assert not policy.blocking
    assert error_rate_result(_result(BALANCED), policy).passed  # 2 of 9 changes
    check = error_rate_result(_result(replace(BALANCED, errors=3, applied=3)), policy)
    assert not check.passed and check.severity == dg.AssetCheckSeverity.WARN
    assert "3 of 9 changes (33.33%)" in check.description  # the tombstone is no change


def test_error_rate_blocks_by_default_and_names_the_reasons_and_the_fix():
    """Hundreds of rejected changes fail the run (a blocking ERROR check), not exit 0."""
    policy = ErrorRatePolicy()
    assert (policy.severity, policy.blocking, policy.max_share) == ("ERROR", True, 0.01)
    reasons = {"column 'memo' holds a string where int32 was expected; declare it string": 2}
    check = error_rate_result(_result(BALANCED, error_reasons=reasons), policy)
    assert not check.passed and check.severity == dg.AssetCheckSeverity.ERROR
    assert "2 x column 'memo' holds a string" in check.description
    assert "error_rate: {severity: WARN}" in check.description


# --- freshness -------------------------------------------------------------------------------


def test_freshness_is_judged_at_the_hour_end():
    policy = FreshnessPolicy(max_lag_minutes=30)
    hour_end = START + timedelta(hours=1)
    fresh = freshness_result(_result(), policy, mirror_newest=hour_end - timedelta(minutes=29))
    assert fresh.passed and fresh.metadata["lag_minutes"].value == 29.0
    stale = freshness_result(_result(), policy, mirror_newest=hour_end - timedelta(minutes=31))
    assert not stale.passed and "more than the allowed 0:30:00" in stale.description
    ahead = freshness_result(_result(), policy, mirror_newest=hour_end + timedelta(hours=3))
    assert ahead.passed and ahead.metadata["lag_minutes"].value == 0.0
    # The current hour is judged against now, not its future end.
    current = _result(finished_at=START + timedelta(minutes=20))
    assert freshness_result(current, policy, mirror_newest=START).passed


# --- schema drift ------------------------------------------------------------------------


SPEC = TableSpec(
    name="t",
    topic="t",
    primary_key=("id",),
    columns={"id": "bigint", "name": "string", "at": "timestamp", "amount": "decimal(10,2)"},
    start_hour="2026-11-01-00:00",
)


def test_schema_drift_passes_on_declared_columns_and_compatible_encodings():
    fields = {"id": {"int64"}, "name": {"string"}, "at": {"int64/MicroTimestamp"}}
    shape = SourceShape(fields={**fields, "amount": {"bytes/Decimal(scale=2)"}}, schemas={True})
    check = schema_drift_result(_result(source_fields=shape), SPEC, POLICY)
    assert check.passed and check.metadata["connect_schema"].value == "yes"


def test_schema_drift_names_appeared_vanished_and_changed_columns():
    mismatch = (
        "column 'id' is Connect string in the connector's schema but is declared bigint; "
        "declare it string"
    )
    shape = SourceShape(
        fields={"id": {"string"}, "name": {"string"}, "amount": {"int64"}, "nickname": {"string"}},
        mismatches={"id": {mismatch}},
        schemas={True},
    )
    check = schema_drift_result(_result(source_fields=shape), SPEC, POLICY)
    assert not check.passed
    assert "appeared: nickname" in check.description
    assert "declared columns the hour's rows lack: at (" in check.description
    assert mismatch in check.description
    assert check.metadata["appeared"].value == "nickname"
    assert check.metadata["type_changed"].value == {"id": [mismatch]}


def test_schema_drift_names_the_columns_a_sensitive_table_withheld():
    shape = SourceShape(fields={"id": {"string"}, "phone": {"string"}}, schemas={True})
    check = schema_drift_result(
        _result(source_fields=shape, withheld_columns=("phone",)), SPEC, POLICY
    )
    assert not check.passed
    assert "not stored: phone; the table has sensitive columns" in check.description
    assert check.metadata["withheld_columns"].value == "phone"
    # Nothing withheld: the metadata says so, and no such problem is named.
    check = schema_drift_result(_result(source_fields=shape), SPEC, POLICY)
    assert "not stored" not in check.description
    assert check.metadata["withheld_columns"].value == ""


# `flag TINYINT(1) NOT NULL DEFAULT 0` since CREATE TABLE, `grade INT NOT NULL DEFAULT 7` added
# later: their Connect schemas show the defaults (docs/debezium.md, 'Schema changes').
DEFAULTS_TABLE = {
    "name": "t",
    "topic": "t",
    "primary_key": ["id"],
    "columns": {"id": "bigint", "flag": "int", "grade": "int"},
    "start_hour": "2026-11-01-00:00",
}
SINCE_CREATE = TableSpec.model_validate(DEFAULTS_TABLE)


def _shape(*, absent: set[str] = frozenset()) -> SourceShape:
    """The hour's shape as the decoder reports a schema naming id, flag and grade."""
    fields = {"id": {"int64"}, "flag": {"int16"}, "grade": {"int32"}}
    return SourceShape(
        fields=fields,
        schemas={True},
        defaults={"flag": {"0"}, "grade": {"7"}},
        absent=set(absent),
    )


def test_schema_drift_leaves_a_default_alone_on_a_column_every_change_carries():
    """A NOT NULL DEFAULT column the table had since it was created is in every change: no row
    of the mirror can hold null for want of its default, so an undeclared default is fine."""
    check = schema_drift_result(_result(source_fields=_shape()), SINCE_CREATE, POLICY)
    assert check.passed, check.description
    assert check.metadata["undeclared_defaults"].value == ""


def test_schema_drift_names_a_default_of_a_column_some_changes_were_written_without():
    """`ALTER TABLE ... ADD COLUMN grade ... DEFAULT 7`: changes written before it lack grade,
    and their rows hold null where the source shows 7, whether this hour had such a change or
    an earlier run read one (its record), until the tables file declares the default."""
    for result in (
        _result(source_fields=_shape(absent={"grade"})),
        _result(source_fields=_shape(), columns_lacked=("grade",)),
    ):
        check = schema_drift_result(result, SINCE_CREATE, POLICY)
        assert not check.passed
        assert check.description.startswith(
            "the source's schema gives grade a default that the tables file does not declare, "
            "and changes the mirror took were written before the source table had the column"
        )
        assert check.metadata["undeclared_defaults"].value == "grade"
        assert check.metadata["columns_some_changes_lack"].value == "grade"
    columns = {**DEFAULTS_TABLE["columns"], "grade": {"type": "int", "default": 7}}
    declared = TableSpec.model_validate({**DEFAULTS_TABLE, "columns": columns})
    assert schema_drift_result(result, declared, POLICY).passed


def test_an_hour_whose_every_change_is_an_error_fails_changes_readable():
    reason = "column 'balance' holds decimal text ..."
    policy = CheckPolicy(severity="ERROR", blocking=True)
    failing = _result(
        counts=HourCounts(consumed=5, applied=0, superseded=0, stale=0, tombstones=1, errors=4),
        error_reasons={reason: 4},
    )
    check = changes_readable_result(failing, policy)
    assert not check.passed
    assert "all 4 changes" in check.description and reason in check.description
    some = _result(
        counts=HourCounts(consumed=5, applied=1, superseded=0, stale=0, tombstones=1, errors=3)
    )
    assert changes_readable_result(some, policy).passed
    empty = _result(
        counts=HourCounts(consumed=1, applied=0, superseded=0, stale=0, tombstones=1, errors=0)
    )
    assert changes_readable_result(empty, policy).passed


def test_unknown_toasted_values_fail_their_check():
    check = toasted_values_result(_result(), POLICY, unknown={"body": 2, "notes": 0})
    assert not check.passed and "2 live rows hold no known value of 'body'" in check.description
    assert check.metadata["unknown_notes"].value == 0
    assert toasted_values_result(_result(), POLICY, unknown={"body": 0}).passed


# --- retention risk (I6) ----------------------------------------------------------------


def _retention(**kwargs):
    options = {
        "hour_key": KEY,
        "recorded_starts": {0: 5, 1: 7},
        "log_starts": {0: 0, 1: 7},
        "retention": TopicRetention(retention_ms=None, retention_bytes=None, compacted=False),
        "now": START + timedelta(hours=5),
        "policy": RetentionPolicy(min_hours_left=24),
    }
    return retention_risk_result(**(options | kwargs))


def test_retention_risk_passes_with_unlimited_retention():
    assert _retention().passed


def test_retention_risk_counts_the_hours_left():
    week = TopicRetention(retention_ms=7 * 24 * 3_600_000, retention_bytes=None, compacted=False)
    check = _retention(retention=week)
    assert check.passed and check.metadata["hours_left"].value == 7 * 24 - 5
    day = TopicRetention(retention_ms=24 * 3_600_000, retention_bytes=None, compacted=False)
    soon = _retention(retention=day)
    assert not soon.passed and "19.0 h from now, fewer than 24" in soon.description


def test_retention_risk_fails_once_the_offsets_are_gone_or_unknown():
    gone = _retention(log_starts={0: 6, 1: 7})
    assert not gone.passed
    assert "partition 0: offsets [5, 6) are already deleted" in gone.description
    assert "can no longer be replayed" in gone.description
    unknown = _retention(recorded_starts=None)
    assert not unknown.passed and "no recorded run" in unknown.description


def test_the_history_check_fails_when_the_hour_did_not_reach_the_history():
    """The per-hour history check judges the logs and the batch: the history's log must hold
    a commit of the run's record, and its MERGE insert no more versions than the hour has."""
    from cdc_assets.history import HistoryOutcome
    from cdc_assets.history_tracking import FoldOutcome
    from cdc_assets.results import HistoryRun

    def judged(outcome, folded=None):
        return history_result(_result(history=HistoryRun(outcome, folded)), POLICY)

    good = HistoryOutcome(versions=3, opened=2, rewritten=1, version=7, recorded_version=7)
    assert judged(good).passed
    missing = replace(good, version=None, recorded_version=None)
    assert "holds no commit of this run" in judged(missing).description
    doubled = replace(good, opened=4)
    assert "inserted 4 versions, more than the hour's 3" in judged(doubled).description
    unfolded = FoldOutcome(3, 1, 0, 0, None, recorded_version=None)
    assert "folded history's log holds no commit" in judged(good, unfolded).description
    assert judged(good, replace(unfolded, recorded_version=9)).passed
