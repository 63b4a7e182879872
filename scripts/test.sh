#!/usr/bin/env bash
# The whole test suite: installs what is missing, then runs pytest. The tests start their own
# Kafka broker, Spark session and Delta tables; nothing else needs to be running.
# CDC_TEST_WORKERS=2 runs the test files in two pytest-xdist workers. The default is one process:
# on 2 cores, two workers took 58 minutes against CI's 66 in one, a gain too small to trade for
# the timing-sensitive fault tests sharing the cores.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
exec .venv/bin/python -m pytest -n "${CDC_TEST_WORKERS:-0}" --dist loadfile "$@"
