"""Driving a real source database through its real Debezium connector, and reading it back.

`Capture` registers one connector for a test's tables (topics of its own), runs the test's SQL at
a chosen hour (the Connect worker's clock is set to it, so Kafka stamps the records with it) and
waits until the connector published every change the statements made. `source_rows` reads the
tables with a plain database client, independent of the pipeline, typed as the mirror's rows
are (`mirror_rows`), so the two compare with ==.
"""

from __future__ import annotations

import json
import struct
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from datetime import time as time_of_day
from decimal import Decimal
from typing import Any

import polars as pl
import pyarrow as pa
from deltalake import DeltaTable, QueryBuilder
from pyspark.sql import SparkSession

from cdc_assets.config import TableSpec
from devtools import kafka_connect, mariadb, postgres
from tests.support import mirror_rows

PG_PASSWORD_ENV = "CDC_TEST_PG_PASSWORD"
MY_PASSWORD_ENV = "CDC_TEST_MARIADB_PASSWORD"


@dataclass
class Sources:
    broker: str
    postgres: postgres.PostgresConfig
    mariadb: mariadb.MariaDBConfig
    worker: kafka_connect.ConnectConfig
    passwords: Mapping[str, str] = field(repr=False)

    def sql(self, kind: str):
        """A new autocommit connection to the source database of `kind`."""
        if kind == "postgres":
            connection = postgres.connect(self.postgres, self.passwords[PG_PASSWORD_ENV])
            connection.autocommit = True
            return connection
        return mariadb.connect(self.mariadb, self.passwords[MY_PASSWORD_ENV])


# How long the topics must stop growing before a settle after a connector restart returns.
RESTARTED_QUIET_S = 2.0


class Capture:
    """One Debezium connector capturing `tables` of a source, on topics of its own.

    `expect(table, n)` counts the records the connector owes for the statements a test ran
    (an insert or update 1, a delete 2 with its tombstone, a primary-key update 3); `settle`
    waits until the topics hold at least that many (more after a restart: at least once).
    """

    def __init__(
        self,
        sources: Sources,
        kind: str,
        tables: list[str],
        *,
        name: str | None = None,
        schemas: bool = True,
        extra: Mapping[str, str] | None = None,
        partitions: int = 3,
    ) -> None:
        self.sources, self.kind, self.tables = sources, kind, tables
        self.name = name or f"t{uuid.uuid4().hex[:10]}"
        self.schemas = schemas
        namespace = "public" if kind == "postgres" else sources.mariadb.database
        self._qualified = {t: f"{namespace}.{t}" for t in tables}
        config = sources.postgres if kind == "postgres" else sources.mariadb
        self.settings = kafka_connect.connector_settings(
            kind=kind,
            topic_prefix=self.name,
            host="127.0.0.1",
            port=config.port,
            database=config.database,
            user=config.username,
            password_env=PG_PASSWORD_ENV if kind == "postgres" else MY_PASSWORD_ENV,
            tables=list(self._qualified.values()),
            schemas=schemas,
            partitions=partitions,
            extra=extra,
        )
        self.expected = {t: 0 for t in tables}
        # Records a restart made the connector send again, per table, as the last settle after
        # it counted them: the later settles wait for the owed records on top of these.
        self.resent = {t: 0 for t in tables}
        self.quiet_s = 0.0  # RESTARTED_QUIET_S once the connector restarted (`restarted`)

    def topic(self, table: str) -> str:
        return f"{self.name}.{self._qualified[table]}"

    def start(self) -> None:
        kafka_connect.put_connector(self.sources.worker, self.name, self.settings)
        kafka_connect.wait_running(self.sources.worker, self.name)

    def stop(self) -> None:
        kafka_connect.delete_connector(self.sources.worker, self.name)

    def expect(self, table: str, records: int) -> None:
        self.expected[table] += records

    def restarted(self) -> None:
        """Marks that the connector restarted: from now on every settle waits for quiet."""
        self.quiet_s = RESTARTED_QUIET_S

    def settle(self, timeout_s: float = 120) -> dict[str, int]:
        """Waits until every topic holds its expected records and, once the connector has
        restarted, until they stop growing for `quiet_s`; returns the counts.

        The count alone is enough while the connector never restarted: it sends each change
        once. After a restart (`restarted`) it is not: the connector sends some records again
        (at least once), so a topic can hold the expected number while the newest changes are
        still on their way, and an hour read then misses them. Each settle after a restart
        waits for quiet and records the surplus (`resent`), which the later ones add to what
        they wait for; without it, a settle would stop as soon as the surplus made up for
        records still on their way.
        """
        quiet_s = self.quiet_s
        expected = {self.topic(t): n + self.resent[t] for t, n in self.expected.items()}
        sizes = kafka_connect.wait_published(self.sources.worker, self.name, expected, timeout_s)
        deadline = time.monotonic() + timeout_s
        quiet_since = time.monotonic()
        while time.monotonic() - quiet_since < quiet_s:
            time.sleep(0.5)
            now = kafka_connect.topic_sizes(self.sources.broker, list(expected))
            if now != sizes:
                sizes, quiet_since = now, time.monotonic()
            if time.monotonic() > deadline:
                raise AssertionError(f"connector {self.name}'s topics kept growing: {sizes}")
        if quiet_s:
            for t in self.tables:
                self.resent[t] = sizes[self.topic(t)] - self.expected[t]
        return sizes


def at_hour(sources: Sources, hour: datetime, minute: int = 10) -> None:
    """Sets the Connect worker's clock to `minute` past `hour` (call only once settled)."""
    kafka_connect.set_clock(sources.worker, hour + timedelta(minutes=minute))


# --- the source's rows, typed as the mirror's ---------------------------------------------------


def source_rows(
    connection, table: str, spec: TableSpec, *, selects: Mapping[str, str] | None = None
) -> dict[tuple, dict]:
    """Every row of `table` (plain SELECT), normalized per the spec's declared types.

    `selects` replaces a column by an SQL expression (a value the client library can't return
    as the source shows it, e.g. MySQL's BIT as its bit string).
    """
    columns = list(spec.columns)
    quote = '"' if "psycopg2" in type(connection).__module__ else "`"
    select = ", ".join((selects or {}).get(c, f"{quote}{c}{quote}") for c in columns)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {select} FROM {quote}{table}{quote}")  # test tables only
        fetched = cursor.fetchall()
    rows = {}
    for values in fetched:
        row = {c: normalize(spec.columns[c], v) for c, v in zip(columns, values, strict=True)}
        rows[tuple(row[k] for k in spec.primary_key)] = row
    return rows


def mirror_live_rows(path: str, spec: TableSpec) -> dict[tuple, dict]:
    """The mirror's live rows, normalized as `source_rows`."""
    return {
        key: {c: normalize(spec.columns[c], row[c]) for c in spec.columns}
        for key, row in mirror_rows(path, spec).items()
    }


def source_moment(connection, table: str, spec: TableSpec) -> tuple[datetime, dict[tuple, dict]]:
    """The source's clock and `source_rows` at one moment (nothing written in between): what
    the history `as of` that moment must hold. Postgres' clock is the one Debezium's
    `source.ts_ms` (a transaction's commit time) is read from."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT clock_timestamp()")
        (moment,) = cursor.fetchone()
    return moment.astimezone(UTC), source_rows(connection, table, spec)


def history_as_of(
    spark: SparkSession, path: str, spec: TableSpec, moment: datetime
) -> tuple[dict[tuple, dict], dict[tuple, list[str]]]:
    """`<table>__history` at `path` as of `moment` (`cdc_assets.history.as_of`), its rows
    normalized as `source_rows`, and per key the TOASTed columns whose value it says it does not
    know (`_cdc_unknown__C`: left None in the rows)."""
    from pyspark.sql import functions as F

    from cdc_assets.history import as_of
    from tests.support import typed_rows

    naive = moment.astimezone(UTC).replace(tzinfo=None)  # the session's zone is UTC
    versions = as_of(spark.read.format("delta").load(path), F.lit(naive).cast("timestamp"))
    rows, unknown = {}, {}
    flags = [f"_cdc_unknown__{c}" for c in spec.toasted_columns]
    for key, row in typed_rows(versions, spec, flags).items():
        missing = [c for c in spec.toasted_columns if row.get(f"_cdc_unknown__{c}")]
        if missing:
            unknown[key] = missing
        rows[key] = {
            c: None if c in missing else normalize(spec.columns[c], row[c]) for c in spec.columns
        }
    return rows, unknown


def live_rows_outside_spark(
    path: str, spec: TableSpec, columns: list[str]
) -> dict[str, dict[tuple, dict]]:
    """The mirror's live rows (`columns` only), normalized as `source_rows`, read by the two
    readers docs/reading.md names: deltalake's query engine and polars. Neither is given an
    option: what a user who follows the page gets."""

    picked = [*spec.primary_key, *columns]
    listed = ", ".join(f'"{c}"' for c in picked)
    query = f"SELECT {listed} FROM mirror WHERE NOT _cdc_deleted"
    tables = {
        "deltalake": pa.table(QueryBuilder().register("mirror", DeltaTable(path)).execute(query)),
        "polars": pl.read_delta(path).filter(~pl.col("_cdc_deleted")).select(picked).to_arrow(),
    }
    found = {}
    for reader, table in tables.items():
        rows = {}
        for row in table.to_pylist():
            typed = {c: normalize(spec.columns[c], row[c]) for c in picked}
            rows[tuple(typed[k] for k in spec.primary_key)] = {c: typed[c] for c in columns}
        found[reader] = rows
    return found


def normalize(declared: str, value: Any) -> Any:
    """One value as both sides compare it (the source's client types differ from Spark's)."""
    if value is None:
        return None
    if declared.startswith("array<"):
        item = declared[len("array<") : -1]
        return [normalize(item, v) for v in value]
    if declared == "timestamp":
        if isinstance(value, datetime):
            return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
    if declared == "time":
        if isinstance(value, timedelta):  # MySQL's TIME
            micros = value // timedelta(microseconds=1)
            return f"{micros // 3_600_000_000:02d}:{micros // 60_000_000 % 60:02d}:" \
                f"{micros // 1_000_000 % 60:02d}.{micros % 1_000_000:06d}"  # fmt: skip
        if isinstance(value, time_of_day):
            return value.strftime("%H:%M:%S.%f")
        return value
    if declared == "boolean" and value in ("0", "1"):  # Postgres' bit(1) through psycopg2
        return value == "1"
    if declared == "float":
        return struct.unpack("f", struct.pack("f", value))[0]
    if declared == "binary":
        return bytes(value)
    if declared == "bigint" and isinstance(value, timedelta):  # interval → MicroDuration
        return value // timedelta(microseconds=1)
    if declared == "string":
        return _normalize_text(value)
    if isinstance(value, Decimal | date | int | float | bool):
        return value
    return value


def _normalize_text(value: Any) -> Any:
    if isinstance(value, dict | list):  # json/jsonb through psycopg2
        return json.dumps(value, sort_keys=True)
    if isinstance(value, time_of_day):  # timetz: Debezium's ZonedTime is UTC, 'Z'
        moment = datetime.combine(date(2000, 1, 1), value).astimezone(UTC)
        return moment.strftime("%H:%M:%S.%f") + "Z"
    if isinstance(value, set):  # MySQL SET
        return ",".join(sorted(value))
    if isinstance(value, bytes | bytearray):  # MySQL BIT: big-endian
        return value.hex()
    if isinstance(value, str):
        text = value.strip()
        if text[:1] in "{[":
            try:
                return json.dumps(json.loads(text), sort_keys=True)
            except ValueError:
                return value
        if len(text) > 9 and text.endswith("Z") and text[2] == ":" and "T" not in text:
            clock, _, fraction = text[:-1].partition(".")
            return f"{clock}.{fraction.ljust(6, '0')[:6]}Z"
    return value
