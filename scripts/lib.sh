# Shared by the scripts that start the stack (run.sh, bench-envoy.sh): sourced, not run.
#
#   components     ENVOY, REDIS_SERVER, REDIS_CLI, SERVER, WASM from the TOLLGATE_* variables (the
#                  Makefile exports them), else the workspace defaults under $ROOT
#   say, die       messages on stderr prefixed with the script's name
#   require_files  dies naming the first file that is missing
#   free_port      a free 127.0.0.1 port
#   wait_for       waits for a started process to answer, showing its log if it does not
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
