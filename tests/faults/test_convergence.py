"""I3 as a property: any schedule of hours, on any number of mirrors, converges.

The log is written once: four hours of an accounts table's changes over a dozen keys, with the
faults that make order matter (see `_log`). Hypothesis then draws schedules: one or two
mirrors of that topic, each a list of runs of its hours, either every hour at least once in any
order plus repeats, or any subset with repeats; some runs are refreshes of an hour while it was
still open (a tier-0 table's `refresh_minutes`), which read its records up to a moment inside it
(`_as_of`: the Kafka offsets as they stood then), the runs after them reading on from there.
Each schedule runs on a fresh lake through the fleet runner (`run_tables`, the path the
mirrors' asset takes: the mirrors' hours interleave on the suite's one Spark session, two tables
at a time), and each mirror is compared with the reference replay of the records Kafka committed
that its runs read (`_read_by`): `demo.reference` orders every key's changes by sequence, so
that replay does not depend on the order hours run in, and I3 says the mirror must not either.
Every table-hour's accounting check (I2) must pass too, refreshes included. The first mirror
keeps its history (`history: true`): its `__history` table must equal `demo.reference.history`
of the same records version by version, and its `history` check pass on every table-hour.
Hypothesis also draws how that history tracks columns (`TRACKING`): with the balance left
out, `__history` must equal `demo.reference.tracked_history` and `__history_changes` the
per-change reference. And whether a schedule's small hours run interpreted (the default for mirrors
this small, `interpreted_max_bytes`) or generate code (the large tables' way); both must occur.

Every run first tries the pinned schedules (`PINNED`): the one the property shrank to when the
MERGE's sequence guard was removed (a single mirror running hours 0, 2, 3, 1: 3 resurrected
deletes, 7 mismatched rows), and three that between them take every mode the strategy draws.
Then as many drawn ones as the Hypothesis profile's `max_examples` (tests/conftest.py): CI
(`CI=true`, the `ci` profile) draws 6, derandomized, so the same 10 schedules every run, 49
table-hours. In the whole suite 20 drawn schedules (112 table-hours) took 261.6 s at `cd1ee94`
(2026-12-02); what these take is in docs/testing.md. Locally the `dev` profile draws 6 new
schedules each run and replays a failing one first (kept in `.local/hypothesis`);
`--hypothesis-profile=deep` draws 200. `python -m benchmarks.small_hours` measures what a small
table-hour costs.
"""

from __future__ import annotations

import logging
import random
import time
from collections import Counter
from dataclasses import replace
from datetime import timedelta

import pytest
from hypothesis import example, given, note, settings
from hypothesis import strategies as st
from kafka import TopicPartition

from cdc_assets import hour_run
from cdc_assets.config import TableSpec
from cdc_assets.fleet import TableWork, run_tables
from checks.table_checks import MIRROR_CHECKS
from demo.reference import history, tracked_history
from resources.lake import LakeResource
from tests.faults import table
from tests.faults.figures import Comparison, compare, record
from tests.support import read_records

pytestmark = pytest.mark.integration

log = logging.getLogger(__name__)

HOURS = 4
KEYS = 12
PARTITIONS = 3
PER_HOUR = 24
REDELIVERED = 6  # the previous hour's last records a connector restart sends again
SNAPSHOT_LSN = 500  # older than every streamed change (those start at 1010)
MAX_MIRRORS = 2
FIGURES = ("lost", "duplicates", "resurrected", "mismatches")


def _log(seed: int) -> tuple[list[table.Change], Counter]:
    """The topic's changes, in send order, and how many of each fault they carry.

    Per hour: the previous hour's last records delivered again (a connector restart: same
    bytes, same LSN, a later offset); creates, updates and deletes of hot keys, most deletes
    followed by their tombstone, a deleted key created again; updates that keep the row's name
    (a tracked history folds them into the version in force); some changes sent to another
    partition than their key's (a topic whose partition count changed); an update older than
    a key's delete arriving after it; and a snapshot read older than everything streamed.
    Kafka timestamps grow in send order, so each record's hour is its timestamp's.
    """
    rng = random.Random(seed)
    live: set[int] = set()
    names: dict[int, str] = {}  # each live key's name
    deleted: dict[int, int] = {}  # key -> LSN of its delete, while it stays deleted
    lsn, out, faults = 1_000, [], Counter()
    for hour in range(HOURS):
        now = list(out[-REDELIVERED:])
        faults["duplicate deliveries"] += len(now)
        for _ in range(PER_HOUR):
            row_id, lsn = rng.randrange(KEYS), lsn + 10
            partition = rng.randrange(PARTITIONS) if rng.random() < 0.1 else None
            faults["sent to another partition"] += partition is not None
            if row_id not in live:
                faults["re-inserts after a delete"] += row_id in deleted
                now.append(table.change("c", row_id, lsn, hour=hour, partition=partition))
                live.add(row_id)
                names[row_id] = f"n{lsn}"
                deleted.pop(row_id, None)
            elif rng.random() < 0.25:
                faults["deletes"] += 1
                now.append(table.change("d", row_id, lsn, hour=hour, partition=partition))
                if rng.random() < 0.8:
                    now.append(table.tombstone(row_id, hour=hour, partition=partition))
                live.discard(row_id)
                deleted[row_id] = lsn
            elif rng.random() < 0.5:
                faults["updates keeping the name"] += 1
                kept = names[row_id]
                now.append(
                    table.change("u", row_id, lsn, hour=hour, partition=partition, name=kept)
                )
            else:
                now.append(table.change("u", row_id, lsn, hour=hour, partition=partition))
                names[row_id] = f"n{lsn}"
        if deleted:
            # Older than the delete (LSNs step by 10, so it ties with no other change).
            row_id = rng.choice(sorted(deleted))
            now.append(table.change("u", row_id, deleted[row_id] - 5, hour=hour, name="late"))
            faults["late updates older than a delete"] += 1
        now.append(table.change("r", rng.randrange(KEYS), SNAPSHOT_LSN, hour=hour, name="snapshot"))
        faults["snapshot reads older than the stream"] += 1
        # Stamped in send order, seconds into the hour: timestamps never go back on a partition.
        out += [table.Change(hour, c.value, c.key, c.partition, n + 1) for n, c in enumerate(now)]
    return out, faults


# A run of an hour is either a complete run (None) or a refresh of it while it was open, which
# read each partition's records stamped before this second of the hour (a record's stamp is its
# place in the hour, see `_log`): the Kafka offsets as they stood then (`_as_of`).
REFRESH_SECONDS = (10, 25)

Run = tuple[int, int | None]  # (hour, refresh second or None)


@st.composite
def _schedules(draw: st.DrawFn) -> list[list[Run]]:
    """Each mirror's runs, in list order: all hours plus repeats, or any subset with repeats
    (both shrink towards fewer runs and hours in order); some runs are refreshes of an open hour
    (`REFRESH_SECONDS`). An hour's refreshes read further each time and come before its
    complete runs, as time makes them: a refresh drawn after a later one reads as far as it, one
    drawn after a complete run is a complete run."""
    mirrors = []
    for _ in range(draw(st.integers(1, MAX_MIRRORS))):
        if draw(st.booleans()):
            hours = list(draw(st.permutations(range(HOURS))))
            for repeat in draw(st.lists(st.integers(0, HOURS - 1), max_size=2)):
                hours.insert(draw(st.integers(0, len(hours))), repeat)
        else:
            hours = draw(st.lists(st.integers(0, HOURS - 1), min_size=1, max_size=HOURS))
        cuts = draw(
            st.lists(
                st.sampled_from((None, None, *REFRESH_SECONDS)),
                min_size=len(hours),
                max_size=len(hours),
            )
        )
        runs, read = [], {}  # read: the furthest second each hour's runs reached (inf: all)
        for hour, cut in zip(hours, cuts, strict=True):
            reached = max(read.get(hour, 0), float("inf") if cut is None else cut)
            read[hour] = reached
            runs.append((hour, None if reached == float("inf") else int(reached)))
        mirrors.append(runs)
    return mirrors


def _as_of(cuts: dict[tuple[str, str], list[int | None]]):
    """`hour_run._slice` as a refresh at second `cut` of the hour saw it: each partition's slice
    ends at its first record stamped at or after that second, and the hour is open. `cuts` holds
    each (table, hour key)'s runs' cuts in run order (None: the slice as it is)."""
    original = hour_run._slice

    def sliced(kafka, consumer, spec, hour_key, now, starts, starts_cover_topic):
        full = original(kafka, consumer, spec, hour_key, now, starts, starts_cover_topic)
        cut = cuts[(spec.name, hour_key)].pop(0)
        if cut is None:
            return full
        at_ms = int((full.hour_start + timedelta(seconds=cut)).timestamp() * 1000)
        tps = {p.partition: TopicPartition(full.topic, p.partition) for p in full.partitions}
        found = consumer.offsets_for_times({tp: at_ms for tp in tps.values()})
        parts = []
        for part in full.partitions:
            at = found[tps[part.partition]]
            end = part.end if at is None else min(part.end, max(part.start, at.offset))
            parts.append(replace(part, end=end, moved_past=False))
        return replace(full, partitions=tuple(parts), closed=False, open_reason="a refresh")

    return sliced


def _read_by(records: list[tuple], runs: list[Run]) -> list[tuple]:
    """The committed records the runs read: every record of an hour a complete run read, the
    ones stamped before the furthest refresh's second of an hour only refreshed."""
    reached: dict[int, float] = {}
    for hour, cut in runs:
        reached[hour] = max(reached.get(hour, 0), float("inf") if cut is None else cut)
    return [
        r
        for r in records
        if table.hour_of(r[4]) in reached
        and r[4] < table.stamp(table.hour_of(r[4])) + reached[table.hour_of(r[4])] * 1000
    ]


# How the first mirror's history tracks columns: every change a version, or the balance left
# out (a change of the balance alone updates the version in force), said either way.
TRACKING = {
    "every change": {},
    "except balance": {"history_except_columns": ("balance",)},
    "name only": {"history_columns": ("name",)},
}


def _mirror(spec: TableSpec, n: int, *, tracking: str = "every change") -> TableSpec:
    """Another mirror of the same topic (its own Delta table in the lake); the first one keeps
    its history (`history: true`), tracked as `tracking` says."""
    first = {"history": True, **TRACKING[tracking]} if n == 0 else {}
    return TableSpec.model_validate({**spec.model_dump(), "name": f"accounts_{n}", **first})


# Schedules every run tries first, whatever the profile draws after them (`example`): the one
# the property shrank to when the MERGE's sequence guard was removed, then schedules that
# between them take every mode the strategy draws, so the drawn ones need not: code generated
# and interpreted, each history tracking, one and two mirrors, every hour in reverse and a
# subset, repeats, refreshes at both seconds rising to a complete run, and an hour refreshed by
# one mirror while another ran it whole. Kept short: a tracked history's hour costs ~5 s.
PINNED: list[tuple[list[list[Run]], bool, str]] = [
    ([[(0, None), (2, None), (3, None), (1, None)]], False, "every change"),
    (
        [[(3, None), (2, None), (1, None), (0, None)], [(1, 10), (1, 25), (1, None)]],
        True,
        "except balance",
    ),
    ([[(2, None), (0, 10), (0, None), (1, None)]], False, "name only"),
    ([[(1, None), (3, None)], [(3, 25), (0, None), (3, None), (0, None)]], True, "every change"),
]


def _pinned(function):
    for schedule, compiled, tracking in reversed(PINNED):
        function = example(schedule, compiled, tracking)(function)
    return function


def test_any_schedule_of_hours_converges_to_the_reference(
    broker, kafka, spark, create_topic, tmp_path
):
    spec = table.spec(create_topic("faults-convergence", partitions=PARTITIONS))
    changes, faults = _log(seed=17)
    table.send_all(broker, spec.topic, changes)
    table.close_hours(broker, spec.topic, PARTITIONS, after_hour=HOURS - 1)
    committed = read_records(broker, spec.topic, headers=True)
    # The reference takes a record's hour from its timestamp; the pipeline slices by offsets.
    # They agree while timestamps never go back on a partition (slicing itself is I1's test).
    for p in range(PARTITIONS):
        stamps = [r[4] for r in sorted(r for r in committed if r[0] == p)]
        assert stamps == sorted(stamps), f"partition {p}'s timestamps go back"
    assert len(faults) == 7 and all(faults.values()), faults  # the log has every fault
    records = [(p, o, v, k, h) for p, o, v, k, _, h in committed]
    tracked_spec = _mirror(spec, 0, tracking="except balance")
    folded = sum(map(len, tracked_history(tracked_spec, records).values()))
    assert folded < sum(map(len, history(tracked_spec, records).values()))  # some versions fold

    total, cases, table_hours = Comparison(), 0, 0
    modes: Counter[bool] = Counter()
    trackings: Counter[str] = Counter()
    started = time.monotonic()

    # Whether the schedule's small hours generate code for their expressions, or run
    # interpreted (`interpreted_max_bytes`, the default for mirrors this small): the rows must
    # not tell the two apart.
    # And how the first mirror's history tracks columns (`TRACKING`).
    @given(_schedules(), st.booleans(), st.sampled_from(sorted(TRACKING)))
    @_pinned
    def converges(schedule: list[list[Run]], compiled: bool, tracking: str) -> None:
        nonlocal cases, table_hours
        cases += 1
        note(f"schedule ((hour, refresh second) per mirror, in run order): {schedule}")
        note(f"code generated: {compiled}, history tracking: {tracking}")
        modes[compiled] += 1
        trackings[tracking] += 1
        tracked = tracking != "every change"
        lake = LakeResource(root=str(tmp_path / f"schedule{cases}"))
        mirrors = [_mirror(spec, n, tracking=tracking) for n in range(len(schedule))]
        cuts: dict[tuple[str, str], list[int | None]] = {}
        for mirror, runs in zip(mirrors, schedule, strict=True):
            for hour, cut in runs:
                cuts.setdefault((mirror.name, table.hour_key(hour)), []).append(cut)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(hour_run, "_slice", _as_of(cuts))
            outcomes = run_tables(
                checks=MIRROR_CHECKS,
                spark=spark,
                kafka=kafka,
                lake=lake,
                work=[
                    TableWork(mirror, [table.hour_key(h) for h, _ in runs])
                    for mirror, runs in zip(mirrors, schedule, strict=True)
                ],
                parallelism=2,
                force_open_hour=True,  # the refreshes; a closed hour's run is complete anyway
                interpreted_max_bytes=0 if compiled else None,
            )
        for mirror, runs, outcome in zip(mirrors, schedule, outcomes, strict=True):
            if outcome.error is not None:
                raise outcome.error
            table_hours += len(outcome.hours)
            for run in outcome.hours:
                for name in ("accounting", *(("history",) if mirror.history else ())):
                    verdict = [c for c in run.checks if c.check_name == name]
                    assert [c.passed for c in verdict] == [True], (mirror.name, name, run.result)
            read = _read_by(committed, runs)
            if mirror.history:
                path = lake.table_path(f"{mirror.name}__history")
                if tracked:
                    changes = lake.table_path(f"{mirror.name}__history_changes")
                    wrong = table.history_differences(changes, spec, read)
                    assert not wrong, (mirror.name, runs, wrong[:3])
                wrong = table.history_differences(path, mirror, read, folded=tracked)
                assert not wrong, (mirror.name, runs, wrong[:3])
            ref = table.reference_of(spec, read)
            comparison = compare(lake.table_path(mirror.name), spec, ref.expected, ref.seen_keys)
            for name in FIGURES:
                setattr(total, name, getattr(total, name) + getattr(comparison, name))
            assert comparison.clean, (mirror.name, runs, comparison)

    try:
        converges()
    finally:
        log.info(
            "convergence property: %d schedules, %d table-hours in %.0f s",
            cases,
            table_hours,
            time.monotonic() - started,
        )
        record("convergence_property", total, faults=cases)
    assert cases >= len(PINNED) + settings().max_examples, f"only {cases} schedules ran"
    assert len(modes) == 2, f"schedules ran in one mode only (code generated: {dict(modes)})"
    assert len(trackings) == len(TRACKING), f"history trackings drawn: {dict(trackings)}"
