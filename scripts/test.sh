#!/usr/bin/env bash
# The whole test suite: installs what is missing, then runs pytest. The tests start their own
# Kafka broker, Spark session and Delta tables; nothing else needs to be running.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
exec .venv/bin/python -m pytest "$@"
