#!/usr/bin/env bash
# The figures of this `make bench` beside the last recorded ones (bench/recorded.tsv), so a
# regression is seen the day it lands: CPU µs per request of each tier (Envoy, service, Redis; the
# median of bench-envoy.sh's rounds) and each tier's instructions per request (bench-instructions.sh:
# Envoy's, and with TIER=service and TIER=redis the service's and Redis's per take).
# A figure more than THRESHOLD % (10) above its record prints a WARNING line. It is a warning, not
# a test: the exit status is 0 whatever the figures. CPU per request moves with the machine's load
# (compare the load averages); instruction counts do not, so a warning on those is the one to chase.
#
#   scripts/bench-compare.sh             # after bench-envoy.sh and/or bench-instructions.sh
#   RECORD=1 scripts/bench-compare.sh    # also write this run's figures into bench/recorded.tsv
#
# bench/recorded.tsv: one figure per line, tab-separated: kind (cpu_us or instructions), variant,
# tier (envoy, service, redis), value; lines starting with # are comments (say where the figures
# come from).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
RECORDED=${RECORDED:-$ROOT/bench/recorded.tsv}
ENVOY_RESULTS=${ENVOY_RESULTS:-$ROOT/bench-out/envoy/results.tsv}
INSTR_RESULTS=${INSTR_RESULTS:-$ROOT/bench-out/instructions/results.tsv}
# The service's and Redis's instructions per take (bench-instructions.sh with TIER=service, redis).
INSTR_SERVICE_RESULTS=${INSTR_SERVICE_RESULTS:-$ROOT/bench-out/instructions-service/results.tsv}
INSTR_REDIS_RESULTS=${INSTR_REDIS_RESULTS:-$ROOT/bench-out/instructions-redis/results.tsv}
THRESHOLD=${THRESHOLD:-10}

NOW=$(mktemp)
trap 'rm -f "$NOW"' EXIT
# bench-envoy.sh's results: variant, req/s, p99, requests, non-2xx, CPU µs per request of Envoy,
# service, Redis, upstream, round, p50. The median over rounds of each tier.
if [ -s "$ENVOY_RESULTS" ]; then
  awk -F'\t' '{ n = ++count[$1]; e[$1, n] = $6; s[$1, n] = $7; r[$1, n] = $8 }
    function med(a, v, k,   i, j, t, x) {
      for (i = 1; i <= k; i++) x[i] = a[v, i] + 0
      for (i = 1; i <= k; i++) for (j = i + 1; j <= k; j++) if (x[j] < x[i]) { t = x[i]; x[i] = x[j]; x[j] = t }
      return x[int((k + 1) / 2)]
    }
    END { for (v in count) {
      printf "cpu_us\t%s\tenvoy\t%s\n", v, med(e, v, count[v])
      if (med(s, v, count[v]) > 0) printf "cpu_us\t%s\tservice\t%s\n", v, med(s, v, count[v])
      if (med(r, v, count[v]) > 0) printf "cpu_us\t%s\tredis\t%s\n", v, med(r, v, count[v])
    } }' "$ENVOY_RESULTS" >>"$NOW"
fi
# bench-instructions.sh's results: variant, median, rounds.
for tier in envoy service redis; do
  case $tier in envoy) f=$INSTR_RESULTS ;; service) f=$INSTR_SERVICE_RESULTS ;; redis) f=$INSTR_REDIS_RESULTS ;; esac
  if [ -s "$f" ]; then
    awk -F'\t' -v t="$tier" '{ printf "instructions\t%s\t%s\t%s\n", $1, t, $2 }' "$f" >>"$NOW"
  fi
done
if [ ! -s "$NOW" ]; then
  echo "bench-compare: no results in $ENVOY_RESULTS or $INSTR_RESULTS (run bench-envoy.sh or bench-instructions.sh first)" >&2
  exit 0
fi

echo "This run beside the last recorded figures ($RECORDED), load average now $(cut -d' ' -f1-3 /proc/loadavg):"
echo
echo "| figure | variant | tier | now | recorded | change |"
echo "|---|---|---|---|---|---|"
warnings=()
while IFS=$'\t' read -r kind variant tier value; do
  rec=$(awk -F'\t' -v k="$kind" -v v="$variant" -v t="$tier" '$1 == k && $2 == v && $3 == t {print $4}' "$RECORDED" 2>/dev/null | tail -n 1)
  if [ -z "$rec" ]; then
    echo "| $kind | $variant | $tier | $value | – | – |"
    continue
  fi
  change=$(awk -v a="$value" -v b="$rec" 'BEGIN { if (b > 0) printf "%+.1f %%", (a - b) * 100 / b; else print "–" }')
  echo "| $kind | $variant | $tier | $value | $rec | $change |"
  if awk -v a="$value" -v b="$rec" -v t="$THRESHOLD" 'BEGIN { exit !(b > 0 && a > b * (1 + t / 100)) }'; then
    warnings+=("$kind of $variant ($tier): $value against $rec recorded ($change)")
  fi
done < <(sort "$NOW")
echo
for w in "${warnings[@]}"; do
  echo "WARNING: grew more than $THRESHOLD %: $w"
done
[ "${#warnings[@]}" -gt 0 ] || echo "No figure grew more than $THRESHOLD % over its record."

if [ "${RECORD:-0}" = 1 ]; then
  {
    echo "# Recorded by RECORD=1 scripts/bench-compare.sh, $(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), load average $(cut -d' ' -f1 /proc/loadavg)"
    grep '^#' "$RECORDED" 2>/dev/null | grep -v '^# Recorded by RECORD=1' || true
    # Keep the records this run did not measure, replace those it did.
    awk -F'\t' 'NR == FNR { seen[$1 FS $2 FS $3] = 1; next } !/^#/ && !(($1 FS $2 FS $3) in seen)' "$NOW" "$RECORDED" 2>/dev/null || true
    sort "$NOW"
  } >"$RECORDED.tmp"
  mv "$RECORDED.tmp" "$RECORDED"
  echo "bench-compare: this run's figures written to $RECORDED"
fi
