"""The partition job through Dagster Pipes, as it would run on EMR, but on this machine.

`PipesSubprocessClient` starts the real entry script (emr/pipes_job.py) with pyspark's
own spark-submit on local[1], against the session's real broker, into a local Delta lake. The
hours it materializes (two tables in one run) must equal the reference replay, and Dagster must
record the in-process asset's metadata and checks for them from what came through Pipes. An
hour that is still open must fail the run with the job's own error, not retried, and write
nothing.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime
from pathlib import Path

import dagster as dg
import pytest

from cdc_assets.config import TableSpec
from checks.table_checks import run_check_names
from emr.assets import EMRServerlessLaunch, SparkSubmitLaunch, build_pipes_mirror_assets
from emr.pipes_job import session_conf
from resources.lake import LakeResource
from resources.spark import DEFAULT_JARS_DIR, REQUIRED_SESSION_CONF, SparkResource
from tests.faults import table
from tests.support import diff_rows, mirror_rows, read_records

HOUR = table.hour_key(0)
CHANGES = [
    table.change("c", 1, 10, second=1),
    table.change("c", 2, 11, second=2),
    table.change("c", 3, 12, second=3),
    table.change("u", 1, 13, balance=500, second=4),
    table.change("d", 2, 14, second=5),
    table.tombstone(2, second=6),
    table.change("c", 4, 15, second=7),
    table.change("u", 3, 16, name="renamed", second=8),
]


def _pipes_resources(kafka, lake: LakeResource, tmp_path) -> dict:
    launch = SparkSubmitLaunch(
        master="local[1]",
        driver_memory="512m",
        shuffle_partitions=2,
        conf={
            "spark.local.dir": str(tmp_path / "job-spark-local"),
            # A short-lived JVM: the quick compiler only, which halves its CPU time.
            "spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
        },
    )
    return {
        "pipes_client": dg.PipesSubprocessClient(),
        "pipes_launch": launch,
        "kafka": kafka,
        "lake": lake,
    }


FAILURE = dg.DagsterEventType.STEP_FAILURE
# The keys of the in-process asset's materialization metadata (cdc_assets.reporting.result_metadata)
# for an hour with source timestamps and no lost offsets.
IN_PROCESS_METADATA = {
    "kafka_topic",
    "kafka_offsets",
    "slice_records",
    "consumed",
    "applied",
    "superseded",
    "stale",
    "tombstones",
    "errors",
    "error_reasons",
    "rows_inserted",
    "rows_updated",
    "rows_deleted",
    "rows_counted_from",
    "delta_version",
    "delta_path",
    "partial_hour",
    "lag_seconds",
    "newest_source_ts",
    "freshness_seconds",
}


def _commits(path: str) -> list[int]:
    """The versions in the Delta log of the (local) table at `path`."""
    return sorted(int(f.stem) for f in Path(path, "_delta_log").glob("*.json"))


def _events(result, event_type: dg.DagsterEventType) -> list:
    return [e for e in result.all_events if e.event_type == event_type]


@pytest.mark.integration
def test_an_hour_through_pipes_equals_the_reference_and_an_open_hour_fails(
    broker, kafka, spark, create_topic, tmp_path
):
    topic = create_topic("pipes-accounts", partitions=2)
    spec = table.spec(topic)
    table.send_all(broker, topic, CHANGES)
    # A second table in the same run: one multi-asset, one job per table-hour.
    other_topic = create_topic("pipes-accounts-b", partitions=1)
    other = spec.model_copy(update={"name": "accounts_b", "topic": other_topic})
    table.send_all(broker, other_topic, CHANGES[:3])
    # And first in the run, a table whose job fails: its sequence names a field the records
    # lack (not retried). The run goes on with the others, then fails naming it.
    broken = TableSpec.model_validate(
        {
            **spec.model_dump(),
            "name": "accounts_broken",
            "topic": other_topic,
            "sequence": [{"field": "source.pos"}],
        }
    )
    lake = LakeResource(root=str(tmp_path / "lake"))
    path = lake.table_path(spec.name)

    instance = dg.DagsterInstance.ephemeral()
    through_pipes = dg.materialize(
        build_pipes_mirror_assets([broken, spec, other]),
        partition_key=HOUR,
        instance=instance,
        resources=_pipes_resources(kafka, lake, tmp_path),
        raise_on_error=False,
    )
    (failure,) = _events(through_pipes, FAILURE)
    message = failure.step_failure_data.error.message
    assert "1 of 3 tables failed" in message and "accounts_broken" in message, message
    assert "'sequence' setting" in message, message
    assert not _events(through_pipes, dg.DagsterEventType.STEP_UP_FOR_RETRY)
    materialized = {e.asset_key for e in through_pipes.get_asset_materialization_events()}
    assert materialized == {dg.AssetKey(spec.name), dg.AssetKey(other.name)}

    # The mirror equals the plain-Python replay of what Kafka committed.
    expected = table.reference(broker, spec, upto_hour=0).expected
    assert diff_rows(mirror_rows(path, spec), expected) == {
        "missing": [],
        "unexpected": [],
        "different": [],
    }
    assert sorted(expected) == [(1,), (3,), (4,)]  # 2 deleted
    other_expected = table.reference(broker, other, upto_hour=0).expected
    assert sorted(other_expected) == [(1,), (2,), (3,)]
    assert not any(
        diff_rows(mirror_rows(lake.table_path(other.name), other), other_expected).values()
    )
    commits = _commits(path)

    # What the instance recorded came through Pipes: the in-process asset's metadata, typed as
    # it types them (ints and floats plot, the path links, the time renders).
    (record,) = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey(spec.name), asset_partitions=[HOUR]), limit=5
    ).records
    assert record.run_id == through_pipes.run_id
    recorded = record.asset_materialization.metadata
    assert set(recorded) == IN_PROCESS_METADATA
    per_partition: dict[int, int] = {}
    for partition, *_ in read_records(broker, topic):
        per_partition[partition] = per_partition.get(partition, 0) + 1
    assert recorded["kafka_offsets"] == dg.MetadataValue.json(
        {str(p): {"start": 0, "end": n, "records": n} for p, n in per_partition.items()}
    )
    assert recorded["kafka_topic"] == dg.MetadataValue.text(topic)
    counts = {"consumed": 8, "applied": 4, "superseded": 3, "stale": 0, "tombstones": 1}
    for name, value in {**counts, "errors": 0, "slice_records": 8}.items():
        assert recorded[name] == dg.MetadataValue.int(value), name
    # Ids 1, 3, 4 new live rows, id 2 arriving deleted: a mirror without a change data feed
    # counts what Delta's metrics tell apart, four rows added (docs/checks.md).
    rows = {"rows_inserted": 4, "rows_updated": 0, "rows_deleted": 0}
    for name, value in rows.items():
        assert recorded[name] == dg.MetadataValue.int(value), name
    assert recorded["rows_counted_from"] == dg.MetadataValue.text("merge metrics")
    assert recorded["delta_version"] == dg.MetadataValue.int(max(commits))
    assert recorded["delta_path"] == dg.MetadataValue.path(path)
    assert recorded["partial_hour"] == dg.MetadataValue.bool(False)
    assert recorded["error_reasons"] == dg.MetadataValue.json({})
    assert recorded["newest_source_ts"] == dg.MetadataValue.timestamp(table.stamp(0, 8) / 1000)
    assert isinstance(recorded["lag_seconds"], dg.FloatMetadataValue)

    # Every check of the table, recorded against the hour, passed, with its description and
    # typed metadata.
    evaluations = {
        e.check_name: e
        for e in through_pipes.get_asset_check_evaluations()
        if e.asset_key == dg.AssetKey(spec.name)
    }
    assert set(evaluations) == set(run_check_names(spec))
    for name, evaluation in evaluations.items():
        assert evaluation.passed and evaluation.partition == HOUR, name
    assert "no recorded run" in evaluations["continuity"].description
    accounting = evaluations["accounting"].metadata
    assert accounting["consumed"] == accounting["accounted"] == dg.MetadataValue.int(8)
    freshness = evaluations["freshness"].metadata
    assert freshness["newest_source_ts"] == recorded["newest_source_ts"]
    # The job's log line reached the run's logs through Pipes.
    messages = [e.message or "" for e in instance.all_logs(through_pipes.run_id)]
    assert any(f"accounts {HOUR}: consumed 8, applied 4" in m for m in messages)

    # An hour still open fails the run with the job's own error, and is not retried.
    open_hour = datetime.now(UTC).strftime("%Y-%m-%d-%H:00")
    failed = dg.materialize(
        build_pipes_mirror_assets([spec]),
        partition_key=open_hour,
        instance=instance,
        resources=_pipes_resources(kafka, lake, tmp_path),
        raise_on_error=False,
    )
    assert not failed.success
    (failure,) = _events(failed, FAILURE)
    message = failure.step_failure_data.error.message
    assert f"hour {open_hour} is still open" in message and "force_open_hour" in message
    assert not _events(failed, dg.DagsterEventType.STEP_UP_FOR_RETRY)
    assert not instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey(spec.name), asset_partitions=[open_hour]),
        limit=1,
    ).records
    # Nothing was written: no Delta commit since.
    assert _commits(path) == commits


def test_the_emr_configuration_loads_without_aws_and_ships_the_poms_jars(monkeypatch):
    for name in list(os.environ):
        if name.startswith(("AWS_", "CDC_EMR")):
            monkeypatch.delenv(name)
    from emr import definitions as emr

    defs = emr.defs() if callable(emr.defs) else emr.defs
    keys = {k.to_user_string() for k in defs.resolve_asset_graph().get_all_asset_keys()}
    assert keys == {"customers", "orders", "order_items"}
    # The jars the EMR job is given are the ones pom.xml resolves for the local runs.
    assert sorted(emr.PROJECT_JARS) == sorted(p.name for p in DEFAULT_JARS_DIR.glob("*.jar"))

    launch = EMRServerlessLaunch(
        application_id="00app",
        execution_role_arn="arn:aws:iam::123456789012:role/job",
        artifacts_uri="s3://b/cdc-lake/",
        jars=[*emr.PROJECT_JARS, "local:/usr/share/aws/x.jar"],
        spark_conf=emr.SPARK_CONF,
        secret_env={"CDC_KAFKA_SASL_PASSWORD": "cdc/kafka"},
    )
    params = launch.run_kwargs(spec=table.spec("shop.public.accounts"), hour_key=HOUR)
    params = params["start_job_run_params"]
    assert params["jobDriver"]["sparkSubmit"]["entryPoint"] == "s3://b/cdc-lake/pipes_job.py"
    submit = params["jobDriver"]["sparkSubmit"]["sparkSubmitParameters"].split()
    assert "spark.archives=s3://b/cdc-lake/cdc_lake_venv.tar.gz#environment" in submit
    jars = submit[submit.index("--jars") + 1].split(",")
    assert jars == [
        *(f"s3://b/cdc-lake/jars/{j}" for j in emr.PROJECT_JARS),
        "local:/usr/share/aws/x.jar",
    ]
    overrides = params["configurationOverrides"]
    assert overrides["monitoringConfiguration"]["cloudWatchLoggingConfiguration"]["enabled"]
    (secrets,) = overrides["applicationConfiguration"]
    assert secrets["properties"] == {
        "spark.emr-serverless.driverEnv.CDC_KAFKA_SASL_PASSWORD": "EMR.secret@cdc/kafka"
    }


# What spark-submit and the cluster decide for the job: where and with what its session runs.
LEFT_TO_THE_CLUSTER = {
    "spark.master",
    "spark.app.name",
    "spark.jars",
    "spark.driver.memory",
    "spark.sql.extensions",  # the job adds Delta's to the cluster's
    "spark.ui.enabled",
    "spark.scheduler.mode",
}


def test_the_jobs_session_has_every_setting_sparkresource_gives_its_own(tmp_path):
    # A setting SparkResource adds to spark_config outside session_conf would be missing from
    # the job's session, and an hour on EMR would run differently from one in process.
    jars = tmp_path / "jars"
    jars.mkdir()
    for name in ("delta-spark_4.2_2.13-4.4.0.jar", "spark-sql-kafka-0-10_2.13-4.2.0.jar"):
        (jars / name).touch()
    local = SparkResource(
        jars_dir=str(jars), s3_jars_dir=str(tmp_path / "none"), jvm_archive_dir=None
    ).spark_config()
    on_the_cluster = session_conf({})
    assert on_the_cluster.pop("spark.sql.extensions") == "io.delta.sql.DeltaSparkSessionExtension"
    assert {k: v for k, v in local.items() if k not in LEFT_TO_THE_CLUSTER} == on_the_cluster

    # What the cluster set is kept, but for what the results rest on; Delta joins its extensions.
    submitted = {key: "the cluster's" for key in on_the_cluster}
    conf = session_conf({**submitted, "spark.sql.extensions": "x.Ext"})
    assert conf == {
        **REQUIRED_SESSION_CONF,
        "spark.sql.extensions": "x.Ext,io.delta.sql.DeltaSparkSessionExtension",
    }


def test_the_emr_location_loads_with_a_sensitive_table(monkeypatch):
    """A Pipes job reads the masking key from its own environment: the location asks no
    `masking` resource of Dagster for a table with sensitive columns."""
    for name in list(os.environ):
        if name.startswith(("AWS_", "CDC_EMR")):
            monkeypatch.delenv(name)
    from emr import definitions as emr

    sensitive = table.spec("shop.public.accounts", sensitive={"name": "hash"})
    defs = emr.build_definitions([sensitive], emr.emr_serverless_resources())
    dg.Definitions.validate_loadable(defs)
