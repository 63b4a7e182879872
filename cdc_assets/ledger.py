"""A mirror's ledger: what each run recorded in its Delta commit, read without Spark.

Every run commits to its mirror with the hour's slice and counts as the commit's
`userMetadata` (`commits.commit_metadata`). Reading that back needs no Spark job: a Delta table's
log is a folder of JSON files, one per version, whose `commitInfo` action holds the metadata,
the operation and its metrics. This reads those files directly (a local folder, or S3 through
the lake's boto3 client), newest first, and keeps what it read, so a run that looks at the same
table hour after hour reads each commit once.

Delta keeps commit files for `delta.logRetentionDuration` (30 days by default); older commits
are only in checkpoints, which carry no commitInfo. That is also all `DESCRIBE HISTORY` shows.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

_COMMIT_FILE = re.compile(r"^(\d{20})\.json$")


@dataclass(frozen=True)
class Commit:
    """One Delta commit as the ledger needs it."""

    version: int
    operation: str | None
    # The pipeline's userMetadata (the run's record), None for other commits.
    metadata: dict[str, Any] | None
    metrics: dict[str, str] = field(default_factory=dict)


class DeltaLog:
    """The Delta log of the table at `path` (a local path, or `s3a://bucket/prefix`).

    `s3_client`: a boto3 S3 client for an `s3a://`/`s3://` path (the lake resource's).
    """

    def __init__(self, path: str, *, s3_client: Any = None) -> None:
        self.path = path
        self._s3 = s3_client
        self._commits: dict[int, Commit] = {}
        self._stamps: dict[str, Any] | None = None
        parsed = urlparse(path)
        self._bucket = parsed.netloc if parsed.scheme in ("s3", "s3a") else None
        self._prefix = parsed.path.lstrip("/").rstrip("/") + "/_delta_log/"
        self._folder = None if self._bucket else Path(path) / "_delta_log"

    # -- listing and reading --

    def versions(self) -> list[int]:
        """The versions whose commit files exist, oldest first (listed again on each call)."""
        self._stamps = self._list()
        return self._listed()

    def _listed(self) -> list[int]:
        """The versions of the last listing, oldest first."""
        return sorted(int(m[1]) for name in self._stamps or () if (m := _COMMIT_FILE.match(name)))

    def exists(self) -> bool:
        return bool(self.versions())

    def latest_version(self) -> int | None:
        versions = self.versions()
        return versions[-1] if versions else None

    def commits(self) -> list[Commit]:
        """Every commit still in the log, newest first (each file read once per instance)."""
        versions = self.versions()
        for version in versions:
            if version not in self._commits:
                self._commits[version] = self._read(version)
        return [self._commits[v] for v in reversed(versions)]

    def commit(self, version: int) -> Commit:
        if version not in self._commits:
            self._commits[version] = self._read(version)
        return self._commits[version]

    def run_commit(self, metadata: dict[str, Any], operation: str) -> Commit | None:
        """The newest `operation` commit carrying exactly `metadata`: a run's own commit."""
        wanted = json.loads(json.dumps(metadata))
        for commit in self.commits():
            if commit.operation == operation and commit.metadata == wanted:
                return commit
        return None

    def hour_history(self) -> tuple[int | None, list[dict[str, Any]]]:
        """The table's current version and its pipeline commits' metadata, newest first (each
        with its `version`); (None, []) before the table exists."""
        commits = self.commits()
        history = [
            {"version": c.version, **c.metadata}
            for c in commits
            if c.metadata is not None and "slice" in c.metadata and "prepares" not in c.metadata
        ]
        return (commits[0].version if commits else None), history

    def size_bytes(self, *, absent: int | None = None, relist: bool = True) -> int | None:
        """The table's data files' bytes at its latest version, from the checksum file Delta
        writes beside each commit (`<version>.crc`, `tableSizeBytes`); None where that version
        has none (a writer that writes no checksum, or one that stopped before it); `absent`
        where the table has no commit yet. `relist=False` takes the latest version from this
        instance's last listing, where the caller knows nothing has committed since (on S3, a
        LIST less)."""
        versions = self.versions() if relist or self._stamps is None else self._listed()
        if not versions:
            return absent
        name = f"{versions[-1]:020d}.crc"
        if name not in (self._stamps or {}):
            return None
        try:
            return int(json.loads(self._text(name))["tableSizeBytes"])
        except (ValueError, KeyError, TypeError):
            return None

    def _list(self) -> dict[str, Any]:
        """The log's file names, each with what tells a rewritten file from the one cached."""
        if self._folder is not None:
            try:
                entries = os.scandir(self._folder)
            except FileNotFoundError:
                return {}
            with entries:
                return {e.name: (e.stat().st_mtime_ns, e.stat().st_size) for e in entries}
        stamps: dict[str, Any] = {}
        paginator = self._s3.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self._bucket, Prefix=self._prefix, Delimiter="/"):
            for item in page.get("Contents", ()):
                stamps[item["Key"][len(self._prefix) :]] = (item.get("ETag"), item.get("Size"))
        return stamps

    def _read(self, version: int) -> Commit:
        name = f"{version:020d}.json"
        stamp = (self._stamps or {}).get(name)
        cached = _READ.get((self.path, name))
        if stamp is not None and cached is not None and cached[0] == stamp:
            return cached[1]
        commit = _parse(version, self._text(name))
        if stamp is not None:
            _READ[(self.path, name)] = (stamp, commit)
        return commit

    def _text(self, name: str) -> str:
        """A file of the log, as text."""
        if self._folder is not None:
            return (self._folder / name).read_text()
        answer = self._s3.get_object(Bucket=self._bucket, Key=self._prefix + name)
        return answer["Body"].read().decode()


# Commit files are written once, but a table can be dropped and made again at the same path:
# a cached commit is used only while its file's listing stamp (mtime and size, or S3 ETag) is
# the one it was read with.
_READ: dict[tuple[str, str], tuple[Any, Commit]] = {}


def _parse(version: int, text: str) -> Commit:
    """The commit's commitInfo action."""
    for line in text.splitlines():
        action = json.loads(line) if line.strip() else {}
        info = action.get("commitInfo")
        if info is None:
            continue
        metadata = None
        try:
            parsed = json.loads(info.get("userMetadata") or "null")
            metadata = parsed if isinstance(parsed, dict) else None
        except ValueError:
            metadata = None
        return Commit(
            version=version,
            operation=info.get("operation"),
            metadata=metadata,
            metrics=dict(info.get("operationMetrics") or {}),
        )
    return Commit(version=version, operation=None, metadata=None)
