"""A real MariaDB, Debezium's MariaDB connector at default settings, and the mirror equal to
`SELECT * FROM` the source table in any hour order.

Changes are ordered by the binlog position (`source.file` as a numbered binlog, `source.pos`,
`source.row`); the binary log is rotated in the middle, so an hour's changes span two files.
MySQL's temporal encodings (DATETIME in milliseconds or microseconds by its precision,
TIMESTAMP as ZonedTimestamp, TIME as MicroTime, YEAR), ENUM, SET, JSON, BIT and BLOB.
"""

from __future__ import annotations

import json
import random
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

import pytest

from cdc_assets.config import TableSpec
from cdc_assets.hour_run import run_hour
from checks.table_checks import MIRROR_CHECKS, evaluate_run_checks
from devtools import kafka_connect
from resources.lake import LakeResource
from tests.cdc_sources.source import (
    Capture,
    at_hour,
    live_rows_outside_spark,
    mirror_live_rows,
    source_rows,
)

pytestmark = pytest.mark.integration

# Before the Postgres test's hours (tests/cdc_sources/test_postgres.py), so the record clock the
# two tests share only moves forward.
FIRST = datetime(2026, 11, 2, 0, tzinfo=UTC)
HOURS = [FIRST + timedelta(hours=n) for n in range(4)]
KEYS = [h.strftime("%Y-%m-%d-%H:%M") for h in HOURS]
TABLE = "items"
COLUMNS = {
    "id": "bigint",
    "price": "decimal(10,2)",  # DECIMAL: Connect Decimal, base64
    "qty": "int",
    "big": "bigint",
    "flag": "int",  # TINYINT(1) NOT NULL DEFAULT 0: int16, "default": 0 in its schema
    "at": "timestamp",  # DATETIME: Timestamp (ms)
    "at6": "timestamp",  # DATETIME(6): MicroTimestamp
    "ts": "timestamp",  # TIMESTAMP(6): ZonedTimestamp
    "d": "date",
    "t": "time",  # TIME(6): MicroTime
    "y": "int",  # YEAR: io.debezium.time.Year
    "e": "string",  # ENUM: Enum
    "st": "string",  # SET: EnumSet
    "j": "string",  # JSON
    "b": "string",  # BIT(4): Bits
    "bl": "binary",  # BLOB
    "name": "string",
    "score": "double",
    "ratio": "float",
}
DDL = f"""CREATE TABLE {TABLE} (
  id BIGINT PRIMARY KEY, price DECIMAL(10,2), qty INT, big BIGINT,
  flag TINYINT(1) NOT NULL DEFAULT 0, at DATETIME, at6 DATETIME(6), ts TIMESTAMP(6) NULL,
  d DATE, t TIME(6), y YEAR,
  e ENUM('red','green','blue'), st SET('x','y','z'), j JSON, b BIT(4), bl BLOB,
  name VARCHAR(40), score DOUBLE, ratio FLOAT
) CHARACTER SET utf8mb4"""
# BIT(4) read back as its bit string, the way the mirror stores Debezium's Bits.
SELECTS = {"b": "LPAD(BIN(b), 4, '0')"}
# (DATETIME(6) and DATE, TIMESTAMP(6)) at the ends of their ranges and at the epoch.
EDGES = [
    (datetime(1000, 1, 1), datetime(1970, 1, 1, 0, 0, 1)),
    (datetime(1583, 1, 1), datetime(1970, 1, 1, 0, 0, 1, 1)),
    (datetime(1970, 1, 1), datetime(2038, 1, 19, 3, 14, 7, 999_999)),
    (datetime(9999, 12, 31, 23, 59, 59, 999_999), datetime(2000, 2, 29, 12)),
]


def _spec(topic: str) -> TableSpec:
    return TableSpec.model_validate(
        {
            "name": TABLE,
            "topic": topic,
            "primary_key": ["id"],
            "columns": COLUMNS,
            "sequence": [
                {"field": "source.file", "type": "binlog"},
                {"field": "source.pos", "type": "bigint"},
                {"field": "source.row", "type": "bigint"},
            ],
            "start_hour": "2026-11-01-00:00",
        }
    )


class Workload:
    def __init__(self, connection, capture: Capture, seed: int = 21) -> None:
        self.sql, self.capture, self.random = connection, capture, random.Random(seed)

    def run(self, statement: str, params=(), *, records_per_row: int = 1) -> None:
        with self.sql.cursor() as cursor:
            rows = cursor.execute(statement, params)
        self.capture.expect(TABLE, max(rows, 0) * records_per_row)

    def row(self, key: int) -> dict:
        r = self.random
        base = datetime(2026, 11, 2, 0, 30)
        return {
            "id": key,
            "price": r.choice([Decimal("-10711.76"), Decimal(r.randint(-(10**9), 10**9)) / 100]),
            "qty": r.randint(-(2**31), 2**31 - 1),
            "big": r.randint(-(2**63), 2**63 - 1),
            "flag": r.choice([0, 1]),
            "at": base + timedelta(seconds=r.randint(-(10**9), 10**9)),
            "at6": base + timedelta(microseconds=r.randint(-(10**15), 10**15)),
            "ts": base + timedelta(microseconds=r.randint(-(10**14), 10**14)),
            "d": date(2026, 1, 1) + timedelta(days=r.randint(-40_000, 2_000)),
            "t": timedelta(microseconds=r.randint(0, 86_399_999_999)),
            "y": r.randint(1901, 2155),
            "e": r.choice(["red", "green", "blue"]),
            "st": ",".join(sorted(r.sample(["x", "y", "z"], r.randint(0, 3)))),
            "j": json.dumps({"k": r.randint(0, 9), "l": [1, None, "x"]}),
            "b": r.randint(0, 15),
            "bl": bytes(r.randrange(256) for _ in range(r.randint(0, 30))),
            "name": r.choice(["Zoë", "plain", "", "émoji 🎉"]),
            "score": r.uniform(-1e6, 1e6),
            "ratio": r.choice([0.5, -1.25, 3.0]),
        }

    def insert(self, key: int) -> None:
        row = self.row(key)
        values = ", ".join(f"%({c})s" for c in row)
        self.run(f"INSERT INTO {TABLE} ({', '.join(row)}) VALUES ({values})", row)

    def update(self, key: int, *columns: str) -> None:
        row = self.row(key)
        sets = ", ".join(f"{c} = %({c})s" for c in columns)
        self.run(f"UPDATE {TABLE} SET {sets} WHERE id = %(id)s", row)


def test_mirror_of_a_real_mariadb_equals_the_source_in_any_hour_order(
    sources, spark, kafka, tmp_path
):
    connection = sources.sql("mariadb")
    with connection.cursor() as cursor:
        cursor.execute(DDL)
    capture = Capture(sources, "mariadb", [TABLE])
    work = Workload(connection, capture)
    try:
        for key in range(1, 9):
            work.insert(key)  # before the connector: its snapshot
        at_hour(sources, HOURS[0])
        capture.start()

        capture.settle()
        at_hour(sources, HOURS[1])
        for key in range(9, 15):
            work.insert(key)
        # The ends of each temporal type's range: Parquet's INT96 misreads them outside Spark.
        for key, (moment, stamp) in enumerate(EDGES, start=40):
            row = {**work.row(key), "at": moment.replace(microsecond=0), "at6": moment}
            row |= {"d": moment.date(), "ts": stamp}
            values = ", ".join(f"%({c})s" for c in row)
            work.run(f"INSERT INTO {TABLE} ({', '.join(row)}) VALUES ({values})", row)
        work.update(1, "price", "at", "at6", "ts", "t")
        work.update(2, "st", "e", "j", "b", "bl")
        work.run(f"UPDATE {TABLE} SET id = 102 WHERE id = 2", records_per_row=3)
        work.run(f"DELETE FROM {TABLE} WHERE id IN (3, 9)", records_per_row=2)

        capture.settle()
        at_hour(sources, HOURS[2])
        work.run("FLUSH BINARY LOGS")  # the hour's changes span two binlog files
        work.update(102, "price")
        with connection.cursor() as cursor:  # one transaction, two changes of one row
            cursor.execute("START TRANSACTION")
            cursor.execute(f"UPDATE {TABLE} SET qty = 1 WHERE id = 4")
            cursor.execute(f"UPDATE {TABLE} SET qty = 2 WHERE id = 4")
            cursor.execute("COMMIT")
        capture.expect(TABLE, 2)
        work.insert(3)
        # The connector restarts (an operator's restart): it resumes from its committed offset.
        capture.settle()
        kafka_connect.restart_connector(sources.worker, capture.name)
        kafka_connect.wait_running(sources.worker, capture.name)
        capture.restarted()

        capture.settle()
        at_hour(sources, HOURS[3])
        work.run("FLUSH BINARY LOGS")
        for key in (1, 5, 102):
            work.update(key, "price", "at6", "y", "ratio")
        work.run(f"DELETE FROM {TABLE} WHERE id = 6", records_per_row=2)
        capture.settle()

        spec = _spec(capture.topic(TABLE))
        expected = source_rows(connection, TABLE, spec, selects=SELECTS)
        for n, order in enumerate([[0, 1, 2, 3], [3, 2, 1, 0], [2, 0, 3, 0, 1]]):
            lake = LakeResource(root=str(tmp_path / f"order{n}"))
            for hour in order:
                result = run_hour(
                    checks=MIRROR_CHECKS,
                    spark=spark,
                    kafka=kafka,
                    lake=lake,
                    spec=spec,
                    hour_key=KEYS[hour],
                )
                checks = evaluate_run_checks(
                    spark=spark, spec=spec, path=lake.table_path(TABLE), result=result
                )
                failed = {c.check_name: c.description for c in checks if not c.passed}
                # flag's schema shows its default, which the spec leaves undeclared: the column
                # is in every change since CREATE TABLE, so schema_drift is green all the same.
                assert result.source_fields.source_defaults()["flag"] == 0, (order, hour)
                assert not failed and not result.counts.errors, (
                    order,
                    hour,
                    failed,
                    result.error_reasons,
                )
            actual = mirror_live_rows(lake.table_path(TABLE), spec)
            different = {
                k: {
                    c: (actual[k][c], expected[k][c])
                    for c in spec.columns
                    if actual[k][c] != expected[k][c]
                }
                for k in set(actual) & set(expected)
                if actual[k] != expected[k]
            }
            assert set(actual) == set(expected) and not different, (
                order,
                sorted(set(actual) ^ set(expected)),
                different,
            )
            temporal = ["at", "at6", "ts", "d"]
            outside = live_rows_outside_spark(lake.table_path(TABLE), spec, temporal)
            wanted = {k: {c: row[c] for c in temporal} for k, row in expected.items()}
            for reader, rows in outside.items():
                assert rows == wanted, (reader, order)
    finally:
        capture.stop()
        connection.close()
