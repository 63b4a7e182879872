"""The batch a decode pass reads and the pieces it returns: plain containers both passes share.

`BatchInput` is the Kafka batch as Python lists; each pass returns `Part`s (decoded rows of some
of the batch's records) and adds what the records told of the source's columns to `Seen`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa

from cdc_assets.decoding.envelope import OLD_KEY_HEADER, old_key_value
from cdc_assets.decoding.shape import SourceShape

# Spark's read sends the decoder the `__debezium.oldkey` header's value alone, in this column
# (`spark.decoder_input`).
OLD_KEY_COLUMN = "_cdc_old_key"


@dataclass
class BatchInput:
    """The batch's Kafka columns as Python lists."""

    batch: pa.RecordBatch
    keys: list
    values: list
    partitions: list
    offsets: list
    headers: list

    @classmethod
    def of(cls, batch: pa.RecordBatch) -> BatchInput:
        count = batch.num_rows
        names = batch.schema.names
        # The one header the decoder reads, whichever way the slice was read: every header (a
        # slice read in the driver, `read.read_slice_locally`) or its value alone (Spark's read,
        # `spark.decoder_input`). So other headers send no record to the exact pass.
        if "headers" in names:
            old_keys = [old_key_value(h) for h in batch.column("headers").to_pylist()]
        elif OLD_KEY_COLUMN in names:
            old_keys = batch.column(OLD_KEY_COLUMN).to_pylist()
        else:
            old_keys = [None] * count
        headers = [
            None if old is None else [{"key": OLD_KEY_HEADER, "value": old}] for old in old_keys
        ]
        return cls(
            batch,
            batch.column("key").to_pylist(),
            batch.column("value").to_pylist(),
            batch.column("partition").to_pylist(),
            batch.column("offset").to_pylist(),
            headers,
        )


@dataclass
class Seen:
    """What the batch's records told of the source's columns (`SourceShape`), gathered."""

    shape: SourceShape = field(default_factory=SourceShape)
    json_kinds: dict[str, set[str]] = field(default_factory=dict)
    # (column, partition) → (offset, kind) of the newest non-null value.
    json_newest: dict[tuple[str, int], tuple[int, str]] = field(default_factory=dict)

    def kind(self, name: str, kind: str, partition: int, offset: int) -> None:
        self.json_kinds.setdefault(name, set()).add(kind)
        if kind != "null":
            newest = self.json_newest.get((name, partition))
            if newest is None or offset > newest[0]:
                self.json_newest[(name, partition)] = (offset, kind)


@dataclass
class Part:
    """Decoded rows of some of the batch's records: their row numbers, ascending, and one
    array per output column (the schema's, SHAPE and TALLY excepted)."""

    rows: list[int]
    arrays: list[pa.Array]
