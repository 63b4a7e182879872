"""What a run counts from its commits and the log, without Spark: the live rows a MERGE
inserted, updated and deleted from its change rows (`merge.live_split`), and whether a run on
record applied a slice already (`commits.applied_before`). Pure functions, no Spark."""

from __future__ import annotations

import json

import pyarrow as pa

from cdc_assets.commits import PREPARES, applied_before
from cdc_assets.ledger import DeltaLog
from cdc_assets.merge import SPLIT_BY_FEED, live_split
from tests.support import accounts_spec

SPEC = accounts_spec("counts")


class _Log:
    """A ledger whose commit holds `rows` as its change rows."""

    def __init__(self, rows: list[tuple[str, int, bool]] | None) -> None:
        self.rows = rows

    def change_rows(self, version, columns):
        if self.rows is None:
            return None
        kinds, ids, deleted = zip(*self.rows, strict=True) if self.rows else ((), (), ())
        return pa.table(
            {
                "id": pa.array(ids, pa.int64()),
                "_cdc_deleted": pa.array(deleted, pa.bool_()),
                "_change_type": pa.array(kinds, pa.string()),
            }
        )


def test_the_live_split_follows_each_rows_images():
    rows = [
        ("insert", 1, False),  # a new live row: inserted
        ("insert", 2, True),  # a delete of a key the mirror lacked: deleted
        ("update_preimage", 3, False),  # live → live: updated
        ("update_postimage", 3, False),
        ("update_preimage", 4, False),  # live → deleted: deleted
        ("update_postimage", 4, True),
        ("update_preimage", 5, True),  # deleted → live: inserted (undeleted)
        ("update_postimage", 5, False),
        ("update_preimage", 6, True),  # deleted → deleted (a newer delete): none
        ("update_postimage", 6, True),
        ("delete", 7, False),  # a live row removed (hard delete): deleted
    ]
    assert live_split(SPEC, _Log(rows), 3) == (2, 1, 3, SPLIT_BY_FEED)


def test_no_change_rows_no_split():
    assert live_split(SPEC, _Log(None), 3) is None
    # Images that don't pair up by key are not read as a split.
    unpaired = [("update_preimage", 1, False), ("update_postimage", 2, False)]
    assert live_split(SPEC, _Log(unpaired), 3) is None


def test_a_slice_is_applied_before_only_by_a_complete_record_of_it():
    hour = "2026-11-04-08:00"
    slice_ = {"topic": "t", "partitions": {"0": {"start": 0, "end": 5}}, "closed": True}
    other = {"topic": "t", "partitions": {"0": {"start": 0, "end": 6}}, "closed": True}
    record = {"hour": hour, "slice": slice_}
    assert applied_before([record], hour, slice_)
    assert not applied_before([record], hour, other)
    assert not applied_before([record], "2026-11-04-09:00", slice_)
    assert not applied_before([{**record, "partial": True}], hour, slice_)
    assert not applied_before([{**record, "read_from": {"0": 3}}], hour, slice_)
    assert not applied_before([], hour, slice_)


def test_a_commit_that_prepared_a_merge_is_no_run_on_record(tmp_path):
    """A run that stopped after creating the table (or adding a column) before its MERGE left
    a commit carrying its record: the runs' history leaves it out, so the hour is not taken
    for applied and the next run MERGEs it."""
    hour = "2026-11-04-08:00"
    record = {"hour": hour, "slice": {"topic": "t", "partitions": {}, "closed": True}}
    log = tmp_path / "_delta_log"
    log.mkdir()
    for version, metadata in enumerate([{**record, PREPARES: "the mirror's table"}, record]):
        info = {"operation": "WRITE", "userMetadata": json.dumps(metadata)}
        (log / f"{version:020d}.json").write_text(json.dumps({"commitInfo": info}) + "\n")
    _, history = DeltaLog(str(tmp_path)).hour_history()
    assert [c["version"] for c in history] == [1]
    assert applied_before(history, hour, record["slice"])
    (log / f"{1:020d}.json").unlink()
    _, prepared_only = DeltaLog(str(tmp_path)).hour_history()
    assert prepared_only == [] and not applied_before(prepared_only, hour, record["slice"])
