#!/usr/bin/env bash
# Installs everything the project needs into the checkout: the virtualenv with the pinned
# Python packages, the JVM jars from Maven Central (pom.xml → .jars/: Spark's, the Kafka broker,
# Kafka Connect and Debezium's connectors; Delta's log store for S3 compiled from jvm/log-store),
# Debian's PostgreSQL and MariaDB (→ .tools/), and the Spark driver's class-data archive
# (→ .jars/jvm-archive/, resources/jvm_archive.py). Idempotent: a second run only checks. Needs
# python3.11, java 17 and mvn on PATH, and Debian's apt-get and dpkg-deb.
# `--demo`: only what the demo needs before its UI answers: no MariaDB (the tests' second CDC
# source) and no class-data archive; `--archive`: that archive alone, once the rest is installed
# (scripts/demo.sh runs it beside the demo's start); `--bench`: the benchmark's packages too
# (scripts/bench.sh), which the tests and the demo don't need.
set -euo pipefail
cd "$(dirname "$0")/.."

# The Spark driver's class-data archive (resources/jvm_archive.py): a session's JVM maps Spark's,
# Delta's and Kafka's classes from it instead of loading them one by one. Made once per java and
# class path (about a minute); without it a session starts as it would anyway, only slower.
# It says itself when it makes one; Spark's output goes to .local/install/jvm-archive.log.
make_archive() {
  .venv/bin/python -c 'import sys; from resources.jvm_archive import main; sys.exit(main())' ||
    echo "install: no class-data archive for the Spark driver (sessions start without one)" >&2
}

demo=false
extras=dev
case "${1:-}" in
  --demo) demo=true ;;
  --archive) make_archive; exit 0 ;;
  --bench) extras=dev,bench ;;
  "") ;;
  *) echo "usage: scripts/install.sh [--demo|--archive|--bench]" >&2; exit 2 ;;
esac

# Each step that does something says so, then how long it took.
took() { echo "install:   done in $((SECONDS - $1)) s"; }

# A tool's own output (pip's notes on the editable build, Maven's colour codes) goes to
# .local/install/NAME.log, written anew by each install; its last lines are shown when it fails.
#   logged NAME COMMAND...
logged_names=" "
logged() {
  local name=$1 log=.local/install/$1.log
  shift
  mkdir -p .local/install
  if [[ $logged_names != *" $name "* ]]; then
    : >"$log"
    logged_names+="$name "
  fi
  echo "\$ $*" >>"$log"
  if ! "$@" >>"$log" 2>&1; then
    tail -n 40 "$log" >&2
    echo "install: $name failed (its output: $log)" >&2
    exit 1
  fi
}

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
command -v java >/dev/null || { echo "install: java (17+) is not on PATH" >&2; exit 1; }
command -v mvn >/dev/null || { echo "install: mvn is not on PATH" >&2; exit 1; }

# One stamp per lock and set of extras; a venv installed with the benchmark's extras also serves
# the tests.
pins=$(cat pyproject.toml constraints.txt | sha1sum | cut -c1-12)
stamp=.venv/.installed-$pins-${extras/,/-}
if [ ! -f "$stamp" ] && ! [ -f ".venv/.installed-$pins-dev-bench" ]; then
  echo "install: Python packages into .venv (pinned in pyproject.toml; extras: $extras)"
  t0=$SECONDS
  [ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
  logged pip .venv/bin/python -m pip install --quiet --upgrade pip
  logged pip .venv/bin/python -m pip install --constraint constraints.txt -e ".[$extras]"
  # A conflict pip's resolver only warns about (exit 0) fails the install here.
  logged pip .venv/bin/python -m pip check
  rm -f .venv/.installed-* && touch "$stamp"
  took "$t0"
fi

jar_stamp=.jars/.resolved-$(cat pom.xml jvm/*/pom.xml | sha1sum | cut -c1-12)
if [ ! -f "$jar_stamp" ]; then
  echo "install: JVM jars from Maven Central into .jars/ (pom.xml)"
  t0=$SECONDS
  rm -rf .jars
  logged mvn mvn --batch-mode package
  touch "$jar_stamp"
  took "$t0"
fi

# Debian's packages for the local servers, downloaded with apt-get from the machine's own
# configured sources into private state (no root; the system's packages and apt lists untouched)
# and unpacked into .tools/<name>/. The libraries their binaries link come along too (all but
# glibc's and the C++ runtime's), so the servers don't depend on what happens to be installed;
# devtools/ runs them with those libraries on LD_LIBRARY_PATH.
#   debian_unpack NAME "PACKAGES" "BINARIES TO CHECK (paths inside the tree)" [PATHS TO DROP]
debian_unpack() {
  local name=$1 packages=$2 binaries=$3 drop=${4:-}
  local dir=.tools/$name
  local stamp=$dir/.installed-$(echo "$packages" | sha1sum | cut -c1-12)
  [ -f "$stamp" ] && return 0
  echo "install: Debian's $name into $dir/ (apt-get download, no root)"
  local t0=$SECONDS
  for tool in apt-get dpkg-deb ldd; do
    command -v "$tool" >/dev/null || { echo "install: $tool is missing (Debian's apt, dpkg)" >&2; exit 1; }
  done
  local work=$PWD/.tools/$name.download
  rm -rf "$work" "$dir" "$dir.tmp"
  mkdir -p "$work"/state/lists/partial "$work"/cache/archives/partial "$work"/debs
  local apt_private=(
    -o Dir::State="$work"/state -o Dir::State::status=/dev/null -o Dir::Cache="$work"/cache
    -o Debug::NoLocking=1 -o APT::Sandbox::User="$(id -un)"
    -o APT::Architectures="$(dpkg --print-architecture)" -o Acquire::Languages=none
  )
  apt-get -qq "${apt_private[@]}" update
  # shellcheck disable=SC2086  # the package list splits on purpose
  (cd "$work"/debs && apt-get -qq "${apt_private[@]}" download $packages)
  mkdir -p "$dir.tmp"
  for deb in "$work"/debs/*.deb; do dpkg-deb -x "$deb" "$dir.tmp"; done
  rm -rf "$dir.tmp"/usr/share/doc "$dir.tmp"/usr/share/locale "$dir.tmp"/usr/share/man
  for path in $drop; do rm -rf "${dir:?}.tmp/$path"; done
  (cd "$work"/debs && ls -1 ./*.deb | sed 's|^\./||') >"$dir.tmp"/PACKAGES
  local libs resolved system binary
  libs=$(find "$PWD/$dir.tmp" -maxdepth 3 -type d -name '*-linux-gnu*' -path '*/lib/*' | paste -sd:)
  # Every library resolves, and from the unpacked tree, except glibc's and the C++ runtime's.
  for binary in $binaries; do
    resolved=$(LD_LIBRARY_PATH=$libs ldd "$dir.tmp/$binary")
    system=$(echo "$resolved" | grep '=>' | grep -v "=> $PWD/$dir.tmp/" |
      grep -vE '^\s*(libc|libm|libresolv|libdl|libpthread|librt|libstdc\+\+|libgcc_s)\.so' || true)
    if [ -n "$system" ]; then
      echo "install: $binary from $dir needs libraries it does not ship:" >&2
      echo "$system" >&2
      exit 1
    fi
  done
  rm -rf "$work"
  mv "$dir.tmp" "$dir"
  touch "$stamp"
  took "$t0"
}

# PostgreSQL 15: the Dagster instance on Postgres (tests/deploy, deploy/production) and the
# demo's and tests' CDC source (logical decoding, devtools/postgres.py). JIT is off (no LLVM).
debian_unpack postgresql "postgresql-15 libpq5 libicu72 libxml2 libldap-2.5-0 libsasl2-2
  libgssapi-krb5-2 libkrb5-3 libk5crypto3 libkrb5support0 libkeyutils1 libcom-err2 libssl3
  liblz4-1 libzstd1 liblzma5 zlib1g libsystemd0 libcap2 libgcrypt20 libgpg-error0 libpam0g
  libaudit1 libcap-ng0 libgnutls30 libp11-kit0 libidn2-0 libunistring2 libtasn1-6 libnettle8
  libhogweed6 libgmp10 libffi8" \
  "usr/lib/postgresql/15/bin/postgres usr/lib/postgresql/15/bin/initdb
  usr/lib/postgresql/15/bin/pg_ctl" \
  "usr/lib/postgresql/15/lib/bitcode usr/share/postgresql/15/man"

# MariaDB 10.11: the MySQL-family CDC source of the tests (devtools/mariadb.py).
$demo || debian_unpack mariadb "mariadb-server-core mariadb-client-core libcrypt1 libnuma1 libpcre2-8-0
  liburing2 libaio1 libsnappy1v5 libssl3 libsystemd0 liblz4-1 libzstd1 libcap2 libgcrypt20
  libgpg-error0 zlib1g liblzma5 libedit2 libbsd0 libmd0 libtinfo6 libncurses6" \
  "usr/sbin/mariadbd usr/bin/mariadb usr/bin/my_print_defaults" \
  "usr/share/mysql/mysql-test"

# The Kafka Connect worker's shifted clock (jvm/connect-clock): a producer interceptor that
# stamps the records of the tests and the demo's seeding with the hour being produced
# (devtools/kafka_connect.py). Compiled against the worker's kafka-clients from .jars/connect.
clock_src=jvm/connect-clock/src/main/java
clock_jar=.jars/connect-clock/shifted-clock-$(cat "$clock_src"/io/cdclake/connect/*.java | sha1sum | cut -c1-12).jar
if [ ! -f "$clock_jar" ]; then
  echo "install: the Connect worker's shifted clock ($clock_jar)"
  t0=$SECONDS
  rm -rf .jars/connect-clock && mkdir -p .jars/connect-clock/classes
  javac --release 17 -nowarn -cp "$(ls .jars/connect/kafka-clients-*.jar)" \
    -d .jars/connect-clock/classes "$clock_src"/io/cdclake/connect/*.java
  jar cf "$clock_jar" -C .jars/connect-clock/classes .
  rm -rf .jars/connect-clock/classes
  took "$t0"
fi

# Delta's log store for a lake on S3 with more than one writer (jvm/log-store): commit files are
# created with S3 conditional writes. Compiled against Delta's storage jar (.jars/spark), S3A
# (.jars/s3) and pyspark's Hadoop; SparkResource hands it to Spark (spark.jars).
store_src=jvm/log-store/src/main/java
store_jar=.jars/log-store/conditional-put-log-store-$(cat "$store_src"/io/cdclake/delta/*.java .jars/spark/delta-storage-*.jar .jars/s3/hadoop-aws-*.jar | sha1sum | cut -c1-12).jar
if [ ! -f "$store_jar" ]; then
  echo "install: Delta's conditional-put log store for S3 ($store_jar)"
  t0=$SECONDS
  pyspark_jars=$(.venv/bin/python -c 'import pathlib, pyspark; print(pathlib.Path(pyspark.__file__).parent / "jars")')
  rm -rf .jars/log-store && mkdir -p .jars/log-store/classes
  javac --release 17 -nowarn \
    -cp "$(ls .jars/spark/delta-storage-*.jar):$(ls .jars/s3/hadoop-aws-*.jar):$(ls .jars/s3/bundle-*.jar):$pyspark_jars/*" \
    -d .jars/log-store/classes "$store_src"/io/cdclake/delta/*.java
  jar cf "$store_jar" -C .jars/log-store/classes .
  rm -rf .jars/log-store/classes
  took "$t0"
fi

$demo || make_archive
