#!/usr/bin/env bash
# Soak of the decision service (`make soak`, not part of `make test`): SOAK_SECONDS (default 600) of
# valid takes at the highest rate the machine sustains, mixed with hostile clients, while Redis is
# killed (SIGKILL) and restarted twice; the service's RSS is sampled every 5 s.
#
#   scripts/soak.sh                       # 10 minutes
#   SOAK_SECONDS=60 scripts/soak.sh       # a short run
#
# Traffic and checks are server/examples/soak.rs: JSON over HTTP/1.1 and gRPC takes on buckets that
# never refill, 4 MB gRPC and 87,000-bucket JSON bodies, takes without the token, malformed and
# 17-bucket bodies, slow bodies and silent connections; every answer checked, and at the end what
# Redis charged compared with what was answered (no decision lost or doubled).
# Redis keeps an append-only file (written before each reply), so a SIGKILL loses no charge that was
# answered. Output: bench-out/soak.csv (the RSS curve) and bench-out/soak-*.log; exit status 1 on any
# lost or doubled decision or wrong answer. Everything listens on 127.0.0.1 and is stopped at exit.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
# shellcheck source=scripts/lib.sh
. scripts/lib.sh

SECS=${SOAK_SECONDS:-600}
OUT=${OUT:-$ROOT/bench-out}
mkdir -p "$OUT"
require_files "$REDIS_SERVER" "$REDIS_CLI" "$SERVER"
say "building the soak driver (release)"
cargo build --locked --release -p tollgate-server --example soak 2>&1 | tail -1 >&2
DRIVER=$ROOT/target/release/examples/soak

RP=$(free_port); SP=$(free_port)
DATA=$(mktemp -d)
TOKEN=$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')
printf '%s\n' "$TOKEN" >"$DATA/token"
PIDS=()
REDIS_PID=
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  # The Redis running now (the first, or the last restart), by the PID recorded at its start.
  if [ -f "$DATA/redis.pid" ]; then kill "$(cat "$DATA/redis.pid")" 2>/dev/null || true; fi
  wait 2>/dev/null || true
  rm -rf "$DATA"
}
trap cleanup EXIT

start_redis() {
  "$REDIS_SERVER" --port "$RP" --bind 127.0.0.1 --dir "$DATA" --save '' \
    --appendonly yes --appendfsync everysec >>"$OUT/soak-redis.log" 2>&1 &
  REDIS_PID=$!
  echo "$REDIS_PID" >"$DATA/redis.pid"
  wait_for redis "$OUT/soak-redis.log" "$REDIS_PID" "$REDIS_CLI" -p "$RP" ping
}

: >"$OUT/soak-redis.log"
start_redis
"$SERVER" --listen "127.0.0.1:$SP" --redis-url "redis://127.0.0.1:$RP" --token-file "$DATA/token" \
  --redis-timeout-ms 200 --log-format json >"$OUT/soak-service.log" 2>&1 &
SERVICE_PID=$!
PIDS+=("$SERVICE_PID")
wait_for tollgate-server "$OUT/soak-service.log" "$SERVICE_PID" curl -sf "http://127.0.0.1:$SP/healthz"

# Redis killed and restarted at one third and two thirds of the run.
(
  for _ in 1 2; do
    sleep $((SECS / 3))
    kill -9 "$(cat "$DATA/redis.pid")"
    echo "$(date +%T) redis killed (SIGKILL)" >>"$OUT/soak-redis.log"
    sleep 2
    "$REDIS_SERVER" --port "$RP" --bind 127.0.0.1 --dir "$DATA" --save '' \
      --appendonly yes --appendfsync everysec >>"$OUT/soak-redis.log" 2>&1 &
    echo "$!" >"$DATA/redis.pid"
    echo "$(date +%T) redis restarted" >>"$OUT/soak-redis.log"
  done
  wait
) &
PIDS+=("$!")

say "soak: ${SECS} s against 127.0.0.1:$SP (Redis on $RP restarted twice)"
set +e
"$DRIVER" --addr "127.0.0.1:$SP" --token "$TOKEN" --pid "$SERVICE_PID" --seconds "$SECS" \
  --out "$OUT/soak.csv" | tee "$OUT/soak-summary.txt"
status=${PIPESTATUS[0]}
set -e
say "service warnings logged: $(grep -c '"level":"WARN"' "$OUT/soak-service.log" || true)"
say "RSS curve: $OUT/soak.csv"
exit "$status"
