"""The real change-data-capture sources, started once for the tests of this folder.

PostgreSQL (logical decoding) and MariaDB (row-based binlog) with their users, and one Kafka
Connect worker running Debezium's connectors against the session's broker, on a clock the tests
set (`devtools.kafka_connect.set_clock`): each test captures its own tables with connectors of
its own, on topics of its own.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest

from devtools import kafka_connect, mariadb, postgres
from tests.cdc_sources.source import MY_PASSWORD_ENV, PG_PASSWORD_ENV, Sources
from tests.support import free_ports


# The package's tests share them; they stop when its last test is done, so the rest of the
# suite doesn't share the machine's two cores with an idle Connect worker and two databases.
@pytest.fixture(scope="package")
def sources(broker: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sources]:
    pg_port, my_port, connect_port = free_ports(3)
    base = tmp_path_factory.mktemp("cdc-sources")
    pg = postgres.PostgresConfig(
        port=pg_port, data_dir=base / "pg", database="shop", username="shop",
        logical_replication=True,
    )  # fmt: skip
    my = mariadb.MariaDBConfig(port=my_port, data_dir=base / "mariadb", database="shop")
    passwords = {
        PG_PASSWORD_ENV: secrets.token_urlsafe(18),
        MY_PASSWORD_ENV: secrets.token_urlsafe(18),
    }
    worker = kafka_connect.ConnectConfig(
        bootstrap=broker,
        port=connect_port,
        data_dir=base / "connect",
        secrets=passwords,
        fake_clock=True,
    )
    started = []
    try:
        postgres.start(pg, passwords[PG_PASSWORD_ENV])
        started.append(lambda: postgres.stop(pg))
        mariadb.start(my, passwords[MY_PASSWORD_ENV])
        started.append(lambda: mariadb.stop(my))
        kafka_connect.start(worker)
        started.append(lambda: kafka_connect.stop(worker))
        yield Sources(broker=broker, postgres=pg, mariadb=my, worker=worker, passwords=passwords)
    finally:
        for stop in reversed(started):
            stop()
