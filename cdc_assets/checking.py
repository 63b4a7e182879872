"""What a mirror's run asks of its checks, stated where the run is; implemented in checks/.

The run (`hour_run.run_hour`), the fleet and the asset factory receive a `MirrorChecks` and call
it; they import nothing of checks/. So the packages depend one way (tests/test_layers.py):
resources <- cdc_assets <- checks <- sensors, shop_analytics <- the code locations
(code_location, emr), where a mirror's assets get their checks
(`checks.table_checks.MIRROR_CHECKS`).

The run calls the audit before its MERGE (the hard expectations hold failing changes back, into
the error table) and the validation after it (the other expectations, on the hour's newest change
per key); the asset then evaluates every check of the hour from the run's `HourResult`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import dagster as dg
    import pyarrow as pa
    from pyspark.sql import DataFrame, SparkSession

    from cdc_assets.config import TableSpec
    from cdc_assets.results import HourResult, KeyCounts


class AuditVerdict(Protocol):
    """What the run takes from the audit of an hour's changes."""

    # (kafka partition, kafka offset) -> error-table reason: the changes to hold back.
    @property
    def failed(self) -> Mapping[tuple[int, int], str]: ...

    # The changes held back, per error-table reason.
    @property
    def reasons(self) -> Mapping[str, int]: ...


class MirrorChecks(Protocol):
    """The checks of a mirror: called by the run (audit, validate) and by the asset."""

    def preload(self) -> None:
        """Imports what evaluating the checks needs (called while the Spark session starts)."""

    def audit(
        self, spark: SparkSession, spec: TableSpec, changes: pa.Table | DataFrame
    ) -> AuditVerdict | None:
        """The hard expectations on the hour's decoded, applicable changes; None: none declared.
        Changes in memory (a pyarrow Table) are judged without a Spark query."""

    def audit_nothing(self, spec: TableSpec) -> AuditVerdict | None:
        """The hard expectations' verdict on an hour without changes."""

    def validate(
        self,
        spark: SparkSession,
        spec: TableSpec,
        path: str,
        version: int | None,
        rows: pa.Table | DataFrame,
        keys: KeyCounts,
        frame: DataFrame | None = None,
    ) -> Sequence[object]:
        """The other expectations, on `rows` (the hour's newest live change per key) and the
        mirror at `version`; kept in `HourResult.expectations` for `evaluate`. Rows in memory
        (a pyarrow Table) are judged without a Spark query, but a declared `unique` (one query
        of the mirror) takes the hour's values from `frame`, a DataFrame of the same rows."""

    def validate_nothing(self, spec: TableSpec) -> Sequence[object]:
        """The other expectations' verdicts on an hour without changes."""

    def check_specs(
        self, spec: TableSpec, *, partitions_def: dg.PartitionsDefinition
    ) -> list[dg.AssetCheckSpec]:
        """The checks every run of `spec`'s mirror evaluates, in `evaluate`'s order."""

    def evaluate(
        self, *, spark: SparkSession, spec: TableSpec, path: str, result: HourResult
    ) -> list[dg.AssetCheckResult]:
        """The results of `check_specs` for one hour's run."""
