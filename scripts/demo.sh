#!/usr/bin/env bash
# The demo on the embedded defaults: installs what is missing, starts the local Kafka broker and
# the demo producer (in the background: on its first start it seeds the last few closed hours of
# demo CDC events, then keeps writing the current hour's changes as they happen), and starts the
# Dagster UI on the demo tables. Ctrl-C stops Dagster and the producer; `scripts/demo.sh --stop`
# stops the producer and the broker, and `scripts/demo.sh --reset` wipes the local broker data,
# the producer's source database, the lake and the Dagster history first.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

export CDC_KAFKA_PORT=${CDC_KAFKA_PORT:-19092}
export CDC_KAFKA_DATA_DIR=${CDC_KAFKA_DATA_DIR:-$root/.local/kafka}
export CDC_LAKE_ROOT=${CDC_LAKE_ROOT:-$root/.local/lake}
export DAGSTER_HOME=${DAGSTER_HOME:-$root/.local/dagster}
port=${DAGSTER_PORT:-3000}
hours=${DEMO_HOURS:-3}                      # closed hours seeded on the producer's first start
changes=${DEMO_CHANGES_PER_HOUR:-200}
demo_dir=${DEMO_DIR:-$root/.local/demo}     # the producer's state, pid and log
producer_pid_file=$demo_dir/producer.pid
producer_log=$demo_dir/producer.log

# Prints the pid of the running producer of $demo_dir; fails if there is none.
producer_pid() {
  local pid args
  pid=$(cat "$producer_pid_file" 2>/dev/null) || return 1
  # A reused pid, or an exited one (a zombie has no command line), is not ours.
  args=$(ps -o args= -p "$pid" 2>/dev/null) || return 1
  [[ $args == *"demo.produce --follow"* ]] || return 1
  echo "$pid"
}

# Whether process $1 runs (exited children linger as zombies until reaped).
alive() {
  local stat
  stat=$(ps -o stat= -p "$1" 2>/dev/null) || return 1
  [[ -n $stat && $stat != Z* ]]
}

# Whether the producer log has said it is up since line $1.
producer_up() {
  awk -v from="$1" 'NR >= from && /following:/ { up = 1; exit } END { exit !up }' "$producer_log"
}

stop_producer() {
  local pid
  if pid=$(producer_pid); then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 150); do producer_pid >/dev/null || break; sleep 0.1; done
    if producer_pid >/dev/null; then kill -KILL "$pid" 2>/dev/null || true; fi
    echo "demo: producer stopped (pid $pid)"
  fi
  rm -f "$producer_pid_file"
}

case "${1:-}" in
  --stop)
    stop_producer
    exec .venv/bin/python -m devtools.kafka_broker stop ;;
  --reset)
    stop_producer
    [ -x .venv/bin/python ] && .venv/bin/python -m devtools.kafka_broker stop || true
    rm -rf "$CDC_KAFKA_DATA_DIR" "$CDC_LAKE_ROOT" "$DAGSTER_HOME" "$demo_dir" ;;
  "") ;;
  *) echo "usage: scripts/demo.sh [--stop|--reset]" >&2; exit 2 ;;
esac

# A second demo would fail on the port, and its exit would stop the first one's producer.
if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
  echo "demo: port $port is in use (the demo already runs?); choose another with DAGSTER_PORT" >&2
  exit 1
fi

scripts/install.sh
export CDC_KAFKA_BOOTSTRAP_SERVERS
CDC_KAFKA_BOOTSTRAP_SERVERS=$(.venv/bin/python -m devtools.kafka_broker start)

mkdir -p "$demo_dir"
trap stop_producer EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP
if pid=$(producer_pid); then
  echo "demo: the producer already runs (pid $pid)"
else
  log_start=1
  [ -f "$producer_log" ] && log_start=$(($(wc -l < "$producer_log") + 1))
  nohup .venv/bin/python -m demo.produce --follow --state "$demo_dir/source.pickle" \
    --bootstrap "$CDC_KAFKA_BOOTSTRAP_SERVERS" --hours "$hours" --changes-per-hour "$changes" \
    < /dev/null >> "$producer_log" 2>&1 &
  pid=$!
  echo "$pid" > "$producer_pid_file"
  # Up once it says so; a state it cannot continue makes it exit with the reason.
  for _ in $(seq 1 600); do
    producer_up "$log_start" && break
    if ! alive "$pid"; then
      echo "demo: the producer did not start:" >&2
      tail -n "+$log_start" "$producer_log" >&2
      exit 1
    fi
    sleep 0.1
  done
  awk -v from="$log_start" 'NR >= from && /following:/ { print "demo: producer " $0 }' \
    "$producer_log"
fi

mkdir -p "$DAGSTER_HOME"
[ -f "$DAGSTER_HOME/dagster.yaml" ] || cp deploy/local/dagster.yaml "$DAGSTER_HOME/dagster.yaml"
echo
echo "  Dagster UI:  http://127.0.0.1:$port   (assets: customers, orders, order_items)"
echo "  Producer:    ~$changes changes per hour at the current time (pid $pid)"
echo "               log: $producer_log"
echo "  Each hour is materialized once it closes; older hours from an asset's Partitions tab."
echo "  Lake: $CDC_LAKE_ROOT   Broker log: $CDC_KAFKA_DATA_DIR/logs"
echo
# Not exec: the EXIT trap stops the producer when Dagster stops (Ctrl-C).
.venv/bin/dagster dev -w workspace.yaml -h 127.0.0.1 -p "$port"
