# Shared by the scripts that start the stack (run.sh, bench-envoy.sh, bench-accuracy.sh): sourced, not run.
#
#   components     ENVOY, REDIS_SERVER, REDIS_CLI, SERVER, WASM from the TOLLGATE_* variables (the
#                  Makefile exports them), else the workspace defaults under $ROOT
#   say, die       messages on stderr prefixed with the script's name
#   require_files  dies naming the first file that is missing
#   free_port      a free 127.0.0.1 port
#   wait_for       waits for a started process to answer, showing its log if it does not
#   listener_yaml, wasm_filter_yaml, cluster_yaml   Envoy configuration pieces (below)
#
# The caller sets ROOT (the repository root) and `set -euo pipefail` before sourcing this.

ENVOY=${TOLLGATE_ENVOY:-$ROOT/.tools/envoy}
REDIS_SERVER=${TOLLGATE_REDIS_SERVER:-$ROOT/.tools/redis-server}
REDIS_CLI=${TOLLGATE_REDIS_CLI:-$ROOT/.tools/redis-cli}
SERVER=${TOLLGATE_SERVER:-$ROOT/dist/tollgate-server}
WASM=${TOLLGATE_WASM:-$ROOT/dist/tollgate.wasm}

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

# Envoy configuration for the benchmarks, as YAML text (tests build theirs in tests/common/envoy.rs).
#
# listener_yaml NAME PORT ADMIN ROUTE [FILTERS] [ACCESS_LOG]: an Envoy bootstrap's admin and its one
# HTTP listener (NAME is also the stat prefix); ROUTE is the route's action (`route: {cluster: x}` or
# a `direct_response`), FILTERS YAML lines placed before the router, ACCESS_LOG a file that gets one
# line per request: its start time in seconds (ms precision) and status. Clusters follow
# (`  clusters:` and cluster_yaml).
listener_yaml() {
  local nl=$'\n' log=""
  if [ -n "${6:-}" ]; then
    log=$(cat <<EOF
          access_log:
          - name: envoy.access_loggers.file
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog
              path: $6
              log_format: {text_format_source: {inline_string: "%START_TIME(%s.%3f)% %RESPONSE_CODE%\n"}}
EOF
)
  fi
  cat <<EOF
admin: {address: {socket_address: {address: 127.0.0.1, port_value: $3}}}
stats_flush_interval: 1s
static_resources:
  listeners:
  - name: $1
    address: {socket_address: {address: 127.0.0.1, port_value: $2}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: $1
${log:+$log$nl}          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {prefix: "/"}
                $4
          http_filters:
${5:+$5$nl}          - name: envoy.filters.http.router
            typed_config: {"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}
EOF
}

# wasm_filter_yaml NAME CODE [CONFIG]: a proxy-wasm filter (v8) running the module CODE, with the
# plugin configuration CONFIG (JSON, one line or several) if given; YAML lines for listener_yaml.
wasm_filter_yaml() {
  cat <<EOF
          - name: envoy.filters.http.wasm
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
              config:
                name: $1
                vm_config:
                  vm_id: $1
                  runtime: envoy.wasm.runtime.v8
                  code: {local: {filename: "$2"}}
EOF
  if [ -n "${3:-}" ]; then
    printf '%s\n' \
      '                configuration:' \
      '                  "@type": type.googleapis.com/google.protobuf.StringValue' \
      '                  value: |'
    printf '%s\n' "$3" | sed 's/^/                    /'
  fi
}

# cluster_yaml NAME [http2] PORT...: a STATIC round-robin cluster over 127.0.0.1:PORT...; with http2,
# spoken over HTTP/2 (the service: gRPC, and the filter's HTTP callouts).
cluster_yaml() {
  local name=$1 eps="" h2="" p; shift
  for p in "$@"; do
    if [ "$p" = http2 ]; then
      h2=$(printf '%s\n' \
        '    typed_extension_protocol_options:' \
        '      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:' \
        '        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions' \
        '        explicit_http_config: {http2_protocol_options: {}}')
    else
      eps+="{endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: $p}}}}, "
    fi
  done
  cat <<EOF
  - name: $name
    type: STATIC
    lb_policy: ROUND_ROBIN
    connect_timeout: 0.25s
    load_assignment:
      cluster_name: $name
      endpoints: [{lb_endpoints: [${eps%, }]}]
EOF
  [ -z "$h2" ] || printf '%s\n' "$h2"
}
