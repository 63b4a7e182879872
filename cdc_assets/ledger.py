"""A mirror's ledger: what each run recorded in its Delta commit, read without Spark.

Every run commits to its mirror with the hour's slice and counts as the commit's
`userMetadata` (`commits.commit_metadata`). Reading that back needs no Spark job: a Delta table's
log is a folder of JSON files, one per version, whose `commitInfo` action holds the metadata,
the operation and its metrics. This reads those files directly (a local folder, or S3 through
the lake's boto3 client), newest first, and keeps what it read, so a run that looks at the same
table hour after hour reads each commit once.

The same files give the table's schema, properties and protocol (`table_metadata`), replayed as
Delta does, and on a table with the change data feed the rows one commit changed
(`change_rows`). Where the log holds what this can't read faithfully, both return None and the
caller asks Spark.

Delta keeps commit files for `delta.logRetentionDuration` (30 days by default); older commits
are only in checkpoints, which carry no commitInfo. That is also all `DESCRIBE HISTORY` shows.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import pyarrow as pa
import pyarrow.parquet as pq

_COMMIT_FILE = re.compile(r"^(\d{20})\.json$")
# Classic (`<v>.checkpoint.parquet`) and multi-part (`<v>.checkpoint.<i>.<n>.parquet`)
# checkpoints, and the UUID-named v2 ones (`<v>.checkpoint.<uuid>.json|parquet`, with sidecars).
_CHECKPOINT_FILE = re.compile(r"^(\d{20})\.checkpoint(?:\.(\d{10})\.(\d{10}))?\.parquet$")
_V2_CHECKPOINT_FILE = re.compile(r"^(\d{20})\.checkpoint\.[0-9a-fA-F-]{36}\.(?:json|parquet)$")

CHANGE_DATA_FEED = "delta.enableChangeDataFeed"
CHANGE_TYPE = "_change_type"


@dataclass(frozen=True)
class FileAction:
    """A file a commit adds to the table (`add`) or to its change data feed (`cdc`)."""

    # As the log has it: a URL-encoded path relative to the table's root, or an absolute URI.
    path: str
    partition_values: dict[str, str | None] = field(default_factory=dict)
    size: int | None = None
    deletion_vector: bool = False


@dataclass(frozen=True)
class Commit:
    """One Delta commit as the ledger needs it."""

    version: int
    operation: str | None
    # The pipeline's userMetadata (the run's record), None for other commits.
    metadata: dict[str, Any] | None
    metrics: dict[str, str] = field(default_factory=dict)
    # The commit's `metaData` and `protocol` actions as written, None where it changed neither.
    metadata_action: dict[str, Any] | None = None
    protocol_action: dict[str, Any] | None = None
    # Its change data files, the data files it added with dataChange, and how many it removed.
    cdc_files: tuple[FileAction, ...] = ()
    added_files: tuple[FileAction, ...] = ()
    data_removes: int = 0


@dataclass(frozen=True)
class Protocol:
    """What a reader and a writer of the table must support (Delta's `protocol` action)."""

    min_reader_version: int
    min_writer_version: int
    reader_features: tuple[str, ...] = ()
    writer_features: tuple[str, ...] = ()


@dataclass(frozen=True)
class TableMetadata:
    """A Delta table's metadata at a version, as its log's replay leaves it."""

    version: int
    id: str
    # The parsed `schemaString`, what `pyspark.sql.types.StructType.fromJson` takes. As stored:
    # Spark's DataFrame schema leaves out Delta's internal field metadata (column defaults,
    # column-mapping ids, type changes), which the mirrors' columns do not carry.
    schema: dict[str, Any]
    partition_columns: tuple[str, ...]
    # The table's properties as stored (`delta.*` and the project's own).
    configuration: dict[str, str]
    protocol: Protocol

    def properties(self) -> dict[str, str]:
        """The properties `SHOW TBLPROPERTIES` lists: the configuration, the protocol's versions
        and `delta.feature.<name>` for each feature (Delta's `Snapshot.getProperties`; a
        clustered table's clustering columns are not among them)."""
        protocol = self.protocol
        listed = {k: v for k, v in self.configuration.items() if k != "path"}
        listed["delta.minReaderVersion"] = str(protocol.min_reader_version)
        listed["delta.minWriterVersion"] = str(protocol.min_writer_version)
        if protocol.min_reader_version >= 3 or protocol.min_writer_version >= 7:
            for name in sorted({*protocol.reader_features, *protocol.writer_features}):
                listed[f"delta.feature.{name}"] = "supported"
        return listed


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

    def table_metadata(self, *, relist: bool = True) -> TableMetadata | None:
        """The table's current schema, properties and protocol, read from its log without Spark;
        None before the table exists (`relist=False`: by this instance's last listing, as in
        `size_bytes`).

        Replayed as Delta does: the newest `metaData` and `protocol` actions win, looked for in
        the commits after the newest complete checkpoint, newest first, then in that checkpoint
        (classic or multi-part Parquet, only those two columns read). None also where this can't
        replay the log faithfully, for the caller to ask Spark: the checkpoint it needs is a v2
        one (UUID-named), a commit after it is missing, or the table is catalog-managed (its
        newest commits need not be in the folder yet). `exists()` tells that from no table.
        """
        if relist or self._stamps is None:
            self._stamps = self._list()
        return self._replay(None)

    def change_rows(
        self, version: int, columns: Sequence[str], *, max_bytes: int | None = None
    ) -> pa.Table | None:
        """The rows commit `version` changed, as Delta's change data feed reports them (a
        `readChangeFeed` from and to `version`): `columns` and `_change_type` (`insert`,
        `update_preimage`, `update_postimage`, `delete`), read from the commit's files without
        Spark. `columns` are the table's current top-level columns (as in Spark's read, one the
        commit's files lack is null); a name the table lacks is a ValueError.

        Per Delta's protocol a commit with `cdc` actions changed exactly the rows of those files,
        and one without inserted the rows of the files it added. None, for the caller to ask
        Spark, where the feed was off at that commit (or its commit file is gone) and where this
        can't read the rows faithfully: the commit removed data without change files, an added
        file has a deletion vector, a column asked for is a partition column, the table maps
        column names (`delta.columnMapping.mode`) or needs a reader feature not known here, or
        the files to read hold more than `max_bytes`.
        """
        self._stamps = self._list()
        at, current = self._replay(version), self._replay(None)
        if at is None or current is None or version not in self._listed():
            return None
        if at.configuration.get(CHANGE_DATA_FEED, "false").lower() != "true":
            return None
        fields = {f["name"]: f["type"] for f in current.schema.get("fields", ())}
        unknown = [c for c in columns if c not in fields]
        if unknown:
            raise ValueError(
                f"the table at {self.path} has no column {unknown} at version {current.version} "
                f"(its columns: {sorted(fields)})"
            )
        partitions = {*at.partition_columns, *current.partition_columns}
        if not (_plain_files(at) and _plain_files(current)) or partitions & {*columns}:
            return None
        types = {c: _arrow_type(fields[c]) for c in columns}
        if any(isinstance(fields[c], str) and types[c] is None for c in columns):
            return None  # a type this does not know how Spark stores
        commit = self._read(version)
        if commit.cdc_files:
            files, change_type = commit.cdc_files, None  # the type is in each row of the files
        elif _changed_no_rows(commit):
            files, change_type = (), "insert"
        elif commit.data_removes or any(f.deletion_vector for f in commit.added_files):
            return None
        else:
            files, change_type = commit.added_files, "insert"
        if max_bytes is not None and sum(f.size or 0 for f in files) > max_bytes:
            return None
        parts = [self._change_file(f, columns, types, change_type) for f in files]
        if any(part is None for part in parts):
            return None
        if not parts:
            if any(types[c] is None for c in columns):
                return None
            empty = {c: pa.array([], types[c]) for c in columns}
            return pa.table({**empty, CHANGE_TYPE: pa.array([], pa.string())})
        try:
            return pa.concat_tables(parts)
        except pa.ArrowInvalid:  # nested columns the files hold in different shapes
            return None

    def _replay(self, version: int | None) -> TableMetadata | None:
        """The table's metadata at `version` (the latest where None), by the last listing."""
        commits = set(self._listed())
        checkpoints = _checkpoints(self._stamps or {})
        latest = max([*commits, *checkpoints], default=None)
        if latest is None or (version is not None and not 0 <= version <= latest):
            return None
        target = latest if version is None else version
        base = max((v for v in checkpoints if v <= target), default=-1)
        meta = protocol = None
        for v in range(target, base, -1):
            if v not in commits:
                return None  # a gap in the log: no table state to replay
            commit = self._read(v)
            meta = meta if meta is not None else commit.metadata_action
            protocol = protocol if protocol is not None else commit.protocol_action
            if meta is not None and protocol is not None:
                break
        else:
            if base >= 0:
                found = self._checkpoint_actions(checkpoints[base])
                if found is None:
                    return None
                meta = meta if meta is not None else found[0]
                protocol = protocol if protocol is not None else found[1]
        if meta is None or protocol is None:
            return None
        table = _table_metadata(target, meta, protocol)
        return None if table is None or _catalog_managed(table) else table

    def _checkpoint_actions(self, names: tuple[str, ...] | None) -> tuple[dict, dict] | None:
        """The `metaData` and `protocol` actions of a checkpoint (its Parquet parts); None for a
        v2 checkpoint (`names` None) or one that can't be read."""
        if names is None:
            return None
        stamp = tuple((self._stamps or {}).get(name) for name in names)
        cached = _CHECKPOINTS.get(self.path)
        if cached is not None and cached[0] == (names, stamp):
            return cached[1]
        meta = protocol = None
        try:
            for name in names:
                if self._folder is not None:
                    source: Any = self._folder / name
                else:
                    source = pa.BufferReader(self._bytes(name))
                actions = pq.read_table(source, columns=["metaData", "protocol"])
                metas = actions.column("metaData").drop_null().to_pylist()
                protocols = actions.column("protocol").drop_null().to_pylist()
                meta = meta if meta is not None or not metas else metas[0]
                protocol = protocol if protocol is not None or not protocols else protocols[0]
        except (pa.ArrowException, OSError, ValueError, KeyError):
            return None
        if meta is None or protocol is None:
            return None
        if None not in stamp:
            _CHECKPOINTS[self.path] = ((names, stamp), (meta, protocol))
        return meta, protocol

    def _change_file(
        self,
        action: FileAction,
        columns: Sequence[str],
        types: dict[str, pa.DataType | None],
        change_type: str | None,
    ) -> pa.Table | None:
        """One file's rows: `columns` as the table types them, and their `_change_type` (the
        file's own where `change_type` is None); None where it can't be read faithfully."""
        location = _file_location(self.path, action.path)
        if location is None:
            return None
        bucket, key = location
        try:
            if bucket is None:
                source: Any = key
            else:
                source = pa.BufferReader(self._s3.get_object(Bucket=bucket, Key=key)["Body"].read())
            # INT96 (Spark's default) as microseconds: nanoseconds overflow outside 1677..2262.
            with pq.ParquetFile(source, coerce_int96_timestamp_unit="us") as parquet:
                present = set(parquet.schema_arrow.names)
                wanted = [c for c in columns if c in present]
                if change_type is None:
                    if CHANGE_TYPE not in present:
                        return None
                    wanted.append(CHANGE_TYPE)
                rows = parquet.read(columns=wanted)
                count = parquet.metadata.num_rows
            arrays: dict[str, Any] = {}
            for column in columns:
                wanted_type = types[column]
                if column not in present:
                    if wanted_type is None:
                        return None
                    arrays[column] = pa.nulls(count, wanted_type)
                    continue
                values = rows.column(column)
                if wanted_type is not None and values.type != wanted_type:
                    values = values.cast(wanted_type)  # INT96 timestamps, widened types
                arrays[column] = values
            if change_type is None:
                arrays[CHANGE_TYPE] = rows.column(CHANGE_TYPE).cast(pa.string())
            else:
                arrays[CHANGE_TYPE] = pa.array([change_type] * count, pa.string())
            return pa.table(arrays)
        except (pa.ArrowException, OSError, ValueError, KeyError):
            return None  # gone (vacuumed) or not Parquet as Spark writes it: Spark says which
        except Exception as exc:
            if bucket is not None and isinstance(exc, self._s3.exceptions.NoSuchKey):
                return None
            raise

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
        return self._bytes(name).decode()

    def _bytes(self, name: str) -> bytes:
        """A file of the log."""
        if self._folder is not None:
            return (self._folder / name).read_bytes()
        answer = self._s3.get_object(Bucket=self._bucket, Key=self._prefix + name)
        return answer["Body"].read()


# Commit files are written once, but a table can be dropped and made again at the same path:
# a cached commit is used only while its file's listing stamp (mtime and size, or S3 ETag) is
# the one it was read with.
_READ: dict[tuple[str, str], tuple[Any, Commit]] = {}


# The same for the metaData and protocol actions of a table's newest checkpoint read (an older
# one is not read again once a newer one exists).
_CHECKPOINTS: dict[str, tuple[Any, tuple[dict, dict]]] = {}


def _parse(version: int, text: str) -> Commit:
    """The commit's commitInfo, its metaData and protocol actions, and its file actions."""
    info: dict[str, Any] | None = None
    meta = protocol = None
    cdc: list[FileAction] = []
    added: list[FileAction] = []
    removes = 0
    for line in text.splitlines():
        if not line.strip():
            continue
        for kind, action in json.loads(line).items():
            if kind == "commitInfo" and info is None:
                info = action or {}
            elif kind == "metaData":
                meta = action
            elif kind == "protocol":
                protocol = action
            elif kind == "cdc":
                cdc.append(_file_action(action))
            # dataChange is required; one without it is taken to change data, as the safe side.
            elif kind == "add" and action.get("dataChange", True):
                added.append(_file_action(action))
            elif kind == "remove" and action.get("dataChange", True):
                removes += 1
    info = info or {}
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
        metadata_action=meta,
        protocol_action=protocol,
        cdc_files=tuple(cdc),
        added_files=tuple(added),
        data_removes=removes,
    )


def _file_action(action: dict[str, Any]) -> FileAction:
    return FileAction(
        path=action["path"],
        partition_values=dict(action.get("partitionValues") or {}),
        size=action.get("size"),
        deletion_vector=action.get("deletionVector") is not None,
    )


def _checkpoints(names) -> dict[int, tuple[str, ...] | None]:
    """The complete checkpoints among the log's files: version -> the Parquet files to read (a
    classic one where a version has both kinds), or None where a version has only a v2 one.
    A multi-part checkpoint with a part missing is not one (a writer may still be at it). Taken
    from the listing, not `_last_checkpoint`: Delta reads that only as where to start listing,
    and the ledger lists the whole folder anyway."""
    classic: dict[int, tuple[str, ...]] = {}
    parts: dict[tuple[int, int], set[int]] = {}
    found: dict[int, tuple[str, ...] | None] = {}
    for name in names:
        if m := _CHECKPOINT_FILE.match(name):
            if m[2] is None:
                classic[int(m[1])] = (name,)
            else:
                parts.setdefault((int(m[1]), int(m[3])), set()).add(int(m[2]))
        elif m := _V2_CHECKPOINT_FILE.match(name):
            found[int(m[1])] = None
    for (version, count), seen in parts.items():
        if seen == set(range(1, count + 1)):
            found[version] = tuple(
                f"{version:020d}.checkpoint.{i:010d}.{count:010d}.parquet"
                for i in range(1, count + 1)
            )
    found.update(classic)
    return found


def _table_metadata(version: int, meta: dict, protocol: dict) -> TableMetadata | None:
    """The metadata from a metaData and a protocol action, as a commit (JSON) or a checkpoint
    (Parquet: maps as lists of pairs) holds them; None for actions not as Delta writes them."""
    try:
        return TableMetadata(
            version=version,
            id=meta["id"],
            schema=json.loads(meta["schemaString"]),
            partition_columns=tuple(meta.get("partitionColumns") or ()),
            configuration=dict(meta.get("configuration") or {}),
            protocol=Protocol(
                min_reader_version=int(protocol["minReaderVersion"]),
                min_writer_version=int(protocol["minWriterVersion"]),
                reader_features=tuple(protocol.get("readerFeatures") or ()),
                writer_features=tuple(protocol.get("writerFeatures") or ()),
            ),
        )
    except (KeyError, TypeError, ValueError):
        return None


# A catalog or commit coordinator holds the newest commits of such a table; the log's folder
# may not have them yet.
_MANAGED_FEATURES = frozenset(
    {"catalogManaged", "catalogOwned-preview", "coordinatedCommits-preview"}
)
_COORDINATOR = "delta.coordinatedCommits.commitCoordinator-preview"


def _catalog_managed(table: TableMetadata) -> bool:
    features = {*table.protocol.reader_features, *table.protocol.writer_features}
    return bool(features & _MANAGED_FEATURES) or _COORDINATOR in table.configuration


# Reader features that change nothing in how a file's rows are read by name here (column
# mapping only in mode none, checked apart; deletion vectors only on files not read).
_READABLE_FEATURES = frozenset(
    {
        "deletionVectors",
        "columnMapping",
        "timestampNtz",
        "typeWidening",
        "typeWidening-preview",
        "v2Checkpoint",
        "vacuumProtocolCheck",
    }
)


def _plain_files(table: TableMetadata) -> bool:
    """Whether the table's data files are read by column name with nothing else to apply."""
    protocol = table.protocol
    mode = str(table.configuration.get("delta.columnMapping.mode", "none")).lower()
    return (
        mode == "none"
        and protocol.min_reader_version <= 3
        and set(protocol.reader_features) <= _READABLE_FEATURES
    )


def _changed_no_rows(commit: Commit) -> bool:
    """A MERGE whose metrics say it changed no row: Delta's change feed reports none for it,
    whatever files it wrote (CDCReader.shouldSkipFileActionsInCommit)."""
    metrics = ("numTargetRowsInserted", "numTargetRowsUpdated", "numTargetRowsDeleted")
    return commit.operation == "MERGE" and all(commit.metrics.get(m) == "0" for m in metrics)


# How Spark's Parquet files hold a column of each Delta primitive type, as Arrow reads it back.
_ARROW_TYPES = {
    "string": pa.string(),
    "long": pa.int64(),
    "integer": pa.int32(),
    "short": pa.int16(),
    "byte": pa.int8(),
    "float": pa.float32(),
    "double": pa.float64(),
    "boolean": pa.bool_(),
    "binary": pa.binary(),
    "date": pa.date32(),
    # An instant, stored in UTC; timestamp_ntz is a wall-clock time.
    "timestamp": pa.timestamp("us", tz="UTC"),
    "timestamp_ntz": pa.timestamp("us"),
}
_DECIMAL = re.compile(r"^decimal\((\d+),\s*(\d+)\)$")


def _arrow_type(delta_type: Any) -> pa.DataType | None:
    """The Arrow type of a Delta schema type; None for a nested one (read as the file holds it)
    and for a primitive not known here."""
    if not isinstance(delta_type, str):
        return None
    if m := _DECIMAL.match(delta_type):
        return pa.decimal128(int(m[1]), int(m[2]))
    return _ARROW_TYPES.get(delta_type)


def _file_location(table: str, path: str) -> tuple[str | None, str] | None:
    """Where a file the log names is: (bucket, key) on S3, (None, path) on local disk; None
    for a URI of another filesystem. The log's paths are URIs, relative to the table's root or
    absolute, URL-encoded."""
    root, uri = urlparse(table), urlparse(path)
    on_s3 = root.scheme in ("s3", "s3a")
    if not uri.scheme:
        relative = unquote(path)
        if on_s3:
            return root.netloc, f"{root.path.strip('/')}/{relative}".lstrip("/")
        return None, os.path.join(table, relative)
    if uri.scheme in ("s3", "s3a", "s3n") and on_s3:
        return uri.netloc, unquote(uri.path).lstrip("/")
    if uri.scheme == "file" and not on_s3:
        return None, unquote(uri.path)
    return None
