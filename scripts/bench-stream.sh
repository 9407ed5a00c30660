#!/usr/bin/env bash
# A decision's cost in Envoy over a unary gRPC call against one message on a per-worker stream,
# counted by callgrind (BENCHMARKS.md, "A take as a message on a stream").
#
# bench/stream-probe is a proxy-wasm module that does nothing but ask: per request one unary call
# (`unary`) or one message on its worker's bidirectional stream (`stream`), of a one-bucket take's
# size, then waits for the answer and reads it. Its peer is bench/stream-probe/server.py (grpcio,
# installed by `scripts/tools.sh bench`), whose CPU is not counted. As in bench-instructions.sh:
# Envoy --concurrency 1 under callgrind, bare (the route answers itself), one keep-alive client,
# WARMUP requests first (V8's tier-up), then ROUNDS × REQUESTS, Envoy's instructions per request
# reported per round. The empty wasm filter's and no filter's figures (bench-instructions.sh) are
# the floor both are measured against.
#
#   scripts/bench-stream.sh            # WARMUP=2000 ROUNDS=3 REQUESTS=500
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
# shellcheck source=scripts/lib.sh
. scripts/lib.sh
REQUESTS=${REQUESTS:-500}
ROUNDS=${ROUNDS:-3}
WARMUP=${WARMUP:-2000}
OUT=${OUT:-$ROOT/bench-out/stream}
PY_GRPC=$ROOT/.tools/py-grpc

require_files "$ENVOY" "$ENVOY_CONFIG"
command -v valgrind >/dev/null || die "valgrind missing (scripts/tools.sh bench)"
[ -d "$PY_GRPC/grpc" ] || die "grpcio missing in $PY_GRPC (scripts/tools.sh bench)"
PROBE=$ROOT/target/stream-probe/wasm32-wasip1/release/stream_probe.wasm
CARGO_TARGET_DIR=$ROOT/target/stream-probe cargo build --quiet --release --target wasm32-wasip1 \
  --manifest-path bench/stream-probe/Cargo.toml || die "cannot build bench/stream-probe"
rm -rf "$OUT" && mkdir -p "$OUT"
trap stop_started EXIT INT TERM


for mode in unary stream; do
  peer=$(free_port)
  PYTHONPATH=$PY_GRPC python3 bench/stream-probe/server.py "$peer" >"$OUT/peer-$mode.log" 2>&1 &
  peer_pid=$!; PIDS+=("$peer_pid")
  for _ in $(seq 100); do grep -q ready "$OUT/peer-$mode.log" 2>/dev/null && break; sleep 0.1; done
  port=$(free_port); admin=$(free_port)
  envoy_config --listen "$port" --admin "$admin" --direct $'hello from the edge\n' --service "$peer" \
    --wasm "$PROBE" --plugin-config "$mode" >"$OUT/envoy-$mode.yaml"
  callgrind_envoy "$mode" "$OUT" "$admin"
  sleep 1 # the stream opens on the root context's first tick
  python3 scripts/drive.py "$port" "$WARMUP" || die "$mode: warm-up failed"
  callgrind_rounds "$mode" "$OUT" "$ROUNDS" "$REQUESTS" python3 scripts/drive.py "$port" "$REQUESTS"
  sleep 2.5 # the peer's next count
  answered=$(tail -n 1 "$OUT/peer-$mode.log")
  kill "$peer_pid" 2>/dev/null || true
  say "$mode: ${COUNTS[*]} instructions per request (median $MEDIAN); the peer answered $answered"
  # Every request must have been asked the way the mode says, or the figure is not the mode's.
  expected=$(( WARMUP + ROUNDS * REQUESTS ))
  python3 -c "import ast,sys; c=ast.literal_eval(sys.argv[1]); sys.exit(0 if c['$mode'] == $expected else 1)" \
    "$answered" || die "$mode: the peer answered $answered, not $expected ${mode} requests"
done
