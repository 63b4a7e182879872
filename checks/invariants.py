"""The pipeline's own invariants as asset checks, evaluated on every hour a run materializes.

accounting (I2): every message consumed from the hour's slice is applied, superseded (an older
change of the same key in the slice), stale (not newer than the mirror's row), a tombstone
marker, or an error; no category is negative; and no more messages were read than the slice
holds (fewer only where Kafka has offset gaps: transaction markers, compaction).
"""

from __future__ import annotations

import dagster as dg

from cdc_assets.hour_run import HourResult

ACCOUNTING = "accounting"


def invariant_check_specs(
    *, asset_key: dg.AssetKey, partitions_def: dg.PartitionsDefinition
) -> list[dg.AssetCheckSpec]:
    return [
        dg.AssetCheckSpec(
            ACCOUNTING,
            asset=asset_key,
            partitions_def=partitions_def,
            blocking=True,
            description=(
                "Every consumed message is applied, superseded, stale, a tombstone or an error "
                "(I2)."
            ),
        )
    ]


def accounting_result(result: HourResult) -> dg.AssetCheckResult:
    counts = result.counts
    parts = {
        "applied": counts.applied,
        "superseded": counts.superseded,
        "stale": counts.stale,
        "tombstones": counts.tombstones,
        "errors": counts.errors,
    }
    negative = sorted(name for name, value in parts.items() if value < 0)
    accounted = sum(parts.values())
    gaps = result.slice.size - counts.consumed
    problems = []
    if accounted != counts.consumed:
        problems.append(f"consumed {counts.consumed} but accounted for {accounted}")
    if negative:
        problems.append(f"negative counts: {', '.join(negative)}")
    if gaps < 0:
        problems.append(f"read {counts.consumed} messages from a slice of {result.slice.size}")
    return dg.AssetCheckResult(
        check_name=ACCOUNTING,
        passed=not problems,
        description="; ".join(problems) or None,
        metadata={
            "consumed": counts.consumed,
            "accounted": accounted,
            **parts,
            "slice_offsets": result.slice.size,
            "offset_gaps": gaps,
        },
    )
