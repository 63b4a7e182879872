"""The error table of a table with sensitive columns stores its raw bytes sealed, not in clear.

A bad record keeps its raw Kafka key and value bytes in `<table>__errors` (I7); on a table with
`sensitive` columns they hold raw sensitive values, so `seal_raw_bytes` seals them right after
decoding, in the masking step (`cdc_assets.masking.mask_changes`), before the hard expectations,
the error table or anything else reads them. Whoever holds the masking key opens them again:
`unseal`, `unsealed_errors`, and `python -m cdc_assets.error_replay` after a fix.

Before changing the code:

- AES-256-SIV under a key derived from the masking key with HKDF-SHA256: one secret serves the
  hashes and the seal, and the two keys differ. The associated data binds a sealed value to its
  Kafka coordinates and field (`key` or `value`): copied to another row or field, it doesn't open.
- Deterministic on purpose: a frame Spark computes again seals to the same bytes, and nonce
  reuse can't leak anything (a topic deleted and created again reuses coordinates).
- An error table is sealed or raw for good (`check_error_table`).

The scheme, the replay and key rotation: README, 'Sensitive columns'.
"""

from __future__ import annotations

from collections.abc import Iterator

import pandas as pd
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESSIV
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from cdc_assets.columns import KAFKA_OFFSET, KAFKA_PARTITION
from resources.masking import HmacKey

# Field metadata of the error table's sealed `key` and `value` (the mirror's key, MASKING_FIELD).
MASKING_FIELD = "cdc.masking"
SEALED = "aes-256-siv"
RAW_COLUMNS = ("key", "value")
# Changing it changes the sealing key: a new version of the scheme, never an edit.
_KDF_INFO = b"cdc-lake error table AES-256-SIV v1"
_AAD_PREFIX = b"cdc-lake error table v1"


class SealError(RuntimeError):
    """A sealed value doesn't open: another key, or it was moved or altered."""


class ErrorTableSealingError(RuntimeError):
    """An error table holds raw bytes where sealed ones are due, or the other way round."""


def sealing_key(key: HmacKey) -> bytes:
    """The AES-256-SIV key (64 bytes) derived from the masking key."""
    return HKDF(algorithm=hashes.SHA256(), length=64, salt=None, info=_KDF_INFO).derive(key.secret)


def _associated(topic: str, partition: int, offset: int, field: str) -> list[bytes]:
    return [_AAD_PREFIX, topic.encode(), b"%d" % partition, b"%d" % offset, field.encode()]


def seal(
    aead: bytes, data: bytes | None, *, topic: str, partition: int, offset: int, field: str
) -> bytes | None:
    """`data` sealed under `aead` (a `sealing_key`) for the record at these coordinates."""
    if data is None:
        return None
    return AESSIV(aead).encrypt(bytes(data), _associated(topic, partition, offset, field))


def unseal(
    aead: bytes, sealed: bytes | None, *, topic: str, partition: int, offset: int, field: str
) -> bytes | None:
    """The bytes `seal` sealed; `SealError` when the key or the coordinates differ."""
    if sealed is None:
        return None
    try:
        return AESSIV(aead).decrypt(bytes(sealed), _associated(topic, partition, offset, field))
    except InvalidTag:
        raise SealError(
            f"the sealed {field} of {topic} partition {partition} offset {offset} doesn't open "
            "with this masking key: it was sealed under another one (rotated? replay with the "
            "old key), or the row was altered"
        ) from None


def _seal_udf(key: HmacKey, field: str, *, opening: bool):
    aead = sealing_key(key)  # only the closure holds it; Spark ships it pickled, never as text
    apply = unseal if opening else seal

    def run(
        data: pd.Series, topic: pd.Series, partition: pd.Series, offset: pd.Series
    ) -> pd.Series:
        return pd.Series(
            [
                apply(aead, d, topic=t, partition=p, offset=o, field=field)
                for d, t, p, o in zip(data, topic, partition, offset, strict=True)
            ],
            dtype=object,
        )

    # The name Spark's plans and UI show for the step.
    run.__name__ = run.__qualname__ = "aes_siv_open" if opening else "aes_siv_seal"
    return F.pandas_udf(run, T.BinaryType())


def seal_raw_bytes(frame: DataFrame, key: HmacKey) -> DataFrame:
    """Seals the decoded frame's `key` and `value` (`cdc_assets.decoding`: set on error rows)."""
    coordinates = (F.col("topic"), F.col(KAFKA_PARTITION), F.col(KAFKA_OFFSET))
    return frame.withColumns(
        {
            field: _seal_udf(key, field, opening=False)(F.col(field), *coordinates).alias(
                field, metadata={MASKING_FIELD: SEALED}
            )
            for field in RAW_COLUMNS
        }
    )


def error_table_schema(base: T.StructType, *, sealed: bool) -> T.StructType:
    """The error table's schema, its `key` and `value` marked when `sealed`."""
    if not sealed:
        return base
    return T.StructType(
        [
            T.StructField(f.name, f.dataType, f.nullable, {MASKING_FIELD: SEALED})
            if f.name in RAW_COLUMNS
            else f
            for f in base.fields
        ]
    )


def is_sealed(schema: T.StructType) -> bool:
    return all(schema[c].metadata.get(MASKING_FIELD) == SEALED for c in RAW_COLUMNS)


def check_error_table(schema: T.StructType, *, table: str, path: str, sealed: bool) -> None:
    """Refuses to add rows to an error table (`schema`) sealed otherwise than they are."""
    if is_sealed(schema) == sealed:
        return
    if sealed:
        raise ErrorTableSealingError(
            f"table '{table}', setting 'sensitive': its error table at {path} was written before "
            "the table had sensitive columns and may hold their raw values in clear; sealed rows "
            "can't be added beside them. Produce its rows back to the topic if Kafka no longer "
            f"holds them (python -m cdc_assets.error_replay --table {table}), delete the error "
            "table's folder (and the mirror's, see the README) and run the hours again. Nothing "
            "was written."
        )
    raise ErrorTableSealingError(
        f"table '{table}', setting 'sensitive': its error table at {path} holds sealed rows, but "
        "the table no longer has sensitive columns, and raw rows can't be added beside them. "
        "Put the setting back, or produce the sealed rows back to the topic with the masking key "
        f"(python -m cdc_assets.error_replay --table {table}) and delete the error table's "
        "folder. Nothing was written."
    )


def unsealed_errors(errors: DataFrame, key: HmacKey | None) -> DataFrame:
    """Rows of an error table with `key` and `value` as Kafka gave them (`key` None: the table
    isn't sealed). Read them only where the Kafka topic itself may be read."""
    if not is_sealed(errors.schema):
        return errors
    if key is None:
        raise SealError("the error table is sealed: its rows open only with the masking key")
    coordinates = (F.col("topic"), F.col("partition"), F.col("offset"))
    return errors.withColumns(
        {
            field: _seal_udf(key, field, opening=True)(F.col(field), *coordinates).alias(
                field, metadata={}
            )
            for field in RAW_COLUMNS
        }
    )


def unseal_rows(rows: Iterator, key: HmacKey) -> Iterator[tuple[bytes | None, bytes | None]]:
    """(key, value) of each sealed error-table row (with topic, partition, offset), opened in
    this process: what the replay sends."""
    aead = sealing_key(key)
    for row in rows:
        where = {"topic": row["topic"], "partition": row["partition"], "offset": row["offset"]}
        yield (
            unseal(aead, row["key"], field="key", **where),
            unseal(aead, row["value"], field="value", **where),
        )
