#!/usr/bin/env bash
# The whole test suite: installs what is missing, then runs pytest. The tests start their own
# Kafka broker, Spark session and Delta tables; nothing else needs to be running.
# Two workers (pytest-xdist), each test file in one of them: while one worker waits on a broker,
# a Dagster daemon or a child's JVM, the other computes. CDC_TEST_WORKERS=0 runs every test in
# this process.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
exec .venv/bin/python -m pytest -n "${CDC_TEST_WORKERS:-2}" --dist loadfile "$@"
