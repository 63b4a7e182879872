"""The mirror assets whose hours run outside Dagster: the partition job, through Dagster Pipes.

`build_pipes_mirror_assets(specs)` builds the same assets as
`cdc_assets.factory.build_mirror_assets` (one builder) with another runner (`PIPES`): for each
hour of each selected table it starts the partition job, `emr/pipes_job.py`, through the
`pipes_client` resource, as `pipes_launch` says (`SparkSubmitLaunch`, `EMRServerlessLaunch` or
`EMRClusterLaunch`), and records what the job reported through Pipes: the hour's
materialization metadata and check results, exactly as the in-process run records its own. One
job per hour, each its own Pipes session: Pipes reports one materialization per session.

Secrets never go in the extras (they travel in plain text); the job reads them from its own
environment. The clients, the transports and one run: docs/emr.md, 'The pieces'.
"""

import copy
import os
import sys
import time
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import dagster as dg
import pyspark
from pydantic import Field

from cdc_assets.config import TableSpec
from cdc_assets.factory import (
    NOT_RETRIED,
    HourRunConfig,
    MirrorRunner,
    MirrorsRun,
    TableFailure,
    build_mirror_assets,
    hour_failure,
    tables_failure,
)
from cdc_assets.reporting import HourReport, report_done_hours, report_hours
from checks.table_checks import MIRROR_CHECKS
from resources.kafka import KafkaResource
from resources.lake import LakeResource
from resources.masking import MaskingKeyError
from resources.spark import DEFAULT_JARS_DIR, REPO_ROOT, SparkResource

JOB_SCRIPT = Path(__file__).with_name("pipes_job.py")

# The Pipes extras the job reads (emr/pipes_job.py).
EXTRA_TABLE = "cdc_table"  # the TableSpec, as JSON
EXTRA_HOUR = "cdc_hour"  # the hour key, e.g. 2026-11-04-08:00
EXTRA_FORCE_OPEN_HOUR = "cdc_force_open_hour"
EXTRA_KAFKA = "cdc_kafka"  # KafkaResource settings, secrets left out
EXTRA_LAKE_ROOT = "cdc_lake_root"
# The custom message carrying the check results' descriptions: `report_asset_check` has no
# description parameter, and the descriptions say what a check found.
CHECK_DESCRIPTIONS = "cdc_check_descriptions"

# KafkaResource fields never put into the extras; the job reads them from its environment.
KAFKA_SECRET_FIELDS = frozenset({"sasl_password"})

PIPES_CLOSED_WITH_EXCEPTION = "[pipes] external process pipes closed with exception"


def _not_retried_names() -> frozenset[str]:
    """Class names of the job's errors that retrying can't fix (as the in-process asset)."""
    names: set[str] = set()
    pending: list[type] = [*NOT_RETRIED, MaskingKeyError]
    while pending:
        cls = pending.pop()
        names.add(cls.__name__)
        pending += cls.__subclasses__()
    return frozenset(names)


NOT_RETRIED_NAMES = _not_retried_names()


def kafka_extras(kafka: KafkaResource) -> dict[str, Any]:
    """The Kafka settings the job gets in the extras: every field but the secrets."""
    return {
        name: getattr(kafka, name)
        for name in KafkaResource.model_fields
        if name not in KAFKA_SECRET_FIELDS and getattr(kafka, name) is not None
    }


# ---- metadata over Pipes (the job's side uses these too)

_PIPES_TYPES: dict[type, str] = {
    dg.TextMetadataValue: "text",
    dg.IntMetadataValue: "int",
    dg.FloatMetadataValue: "float",
    dg.BoolMetadataValue: "bool",
    dg.JsonMetadataValue: "json",
    dg.PathMetadataValue: "path",
    dg.UrlMetadataValue: "url",
    dg.MarkdownMetadataValue: "md",
    dg.NotebookMetadataValue: "notebook",
    dg.TimestampMetadataValue: "timestamp",
    dg.NullMetadataValue: "null",
}


def to_pipes_metadata(metadata: Mapping[str, dg.MetadataValue]) -> dict[str, dict[str, Any]]:
    """Typed metadata as Pipes carries it, so Dagster records the same types (the UI plots ints
    and floats, links paths, renders timestamps). A type Pipes can't carry fails loudly."""
    out = {}
    for key, value in metadata.items():
        kind = _PIPES_TYPES.get(type(value))
        if kind is None:
            raise TypeError(
                f"metadata '{key}' is a {type(value).__name__}, which Pipes can't carry; add it "
                "to emr.assets._PIPES_TYPES with its Pipes type"
            )
        out[key] = {"type": kind, "raw_value": None if kind == "null" else value.value}
    return out


# ---- how each client starts the job


class PipesLaunch(dg.ConfigurableResource):
    """How the `pipes_client` resource starts the partition job for one hour of one table."""

    def run_kwargs(self, *, spec: TableSpec, hour_key: str) -> dict[str, Any]:
        """The arguments of the client's `run`, besides `context` and `extras`."""
        raise NotImplementedError


def _no_whitespace(values: Mapping[str, str] | list[str], where: str) -> None:
    items = values.items() if isinstance(values, Mapping) else enumerate(values)
    for key, value in items:
        if any(c.isspace() for c in f"{key}{value}"):
            raise ValueError(
                f"{where}: '{key}={value}' contains whitespace, which EMR's spark-submit "
                "parameters can't carry; drop it or set it on the application"
            )


class SparkSubmitLaunch(PipesLaunch):
    """For `PipesSubprocessClient`: `spark-submit emr/pipes_job.py` on this machine.

    The job's Spark is set up as the in-process `SparkResource` sets up its session (the
    project's jars from pom.xml, Delta, UTC, ...), handed to spark-submit as `--conf`; the
    driver and the Python workers run this interpreter, which has the project installed.
    """

    spark_submit: str = Field(
        default=str(Path(pyspark.__file__).parent / "bin" / "spark-submit"),
        description="spark-submit of the Spark to run on (default: pyspark's own).",
    )
    master: str = "local[*]"
    driver_memory: str = "2g"
    shuffle_partitions: int = 8
    jars_dir: str = Field(default=str(DEFAULT_JARS_DIR), description="Folder of jars for Spark.")
    conf: dict[str, str] = Field(default_factory=dict, description="Other Spark conf.")
    python_executable: str = Field(
        default=sys.executable, description="Python of the driver and of Spark's Python workers."
    )

    def command(self) -> list[str]:
        spark = SparkResource(
            master=self.master,
            app_name="cdc-lake-pipes-job",
            driver_memory=self.driver_memory,
            shuffle_partitions=self.shuffle_partitions,
            jars_dir=self.jars_dir,
            extra_conf=self.conf,
            # The driver runs where spark-submit puts it, not on this host's class archive.
            jvm_archive_dir=None,
        )
        command = [self.spark_submit]
        for key, value in spark.spark_config().items():
            command += ["--conf", f"{key}={value}"]
        return [*command, str(JOB_SCRIPT)]

    def run_kwargs(self, *, spec: TableSpec, hour_key: str) -> dict[str, Any]:
        python_path = os.pathsep.join(
            p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p
        )
        return {
            "command": self.command(),
            "env": {
                "PYSPARK_PYTHON": self.python_executable,
                "PYSPARK_DRIVER_PYTHON": self.python_executable,
                "PYTHONPATH": python_path,
            },
        }


# The packed virtualenv (venv-pack), unpacked by Spark into each container as ./environment.
VENV_PYTHON = "./environment/bin/python"
JOB_ARTIFACT = "pipes_job.py"
VENV_ARTIFACT = "cdc_lake_venv.tar.gz"


class EMRArtifacts(PipesLaunch):
    """Where the job's artifacts are: `artifacts_uri` holds `pipes_job.py` (the entry point),
    `cdc_lake_venv.tar.gz` (the project and its Python dependencies, packed by venv-pack) and
    `jars/` (see docs/emr.md)."""

    artifacts_uri: str = Field(description="s3://bucket/prefix the artifacts are uploaded to.")
    jars: list[str] = Field(
        default_factory=list,
        description=(
            "Jars for --jars: file names under <artifacts_uri>/jars/, or full URIs (s3://..., "
            "local:/usr/share/...) used as they are. They must match the cluster's Spark."
        ),
    )
    spark_conf: dict[str, str] = Field(default_factory=dict, description="Other Spark conf.")

    @property
    def entry_point(self) -> str:
        return f"{self.artifacts_uri.rstrip('/')}/{JOB_ARTIFACT}"

    @property
    def venv_archive(self) -> str:
        return f"{self.artifacts_uri.rstrip('/')}/{VENV_ARTIFACT}"

    def jar_uris(self) -> list[str]:
        base = self.artifacts_uri.rstrip("/")
        return [jar if ":" in jar else f"{base}/jars/{jar}" for jar in self.jars]


class EMRServerlessLaunch(EMRArtifacts):
    """For `PipesEMRServerlessClient`: a job run on an EMR Serverless application.

    The client adds the Pipes bootstrap variables as `spark.emr-serverless.driverEnv.*` and reads
    the job's messages from its driver's stdout in CloudWatch Logs, which this launch turns on.
    """

    application_id: str = Field(description="The EMR Serverless application (type SPARK).")
    execution_role_arn: str = Field(description="The job runtime role.")
    driver_env: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "Environment of the driver. No secrets: they would show in the job run's "
            "configuration; use `secret_env`."
        ),
    )
    secret_env: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "Environment variable -> AWS Secrets Manager secret id (e.g. CDC_KAFKA_SASL_PASSWORD, "
            "CDC_MASKING_KEY). Set as `EMR.secret@<id>` driver environment in the job's "
            "spark-defaults: EMR Serverless resolves it when the job runs, so the value is in no "
            "API response. The runtime role needs secretsmanager:GetSecretValue on it."
        ),
    )
    log_group: str = "/aws/emr-serverless"
    execution_timeout_minutes: int = 120

    def spark_submit_parameters(self) -> str:
        conf = {
            "spark.archives": f"{self.venv_archive}#environment",
            "spark.emr-serverless.driverEnv.PYSPARK_DRIVER_PYTHON": VENV_PYTHON,
            "spark.emr-serverless.driverEnv.PYSPARK_PYTHON": VENV_PYTHON,
            "spark.emr-serverless.executorEnv.PYSPARK_PYTHON": VENV_PYTHON,
            **{f"spark.emr-serverless.driverEnv.{k}": v for k, v in self.driver_env.items()},
            **self.spark_conf,
        }
        jars = self.jar_uris()
        _no_whitespace(conf, "EMRServerlessLaunch")
        _no_whitespace(jars, "EMRServerlessLaunch.jars")
        parameters = [f"--conf {key}={value}" for key, value in conf.items()]
        if jars:
            parameters.append(f"--jars {','.join(jars)}")
        return " ".join(parameters)

    def run_kwargs(self, *, spec: TableSpec, hour_key: str) -> dict[str, Any]:
        return {
            "start_job_run_params": {
                "applicationId": self.application_id,
                "executionRoleArn": self.execution_role_arn,
                "name": f"cdc-lake {spec.name} {hour_key}",
                "executionTimeoutMinutes": self.execution_timeout_minutes,
                "jobDriver": {
                    "sparkSubmit": {
                        "entryPoint": self.entry_point,
                        "sparkSubmitParameters": self.spark_submit_parameters(),
                    }
                },
                # The client reads the job's Pipes messages from the driver's stdout stream in
                # CloudWatch Logs; without this it warns and receives nothing. No `logTypes`:
                # dagster-aws 0.29.27 compares them in lower case with the upper-case values
                # EMR takes, and would then forward neither stdout nor stderr.
                "configurationOverrides": {
                    "monitoringConfiguration": {
                        "cloudWatchLoggingConfiguration": {
                            "enabled": True,
                            "logGroupName": self.log_group,
                        }
                    },
                    **self._secret_configuration(),
                },
            }
        }

    def _secret_configuration(self) -> dict[str, Any]:
        if not self.secret_env:
            return {}
        properties = {
            f"spark.emr-serverless.driverEnv.{var}": f"EMR.secret@{secret_id}"
            for var, secret_id in self.secret_env.items()
        }
        return {
            "applicationConfiguration": [
                {"classification": "spark-defaults", "properties": properties}
            ]
        }


class EMRClusterLaunch(EMRArtifacts):
    """For `PipesEMRClient` (EMR on EC2): a transient cluster per hour, the job its one step.

    `PipesEMRClient` starts a cluster with `run_job_flow` and waits until it terminated. Give it
    a `PipesS3MessageReader`: the job then writes its messages to that bucket. Don't put
    spark-defaults, spark-env, yarn-env or hadoop-env `Configurations` into `run_job_flow`:
    dagster-aws 0.29.27 merges its own (the Pipes bootstrap variables) into an existing
    classification by dropping them.
    """

    release_label: str = Field(description="The EMR release, e.g. emr-spark-8.0.0.")
    log_uri: str = Field(description="s3://... for the cluster's logs.")
    job_flow_role: str = "EMR_EC2_DefaultRole"
    service_role: str = "EMR_DefaultRole"
    subnet_id: str | None = None
    instance_type: str = "m5.xlarge"
    core_instances: int = 1
    run_job_flow: dict[str, Any] = Field(
        default_factory=dict,
        description="Other run_job_flow parameters (Tags, SecurityConfiguration, ...).",
    )
    driver_env: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "Environment of the driver (YARN AM). No secrets: step arguments show in the EMR "
            "API and console. Secrets are not wired for EMR on EC2 (docs/emr.md)."
        ),
    )

    def step_args(self) -> list[str]:
        conf = {
            "spark.archives": f"{self.venv_archive}#environment",
            "spark.yarn.appMasterEnv.PYSPARK_PYTHON": VENV_PYTHON,
            "spark.executorEnv.PYSPARK_PYTHON": VENV_PYTHON,
            **{f"spark.yarn.appMasterEnv.{k}": v for k, v in self.driver_env.items()},
            **self.spark_conf,
        }
        args = ["spark-submit", "--deploy-mode", "cluster"]
        for key, value in conf.items():
            args += ["--conf", f"{key}={value}"]
        if self.jars:
            args += ["--jars", ",".join(self.jar_uris())]
        return [*args, self.entry_point]

    def run_kwargs(self, *, spec: TableSpec, hour_key: str) -> dict[str, Any]:
        name = f"cdc-lake {spec.name} {hour_key}"
        instances: dict[str, Any] = {
            "InstanceGroups": [
                {"InstanceRole": "MASTER", "InstanceType": self.instance_type, "InstanceCount": 1},
                {
                    "InstanceRole": "CORE",
                    "InstanceType": self.instance_type,
                    "InstanceCount": self.core_instances,
                },
            ],
            # The client waits for the cluster to terminate: it must end with its step.
            "KeepJobFlowAliveWhenNoSteps": False,
        }
        if self.subnet_id:
            instances["Ec2SubnetId"] = self.subnet_id
        params = {
            **copy.deepcopy(self.run_job_flow),
            "Name": name,
            "ReleaseLabel": self.release_label,
            "LogUri": self.log_uri,
            "JobFlowRole": self.job_flow_role,
            "ServiceRole": self.service_role,
            "Applications": [{"Name": "Spark"}],
            "Instances": instances,
            "Steps": [
                {
                    "Name": name,
                    "ActionOnFailure": "TERMINATE_CLUSTER",
                    "HadoopJarStep": {"Jar": "command-runner.jar", "Args": self.step_args()},
                }
            ],
        }
        return {"run_job_flow_params": params}


# ---- the asset


def _run_through_pipes(context: dg.AssetExecutionContext, run: MirrorsRun) -> Iterator:
    """Each selected table's hours, one partition job after the other. A table whose job fails
    keeps the hours before it and the run goes on with the next table; the run then fails,
    naming each failed table (retried when retrying can help one of them; a retry skips what
    is done), as the in-process run does."""
    failures: list[TableFailure] = []
    for spec, hour_keys in run.work:
        check_specs = run.check_specs[spec.name]
        reports: list[HourReport] = []
        try:
            for hour_key in hour_keys:
                reports.append(
                    _run_job(context, spec, hour_key, run.config, check_specs, done=reports)
                )
        except Exception as exc:
            failure = _table_failure(spec, hour_keys[len(reports)], exc, reports)
            context.log.error(f"{spec.name} {failure.hour_key}: {failure.reason}")
            failures.append(failure)
            yield from report_done_hours(context, spec, check_specs, reports)
            continue
        yield from report_hours(context, spec, check_specs, reports)
    if failures:
        raise tables_failure(failures, total=len(run.work))


def _table_failure(
    spec: TableSpec, hour_key: str, exc: Exception, done: list[HourReport]
) -> TableFailure:
    """A failed job as the run's failure names it: a Failure's description (the job's own
    error), else the exception; retried unless the Failure says retrying can't help."""
    if isinstance(exc, dg.Failure):
        reason, retriable = exc.description or "", exc.allow_retries
    else:
        reason, retriable = f"{type(exc).__name__}: {exc}", True
    return TableFailure(spec.name, hour_key, reason, [r.hour_key for r in done], retriable)


PIPES = MirrorRunner(
    run=_run_through_pipes,
    # No `masking`: the job reads its key from its own environment.
    resources=lambda specs: {"pipes_client", "pipes_launch", "kafka", "lake"},
    note=" Each hour runs as the partition job (emr/pipes_job.py) through Dagster Pipes.",
)


def build_pipes_mirror_assets(specs: list[TableSpec]) -> list[dg.AssetsDefinition]:
    """The mirrors of `specs`, each hour materialized by the partition job through Pipes: the
    same assets as in-process (`cdc_assets.factory.build_mirror_assets`), another runner."""
    return build_mirror_assets(specs, checks=MIRROR_CHECKS, runner=PIPES)


def _run_job(
    context: dg.AssetExecutionContext,
    spec: TableSpec,
    hour_key: str,
    config: HourRunConfig,
    check_specs: list[dg.AssetCheckSpec],
    *,
    done: list[HourReport],
) -> HourReport:
    """One table-hour as the partition job; its report is what the job sent through Pipes."""
    invocation = _start_job(context, spec, hour_key, config, done=done)
    results = invocation.get_results(implicit_materializations=False)
    materializations = [r for r in results if isinstance(r, dg.MaterializeResult)]
    reported = {r.check_name: r for r in results if isinstance(r, dg.AssetCheckResult)}
    missing = [s.name for s in check_specs if s.name not in reported]
    if len(materializations) != 1 or missing:
        raise dg.Failure(
            description=(
                f"the partition job of {spec.name} {hour_key} ended without reporting "
                + ("its materialization" if len(materializations) != 1 else f"checks {missing}")
                + " through Pipes. It may have committed the hour to Delta (a rerun finds its "
                "changes applied). Check the message transport: the client's message reader "
                "and the job's message writer (docs/emr.md)."
            ),
            allow_retries=False,
        )
    checks = _check_results(invocation, reported, check_specs)
    return HourReport(hour_key, materializations[0].metadata or {}, checks)


def _start_job(
    context: dg.AssetExecutionContext,
    spec: TableSpec,
    hour_key: str,
    config: HourRunConfig,
    *,
    done: list[HourReport],
):
    """Runs the job through `pipes_client` with the hour's extras (no secret among them); a
    failure the job reported is raised with its message, not retried when retrying can't help."""
    launch: PipesLaunch = context.resources.pipes_launch
    kafka: KafkaResource = context.resources.kafka
    lake: LakeResource = context.resources.lake
    extras = {
        EXTRA_TABLE: spec.model_dump(mode="json"),
        EXTRA_HOUR: hour_key,
        EXTRA_FORCE_OPEN_HOUR: config.force_open_hour,
        EXTRA_KAFKA: kafka_extras(kafka),
        EXTRA_LAKE_ROOT: lake.root_uri,
    }
    started = time.time()
    try:
        with warnings.catch_warnings():
            # Dagster's Pipes message handler calls a preview API of its own at every session;
            # dagster is pinned, so the warning says nothing new.
            warnings.filterwarnings(
                "ignore", category=dg.PreviewWarning, message=".*expected_writer_count"
            )
            return context.resources.pipes_client.run(
                context=context, extras=extras, **launch.run_kwargs(spec=spec, hour_key=hour_key)
            )
    except Exception as exc:
        error = _job_error(context, since=started)
        if error is None:
            raise  # nothing came back through Pipes: the client's own error says what it knows
        message = f"the partition job of {spec.name} {hour_key} failed: {error.message.strip()}"
        if error.cls_name in NOT_RETRIED_NAMES:
            raise hour_failure(message, [r.hour_key for r in done]) from exc
        raise dg.Failure(description=message) from exc


def _check_results(
    invocation, reported: Mapping[str, dg.AssetCheckResult], check_specs: list[dg.AssetCheckSpec]
) -> list[dg.AssetCheckResult]:
    """The job's check results with their descriptions (sent in a custom message)."""
    descriptions: dict[str, str | None] = {}
    for message in invocation.get_custom_messages():
        if isinstance(message, dict):
            descriptions |= message.get(CHECK_DESCRIPTIONS, {})
    return [
        dg.AssetCheckResult(
            check_name=name,
            passed=reported[name].passed,
            severity=reported[name].severity,
            description=descriptions.get(name),
            # The client's own metadata (e.g. the EMR job run id) stays on the materialization.
            metadata={
                k: v for k, v in reported[name].metadata.items() if k not in invocation.metadata
            },
        )
        for name in (s.name for s in check_specs)
    ]


def _job_error(context: dg.AssetExecutionContext, *, since: float):
    """The exception the job reported through Pipes in this step since `since`, if any."""
    step_key = context.get_step_execution_context().step.key
    found = None
    for entry in context.instance.all_logs(
        context.run_id, of_type=dg.DagsterEventType.ENGINE_EVENT
    ):
        event = entry.dagster_event
        if (
            entry.timestamp >= since
            and entry.step_key == step_key
            and event is not None
            and event.message == PIPES_CLOSED_WITH_EXCEPTION
            and event.engine_event_data.error is not None
        ):
            found = event.engine_event_data.error
    return found
