"""A batch of Kafka records → the decoded Arrow batch: the fast pass, then the exact pass.

The fast pass (`fast.py`) decodes the records of the common shape a column at a time and leaves
out the others; the exact pass (`exact.py`) decodes those one by one and names every error.
Both produce the same rows for a record (tests/cdc_assets/test_batch_decode.py checks the whole
batch against the exact pass alone); the batch's tally and source shape add up what both saw.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pyarrow as pa

from cdc_assets.decoding.exact import RecordDecoder, exact_part
from cdc_assets.decoding.fast import FastPass
from cdc_assets.decoding.parts import BatchInput, Part, Seen
from cdc_assets.decoding.plan import arrow_schema
from cdc_assets.decoding.shape import add_json_kinds
from cdc_assets.decoding.tally import KeyRange, Tally


def decode_batch(
    decoder: RecordDecoder, batch: pa.RecordBatch, *, fast: bool = True
) -> pa.RecordBatch:
    """Decodes a batch of Kafka rows (key, value, topic, partition, offset, timestamp and,
    optionally, the headers or the old key's header, `spark.decoder_input`) into the frame
    `DecodePlan.spark_schema` describes. `fast=False`: the exact pass alone, for every record
    (the same batch, slower)."""
    with _no_cycle_collection():
        return _decode_batch(decoder, batch, fast=fast)


@contextmanager
def _no_cycle_collection() -> Iterator[None]:
    """A batch builds a few objects per value and keeps them until its arrays are made, none
    of them in a reference cycle: Python's cycle collector, run every few hundred allocations,
    would scan them again and again (a third of the batch's time, measured)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _decode_batch(decoder: RecordDecoder, batch: pa.RecordBatch, *, fast: bool) -> pa.RecordBatch:
    plan = decoder.plan
    schema = arrow_schema(plan)
    records = BatchInput.of(batch)
    count = batch.num_rows
    tally = Tally(records=count)
    key_range = KeyRange(plan.ranged_keys)
    seen = Seen()
    if fast:
        parts, left_out = FastPass(decoder, records, schema).run(tally, key_range, seen)
    else:
        parts, left_out = [], list(range(count))
    if left_out:
        parts.append(exact_part(decoder, records, left_out, schema, tally, key_range, seen))
    add_json_kinds(plan, seen.shape, seen.json_kinds, seen.json_newest)
    shapes, tallies = [None] * count, [None] * count
    if count and (seen.shape.schemas or seen.shape.fields):
        shapes[0] = seen.shape.to_json()
    if count:
        tally.low, tally.high = key_range.encoded()
        tallies[0] = tally.to_json()
    columns = _assemble(parts, count, schema)
    columns += [pa.array(shapes, pa.string()), pa.array(tallies, pa.string())]
    return pa.RecordBatch.from_arrays(columns, schema=schema)


def _assemble(parts: list[Part], count: int, schema: pa.Schema) -> list[pa.Array]:
    """The parts' rows in the batch's order."""
    width = len(schema) - 2
    parts = [p for p in parts if p.rows]
    if not parts:
        return [pa.array([], schema.field(n).type) for n in range(width)]
    if len(parts) == 1:
        return parts[0].arrays
    rows = np.concatenate([np.asarray(p.rows, dtype=np.int64) for p in parts])
    order = pa.array(np.argsort(rows, kind="stable"))
    return [pa.concat_arrays([p.arrays[n] for p in parts]).take(order) for n in range(width)]
