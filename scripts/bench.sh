#!/usr/bin/env bash
# The ingest benchmark (issue 5): floor, ours, naive and delta-rs side by side, and a 24-hour
# backfill as one run versus 24 runs. Not part of the tests. Installs what is missing, starts its
# own Kafka broker, and writes benchmarks/results/ingest-<profile>.{json,md,png}.
#   scripts/bench.sh                    the standard profile (about an hour on 2 cores)
#   scripts/bench.sh --profile smoke    a few minutes, to see that it works
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh --bench
exec .venv/bin/python -m benchmarks.run "$@"
