#!/usr/bin/env bash
# Envoy's instructions per request, counted by callgrind (BENCHMARKS.md, "Instructions per request").
#
# Wall-clock ratios on these shared 2-core machines move by ±0.1 from round to round; an instruction
# count does not: the same binary, configuration and requests give the same count within a few tenths
# of a percent, whatever else the machine is doing. So the idle path (a request no rule matches
# against the empty wasm filter) and the cost of one exact decision in Envoy are measured here.
#
# Each variant is one Envoy (--concurrency 1, bare: the route answers itself) under
# `valgrind --tool=callgrind`; CLIENTS clients (1: one after the other) send requests on keep-alive
# connections: WARMUP first, then ROUNDS × REQUESTS, the counters zeroed before and dumped after each
# round. Reported: Envoy's instructions per request (all its threads), the median round. The service
# and Redis run normally (not counted).
#   none      no filter
#   empty     the floor of any wasm filter: bench/empty-filter (proxy-wasm SDK, returns Continue)
#   dm-empty  the floor of a native filter: bench/dm-probe, an Envoy dynamic module whose hooks all
#             continue (built here; Envoy finds libdm_probe.so through
#             ENVOY_DYNAMIC_MODULES_SEARCH_PATH)
#   dm-stream the same module sending one message per request on its worker's HTTP/2 stream and
#             waiting for the answer, against bench/stream-probe/server.py (grpcio, installed by
#             `scripts/tools.sh bench`) instead of the service; the peer's count must show every
#             request asked
#   nomatch   Tollgate, its rule matches no request (`path_exact: /never`): the idle path
#   skip      Tollgate in the chain, switched off for the route (FilterConfig `disabled: true`)
#   http      Tollgate exact, one callout per request over HTTP (`"batch": 0`; the service's
#             decision not counted)
#   grpc      the same over gRPC: a message of one take on the worker's stream (`service.stream`,
#             the default with gRPC)
#   grpc-unary  the same as a unary gRPC call per request (`"stream": false`)
#   http-batch  as http with group commit (the default, `"batch": 64`): with CLIENTS > 1, requests
#             that arrive while a callout is in flight leave together in one batch callout
#   grpc-batch, grpc-unary-batch  the same over gRPC: batches as messages on the stream, or as
#             unary calls
#   lease     Tollgate with an adaptive lease: most requests spend a local pool
#   lease-metadata  the same, its capacity read from dynamic metadata (`from_request`) that no
#             filter wrote: the property read, and the rule's own capacity counted as defaulted
#   grpc-post as grpc, each request a POST with a small JSON body (an LLM request's shape) that no
#             rule reads
#   grpc-model  the same, its bucket keyed by the body's `model` (`"model": {"body": true}`): the
#             headers go on, the body is held and scanned, the take sent once the model is read
#             (on this direct-response route the route answers at the headers, before the take)
#   grpc-post-upstream, grpc-model-upstream  the same two forwarded to an upstream
#             (bench/upstream/server.py, not counted) instead of answered by the route: the body's
#             model read before the take, as in production
#   denied    Tollgate exact, its bucket empty (capacity 1 an hour): a flood's request, denied from
#             the remembered denial (one callout a second, `remember_denials_ms`), not by a callout
#   local-denied  no module: Envoy's own local_ratelimit, its bucket empty: what a 429 costs Envoy
#   native-X  variant X (nomatch, skip, http, grpc, grpc-unary, the batches, lease, denied, ...)
#             with the filter's native build (`make native`: dist/libtollgate.so, an Envoy dynamic
#             module) in the wasm module's place, the same plugin configuration
#
# TIER=service counts the decision service instead, TIER=redis Redis (variants http, grpc,
# grpc-unary and http-batch only): that process under callgrind (the service with --worker-threads 1, all its
# threads), the others run normally; its instructions per request are its cost per take.
#
#   scripts/bench-instructions.sh            # REQUESTS=500 ROUNDS=3 WARMUP=2000
#   TIER=service VARIANTS="http grpc" scripts/bench-instructions.sh
#   TIER=redis VARIANTS=http scripts/bench-instructions.sh
#   VARIANTS="empty nomatch" scripts/bench-instructions.sh
#   CLIENTS=8 VARIANTS="http http-batch" scripts/bench-instructions.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
# shellcheck source=scripts/lib.sh
. scripts/lib.sh
VARIANTS=${VARIANTS:-none empty nomatch skip http grpc grpc-unary lease}
REQUESTS=${REQUESTS:-500}
ROUNDS=${ROUNDS:-3}
# 2,000 requests of warm-up: after 300, the first two or three rounds of the exact path still paid
# V8's tier-up (350k, 349k, 349k, then 326k), so their median was not the steady figure.
WARMUP=${WARMUP:-2000}
CLIENTS=${CLIENTS:-1}
TIER=${TIER:-envoy}
# Envoy's counts in bench-out/instructions, the service's and Redis's beside them (bench-compare.sh
# reads all three).
if [ "$TIER" = envoy ]; then OUT=${OUT:-$ROOT/bench-out/instructions}; else OUT=${OUT:-$ROOT/bench-out/instructions-$TIER}; fi
WASM=$(readlink -f "$WASM")

require_files "$ENVOY" "$REDIS_SERVER" "$REDIS_CLI" "$SERVER" "$WASM" "$ENVOY_CONFIG"
command -v valgrind >/dev/null || die "valgrind missing (scripts/tools.sh bench)"
EMPTY_WASM=$ROOT/target/empty-filter/wasm32-wasip1/release/empty_filter.wasm
if [[ " $VARIANTS " == *" empty "* ]]; then
  CARGO_TARGET_DIR=$ROOT/target/empty-filter cargo build --quiet --release --target wasm32-wasip1 \
    --manifest-path bench/empty-filter/Cargo.toml || die "cannot build bench/empty-filter"
  require_files "$EMPTY_WASM"
fi
# The native probe (variants dm-*): its own crate outside the workspace, a shared library Envoy
# loads by name; and the filter's native build (variants native-*). Envoy looks for both in one
# folder of links.
DM_DIR=$ROOT/target/dm-probe/release
MODULES=$ROOT/target/bench-modules
mkdir -p "$MODULES"
export ENVOY_DYNAMIC_MODULES_SEARCH_PATH=$MODULES
if [[ " $VARIANTS " == *" dm-"* ]]; then
  CARGO_TARGET_DIR=$ROOT/target/dm-probe cargo build --quiet --release \
    --manifest-path bench/dm-probe/Cargo.toml || die "cannot build bench/dm-probe"
  require_files "$DM_DIR/libdm_probe.so"
  ln -sf "$DM_DIR/libdm_probe.so" "$MODULES/libdm_probe.so"
fi
if [[ " $VARIANTS " == *" native-"* ]]; then
  require_files "$NATIVE"
  ln -sf "$(readlink -f "$NATIVE")" "$MODULES/libtollgate.so"
fi
PY_GRPC=$ROOT/.tools/py-grpc
if [[ " $VARIANTS " == *" dm-stream "* ]]; then
  [ -d "$PY_GRPC/grpc" ] || die "grpcio missing in $PY_GRPC (scripts/tools.sh bench)"
fi
rm -rf "$OUT" && mkdir -p "$OUT"

trap stop_started EXIT INT TERM
case $TIER in
  envoy) start_redis "$OUT"; start_service "$OUT" ;;
  service) start_redis "$OUT" ;;
  redis) ;;
  *) die "TIER is envoy, service or redis, not $TIER" ;;
esac


# The bench's rule: every request admitted (capacity and rate 10^9 a second), or with $4 set, those
# key and limits instead.
ADMIT_ALL='"key": ["literal:bench"], "capacity": 1000000000, "rate": 1000000000, "period_ms": 1000'
# A callout's timeout of 10 s: the first requests under callgrind wait for V8 to compile the module,
# and a first callout timed out would be admitted on credit, whose debt then rides on the callouts
# after it (an empty bucket never repays it, so its denials would not be remembered either).
# The module with the bench's plugin configuration, as tollgate-envoy-config's builder writes it.
plugin() { # $1: transport, $2: extra rule fields, $3: extra service fields (NAME=JSON ...), $4: key and limits
  local field
  PLUGIN=(--wasm "$WASM" --service-field "transport=\"$1\"" --service-field timeout_ms=10000)
  for field in ${3:-}; do PLUGIN+=(--service-field "$field"); done
  PLUGIN+=(--rule "{\"name\": \"all\", $2 ${4:-$ADMIT_ALL}}")
}

RESULTS=$OUT/results.tsv
: >"$RESULTS"
for variant in $VARIANTS; do
  if [ "$TIER" != envoy ]; then
    case $variant in http | grpc | grpc-unary | http-batch | grpc-batch | grpc-unary-batch) ;;
      *) die "TIER=$TIER: $variant makes no take" ;; esac
  fi
  if [ "$TIER" = service ]; then
    SVC_PORT=$(free_port)
    callgrind_start "$variant" "$OUT" "curl -fsS http://127.0.0.1:$SVC_PORT/healthz" "$SERVER" --listen "127.0.0.1:$SVC_PORT" \
      --redis-url "redis://127.0.0.1:$REDIS_PORT" --log-format text --worker-threads 1
  elif [ "$TIER" = redis ]; then
    REDIS_PORT=$(free_port)
    callgrind_start "$variant" "$OUT" "$REDIS_CLI -p $REDIS_PORT ping" "$REDIS_SERVER" --port "$REDIS_PORT" \
      --bind 127.0.0.1 --save '' --appendonly no --dir "$OUT"
    start_service "$OUT"
  fi
  service=$SVC_PORT
  if [ "$variant" = dm-stream ]; then
    service=$(free_port)
    PYTHONPATH=$PY_GRPC python3 bench/stream-probe/server.py "$service" >"$OUT/peer-$variant.log" 2>&1 &
    peer_pid=$!; PIDS+=("$peer_pid")
    for _ in $(seq 100); do grep -q ready "$OUT/peer-$variant.log" 2>/dev/null && break; sleep 0.1; done
  fi
  port=$(free_port); admin=$(free_port)
  args=(--listen "$port" --admin "$admin" --direct $'hello from the edge\n' --service "$service")
  case $variant in *-upstream)
    up=$(free_port)
    python3 bench/upstream/server.py "$up" >"$OUT/upstream-$variant.log" 2>&1 &
    PIDS+=("$!")
    for _ in $(seq 100); do grep -q ready "$OUT/upstream-$variant.log" 2>/dev/null && break; sleep 0.1; done
    args=(--listen "$port" --admin "$admin" --upstream "$up" --service "$service") ;;
  esac
  base_variant=$variant
  case $variant in native-*)
    base_variant=${variant#native-}
    args+=(--native "$MODULES/libtollgate.so") ;;
  esac
  case $base_variant in
    none) ;;
    empty) args+=(--wasm "$EMPTY_WASM" --bare-module empty) ;;
    dm-empty) args+=(--dynamic-module dm_probe --dynamic-module-config empty) ;;
    dm-stream) args+=(--dynamic-module dm_probe --dynamic-module-config stream) ;;
    nomatch) plugin http '"match": {"path_exact": "/never"},'; args+=("${PLUGIN[@]}") ;;
    skip) plugin http ''; args+=("${PLUGIN[@]}" --skip-module) ;;
    http) plugin http '' 'batch=0'; args+=("${PLUGIN[@]}") ;;
    grpc) plugin grpc '' 'batch=0'; args+=("${PLUGIN[@]}") ;;
    grpc-unary) plugin grpc '' 'batch=0 stream=false'; args+=("${PLUGIN[@]}") ;;
    grpc-post | grpc-post-upstream) plugin grpc '' 'batch=0'; args+=("${PLUGIN[@]}") ;;
    grpc-model | grpc-model-upstream)
      plugin grpc '' 'batch=0' '"key": ["model"], "capacity": 1000000000, "rate": 1000000000, "period_ms": 1000'
      args+=("${PLUGIN[@]}" --field 'model={"body": true}') ;;
    http-batch) plugin http '' 'batch=64'; args+=("${PLUGIN[@]}") ;;
    grpc-batch) plugin grpc '' 'batch=64'; args+=("${PLUGIN[@]}") ;;
    grpc-unary-batch) plugin grpc '' 'batch=64 stream=false'; args+=("${PLUGIN[@]}") ;;
    lease) plugin http '"lease": {},'; args+=("${PLUGIN[@]}") ;;
    lease-metadata) plugin http '"lease": {}, "from_request": {"capacity": {"metadata": ["envoy.filters.http.ext_authz", "limit"], "max": 1000000000}},'
      args+=("${PLUGIN[@]}") ;;
    local-denied) args+=(--local-ratelimit 1,1,3600) ;;
    denied) plugin http '' 'batch=0' '"key": ["literal:denied"], "capacity": 1, "rate": 1, "period_ms": 3600000'
      args+=("${PLUGIN[@]}") ;;
    *) die "unknown variant $variant" ;;
  esac
  envoy_config "${args[@]}" >"$OUT/envoy-$variant.yaml"
  if [ "$TIER" != envoy ]; then
    "$ENVOY" -c "$OUT/envoy-$variant.yaml" --concurrency 1 --disable-hot-restart --log-level warn \
      >"$OUT/envoy-$variant.log" 2>&1 &
    envoy_pid=$!; PIDS+=("$envoy_pid")
    wait_for "envoy ($variant)" "$OUT/envoy-$variant.log" "$envoy_pid" curl -fsS "http://127.0.0.1:$admin/ready"
  else
    callgrind_envoy "$variant" "$OUT" "$admin"
  fi
  statuses=200
  case $base_variant in denied | local-denied) statuses=200,429 ;; esac
  unset DRIVE_BODY
  case $base_variant in grpc-post* | grpc-model*)
    export DRIVE_BODY='{"model":"gpt-4o-mini","messages":[{"role":"user","content":"How many tokens is this?"}],"max_tokens":64}' ;;
  esac
  python3 scripts/drive.py "$port" "$WARMUP" "$CLIENTS" "$statuses" || die "$variant: warm-up failed"
  callgrind_rounds "$variant" "$OUT" "$ROUNDS" "$REQUESTS" python3 scripts/drive.py "$port" "$REQUESTS" "$CLIENTS" "$statuses"
  if [ "$TIER" != envoy ]; then kill "$envoy_pid"; wait "$envoy_pid" 2>/dev/null || true; fi
  if [ "$TIER" = redis ]; then kill "$SVC_PID"; wait "$SVC_PID" 2>/dev/null || true; fi
  if [ "$variant" = dm-stream ]; then
    # Every request must have been asked on the stream, or the figure is not the stream's.
    sleep 2.5 # the peer's next count
    answered=$(tail -n 1 "$OUT/peer-$variant.log")
    kill "$peer_pid" 2>/dev/null || true
    expected=$(( WARMUP + ROUNDS * REQUESTS ))
    python3 -c "import ast,sys; c=ast.literal_eval(sys.argv[1]); sys.exit(0 if c['stream'] == $expected else 1)" \
      "$answered" || die "$variant: the peer answered $answered, not $expected stream messages"
  fi
  say "$variant: ${COUNTS[*]} $TIER instructions per request (median $MEDIAN)"
  printf '%s\t%s\t%s\n' "$variant" "$MEDIAN" "${COUNTS[*]}" >>"$RESULTS"
done

base=$(awk -F'\t' '$1 == "none" {print $2}' "$RESULTS")
counted="Envoy --concurrency 1"
[ "$TIER" = service ] && counted="the service (--worker-threads 1)"
[ "$TIER" = redis ] && counted="Redis"
echo "$counted under callgrind, Envoy bare (direct_response), $ROUNDS × $REQUESTS requests from $CLIENTS keep-alive client(s), $(date -u +%Y-%m-%dT%H:%MZ)"
echo "module: $(stat -c %s "$WASM") bytes"
if [[ " $VARIANTS " == *" dm-"* ]]; then echo "dynamic module: $(stat -c %s "$DM_DIR/libdm_probe.so") bytes"; fi
if [[ " $VARIANTS " == *" native-"* ]]; then echo "native module: $(stat -c %s "$(readlink -f "$NATIVE")") bytes"; fi
echo
echo "| path | instructions per request (median) | rounds | vs no filter |"
echo "|---|---|---|---|"
while IFS=$'\t' read -r variant median rounds; do
  extra="–"
  [ -n "$base" ] && [ "$variant" != none ] && extra=$(awk -v m="$median" -v b="$base" 'BEGIN {printf "%+d", m - b}')
  echo "| $variant | $median | $rounds | $extra |"
done <"$RESULTS"
