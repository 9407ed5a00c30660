#!/usr/bin/env bash
# Redis's and the service's CPU per take as the batch grows (BENCHMARKS.md, "Redis's work per take
# in a batch"): one take script run per message of N takes, for N in BATCHES.
#
# Redis and a service (`--coalesce 0`: each message of the stream is one script call of its N
# takes, never merged with another's) on one Redis; server/examples/loadgen.rs sends TakeStream
# messages of N takes of one bucket that never runs dry (every take runs the whole script and
# writes), CONNECTIONS connections, CONCURRENCY messages in flight, SECONDS_PER_RUN each. Reported
# per take: Redis's and the service's CPU (utime+stime from /proc over the run), takes/s. Loopback
# only, bounded in time.
#
#   scripts/bench-redis-batch.sh        # BATCHES="1 4 16 64" CONNECTIONS=2 CONCURRENCY=8 SECONDS_PER_RUN=4
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
# shellcheck source=scripts/lib.sh
. scripts/lib.sh
BATCHES=${BATCHES:-1 4 16 64}
CONNECTIONS=${CONNECTIONS:-2}
CONCURRENCY=${CONCURRENCY:-8}
SECS=${SECONDS_PER_RUN:-4}
OUT=${OUT:-$ROOT/bench-out/redis-batch}
require_files "$REDIS_SERVER" "$REDIS_CLI" "$SERVER"
cargo build --quiet --release -p tollgate-server --example loadgen || die "cannot build loadgen"
LOADGEN=$ROOT/target/release/examples/loadgen
rm -rf "$OUT" && mkdir -p "$OUT"
trap stop_started EXIT INT TERM
TCK=$(getconf CLK_TCK)
ticks() { awk '{print $14 + $15}' "/proc/$1/stat" 2>/dev/null || echo 0; }

start_redis "$OUT"
start_service "$OUT" --coalesce 0 --redis-timeout-ms 1000
"$LOADGEN" --addr "127.0.0.1:$SVC_PORT" --mode stream --connections 1 --concurrency 2 --seconds 1 >/dev/null

{
  echo "loadgen stream: $CONNECTIONS connections, $CONCURRENCY messages in flight, ${SECS} s per batch size, $(nproc) cores, $(date -u +%Y-%m-%dT%H:%MZ)"
  echo
  echo "| takes per message | takes/s | Redis CPU µs per take | service CPU µs per take | message p99 ms |"
  echo "|---|---|---|---|---|"
} >"$OUT/table.md"
for n in $BATCHES; do
  r0=$(ticks "$REDIS_PID"); s0=$(ticks "$SVC_PID")
  line=$("$LOADGEN" --addr "127.0.0.1:$SVC_PORT" --mode stream --connections "$CONNECTIONS" \
    --concurrency "$CONCURRENCY" --seconds "$SECS" --batch "$n" | tail -1)
  r1=$(ticks "$REDIS_PID"); s1=$(ticks "$SVC_PID")
  echo "$line" >>"$OUT/loadgen.txt"
  takes=$(sed -E 's/.* decisions=([0-9]+) .*/\1/' <<<"$line")
  rate=$(sed -E 's/.*decisions_per_s=([0-9.]+) .*/\1/' <<<"$line")
  p99=$(sed -E 's/.*p99_ms=([0-9.]+) .*/\1/' <<<"$line")
  errors=$(sed -E 's/.* errors=([0-9]+) .*/\1/' <<<"$line")
  [ "$errors" = 0 ] || say "WARNING: batch $n: $errors errors"
  per() { awk -v a="$1" -v b="$2" -v n="$takes" -v t="$TCK" 'BEGIN { printf "%.2f", (b - a) * 1e6 / t / n }'; }
  printf '| %s | %s | %s | %s | %s |\n' "$n" "$rate" "$(per "$r0" "$r1")" "$(per "$s0" "$s1")" "$p99" >>"$OUT/table.md"
  say "batch $n: $rate takes/s, Redis $(per "$r0" "$r1") µs, service $(per "$s0" "$s1") µs per take"
done
cat "$OUT/table.md"
