#!/usr/bin/env bash
# `make fuzz`: builds every cargo-fuzz target in fuzz/ (libFuzzer, AddressSanitizer, debug
# assertions and overflow checks on) and runs each for FUZZ_SECONDS. Fails if any target finds a
# crash (a panic, a failed property, a sanitizer report, a hang over FUZZ_TIMEOUT seconds).
#
#   FUZZ_SECONDS=20     seconds per target (default 20: about 3.5 minutes for the ten targets)
#   FUZZ_TARGETS="..."  only these targets (default: every target of fuzz/Cargo.toml)
#   FUZZ_TIMEOUT=10     seconds one input may take before it counts as a hang
#
# Each target starts from its committed seeds (fuzz/seeds/<target>) and the corpus earlier runs
# grew (fuzz/corpus/<target>, git-ignored); a crashing input is written to
# fuzz/artifacts/<target>/ with the command that replays it. The toolchain is stable: cargo-fuzz
# passes -Zsanitizer, so RUSTC_BOOTSTRAP=1 lets stable rustc take it (its AddressSanitizer runtime
# ships with the stable standard library).
set -euo pipefail
cd "$(dirname "$0")/.."

SECONDS_PER_TARGET="${FUZZ_SECONDS:-20}"
TIMEOUT="${FUZZ_TIMEOUT:-10}"
CARGO_FUZZ="$PWD/.tools/cargo-fuzz/bin/cargo-fuzz"
BIN_DIR="$PWD/fuzz/target/x86_64-unknown-linux-gnu/release"
export RUSTC_BOOTSTRAP=1
# ASan's one-definition-rule check trips over Rust's duplicated generic symbols (cargo-fuzz sets
# the same); leak detection stays on.
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_odr_violation=0}"

[ -x "$CARGO_FUZZ" ] || bash scripts/tools.sh fuzz
targets="${FUZZ_TARGETS:-$("$CARGO_FUZZ" fuzz list --fuzz-dir fuzz)}"

echo "fuzz: building $(echo "$targets" | wc -w) targets" >&2
"$CARGO_FUZZ" fuzz build --fuzz-dir fuzz >&2

failed=()
summary=$(printf '%-20s %12s %10s %8s %8s  %s\n' target execs exec/s cov corpus result)
for t in $targets; do
  corpus="fuzz/corpus/$t" artifacts="fuzz/artifacts/$t" log="fuzz/artifacts/$t.log"
  mkdir -p "$corpus" "$artifacts" "fuzz/seeds/$t"
  echo "fuzz: $t for ${SECONDS_PER_TARGET}s" >&2
  rc=0
  "$BIN_DIR/$t" "$corpus" "fuzz/seeds/$t" \
    -max_total_time="$SECONDS_PER_TARGET" -timeout="$TIMEOUT" -print_final_stats=1 \
    -artifact_prefix="$artifacts/" >"$log" 2>&1 || rc=$?
  execs=$(awk '/stat::number_of_executed_units/ {print $NF}' "$log" | tail -1)
  rate=$(awk '/stat::average_exec_per_sec/ {print $NF}' "$log" | tail -1)
  cov=$(grep -oE 'cov: [0-9]+' "$log" | tail -1 | awk '{print $2}')
  size=$(find "$corpus" -type f | wc -l)
  if [ "$rc" = 0 ]; then
    result=ok
  else
    failed+=("$t")
    crash=$(grep -oE "Test unit written to [^ ]+" "$log" | tail -1 | awk '{print $5}')
    result="CRASH (exit $rc) ${crash:-see $log}"
    {
      echo "fuzz: $t failed; the report (from $log):"
      # `|| true`: head closing the pipe early must not end the script (pipefail).
      grep -E -A30 "panicked|ERROR: (libFuzzer|AddressSanitizer)|==ERROR" "$log" | head -60 || true
      [ -n "$crash" ] && echo "fuzz: replay with: $BIN_DIR/$t $crash"
    } >&2
  fi
  summary+=$'\n'$(printf '%-20s %12s %10s %8s %8s  %s' "$t" "${execs:-?}" "${rate:-?}" "${cov:-?}" "$size" "$result")
done

echo "$summary"
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz: FAILED: ${failed[*]}" >&2
  exit 1
fi
echo "fuzz: no crash in $(echo "$targets" | wc -w) targets, ${SECONDS_PER_TARGET}s each" >&2
