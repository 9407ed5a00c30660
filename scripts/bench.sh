#!/usr/bin/env bash
# `make bench`: every benchmark recorded in BENCHMARKS.md, one after the other (never at once: they
# share the machine's cores). Envoy with Tollgate first, then a fleet's accuracy, then the service alone.
set -euo pipefail
cd "$(dirname "$0")/.."
rc=0
bash scripts/bench-envoy.sh || rc=$?
bash scripts/bench-accuracy.sh || rc=$?
if [ -f scripts/bench-service.sh ]; then
  bash scripts/bench-service.sh || rc=$?
fi
exit "$rc"
