"""The partition job: one hour of one mirror, run outside Dagster and reported through Pipes.

    spark-submit [--jars ...] emr/pipes_job.py

Dagster starts it through a Pipes client (`emr/assets.py`). It opens the Pipes context, reads
the table and the hour from the extras, runs `run_hour` on the cluster's Spark session (set up
by `SparkResource.session_conf`), evaluates the hour's checks and reports the materialization
and the check results back: the same metadata and checks the in-process asset records. Any
error is reported through Pipes and exits the job non-zero.

The extras never carry a secret: the Kafka password and the masking key come from the job's
own environment. Its settings and message transports: docs/emr.md, 'How context and messages
travel' and 'Environment and configuration'.
"""

from __future__ import annotations

import sys
from pathlib import Path

# As a script (spark-submit .../emr/pipes_job.py) Python puts emr/ first on sys.path, where
# its modules would shadow top-level ones of the same name (`definitions`, `assets`): the
# project is imported as the installed package only.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)

import logging  # noqa: E402
import os  # noqa: E402
from collections.abc import Iterator, Mapping  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from typing import Any  # noqa: E402

from dagster_pipes import (  # noqa: E402
    PipesContext,
    PipesDefaultMessageWriter,
    PipesEnvVarParamsLoader,
    PipesMessageWriter,
    PipesMessageWriterChannel,
    PipesParams,
    PipesS3MessageWriter,
    open_dagster_pipes,
)
from pyspark import SparkConf  # noqa: E402
from pyspark.sql import SparkSession  # noqa: E402

from cdc_assets.config import TableSpec  # noqa: E402
from cdc_assets.hour_run import run_hour  # noqa: E402
from cdc_assets.reporting import hour_summary, partial_warning, result_metadata  # noqa: E402
from checks.table_checks import MIRROR_CHECKS  # noqa: E402
from emr.assets import (  # noqa: E402
    CHECK_DESCRIPTIONS,
    EXTRA_FORCE_OPEN_HOUR,
    EXTRA_HOUR,
    EXTRA_KAFKA,
    EXTRA_LAKE_ROOT,
    EXTRA_TABLE,
    KAFKA_SECRET_FIELDS,
    to_pipes_metadata,
)
from resources.environment import (  # noqa: E402
    KAFKA_BOOTSTRAP_ENV,
    KAFKA_PASSWORD_ENV,
    LAKE_ROOT_ENV,
    MASKING_KEY_ENV,
)
from resources.kafka import KafkaResource  # noqa: E402
from resources.lake import LakeResource, single_writer_from_env  # noqa: E402
from resources.masking import HmacKey, MaskingResource  # noqa: E402
from resources.spark import DELTA_EXTENSION, REQUIRED_SESSION_CONF, SparkResource  # noqa: E402


class JobConfigError(RuntimeError):
    """The job lacks a setting; the message names it."""


class MessageWriter(PipesMessageWriter):
    """Writes the messages where the Dagster side's message reader reads them.

    `PipesS3MessageReader` (EMR on EC2) passes a bucket: S3, with the job's own credentials.
    Otherwise the default writer: a file (`PipesSubprocessClient`'s temp file reader) or stdout
    (`PipesCloudWatchMessageReader`, EMR Serverless: the driver's stdout in CloudWatch Logs).
    """

    @contextmanager
    def open(self, params: PipesParams) -> Iterator[PipesMessageWriterChannel]:
        if "bucket" in params:
            import boto3

            writer: PipesMessageWriter = PipesS3MessageWriter(client=boto3.client("s3"))
        else:
            writer = PipesDefaultMessageWriter()
        with writer.open(params) as channel:
            yield channel


def job_kafka(settings: Mapping[str, Any]) -> KafkaResource:
    """The Kafka resource from the extras' settings, the secret from the environment."""
    leaked = sorted(KAFKA_SECRET_FIELDS & set(settings))
    if leaked:
        raise JobConfigError(f"the Pipes extras carry Kafka secrets {leaked}; refusing to use them")
    values = dict(settings)
    if not values.get("bootstrap_servers"):
        values["bootstrap_servers"] = os.environ.get(KAFKA_BOOTSTRAP_ENV)
        if not values["bootstrap_servers"]:
            raise JobConfigError(
                f"no Kafka bootstrap servers: neither the Pipes extras nor {KAFKA_BOOTSTRAP_ENV}"
            )
    if values.get("sasl_mechanism"):
        password = os.environ.get(KAFKA_PASSWORD_ENV)
        if not password:
            raise JobConfigError(
                f"Kafka uses SASL {values['sasl_mechanism']}, but the job has no password: set "
                f"{KAFKA_PASSWORD_ENV} in its environment"
            )
        values["sasl_password"] = password
    return KafkaResource(**values)


def job_lake(root: str | None) -> LakeResource:
    root = root or os.environ.get(LAKE_ROOT_ENV)
    if not root:
        raise JobConfigError(f"no lake root: neither the Pipes extras nor {LAKE_ROOT_ENV}")
    return LakeResource(root=root, single_writer=single_writer_from_env())


def job_masking_key(spec: TableSpec) -> HmacKey | None:
    """The masking key of a table with sensitive columns (the same checks as the in-process
    run): it hashes them and seals the error table's raw bytes."""
    if not spec.sensitive:
        return None
    masking = MaskingResource(key=os.environ.get(MASKING_KEY_ENV))
    return masking.hmac_key(table=spec.name, columns=list(spec.sensitive))


def session_conf(submitted: Mapping[str, str]) -> dict[str, str]:
    """The session settings to add to what spark-submit (or the cluster) set: SparkResource's
    own (its defaults), those the results rest on always, the others where nothing was
    submitted, and Delta's extension beside the submitted ones."""
    conf = {
        key: value
        for key, value in SparkResource().session_conf().items()
        if key in REQUIRED_SESSION_CONF or key not in submitted
    }
    extensions = [e.strip() for e in submitted.get("spark.sql.extensions", "").split(",")]
    extensions = [e for e in extensions if e]
    if DELTA_EXTENSION not in extensions:
        conf["spark.sql.extensions"] = ",".join([*extensions, DELTA_EXTENSION])
    return conf


def job_session() -> SparkSession:
    """The session of the cluster (spark-submit created its JVM), set up as SparkResource's."""
    # py4j's DEBUG trace prints every call into the JVM with its arguments, the Kafka login
    # among them: it never goes below INFO (as in resources/spark.py).
    py4j = logging.getLogger("py4j")
    py4j.setLevel(max(py4j.getEffectiveLevel(), logging.INFO))
    submitted = dict(SparkConf().getAll())
    builder = SparkSession.builder
    for key, value in session_conf(submitted).items():
        builder = builder.config(key, value)
    return builder.getOrCreate()


def _hour_key(pipes: PipesContext) -> str:
    hour_key = pipes.get_extra(EXTRA_HOUR)
    if pipes.is_partition_step:
        # One job per hour: the hour is one of the step's partitions.
        keys = pipes.partition_key_range
        if not keys["start"] <= hour_key <= keys["end"]:
            raise JobConfigError(
                f"hour {hour_key} is outside the step's partitions {keys['start']}..{keys['end']}"
            )
    return hour_key


def run(pipes: PipesContext) -> None:
    spec = TableSpec.model_validate(pipes.get_extra(EXTRA_TABLE))
    # The step may materialize several tables (a mirrors multi-asset); this job is one of them.
    if spec.name not in pipes.asset_keys:
        raise JobConfigError(
            f"the step materializes {', '.join(pipes.asset_keys)}, the extras name {spec.name}"
        )
    hour_key = _hour_key(pipes)
    kafka = job_kafka(pipes.extras.get(EXTRA_KAFKA) or {})
    lake = job_lake(pipes.extras.get(EXTRA_LAKE_ROOT))
    masking_key = job_masking_key(spec)
    spark = job_session()
    try:
        result = run_hour(
            checks=MIRROR_CHECKS,
            spark=spark,
            kafka=kafka,
            lake=lake,
            spec=spec,
            hour_key=hour_key,
            force_open_hour=bool(pipes.extras.get(EXTRA_FORCE_OPEN_HOUR)),
            masking_key=masking_key,
        )
        path = lake.table_path(spec.name)
        checks = MIRROR_CHECKS.evaluate(spark=spark, spec=spec, path=path, result=result)
    finally:
        spark.stop()
    pipes.log.info(hour_summary(spec, result))
    if result.partial:
        pipes.log.warning(partial_warning(spec, result))
    pipes.report_asset_materialization(
        asset_key=spec.name, metadata=to_pipes_metadata(result_metadata(result, table_path=path))
    )
    pipes.report_custom_message({CHECK_DESCRIPTIONS: {c.check_name: c.description for c in checks}})
    for check in checks:
        pipes.report_asset_check(
            asset_key=spec.name,
            check_name=check.check_name,
            passed=check.passed,
            severity=check.severity.value,
            metadata=to_pipes_metadata(check.metadata),
        )


def main() -> int:
    params = PipesEnvVarParamsLoader()
    if not params.is_dagster_pipes_process():
        print(  # noqa: T201
            "emr/pipes_job.py runs the hours Dagster hands it through Pipes; start it "
            "from Dagster (emr/assets.py), not by hand. To run an hour without Dagster, "
            "call cdc_assets.hour_run.run_hour.",
            file=sys.stderr,
        )
        return 2
    # An exception leaves through the context: Pipes reports it to Dagster, then it exits the
    # job with a traceback and status 1.
    with open_dagster_pipes(params_loader=params, message_writer=MessageWriter()) as pipes:
        run(pipes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
