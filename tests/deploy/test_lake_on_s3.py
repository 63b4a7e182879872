"""The lake on S3: what S3A is told, and a wrong S3 setup failing fast, naming the fix.

The mirrors, error tables and checks on S3 are proven by tests/cdc_assets/test_mirror.py (its
reference run and backfill write to the `s3` fixture's server) and the cluster backfill there.
"""

from __future__ import annotations

import dagster as dg
import pytest
from dagster_aws.s3 import S3Resource

from cdc_assets.factory import build_table_asset
from checks.table_checks import MIRROR_CHECKS
from resources.lake import LakeResource, s3_resource_from_env, s3a_settings
from tests.conftest import S3_SECRET_ENV
from tests.faults.table import hour_key, spec

BUCKET = "mirrors"
PREFIX = f"fs.s3a.bucket.{BUCKET}."


@pytest.fixture
def no_aws_environment(monkeypatch, tmp_path):
    """No credentials, profile, region or endpoint from this machine, and no instance role."""
    for name in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_PROFILE",
        "AWS_DEFAULT_PROFILE",
        "AWS_REGION",
        "AWS_DEFAULT_REGION",
        "AWS_ENDPOINT_URL",
        "AWS_ENDPOINT_URL_S3",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def test_explicit_keys_and_a_custom_endpoint_go_to_the_lakes_bucket_only(no_aws_environment):
    s3 = S3Resource(
        endpoint_url="http://127.0.0.1:9000",
        region_name="eu-west-1",
        aws_access_key_id="AKIDEXAMPLE",
        aws_secret_access_key="example-secret",
    )
    settings = s3a_settings(s3, BUCKET, path_style_access=None)
    assert settings == {
        PREFIX + "endpoint.region": "eu-west-1",
        PREFIX + "endpoint": "http://127.0.0.1:9000",
        PREFIX + "connection.ssl.enabled": "false",
        PREFIX + "path.style.access": "true",
        PREFIX + "access.key": "AKIDEXAMPLE",
        PREFIX + "secret.key": "example-secret",
        PREFIX
        + "aws.credentials.provider": "org.apache.hadoop.fs.s3a.SimpleAWSCredentialsProvider",
    }


def test_a_session_token_uses_the_temporary_provider_and_aws_keeps_virtual_hosts(
    no_aws_environment,
):
    s3 = S3Resource(
        region_name="us-east-1",
        aws_access_key_id="ASIAEXAMPLE",
        aws_secret_access_key="example-secret",
        aws_session_token="example-token",
    )
    settings = s3a_settings(s3, BUCKET, path_style_access=None)
    assert PREFIX + "endpoint" not in settings  # AWS itself: S3A's own endpoint logic
    assert settings[PREFIX + "path.style.access"] == "false"
    assert settings[PREFIX + "session.token"] == "example-token"
    assert settings[PREFIX + "aws.credentials.provider"].endswith("TemporaryAWSCredentialsProvider")


def test_keys_from_the_environment_are_handed_over_but_no_keys_means_s3as_chain(
    no_aws_environment, monkeypatch
):
    # Nothing static to hand over (on EC2, an instance role): S3A's own chain finds and
    # refreshes the credentials on every node.
    settings = s3a_settings(S3Resource(region_name="us-east-1"), BUCKET, path_style_access=None)
    assert not any(key.endswith(("access.key", "secret.key", "provider")) for key in settings)

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDENV")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "env-secret")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "https://s3.example.internal")
    resource = s3_resource_from_env()
    # Dagster's config holds the variables' names, never their values.
    assert resource.aws_access_key_id == dg.EnvVar("AWS_ACCESS_KEY_ID")
    settings = s3a_settings(S3Resource(region_name="us-east-1"), BUCKET, path_style_access=False)
    assert settings[PREFIX + "access.key"] == "AKIDENV"
    assert settings[PREFIX + "secret.key"] == "env-secret"
    assert settings[PREFIX + "endpoint"] == "https://s3.example.internal"
    assert settings[PREFIX + "connection.ssl.enabled"] == "true"
    assert settings[PREFIX + "path.style.access"] == "false"


@pytest.mark.integration
def test_a_wrong_s3_setup_fails_the_run_before_reading_naming_the_fix(
    kafka, spark_resource, s3, topic_prefix, monkeypatch
):
    # The run stops at the lake, before it asks Kafka anything: the topic needn't exist.
    table = spec(f"{topic_prefix}.accounts")
    asset = build_table_asset(checks=MIRROR_CHECKS, spec=table)

    def run(lake: LakeResource) -> str:
        result = dg.materialize(
            [asset],
            partition_key=hour_key(0),
            resources={"kafka": kafka, "spark": spark_resource, "lake": lake},
            raise_on_error=False,
        )
        assert not result.success
        (failure,) = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
        # Not retried: another attempt can't fix a setting.
        assert not any(e.event_type_value == "STEP_UP_FOR_RETRY" for e in result.all_events)
        return failure.step_failure_data.error.message

    # (The same lake with the right key is test_mirror's reference run.)
    message = run(LakeResource(root="s3://no-such-bucket/lake", s3=s3.lake("x").s3))
    assert "bucket 'no-such-bucket' does not exist" in message
    assert "CDC_LAKE_ROOT" in message

    # A key the server doesn't know: S3 refuses it, and the message names where keys come
    # from, never the key itself.
    with monkeypatch.context() as patch:
        patch.setenv(S3_SECRET_ENV, "not-the-secret")
        message = run(s3.lake("wrong-key"))
    assert "denied" in message and "AWS_SECRET_ACCESS_KEY" in message
    assert "not-the-secret" not in message
