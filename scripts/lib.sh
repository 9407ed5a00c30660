# Shared by the scripts that start the stack (run.sh, bench-envoy.sh, bench-accuracy.sh): sourced, not run.
#
#   components     ENVOY, REDIS_SERVER, REDIS_CLI, SERVER, WASM, ENVOY_CONFIG from the TOLLGATE_* variables (the
#                  Makefile exports them), else the workspace defaults under $ROOT
#   say, die       messages on stderr prefixed with the script's name
#   require_files  dies naming the first file that is missing
#   free_port      a free 127.0.0.1 port
#   wait_for       waits for a started process to answer, showing its log if it does not
#   PIDS, stop_started   the processes started (below, and by the caller), and their stop on exit
#   start_redis, start_service   Redis and tollgate-server on free ports, waited for (below)
#   envoy_config   an Envoy bootstrap from the workspace's generator (below)
#
# The caller sets ROOT (the repository root) and `set -euo pipefail` before sourcing this.

ENVOY=${TOLLGATE_ENVOY:-$ROOT/.tools/envoy}
REDIS_SERVER=${TOLLGATE_REDIS_SERVER:-$ROOT/.tools/redis-server}
REDIS_CLI=${TOLLGATE_REDIS_CLI:-$ROOT/.tools/redis-cli}
SERVER=${TOLLGATE_SERVER:-$ROOT/dist/tollgate-server}
WASM=${TOLLGATE_WASM:-$ROOT/dist/tollgate.wasm}
# The filter's native build (`make native`): an Envoy dynamic module.
NATIVE=${TOLLGATE_NATIVE:-$ROOT/dist/libtollgate.so}
ENVOY_CONFIG=${TOLLGATE_ENVOY_CONFIG:-$ROOT/target/debug/tollgate-envoy-config}

SCRIPT_NAME=$(basename "$0" .sh)
say() { printf '%s: %s\n' "$SCRIPT_NAME" "$*" >&2; }
die() { say "$*"; exit 1; }

require_files() {
  local f
  for f in "$@"; do
    [ -f "$f" ] || die "missing $f (run \`make build\`, or \`make tools\`)"
  done
}

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# wait_for WHAT LOG PID CMD...: runs CMD until it succeeds, up to 15 s; dies with the end of LOG when
# process PID exits first or time runs out.
wait_for() {
  local what=$1 log=$2 pid=$3; shift 3
  for _ in $(seq 300); do
    if "$@" >/dev/null 2>&1; then say "$what ready"; return 0; fi
    kill -0 "$pid" 2>/dev/null || { tail -n 40 "$log" >&2; die "$what exited (log: $log)"; }
    sleep 0.05
  done
  tail -n 40 "$log" >&2
  die "$what not ready after 15 s (log: $log)"
}

# Every process a script starts goes into PIDS; `trap stop_started EXIT INT TERM` stops them all
# when it exits.
PIDS=()
stop_started() {
  local pid
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
}

# start_redis DIR: a redis-server (no persistence) on a free port, its log in DIR; sets REDIS_PORT
# and REDIS_PID.
start_redis() {
  REDIS_PORT=$(free_port)
  "$REDIS_SERVER" --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no --dir "$1" \
    >"$1/redis.log" 2>&1 &
  REDIS_PID=$!; PIDS+=("$REDIS_PID")
  wait_for redis "$1/redis.log" "$REDIS_PID" "$REDIS_CLI" -p "$REDIS_PORT" ping
}

# start_service DIR [ARG...]: tollgate-server on a free port over start_redis's Redis, with more
# arguments ARG, its log in DIR; sets SVC_PORT and SVC_PID. With SVC_CPUS set, it starts on those
# CPUs (taskset), so that it sizes its runtime to them as a deployment's replica would;
# SVC_LOG names its log (service.log).
start_service() {
  local dir=$1; shift
  local wrap=()
  [ -z "${SVC_CPUS:-}" ] || wrap=(taskset -c "$SVC_CPUS")
  SVC_PORT=$(free_port)
  "${wrap[@]}" "$SERVER" --listen "127.0.0.1:$SVC_PORT" --redis-url "redis://127.0.0.1:$REDIS_PORT" --log-format text \
    "$@" >"$dir/${SVC_LOG:-service.log}" 2>&1 &
  SVC_PID=$!; PIDS+=("$SVC_PID")
  wait_for tollgate-server "$dir/${SVC_LOG:-service.log}" "$SVC_PID" curl -fsS "http://127.0.0.1:$SVC_PORT/healthz"
}

# proc_mem PID: "VmRSS VmHWM" of a running process, in kB (from /proc/PID/status; "0 0" when gone).
proc_mem() {
  awk '/^VmRSS:/ {r = $2} /^VmHWM:/ {h = $2} END {print r + 0, h + 0}' "/proc/$1/status" 2>/dev/null || echo "0 0"
}

# wrk_keys_lua FILE METHOD PATH HEADER BODY: writes a wrk script whose request i carries the key
# `<prefix><i mod n>` and which, after n responses, stops and creates a marker file (n, prefix and the
# marker are wrk's arguments after `--`: `-- N PREFIX MARKER`; see wrk_keys). The key goes into the
# request header HEADER, or, when HEADER is empty, replaces `KEY` in the JSON BODY. With `wrk -t1`
# that is n distinct keys (requests still in flight at the stop repeat early keys). Used to measure
# memory per key.
wrk_keys_lua() {
  local file=$1 method=$2 path=$3 header=$4 body=$5
  cat >"$file" <<EOF
local n, prefix, marker, sent, done = 1, "", nil, 0, 0
function init(args) n = tonumber(args[1]); prefix = args[2] or ""; marker = args[3] end
function request()
  local key = prefix .. (sent % n)
  sent = sent + 1
  local headers, body = {}, nil
  if "$header" ~= "" then headers["$header"] = key
  else headers["content-type"] = "application/json"; body = string.gsub('$body', "KEY", key) end
  return wrk.format("$method", "$path", headers, body)
end
function response(status, headers, body)
  done = done + 1
  if done == n then
    if marker then local f = io.open(marker, "w"); if f then f:close() end end
    wrk.thread:stop()
  end
end
EOF
}

# wrk_keys LUA N PREFIX OUT CONNECTIONS URL: runs `wrk -t1` with a wrk_keys_lua script for N keys
# into OUT. wrk itself waits out its whole -d even once its thread has stopped, so it is interrupted
# (SIGINT: it still prints its report) as soon as the script has seen N responses; 60 s at most.
wrk_keys() {
  local lua=$1 n=$2 prefix=$3 out=$4 conns=$5 url=$6 pid
  rm -f "$out.done"
  wrk -t1 -c"$conns" -d60s --timeout 2s -s "$lua" "$url" -- "$n" "$prefix" "$out.done" >"$out" &
  pid=$!
  for _ in $(seq 1200); do
    [ -e "$out.done" ] && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.05
  done
  kill -INT "$pid" 2>/dev/null || true
  wait "$pid" || true
}

# envoy_config OPTION...: an Envoy bootstrap on stdout, from the workspace's one generator of Envoy
# configuration (testkit/src/envoy.rs, the tests' too), e.g. `envoy_config --listen P --admin A
# --wasm M --plugin-config JSON --service S --upstream U`. The options are listed in
# testkit/src/bin/tollgate-envoy-config.rs; `make envoy-config` builds it.
envoy_config() {
  [ -x "$ENVOY_CONFIG" ] || die "missing $ENVOY_CONFIG (run \`make envoy-config\`)"
  "$ENVOY_CONFIG" "$@"
}

# callgrind_start NAME OUT READY CMD...: CMD under `valgrind --tool=callgrind`, its log OUT/NAME.log,
# its dumps OUT/callgrind-NAME.out.<n>, waited for until the command line READY succeeds (2 minutes
# at most). Sets CG_PID.
callgrind_start() {
  local name=$1 out=$2 ready=$3
  shift 3
  valgrind --tool=callgrind --smc-check=all-non-file --callgrind-out-file="$out/callgrind-$name.out" \
    "$@" >"$out/$name.log" 2>&1 &
  CG_PID=$!; PIDS+=("$CG_PID")
  for _ in $(seq 240); do
    bash -c "$ready" >/dev/null 2>&1 && return 0
    kill -0 "$CG_PID" 2>/dev/null || { tail -n 20 "$out/$name.log" >&2; die "$name: exited under callgrind"; }
    sleep 0.5
  done
  die "$name: not ready under callgrind"
}

# callgrind_envoy NAME OUT ADMIN: Envoy (--concurrency 1, bare) under callgrind_start with the
# configuration OUT/envoy-NAME.yaml, waited for on its admin port ADMIN; its log is OUT/NAME.log.
callgrind_envoy() {
  callgrind_start "$1" "$2" "curl -fsS http://127.0.0.1:$3/ready" \
    "$ENVOY" -c "$2/envoy-$1.yaml" --concurrency 1 --disable-hot-restart --log-level warn
}

# callgrind_rounds NAME OUT ROUNDS REQUESTS CMD...: ROUNDS runs of CMD (which sends REQUESTS
# requests) against callgrind_envoy's Envoy, its counters zeroed before and dumped after each, then
# Envoy stopped. Sets COUNTS (Envoy's instructions per request, one per round) and MEDIAN.
callgrind_rounds() {
  local name=$1 out=$2 rounds=$3 requests=$4 dump
  shift 4
  COUNTS=()
  for round in $(seq "$rounds"); do
    callgrind_control -z "$CG_PID" >/dev/null 2>&1
    "$@" || die "$name: round $round failed"
    dump=$out/callgrind-$name.out.$round
    callgrind_control -d "$CG_PID" >/dev/null 2>&1
    for _ in $(seq 100); do
      [ -s "$dump" ] && break
      sleep 0.1
    done
    [ -s "$dump" ] || die "$name: no callgrind dump $dump"
    COUNTS+=("$(awk -v n="$requests" '/^totals:/ {printf "%.0f", $2 / n}' "$dump")")
  done
  kill "$CG_PID" 2>/dev/null || true
  wait "$CG_PID" 2>/dev/null || true
  MEDIAN=$(printf '%s\n' "${COUNTS[@]}" | sort -n | awk '{a[NR] = $1} END {print a[int((NR + 1) / 2)]}')
}
