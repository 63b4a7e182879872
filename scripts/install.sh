#!/usr/bin/env bash
# Installs everything the project needs into the checkout: the virtualenv with the pinned
# Python packages, the JVM jars from Maven Central (pom.xml → .jars/), and Debian's PostgreSQL
# server (→ .tools/postgresql/). Idempotent: a second run only checks. Needs python3.11, java 17
# and mvn on PATH, and Debian's apt-get and dpkg-deb.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
command -v java >/dev/null || { echo "install: java (17+) is not on PATH" >&2; exit 1; }
command -v mvn >/dev/null || { echo "install: mvn is not on PATH" >&2; exit 1; }

stamp=.venv/.installed-$(cat pyproject.toml constraints.txt | sha1sum | cut -c1-12)
if [ ! -f "$stamp" ]; then
  echo "install: Python packages into .venv (pinned in pyproject.toml)"
  [ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet --constraint constraints.txt -e ".[dev,bench]"
  rm -f .venv/.installed-* && touch "$stamp"
fi

jar_stamp=.jars/.resolved-$(cat pom.xml jvm/*/pom.xml | sha1sum | cut -c1-12)
if [ ! -f "$jar_stamp" ]; then
  echo "install: JVM jars from Maven Central into .jars/ (pom.xml)"
  rm -rf .jars
  mvn --batch-mode --quiet package
  touch "$jar_stamp"
fi

# Debian bookworm's PostgreSQL 15 server, for the Dagster instance on Postgres (tests/deploy,
# deploy/production): downloaded with apt-get into private state (no root, the system's packages
# and apt lists untouched) and unpacked into .tools/postgresql/. The libraries its binaries
# link come along too (all but glibc and the C++ runtime), so the server does not depend on what
# happens to be installed; devtools/postgres.py runs it with them on LD_LIBRARY_PATH.
pg_packages="postgresql-15 libpq5 libicu72 libxml2 libldap-2.5-0 libsasl2-2 libgssapi-krb5-2
  libkrb5-3 libk5crypto3 libkrb5support0 libkeyutils1 libcom-err2 libssl3 liblz4-1 libzstd1
  liblzma5 zlib1g libsystemd0 libcap2 libgcrypt20 libgpg-error0 libpam0g libaudit1 libcap-ng0
  libgnutls30 libp11-kit0 libidn2-0 libunistring2 libtasn1-6 libnettle8 libhogweed6 libgmp10
  libffi8"
pg_dir=.tools/postgresql
pg_stamp=$pg_dir/.installed-$(echo "$pg_packages" | sha1sum | cut -c1-12)
if [ ! -f "$pg_stamp" ]; then
  echo "install: Debian bookworm's PostgreSQL 15 into $pg_dir/ (apt-get download, no root)"
  for tool in apt-get dpkg-deb ldd; do
    command -v "$tool" >/dev/null || { echo "install: $tool is missing (Debian's apt, dpkg)" >&2; exit 1; }
  done
  work=$PWD/.tools/postgresql.download
  rm -rf "$work" "$pg_dir" "$pg_dir.tmp"
  mkdir -p "$work"/state/lists/partial "$work"/cache/archives/partial "$work"/parts "$work"/debs
  keyring=/usr/share/keyrings/debian-archive-keyring.gpg
  for suite in bookworm bookworm-updates; do
    echo "deb [signed-by=$keyring target=Packages] http://deb.debian.org/debian $suite main"
  done >"$work"/sources.list
  echo "deb [signed-by=$keyring target=Packages] http://deb.debian.org/debian-security" \
    "bookworm-security main" >>"$work"/sources.list
  apt_private=(
    -o Dir::State="$work"/state -o Dir::State::status=/dev/null
    -o Dir::Cache="$work"/cache -o Dir::Etc::SourceList="$work"/sources.list
    -o Dir::Etc::SourceParts="$work"/parts -o Dir::Etc::Preferences=/dev/null
    -o Dir::Etc::PreferencesParts="$work"/parts -o Debug::NoLocking=1
    -o APT::Sandbox::User="$(id -un)" -o APT::Architectures="$(dpkg --print-architecture)"
    -o Acquire::Languages=none
  )
  apt-get -qq "${apt_private[@]}" update
  # shellcheck disable=SC2086  # the package list splits on purpose
  (cd "$work"/debs && apt-get -qq "${apt_private[@]}" download $pg_packages)
  mkdir -p "$pg_dir.tmp"
  for deb in "$work"/debs/*.deb; do dpkg-deb -x "$deb" "$pg_dir.tmp"; done
  # JIT is off (no LLVM); documentation and translations are not needed.
  rm -rf "$pg_dir.tmp"/usr/lib/postgresql/15/lib/bitcode "$pg_dir.tmp"/usr/share/doc \
    "$pg_dir.tmp"/usr/share/locale "$pg_dir.tmp"/usr/share/man "$pg_dir.tmp"/usr/share/postgresql/15/man
  (cd "$work"/debs && ls -1 ./*.deb | sed 's|^\./||') >"$pg_dir.tmp"/PACKAGES
  libs=$(find "$PWD/$pg_dir.tmp" -maxdepth 3 -type d -name '*-linux-gnu*' -path '*/lib/*' | paste -sd:)
  # Every library resolves, and from the unpacked tree, except glibc's and the C++ runtime's.
  for binary in postgres initdb pg_ctl; do
    resolved=$(LD_LIBRARY_PATH=$libs ldd "$pg_dir.tmp/usr/lib/postgresql/15/bin/$binary")
    system=$(echo "$resolved" | grep '=>' | grep -v "=> $PWD/$pg_dir.tmp/" |
      grep -vE '^\s*(libc|libm|libresolv|libdl|libpthread|librt|libstdc\+\+|libgcc_s)\.so' || true)
    if [ -n "$system" ]; then
      echo "install: $binary from $pg_dir needs libraries it does not ship:" >&2
      echo "$system" >&2
      exit 1
    fi
  done
  rm -rf "$work"
  mv "$pg_dir.tmp" "$pg_dir"
  touch "$pg_stamp"
fi
