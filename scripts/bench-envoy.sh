#!/usr/bin/env bash
# Envoy with Tollgate, side by side in one run on 127.0.0.1 (BENCHMARKS.md, "Envoy with Tollgate").
#
# Each variant is a fresh Envoy (--concurrency 2, or ENVOY_CONCURRENCY) whose edge listener routes to the same trivial upstream
# (a second Envoy, --concurrency 1, direct_response). Load: wrk -t1 -c16 -d${DURATION}s after a 1 s warm-up.
#   none      no rate limit filter
#   http      Tollgate, JSON over HTTP/2 to tollgate-server, Redis Lua bucket, one callout per request
#             (`"batch": 0`; the filter's default batches)
#   grpc      Tollgate, gRPC to tollgate-server, Redis Lua bucket, each take one message on the
#             worker's stream (`service.stream`, gRPC's default)
#   grpc-unary  as grpc, one unary call per request (`"stream": false`)
#   http-allow  as http, with failure_mode allow: no fallback share is kept in step with the answers
#             (http keeps one per bucket: the cost of a fallback that remembers, on the exact path)
#   http-batch, grpc-batch, grpc-unary-batch  as http / grpc / grpc-unary with group commit
#             (service.batch 64): requests behind a worker's callout (or message) in flight leave
#             together in one batch; grpc-batch is the filter's default configuration
#   grpc-mt, grpc-batch-mt  as grpc / grpc-batch against a second service run as before it sized its
#             runtime (production layout only: started on every core with `--runtime multi-thread`,
#             then pinned; grpc-batch-mt joins the default variants there)
#   native-rls  no Tollgate module: Envoy's own ratelimit filter (RLS v3) against tollgate-server's
#             RLS endpoint (--rls-config), descriptor remote_address
#   fallback  Tollgate with the service down (closed port): breaker open, local buckets only
#   nomatch   Tollgate loaded, its rule matches no request (no callout): the module's fixed cost
#   lease     as http, with lease mode (lease size 100): most requests spend a local pool, no callout
#   lease-adaptive  as lease, the size left to the filter (`"lease": {}`: sized to the key's rate)
#   local-rl  no Tollgate module: Envoy's own local_ratelimit filter (one bucket per Envoy process, so N
#             proxies admit N times the limit): the cost of a limiter that is not global
#   empty     the floor of any wasm filter: bench/empty-filter (proxy-wasm SDK, returns Continue)
#   bare-none, bare-empty, bare-nomatch  none, empty and nomatch on a bare Envoy: the route answers
#             itself (direct_response), no upstream hop; their ratios are against bare-none
#   bare-skip Tollgate in the chain but disabled for the route (a route FilterConfig `disabled: true`,
#             not in the default VARIANTS): what a route without limits costs
#   native-X  variant X (grpc-batch, nomatch, lease-adaptive, ...) with the filter's native build
#             (`make native`: dist/libtollgate.so, an Envoy dynamic module) in the wasm module's
#             place, the same plugin configuration; native-grpc-batch, native-nomatch,
#             native-lease-adaptive and native-bare-nomatch join the default variants
# The limit is high enough that every request is admitted, so what is measured is the per-request path.
# LAYOUT: shared (default), every process free to run on every core; production, the limiter tier
# (Redis, the service) pinned to the last core and the proxy side (wrk, the Envoys, the upstream) to
# the others, as a deployment runs them on separate machines (taskset; at least two cores).
# CPU: utime+stime deltas from /proc/<pid>/stat over the measured run, per process (µs of CPU per request).
# Memory: each variant's VmRSS/VmHWM and Envoy's server.memory_allocated/heap_size after start and after
# the load. Then key churn: Envoys keyed on x-api-key with fallback.max_keys N (fbkeys-N: service down;
# leasekeys-N: lease mode) take KEYS distinct keys twice over, memory read before and after each pass.
#
#   scripts/bench-envoy.sh                    # DURATION=5 CONNECTIONS=16 ROUNDS=3 KEYS=20000
#   ROUNDS=1 KEYS=0 scripts/bench-envoy.sh    # a single round, no key churn
#   KEY_VARIANTS="fbkeys-500" scripts/bench-envoy.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
# shellcheck source=scripts/lib.sh
. scripts/lib.sh
DURATION=${DURATION:-5}
CONNECTIONS=${CONNECTIONS:-16}
VARIANTS_GIVEN=${VARIANTS+yes}
VARIANTS=${VARIANTS:-none local-rl http http-allow http-batch grpc grpc-batch grpc-unary grpc-unary-batch native-rls fallback empty nomatch lease lease-adaptive bare-none bare-empty bare-nomatch native-grpc-batch native-nomatch native-lease-adaptive native-bare-nomatch}
ROUNDS=${ROUNDS:-3}
# Workers of each Envoy under test (2: one per core of the machine; the production layout gives the
# proxy side one core, where ENVOY_CONCURRENCY=1 is what a deployment sized to it would run).
ENVOY_CONCURRENCY=${ENVOY_CONCURRENCY:-2}
LAYOUT=${LAYOUT:-shared}
OUT=${OUT:-$ROOT/bench-out/envoy}
WASM=$(readlink -f "$WASM")

require_files "$ENVOY" "$REDIS_SERVER" "$REDIS_CLI" "$SERVER" "$WASM" "$ENVOY_CONFIG"
# The native build's Envoys find dist/libtollgate.so through the search path.
uses_native=
for v in $VARIANTS; do case $v in native-rls) ;; native-*) uses_native=yes ;; esac; done
if [ -n "$uses_native" ]; then
  require_files "$NATIVE"
  NATIVE=$(readlink -f "$NATIVE")
  export ENVOY_DYNAMIC_MODULES_SEARCH_PATH=${NATIVE%/*}
fi
# The empty filter (variants empty, bare-empty): built here, its own crate outside the workspace.
EMPTY_WASM=$ROOT/target/empty-filter/wasm32-wasip1/release/empty_filter.wasm
if [[ " $VARIANTS " == *" empty "* || " $VARIANTS " == *" bare-empty "* ]]; then
  say "building bench/empty-filter (wasm32-wasip1)"
  CARGO_TARGET_DIR=$ROOT/target/empty-filter cargo build --quiet --release --target wasm32-wasip1 \
    --manifest-path bench/empty-filter/Cargo.toml || die "cannot build bench/empty-filter"
  require_files "$EMPTY_WASM"
fi
command -v wrk >/dev/null || die "wrk missing (scripts/tools.sh bench)"
# The cores of each side ("" in the shared layout: no pinning).
TIER_CPUS="" PROXY_CPUS=""
case $LAYOUT in
  shared) ;;
  production)
    last=$(($(nproc) - 1))
    [ "$last" -ge 1 ] || die "LAYOUT=production needs two cores or more"
    TIER_CPUS=$last PROXY_CPUS=0; [ "$last" -eq 1 ] || PROXY_CPUS=0-$((last - 1))
    command -v taskset >/dev/null || die "taskset missing (util-linux)"
    # The service as it was run before it sized its runtime, for comparison in the same run.
    [ -n "$VARIANTS_GIVEN" ] || VARIANTS="$VARIANTS grpc-batch-mt" ;;
  *) die "LAYOUT=$LAYOUT: shared or production" ;;
esac
# pin CPUS PID: every thread of PID on CPUS (nothing in the shared layout).
pin() { [ -z "$1" ] || taskset -a -pc "$1" "$2" >/dev/null; }
# The load generator, on the proxy side's cores.
load() { if [ -n "$PROXY_CPUS" ]; then taskset -c "$PROXY_CPUS" wrk "$@"; else wrk "$@"; fi; }

rm -rf "$OUT" && mkdir -p "$OUT"
LOAD0=$(cut -d' ' -f1-3 /proc/loadavg)
TCK=$(getconf CLK_TCK)
# utime+stime of a process, in clock ticks.
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat" 2>/dev/null || echo 0; }

trap stop_started EXIT INT TERM

# Shared pieces: Redis, the service, the upstream Envoy.
start_redis "$OUT"

# The limits file of the RLS endpoint (variant native-rls): one bucket per client address, a limit
# no benchmark reaches (every request admitted, like the other variants).
cat >"$OUT/rls-limits.yaml" <<'LIMITS'
domain: bench
descriptors:
  - key: remote_address
    rate_limit: {unit: second, requests_per_unit: 1000000000}
LIMITS
# In the production layout the service starts on the tier's core, so it sizes its runtime to it
# (one core: one thread, `--runtime auto`), as a replica given one core does. Variants ending in
# -mt ask a second one on the same Redis, run as before that: started on every core (a worker
# thread per core, `--runtime multi-thread`), then pinned to the tier's core.
SVC_MT_PORT="" SVC_MT_PID=""
if [ -n "$TIER_CPUS" ]; then
  SVC_LOG=service-mt.log start_service "$OUT" --rls-config "$OUT/rls-limits.yaml" --runtime multi-thread
  SVC_MT_PORT=$SVC_PORT SVC_MT_PID=$SVC_PID
  pin "$TIER_CPUS" "$SVC_MT_PID"
fi
SVC_CPUS=$TIER_CPUS start_service "$OUT" --rls-config "$OUT/rls-limits.yaml"
pin "$TIER_CPUS" "$REDIS_PID"
pin "$TIER_CPUS" "$SVC_PID"

UP_PORT=$(free_port); UP_ADMIN=$(free_port)
envoy_config --name upstream --listen "$UP_PORT" --admin "$UP_ADMIN" --stats-flush-s 1 \
  --direct $'hello from the upstream\n' >"$OUT/upstream.yaml"
"$ENVOY" -c "$OUT/upstream.yaml" --disable-hot-restart --concurrency 1 --log-level warn >"$OUT/upstream.log" 2>&1 &
UP_PID=$!; PIDS+=($UP_PID)
pin "$PROXY_CPUS" "$UP_PID"
wait_for "upstream envoy" "$OUT/upstream.log" $UP_PID curl -fsS "http://127.0.0.1:$UP_ADMIN/ready"

CLOSED_PORT=$(free_port)

# The Envoy under test. $1 = variant.
envoy_yaml() {
  local variant=$1 port=$2 admin=$3 svc_port=$SVC_PORT transport=http match="" lease=""
  local key='"client_ip"'
  # The plugin configuration's fields beside its rule (tollgate-envoy-config's builder writes it).
  # http, grpc, http-allow: one callout per request (the filter's default batches, "batch": 64).
  local plugin=()
  # native-X: variant X with the filter's native build (dist/libtollgate.so) in the wasm
  # module's place (native-rls is Envoy's own ratelimit filter, not one of them).
  local native=()
  case $variant in
    native-rls) ;;
    native-*) variant=${variant#native-}; native=(--native "$NATIVE") ;;
  esac
  case $variant in
    http) plugin+=(--service-field batch=0) ;;
    grpc) transport=grpc; plugin+=(--service-field batch=0) ;;
    http-allow) plugin+=(--field 'failure_mode="allow"' --service-field batch=0) ;;
    http-batch) plugin+=(--service-field batch=64) ;;
    grpc-batch) transport=grpc; plugin+=(--service-field batch=64) ;;
    grpc-unary) transport=grpc; plugin+=(--service-field batch=0 --service-field stream=false) ;;
    grpc-unary-batch) transport=grpc; plugin+=(--service-field batch=64 --service-field stream=false) ;;
    grpc-mt | grpc-batch-mt)
      [ -n "$SVC_MT_PORT" ] || die "$variant: the production layout's variant"
      transport=grpc svc_port=$SVC_MT_PORT
      if [ "$variant" = grpc-mt ]; then plugin+=(--service-field batch=0); else plugin+=(--service-field batch=64); fi ;;
    fallback) svc_port=$CLOSED_PORT ;;
    nomatch | bare-nomatch) match='"match": {"path_exact": "/never"},' ;;
    lease) lease=', "lease": {"size": 100}' ;;
    lease-adaptive) lease=', "lease": {}' ;;
    # Key churn (memory bound): one bucket per x-api-key, a table of N slots.
    fbkeys-*) svc_port=$CLOSED_PORT ;;&
    leasekeys-*) lease=', "lease": {"size": 100}' ;;&
    fbkeys-* | leasekeys-*) key='"header:x-api-key"'; plugin+=(--field "fallback={\"max_keys\": ${variant#*-}}") ;;
  esac
  local args=(--listen "$port" --admin "$admin" --stats-flush-s 1 --service "$svc_port" --upstream "$UP_PORT")
  case $variant in
    bare-*) args+=(--direct $'hello from the edge\n') ;;&
    # The module loaded but switched off for the route: Envoy does not call it at all.
    bare-skip) args+=(--skip-module) ;;
  esac
  case $variant in
    none | bare-none) ;;
    native-rls) args+=(--native-rls bench --rate-limits '[{actions: [{remote_address: {}}]}]'
                       --rls-timeout-ms 100 --rls-allow-on-failure) ;;
    local-rl) args+=(--local-ratelimit 1000000000,1000000000,1) ;;
    empty | bare-empty) args+=(--wasm "$EMPTY_WASM" --bare-module empty) ;;
    *) args+=(--wasm "$WASM" "${native[@]}" --service-field "transport=\"$transport\"" --service-field timeout_ms=100
              "${plugin[@]}"
              --rule "{\"name\": \"per-ip\", $match \"key\": [$key], \"capacity\": 1000000000, \"rate\": 1000000000, \"period_ms\": 1000$lease}"
              --field 'response={"headers": ["draft"], "on_allowed": false}') ;;
  esac
  envoy_config "${args[@]}"
}

# Converts wrk's latency ("1.23ms", "850.00us", "1.01s") to milliseconds.
to_ms() { awk -v v="$1" 'BEGIN { n = v + 0; if (v ~ /us$/) n /= 1000; else if (v ~ /ms$/) n += 0; else if (v ~ /s$/) n *= 1000; printf "%.2f", n }'; }

RESULTS=$OUT/results.tsv
: >"$RESULTS"
# All variants' Envoys run at once (an idle Envoy costs next to nothing); the measurements take turns.
declare -A EPID EPORT EADMIN
start_envoy() {
  local variant=$1 port admin code
  port=$(free_port); admin=$(free_port)
  envoy_yaml "$variant" "$port" "$admin" >"$OUT/envoy-$variant.yaml"
  "$ENVOY" -c "$OUT/envoy-$variant.yaml" --disable-hot-restart --concurrency "$ENVOY_CONCURRENCY" --log-level warn \
    >"$OUT/envoy-$variant.log" 2>&1 &
  EPID[$variant]=$!; EPORT[$variant]=$port; EADMIN[$variant]=$admin; PIDS+=($!)
  pin "$PROXY_CPUS" "${EPID[$variant]}"
  wait_for "envoy ($variant)" "$OUT/envoy-$variant.log" "${EPID[$variant]}" curl -fsS "http://127.0.0.1:$admin/ready"
  code=$(curl -s -o /dev/null -w '%{http_code}' -H 'x-api-key: first' "http://127.0.0.1:$port/")
  [ "$code" = 200 ] || die "$variant: a first request got $code, not 200"
}

# Memory of a variant's Envoy: "VmRSS VmHWM (kB) server.memory_allocated server.memory_heap_size (bytes)
# v8-VMs", the last from the v8 runtime's `active` gauge (one VM per worker, plus the main thread's).
# Envoy updates the server.memory_* gauges when it flushes stats (stats_flush_interval, 1 s here), so
# this waits for one flush first.
envoy_mem() {
  local stats
  sleep 1.1
  stats=$(curl -fsS "http://127.0.0.1:${EADMIN[$1]}/stats?filter=server\.memory_|wasm\.runtime\.v8\.active") || stats=""
  echo "$(proc_mem "${EPID[$1]}") $(awk -F': ' '
    /^server\.memory_allocated:/ {a = $2} /^server\.memory_heap_size:/ {h = $2} /runtime\.v8\.active:/ {v = $2}
    END {print a + 0, h + 0, v + 0}' <<<"$stats")"
}
MEM=$OUT/memory.tsv
: >"$MEM"
for variant in $VARIANTS; do
  start_envoy "$variant"
  printf '%s\tstart\t%s\n' "$variant" "$(envoy_mem "$variant" | tr ' ' '\t')" >>"$MEM"
done

measure() {
  local variant=$1 round=$2 epid=${EPID[$1]} port=${EPORT[$1]} spid=$SVC_PID
  local out="$OUT/wrk-$variant-$round.txt"
  case $variant in *-mt) spid=$SVC_MT_PID ;; esac
  load -t1 -c"$CONNECTIONS" -d1s "http://127.0.0.1:$port/" >/dev/null 2>&1 || true
  local e0 s0 r0 u0 e1 s1 r1 u1
  e0=$(cpu_ticks "$epid"); s0=$(cpu_ticks "$spid"); r0=$(cpu_ticks $REDIS_PID); u0=$(cpu_ticks $UP_PID)
  load -t1 -c"$CONNECTIONS" -d"${DURATION}s" --timeout 2s --latency "http://127.0.0.1:$port/" >"$out"
  e1=$(cpu_ticks "$epid"); s1=$(cpu_ticks "$spid"); r1=$(cpu_ticks $REDIS_PID); u1=$(cpu_ticks $UP_PID)
  local rps p50 p99 total non2xx errors
  rps=$(awk '/^Requests\/sec:/ {print $2}' "$out")
  p50=$(to_ms "$(awk '$1 == "50%" {print $2}' "$out")")
  p99=$(to_ms "$(awk '$1 == "99%" {print $2}' "$out")")
  total=$(awk '/requests in/ {print $1}' "$out")
  non2xx=$(awk '/Non-2xx/ {print $5}' "$out"); non2xx=${non2xx:-0}
  errors=$(awk '/Socket errors/ {print $0}' "$out")
  [ "$non2xx" = 0 ] || say "WARNING: $variant had $non2xx non-2xx responses (the limit should admit all)"
  [ -z "$errors" ] || say "WARNING: $variant: $errors"
  cpu() { awk -v a="$1" -v b="$2" -v n="$total" -v t="$TCK" 'BEGIN { printf "%.1f", (b - a) * 1000 / t * 1000 / n }'; }
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$variant" "$rps" "$p99" "$total" "$non2xx" \
    "$(cpu "$e0" "$e1")" "$(cpu "$s0" "$s1")" "$(cpu "$r0" "$r1")" "$(cpu "$u0" "$u1")" "$round" "$p50" >>"$RESULTS"
  say "round $round, $variant: $rps req/s, p99 $p99 ms, $non2xx non-2xx"
}

# ROUNDS > 1 repeats the whole sequence, interleaved: on a machine shared with other work this keeps
# one disturbed run from deciding a ratio.
for round in $(seq "$ROUNDS"); do
  for variant in $VARIANTS; do measure "$variant" "$round"; done
done
for variant in $VARIANTS; do
  printf '%s\tload\t%s\n' "$variant" "$(envoy_mem "$variant" | tr ' ' '\t')" >>"$MEM"
done

# Key churn: the bound on the filter's shared data. Each Envoy below keys its rule on x-api-key with
# fallback.max_keys N (fbkeys-N: service down, every request in the local fallback buckets;
# leasekeys-N: lease mode against the service, one local pool per key). After a 1 s warm-up on one
# key, wrk sends KEYS distinct keys, then KEYS other ones; memory is read before and after each.
KEYS=${KEYS:-20000}
KEY_VARIANTS=${KEY_VARIANTS:-fbkeys-1000 fbkeys-10000 fbkeys-1000000 leasekeys-1000 leasekeys-10000}
CHURN=$OUT/keys.tsv
: >"$CHURN"
if [ "$KEYS" -gt 0 ]; then
  wrk_keys_lua "$OUT/keys.lua" GET / x-api-key ""
  for variant in $KEY_VARIANTS; do
    start_envoy "$variant"
    wrk -t1 -c"$CONNECTIONS" -d1s -H 'x-api-key: warm' "http://127.0.0.1:${EPORT[$variant]}/" >/dev/null 2>&1 || true
    printf '%s\t0\t0\t0\t%s\n' "$variant" "$(envoy_mem "$variant" | tr ' ' '\t')" >>"$CHURN"
    for phase in 1 2; do
      out=$OUT/wrk-$variant-keys$phase.txt
      wrk_keys "$OUT/keys.lua" "$KEYS" "p$phase-" "$out" "$CONNECTIONS" "http://127.0.0.1:${EPORT[$variant]}/"
      total=$(awk '/requests in/ {print $1}' "$out")
      non2xx=$(awk '/Non-2xx/ {print $5}' "$out"); non2xx=${non2xx:-0}
      [ "$non2xx" = 0 ] || say "WARNING: $variant had $non2xx non-2xx responses"
      printf '%s\t%s\t%s\t%s\t%s\n' "$variant" "$phase" "$total" "$non2xx" "$(envoy_mem "$variant" | tr ' ' '\t')" >>"$CHURN"
      say "keys, $variant, phase $phase: $total requests, RSS/HWM/allocated/heap/VMs $(envoy_mem "$variant")"
    done
    kill "${EPID[$variant]}" 2>/dev/null || true
    wait "${EPID[$variant]}" 2>/dev/null || true
  done
fi

# Each figure is the median over the rounds; the ratio is the median of per-round ratios (a variant's
# req/s over the no-filter req/s of the same round), so a drift in machine load between rounds cancels.
size=$(stat -c %s "$WASM")
{
  echo "load average before the run: $LOAD0; after: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "wrk -t1 -c$CONNECTIONS -d${DURATION}s, Envoy --concurrency $ENVOY_CONCURRENCY, $(nproc) cores, $(date -u +%Y-%m-%dT%H:%MZ), median of $ROUNDS round(s)"
  case $LAYOUT in
    shared) echo "layout: shared (every process on every core)" ;;
    production) echo "layout: production (Redis and the service on CPU $TIER_CPUS; wrk, the Envoys and the upstream on CPU $PROXY_CPUS)" ;;
  esac
  echo "module: $size bytes"
  [ -n "$uses_native" ] && echo "native module: $(stat -c %s "$NATIVE") bytes"
  echo
  python3 - "$RESULTS" $VARIANTS <<'PY'
import statistics, sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1]) if l.strip()]
variants = sys.argv[2:]
by = {}
for r in rows:
    by.setdefault(r[0], {})[int(r[9])] = r
def med(v, col):
    return statistics.median(float(r[col]) for r in by[v].values())
print("| path | req/s | ratio vs no filter | ratio per round | p50 ms | p99 ms | non-2xx | CPU µs per request: Envoy | service | Redis | upstream |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for v in variants:
    if v not in by:
        continue
    per = []
    for rnd, r in sorted(by[v].items()):
        bare = v.startswith("bare-") or v.startswith("native-bare-")
        base = by.get("bare-none" if bare else "none", {}).get(rnd)
        if base and float(base[1]) > 0:
            per.append(float(r[1]) / float(base[1]))
    ratio = f"{statistics.median(per):.2f}" if per else "-"
    rounds = " / ".join(f"{x:.2f}" for x in per) if per else "-"
    non2xx = sum(int(r[4]) for r in by[v].values())
    print(f"| {v} | {med(v, 1):.0f} | {ratio} | {rounds} | {med(v, 10):.2f} | {med(v, 2):.2f} | {non2xx} | "
          f"{med(v, 5):.0f} | {med(v, 6):.0f} | {med(v, 7):.0f} | {med(v, 8):.0f} |")
PY
  echo
  echo "Memory of each variant's Envoy: right after start (one request), and after its ${ROUNDS} round(s) of load"
  echo
  python3 - "$MEM" $VARIANTS <<'PY'
import sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1]) if l.strip()]
m = {(r[0], r[1]): [float(x) for x in r[2:]] for r in rows}  # rss_kB hwm_kB alloc_B heap_B vms
MiB = 1024 * 1024
def vs(v, i, scale):
    base = "bare-none" if v.startswith("bare-") else "none"
    b = m.get((base, "load"))
    if not b or v == base or not b[i]:
        return "–"
    a = m[(v, "load")][i]
    return f"+{(a - b[i]) * scale / MiB:.1f} MiB (×{a / b[i]:.2f})"
print("| path | v8 VMs | RSS after start MiB | RSS after load MiB | peak RSS (VmHWM) MiB | RSS vs no filter | "
      "memory_allocated MiB | memory_heap_size MiB | allocated vs no filter |")
print("|---|---|---|---|---|---|---|---|---|")
for v in sys.argv[2:]:
    if (v, "load") not in m:
        continue
    s, l = m.get((v, "start"), [0] * 5), m[(v, "load")]
    print(f"| {v} | {l[4]:.0f} | {s[0] / 1024:.1f} | {l[0] / 1024:.1f} | {l[1] / 1024:.1f} | {vs(v, 0, 1024)} | "
          f"{l[2] / MiB:.1f} | {l[3] / MiB:.1f} | {vs(v, 2, 1)} |")
PY
  if [ -s "$CHURN" ]; then
    echo
    echo "Key churn: $KEYS distinct x-api-key values, then $KEYS other ones (wrk -t1 -c$CONNECTIONS), one Envoy per setting"
    echo
    python3 - "$CHURN" "$KEYS" <<'PY'
import math, sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1]) if l.strip()]
keys = int(sys.argv[2])
by = {}
for r in rows:
    by.setdefault(r[0], {})[int(r[1])] = r
KiB, MiB = 1024, 1024 * 1024
print("| Envoy | max_keys | allocated before MiB | + after keys 1–N KiB | + after keys N+1–2N KiB | slots in use (expected) | "
      "bytes per new slot, 2nd pass | RSS before → after MiB | requests | non-2xx |")
print("|---|---|---|---|---|---|---|---|---|---|")
for v, ph in by.items():
    if not all(p in ph for p in (0, 1, 2)):
        continue
    mk = int(v.split("-")[1])
    a0, a1, a2 = (float(ph[p][6]) for p in (0, 1, 2))
    r0, r2 = float(ph[0][4]), float(ph[2][4])
    used = [mk * (1 - math.exp(-n * keys / mk)) for n in (1, 2)]  # n keys hashed into mk slots
    # Bytes per slot from the second pass, where warm-up effects are over: only meaningful when it
    # still fills many new slots (a bounded table is already full).
    per = f"{(a2 - a1) / (used[1] - used[0]):.0f}" if used[1] - used[0] >= 5000 else "– (full)"
    reqs = int(ph[1][2]) + int(ph[2][2]); non2xx = int(ph[1][3]) + int(ph[2][3])
    print(f"| {v.split('-')[0]} | {mk:,} | {a0 / MiB:.1f} | {(a1 - a0) / KiB:+,.0f} | {(a2 - a1) / KiB:+,.0f} | "
          f"{used[0]:,.0f} → {used[1]:,.0f} | {per} | {r0 / 1024:.1f} → {r2 / 1024:.1f} | {reqs:,} | {non2xx} |")
PY
  fi
} | tee "$OUT/summary.md"
