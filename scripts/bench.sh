#!/usr/bin/env bash
# `make bench`: every benchmark recorded in BENCHMARKS.md, one after the other (never at once: they
# share the machine's cores). Envoy with Tollgate first, then a fleet's accuracy, then Envoy's
# instructions per request (callgrind), then the service alone.
set -euo pipefail
cd "$(dirname "$0")/.."
rc=0
bash scripts/bench-envoy.sh || rc=$?
bash scripts/bench-accuracy.sh || rc=$?
# The idle path and one exact decision (every variant: run the script alone; each costs a minute or two
# under valgrind).
VARIANTS="none empty nomatch http" bash scripts/bench-instructions.sh || rc=$?
if [ -f scripts/bench-service.sh ]; then
  bash scripts/bench-service.sh || rc=$?
fi
exit "$rc"
