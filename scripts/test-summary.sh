#!/usr/bin/env bash
# Runs a test command, passes its output through, and closes with the suite's wall time and one line
# that counts every test: `tests: N passed, N failed`.
#
#   scripts/test-summary.sh [--since EPOCH] [--build-secs N] CMD...
#
# CMD is `cargo nextest run` (its `Summary [..] N tests run: P passed, F failed, T timed out, ...`
# line) or `cargo test` (every binary's `test result:` line, added up: the last one is often an
# example's empty `0 passed`, which would misstate the run). --since is when the suite started
# (`make test` passes the time make started): the time line splits what came before the test
# command (tools, release builds, images, lint), the test build (cargo's `Finished` line) and the
# test run. --build-secs is the builds' time when they ran before (`make test` builds the test
# binaries, the module and the service side by side while the tools install). A run that ran no test fails.
set -uo pipefail
since=""
if [ "${1:-}" = --since ]; then
  since=$2
  shift 2
fi
built=""
if [ "${1:-}" = --build-secs ]; then
  built=$2
  shift 2
fi
start=$(date +%s)
since=${since:-$start}
log=$(mktemp)
trap 'rm -f "$log"' EXIT
"$@" 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
end=$(date +%s)

# Strip colours: nextest and cargo colour their lines when the terminal allows it.
plain=$(sed -E 's/\x1b\[[0-9;]*m//g' "$log")
summary=$(grep -E '^ *Summary \[' <<<"$plain" | tail -1)
if [ -n "$summary" ]; then
  count() { grep -oE "[0-9]+ $1" <<<"$summary" | awk '{s += $1} END {print s + 0}'; }
  passed=$(count passed)
  failed=$(( $(count failed) + $(count 'timed out') ))
  run_s=$(sed -nE 's/^ *Summary \[ *([0-9]+)(\.[0-9]+)?s\].*/\1/p' <<<"$summary")
else
  read -r passed failed < <(sed -nE 's/^test result: [A-Za-z]+\. ([0-9]+) passed; ([0-9]+) failed.*/\1 \2/p' <<<"$plain" \
    | awk '{p += $1; f += $2} END {print p + 0, f + 0}')
  run_s=""
fi
# cargo's "Finished `test` profile [...] target(s) in 2m 05s" (or "in 41.27s"): the test build.
build_s=$(sed -nE 's/.*Finished `test` profile.* in (([0-9]+)m )?([0-9]+)(\.[0-9]+)?s$/\2 \3/p' <<<"$plain" \
  | tail -1 | awk 'NF {print ($2 == "" ? $1 : $1 * 60 + $2)}')

mmss() { printf '%d min %d s' $(($1 / 60)) $(($1 % 60)); }
total=$((end - since))
if [ -n "$built" ]; then
  # The builds ran first, side by side (the test binaries; the module, the static service, their
  # images and the module's lint; the tools installing beside them), then the format check.
  parts="builds $(mmss "$built") (the test binaries beside the module, the service and their images)"
  parts="$parts, then $(mmss $((start - since - built))) to the tests"
else
  parts="before the test command $(mmss $((start - since)))"
  if [ -n "$build_s" ]; then parts="$parts, test build $(mmss "$build_s")"; fi
fi
if [ -n "$run_s" ]; then parts="$parts, tests $(mmss "$run_s")"; fi
echo
echo "suite: $(mmss "$total") ($parts; load average $(cut -d' ' -f1-3 /proc/loadavg))"
echo "tests: $passed passed, $failed failed"
if [ "$status" -eq 0 ] && [ "$passed" -eq 0 ]; then
  echo "no test ran" >&2
  exit 1
fi
if [ "$status" -eq 0 ] && [ "$failed" -gt 0 ]; then
  exit 1
fi
exit "$status"
