#!/usr/bin/env bash
# Decision service throughput vs Redis alone, side by side in one run, on one Redis.
#
#   scripts/bench-service.sh            # defaults: concurrency 32, 5 s per measurement
#   CONCURRENCY=64 SECONDS_PER_RUN=10 scripts/bench-service.sh
#
# 1. redis-benchmark runs the service's own take script (EVALSHA, one token-bucket key) at the
#    given concurrency: the ceiling, Redis alone.
# 2. The service (dist/tollgate-server or target/x86_64-unknown-linux-musl/release/tollgate-server) on the same Redis, driven
#    at the same concurrency by server/examples/loadgen.rs over gRPC (HTTP/2; unary, and as messages on
#    one TakeStream stream per task) and JSON over HTTP/2,
#    by h2load (nghttp2-client; C, cheap per request) over gRPC and JSON over HTTP/2 when it is
#    installed, and by wrk (JSON over HTTP/1.1, one connection per in-flight request). The service
#    runs with its default settings (takes arriving together coalesced into one batch script call);
#    then, unless COALESCE_OFF=0, the h2load and wrk rows again against a second service on the same
#    Redis with --coalesce 0 (one script call per take), for comparison in the same run.
# Prints decisions/s, the ratio to Redis alone, p50/p99 latency of a take, and the CPU each
# process used (2 cores are shared by the load generator, the service and Redis).
# 3. Memory: the service's RSS after that load (Redis store); Redis's used_memory per bucket (INFO
#    memory before/after REDIS_BUCKETS distinct buckets taken through the service, token bucket and
#    fixed window); a memory-store service's RSS before/after MEMORY_BUCKETS distinct buckets.
# Everything listens on 127.0.0.1 (free ports) and is stopped at exit.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
# shellcheck source=scripts/lib.sh
. scripts/lib.sh # proc_mem, wrk_keys_lua, wrk_keys (the definitions below take precedence)

CONCURRENCY=${CONCURRENCY:-32}
COALESCE_OFF=${COALESCE_OFF:-1}
SECS=${SECONDS_PER_RUN:-5}
REDIS_BUCKETS=${REDIS_BUCKETS:-50000}
MEMORY_BUCKETS=${MEMORY_BUCKETS:-100000}
REDIS_SERVER=${TOLLGATE_REDIS_SERVER:-$ROOT/.tools/redis-server}
REDIS_CLI=${TOLLGATE_REDIS_CLI:-$ROOT/.tools/redis-cli}
OUT=${OUT:-$ROOT/bench-out}
mkdir -p "$OUT"

say() { printf 'bench-service: %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }
[ -x "$REDIS_SERVER" ] || die "redis-server not found at $REDIS_SERVER (bash scripts/tools.sh)"
[ -x "$REDIS_CLI" ] || die "redis-cli not found at $REDIS_CLI"
command -v redis-benchmark >/dev/null || die "redis-benchmark not found (apt-get install redis-tools)"
command -v wrk >/dev/null || die "wrk not found (bash scripts/tools.sh bench)"

if [ -n "${TOLLGATE_SERVER:-}" ] && [ -x "${TOLLGATE_SERVER}" ]; then SERVER=$TOLLGATE_SERVER
elif [ -x dist/tollgate-server ]; then SERVER=$ROOT/dist/tollgate-server
elif [ -x target/x86_64-unknown-linux-musl/release/tollgate-server ]; then SERVER=$ROOT/target/x86_64-unknown-linux-musl/release/tollgate-server
else
  say "building the service (release)"
  cargo build --release --target x86_64-unknown-linux-musl -p tollgate-server
  SERVER=$ROOT/target/x86_64-unknown-linux-musl/release/tollgate-server
fi
say "building the load generator (release)"
cargo build --release -p tollgate-server --example loadgen 2>&1 | tail -1 >&2
LOADGEN=$ROOT/target/release/examples/loadgen

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'; }
RP=$(free_port); SP=$(free_port)

PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

# CPU seconds used so far by a process (utime + stime).
cpu_s() { awk -v hz="$(getconf CLK_TCK)" '{printf "%.2f", ($14 + $15) / hz}' "/proc/$1/stat" 2>/dev/null || echo 0; }

"$REDIS_SERVER" --port "$RP" --bind 127.0.0.1 --save '' --appendonly no --daemonize no >"$OUT/redis.log" 2>&1 &
REDIS_PID=$!; PIDS+=("$REDIS_PID")
for _ in $(seq 100); do "$REDIS_CLI" -p "$RP" PING >/dev/null 2>&1 && break; sleep 0.05; done

# The exact script the service runs for a take of token buckets: prelude, token bucket, one take,
# take driver (store/redis/scripts.rs, `take_script_source(Some(TokenBucket))`).
# Its ARGV per bucket (take.lua's header): algorithm, capacity, rate, period_ms, cost, lease.
SCRIPT=$(python3 - <<'EOF'
import pathlib
d = pathlib.Path("server/src/store/lua")
print("\n".join((d / f).read_text() for f in ["prelude.lua", "token_bucket.lua", "take_one.lua", "take.lua"]), end="")
EOF
)
SHA=$("$REDIS_CLI" -p "$RP" SCRIPT LOAD "$SCRIPT")
CAP=1000000000
RKEY="bench:tb:{redis-alone}:$CAP:$CAP:1000"
N=$((SECS * 80000))
LOAD0=$(cut -d' ' -f1-3 /proc/loadavg)
# Redis alone is measured before and after the service runs; ratios use the faster of the two (the
# harder bar), since other load on the machine moves absolute rates from minute to minute.
redis_alone() { # -> sets REDIS_RPS REDIS_P50 REDIS_P99 REDIS_US
  say "redis-benchmark: EVALSHA take script, -c $CONCURRENCY, -n $N"
  local r0; r0=$(cpu_s "$REDIS_PID")
  redis-benchmark -h 127.0.0.1 -p "$RP" -c "$CONCURRENCY" -n "$N" --csv \
    EVALSHA "$SHA" 1 "$RKEY" 0 "$CAP" "$CAP" 1000 1 1 >"$OUT/redis-benchmark.csv"
  REDIS_US=$(awk -v a="$r0" -v b="$(cpu_s "$REDIS_PID")" -v n="$N" 'BEGIN{printf "%.0f", 1e6*(b-a)/n}')
  # "test","rps","avg_latency_ms","min_latency_ms","p50_latency_ms","p95_latency_ms","p99_latency_ms","max_latency_ms"
  grep -q '^"EVALSHA' "$OUT/redis-benchmark.csv" || die "redis-benchmark failed: $(cat "$OUT/redis-benchmark.csv")"
  read -r REDIS_RPS REDIS_P50 REDIS_P99 < <(tail -1 "$OUT/redis-benchmark.csv" | tr -d '"' | awk -F, '{print $2, $5, $7}')
  say "redis alone: $REDIS_RPS/s p50 ${REDIS_P50}ms p99 ${REDIS_P99}ms"
  REDIS_ROWS+=("$(printf '| %-40s | %9.0f | %5s | %10s | %10s | %-16s |' "Redis alone (redis-benchmark EVALSHA)" "$REDIS_RPS" "RATIO" "$REDIS_P50" "$REDIS_P99" "- / $REDIS_US / -")")
  REDIS_BEST=$(awk -v a="${REDIS_BEST:-0}" -v b="$REDIS_RPS" 'BEGIN{print (b > a) ? b : a}')
}
REDIS_ROWS=()
redis_alone

"$SERVER" --listen "127.0.0.1:$SP" --redis-url "redis://127.0.0.1:$RP" --redis-timeout-ms 1000 \
  --key-prefix "bench:" >"$OUT/service.log" 2>&1 &
SERVICE_PID=$!; PIDS+=("$SERVICE_PID")
for _ in $(seq 100); do curl -sf "http://127.0.0.1:$SP/readyz" >/dev/null 2>&1 && break; sleep 0.05; done
curl -sf "http://127.0.0.1:$SP/readyz" >/dev/null || die "service not ready (see $OUT/service.log)"

# Warm-up: connections, script cache.
"$LOADGEN" --addr "127.0.0.1:$SP" --mode grpc --concurrency 8 --connections 2 --seconds 1 >/dev/null

RESULTS=()
RATES=()
measure() { # name, command...; the command prints "decisions/s p50 p99" on its last line
  local name=$1; shift
  local s0 r0 s1 r1
  s0=$(cpu_s "$SERVICE_PID"); r0=$(cpu_s "$REDIS_PID")
  local TIMEFORMAT='%U %S'
  { time "$@" >"$OUT/line.txt"; } 2>"$OUT/time.txt"
  s1=$(cpu_s "$SERVICE_PID"); r1=$(cpu_s "$REDIS_PID")
  local rps p50 p99
  read -r rps p50 p99 < <(tail -1 "$OUT/line.txt")
  local gen; gen=$(tail -1 "$OUT/time.txt" | awk '{print $1 + $2}')
  # CPU time per decision, in microseconds: robust to other load on the machine, unlike rates.
  local per
  per=$(awk -v s="$(awk -v a="$s0" -v b="$s1" 'BEGIN{print b-a}')" -v r="$(awk -v a="$r0" -v b="$r1" 'BEGIN{print b-a}')" \
            -v g="$gen" -v n="$rps" -v t="$SECS" 'BEGIN{d=n*t; printf "%.0f / %.0f / %.0f", 1e6*s/d, 1e6*r/d, 1e6*g/d}')
  RESULTS+=("$(printf '| %-40s | %9.0f | %5s | %10s | %10s | %-16s |' "$name" "$rps" "RATIO" "$p50" "$p99" "$per")")
  RATES+=("$rps")
  say "$name: $rps/s, p50 ${p50}ms p99 ${p99}ms, CPU us/decision service/redis/loadgen $per"
}

lg() { # mode connections -> "rps p50 p99"
  "$LOADGEN" --addr "127.0.0.1:$SP" --mode "$1" --connections "$2" --concurrency "$CONCURRENCY" --seconds "$SECS" \
    | tee -a "$OUT/loadgen.txt" \
    | sed -E 's/.*decisions_per_s=([0-9.]+) p50_ms=([0-9.]+) p99_ms=([0-9.]+).*/\1 \2 \3/'
}
wrk_h1() {
  cat >"$OUT/take.lua" <<EOF
wrk.method = "POST"
wrk.headers["content-type"] = "application/json"
wrk.body = '{"buckets":[{"key":"bench-wrk","capacity":$CAP,"rate":$CAP,"period_ms":1000,"cost":1}]}'
EOF
  wrk -t1 -c"$CONCURRENCY" -d"${SECS}s" --latency -s "$OUT/take.lua" "http://127.0.0.1:$SP/v1/take" >"$OUT/wrk.txt"
  local rps p50 p99 non2xx
  non2xx=$(awk '/Non-2xx/{print $NF}' "$OUT/wrk.txt"); [ -z "$non2xx" ] || die "wrk saw $non2xx non-2xx answers"
  rps=$(awk '/Requests\/sec/{print $2}' "$OUT/wrk.txt")
  p50=$(to_ms "$(awk '$1=="50%"{print $2}' "$OUT/wrk.txt")")
  p99=$(to_ms "$(awk '$1=="99%"{print $2}' "$OUT/wrk.txt")")
  echo "$rps $p50 $p99"
}

allowed_total() { curl -sf "http://127.0.0.1:$SP/metrics" | awk '/^tollgate_decisions_total\{outcome="allowed"\}/{print $2}'; }
to_ms() { awk -v v="$1" 'BEGIN{ if (v ~ /us$/) {sub(/us/,"",v); print v/1000} else if (v ~ /ms$/) {sub(/ms/,"",v); print v+0} else {sub(/s/,"",v); print v*1000} }'; }
h2l() { # content-type body-file path -> "rps mean max" (h2load reports no percentiles)
  local before after ok rps mean max
  before=$(allowed_total); before=${before:-0}
  h2load -D "$SECS" -c 4 -m $((CONCURRENCY / 4)) -t 1 -d "$2" -H "content-type: $1" -H 'te: trailers' \
    "http://127.0.0.1:$SP$3" >"$OUT/h2load.txt" 2>&1
  after=$(allowed_total)
  ok=$(awk '/^requests:/{print $8}' "$OUT/h2load.txt")
  # gRPC errors arrive as HTTP 200 with a grpc-status trailer: count decisions on the service side.
  awk -v a="$before" -v b="$after" -v n="$ok" 'BEGIN{exit !(b - a >= n && n > 0)}' \
    || die "h2load: $ok answers but $((after - before)) allowed decisions (see $OUT/h2load.txt)"
  rps=$(awk '/^finished in/{print $4}' "$OUT/h2load.txt")
  mean=$(to_ms "$(awk '/^time for request:/{print $6}' "$OUT/h2load.txt")")
  max=$(to_ms "$(awk '/^time for request:/{print $5}' "$OUT/h2load.txt")")
  echo "$rps mean:$mean max:$max"
}

HAVE_H2LOAD=0
if command -v h2load >/dev/null; then
  HAVE_H2LOAD=1
  python3 - "$OUT/grpc-body.bin" "$OUT/json-body.txt" "$CAP" <<'PY'
"""Request bodies for h2load in scripts/bench-service.sh: a gRPC-framed tollgate.v1.TakeRequest and
the same take as JSON. Usage: bench-bodies.py GRPC_OUT JSON_OUT CAPACITY"""
import sys


def varint(n):
    out = b""
    while True:
        b, n = n & 0x7F, n >> 7
        if n:
            out += bytes([b | 0x80])
        else:
            return out + bytes([b])


def field(num, wire, payload):
    return varint((num << 3) | wire) + payload


cap = int(sys.argv[3])
key = b"bench-h2load"
# Bucket{key=1, capacity=2, rate=3, period_ms=4, cost=5} in TakeRequest{buckets=1}, then the
# 5-byte gRPC frame header (uncompressed flag, big-endian length).
bucket = (field(1, 2, varint(len(key)) + key) + field(2, 0, varint(cap)) + field(3, 0, varint(cap))
          + field(4, 0, varint(1000)) + field(5, 0, varint(1)))
req = field(1, 2, varint(len(bucket)) + bucket)
with open(sys.argv[1], "wb") as f:
    f.write(b"\x00" + len(req).to_bytes(4, "big") + req)
with open(sys.argv[2], "w") as f:
    f.write('{"buckets":[{"key":"bench-h2load-json","capacity":%d,"rate":%d,"period_ms":1000,"cost":1}]}' % (cap, cap))
PY
  measure "service, gRPC (h2load, 4 conns)" h2l application/grpc "$OUT/grpc-body.bin" /tollgate.v1.RateLimiter/Take
  measure "service, JSON over h2 (h2load, 4 conns)" h2l application/json "$OUT/json-body.txt" /v1/take
else
  say "h2load not installed (apt-get install nghttp2-client): skipping the h2load rows"
fi
measure "service, gRPC (loadgen, 4 h2 conns)" lg grpc 4
measure "service, gRPC stream (loadgen, 4 h2 conns)" lg stream 4
measure "service, JSON over h2 (loadgen)" lg h2 4
measure "service, JSON over HTTP/1.1 (wrk)" wrk_h1
read -r SVC_RSS SVC_HWM < <(proc_mem "$SERVICE_PID")

# The same rows with coalescing off: a second service on the same Redis, one script call per take.
if [ "$COALESCE_OFF" != 0 ]; then
  SP0=$(free_port)
  "$SERVER" --listen "127.0.0.1:$SP0" --redis-url "redis://127.0.0.1:$RP" --redis-timeout-ms 1000 \
    --key-prefix "bench:" --coalesce 0 >"$OUT/service-nocoalesce.log" 2>&1 &
  SERVICE0_PID=$!; PIDS+=("$SERVICE0_PID")
  for _ in $(seq 100); do curl -sf "http://127.0.0.1:$SP0/readyz" >/dev/null 2>&1 && break; sleep 0.05; done
  curl -sf "http://127.0.0.1:$SP0/readyz" >/dev/null || die "service (--coalesce 0) not ready"
  "$LOADGEN" --addr "127.0.0.1:$SP0" --mode grpc --concurrency 8 --connections 2 --seconds 1 >/dev/null
  read -r SP SP0 <<<"$SP0 $SP"; read -r SERVICE_PID SERVICE0_PID <<<"$SERVICE0_PID $SERVICE_PID"
  if [ "$HAVE_H2LOAD" = 1 ]; then
    measure "--coalesce 0: service, gRPC (h2load)" h2l application/grpc "$OUT/grpc-body.bin" /tollgate.v1.RateLimiter/Take
    measure "--coalesce 0: service, JSON over h2 (h2load)" h2l application/json "$OUT/json-body.txt" /v1/take
  fi
  measure "--coalesce 0: service, JSON over HTTP/1.1 (wrk)" wrk_h1
  read -r SP SP0 <<<"$SP0 $SP"; read -r SERVICE_PID SERVICE0_PID <<<"$SERVICE0_PID $SERVICE_PID"
  kill "$SERVICE0_PID" 2>/dev/null || true
fi

redis_alone

# Memory per bucket. Each wrk_keys pass takes one token from each of N new buckets (keys mem-<i>),
# with limits whose state outlives the measurement (a token bucket refills 1 of 10 tokens in 6 min; a
# fixed window of one day), so none expires in between.
MEM_ROWS=()
redis_used() { "$REDIS_CLI" -p "$RP" INFO memory | awk -F: '/^used_memory:/ {print $2 + 0}'; }
for alg in token_bucket fixed_window; do
  [ "$REDIS_BUCKETS" -gt 0 ] || break
  wrk_keys_lua "$OUT/keys-$alg.lua" POST /v1/take "" \
    "{\"buckets\":[{\"key\":\"KEY\",\"capacity\":10,\"rate\":10,\"period_ms\":$([ $alg = token_bucket ] && echo 3600000 || echo 86400000),\"cost\":1,\"algorithm\":\"$alg\"}]}"
  m0=$(redis_used); k0=$("$REDIS_CLI" -p "$RP" DBSIZE)
  wrk_keys "$OUT/keys-$alg.lua" "$REDIS_BUCKETS" "mem-$alg-" "$OUT/wrk-keys-$alg.txt" "$CONCURRENCY" "http://127.0.0.1:$SP/v1/take"
  m1=$(redis_used); k1=$("$REDIS_CLI" -p "$RP" DBSIZE)
  sample=$("$REDIS_CLI" -p "$RP" KEYS "bench:*{mem-$alg-1}*" | head -1 || true)
  non2xx=$(awk '/Non-2xx/{print $NF}' "$OUT/wrk-keys-$alg.txt"); [ -z "$non2xx" ] || die "wrk saw $non2xx non-2xx answers"
  MEM_ROWS+=("$(awk -v a="$alg" -v m0="$m0" -v m1="$m1" -v k0="$k0" -v k1="$k1" -v s="$sample" 'BEGIN {
    printf "| Redis used_memory, %s | %d keys | %+.1f MiB | **%.0f bytes** per bucket (key such as `%s`, %d bytes) |",
      a, k1 - k0, (m1 - m0) / 1048576, (k1 > k0) ? (m1 - m0) / (k1 - k0) : 0, s, length(s) }')")
  say "redis, $alg: $((k1 - k0)) new keys, used_memory $m0 -> $m1"
done

# The memory store: a second service without Redis.
if [ "$MEMORY_BUCKETS" -gt 0 ]; then
  MP=$(free_port)
  # Room for every bucket of the measurement (the store refuses new buckets past its cap).
  "$SERVER" --listen "127.0.0.1:$MP" --memory-max-buckets $((MEMORY_BUCKETS + 10000)) \
    >"$OUT/service-memory.log" 2>&1 &
  MEM_PID=$!; PIDS+=("$MEM_PID")
  for _ in $(seq 100); do curl -sf "http://127.0.0.1:$MP/readyz" >/dev/null 2>&1 && break; sleep 0.05; done
  curl -sf "http://127.0.0.1:$MP/readyz" >/dev/null || die "memory-store service not ready (see $OUT/service-memory.log)"
  wrk_keys_lua "$OUT/keys-memory.lua" POST /v1/take "" \
    '{"buckets":[{"key":"KEY","capacity":10,"rate":10,"period_ms":3600000,"cost":1}]}'
  # Warm-up on 1,000 keys of their own (connections, tokio workers, the map's first growth).
  wrk_keys "$OUT/keys-memory.lua" 1000 "warm-" "$OUT/wrk-keys-memory-warm.txt" "$CONCURRENCY" "http://127.0.0.1:$MP/v1/take"
  read -r r0 _ < <(proc_mem "$MEM_PID")
  d0=$(curl -sf "http://127.0.0.1:$MP/metrics" | awk '/^tollgate_decisions_total\{outcome="allowed"\}/{print $2}')
  wrk_keys "$OUT/keys-memory.lua" "$MEMORY_BUCKETS" "mem-" "$OUT/wrk-keys-memory.txt" "$CONCURRENCY" "http://127.0.0.1:$MP/v1/take"
  read -r r1 h1 < <(proc_mem "$MEM_PID")
  d1=$(curl -sf "http://127.0.0.1:$MP/metrics" | awk '/^tollgate_decisions_total\{outcome="allowed"\}/{print $2}')
  non2xx=$(awk '/Non-2xx/{print $NF}' "$OUT/wrk-keys-memory.txt"); [ -z "$non2xx" ] || die "wrk saw $non2xx non-2xx answers"
  MEM_ROWS+=("$(awk -v n="$MEMORY_BUCKETS" -v d="$((${d1%.*} - ${d0%.*}))" -v r0="$r0" -v r1="$r1" -v h1="$h1" 'BEGIN {
    printf "| service RSS, memory store | %d keys (%d takes) | %.1f → %.1f MiB (peak %.1f) | **%.0f bytes** per bucket |",
      n, d, r0 / 1024, r1 / 1024, h1 / 1024, (r1 - r0) * 1024 / n }')")
  say "memory store: RSS $r0 -> $r1 kB after $MEMORY_BUCKETS keys"
fi

ratio() { awk -v a="$1" -v b="$REDIS_BEST" 'BEGIN{printf "%.2f", a/b}'; }
{
  echo "concurrency $CONCURRENCY, $SECS s per run, $(nproc) cores shared by load generator, service and Redis"
  echo "load average before: $LOAD0; ratios against the faster Redis-alone run ($REDIS_BEST/s)"
  echo
  echo "| path | decisions/s | ratio | p50 ms (h2load: mean) | p99 ms (h2load: max) | CPU µs/decision: service / redis / load gen |"
  echo "|---|---|---|---|---|---|"
  printf '%s\n' "${REDIS_ROWS[0]/RATIO/$(ratio "$(echo "${REDIS_ROWS[0]}" | awk -F'|' '{print $3+0}')")}"
  for i in "${!RESULTS[@]}"; do
    printf '%s\n' "${RESULTS[$i]/RATIO/$(ratio "${RATES[$i]}")}"
  done
  printf '%s\n' "${REDIS_ROWS[1]/RATIO/$(ratio "$(echo "${REDIS_ROWS[1]}" | awk -F'|' '{print $3+0}')")}"
  echo
  echo "| memory | buckets | change | per bucket |"
  echo "|---|---|---|---|"
  printf '| service RSS, Redis store, after the runs above | – | %.1f MiB (peak %.1f) | – |\n' \
    "$(awk -v k="$SVC_RSS" 'BEGIN{print k / 1024}')" "$(awk -v k="$SVC_HWM" 'BEGIN{print k / 1024}')"
  [ ${#MEM_ROWS[@]} -eq 0 ] || printf '%s\n' "${MEM_ROWS[@]}"
  echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
} | tee "$OUT/service-bench.md"
