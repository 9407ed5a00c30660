#!/usr/bin/env bash
# Runs a test command, passes its output through, and closes with one line that adds up every
# `test result:` line cargo printed: `tests: N passed, N failed`. (cargo prints one result per test
# binary; the last one is often an example's empty `0 passed`, which would misstate the run.)
set -uo pipefail
log=$(mktemp)
trap 'rm -f "$log"' EXIT
"$@" 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
read -r passed failed < <(sed -nE 's/^test result: [A-Za-z]+\. ([0-9]+) passed; ([0-9]+) failed.*/\1 \2/p' "$log" \
  | awk '{p += $1; f += $2} END {print p + 0, f + 0}')
echo
echo "tests: $passed passed, $failed failed"
if [ "$status" -eq 0 ] && [ "$passed" -eq 0 ]; then
  echo "no test ran" >&2
  exit 1
fi
exit "$status"
