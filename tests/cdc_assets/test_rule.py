"""The newest change per key, in its two forms: Spark's (`rule.latest_per_key`, a slice Spark
read) and the Arrow one (`rule.newest_per_key`, a slice held in the driver) give the same rows
for any changes, TOASTed values and primary-key moves included."""

from __future__ import annotations

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cdc_assets.columns import (
    DELETED,
    HOUR,
    KAFKA_OFFSET,
    KAFKA_PARTITION,
    MOVED_FROM,
    OP,
    SEQUENCE,
    SOURCE_TS,
    has_value,
)
from cdc_assets.config import TableSpec
from cdc_assets.rule import latest_per_key, newest_per_key

pytestmark = pytest.mark.integration

# Each drawn schedule of changes is a `batch` of its own: the key is (batch, id), so one Spark
# query judges many schedules.
SPEC = TableSpec(
    name="accounts",
    topic="rule",
    primary_key=("batch", "id"),
    columns={"batch": "int", "id": "bigint", "name": "string", "note": "string"},
    toasted_columns=("note",),
    start_hour="2026-11-01-00:00",
)
PLAIN = SPEC.model_copy(update={"toasted_columns": ()})

SEQUENCE_TYPE = pa.struct(
    [
        pa.field("lsn", pa.int64()),
        pa.field("kafka_partition", pa.int32()),
        pa.field("kafka_offset", pa.int64()),
    ]
)

change = st.fixed_dictionaries(
    {
        "id": st.integers(0, 5),
        "lsn": st.integers(0, 6),
        "op": st.sampled_from("cud"),
        "name": st.none() | st.sampled_from(["a", "b", "é"]),
        "note": st.none() | st.sampled_from(["x", "y"]),
        "carries": st.booleans(),
        "moved_from": st.none() | st.integers(0, 5),
    }
)


def _changes(schedules: list[list[dict]], toasted: bool) -> pa.Table:
    """Decoded changes as the decoder gives them: each in its own offset (so sequences are
    unique), LSNs that may tie across keys and deliveries."""
    rows = []
    drawn = [(batch, c) for batch, schedule in enumerate(schedules) for c in schedule]
    for offset, (batch, c) in enumerate(drawn):
        partition = offset % 2
        rows.append(
            {
                "batch": batch,
                "id": c["id"],
                "name": c["name"],
                "note": c["note"] if c["carries"] or not toasted else None,
                OP: c["op"],
                SEQUENCE: {"lsn": c["lsn"], "kafka_partition": partition, "kafka_offset": offset},
                SOURCE_TS: None,
                KAFKA_PARTITION: partition,
                KAFKA_OFFSET: offset,
                HOUR: "2026-11-01-00:00",
                DELETED: c["op"] == "d",
                has_value("note"): c["carries"],
                MOVED_FROM: None
                if c["moved_from"] is None
                else {"batch": batch, "id": c["moved_from"]},
            }
        )
    schema = pa.schema(
        [
            pa.field("batch", pa.int32()),
            pa.field("id", pa.int64()),
            pa.field("name", pa.string()),
            pa.field("note", pa.string()),
            pa.field(OP, pa.string()),
            pa.field(SEQUENCE, SEQUENCE_TYPE),
            pa.field(SOURCE_TS, pa.timestamp("us", tz="UTC")),
            pa.field(KAFKA_PARTITION, pa.int32()),
            pa.field(KAFKA_OFFSET, pa.int64()),
            pa.field(HOUR, pa.string()),
            pa.field(DELETED, pa.bool_()),
            pa.field(has_value("note"), pa.bool_()),
            pa.field(
                MOVED_FROM, pa.struct([pa.field("batch", pa.int32()), pa.field("id", pa.int64())])
            ),
        ]
    )
    table = pa.Table.from_pylist(rows, schema=schema)
    if not toasted:
        table = table.drop_columns([has_value("note"), MOVED_FROM])
    return table


def _sorted(table: pa.Table) -> list[dict]:
    return sorted(table.to_pylist(), key=lambda row: (row["batch"], row["id"]))


@settings(
    max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    schedules=st.lists(st.lists(change, min_size=1, max_size=12), min_size=20, max_size=40),
    toasted=st.booleans(),
)
def test_the_arrow_form_gives_sparks_rows(spark, schedules, toasted):
    spec = SPEC if toasted else PLAIN
    changes = _changes(schedules, toasted)
    ours = newest_per_key(changes, spec)
    theirs = latest_per_key(spark.createDataFrame(changes), spec).toArrow()
    assert ours.column_names == theirs.column_names
    assert ours.schema.types == theirs.schema.types
    assert _sorted(ours) == _sorted(theirs)
