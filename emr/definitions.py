"""Production on AWS: each hour of each mirror runs as a job on EMR Serverless, through Pipes.

The code location for a Dagster deployment whose Spark work runs on EMR Serverless instead of
in the run worker. Load it in place of `code_location.definitions`:

    dagster code-server start -m emr.definitions
    # or in workspace.yaml: - python_module: emr.definitions

It holds the mirror assets (`emr.assets.build_pipes_mirror_assets`) and their offset sensors,
not the downstream assets nor the standalone retention_risk check. Settings come from the
environment when a run starts (dg.EnvVar), never at import. `emr_on_ec2_resources()` is the
same for EMR on EC2; swap it in `defs` to use it.

Packaging, IAM and the environment: docs/emr.md, 'EMR Serverless' and 'EMR on EC2'.
"""

from __future__ import annotations

import os
from typing import Any

import boto3
import dagster as dg
from dagster_aws.pipes import (
    PipesCloudWatchMessageReader,
    PipesEMRClient,
    PipesEMRServerlessClient,
    PipesS3MessageReader,
)

from cdc_assets.config import DEFAULT_TABLES_FILE, TABLES_FILE_ENV, TableSpec, load_tables
from emr.assets import EMRClusterLaunch, EMRServerlessLaunch, build_pipes_mirror_assets
from resources.environment import resources_from_env
from sensors.offset_progress import build_offset_sensor

# The jars pom.xml resolves into .jars/spark/ (Delta 4.4.0 for Spark 4.2, Spark 4.2.0's Kafka
# connector), uploaded to <CDC_EMR_ARTIFACTS>/jars/. They need a Spark 4.2 runtime: the newest
# EMR release, emr-spark-8.0.0, runs Spark 4.0.2 with Delta 4.0.0, see docs/emr.md before
# using them there.
PROJECT_JARS = [
    "commons-pool2-2.13.1.jar",
    "delta-kernel-api-4.4.0.jar",
    "delta-kernel-defaults-4.4.0.jar",
    "delta-kernel-unitycatalog-4.4.0.jar",
    "delta-spark_4.2_2.13-4.4.0.jar",
    "delta-storage-4.4.0.jar",
    "jackson-datatype-jdk8-2.13.5.jar",
    "javax.annotation-api-1.3.2.jar",
    "kafka-clients-3.9.2.jar",
    "spark-sql-kafka-0-10_2.13-4.2.0.jar",
    "spark-token-provider-kafka-0-10_2.13-4.1.0-preview1.jar",
    "unitycatalog-client-0.6.0.jar",
    "unitycatalog-hadoop-0.6.0.jar",
]

# Sizes for one hour of one table; EMR Serverless accepts 1 vCPU with 2-8 GB.
SPARK_CONF = {
    "spark.driver.cores": "1",
    "spark.driver.memory": "4g",
    "spark.executor.cores": "2",
    "spark.executor.memory": "4g",
    "spark.dynamicAllocation.maxExecutors": "4",
    "spark.sql.shuffle.partitions": "8",
}

# Secrets the job needs in its environment, by AWS Secrets Manager secret id (never the value).
SECRET_ENV: dict[str, str] = {
    # "CDC_KAFKA_SASL_PASSWORD": "cdc-lake/kafka-sasl-password",  # Kafka with SASL
    # "CDC_MASKING_KEY": "cdc-lake/masking-key",  # tables that hash a column (`sensitive`)
}


class EMRServerlessPipesClient(dg.ConfigurableResource):
    """`PipesEMRServerlessClient`, created for each job: boto3 clients are made when a run
    starts a job, never when the code location loads, and each job gets a fresh CloudWatch
    message reader."""

    region_name: str | None = None
    poll_interval_seconds: float = 10.0

    def run(self, *, context, extras: dict[str, Any], **launch: Any):
        session = boto3.session.Session(region_name=self.region_name)
        client = PipesEMRServerlessClient(
            client=session.client("emr-serverless"),
            message_reader=PipesCloudWatchMessageReader(client=session.client("logs")),
            poll_interval=self.poll_interval_seconds,
        )
        return client.run(context=context, extras=extras, **launch)


class EMROnEC2PipesClient(dg.ConfigurableResource):
    """`PipesEMRClient` with an S3 message reader, created for each job (see above)."""

    messages_bucket: str
    region_name: str | None = None

    def run(self, *, context, extras: dict[str, Any], **launch: Any):
        session = boto3.session.Session(region_name=self.region_name)
        client = PipesEMRClient(
            client=session.client("emr"),
            message_reader=PipesS3MessageReader(
                bucket=self.messages_bucket,
                client=session.client("s3"),
                include_stdio_in_messages=True,
            ),
        )
        return client.run(context=context, extras=extras, **launch)


def shared_resources() -> dict[str, Any]:
    """The in-process deployment's `kafka` and `lake` (resources/environment.py): their
    non-secret settings reach the job in the Pipes extras. The run worker runs no Spark and
    needs no secret; give Kafka's security settings in resources_from_env (the password itself
    goes to the job through SECRET_ENV, not through these)."""
    resources = resources_from_env()
    return {name: resources[name] for name in ("kafka", "lake")}


def emr_serverless_resources() -> dict[str, Any]:
    return {
        **shared_resources(),
        "pipes_client": EMRServerlessPipesClient(),
        "pipes_launch": EMRServerlessLaunch(
            application_id=dg.EnvVar("CDC_EMR_SERVERLESS_APPLICATION_ID"),
            execution_role_arn=dg.EnvVar("CDC_EMR_EXECUTION_ROLE_ARN"),
            artifacts_uri=dg.EnvVar("CDC_EMR_ARTIFACTS"),
            jars=PROJECT_JARS,
            spark_conf=SPARK_CONF,
            secret_env=SECRET_ENV,
        ),
    }


def emr_on_ec2_resources() -> dict[str, Any]:
    """EMR on EC2: env CDC_EMR_RELEASE_LABEL, CDC_EMR_LOG_URI, CDC_EMR_SUBNET_ID and
    CDC_EMR_MESSAGES_BUCKET besides CDC_EMR_ARTIFACTS. Secrets are not wired (docs/emr.md)."""
    return {
        **shared_resources(),
        "pipes_client": EMROnEC2PipesClient(messages_bucket=dg.EnvVar("CDC_EMR_MESSAGES_BUCKET")),
        "pipes_launch": EMRClusterLaunch(
            release_label=dg.EnvVar("CDC_EMR_RELEASE_LABEL"),
            log_uri=dg.EnvVar("CDC_EMR_LOG_URI"),
            subnet_id=dg.EnvVar("CDC_EMR_SUBNET_ID"),
            artifacts_uri=dg.EnvVar("CDC_EMR_ARTIFACTS"),
            jars=PROJECT_JARS,
            spark_conf=SPARK_CONF,
        ),
    }


def build_definitions(specs: list[TableSpec], resources: dict[str, Any]) -> dg.Definitions:
    return dg.Definitions(
        assets=build_pipes_mirror_assets(specs),
        sensors=[build_offset_sensor(specs=specs)],
        # The run worker only waits for the jobs; one process for all the assets of a run.
        executor=dg.in_process_executor,
        resources=resources,
    )


@dg.definitions
def defs() -> dg.Definitions:
    # Read when Dagster loads the code location, never at import time.
    specs = load_tables(os.environ.get(TABLES_FILE_ENV, DEFAULT_TABLES_FILE))
    return build_definitions(specs, emr_serverless_resources())
