"""The demo shop as a real Postgres database, captured by the real Debezium connector.

`up` starts what the demo's source needs and keeps the shop busy:

- PostgreSQL with logical decoding (`devtools.postgres`, data in `.local/shop-db`), the shop's
  tables (`SCHEMA`: customers with a long `bio` stored out of line, orders, order_items);
- a Kafka Connect worker (`devtools.kafka_connect`) and Debezium's Postgres connector with its
  default settings (schemas in every record, precise decimals), topics `demo.public.<table>`;
- on the first start, the last few closed hours: the worker's clock is set to each hour while
  the workload runs, so Kafka stamps those changes with it and the demo has history to show;
- then the live workload at the real time, about `changes_per_hour` changes per table and hour.

The workload (`Shop.step`) is ordinary SQL with the shop's rules (an order belongs to a
customer, its total is the sum of its items): new customers, updates that leave the TOASTed
`bio` unchanged (Debezium sends a placeholder), bio rewrites, orders placed with their items,
status changes, item quantity changes, items renumbered (a primary-key update), orders deleted,
customers renumbered (a primary-key update of a row with a TOASTed value), a transaction held
open for a few seconds, and rarely a change that breaks a hard expectation of the tables file
(quantity 0, status 'lost'), which the pipeline sends to the error table: `BAD_PER_HOUR` such
changes an hour, so about one hour in five of `orders` and of `order_items` fails that check and
the others are green (a check that is red every hour teaches people to ignore red).

The database password is random at every start and reaches the worker only through its
environment (`${env:CDC_DEMO_SOURCE_PASSWORD}` in the connector config).

    python -m demo.shop up --bootstrap 127.0.0.1:19092 --hours 3 --changes-per-hour 200
    python -m demo.shop down     # stops the workload's servers (the broker is the demo's)
"""

from __future__ import annotations

import argparse
import random
import secrets
import signal
import string
import sys
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

from devtools import kafka_connect, postgres

REPO_ROOT = Path(__file__).resolve().parents[1]
STATE_DIR = REPO_ROOT / ".local"
TOPIC_PREFIX = "demo"
CONNECTOR = "demo-shop"
TABLES = ("customers", "orders", "order_items")
PASSWORD_ENV = "CDC_DEMO_SOURCE_PASSWORD"
SOURCE_PORT = 15433
CONNECT_PORT = 18083
COUNTRIES = ("US", "DE", "FR", "GB", "NL", "ES", "IT", "PL", "SE", "BR", "JP", "IN", "CA", "AU")
STATUSES = ("pending", "paid", "shipped", "cancelled")

SCHEMA = """
CREATE SCHEMA IF NOT EXISTS demo_meta;
CREATE TABLE IF NOT EXISTS demo_meta.seeded (hour timestamptz PRIMARY KEY);
CREATE TABLE IF NOT EXISTS customers (
  customer_id bigint PRIMARY KEY, email text, full_name text, country text,
  is_active boolean NOT NULL, created_at timestamptz NOT NULL DEFAULT now(), bio text
);
ALTER TABLE customers ALTER COLUMN bio SET STORAGE EXTERNAL;
CREATE TABLE IF NOT EXISTS orders (
  order_id bigint PRIMARY KEY, customer_id bigint, status text NOT NULL,
  total numeric(12,2) NOT NULL DEFAULT 0, ordered_at timestamp NOT NULL, ship_date date
);
CREATE TABLE IF NOT EXISTS order_items (
  order_id bigint, line_no int, sku text, quantity int, unit_price numeric(10,2),
  PRIMARY KEY (order_id, line_no)
);
"""

# The workload's steps (Shop._<step>) and how often each is taken.
_STEPS = {
    "customer": 14,
    "customer_update": 14,
    "bio_rewrite": 4,
    "order": 20,
    "progress": 18,
    "quantity": 10,
    "renumber": 3,
    "cancel": 4,
    "drop_order": 4,
    "move_customer": 1,
}
# Changes an hour, on average, that break a hard expectation (`Shop._bad`): each lands in
# `orders` or `order_items`, so each table's hour has one with probability 1 - e^-0.25 (22%).
BAD_PER_HOUR = 0.5
_FIRST = ("Ada", "Alan", "Grace", "Linus", "Margaret", "Ken", "Barbara", "José", "Zoë", "Søren")
_LAST = ("Lovelace", "Turing", "Hopper", "Torvalds", "Hamilton", "Núñez", "Brontë", "Müller")


class Shop:
    """The shop's workload; counts the change records each step makes, per table."""

    def __init__(self, connection, seed: int | None = None, *, steps_per_hour: float = 0) -> None:
        self.sql = connection
        self.random = random.Random(seed)
        # The share of steps that break a hard expectation (none without a pace).
        self.bad_share = BAD_PER_HOUR / steps_per_hour if steps_per_hour else 0.0
        self.records: Counter[str] = Counter()

    def _run(self, cursor, statement: str, params=(), *, table: str, per_row: int = 1) -> int:
        cursor.execute(statement, params)
        rows = max(cursor.rowcount, 0)
        self.records[table] += rows * per_row
        return rows

    def _next_id(self, cursor, table: str, column: str) -> int:
        cursor.execute(f"SELECT coalesce(max({column}), 0) + 1 FROM {table}")
        return cursor.fetchone()[0]

    def _pick(self, cursor, table: str, column: str, where: str = "true") -> int | None:
        cursor.execute(f"SELECT {column} FROM {table} WHERE {where} ORDER BY random() LIMIT 1")
        row = cursor.fetchone()
        return None if row is None else row[0]

    def _bio(self) -> str:
        # Random text: too long to stay in the row, incompressible, so Postgres TOASTs it.
        size = self.random.randint(3000, 6000)
        return "".join(self.random.choices(string.ascii_letters + " ", k=size))

    def step(self, at: datetime) -> None:
        """One transaction of the shop at (about) `at`."""
        r = self.random
        kind = r.choices(list(_STEPS), weights=list(_STEPS.values()))[0]
        if r.random() < self.bad_share:
            kind = "bad"
        with self.sql, self.sql.cursor() as cursor:
            getattr(self, f"_{kind}")(cursor, at)

    def _customer(self, cursor, at: datetime) -> None:
        r = self.random
        key = self._next_id(cursor, "customers", "customer_id")
        first, last = r.choice(_FIRST), r.choice(_LAST)
        self._run(
            cursor,
            "INSERT INTO customers VALUES (%s, %s, %s, %s, true, %s, %s)",
            (key, f"{first}.{last}{key}@example.com".lower(), f"{first} {last}",
             r.choice(COUNTRIES), at, self._bio()),
            table="customers",
        )  # fmt: skip

    def _customer_update(self, cursor, at: datetime) -> None:
        key = self._pick(cursor, "customers", "customer_id")
        if key is None:
            return self._customer(cursor, at)
        # bio is left as it is: Debezium sends __debezium_unavailable_value for it.
        self._run(
            cursor,
            "UPDATE customers SET country = %s, is_active = %s WHERE customer_id = %s",
            (self.random.choice(COUNTRIES), self.random.random() < 0.9, key),
            table="customers",
        )

    def _bio_rewrite(self, cursor, at: datetime) -> None:
        key = self._pick(cursor, "customers", "customer_id")
        if key is not None:
            self._run(
                cursor,
                "UPDATE customers SET bio = %s WHERE customer_id = %s",
                (self._bio(), key),
                table="customers",
            )

    def _order(self, cursor, at: datetime, *, bad: bool = False) -> None:
        r = self.random
        customer = self._pick(cursor, "customers", "customer_id")
        if customer is None:
            return self._customer(cursor, at)
        order = self._next_id(cursor, "orders", "order_id")
        self._run(
            cursor,
            "INSERT INTO orders VALUES (%s, %s, 'pending', 0, %s, NULL)",
            (order, customer, at.replace(tzinfo=None)),
            table="orders",
        )
        for line in range(1, r.randint(1, 4) + 1):
            self._run(
                cursor,
                "INSERT INTO order_items VALUES (%s, %s, %s, %s, %s)",
                (order, line, f"SKU-{''.join(r.choices('ABCDEFGH', k=3))}-{r.randint(0, 9999):04d}",
                 0 if bad and line == 1 else r.randint(1, 5), round(r.uniform(1, 200), 2)),
                table="order_items",
            )  # fmt: skip
        self._total(cursor, order)

    def _total(self, cursor, order: int) -> None:
        self._run(
            cursor,
            "UPDATE orders SET total = coalesce((SELECT sum(quantity * unit_price) FROM "
            "order_items WHERE order_id = %s), 0) WHERE order_id = %s",
            (order, order),
            table="orders",
        )

    def _progress(self, cursor, at: datetime) -> None:
        order = self._pick(cursor, "orders", "order_id", "status IN ('pending', 'paid')")
        if order is None:
            return self._order(cursor, at)
        self._run(
            cursor,
            "UPDATE orders SET status = CASE status WHEN 'pending' THEN 'paid' ELSE 'shipped' "
            "END, ship_date = CASE status WHEN 'paid' THEN %s::date ELSE ship_date END "
            "WHERE order_id = %s",
            (at.date(), order),
            table="orders",
        )

    def _quantity(self, cursor, at: datetime) -> None:
        order = self._pick(cursor, "orders", "order_id", "status = 'pending'")
        if order is None:
            return self._order(cursor, at)
        self._run(
            cursor,
            "UPDATE order_items SET quantity = quantity + 1 WHERE order_id = %s AND line_no = "
            "(SELECT min(line_no) FROM order_items WHERE order_id = %s)",
            (order, order),
            table="order_items",
        )
        self._total(cursor, order)

    def _renumber(self, cursor, at: datetime) -> None:
        """A primary-key update: Debezium sends a delete, a tombstone and a create per row."""
        order = self._pick(cursor, "orders", "order_id", "status = 'pending'")
        if order is not None:
            self._run(
                cursor,
                "UPDATE order_items SET line_no = line_no + 100 WHERE order_id = %s",
                (order,),
                table="order_items",
                per_row=3,
            )

    def _cancel(self, cursor, at: datetime) -> None:
        order = self._pick(cursor, "orders", "order_id", "status = 'pending'")
        if order is not None:
            self._run(
                cursor,
                "UPDATE orders SET status = 'cancelled' WHERE order_id = %s",
                (order,),
                table="orders",
            )

    def _drop_order(self, cursor, at: datetime) -> None:
        order = self._pick(cursor, "orders", "order_id", "status = 'cancelled'")
        if order is not None:
            self._run(cursor, "DELETE FROM order_items WHERE order_id = %s", (order,),
                      table="order_items", per_row=2)  # fmt: skip
            self._run(cursor, "DELETE FROM orders WHERE order_id = %s", (order,),
                      table="orders", per_row=2)  # fmt: skip

    def _move_customer(self, cursor, at: datetime) -> None:
        """A customer's key changes, its bio does not: the mirror carries the bio over."""
        old = self._pick(cursor, "customers", "customer_id")
        if old is None:
            return self._customer(cursor, at)
        new = self._next_id(cursor, "customers", "customer_id")
        self._run(cursor, "UPDATE customers SET customer_id = %s WHERE customer_id = %s",
                  (new, old), table="customers", per_row=3)  # fmt: skip
        self._run(cursor, "UPDATE orders SET customer_id = %s WHERE customer_id = %s",
                  (new, old), table="orders")  # fmt: skip

    def _bad(self, cursor, at: datetime) -> None:
        """A change the tables file's hard expectations refuse: it goes to the error table."""
        if self.random.random() < 0.5:
            return self._order(cursor, at, bad=True)
        order = self._pick(cursor, "orders", "order_id", "status = 'pending'")
        if order is not None:
            self._run(cursor, "UPDATE orders SET status = 'lost' WHERE order_id = %s",
                      (order,), table="orders")  # fmt: skip


def _source_config() -> postgres.PostgresConfig:
    return postgres.PostgresConfig(
        port=SOURCE_PORT,
        data_dir=STATE_DIR / "shop-db",
        database="shop",
        username="shop",
        logical_replication=True,
    )


def _worker(bootstrap: str, password: str) -> kafka_connect.ConnectConfig:
    return kafka_connect.ConnectConfig(
        bootstrap=bootstrap,
        port=CONNECT_PORT,
        data_dir=STATE_DIR / "connect",
        secrets={PASSWORD_ENV: password},
        fake_clock=True,
    )


def topics() -> dict[str, str]:
    return {table: f"{TOPIC_PREFIX}.public.{table}" for table in TABLES}


def up(
    bootstrap: str,
    *,
    hours: int,
    changes_per_hour: int,
    follow: bool = True,
    tables_file: Path | None = None,
) -> None:
    """Starts the source, writes the demo's tables file (`tables_file`, default TABLES_FILE),
    starts the worker and the connector, seeds the missing hours, then follows."""
    password = secrets.token_urlsafe(18)
    source = _source_config()
    postgres.start(source, password)
    connection = postgres.connect(source, password)
    with connection, connection.cursor() as cursor:
        cursor.execute(SCHEMA)
    now = datetime.now(UTC)
    closed = [
        now.replace(minute=0, second=0, microsecond=0) - timedelta(hours=n)
        for n in range(hours, 0, -1)
    ]
    with connection.cursor() as cursor:
        cursor.execute("SELECT hour FROM demo_meta.seeded")
        seeded = {row[0] for row in cursor.fetchall()}
    missing = [hour for hour in closed if hour not in seeded]
    # Written before the slow part (Kafka Connect, the seeding): scripts/demo.sh starts the
    # webserver on it meanwhile. The first hour is the first of those seeded and to seed.
    path = write_tables_file(
        demo_first_hour(seeded | set(missing), now), tables_file or TABLES_FILE
    )
    print(f"tables file: {path}", flush=True)
    worker = _worker(bootstrap, password)
    # Restarted every time: the password is new, and the worker gets it from its environment.
    kafka_connect.stop(worker)
    kafka_connect.start(worker)
    shop = Shop(connection, steps_per_hour=_steps_per_hour(changes_per_hour))
    existing = kafka_connect.topic_sizes(bootstrap, list(topics().values()))
    expected = Counter({table: existing[topic] for table, topic in topics().items()})
    if missing:
        # Rows created before the connector exists reach Kafka as its snapshot, at that hour.
        kafka_connect.set_clock(worker, missing[0] + timedelta(minutes=1))
    settings = kafka_connect.connector_settings(
        kind="postgres",
        topic_prefix=TOPIC_PREFIX,
        host="127.0.0.1",
        port=source.port,
        database=source.database,
        user=source.username,
        password_env=PASSWORD_ENV,
        tables=[f"public.{t}" for t in TABLES],
    )
    kafka_connect.put_connector(worker, CONNECTOR, settings)
    kafka_connect.wait_running(worker, CONNECTOR)
    for hour in missing:
        started = time.monotonic()
        kafka_connect.set_clock(worker, hour + timedelta(minutes=2))
        shop.records.clear()
        for n in range(int(_steps_per_hour(changes_per_hour))):
            shop.step(hour + timedelta(minutes=2, seconds=n))
        expected.update(shop.records)
        kafka_connect.wait_published(
            worker, CONNECTOR, {topics()[t]: n for t, n in expected.items()}
        )
        with connection, connection.cursor() as cursor:
            cursor.execute("INSERT INTO demo_meta.seeded VALUES (%s)", (hour,))
        print(
            f"seeded: {hour.isoformat()} {dict(shop.records)} ({time.monotonic() - started:.1f}s)",
            flush=True,
        )
    kafka_connect.set_clock(worker, datetime.now(UTC))
    print(f"following: about {changes_per_hour} changes per table and hour", flush=True)
    if follow:
        _follow(shop, changes_per_hour)


TABLES_FILE = STATE_DIR / "demo" / "tables.yaml"


def demo_first_hour(seeded: set[datetime], now: datetime) -> datetime:
    """The demo's first hour: its first seeded hour, which every restart keeps (the seeded
    hours are in the shop's database), else the current hour (nothing seeded: `--hours 0`)."""
    return min(seeded) if seeded else now.replace(minute=0, second=0, microsecond=0)


# The demo's tier-0 table: the offset sensor refreshes its open hour every few minutes, so a
# newcomer sees a mirror that follows the shop within minutes, not after the hour closes.
TIER0_TABLE, TIER0_REFRESH_MINUTES = "orders", 5
# The demo's table with history: every version of every customer in customers__history.
HISTORY_TABLE = "customers"


def write_tables_file(first_hour: datetime, path: Path = TABLES_FILE) -> Path:
    """cdc_assets/tables.yaml with the demo's partitions starting where its data starts,
    `TIER0_TABLE` refreshed every `TIER0_REFRESH_MINUTES` while an hour is open, and
    `HISTORY_TABLE` keeping its history."""
    import yaml

    from cdc_assets.config import DEFAULT_TABLES_FILE
    from cdc_assets.hours import hour_key

    raw = yaml.safe_load(DEFAULT_TABLES_FILE.read_text())
    for table in raw["tables"]:
        table["start_hour"] = hour_key(first_hour)
        if table["name"] == TIER0_TABLE:
            table["refresh_minutes"] = TIER0_REFRESH_MINUTES
        if table["name"] == HISTORY_TABLE:
            table["history"] = True
    path.parent.mkdir(parents=True, exist_ok=True)
    header = (
        "# Written by demo/shop.py: cdc_assets/tables.yaml, starting at the demo's first hour,\n"
        f"# with {TIER0_TABLE} refreshed every {TIER0_REFRESH_MINUTES} minutes (tier-0) and\n"
        f"# {HISTORY_TABLE}'s history kept ({HISTORY_TABLE}__history).\n"
    )
    path.write_text(header + yaml.safe_dump(raw, sort_keys=False, allow_unicode=True))
    return path


def _steps_per_hour(changes_per_hour: int) -> float:
    """The workload's transactions an hour: a step changes about two rows across the tables."""
    return changes_per_hour * len(TABLES) / 2


def _follow(shop: Shop, changes_per_hour: int) -> None:
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    signal.signal(signal.SIGINT, lambda *_: stop.append(True))
    pause = 3600 / max(_steps_per_hour(changes_per_hour), 1)
    marked = None
    while not stop:
        now = datetime.now(UTC)
        marked = _mark_followed(shop.sql, marked, now)
        shop.step(now)
        if shop.random.random() < 0.01:
            _held_transaction(shop)
        time.sleep(pause)


def _mark_followed(connection, marked: datetime | None, now: datetime) -> datetime:
    """Records the hours the shop has followed, up to `now`'s, as hours a restart must not
    seed (`demo_meta.seeded`: their changes, or their lack of any while the machine slept, are
    in Kafka at their time); `marked` is the newest recorded. Returns `now`'s hour."""
    hour = now.replace(minute=0, second=0, microsecond=0)
    if marked == hour:
        return hour
    hours = [hour]
    while marked is not None and hours[-1] - timedelta(hours=1) > marked:
        hours.append(hours[-1] - timedelta(hours=1))
    with connection, connection.cursor() as cursor:
        for followed in hours:
            cursor.execute(
                "INSERT INTO demo_meta.seeded VALUES (%s) ON CONFLICT DO NOTHING", (followed,)
            )
    return hour


def _held_transaction(shop: Shop) -> None:
    """A transaction open for a few seconds: its changes reach Kafka when it commits."""
    with shop.sql, shop.sql.cursor() as cursor:
        shop._progress(cursor, datetime.now(UTC))
        time.sleep(5)
        shop._quantity(cursor, datetime.now(UTC))


def down(bootstrap: str) -> None:
    """Stops the Connect worker and the shop's Postgres, saying of each whether it ran."""
    worker = kafka_connect.stop(_worker(bootstrap, ""))
    print(f"demo: Kafka Connect worker {'stopped' if worker else 'was not running'}")  # noqa: T201
    source = postgres.stop(_source_config())
    print(f"demo: the shop's Postgres {'stopped' if source else 'was not running'}")  # noqa: T201


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m demo.shop", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["up", "down", "seed"])
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--hours", type=int, default=3)
    parser.add_argument("--changes-per-hour", type=int, default=200)
    parser.add_argument(
        "--tables-file", type=Path, default=TABLES_FILE, help="where to write the demo's tables"
    )
    args = parser.parse_args(argv)
    try:
        if args.command == "down":
            down(args.bootstrap)
        else:
            up(
                args.bootstrap,
                hours=args.hours,
                changes_per_hour=args.changes_per_hour,
                follow=args.command == "up",
                tables_file=args.tables_file,
            )
    except (RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
