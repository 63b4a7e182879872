"""Spark's read reaches the decoder narrowed to what it reads (`spark.decoder_input`): every
Kafka column but the headers, and the old key's header on a table with toasted columns. The rows
Spark's Python workers decode must be the ones the decoder gives for the whole Kafka row, as a
slice read in the driver passes it (every header included)."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from cdc_assets.columns import ERROR, MOVED_FROM
from cdc_assets.decoding.batch import decode_batch
from cdc_assets.decoding.exact import RecordDecoder
from cdc_assets.decoding.parts import OLD_KEY_COLUMN
from cdc_assets.decoding.plan import DecodePlan
from cdc_assets.decoding.spark import decode, decoder_input
from tests.cdc_assets.decoder_records import (
    COLUMNS,
    assert_same,
    batch_of,
    debezium_record,
    spec_for,
)

HOUR = "2026-11-02-06:00"
OTHER = {"key": "traceparent", "value": b"00-0af7651916cd43dd8448eb211c80319c-01"}
NULL_OLD_KEY = {"key": "__debezium.oldkey", "value": None}
OLD_KEY_2 = {"key": "__debezium.oldkey", "value": b'{"id":2}'}
OLD_KEY_9 = {"key": "__debezium.oldkey", "value": b'{"id":9}'}
NOT_JSON = {"key": "__debezium.oldkey", "value": b"not json"}


def _create(key_id: int, headers: list | None) -> tuple:
    row = dict.fromkeys(COLUMNS) | {"id": key_id, "note": "moved"}
    envelope = {"before": None, "after": row, "source": {"lsn": 50, "ts_ms": 1}, "op": "c"}
    return b'{"id":%d}' % key_id, json.dumps(envelope).encode(), headers


# Row 3 moved from key 2 (its old key behind other headers), row 4 has headers but no move,
# row 5 moved from key 2 (the first of two old keys), row 6's old key is not JSON (an error).
MOVES = [
    _create(3, [OTHER, NULL_OLD_KEY, OLD_KEY_2]),
    _create(4, [OTHER]),
    _create(5, [OLD_KEY_2, OLD_KEY_9]),
    _create(6, [NOT_JSON, OLD_KEY_2]),
]


def _with_other_headers(record: tuple, choice: int) -> tuple:
    """The record with headers the decoder must skip: another header, and an old-key header
    without a value, before the one it reads (a record may have several)."""
    key, value, headers = record
    extra = [[], [OTHER], [OTHER, NULL_OLD_KEY], [NULL_OLD_KEY]][choice]
    if not extra:
        return record
    return key, value, [*extra, *(headers or [])]


@settings(
    max_examples=8,
    deadline=None,
    phases=(Phase.generate,),  # a Spark job per example: no shrinking
    suppress_health_check=[HealthCheck.too_slow],
)
@given(data=st.data())
@pytest.mark.parametrize("toasted", [True, False])
def test_spark_decodes_the_narrowed_rows_as_the_whole_rows(spark, data, toasted):
    spec = spec_for("string")
    if not toasted:
        spec = spec.model_copy(update={"toasted_columns": ()})
    drawn = data.draw(st.lists(debezium_record("string"), min_size=1, max_size=60))
    choices = data.draw(st.lists(st.integers(0, 3), min_size=len(drawn), max_size=len(drawn)))
    records = batch_of(
        [*MOVES, *(_with_other_headers(r, c) for r, c in zip(drawn, choices, strict=True))]
    )
    whole = decode_batch(RecordDecoder(DecodePlan.of(spec, hour_key=HOUR)), records)
    if toasted:  # the decoder follows the first old key's header, and only it
        assert whole.column(MOVED_FROM).to_pylist()[:3] == [{"id": 2}, None, {"id": 2}]
        assert "__debezium.oldkey" in whole.column(ERROR).to_pylist()[3]

    kafka_rows = spark.createDataFrame(pa.Table.from_batches([records])).coalesce(1)
    narrowed = kafka_rows.select(*decoder_input(kafka_rows, DecodePlan.of(spec, hour_key=HOUR)))
    kafka = {"key", "value", "topic", "partition", "offset", "timestamp"}
    assert set(narrowed.columns) == kafka | ({OLD_KEY_COLUMN} if toasted else set())
    in_spark = decode(kafka_rows, spec, hour_key=HOUR).toArrow()
    assert in_spark.num_rows == whole.num_rows
    assert_same(in_spark.combine_chunks().to_batches()[0], whole)
