"""The deployment's resources from its environment: secrets stay dg.EnvVar, never their values,
and every entry point runs with the same resources."""

from __future__ import annotations

import dagster as dg
import pytest

from resources.environment import (
    DRIVER_JIT_ENV,
    KAFKA_BOOTSTRAP_ENV,
    LAKE_ROOT_ENV,
    MASKING_KEY_ENV,
    resources_from_env,
)

ENVIRON = {
    KAFKA_BOOTSTRAP_ENV: "broker:9092",
    LAKE_ROOT_ENV: "s3://bucket/lake",
    MASKING_KEY_ENV: "k" * 64,
    "AWS_ACCESS_KEY_ID": "AKIAEXAMPLE",
    "AWS_SECRET_ACCESS_KEY": "not-a-real-secret",
    "CDC_LAKE_SINGLE_WRITER": "true",
}


def test_secrets_are_named_not_read():
    resources = resources_from_env(ENVIRON)
    assert set(resources) == {"kafka", "spark", "lake", "masking"}
    assert resources["masking"].key == dg.EnvVar(MASKING_KEY_ENV)
    assert resources["lake"].s3.aws_secret_access_key == dg.EnvVar("AWS_SECRET_ACCESS_KEY")
    assert resources["kafka"].bootstrap_servers == dg.EnvVar(KAFKA_BOOTSTRAP_ENV)
    assert resources["lake"].root == dg.EnvVar(LAKE_ROOT_ENV)
    assert resources["lake"].single_writer is True
    assert resources["spark"].driver_jit == "tiered"  # unset
    assert resources_from_env({**ENVIRON, DRIVER_JIT_ENV: "C1"})["spark"].driver_jit == "c1"
    with pytest.raises(ValueError, match=f"{DRIVER_JIT_ENV}='c2': set it to tiered or c1"):
        resources_from_env({**ENVIRON, DRIVER_JIT_ENV: "c2"})


def test_every_entry_point_runs_with_them(monkeypatch):
    for name, value in ENVIRON.items():
        monkeypatch.setenv(name, value)
    from cdc_assets.error_replay import replay_resources
    from code_location.definitions import build_definitions
    from emr.definitions import shared_resources

    ours = resources_from_env()
    in_process = build_definitions([]).resources
    assert {name: in_process[name] for name in ours} == ours
    assert shared_resources() == {name: ours[name] for name in ("kafka", "lake")}
    assert replay_resources() == ours
