"""Sensitive columns: hashed with a secret key or dropped, right after decoding.

`mask_changes` applies a table's `sensitive` setting (`hash` or `drop`) to the decoded changes
before the audit, the newest-per-key step and the MERGE, so a raw value never reaches the
mirror, its change data feed, its Delta statistics, the checks' results, metadata or logs. In
the same step it seals a bad record's raw bytes for the error table (`cdc_assets.sealing`; the
mirror never selects them). `stored_spec` is the table as the mirror stores it;
`check_stored_mirror` refuses a mirror that may already hold a sensitive column raw.

Before changing the code:

- A hash is the HMAC-SHA256 of the value's canonical string form (`canonical_string`): change
  the form and new hashes no longer match the stored ones.
- The HMAC runs in a pandas UDF whose closure holds the key: the key is never a literal in a
  Spark plan (plans are logged and shown in the Spark UI), never in metadata or logs.

The rules (canonical forms, the key, undeclared columns): README, 'Sensitive columns'.
"""

from __future__ import annotations

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from cdc_assets.config import TableSpec, spark_type
from cdc_assets.sealing import MASKING_FIELD, RAW_COLUMNS, seal_raw_bytes
from resources.masking import HmacKey, MaskingKeyError

HASH, DROP = "hash", "drop"
# MASKING_FIELD: field metadata of a hashed column in the mirror's schema (the proof it never
# held raw values), as of the error table's sealed bytes.
HMAC_SHA256 = "hmac-sha256"
_TIMESTAMP_FORMAT = "yyyy-MM-dd'T'HH:mm:ss.SSSSSS'Z'"


class MaskedMirrorError(RuntimeError):
    """The mirror already stores a sensitive column unmasked; masking now would leave it raw."""


def hashed_columns(spec: TableSpec) -> list[str]:
    return [column for column in spec.columns if spec.sensitive.get(column) == HASH]


def dropped_columns(spec: TableSpec) -> list[str]:
    return [column for column in spec.columns if spec.sensitive.get(column) == DROP]


def stored_spec(spec: TableSpec) -> TableSpec:
    """`spec` as the mirror stores it: dropped columns gone, hashed columns strings."""
    if not spec.sensitive:
        return spec
    columns = {
        column: "string" if spec.sensitive.get(column) == HASH else declared
        for column, declared in spec.columns.items()
        if spec.sensitive.get(column) != DROP
    }
    return spec.model_copy(update={"columns": columns})


def canonical_string(column: Column, declared: str) -> Column:
    """The string a value is hashed as (see the module docstring)."""
    if spark_type(declared) == "timestamp":
        # The session runs in UTC (SparkResource), so this renders the instant in UTC.
        return F.date_format(column, _TIMESTAMP_FORMAT)
    return column.cast("string")


def _hmac_udf(key: HmacKey):
    secret = key.secret  # only the closure holds it; Spark ships it pickled, never as text

    def hmac_sha256(values: pd.Series) -> pd.Series:
        import hashlib
        import hmac

        def digest(value: str) -> str:
            return hmac.new(secret, value.encode("utf-8"), hashlib.sha256).hexdigest()

        return values.map(digest, na_action="ignore")

    return F.pandas_udf(hmac_sha256, T.StringType())


def mask_changes(decoded: DataFrame, spec: TableSpec, key: HmacKey | None) -> DataFrame:
    """Hashes and drops `spec`'s sensitive columns of decoded changes (`cdc_assets.decoding`) and
    seals their raw bytes (`cdc_assets.sealing`)."""
    if not spec.sensitive:
        return decoded
    hashed = hashed_columns(spec)
    if key is None:
        raise MaskingKeyError(
            f"table '{spec.name}', setting 'sensitive': columns [{', '.join(spec.sensitive)}] "
            "are masked and the error table's raw bytes sealed, but run_hour got no masking "
            "key; pass the masking resource's key."
        )
    # The raw bytes, where the frame has them (the error rows'; the newest changes per key a
    # MERGE takes from a slice held in the driver carry none).
    raw = all(c in decoded.columns for c in RAW_COLUMNS)
    masked = seal_raw_bytes(decoded, key) if raw else decoded
    if hashed:
        hmac_sha256 = _hmac_udf(key)
        masked = masked.withColumns(
            {
                column: hmac_sha256(canonical_string(F.col(column), spec.columns[column])).alias(
                    column, metadata={MASKING_FIELD: HMAC_SHA256}
                )
                for column in hashed
            }
        )
    return masked.drop(*dropped_columns(spec))


def stand_ins(rows: pa.Table, spec: TableSpec) -> pa.Table:
    """Changes held in memory as the checks may read them: dropped columns gone, a hashed
    column's values replaced by their index among its distinct values in `rows` (nulls stay
    null). The expectations a hashed column allows (not_null, unique) judge the indexes as they
    would the hashes, and no check reads a value."""
    if not spec.sensitive:
        return rows
    rows = rows.drop_columns([c for c in dropped_columns(spec) if c in rows.column_names])
    for column in hashed_columns(spec):
        at = rows.schema.get_field_index(column)
        if at >= 0:
            indices = pc.dictionary_encode(rows.column(column).combine_chunks()).indices
            rows = rows.set_column(at, column, indices)
    return rows


def check_stored_mirror(
    schema: T.StructType | None, path: str, spec: TableSpec, what: str = "mirror"
) -> None:
    """Refuses to run when the mirror (`schema`, None before its first run) already stores a
    sensitive column unmasked; `what` names the table (the history is checked the same way).

    Marking a column sensitive doesn't rewrite the rows already stored; rather than leave raw
    values beside hashed ones, the run stops and says how to rebuild the mirror.
    """
    if not spec.sensitive or schema is None:
        return
    fields = {f.name: f for f in schema.fields}
    raw = [c for c in dropped_columns(spec) if c in fields]
    raw += [
        c
        for c in hashed_columns(spec)
        if c in fields and fields[c].metadata.get(MASKING_FIELD) != HMAC_SHA256
    ]
    if raw:
        raise MaskedMirrorError(
            f"table '{spec.name}', setting 'sensitive': the {what} at {path} was written before "
            f"columns [{', '.join(raw)}] were marked sensitive and may hold their raw values. "
            f"Masking doesn't rewrite stored rows (nor the table's Delta history): delete the "
            f"{what}'s folder and run its hours again while Kafka still holds them (they "
            "converge to the same table, masked), or remove the setting. Nothing was read or "
            "written."
        )
