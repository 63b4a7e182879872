"""Produces a table's error rows back to its topic after a fix, their bytes as Kafka gave them.

    python -m cdc_assets.error_replay --table orders [--hour 2026-11-05-14:00 ...]
        [--reason "value is not valid JSON"] [--dry-run]

When to use it: the table's config or the connector was fixed, and the hours whose records went
to `<table>__errors` can't simply run again because Kafka no longer holds them (while it does,
running the hour again is enough). Each selected row's key and value, unsealed with the masking
key when the table has sensitive columns (`cdc_assets.sealing`), are produced to the table's
topic unchanged, so they are read in the hour they arrive in and applied like any change: only
where they are newer than the mirror's row (I3), so a replay done twice changes nothing more.
Rows that still don't decode go to the error table again, at their new offsets. The error
table is left as it is; purge the replayed rows afterwards (Delta `DELETE`, then `VACUUM`).

Configuration comes from the environment: `CDC_TABLES_FILE`, and the Definitions' own resources
(`resources.environment.resources_from_env`: `CDC_KAFKA_BOOTSTRAP_SERVERS`, `CDC_LAKE_ROOT` with
the AWS settings of an S3 lake, and `CDC_MASKING_KEY` for a sealed error table). It prints
counts only, never a row. It exits 2 when it can't start (an argument, a setting, no error
table, a sealed one without its key) and 1 when Kafka failed while producing, saying which.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import dagster as dg
from delta.tables import DeltaTable
from kafka.errors import KafkaError
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from cdc_assets.config import (
    TableConfigError,
    TableSpec,
    named_table,
)
from cdc_assets.hours import parse_hour_key
from cdc_assets.sealing import is_sealed, unseal_rows
from resources.environment import (
    KAFKA_BOOTSTRAP_ENV,
    LAKE_ROOT_ENV,
    MASKING_KEY_ENV,
    resources_from_env,
)
from resources.kafka import KafkaResource
from resources.lake import LakeResource
from resources.masking import HmacKey, MaskingResource


class ReplayError(RuntimeError):
    """The replay can't start: no error table, or a sealed one without its key."""


@dataclass(frozen=True)
class ReplayOutcome:
    table: str
    topic: str
    selected: int  # error rows matching the hours and reason
    produced: int  # records sent and acknowledged (0 on a dry run)
    sealed: bool


def replay_errors(
    *,
    spark: SparkSession,
    kafka: KafkaResource,
    lake: LakeResource,
    spec: TableSpec,
    key: HmacKey | None,
    hours: Sequence[str] = (),
    reason: str | None = None,
    dry_run: bool = False,
) -> ReplayOutcome:
    """Produces `spec`'s error rows of `hours` (all when empty) whose reason contains `reason`
    to `spec.topic`, unsealed with `key`; see the module docstring."""
    lake.connect(spark)
    path = lake.table_path(spec.error_table_name)
    if not DeltaTable.isDeltaTable(spark, path):
        raise ReplayError(f"table '{spec.name}': no error table at {path}; nothing to replay")
    errors = spark.read.format("delta").load(path)
    sealed = is_sealed(errors.schema)
    if sealed and key is None:
        raise ReplayError(
            f"table '{spec.name}': its error table at {path} is sealed; set {MASKING_KEY_ENV} to "
            "the masking key the rows were written with"
        )
    if hours:
        errors = errors.where(F.col("hour").isin(list(hours)))
    if reason:
        errors = errors.where(F.col("reason").contains(reason))
    rows = errors.select("topic", "partition", "offset", "key", "value").orderBy(
        "topic", "partition", "offset"
    )
    selected = rows.count()
    if dry_run or not selected:
        return ReplayOutcome(spec.name, spec.topic, selected, 0, sealed)
    records = rows.toLocalIterator()
    pairs = (
        unseal_rows(records, key)
        if sealed
        else ((_raw(r["key"]), _raw(r["value"])) for r in records)
    )
    producer = kafka.producer()
    try:
        sent = [producer.send(spec.topic, key=k, value=v) for k, v in pairs if v is not None]
        producer.flush()
        for future in sent:
            future.get(timeout=kafka.request_timeout_ms / 1000)
    finally:
        producer.close()
    return ReplayOutcome(spec.name, spec.topic, selected, len(sent), sealed)


def _raw(data: bytearray | None) -> bytes | None:
    return None if data is None else bytes(data)


def replay_resources() -> dict[str, dg.ConfigurableResource]:
    """The Definitions' resources the replay uses; `masking` only when its key is set, since
    Dagster refuses an unset dg.EnvVar (replay_errors says whether the error table needs it)."""
    resources = resources_from_env()
    names = ["kafka", "spark", "lake", *(["masking"] if os.environ.get(MASKING_KEY_ENV) else [])]
    return {name: resources[name] for name in names}


def _masking_key(masking: MaskingResource | None, spec: TableSpec) -> HmacKey | None:
    if masking is None or not masking.key:
        return None
    return masking.hmac_key(table=spec.name, columns=list(spec.sensitive))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cdc_assets.error_replay", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--table", required=True, help="the table's name in the tables file")
    parser.add_argument(
        "--hour", action="append", default=[], help="an hour partition; repeat; default: all"
    )
    parser.add_argument("--reason", help="only rows whose reason contains this text")
    parser.add_argument("--dry-run", action="store_true", help="count the rows, send nothing")
    args = parser.parse_args(argv)
    for hour in args.hour:
        if parse_hour_key(hour) is None:
            parser.error(
                f"--hour '{hour}' is not an hour key; write it like 2026-11-05-14:00 (UTC, on "
                "the hour)"
            )
    missing = [name for name in (KAFKA_BOOTSTRAP_ENV, LAKE_ROOT_ENV) if not os.environ.get(name)]
    if missing:
        parser.error(
            f"{' and '.join(missing)} not set; set them as the deployment does (the broker's "
            "bootstrap servers, the lake's root folder or s3:// prefix)"
        )
    try:
        spec, tables_file = named_table(args.table)
    except TableConfigError as exc:
        parser.error(str(exc))
    try:
        # Resolved as a run resolves them: the secrets' dg.EnvVar read here, never printed.
        with dg.build_resources(replay_resources()) as resources:
            outcome = replay_errors(
                spark=resources.spark.session,
                kafka=resources.kafka,
                lake=resources.lake,
                spec=spec,
                key=_masking_key(getattr(resources, "masking", None), spec),
                hours=args.hour,
                reason=args.reason,
                dry_run=args.dry_run,
            )
    except ReplayError as exc:
        sys.stderr.write(f"cdc_assets.error_replay: {exc}\n")
        return 2
    except KafkaError as exc:
        sys.stderr.write(
            f"cdc_assets.error_replay: table '{spec.name}': Kafka failed while producing to "
            f"'{spec.topic}' ({exc!r}); some rows may have been sent. Run it again once the "
            "broker answers: a change produced twice is applied once.\n"
        )
        return 1
    verb = "would produce" if args.dry_run else "produced"
    count = outcome.selected if args.dry_run else outcome.produced
    print(  # noqa: T201  (the command's output: counts only)
        f"table '{outcome.table}': {outcome.selected} error rows selected"
        f"{' (sealed)' if outcome.sealed else ''}; {verb} {count} to topic '{outcome.topic}'"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
