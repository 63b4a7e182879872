"""Where the Delta tables live: a local folder by default, any Hadoop filesystem URI otherwise."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
from pydantic import Field


class LakeResource(dg.ConfigurableResource):
    """The lake's root; each table is a Delta table in `<root>/<table>`."""

    root: str = Field(
        default=".local/lake",
        description="A local folder (relative to the working directory) or a URI like s3a://b/p.",
    )

    @property
    def root_uri(self) -> str:
        if "://" in self.root:
            return self.root.rstrip("/")
        return str(Path(self.root).resolve())

    def table_path(self, table: str) -> str:
        return f"{self.root_uri}/{table}"
