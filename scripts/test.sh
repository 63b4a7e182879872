#!/usr/bin/env bash
# The whole test suite: installs what is missing, then runs pytest. The tests start their own
# Kafka broker, Spark session and Delta tables; nothing else needs to be running.
# CDC_TEST_WORKERS=2 runs the test files in two pytest-xdist workers. The default is one process:
# on 2 cores two workers took 58 minutes instead of about 66, and under that load the race in
# tests/faults/test_replays_and_orders.py did not happen, so that test failed.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
exec .venv/bin/python -m pytest -n "${CDC_TEST_WORKERS:-0}" --dist loadfile "$@"
