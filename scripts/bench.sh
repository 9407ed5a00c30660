#!/usr/bin/env bash
# `make bench`: every benchmark recorded in BENCHMARKS.md, one after the other (never at once: they
# share the machine's cores). Envoy with Tollgate first (the wasm and the native build), in both
# layouts, then a fleet's accuracy and a
# fleet's burst shaped, then Envoy's
# instructions per request (callgrind), the service's and Redis's per take, and a stream message's
# against a unary call, then the
# service alone; last, the figures beside the recorded ones (scripts/bench-compare.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
rc=0
bash scripts/bench-envoy.sh || rc=$?
# The same variants in the production layout (Redis and the service on a core of their own, the
# proxy side on the other), and both layouts side by side.
LAYOUT=production KEYS=0 OUT=bench-out/envoy-production bash scripts/bench-envoy.sh || rc=$?
# The production layout's proxy side is one core: its Envoys with one worker, as a deployment sized
# to it runs them (the native build's stream of takes is then one stream per Envoy).
ENVOY_CONCURRENCY=1 LAYOUT=production KEYS=0 ROUNDS=3 OUT=bench-out/envoy-production-c1 \
  VARIANTS="none local-rl grpc-batch native-grpc-batch nomatch native-nomatch lease-adaptive native-lease-adaptive native-rls" \
  bash scripts/bench-envoy.sh || rc=$?
python3 scripts/bench-layouts.py bench-out/envoy bench-out/envoy-production | tee bench-out/layouts.md || rc=$?
bash scripts/bench-accuracy.sh || rc=$?
# A fleet's burst shaped and not: what reaches the upstream per 100 ms, the 429s, the added wait.
bash scripts/bench-shaping.sh || rc=$?
# The idle path, one exact decision, and a flood's 429 from a remembered denial beside Envoy's own
# (every variant: run the script alone; each costs a minute or two under valgrind).
VARIANTS="none empty nomatch http grpc grpc-unary denied local-denied lease dm-empty native-nomatch native-grpc native-denied native-lease" \
  bash scripts/bench-instructions.sh || rc=$?
# The same decisions in batches (8 clients at once): on the stream, as unary gRPC calls, over HTTP.
CLIENTS=8 VARIANTS="http-batch grpc-batch grpc-unary-batch" OUT=bench-out/instructions-batch \
  bash scripts/bench-instructions.sh || rc=$?
# The service's and Redis's instructions per take, each under callgrind behind a plain Envoy.
TIER=service VARIANTS="http grpc grpc-unary" bash scripts/bench-instructions.sh || rc=$?
TIER=redis VARIANTS=http bash scripts/bench-instructions.sh || rc=$?
# A decision asked over a unary gRPC call against one message on a per-worker stream.
bash scripts/bench-stream.sh || rc=$?
# Redis's and the service's CPU per take as a message carries 1, 4, 16 and 64 takes.
bash scripts/bench-redis-batch.sh || rc=$?
if [ -f scripts/bench-service.sh ]; then
  bash scripts/bench-service.sh || rc=$?
fi
# Each tier's CPU per request and Envoy's instructions per request beside the last recorded figures
# (bench/recorded.tsv): a WARNING line for any that grew more than 10 %, never a failure.
bash scripts/bench-compare.sh || true
exit "$rc"
