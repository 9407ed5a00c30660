#!/usr/bin/env bash
# Accuracy of a fleet, in the same `make bench` run as the speed figures (BENCHMARKS.md, "Accuracy").
#
# Four Envoys (--concurrency 2) run the module in front of one upstream; a front Envoy spreads the
# clients' requests over them round-robin. One bucket for everything (key `literal:…`), a limit of
# RATE per second with a burst of RATE. wrk drives the front well above the limit for SECONDS, once per
# mode (each mode has a bucket of its own, so each starts full):
#   exact   one take per request (batched per worker, service.batch default)
#   lease   lease mode, adaptive size (`"lease": {}`)
# Admitted requests are counted where they arrive, at the upstream (its access log, with each
# request's arrival time in ms). The ideal is what one bucket admits over the same span:
#   ideal = RATE (the burst) + RATE × (last arrival − first arrival)
# so exact mode must equal it within a few tokens (the times are the upstream's, a take happens a
# fraction of a millisecond before), and lease mode may fall short of it by what the pools hold
# unspent, never exceed it.
#
#   scripts/bench-accuracy.sh                 # RATE=1000 SECONDS_PER_MODE=10 CONNECTIONS=32
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
# shellcheck source=scripts/lib.sh
. scripts/lib.sh
RATE=${RATE:-1000}
SECS=${SECONDS_PER_MODE:-10}
CONNECTIONS=${CONNECTIONS:-32}
MODES=${MODES:-exact lease}
FLEET=4
OUT=$ROOT/bench-out/accuracy
WASM=$(readlink -f "$WASM")

require_files "$ENVOY" "$REDIS_SERVER" "$REDIS_CLI" "$SERVER" "$WASM" "$ENVOY_CONFIG"
command -v wrk >/dev/null || die "wrk missing (scripts/tools.sh bench)"
rm -rf "$OUT" && mkdir -p "$OUT"
LOAD0=$(cut -d' ' -f1-3 /proc/loadavg)

trap stop_started EXIT INT TERM
start_redis "$OUT"
start_service "$OUT"

start() { # name config-file log concurrency admin
  # Access log lines reach the file within 100 ms (Envoy's default is 10 s).
  "$ENVOY" -c "$2" --disable-hot-restart --concurrency "$4" --log-level warn --file-flush-interval-msec 100 >"$3" 2>&1 &
  PIDS+=($!)
  wait_for "envoy ($1)" "$3" $! curl -fsS "http://127.0.0.1:$5/ready"
}

UP_PORT=$(free_port); UP_ADMIN=$(free_port)
envoy_config --name upstream --listen "$UP_PORT" --admin "$UP_ADMIN" --stats-flush-s 1 \
  --direct $'ok\n' --access-log "$OUT/upstream-access.log" >"$OUT/upstream.yaml"
start upstream "$OUT/upstream.yaml" "$OUT/upstream.log" 1 "$UP_ADMIN"

# The fleet, one set of four Envoys per mode.
declare -A FRONT
for mode in $MODES; do
  lease=""
  [ "$mode" = lease ] && lease=', "lease": {}'
  # The plugin configuration, as tollgate-envoy-config's builder writes it.
  plugin=(--service-field 'transport="grpc"' --service-field timeout_ms=200
          --field "fallback={\"instances\": $FLEET}"
          --rule "{\"name\": \"all\", \"key\": [\"literal:accuracy-$mode\"], \"capacity\": $RATE, \"rate\": $RATE, \"period_ms\": 1000$lease}")
  ports=()
  for i in $(seq "$FLEET"); do
    port=$(free_port); admin=$(free_port); ports+=("$port")
    envoy_config --listen "$port" --admin "$admin" --stats-flush-s 1 --wasm "$WASM" "${plugin[@]}" \
      --service "$SVC_PORT" --upstream "$UP_PORT" >"$OUT/$mode-$i.yaml"
    start "$mode-$i" "$OUT/$mode-$i.yaml" "$OUT/$mode-$i.log" 2 "$admin"
  done
  port=$(free_port); admin=$(free_port)
  fleet=()
  for p in "${ports[@]}"; do fleet+=(--upstream "$p"); done
  envoy_config --name front --listen "$port" --admin "$admin" --stats-flush-s 1 --upstream-cluster fleet \
    "${fleet[@]}" >"$OUT/$mode-front.yaml"
  start "$mode-front" "$OUT/$mode-front.yaml" "$OUT/$mode-front.log" 2 "$admin"
  FRONT[$mode]=$port
done

RESULTS=$OUT/results.tsv
: >"$RESULTS"
for mode in $MODES; do
  lines0=$(wc -l <"$OUT/upstream-access.log")
  wrk -t1 -c"$CONNECTIONS" -d"${SECS}s" --timeout 2s "http://127.0.0.1:${FRONT[$mode]}/" >"$OUT/wrk-$mode.txt"
  sleep 1
  tail -n +"$((lines0 + 1))" "$OUT/upstream-access.log" >"$OUT/arrivals-$mode.log"
  total=$(awk '/requests in/ {print $1}' "$OUT/wrk-$mode.txt")
  read -r admitted first last < <(awk '$2 == 200 {n++; if (!f || $1 < f) f = $1; if ($1 > l) l = $1}
    END {printf "%d %.3f %.3f\n", n, f, l}' "$OUT/arrivals-$mode.log")
  ideal=$(awk -v r="$RATE" -v f="$first" -v l="$last" 'BEGIN {printf "%d", r + r * (l - f)}')
  printf '%s\t%s\t%s\t%s\t%s\n' "$mode" "$total" "$admitted" "$ideal" "$(awk -v f="$first" -v l="$last" 'BEGIN {printf "%.3f", l - f}')" >>"$RESULTS"
  say "$mode: $admitted admitted of $total requests over ${SECS}s; ideal $ideal"
done

{
  echo "load average before the run: $LOAD0; after: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "$FLEET Envoys (--concurrency 2) behind a round-robin front Envoy, one bucket of $RATE/s (burst $RATE);"
  echo "wrk -t1 -c$CONNECTIONS -d${SECS}s per mode, $(date -u +%Y-%m-%dT%H:%MZ)"
  echo
  echo "| mode | requests sent | admitted (at the upstream) | ideal ($RATE + $RATE/s × span) | admitted / ideal | span s |"
  echo "|---|---|---|---|---|---|"
  awk -F'\t' '{printf "| %s | %d | %d | %d | %.4f | %s |\n", $1, $2, $3, $4, ($4 ? $3 / $4 : 0), $5}' "$RESULTS"
} | tee "$OUT/summary.md"
