"""The consumer lag of each mirror, recorded by the offset sensor as an asset observation:
committed messages the mirror has not read, and how many seconds the newest of them is ahead
of the mirror (the end of its newest materialized hour).
"""

from __future__ import annotations

from datetime import datetime

import dagster as dg

from cdc_assets.config import TableSpec
from cdc_assets.hours import hour_start
from sensors.cursor import FleetCursor
from sensors.hours import HOUR, from_ms
from sensors.topic_reads import TopicProgress

# A table's lag is observed when its count of unread messages changes, and at least this often.
LAG_OBSERVATION_SECONDS = 300


def consumer_lag(
    progress: TopicProgress, mirrored: tuple[datetime, dict[int, int]] | None
) -> dict[str, dg.MetadataValue]:
    """Messages the mirror has not read, and how far the newest one is ahead of the mirror.

    `mirrored`: (end of the newest materialized hour, its end offsets), or None.
    """
    until, ends = mirrored if mirrored else (None, {})
    behind = {
        p: max(progress.stable_ends[p] - ends.get(p, progress.log_starts[p]), 0)
        for p in progress.partitions
    }
    newest = max(progress.newest_ms.values(), default=None)
    seconds = 0.0
    if sum(behind.values()) and newest is not None:
        reference = until or from_ms(min(progress.newest_ms.values()))
        seconds = max((from_ms(newest) - reference).total_seconds(), 0.0)
    metadata = {
        "lag_messages": dg.MetadataValue.int(sum(behind.values())),
        "lag_seconds": dg.MetadataValue.float(round(seconds, 3)),
        "lag_messages_by_partition": dg.MetadataValue.json({str(p): n for p, n in behind.items()}),
    }
    if until is not None:
        metadata["mirrored_until"] = dg.MetadataValue.timestamp(until)
    return metadata


def lag_if_due(
    context: dg.SensorEvaluationContext,
    spec: TableSpec,
    progress: TopicProgress,
    cursor: FleetCursor,
    now: datetime,
) -> dg.AssetObservation | None:
    """The table's lag observation, when its unread count changed or the last one is old."""
    unread = sum(progress.stable_ends.values()) - sum(progress.log_starts.values())
    last = cursor.lag.get(spec.name)
    if (
        last is not None
        and last[0] == unread
        and now.timestamp() - last[1] < LAG_OBSERVATION_SECONDS
    ):
        return None
    cursor.lag[spec.name] = [unread, round(now.timestamp())]
    return _lag_observation(context, dg.AssetKey(spec.name), progress)


def _lag_observation(
    context: dg.SensorEvaluationContext, asset_key: dg.AssetKey, progress: TopicProgress
) -> dg.AssetObservation:
    # The newest hour among the recent materializations (a rerun of an old hour is not it).
    records = context.instance.fetch_materializations(asset_key, limit=50).records
    materializations = [
        r.asset_materialization
        for r in records
        if r.asset_materialization.partition and "kafka_offsets" in r.asset_materialization.metadata
    ]
    mirrored = None
    if materializations:
        newest = max(materializations, key=lambda m: m.partition)
        mirrored = (
            hour_start(newest.partition) + HOUR,
            {int(p): o["end"] for p, o in newest.metadata["kafka_offsets"].value.items()},
        )
    return dg.AssetObservation(asset_key=asset_key, metadata=consumer_lag(progress, mirrored))
