"""Many tables' hour in one run of the mirrors' multi-asset, on the real broker, Spark and Delta.

Each table-hour stays its own materialization, check results and Delta commit; tables run in
parallel on sessions of their own; a failing table fails alone. (An empty hour costing no Spark
job: tests/cdc_assets/test_hour_edges.py.)
"""

from __future__ import annotations

import json
from datetime import UTC, datetime

import dagster as dg
import pytest

from cdc_assets.factory import build_mirror_assets
from cdc_assets.ledger import DeltaLog
from checks.table_checks import MIRROR_CHECKS, run_check_names
from resources.spark import SparkResource
from tests.support import accounts_spec, mirror_rows

pytestmark = pytest.mark.integration

HOUR = datetime(2026, 11, 3, 14, tzinfo=UTC)
KEYS = [HOUR.strftime("%Y-%m-%d-%H:%M")]


def _change(row_id: int, lsn: int, balance: str = "1.00") -> bytes:
    row = {"id": row_id, "name": f"n{row_id}", "balance": balance}
    return json.dumps({"op": "c", "before": None, "after": row, "source": {"lsn": lsn}}).encode()


def _ms(moment: datetime) -> int:
    return int(moment.timestamp() * 1000)


def test_tables_of_one_run_each_get_their_hour_and_a_failing_table_fails_alone(
    create_topic, send, kafka, spark_resource, lake, topic_prefix
):
    specs = []
    for n in range(4):
        topic = create_topic(f"{topic_prefix}-fleet-{n}", partitions=2)
        spec = accounts_spec(topic).model_copy(update={"name": f"fleet_{n}"})
        specs.append(spec)
        for row in range(n * 10, n * 10 + 5):
            send(topic, json.dumps({"id": row}).encode(), _change(row, row + 1), _ms(HOUR) + row)
    # A table whose topic does not exist: its hour fails, naming the fix; the others don't.
    missing = accounts_spec(f"{topic_prefix}-nowhere").model_copy(update={"name": "fleet_gone"})
    assets = build_mirror_assets([*specs, missing], checks=MIRROR_CHECKS)
    assert len(assets) == 1  # one multi-asset: the same first hour
    resources = {
        "kafka": kafka,
        "spark": SparkResource(**{**spark_resource.model_dump(), "parallel_tables": 3}),
        "lake": lake,
    }
    run = dg.materialize(assets, partition_key=KEYS[0], resources=resources, raise_on_error=False)

    assert not run.success
    failure = run.get_step_failure_events()[0].step_failure_data.user_failure_data.description
    assert "1 of 5 tables failed" in failure and "fleet_gone" in failure
    assert f"topic '{topic_prefix}-nowhere' does not exist" in failure
    materialized = {m.asset_key.to_user_string(): m for m in run.get_asset_materialization_events()}
    assert sorted(materialized) == [spec.name for spec in specs]
    evaluations = run.get_asset_check_evaluations()
    for spec in specs:
        path = lake.table_path(spec.name)
        # Its own rows, its own checks, its own commit carrying its own slice.
        n = int(spec.name.rsplit("_", 1)[1])
        assert sorted(mirror_rows(path, spec)) == [(row,) for row in range(n * 10, n * 10 + 5)]
        mine = {e.check_name: e.passed for e in evaluations if e.asset_key.path == [spec.name]}
        assert sorted(mine) == sorted(run_check_names(spec)) and all(mine.values()), mine
        metadata = materialized[spec.name].event_specific_data.materialization.metadata
        assert metadata["applied"].value == 5 and metadata["consumed"].value == 5
        (commit,) = [c for c in DeltaLog(path).hour_history()[1] if c["hour"] == KEYS[0]]
        assert commit["slice"]["topic"] == spec.topic
    assert not [e for e in evaluations if e.asset_key.path == ["fleet_gone"]]
