#!/usr/bin/env bash
# The demo on the embedded defaults: installs what is missing, starts the local Kafka broker,
# seeds the last few closed hours of demo CDC events (once), and starts the Dagster UI on the
# demo tables. Ctrl-C stops Dagster; `scripts/demo.sh --stop` stops the broker too, and
# `scripts/demo.sh --reset` wipes the local broker data, lake and Dagster history first.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

export CDC_KAFKA_PORT=${CDC_KAFKA_PORT:-19092}
export CDC_KAFKA_DATA_DIR=${CDC_KAFKA_DATA_DIR:-$root/.local/kafka}
export CDC_LAKE_ROOT=${CDC_LAKE_ROOT:-$root/.local/lake}
export DAGSTER_HOME=${DAGSTER_HOME:-$root/.local/dagster}
port=${DAGSTER_PORT:-3000}
hours=${DEMO_HOURS:-6}

case "${1:-}" in
  --stop) exec .venv/bin/python -m devtools.kafka_broker stop ;;
  --reset)
    [ -x .venv/bin/python ] && .venv/bin/python -m devtools.kafka_broker stop || true
    rm -rf "$CDC_KAFKA_DATA_DIR" "$CDC_LAKE_ROOT" "$DAGSTER_HOME" "$root/.local/demo-seeded" ;;
  "") ;;
  *) echo "usage: scripts/demo.sh [--stop|--reset]" >&2; exit 2 ;;
esac

scripts/install.sh
export CDC_KAFKA_BOOTSTRAP_SERVERS
CDC_KAFKA_BOOTSTRAP_SERVERS=$(.venv/bin/python -m devtools.kafka_broker start)

if [ ! -f "$root/.local/demo-seeded" ]; then
  echo "demo: seeding the last $hours closed hours of CDC events into $CDC_KAFKA_BOOTSTRAP_SERVERS"
  .venv/bin/python -m demo.produce --bootstrap "$CDC_KAFKA_BOOTSTRAP_SERVERS" --hours "$hours"
  date -u +%Y-%m-%dT%H:%M:%SZ > "$root/.local/demo-seeded"
fi

mkdir -p "$DAGSTER_HOME"
[ -f "$DAGSTER_HOME/dagster.yaml" ] || cp deploy/local/dagster.yaml "$DAGSTER_HOME/dagster.yaml"
echo
echo "  Dagster UI: http://127.0.0.1:$port   (assets: customers, orders, order_items)"
echo "  Seeded hours end at $(date -u +%Y-%m-%dT%H:00Z); materialize them from an asset's"
echo "  Partitions tab. Lake: $CDC_LAKE_ROOT   Broker log: $CDC_KAFKA_DATA_DIR/logs"
echo
exec .venv/bin/dagster dev -w workspace.yaml -h 127.0.0.1 -p "$port"
