#!/usr/bin/env bash
# Starts the whole stack on 127.0.0.1 and waits; Ctrl-C stops it. `make run` builds first, then calls this.
#
#   Redis            :6390 (or a free port)  data and logs in .run/
#   tollgate-server  :8081                   --redis-url to that Redis
#   Envoy            :10000 edge (Tollgate), :10001 demo upstream, :9901 admin  (envoy.yaml)
#
# This script stays in the foreground on purpose: Envoy dies when its parent exits, so the parent must
# live as long as the stack does.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
# shellcheck source=scripts/lib.sh
. scripts/lib.sh
RUN=$ROOT/.run

require_files "$ENVOY" "$REDIS_SERVER" "$REDIS_CLI" "$SERVER" "$WASM"
# envoy.yaml names the module relative to the repository root.
[ "$WASM" -ef "$ROOT/dist/tollgate.wasm" ] || die "envoy.yaml loads dist/tollgate.wasm; TOLLGATE_WASM=$WASM differs"

port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

for p in 8081 10000 10001 9901; do
  port_busy "$p" && die "port 127.0.0.1:$p is in use (envoy.yaml and the service need it); stop what holds it"
done
REDIS_PORT=6390
port_busy "$REDIS_PORT" && REDIS_PORT=$(free_port)

mkdir -p "$RUN"
PIDS=()
stop() {
  local rc=${1:-0}
  trap - INT TERM EXIT
  say "stopping"
  # Reverse order of start: Envoy, the service, Redis. Each by its own PID.
  for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do
    kill "${PIDS[i]}" 2>/dev/null || true
  done
  for pid in "${PIDS[@]}"; do
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  done
  exit "$rc"
}
trap 'stop 0' INT TERM
trap 'stop $?' EXIT

"$REDIS_SERVER" --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no --dir "$RUN" \
  >"$RUN/redis.log" 2>&1 &
PIDS+=($!)
wait_for "redis on :$REDIS_PORT" "$RUN/redis.log" "${PIDS[-1]}" "$REDIS_CLI" -p "$REDIS_PORT" ping

"$SERVER" --listen 127.0.0.1:8081 --redis-url "redis://127.0.0.1:$REDIS_PORT" --log-format text \
  >"$RUN/service.log" 2>&1 &
PIDS+=($!)
wait_for "tollgate-server on :8081" "$RUN/service.log" "${PIDS[-1]}" curl -fsS http://127.0.0.1:8081/healthz

"$ENVOY" -c envoy.yaml --disable-hot-restart --concurrency 2 --component-log-level wasm:info \
  >"$RUN/envoy.log" 2>&1 &
PIDS+=($!)
wait_for "envoy on :10000" "$RUN/envoy.log" "${PIDS[-1]}" curl -fsS http://127.0.0.1:9901/ready

cat <<EOF

Tollgate is running (rule "per-ip": 5 requests burst per client IP, refilling 1 per second;
rule "llm-tokens" under /v1/: LLM tokens per x-api-key, priced by the response; rule "shaped" under
/v1/shaped: 5 a second per client IP, a request beyond it held until its token is there, up to 3 s).

  for i in \$(seq 7); do curl -si localhost:10000/ | grep -iE '^(HTTP|ratelimit|x-ratelimit|retry-after)'; done
      five 200s, then 429 with Retry-After, RateLimit-Policy/RateLimit and X-RateLimit-*
  for i in 1 2 3; do curl -si localhost:10000/v1/chat/completions -H 'x-api-key: demo' | grep -i '^x-ratelimit-remaining'; done
      tokens, not requests: 10,000 a minute per API key; each call reserves 4,000 and is settled
      to the 42 the stand-in LLM API reports: 6000, then about 5960, 5920
  for i in \$(seq 15); do curl -s -o /dev/null -w '%{http_code} after %{time_total} s, held %header{x-ratelimit-delay-ms} ms\n' localhost:10000/v1/shaped & done; wait
      a burst of 15 curls at 5 a second: all 200, spaced over about 2 s (the first 5 at once,
      then one every 200 ms, each held as long as x-ratelimit-delay-ms says)
  curl -s 'localhost:9901/stats?filter=wasmcustom'   the filter's counters (Envoy admin)
  curl -s localhost:8081/metrics                     the service's metrics
  curl -s localhost:8081/readyz                      the service sees Redis (redis-cli -p $REDIS_PORT)

Logs: .run/envoy.log .run/service.log .run/redis.log      Ctrl-C stops everything.
EOF

# Stay the parent of all three; if one dies, stop the rest.
while :; do
  for pid in "${PIDS[@]}"; do
    if ! kill -0 "$pid" 2>/dev/null; then say "process $pid exited; see .run/*.log"; stop 1; fi
  done
  sleep 1
done
