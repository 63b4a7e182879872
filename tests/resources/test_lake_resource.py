"""LakeResource's paths and the checks that need no S3: roots, table paths, the single-writer
switch, which log stores are safe with several writers, and storage failures recognized.
Against a real S3 API (moto): tests/deploy/test_lake_on_s3.py, test_writers_on_s3.py."""

from __future__ import annotations

import dagster as dg
import pytest

from resources.lake import (
    MULTI_WRITER_LOG_STORES,
    SINGLE_WRITER_ENV,
    LakeConfigError,
    LakeResource,
    S3Location,
    check_multi_writer_log_store,
    s3_location,
    s3_resource_from_env,
    single_writer_from_env,
    storage_failure,
)
from resources.spark import LOG_STORE_CONF


def test_roots_and_table_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert LakeResource(root="lake").table_path("orders") == f"{tmp_path}/lake/orders"
    s3 = LakeResource(root="s3://bucket/some/prefix/")
    assert s3.root_uri == "s3a://bucket/some/prefix"
    assert LakeResource(root="s3a://bucket").table_path("t") == "s3a://bucket/t"
    assert LakeResource(root="hdfs://nn:8020/lake/").table_path("t") == "hdfs://nn:8020/lake/t"
    assert LakeResource(root="lake").s3_client() is None


def test_an_s3_root_needs_a_bucket():
    assert s3_location("s3://b/p/q/") == S3Location("b", "p/q")
    assert s3_location("/data/lake") is None and s3_location("hdfs://nn/lake") is None
    with pytest.raises(LakeConfigError, match="names no bucket: set CDC_LAKE_ROOT"):
        s3_location("s3:///prefix")


def test_a_local_lake_connects_without_touching_spark(tmp_path):
    LakeResource(root=str(tmp_path)).connect(spark=None)  # nothing to set up for a folder


@pytest.mark.parametrize(
    ("value", "single"),
    [("", False), ("false", False), ("0", False), ("TRUE", True), ("yes", True), (" 1 ", True)],
)
def test_the_single_writer_switch(value, single):
    assert single_writer_from_env({SINGLE_WRITER_ENV: value}) is single


def test_a_single_writer_value_that_is_not_a_boolean_is_refused():
    with pytest.raises(LakeConfigError, match=f"{SINGLE_WRITER_ENV}='maybe': set it to true"):
        single_writer_from_env({SINGLE_WRITER_ENV: "maybe"})


def test_only_the_access_keys_that_are_set_become_env_vars():
    s3 = s3_resource_from_env({"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"})
    assert s3.aws_access_key_id == dg.EnvVar("AWS_ACCESS_KEY_ID")
    assert s3.aws_secret_access_key == dg.EnvVar("AWS_SECRET_ACCESS_KEY")
    assert s3.aws_session_token is None
    assert s3_resource_from_env({}).aws_access_key_id is None


def test_a_log_store_that_can_lose_a_commit_is_refused_naming_both_fixes():
    for store in MULTI_WRITER_LOG_STORES:
        check_multi_writer_log_store(store, "s3://b/lake")
    with pytest.raises(LakeConfigError) as refused:
        check_multi_writer_log_store("io.delta.storage.S3SingleDriverLogStore", "s3://b/lake")
    message = str(refused.value)
    assert "s3://b/lake" in message and LOG_STORE_CONF in message
    assert f"{SINGLE_WRITER_ENV}=true" in message


def test_storage_failures_are_recognized_through_the_exception_chain():
    try:
        try:
            raise OSError("java.io.IOException: No space left on device")
        except OSError as inner:
            raise RuntimeError("MERGE failed") from inner
    except RuntimeError as outer:
        cause, fix = storage_failure(outer)
    assert (
        cause.startswith("a disk the run writes to is full")
        and "'No space left on device'" in cause
    )
    assert "VACUUM" in fix
    assert storage_failure(RuntimeError("SlowDown: Please reduce your request rate"))[0].startswith(
        "S3 kept answering 503 SlowDown"
    )
    assert storage_failure(RuntimeError("a bug")) is None
