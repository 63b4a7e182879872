#!/usr/bin/env bash
# Installs everything the project needs into the checkout: the virtualenv with the pinned
# Python packages, and the JVM jars from Maven Central (pom.xml → .jars/). Idempotent: a second
# run only checks. Needs python3.11, java 17 and mvn on PATH.
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
  .venv/bin/python -m pip install --quiet --constraint constraints.txt -e ".[dev]"
  rm -f .venv/.installed-* && touch "$stamp"
fi

jar_stamp=.jars/.resolved-$(cat pom.xml jvm/*/pom.xml | sha1sum | cut -c1-12)
if [ ! -f "$jar_stamp" ]; then
  echo "install: JVM jars from Maven Central into .jars/ (pom.xml)"
  rm -rf .jars
  mvn --batch-mode --quiet package
  touch "$jar_stamp"
fi
