"""What each fault scenario measured, saved for `python -m tests.faults.report`.

A scenario compares the mirror with the reference replay of what Kafka really committed
(`compare`) and records the figures with `record`. The suite's conftest writes them all to
`FIGURES_PATH` at the end of the session; the report command prints them as a table.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from cdc_assets.columns import DELETED
from cdc_assets.config import TableSpec
from tests.support import delta_rows, rows_by_key

REPO = Path(__file__).resolve().parents[2]
DEFAULT_PATH = REPO / ".local" / "faults" / "figures.json"
FIGURES_PATH = Path(os.environ.get("CDC_FAULT_FIGURES", DEFAULT_PATH))


@dataclass
class Comparison:
    """Mirror against reference, in rows; every figure must be 0."""

    lost: int = 0  # live in the reference, missing from the mirror's live rows
    duplicates: int = 0  # extra Delta rows sharing one primary key (tombstones included)
    resurrected: int = 0  # deleted in the reference, live in the mirror
    mismatches: int = 0  # live on both sides with different values
    details: dict = field(default_factory=dict)

    @property
    def clean(self) -> bool:
        return not (self.lost or self.duplicates or self.resurrected or self.mismatches)


@dataclass
class Figures:
    scenario: str
    passed: bool
    faults: int
    lost: int
    duplicates: int
    resurrected: int
    mismatches: int
    secret_hits: int


_RECORDED: list[Figures] = []
_OWNERS: list[str] = []  # the test that recorded each entry of _RECORDED
_CURRENT: list[str] = []  # the test running now (set by tests/conftest.py)

# Every scenario the suite records; the report fails when one has no figures.
SCENARIOS = (
    "connector_restart_duplicates",
    "killed_before_delta_commit",
    "killed_after_commit_before_dagster",
    "two_runs_of_one_hour_at_once",
    "convergence_property",
    "delete_reinsert_and_key_update",
    "tombstones_null_and_mismatched_keys",
    "late_snapshot_reads",
    "truncate_fail_or_apply",
    "truncate_first_then_older_hours",
    "aborted_and_open_transactions",
    "offsets_deleted_by_retention",
    "compacted_between_runs",
    "broker_restarted_mid_read",
    "schema_new_column_and_type_change",
    "malformed_mistyped_oversized_unknown",
    "toasted_value_unchanged",
    "blocking_check_holds_downstream",
    "sasl_scram_tls",
    "sensitive_columns_masked",
    "partitions_added_between_hours",
    "producer_clock_ahead_then_back",
    "lake_disk_full_during_merge",
    "s3_503_slowdown",
    "daemon_killed_mid_tick",
    "run_killed_holding_pool_slot",
)


def compare(
    path: str,
    spec: TableSpec,
    expected: dict[tuple, dict],
    seen_keys: set[tuple],
) -> Comparison:
    """The mirror at `path` against `expected` (reference live rows by key).

    `seen_keys` are all keys the reference met, so keys seen but not live were deleted. The
    mirror is read with deltalake (`tests.support.delta_rows`).
    """
    stored = delta_rows(path).to_pylist()
    actual = rows_by_key([row for row in stored if row[DELETED] is False], spec)  # as SQL's NOT
    per_key = Counter(tuple(row[k] for k in spec.primary_key) for row in stored)
    extra = sum(count - 1 for count in per_key.values())
    deleted = seen_keys - set(expected)
    lost = sorted(set(expected) - set(actual))
    resurrected = sorted(set(actual) & deleted)
    unknown = sorted(set(actual) - set(expected) - deleted)
    different = sorted(k for k in set(actual) & set(expected) if actual[k] != expected[k])
    return Comparison(
        lost=len(lost),
        duplicates=int(extra),
        resurrected=len(resurrected),
        # A live key the reference never saw is a wrong row too.
        mismatches=len(different) + len(unknown),
        details={
            "lost": lost[:5],
            "resurrected": resurrected[:5],
            "unknown": unknown[:5],
            "different": different[:5],
        },
    )


@contextmanager
def recording_for(test_id: str) -> Iterator[None]:
    _CURRENT[:] = [test_id]
    try:
        yield
    finally:
        _CURRENT.clear()


def fail_recorded_by(test_id: str) -> None:
    """Marks the figures a failed test recorded as not passed, whatever they say."""
    for figures, owner in zip(_RECORDED, _OWNERS, strict=True):
        if owner == test_id:
            figures.passed = False


def record(
    scenario: str,
    comparison: Comparison | None = None,
    *,
    faults: int,
    secret_hits: int = 0,
    passed: bool | None = None,
) -> None:
    """Adds one scenario's figures; `passed` defaults to a clean comparison and no secret hit."""
    c = comparison or Comparison()
    ok = c.clean and not secret_hits if passed is None else passed
    _OWNERS.append(_CURRENT[0] if _CURRENT else "")
    _RECORDED.append(
        Figures(
            scenario=scenario,
            passed=ok,
            faults=faults,
            lost=c.lost,
            duplicates=c.duplicates,
            resurrected=c.resurrected,
            mismatches=c.mismatches,
            secret_hits=secret_hits,
        )
    )


def save(path: Path = FIGURES_PATH) -> None:
    """Writes this session's figures over the same scenarios' earlier ones (a `-k` run
    keeps the others, each with the time it was measured)."""
    if not _RECORDED:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    # Test workers (pytest -n) each save their own scenarios: one at a time, each keeping the
    # others' rows.
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        rows = {r["scenario"]: r for r in (json.loads(path.read_text()) if path.exists() else [])}
        now = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
        rows |= {f.scenario: {**asdict(f), "measured": now} for f in _RECORDED}
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(sorted(rows.values(), key=lambda r: r["scenario"]), indent=2))
        tmp.replace(path)
