"""The secret key that sensitive columns are hashed with (HMAC-SHA256), and that the error
table's raw bytes are sealed with (a key derived from it, `cdc_assets.sealing`), from the
environment."""

from __future__ import annotations

from dataclasses import dataclass, field

import dagster as dg
from pydantic import Field

MASKING_KEY_ENV = "CDC_MASKING_KEY"
# HMAC-SHA256 wants a key at least as long as its 32-byte output (RFC 2104).
MIN_KEY_BYTES = 32


class MaskingKeyError(RuntimeError):
    """A table hashes columns, but no usable key is configured."""


@dataclass(frozen=True)
class HmacKey:
    """The key's bytes, kept out of reprs, so an error or a log line can't print it."""

    secret: bytes = field(repr=False)


class MaskingResource(dg.ConfigurableResource):
    """Holds the key of the tables file's `sensitive` setting: `hash` columns are keyed by it,
    and the error table's raw bytes are sealed with a key derived from it.

    Give the key as `dg.EnvVar("CDC_MASKING_KEY")`, never inline: Dagster then stores only the
    variable's name. Only tables with sensitive columns require this resource, so the others
    run without a key.
    """

    # repr=False: a resource printed in a log or an error shows no key.
    key: str | None = Field(
        default=None,
        repr=False,
        description=(
            f"Secret of at least {MIN_KEY_BYTES} bytes for HMAC-SHA256, e.g. from "
            "`openssl rand -hex 32`. Changing it changes every hash written from then on, and "
            "error rows sealed before open only with the old one."
        ),
    )

    def hmac_key(self, *, table: str, columns: list[str]) -> HmacKey:
        """The key for `table`'s sensitive `columns`, or an error saying how to configure it."""
        secret = (self.key or "").encode()
        masked = ", ".join(columns)
        if not secret:
            raise MaskingKeyError(
                f"table '{table}', setting 'sensitive': columns [{masked}] are masked and the "
                "error table's raw bytes sealed with the masking key, but no "
                f"masking key is configured. Set the environment variable {MASKING_KEY_ENV} to a "
                f"secret of at least {MIN_KEY_BYTES} bytes (e.g. `openssl rand -hex 32`), which "
                f"the `masking` resource reads as dg.EnvVar('{MASKING_KEY_ENV}'). Nothing was "
                "read or written."
            )
        if len(secret) < MIN_KEY_BYTES:
            raise MaskingKeyError(
                f"table '{table}', setting 'sensitive': the masking key in {MASKING_KEY_ENV} has "
                f"{len(secret)} bytes; HMAC-SHA256 needs at least {MIN_KEY_BYTES} (e.g. "
                "`openssl rand -hex 32`). Nothing was read or written."
            )
        return HmacKey(secret)
