"""MaskingResource: a usable key, or an error naming the table, the columns and the fix."""

from __future__ import annotations

import pytest

from resources.masking import MASKING_KEY_ENV, HmacKey, MaskingKeyError, MaskingResource


def test_a_key_of_32_bytes_or_more_is_used():
    key = MaskingResource(key="k" * 32).hmac_key(table="t", columns=["email"])
    assert key == HmacKey(b"k" * 32)
    assert "k" * 32 not in repr(key) and "k" * 32 not in repr(MaskingResource(key="k" * 32))


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        (None, f"no masking key is configured. Set the environment variable {MASKING_KEY_ENV}"),
        ("short", "has 5 bytes; HMAC-SHA256 needs at least 32"),
    ],
)
def test_a_missing_or_short_key_names_the_table_the_columns_and_the_fix(key, expected):
    with pytest.raises(MaskingKeyError) as refused:
        MaskingResource(key=key).hmac_key(table="customers", columns=["email", "tax_id"])
    message = str(refused.value)
    assert expected in message and "table 'customers'" in message
    assert "Nothing was read or written" in message
