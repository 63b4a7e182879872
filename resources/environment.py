"""The deployment's resources from its environment: the one place that names the variables.

`resources_from_env()` is what every entry point runs with: the code location's Definitions,
the EMR code location (its `kafka` and `lake`) and the error replay CLI (resolved by
`dg.build_resources`, as a run resolves them). Secrets go in as `dg.EnvVar`, so Dagster stores
only the variable's name and reads the value when a run starts. The Pipes job on a cluster runs
outside Dagster: it reads the variables named here for what its extras don't carry
(emr/pipes_job.py). Nothing here reads the environment at import time.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import dagster as dg

from resources.kafka import KafkaResource
from resources.lake import LakeResource, s3_resource_from_env, single_writer_from_env
from resources.masking import MASKING_KEY_ENV, MaskingResource
from resources.spark import DRIVER_JITS, SparkResource

KAFKA_BOOTSTRAP_ENV = "CDC_KAFKA_BOOTSTRAP_SERVERS"
KAFKA_PASSWORD_ENV = "CDC_KAFKA_SASL_PASSWORD"  # read by the Pipes job only
LAKE_ROOT_ENV = "CDC_LAKE_ROOT"
DRIVER_JIT_ENV = "CDC_SPARK_DRIVER_JIT"  # SparkResource.driver_jit; unset: tiered

__all__ = [
    "KAFKA_BOOTSTRAP_ENV",
    "KAFKA_PASSWORD_ENV",
    "DRIVER_JIT_ENV",
    "LAKE_ROOT_ENV",
    "MASKING_KEY_ENV",
    "resources_from_env",
]


def resources_from_env(environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """The `kafka`, `spark`, `lake` and `masking` resources of a deployment configured by
    `environ` (read when called: when a code location loads or a command starts)."""
    return {
        "kafka": KafkaResource(bootstrap_servers=dg.EnvVar(KAFKA_BOOTSTRAP_ENV)),
        "spark": SparkResource(driver_jit=driver_jit_from_env(environ)),
        # A folder, or s3://bucket/prefix reached with the AWS settings of the environment; on
        # S3, safe with several writers unless CDC_LAKE_SINGLE_WRITER says it has one.
        "lake": LakeResource(
            root=dg.EnvVar(LAKE_ROOT_ENV),
            s3=s3_resource_from_env(environ),
            single_writer=single_writer_from_env(environ),
        ),
        # Required only by tables with `sensitive` columns (hashes, the error table's seal).
        "masking": MaskingResource(key=dg.EnvVar(MASKING_KEY_ENV)),
    }


def driver_jit_from_env(environ: Mapping[str, str] = os.environ) -> str:
    """The Spark driver's JIT (`SparkResource.driver_jit`) a deployment names in
    CDC_SPARK_DRIVER_JIT; unset: tiered."""
    value = environ.get(DRIVER_JIT_ENV, "").strip().lower() or "tiered"
    if value not in DRIVER_JITS:
        raise ValueError(f"{DRIVER_JIT_ENV}={value!r}: set it to {' or '.join(DRIVER_JITS)}.")
    return value
