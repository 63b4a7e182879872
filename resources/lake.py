"""Where the Delta tables live: a local folder by default, or S3 through dagster-aws.

An `s3://bucket/prefix` (or `s3a://`) root is read and written by Spark's S3A filesystem
(hadoop-aws, `.jars/s3/` from pom.xml). Its endpoint, region and credentials come from the
lake's dagster-aws `S3Resource` (fields as `dg.EnvVar`, or boto3's own chain: environment,
profile, instance role), and `LakeResource.connect(spark)` hands them to S3A for the lake's
bucket only, before anything touches a table.

Several writers of one table on S3 (two Dagster deployments, a notebook, a second cluster) are
safe only when every Delta commit is a put-if-absent. `connect` therefore refuses an S3 lake
unless Spark's Delta log store for s3a makes one (the conditional-put log store SparkResource
sets, or Delta's DynamoDB one) and the store honours S3 conditional writes, unless the lake is
declared `single_writer` (then Delta's default S3 log store, safe inside one Spark driver only).
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import boto3
import botocore.exceptions
import dagster as dg
from dagster_aws.s3 import S3Resource
from pydantic import Field, PrivateAttr
from pyspark.sql import SparkSession

from resources.spark import CONDITIONAL_PUT_LOG_STORE, LOG_STORE_CONF

log = logging.getLogger(__name__)

# boto3's credential methods whose keys don't expire: S3A gets the keys themselves. Refreshing
# ones (instance or container role, assume-role, SSO) are left to S3A's own provider chain,
# which refreshes them; handing over a snapshot would fail once it expires mid-backfill.
STATIC_CREDENTIALS = {"explicit", "env", "shared-credentials-file", "config-file"}
S3A_FILESYSTEM = "org.apache.hadoop.fs.s3a.S3AFileSystem"
# The S3 resource's credential fields a deployment sets through the environment.
CREDENTIAL_ENV = {
    "AWS_ACCESS_KEY_ID": "aws_access_key_id",
    "AWS_SECRET_ACCESS_KEY": "aws_secret_access_key",
    "AWS_SESSION_TOKEN": "aws_session_token",
}


# Delta log stores for s3a whose commit is a put-if-absent across Spark drivers: ours (S3
# conditional writes, jvm/log-store) and Delta's own DynamoDB-backed one, if a cluster brings it.
MULTI_WRITER_LOG_STORES = {CONDITIONAL_PUT_LOG_STORE, "io.delta.storage.S3DynamoDBLogStore"}
SINGLE_WRITER_ENV = "CDC_LAKE_SINGLE_WRITER"


def single_writer_from_env(environ: Mapping[str, str] = os.environ) -> bool:
    """A deployment's word that only its own runs write the lake (CDC_LAKE_SINGLE_WRITER)."""
    value = environ.get(SINGLE_WRITER_ENV, "").strip().lower()
    if value not in ("", "0", "false", "no", "1", "true", "yes"):
        raise LakeConfigError(f"{SINGLE_WRITER_ENV}={value!r}: set it to true or false.")
    return value in ("1", "true", "yes")


class LakeConfigError(RuntimeError):
    """The lake can't be used as configured; the message names the setting and the fix."""


class LakeUnavailableError(RuntimeError):
    """S3 did not answer; retrying may help (the run's retry policy does)."""


@dataclass(frozen=True)
class S3Location:
    bucket: str
    prefix: str


def s3_location(root: str) -> S3Location | None:
    """The bucket and prefix of an `s3://` or `s3a://` root; None for any other root."""
    parsed = urlparse(root)
    if parsed.scheme not in ("s3", "s3a"):
        return None
    if not parsed.netloc:
        raise LakeConfigError(
            f"lake root '{root}' names no bucket: set CDC_LAKE_ROOT to s3://<bucket>/<prefix>."
        )
    return S3Location(bucket=parsed.netloc, prefix=parsed.path.strip("/"))


def s3_resource_from_env(environ: Mapping[str, str] = os.environ) -> S3Resource:
    """The lake's S3 resource: the access key variables that are set, as dg.EnvVar.

    Region, endpoint and profile are boto3's own variables (AWS_REGION, AWS_ENDPOINT_URL_S3,
    AWS_PROFILE); without an access key, boto3's chain finds the credentials (a profile or an
    instance role).
    """
    fields = {field: dg.EnvVar(name) for name, field in CREDENTIAL_ENV.items() if environ.get(name)}
    return S3Resource(**fields)


def s3a_settings(s3: S3Resource, bucket: str, *, path_style_access: bool | None) -> dict[str, str]:
    """Hadoop settings that point S3A at `bucket` as `s3` (a dagster-aws resource) would reach it.

    Every setting is per bucket (`fs.s3a.bucket.<bucket>.*`), so other buckets the same Spark
    session reads keep their own configuration. Values include secrets: they go into the
    session's Hadoop configuration only, never into Spark's conf, logs or metadata.
    """
    prefix = f"fs.s3a.bucket.{bucket}."
    session = boto3.session.Session(profile_name=s3.profile_name)
    client = s3.get_client()
    settings: dict[str, str] = {}
    region = s3.region_name or session.region_name or client.meta.region_name
    if region:
        settings[prefix + "endpoint.region"] = region
    # The endpoint boto3 resolved: the resource's endpoint_url, or AWS_ENDPOINT_URL(_S3).
    endpoint = s3.endpoint_url or client.meta.endpoint_url
    custom = bool(endpoint) and not urlparse(endpoint).hostname.endswith("amazonaws.com")
    if custom:
        settings[prefix + "endpoint"] = endpoint
        settings[prefix + "connection.ssl.enabled"] = str(
            urlparse(endpoint).scheme == "https"
        ).lower()
    path_style = custom if path_style_access is None else path_style_access
    settings[prefix + "path.style.access"] = str(path_style).lower()

    if s3.use_unsigned_session:
        settings[prefix + "aws.credentials.provider"] = (
            "org.apache.hadoop.fs.s3a.AnonymousAWSCredentialsProvider"
        )
        return settings
    if s3.aws_access_key_id or s3.aws_secret_access_key:
        if not (s3.aws_access_key_id and s3.aws_secret_access_key):
            raise LakeConfigError(
                "the lake's S3 resource sets only one of aws_access_key_id and "
                "aws_secret_access_key: set both (e.g. dg.EnvVar('AWS_ACCESS_KEY_ID') and "
                "dg.EnvVar('AWS_SECRET_ACCESS_KEY')), or neither to use boto3's chain."
            )
        key, secret, token = s3.aws_access_key_id, s3.aws_secret_access_key, s3.aws_session_token
    else:
        credentials = session.get_credentials()
        if credentials is None or credentials.method not in STATIC_CREDENTIALS:
            # No static keys: S3A's default chain (environment, instance/container role, web
            # identity) finds and refreshes them on every node.
            return settings
        frozen = credentials.get_frozen_credentials()
        key, secret, token = frozen.access_key, frozen.secret_key, frozen.token
    settings[prefix + "access.key"] = key
    settings[prefix + "secret.key"] = secret
    if token:
        settings[prefix + "session.token"] = token
        settings[prefix + "aws.credentials.provider"] = (
            "org.apache.hadoop.fs.s3a.TemporaryAWSCredentialsProvider"
        )
    else:
        settings[prefix + "aws.credentials.provider"] = (
            "org.apache.hadoop.fs.s3a.SimpleAWSCredentialsProvider"
        )
    return settings


class LakeResource(dg.ConfigurableResource):
    """The lake's root; each table is a Delta table in `<root>/<table>`."""

    root: str = Field(
        default=".local/lake",
        description=(
            "A local folder (relative to the working directory), s3://bucket/prefix (read "
            "through S3A), or any other Hadoop filesystem URI."
        ),
    )
    s3: S3Resource | None = Field(
        default=None,
        description=(
            "How to reach S3 for an s3:// root (dagster-aws): endpoint, region, credentials. "
            "Unset: boto3's default chain (environment, profile, instance role)."
        ),
    )
    s3_path_style_access: bool | None = Field(
        default=None,
        description="S3A path-style requests; default: on for a custom endpoint, off for AWS.",
    )
    single_writer: bool = Field(
        default=False,
        description=(
            "An S3 lake that only one Spark driver at a time ever writes (one Dagster "
            "deployment, its pools): Delta's default S3 log store is then accepted. Off: the "
            "lake needs a multi-writer log store, or connecting fails (docs/deploy.md)."
        ),
    )

    _connected: set[int] = PrivateAttr(default_factory=set)

    @property
    def root_uri(self) -> str:
        location = s3_location(self.root)
        if location is not None:
            return f"s3a://{location.bucket}/{location.prefix}".rstrip("/")
        if "://" in self.root:
            return self.root.rstrip("/")
        return str(Path(self.root).resolve())

    def table_path(self, table: str) -> str:
        return f"{self.root_uri}/{table}"

    def s3_client(self):
        """A boto3 client for an S3 root (the lake's own settings), None for a local root."""
        if s3_location(self.root) is None:
            return None
        return (self.s3 or S3Resource()).get_client()

    def connect(self, spark: SparkSession) -> None:
        """Points `spark` at the lake: for an S3 root, S3A's settings for its bucket, checked.

        Call before a table path is used (the assets and checks do). Once per session; fails
        fast, naming the setting to fix, when the bucket can't be reached.
        """
        location = s3_location(self.root)
        if location is None or id(spark) in self._connected:
            return
        s3 = self.s3 or S3Resource()
        settings = s3a_settings(s3, location.bucket, path_style_access=self.s3_path_style_access)
        # PySpark has no public handle on the running context's Hadoop configuration (SparkConf's
        # spark.hadoop.* reach it only when the context starts): the JVM context's is set.
        hadoop = spark.sparkContext._jsc.hadoopConfiguration()  # noqa: SLF001
        try:
            hadoop.getClassByName(S3A_FILESYSTEM)
        except Exception as error:
            raise LakeConfigError(
                f"lake root '{self.root}': Spark has no S3A filesystem ({S3A_FILESYSTEM}). "
                "Resolve the jars with scripts/install.sh (pom.xml → .jars/s3/, which "
                "SparkResource puts on the class path), or add hadoop-aws matching the "
                "cluster's Hadoop to its class path."
            ) from error
        _check_bucket(s3, location, self.root)
        for key, value in settings.items():
            hadoop.set(key, value)
        store = delta_log_store(spark, self.root_uri)
        if not self.single_writer:
            check_multi_writer_log_store(store, self.root)
            if store == CONDITIONAL_PUT_LOG_STORE:
                _check_conditional_writes(s3, location, self.root)
        self._connected.add(id(spark))
        log.info(
            "lake on s3a://%s (endpoint %s, credentials: %s, Delta log store %s%s)",
            location.bucket,
            settings.get(f"fs.s3a.bucket.{location.bucket}.endpoint", "AWS"),
            "from the S3 resource"
            if any(k.endswith(".access.key") for k in settings)
            else "S3A's default chain",
            store,
            ", single writer" if self.single_writer else "",
        )


def delta_log_store(spark: SparkSession, path: str) -> str:
    """The class of the log store Delta commits to `path` with, resolved as Delta resolves it."""
    # Delta's log stores have no Python API: this asks the JVM, through pyspark's gateway.
    jvm = spark.sparkContext._jvm  # noqa: SLF001
    session = spark._jsparkSession  # noqa: SLF001
    delegating = jvm.org.apache.spark.sql.delta.storage.LogStore.apply(session)
    try:
        store = delegating.getDelegate(jvm.org.apache.hadoop.fs.Path(path))
    except Exception as error:
        raise LakeConfigError(
            f"Delta can't create the log store for '{path}' ({LOG_STORE_CONF}): "
            f"{str(error).splitlines()[-1][:300]}. Resolve the jars with scripts/install.sh."
        ) from None
    # A Java log store (io.delta.storage.LogStore) is wrapped in Delta's Scala adaptor.
    if store.getClass().getName().endswith(".LogStoreAdaptor"):
        store = store.logStoreImpl()
    return store.getClass().getName()


def check_multi_writer_log_store(store: str, root: str) -> None:
    """Fails, naming the setting and the fix, when `store` lets two writers lose a commit."""
    if store in MULTI_WRITER_LOG_STORES:
        return
    raise LakeConfigError(
        f"lake root '{root}': Delta commits to it with {store}, which is safe with one Spark "
        "driver only: two writers of a table (a second deployment, a notebook, another "
        "cluster) can overwrite each other's commits on S3 and lose one without an error. "
        f"Run scripts/install.sh, which builds the conditional-put log store (jvm/log-store) "
        f"that SparkResource sets as {LOG_STORE_CONF}={CONDITIONAL_PUT_LOG_STORE} (a cluster "
        "of your own: add its jar to spark.jars and set that conf). Or, if this deployment is "
        f"the only writer of the lake, say so: {SINGLE_WRITER_ENV}=true "
        "(LakeResource.single_writer); see docs/deploy.md."
    )


def _check_conditional_writes(s3: S3Resource, location: S3Location, root: str) -> None:
    """Fails with the fix unless the store refuses a second If-None-Match PUT of one key.

    A store that ignores the header would let both writers of a version succeed, the later
    replacing the earlier commit: the log store would be no safer than Delta's default. Two PUTs
    and a DELETE of a probe object under the lake's prefix, once per session.
    """
    client = s3.get_client()
    key = "/".join(
        part for part in (location.prefix, "_cdc_conditional_write_probe", uuid.uuid4().hex) if part
    )
    where = f"lake root '{root}' (endpoint {client.meta.endpoint_url})"
    fix = (
        "Use a store with S3 conditional writes (AWS S3 has them; check your S3-compatible "
        f"store's version), or set {SINGLE_WRITER_ENV}=true if this deployment is the only writer."
    )
    try:
        client.put_object(Bucket=location.bucket, Key=key, Body=b"", IfNoneMatch="*")
        try:
            client.put_object(Bucket=location.bucket, Key=key, Body=b"", IfNoneMatch="*")
        except botocore.exceptions.ClientError as error:
            if error.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 412:
                return
            raise
        raise LakeConfigError(
            f"{where}: the store ignores S3 conditional writes (a second PUT with "
            "If-None-Match: * replaced the object), so two writers of a Delta table could "
            f"both commit one version and one commit would be lost. {fix}"
        )
    except botocore.exceptions.ClientError as error:
        code = error.response.get("Error", {}).get("Code", "")
        status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        if status >= 500 or code in ("SlowDown", "RequestTimeout", "InternalError"):
            raise LakeUnavailableError(
                f"{where}: S3 answered the conditional-write probe with {code or status} "
                "(throttling or a server error) past boto3's retries; the run's retries try again."
            ) from None
        if code in ("403", "AccessDenied"):
            raise LakeConfigError(
                f"{where}: writing under the lake's prefix was denied ({code}). Its writers need "
                "s3:PutObject and s3:DeleteObject there (check the credentials' policy)."
            ) from None
        raise LakeConfigError(
            f"{where}: a conditional write (PUT with If-None-Match: *) was refused ({code}), "
            f"so Delta's commits can't be made safe for several writers. {fix}"
        ) from None
    except botocore.exceptions.EndpointConnectionError:
        raise LakeUnavailableError(
            f"{where}: S3 does not answer; the run's retries try again."
        ) from None
    finally:
        try:
            client.delete_object(Bucket=location.bucket, Key=key)
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError):
            pass  # what failed before is what the run reports


def _check_bucket(s3: S3Resource, location: S3Location, root: str) -> None:
    """Fails with the fix when the lake's bucket is missing, unreachable or forbidden."""
    client = s3.get_client()
    where = f"lake root '{root}' (endpoint {client.meta.endpoint_url})"
    try:
        client.head_bucket(Bucket=location.bucket)
    except botocore.exceptions.ClientError as error:
        code = error.response.get("Error", {}).get("Code", "")
        if code in ("404", "NoSuchBucket"):
            raise LakeConfigError(
                f"{where}: bucket '{location.bucket}' does not exist. Create it, or fix "
                "CDC_LAKE_ROOT."
            ) from None
        if code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            raise LakeConfigError(
                f"{where}: access to bucket '{location.bucket}' was denied ({code}). Check the "
                "credentials the lake's S3 resource uses (AWS_ACCESS_KEY_ID / "
                "AWS_SECRET_ACCESS_KEY, AWS_PROFILE or the instance role) and their policy."
            ) from None
        raise
    except botocore.exceptions.NoCredentialsError:
        raise LakeConfigError(
            f"{where}: no AWS credentials found. Set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or run with an instance role."
        ) from None
    except botocore.exceptions.EndpointConnectionError:
        raise LakeUnavailableError(
            f"{where}: S3 does not answer. Check the endpoint (AWS_ENDPOINT_URL_S3 or the S3 "
            "resource's endpoint_url); the run's retries try again."
        ) from None


class LakeWriteError(RuntimeError):
    """The lake's storage refused a write (disk full, S3 throttling past its retries); the
    message names the table, the hour, the cause and the fix. Retried by the run's policy: the
    cause may pass."""


# What the storage says when it can't take a write, as it appears in the Java or boto3
# exception's text, and what the operator does about it.
_STORAGE_FAILURES = (
    (
        ("No space left on device", "Disk quota exceeded"),
        "a disk the run writes to is full (the lake's, or Spark's scratch space)",
        "Free space on the lake's volume (VACUUM old tables, grow the volume) or in Spark's "
        "local directories (spark.local.dir)",
    ),
    (
        ("SlowDown", "Please reduce your request rate", "503 Service Unavailable"),
        "S3 kept answering 503 SlowDown (throttling) after S3A's and boto3's retries",
        "Lower the request rate on the bucket's prefix (fewer tables in parallel: "
        "SparkResource.parallel_tables), or raise S3A's fs.s3a.retry.throttle.limit",
    ),
)


def storage_failure(error: BaseException) -> tuple[str, str] | None:
    """(cause, fix) when `error` (or what it wraps) is the lake's storage refusing a write."""
    texts = []
    while error is not None and len(texts) < 10:
        texts.append(str(error))
        error = error.__cause__ or error.__context__
    text = "\n".join(texts)
    for markers, cause, fix in _STORAGE_FAILURES:
        for marker in markers:
            if marker in text:
                return f"{cause} ('{marker}')", fix
    return None
