"""The error table's seal as pure functions: it opens to the same bytes with the same key and
coordinates only, it matches the documented scheme (checked with the cipher library directly),
and an error table sealed otherwise than a table's rows is refused."""

from __future__ import annotations

import secrets

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESSIV
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from pyspark.sql import types as T

from cdc_assets.error_table import ERROR_TABLE_SCHEMA
from cdc_assets.sealing import (
    MASKING_FIELD,
    SEALED,
    ErrorTableSealingError,
    SealError,
    check_error_table,
    error_table_schema,
    is_sealed,
    seal,
    sealing_key,
    unseal,
    unseal_rows,
)
from resources.masking import HmacKey

SECRET = HmacKey(secrets.token_hex(32).encode())
WHERE = {"topic": "cdc.patients", "partition": 2, "offset": 1234, "field": "value"}
RECORD = b'{"op":"c","after":{"id":7,"email":"ann@example.org","ssn":"123-45-6789"}}'


def test_a_sealed_value_opens_to_the_same_bytes_and_hides_them():
    aead = sealing_key(SECRET)
    sealed = seal(aead, RECORD, **WHERE)
    assert sealed != RECORD and b"ann@example.org" not in sealed and b"123-45" not in sealed
    assert unseal(aead, sealed, **WHERE) == RECORD
    # Deterministic: Spark computing a frame again seals the record to the same bytes.
    assert seal(aead, RECORD, **WHERE) == sealed
    assert seal(aead, None, **WHERE) is None and unseal(aead, None, **WHERE) is None
    assert unseal(aead, seal(aead, b"", **WHERE), **WHERE) == b""


def test_the_seal_is_the_documented_scheme():
    """HKDF-SHA256 of the masking key, AES-256-SIV with the coordinates as associated data:
    computed here with the library alone, so a change of scheme (which would leave older rows
    unopenable) fails this test."""
    derived = HKDF(
        algorithm=hashes.SHA256(), length=64, salt=None, info=b"cdc-lake error table AES-256-SIV v1"
    ).derive(SECRET.secret)
    aad = [b"cdc-lake error table v1", b"cdc.patients", b"2", b"1234", b"value"]
    assert sealing_key(SECRET) == derived
    assert seal(derived, RECORD, **WHERE) == AESSIV(derived).encrypt(RECORD, aad)


@pytest.mark.parametrize(
    "moved",
    [{"topic": "cdc.other"}, {"partition": 3}, {"offset": 1235}, {"field": "key"}],
)
def test_a_sealed_value_opens_only_where_it_was_sealed(moved):
    aead = sealing_key(SECRET)
    sealed = seal(aead, RECORD, **WHERE)
    with pytest.raises(SealError, match="doesn't open with this masking key") as caught:
        unseal(aead, sealed, **{**WHERE, **moved})
    assert "ann@example.org" not in str(caught.value)


def test_another_key_does_not_open_it():
    sealed = seal(sealing_key(SECRET), RECORD, **WHERE)
    other = sealing_key(HmacKey(secrets.token_hex(32).encode()))
    with pytest.raises(SealError, match="rotated\\? replay with the old key"):
        unseal(other, sealed, **WHERE)
    # The seal's key is not the hashes' key.
    assert sealing_key(SECRET)[:32] != SECRET.secret[:32]


def test_rows_are_unsealed_with_their_own_coordinates():
    aead = sealing_key(SECRET)
    rows = [
        {"topic": "t", "partition": p, "offset": o, "key": seal(aead, k, topic="t", partition=p,
         offset=o, field="key"), "value": seal(aead, v, topic="t", partition=p, offset=o,
         field="value")}
        for p, o, k, v in [(0, 5, b'{"id":1}', b"one"), (1, 5, None, b"two")]
    ]  # fmt: skip
    assert list(unseal_rows(iter(rows), SECRET)) == [(b'{"id":1}', b"one"), (None, b"two")]


def test_a_sealed_error_table_marks_its_raw_columns():
    sealed = error_table_schema(ERROR_TABLE_SCHEMA, sealed=True)
    assert {f.name for f in sealed if f.metadata.get(MASKING_FIELD) == SEALED} == {"key", "value"}
    assert is_sealed(sealed) and not is_sealed(ERROR_TABLE_SCHEMA)
    assert error_table_schema(ERROR_TABLE_SCHEMA, sealed=False) == ERROR_TABLE_SCHEMA
    assert [f.dataType for f in sealed] == [f.dataType for f in ERROR_TABLE_SCHEMA]


@pytest.mark.parametrize(
    ("stored", "sealed", "expected"),
    [
        (ERROR_TABLE_SCHEMA, True, "was written before the table had sensitive columns"),
        (error_table_schema(ERROR_TABLE_SCHEMA, sealed=True), False, "holds sealed rows"),
    ],
)
def test_rows_are_never_added_to_an_error_table_sealed_otherwise(
    stored: T.StructType, sealed: bool, expected: str
):
    with pytest.raises(ErrorTableSealingError) as caught:
        check_error_table(stored, table="patients", path="/lake/patients__errors", sealed=sealed)
    message = str(caught.value)
    assert "table 'patients', setting 'sensitive'" in message and expected in message
    assert "python -m cdc_assets.error_replay --table patients" in message
    assert "Nothing was written" in message
    # The same marking passes.
    check_error_table(stored, table="patients", path="/x", sealed=not sealed)
