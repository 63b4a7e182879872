"""A real Postgres, its real Debezium connector at default settings, and the mirror equal to
`SELECT * FROM` the source table, row for row, whatever order the hours run in.

One workload on one table, captured twice: by a connector with Kafka Connect's defaults (schemas
in every record, precise decimals) and by one with schemas off and decimal.handling.mode=string
(the table's config then says how each column is encoded). The workload spans four hours: a
snapshot, then inserts, updates and deletes of every type Debezium encodes differently,
primary-key updates of rows whose TOASTed text did not change (default replica identity), a
Kafka Connect worker killed and restarted (Debezium's at-least-once replay), and two
`ALTER TABLE ... ADD COLUMN`s, one with a `DEFAULT` that fills the rows already there.

Each capture's mirror is judged with the new columns undeclared and declared (`grade` with its
default): a change written before a column existed takes its default, never an error, and a
mirror that gains the declared column after it holds rows shows the default in those rows.

The hour orders (in order, reversed, shuffled with repeats) are crossed pairwise with the
captures and the two ways of declaring (`ORDERS`): every pair of them still runs, in 9
mirrors and 42 table-hours, where every capture in every order took 12 mirrors and 72 (with
a random order of 10 runs where the shuffled one has 6).

The default capture's undeclared mirrors keep their history (`history: true`): the source is
read (`SELECT *`, with Postgres' clock) at four moments while the workload runs, and the history
as of each moment's time equals that read row for row, whichever order the hours ran in,
TOASTed values included: a moved row's versions take the body a primary-key update left out
from the old key's (`cdc_assets.history_moves`), and no version is `_cdc_unknown__body`.
"""

from __future__ import annotations

import json
import random
import string
import uuid
from datetime import UTC, date, datetime, time, timedelta, timezone
from decimal import Decimal

import pytest

from cdc_assets.config import TableSpec
from cdc_assets.fleet import TableWork, run_tables
from cdc_assets.hour_run import run_hour
from checks.table_checks import MIRROR_CHECKS
from devtools import kafka_connect
from resources.lake import LakeResource
from tests.cdc_sources.source import (
    Capture,
    at_hour,
    history_as_of,
    live_rows_outside_spark,
    mirror_live_rows,
    source_moment,
    source_rows,
)

pytestmark = pytest.mark.integration

FIRST = datetime(2026, 11, 2, 6, tzinfo=UTC)
HOURS = [FIRST + timedelta(hours=n) for n in range(4)]
KEYS = [h.strftime("%Y-%m-%d-%H:%M") for h in HOURS]
TABLE = "accounts"

COLUMNS = {
    "id": "bigint",
    "balance": "decimal(14,2)",  # numeric(14,2): Connect Decimal, base64 (precise)
    "amount": "decimal(24,6)",  # numeric: VariableScaleDecimal
    "qty": "int",
    "small": "int",  # smallint: int16
    "ratio": "float",  # real
    "score": "double",
    "active": "boolean",
    "name": "string",
    "body": "string",  # text, stored out of line (TOASTed)
    "blob": "binary",  # bytea
    "day": "date",
    "at_time": "time",  # MicroTime
    "at_time3": "time",  # time(3): Time (ms)
    "at_ts": "timestamp",  # MicroTimestamp
    "at_ts3": "timestamp",  # timestamp(3): Timestamp (ms)
    "at_tz": "timestamp",  # timestamptz: ZonedTimestamp
    "at_timetz": "string",  # timetz: ZonedTime
    "dur": "bigint",  # interval: MicroDuration
    "uid": "string",  # uuid
    "doc": "string",  # jsonb: Json
    "mood": "string",  # an enum: Enum
    "flag": "boolean",  # bit(1)
    "bits": "string",  # bit(4): Bits
    "tags": "array<string>",  # text[]
    "nums": "array<int>",  # int[]
}
DDL = f"""
CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy');
CREATE TABLE {TABLE} (
  id bigint PRIMARY KEY, balance numeric(14,2), amount numeric, qty integer, small smallint,
  ratio real, score double precision, active boolean, name varchar(40), body text, blob bytea,
  day date, at_time time, at_time3 time(3), at_ts timestamp, at_ts3 timestamp(3),
  at_tz timestamptz, at_timetz timetz, dur interval, uid uuid, doc jsonb, mood mood,
  flag bit(1), bits bit(4), tags text[], nums int[]
);
ALTER TABLE {TABLE} ALTER COLUMN body SET STORAGE EXTERNAL;
"""
EDGES = [
    datetime(1000, 1, 1),
    datetime(1583, 1, 1),
    datetime(1970, 1, 1),
    datetime(9999, 12, 31, 23, 59, 59, 999_999),
]
# Added in hour 2; `grade ... DEFAULT 'B'` fills every row already there without a change event.
DECLARED_LATER = {"note": "string", "grade": {"type": "string", "default": "B"}}
_CASTS = {
    "doc": "::jsonb",
    "mood": "::mood",
    "flag": "::bit(1)",
    "bits": "::bit(4)",
    "uid": "::uuid",
}


def _spec(topic: str, *, schemas: bool, declared: bool = False) -> TableSpec:
    base = {
        "name": TABLE,
        "topic": topic,
        "primary_key": ["id"],
        "columns": dict(COLUMNS),
        "toasted_columns": ["body"],
        "start_hour": "2026-11-01-00:00",
    }
    if declared:  # the columns the source gains in hour 2, declared as README recommends
        base["columns"] = {**COLUMNS, **DECLARED_LATER}
    if schemas:
        return TableSpec.model_validate(base)
    # Without schemas the table's config says each encoding the connector's settings imply.
    columns = {k: v for k, v in base["columns"].items() if k != "bits"}  # Bits need their length
    columns |= {
        "at_time3": {"type": "time", "encoding": "Time"},
        "at_ts3": {"type": "timestamp", "encoding": "Timestamp"},
        "at_tz": {"type": "timestamp", "encoding": "ZonedTimestamp"},
    }
    return TableSpec.model_validate(
        base | {"columns": columns, "decimal_handling": "string", "new_columns": "ignore"}
    )


class Workload:
    """Random rows of every type, written with SQL, and the records the connector owes."""

    def __init__(self, connection, captures: list[Capture], seed: int = 15) -> None:
        self.sql, self.captures, self.random = connection, captures, random.Random(seed)

    def run(self, statement: str, params=(), *, records_per_row: int = 1) -> int:
        with self.sql.cursor() as cursor:
            cursor.execute(statement, params)
            rows = max(cursor.rowcount, 0)
        for capture in self.captures:
            capture.expect(TABLE, rows * records_per_row)
        return rows

    def row(self, key: int) -> dict:
        r = self.random
        base = datetime(2026, 11, 2, 6, 30)

        def clock(micros: int, zone: timezone | None = None) -> time:
            return time(r.randrange(24), r.randrange(60), r.randrange(60), micros, tzinfo=zone)

        zone = timezone(timedelta(hours=r.randint(-11, 12)))
        return {
            "id": key,
            # -10711.76 is base64 "76e4", which a guessing reader takes for the number 760000.
            "balance": r.choice([Decimal("-10711.76"), Decimal(r.randint(-(10**9), 10**9)) / 100]),
            "amount": (Decimal(r.randint(-(10**12), 10**12)).scaleb(-r.randint(0, 6))).normalize(),
            "qty": r.randint(-(2**31), 2**31 - 1),
            "small": r.randint(-32768, 32767),
            "ratio": r.choice([0.1, 1.5, -3.25, 1e30]),
            "score": r.uniform(-1e6, 1e6),
            "active": r.random() < 0.5,
            "name": r.choice(["Zoë", "José Núñez", "plain", "", "émoji 🎉"]),
            "body": "".join(r.choices(string.ascii_letters + string.digits, k=24_000)),
            "blob": bytes(r.randrange(256) for _ in range(r.randint(0, 40))),
            "day": date(2026, 1, 1) + timedelta(days=r.randint(-40_000, 2_000)),
            "at_time": clock(r.randrange(10**6)),
            "at_time3": clock(r.randrange(1000) * 1000),
            "at_ts": base + timedelta(microseconds=r.randint(-(10**15), 10**15)),
            "at_ts3": base + timedelta(milliseconds=r.randint(-(10**12), 10**12)),
            "at_tz": base.replace(tzinfo=zone)
            + timedelta(microseconds=r.randint(-(10**14), 10**14)),
            "at_timetz": clock(r.randrange(10**6), timezone(timedelta(hours=r.choice([-5, 0, 2])))),
            "dur": timedelta(days=r.randint(-400, 400), microseconds=r.randint(0, 86_399_999_999)),
            "uid": str(uuid.UUID(int=r.getrandbits(128))),
            "doc": json.dumps({"k": r.randint(0, 9), "list": [1, "two", None], "ok": True}),
            "mood": r.choice(["sad", "ok", "happy"]),
            "flag": r.choice(["0", "1"]),
            "bits": "".join(r.choice("01") for _ in range(4)),
            "tags": [r.choice(["a", "b,c", 'quote"d', "", "ünï"]) for _ in range(r.randint(0, 3))],
            "nums": [r.randint(-100, 100) for _ in range(r.randint(0, 4))],
        }

    def insert(self, key: int) -> None:
        row = self.row(key)
        values = ", ".join(f"%({c})s{_CASTS.get(c, '')}" for c in row)
        self.run(f"INSERT INTO {TABLE} ({', '.join(row)}) VALUES ({values})", row)

    def update(self, key: int, *columns: str) -> None:
        row = self.row(key)
        sets = ", ".join(f"{c} = %({c})s{_CASTS.get(c, '')}" for c in columns)
        self.run(f"UPDATE {TABLE} SET {sets} WHERE id = %(id)s", row)

    def move(self, old: int, new: int) -> None:
        """A primary-key update that leaves the TOASTed body as it is."""
        self.run(f"UPDATE {TABLE} SET id = %s WHERE id = %s", (new, old), records_per_row=3)

    def delete(self, key: int) -> None:
        self.run(f"DELETE FROM {TABLE} WHERE id = %s", (key,), records_per_row=2)


def _unexpected_failures(checks, *, last: bool) -> dict[str, str]:
    failed = {c.check_name: c.description for c in checks if not c.passed}
    # Source columns the spec doesn't declare are named (a warning): the columns the table
    # gained, and bits in the schema-less spec; so are the declared columns an hour from before
    # the ALTER lacks.
    allowed = {"note", "grade", "bits"}
    problems = [p for p in failed.get("schema_drift", "").split("; ") if p]
    left = [
        p
        for p in problems
        if not (
            p.startswith(("columns not in the tables file appeared: ", "declared columns"))
            and set(p.split(": ", 1)[1].split(" (")[0].split(", ")) <= allowed
        )
    ]
    if problems and not left:
        del failed["schema_drift"]
    # Out of order, a moved row's body is unknown until its older hour runs.
    if not last:
        failed.pop("toasted_values", None)
    return failed


# The orders hours run in: in order, reversed, and shuffled with repeats (a later hour first,
# hours run again after later ones, hour 1 only after 2 and 3).
HOUR_ORDERS = ([0, 1, 2, 3], [3, 2, 1, 0], [2, 0, 3, 2, 1, 0])
# Which of them each mirror runs (indexes into HOUR_ORDERS), by (schemas on, columns declared
# later), crossed pairwise: the history's mirror (schemas on, undeclared) in all three, every
# other in two, so each encoding and each way of declaring the new columns meets every order,
# and every order more than one capture.
ORDERS = {
    (True, False): (0, 1, 2),
    (True, True): (1, 2),
    (False, False): (0, 2),
    (False, True): (0, 1),
}


def _settle_and_move_clock(captures: list[Capture], sources, hour: datetime) -> None:
    for capture in captures:
        capture.settle()
    at_hour(sources, hour)


def test_mirrors_of_a_real_postgres_equal_the_source_in_any_hour_order(
    sources, spark, kafka, tmp_path
):
    connection = sources.sql("postgres")
    with connection.cursor() as cursor:
        cursor.execute(DDL)
    defaults = Capture(sources, "postgres", [TABLE])  # schemas on, precise decimals
    textual = Capture(
        sources, "postgres", [TABLE], schemas=False,
        extra={"decimal.handling.mode": "string"},
    )  # fmt: skip
    captures = [defaults, textual]
    work = Workload(connection, captures)
    try:
        # Hour 0: rows that exist before the connectors start reach Kafka as their snapshot.
        for key in range(1, 13):
            work.insert(key)
        at_hour(sources, HOURS[0])
        for capture in captures:
            capture.start()

        _settle_and_move_clock(captures, sources, HOURS[1])
        # The source at moments between the hours' changes: the history's as-of references.
        undeclared = _spec(defaults.topic(TABLE), schemas=True)
        moments = [(undeclared, *source_moment(connection, TABLE, undeclared))]
        for key in range(13, 21):
            work.insert(key)
        work.update(1, "balance", "amount", "at_tz", "doc")
        work.update(2, "name", "tags", "nums", "bits", "flag")
        work.update(4, "balance")  # body unchanged: Debezium sends the placeholder
        work.move(3, 103)  # body unchanged and left out of the new row
        work.move(5, 105)
        work.delete(6)
        work.delete(14)
        work.update(13, "body")
        # The ends of the temporal types' ranges: Parquet's INT96 misreads them outside Spark.
        for key, moment in enumerate(EDGES, start=40):
            row = {**work.row(key), "at_ts": moment, "at_ts3": moment.replace(microsecond=0)}
            row |= {"at_tz": moment.replace(tzinfo=UTC), "day": moment.date()}
            values = ", ".join(f"%({c})s{_CASTS.get(c, '')}" for c in row)
            work.run(f"INSERT INTO {TABLE} ({', '.join(row)}) VALUES ({values})", row)

        # The worker crashes and comes back: the connector re-sends what it had not committed.
        for capture in captures:
            capture.settle()
        kafka_connect.kill(sources.worker)
        kafka_connect.start(sources.worker)
        for capture in captures:
            kafka_connect.wait_running(sources.worker, capture.name)
            capture.restarted()

        _settle_and_move_clock(captures, sources, HOURS[2])
        moments.append((undeclared, *source_moment(connection, TABLE, undeclared)))
        work.run(f"ALTER TABLE {TABLE} ADD COLUMN note text")
        work.run(f"ALTER TABLE {TABLE} ADD COLUMN grade text DEFAULT 'B'")
        work.update(103, "balance")
        work.move(103, 203)  # a chain of moves: 3 → 103 → 203
        work.run(f"UPDATE {TABLE} SET note = 'added' WHERE id IN (1, 2, 203)")
        work.run(f"UPDATE {TABLE} SET grade = 'A' WHERE id IN (2, 9)")
        work.delete(7)
        work.insert(7)  # a key deleted and created again
        work.insert(21)

        # A tier-0 mirror of the default capture (refresh_minutes): hour 2 refreshed while it
        # is still open and judged against the source as it stands now; completed below.
        declared = {**COLUMNS, "note": "string", "grade": "string"}
        lake = LakeResource(root=str(tmp_path / "lake"))
        tier0 = _spec(defaults.topic(TABLE), schemas=True)
        tier0 = tier0.model_copy(update={"name": f"{TABLE}_tier0", "refresh_minutes": 15})
        tier0_judged = tier0.model_copy(update={"columns": declared})
        defaults.settle()
        (early,) = run_tables(
            checks=MIRROR_CHECKS, spark=spark, kafka=kafka, lake=lake,
            work=[TableWork(tier0, KEYS[:2])], parallelism=1,
        )  # fmt: skip
        assert early.error is None, (early.failed_hour, early.error)
        refresh = run_hour(
            checks=MIRROR_CHECKS, spark=spark, kafka=kafka, lake=lake, spec=tier0,
            hour_key=KEYS[2], now=HOURS[2] + timedelta(minutes=30), force_open_hour=True,
        )  # fmt: skip
        assert refresh.partial and refresh.counts.applied > 0
        assert mirror_live_rows(lake.table_path(tier0.name), tier0_judged) == (
            source_rows(connection, TABLE, tier0_judged)
        )

        _settle_and_move_clock(captures, sources, HOURS[3])
        moments.append((tier0_judged, *source_moment(connection, TABLE, tier0_judged)))
        for key in (1, 8, 9, 105):
            work.update(key, "balance", "at_ts", "at_ts3", "at_time3", "dur", "ratio")
        work.move(8, 108)
        for capture in captures:
            capture.settle()
        moments.append((tier0_judged, *source_moment(connection, TABLE, tier0_judged)))
        moved = {(103,), (105,), (203,), (108,)}  # rows a primary-key update created

        # Each capture's hours in its orders (ORDERS): a mirror of its own (named after the
        # order) in one lake, run as a fleet run runs its tables, two at a time
        # (cdc_assets/fleet.py).
        work, mirrors = [], {}
        for capture in captures:
            for late in (False, True):
                spec = _spec(capture.topic(TABLE), schemas=capture.schemas, declared=late)
                judged = spec  # declared: note and grade are its columns
                if capture.schemas and not late:
                    # note and grade were added to this mirror, typed from the schema, grade's
                    # rows from before it with the default the connector's schema declares.
                    judged = spec.model_copy(update={"columns": declared})
                expected = source_rows(connection, TABLE, judged)
                for n in ORDERS[capture.schemas, late]:
                    order = HOUR_ORDERS[n]
                    name = f"{TABLE}_{capture.name}_{'declared_' if late else ''}{n}"
                    hours = [KEYS[h] for h in order]
                    history = capture.schemas and not late
                    update = {"name": name, "history": history}
                    work.append(TableWork(spec.model_copy(update=update), hours))
                    mirrors[name] = (capture, order, judged, expected)
        # The tier-0 mirror's hours 2 (after its refresh: read whole, now that it closed) and 3.
        work.append(TableWork(tier0, KEYS[2:]))
        mirrors[tier0.name] = (
            defaults,
            [2, 3],
            tier0_judged,
            source_rows(connection, TABLE, tier0_judged),
        )
        runs = run_tables(
            checks=MIRROR_CHECKS, spark=spark, kafka=kafka, lake=lake, work=work, parallelism=2
        )
        (completed,) = [r for r in runs if r.spec.name == tier0.name]
        assert completed.hours[0].result.refreshed_to is None  # a closed hour is read whole
        # Declared once the source has them, as README says: hours 0-1 ran without the
        # columns, 2-3 with them; the rows from before take grade's default.
        capture = captures[0]
        before = _spec(capture.topic(TABLE), schemas=True).model_copy(update={"name": "late"})
        after = _spec(capture.topic(TABLE), schemas=True, declared=True)
        after = after.model_copy(update={"name": "late"})
        # Then the hours from before the ALTER again (a backfill): no error, nothing changes.
        for spec, hours in ((before, KEYS[:2]), (after, KEYS[2:]), (after, KEYS[:2])):
            (late_run,) = run_tables(
                checks=MIRROR_CHECKS,
                spark=spark,
                kafka=kafka,
                lake=lake,
                work=[TableWork(spec, hours)],
                parallelism=1,
            )
            assert late_run.error is None, (late_run.failed_hour, late_run.error)
            assert not any(h.result.counts.errors for h in late_run.hours)
        runs.append(late_run)  # its mirror is judged below, after its last hours
        judged = after.model_copy(update={"columns": declared})
        mirrors["late"] = (capture, [0, 1], judged, source_rows(connection, TABLE, judged))

        for run in runs:
            capture, order, judged, expected = mirrors[run.spec.name]
            assert run.error is None, (capture.schemas, order, run.failed_hour, run.error)
            for step, hour_run in enumerate(run.hours):
                failed = _unexpected_failures(hour_run.checks, last=step == len(order) - 1)
                result = hour_run.result
                problems = (capture.schemas, order, result.hour_key, failed, result.error_reasons)
                assert not failed and not result.counts.errors, problems
            actual = mirror_live_rows(lake.table_path(run.spec.name), judged)
            different = {
                k: {c: (actual[k][c], expected[k][c]) for c in judged.columns
                    if actual[k][c] != expected[k][c]}
                for k in set(actual) & set(expected) if actual[k] != expected[k]
            }  # fmt: skip
            temporal = ["at_ts", "at_ts3", "at_tz", "day"]
            outside = live_rows_outside_spark(lake.table_path(run.spec.name), judged, temporal)
            wanted = {k: {c: row[c] for c in temporal} for k, row in expected.items()}
            for reader, rows in outside.items():
                assert rows == wanted, (reader, capture.schemas, order)
            assert set(actual) == set(expected) and not different, (
                capture.schemas,
                order,
                [(h.result.hour_key, h.result.slice.as_dict()["partitions"]) for h in run.hours],
                sorted(set(actual) ^ set(expected)),
                different,
            )
            if run.spec.history:
                history = lake.table_path(f"{run.spec.name}__history")
                # The versions the primary-key updates began, each naming its old key.
                began = (
                    spark.read.format("delta").load(history).where("_cdc_moved_from IS NOT NULL")
                )
                began = {tuple(r) for r in began.select(*run.spec.primary_key).collect()}
                assert began == moved, (order, began)
                for n, (columns, moment, then) in enumerate(moments):
                    rows, unknown = history_as_of(spark, history, columns, moment)
                    assert not unknown, (order, n, unknown)
                    wrong = {k: (rows.get(k), then.get(k)) for k in set(rows) | set(then)
                             if rows.get(k) != then.get(k)}  # fmt: skip
                    assert not wrong, (order, n, moment, wrong)
    finally:
        for capture in captures:
            capture.stop()
        connection.close()
