"""SparkResource's session configuration (no session started): what the project's results
rest on, the jars it finds, and the S3 pieces it adds only when they were resolved."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from resources import jvm_archive
from resources.spark import (
    C1_ONLY,
    CONDITIONAL_PUT_LOG_STORE,
    LOG_STORE_CONF,
    SparkJarsMissingError,
    SparkResource,
    log_store_jar,
    s3_class_path,
    spark_jars,
)

JARS = ("delta-spark_4.2_2.13-4.4.0.jar", "spark-sql-kafka-0-10_2.13-4.2.0.jar", "x.jar")


def _dir(path: Path, *names: str) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for name in names:
        (path / name).touch()
    return path


def test_the_session_is_set_up_for_delta_utc_and_redacted_secrets(tmp_path):
    spark = SparkResource(
        jars_dir=str(_dir(tmp_path / "jars", *JARS)),
        s3_jars_dir=str(tmp_path / "none"),
        shuffle_partitions=3,
        extra_conf={"spark.sql.shuffle.partitions": "5", "spark.x": "y"},
    )
    conf = spark.spark_config()
    assert conf["spark.sql.extensions"] == "io.delta.sql.DeltaSparkSessionExtension"
    assert conf["spark.sql.catalog.spark_catalog"].endswith("DeltaCatalog")
    assert conf["spark.sql.session.timeZone"] == "UTC"
    assert "password" in conf["spark.redaction.regex"] and "jaas" in conf["spark.redaction.regex"]
    assert conf["spark.scheduler.mode"] == "FAIR"
    assert conf["spark.sql.codegen.cache.maxEntries"] == "1000"  # see test_spark_session.py
    assert conf["spark.jars"].split(",") == [str(tmp_path / "jars" / j) for j in sorted(JARS)]
    # extra_conf has the last word.
    assert (conf["spark.sql.shuffle.partitions"], conf["spark.x"]) == ("5", "y")
    assert "spark.driver.extraClassPath" not in conf and LOG_STORE_CONF not in conf


def test_missing_jars_name_the_command_that_resolves_them(tmp_path):
    with pytest.raises(SparkJarsMissingError, match=r"spark-sql-kafka-.*mvn -q package"):
        spark_jars(_dir(tmp_path / "jars", JARS[0]))


def test_the_s3_jars_go_on_the_class_path_with_the_conditional_put_log_store(tmp_path):
    s3 = _dir(tmp_path / "s3", "hadoop-aws-3.5.0.jar", "bundle-2.35.4.jar")
    store = _dir(
        tmp_path / "store", "conditional-put-log-store-a.jar", "conditional-put-log-store-b.jar"
    )
    assert log_store_jar(store) == str(store / "conditional-put-log-store-b.jar")
    conf = SparkResource(
        jars_dir=str(_dir(tmp_path / "jars", *JARS)), s3_jars_dir=str(s3), log_store_dir=str(store)
    ).spark_config()
    assert conf["spark.driver.extraClassPath"] == conf["spark.executor.extraClassPath"] == f"{s3}/*"
    assert conf["spark.jars"].split(",")[-1] == str(store / "conditional-put-log-store-b.jar")
    assert conf[LOG_STORE_CONF] == CONDITIONAL_PUT_LOG_STORE
    assert s3_class_path(tmp_path / "none") is None and log_store_jar(tmp_path / "none") is None


def test_hadoop_aws_of_another_hadoop_than_pysparks_is_refused(tmp_path):
    with pytest.raises(SparkJarsMissingError, match=r"hadoop-aws-1\.0\.0\.jar .* does not match"):
        s3_class_path(_dir(tmp_path / "s3", "hadoop-aws-1.0.0.jar"))


def test_the_driver_starts_on_the_class_archive_made_for_its_java_and_class_path(
    tmp_path, monkeypatch
):
    jars, archives = _dir(tmp_path / "jars", *JARS), tmp_path / "archive s"  # a space, quoted
    extra = {"spark.driver.extraJavaOptions": "-Dmine=1"}

    def conf(**fields) -> dict[str, str]:
        settings = {
            "jvm_archive_dir": str(archives),
            "extra_conf": extra,
            "driver_jit": "tiered",  # no JIT option of its own (test below)
            **fields,
        }
        return SparkResource(
            jars_dir=str(jars), s3_jars_dir=str(tmp_path / "none"), **settings
        ).spark_config()

    assert jvm_archive.DRIVER_OPTIONS not in conf()  # no archive made: none used
    archive = jvm_archive.archive_path(conf(), archives)
    _dir(archives, archive.name)
    # The host's and the user's extraJavaOptions stay as they are; the archive goes before.
    assert conf()[jvm_archive.DRIVER_OPTIONS] == f"-XX:SharedArchiveFile='{archive}'"
    assert conf()["spark.driver.extraJavaOptions"] == "-Dmine=1"
    assert jvm_archive.DRIVER_OPTIONS not in conf(jvm_archive_dir=None)  # off
    # Options that choose their own class sharing get no archive.
    extra["spark.driver.extraJavaOptions"] = "-Xshare:off"
    assert jvm_archive.DRIVER_OPTIONS not in conf()
    extra["spark.driver.extraJavaOptions"] = "-Dmine=1"
    # Another class path (a jar more), another java, a heap past compressed pointers: each is
    # another archive's.
    monkeypatch.setenv("JAVA_HOME", str(_dir(tmp_path / "jdk" / "bin", "java").parent))
    assert jvm_archive.archive_path(conf(), archives) != archive
    monkeypatch.undo()
    assert jvm_archive.archive_path(conf(driver_memory="40g"), archives) != archive
    extra["spark.driver.extraJavaOptions"] = "-Dmine=1 -XX:-UseCompressedOops"
    assert jvm_archive.archive_path(conf(), archives) != archive
    extra["spark.driver.extraJavaOptions"] = "-Dmine=1 -XX:-UseZGC"  # ZGC off: pointers stay
    assert jvm_archive.archive_path(conf(), archives) == archive
    extra["spark.driver.extraJavaOptions"] = "-Dmine=1"
    _dir(jars, "y.jar")
    assert jvm_archive.archive_path(conf(), archives) != archive
    assert jvm_archive.DRIVER_OPTIONS not in conf()


def test_the_class_archive_follows_the_jars_behind_a_class_path_wildcard(tmp_path):
    s3 = _dir(tmp_path / "s3", "hadoop-aws-3.5.0.jar")
    conf = {"spark.jars": "a.jar", "spark.driver.extraClassPath": f"{s3}/*"}
    before = jvm_archive.archive_path(conf, tmp_path)
    os.utime(s3 / "hadoop-aws-3.5.0.jar", ns=(0, 0))  # the same jar copied again: another time
    assert jvm_archive.archive_path(conf, tmp_path) != before


def test_install_keeps_the_archive_jvms_output_in_its_log(tmp_path, capfd):
    """scripts/install.sh's archive step: what the session's JVM (a child process) writes goes
    to the log, and the terminal gets it back afterwards."""
    import subprocess

    log = tmp_path / "jvm-archive.log"
    with jvm_archive._output_to(log):
        subprocess.run(["sh", "-c", "echo spark warning >&2; echo spark out"], check=True)
    subprocess.run(["sh", "-c", "echo after"], check=True)
    assert log.read_text().split() == ["spark", "warning", "spark", "out"]
    assert capfd.readouterr().out == "after\n"


def test_the_driver_compiles_with_c1_only_when_told(tmp_path):
    def options(**fields) -> list[str]:
        conf = SparkResource(
            jars_dir=str(_dir(tmp_path / "jars", *JARS)),
            s3_jars_dir=str(tmp_path / "none"),
            jvm_archive_dir=None,
            **fields,
        ).spark_config()
        return [conf.get(name, "") for name in jvm_archive.USER_OPTIONS]

    mine = {"spark.driver.extraJavaOptions": "-Dmine=1"}
    assert options(extra_conf=mine) == ["", "-Dmine=1"]  # tiered: the JVM's default
    assert options(driver_jit="c1", extra_conf=mine) == [C1_ONLY, "-Dmine=1"]
    # The user's own choice of JIT stands, whichever driver_jit says.
    for own in ("-XX:TieredStopAtLevel=3", "-XX:-TieredCompilation"):
        extra = {"spark.driver.extraJavaOptions": own}
        assert options(driver_jit="c1", extra_conf=extra) == ["", own]
