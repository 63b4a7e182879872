"""The mirror's own columns: the `_cdc_*` names every stage after the decoder reads and writes.

The decoder (`cdc_assets.decoding`) produces them; the rule, the MERGE, the error table, the
commits, the checks and the downstream assets read them. Names only, so any of those can import
them without importing the decoder.
"""

from __future__ import annotations

# What a change is and where it came from.
OP, SEQUENCE, SOURCE_TS, KAFKA_PARTITION, KAFKA_OFFSET = (
    "_cdc_op",
    "_cdc_sequence",
    "_cdc_source_ts",
    "_cdc_kafka_partition",
    "_cdc_kafka_offset",
)
KAFKA_TIMESTAMP = "_cdc_kafka_timestamp"
# The OP of a truncate record (Debezium's `t`).
TRUNCATE = "t"
HOUR, INGESTED_AT, DELETED = "_cdc_hour", "_cdc_ingested_at", "_cdc_deleted"
# The decoder's verdict: null when the change can be applied, else the reason.
ERROR = "_cdc_error"
TOMBSTONE = "_cdc_is_tombstone"
# The old primary key of a change that moved its row (a primary-key update), from Debezium's
# `__debezium.oldkey` header; null for other changes.
MOVED_FROM = "_cdc_moved_from"
# What the hour's records told of the source's columns: one JSON summary per Arrow batch.
SHAPE = "_cdc_shape"
# What the batch's records add up to (`cdc_assets.decoding.tally.Tally`): JSON on its first row.
TALLY = "_cdc_tally"


def has_value(column: str) -> str:
    """Decoded flag: the change carries a value of toasted column `column`."""
    return f"_cdc_has__{column}"


def value_sequence(column: str) -> str:
    """Mirror column: the sequence of the change that gave toasted `column` its value."""
    return f"_cdc_seq__{column}"


# The Kafka coordinates closing the `_cdc_sequence` struct: not where a change stands at its
# source (a change delivered twice stands in one place).
KAFKA_FIELDS = ("kafka_partition", "kafka_offset")


def source_fields(sequence_type) -> list[str]:
    """The fields of a `_cdc_sequence` struct type that name a change at its source (a history
    version's identity)."""
    return [f.name for f in sequence_type.fields if f.name not in KAFKA_FIELDS]
