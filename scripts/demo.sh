#!/usr/bin/env bash
# The demo on the embedded defaults: installs what is missing, starts the local Kafka broker and
# the demo shop's real source (demo/shop.py, in the background: PostgreSQL with logical decoding,
# a Kafka Connect worker and Debezium's Postgres connector with its default settings; on its
# first start it writes the last few closed hours of changes, then keeps changing the shop at the
# current time), and starts the Dagster UI on the demo tables. Ctrl-C stops Dagster and the
# shop's workload; `scripts/demo.sh --stop` stops the workload, the source, the Connect worker and
# the broker, and `scripts/demo.sh --reset` wipes the broker data, the shop's database, the
# lake and the Dagster history first.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

export CDC_KAFKA_PORT=${CDC_KAFKA_PORT:-19092}
export CDC_KAFKA_DATA_DIR=${CDC_KAFKA_DATA_DIR:-$root/.local/kafka}
export CDC_LAKE_ROOT=${CDC_LAKE_ROOT:-$root/.local/lake}
export DAGSTER_HOME=${DAGSTER_HOME:-$root/.local/dagster}
port=${DAGSTER_PORT:-3000}
hours=${DEMO_HOURS:-3}                      # closed hours seeded on the first start
changes=${DEMO_CHANGES_PER_HOUR:-200}
demo_dir=${DEMO_DIR:-$root/.local/demo}     # the workload's pid, log and tables file
shop_pid_file=$demo_dir/shop.pid
shop_log=$demo_dir/shop.log

# Prints the pid of the running shop workload; fails if there is none.
shop_pid() {
  local pid args
  pid=$(cat "$shop_pid_file" 2>/dev/null) || return 1
  # A reused pid, or an exited one (a zombie has no command line), is not ours.
  args=$(ps -o args= -p "$pid" 2>/dev/null) || return 1
  [[ $args == *"demo.shop up"* ]] || return 1
  echo "$pid"
}

# Whether process $1 runs (exited children linger as zombies until reaped).
alive() {
  local stat
  stat=$(ps -o stat= -p "$1" 2>/dev/null) || return 1
  [[ -n $stat && $stat != Z* ]]
}

# Whether the shop's log has said $2 (an awk pattern) since line $1.
shop_said() {
  awk -v from="$1" "NR >= from && $2 { found = 1; exit } END { exit !found }" "$shop_log"
}

stop_shop() {
  local pid
  if pid=$(shop_pid); then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 150); do shop_pid >/dev/null || break; sleep 0.1; done
    if shop_pid >/dev/null; then kill -KILL "$pid" 2>/dev/null || true; fi
    echo "demo: shop workload stopped (pid $pid)"
  fi
  rm -f "$shop_pid_file"
}

stop_servers() {
  [ -x .venv/bin/python ] || return 0
  .venv/bin/python -m demo.shop down --bootstrap "127.0.0.1:$CDC_KAFKA_PORT" || true
  local broker
  broker=$(.venv/bin/python -m devtools.kafka_broker stop) || broker="not stopped (see above)"
  echo "demo: Kafka broker ${broker/not running/was not running}"
}

case "${1:-}" in
  --stop)
    stop_shop
    stop_servers
    echo "demo: Dagster itself stops with Ctrl-C in the terminal that runs scripts/demo.sh;"
    echo "      the lake and the instance stay under .local/ (scripts/demo.sh --reset starts afresh)"
    exit 0 ;;
  --reset)
    stop_shop
    stop_servers
    rm -rf "$CDC_KAFKA_DATA_DIR" "$CDC_LAKE_ROOT" "$DAGSTER_HOME" "$demo_dir" \
      "$root/.local/shop-db" "$root/.local/connect" ;;
  "") ;;
  *) echo "usage: scripts/demo.sh [--stop|--reset]" >&2; exit 2 ;;
esac

# A second demo would fail on the port, and its exit would stop the first one's workload.
if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
  echo "demo: port $port is in use (the demo already runs?); choose another with DAGSTER_PORT" >&2
  exit 1
fi

scripts/install.sh --demo
# The Spark driver's class-data archive, made beside the demo's start: the UI needs none, and a
# run that starts before it is there starts without it (slower, not wrong; the archive is
# written aside and renamed when whole). Its lines go to .local/install/archive.out.
mkdir -p "$root/.local/install"
nohup scripts/install.sh --archive < /dev/null >> "$root/.local/install/archive.out" 2>&1 &
export CDC_KAFKA_BOOTSTRAP_SERVERS
CDC_KAFKA_BOOTSTRAP_SERVERS=$(.venv/bin/python -m devtools.kafka_broker start)

mkdir -p "$demo_dir"
web_pid=
stop_all() {
  # The webserver stops its own code server on the way out: waited for, so none is left over.
  if [ -n "$web_pid" ]; then
    kill -TERM "$web_pid" 2>/dev/null || true
    wait "$web_pid" 2>/dev/null || true
  fi
  stop_shop
}
trap stop_all EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP

# Waits until the shop's log says $2 (an awk pattern) since line $1; a shop that exits or takes
# 5 minutes makes the demo stop with the shop's own lines.
await_shop() {
  local from=$1 pattern=$2
  for _ in $(seq 1 3000); do
    shop_said "$from" "$pattern" && return 0
    if ! alive "$pid"; then
      echo "demo: the shop did not start:" >&2
      tail -n "+$from" "$shop_log" >&2
      exit 1
    fi
    sleep 0.1
  done
  echo "demo: the shop did not start within 5 minutes:" >&2
  tail -n "+$from" "$shop_log" >&2
  exit 1
}

log_start=
if pid=$(shop_pid); then
  echo "demo: the shop workload already runs (pid $pid)"
else
  log_start=1
  [ -f "$shop_log" ] && log_start=$(($(wc -l < "$shop_log") + 1))
  echo "demo: starting the shop's Postgres, Kafka Connect and Debezium (first start: seeding" \
    "$hours hours; log $shop_log)"
  nohup .venv/bin/python -m demo.shop up --bootstrap "$CDC_KAFKA_BOOTSTRAP_SERVERS" \
    --hours "$hours" --changes-per-hour "$changes" --tables-file "$demo_dir/tables.yaml" \
    < /dev/null >> "$shop_log" 2>&1 &
  pid=$!
  echo "$pid" > "$shop_pid_file"
  # The shop writes the tables file first, before Kafka Connect and the seeding (the slow part).
  await_shop "$log_start" "/tables file:/"
fi
# The demo's tables, their partitions starting at the demo's first hour (demo/shop.py writes it).
export CDC_TABLES_FILE=$demo_dir/tables.yaml

mkdir -p "$DAGSTER_HOME"
[ -f "$DAGSTER_HOME/dagster.yaml" ] || cp deploy/local/dagster.yaml "$DAGSTER_HOME/dagster.yaml"
# The mirrors' pools exist before the first run is queued: Dagster 1.13 creates a pool at its
# default limit when it first sees it queued, and does not apply that limit in the same pass, so
# the first tick's runs would all start at once (docs/deploy.md, one writer per table).
.venv/bin/dagster instance concurrency set cdc_mirrors 1 >/dev/null
.venv/bin/dagster instance concurrency set cdc_mirrors_tier0 1 >/dev/null
# The webserver (the UI) as soon as the tables file is there; the daemon (sensors, run queue)
# once the shop follows the clock, so that its first tick finds the seeded hours whole instead
# of launching runs of half-seeded ones. Both as in production (docs/deploy.md), on this
# instance; `dagster dev` would start the two together.
.venv/bin/dagster-webserver -w workspace.yaml -h 127.0.0.1 -p "$port" &
web_pid=$!
echo
echo "  Dagster UI:  http://127.0.0.1:$port   (assets: customers, orders, order_items)"
echo "  Source:      Postgres on 127.0.0.1:15433 (database shop), Debezium in Kafka Connect"
echo "               on http://127.0.0.1:18083, ~$changes changes per table and hour (pid $pid)"
echo "               log: $shop_log"
echo "  Each hour is materialized once it closes; older hours from an asset's Partitions tab."
echo "  Lake: $CDC_LAKE_ROOT   Broker log: $CDC_KAFKA_DATA_DIR/logs"
echo
if [ -n "$log_start" ]; then
  await_shop "$log_start" "/following:/"
  awk -v from="$log_start" 'NR >= from && /seeded:|following:/ { print "demo: shop " $0 }' \
    "$shop_log"
fi
if ! alive "$web_pid"; then
  echo "demo: the webserver exited (its lines are above)" >&2
  exit 1
fi
# Not exec: the EXIT trap stops the webserver and the workload when the daemon stops (Ctrl-C).
.venv/bin/dagster-daemon run -w workspace.yaml
