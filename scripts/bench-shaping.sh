#!/usr/bin/env bash
# Shaping through a fleet, in the same `make bench` run as the other figures.
#
# FLEET Envoys (--concurrency 2) run the module in front of one upstream; CLIENTS client threads (one
# Python process) send each request to the next Envoy round-robin, pausing PAUSE_MS after each
# answer, for SECONDS_PER_MODE. One bucket for everything (key `literal:…`): CAPACITY tokens, RATE a
# second. Twice, each mode with a bucket of its own:
#   shaped     the rule has "shape": {"max_delay_ms": MAX_DELAY_MS}: a request is held until its
#              token is there, up to MAX_DELAY_MS, and refused only beyond it
#   unshaped   the same rule without it: what the bucket cannot pay now is refused
# What reached the upstream is counted where it arrives (its access log, each request's arrival in
# ms), per 100 ms from the first arrival, beside one bucket's bound for a window
# (CAPACITY + RATE / 10); the clients count the 429s and time the 200s: the added wait is a 200's
# latency less the median of those not held (`x-ratelimit-delay-ms` absent).
#
#   scripts/bench-shaping.sh        # FLEET=3 CLIENTS=150 SECONDS_PER_MODE=4 CAPACITY=50 RATE=100 MAX_DELAY_MS=1000
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
# shellcheck source=scripts/lib.sh
. scripts/lib.sh
FLEET=${FLEET:-3}
CLIENTS=${CLIENTS:-150}
SECS=${SECONDS_PER_MODE:-4}
CAPACITY=${CAPACITY:-50}
RATE=${RATE:-100}
MAX_DELAY_MS=${MAX_DELAY_MS:-1000}
PAUSE_MS=${PAUSE_MS:-300}
MODES=${MODES:-shaped unshaped}
OUT=$ROOT/bench-out/shaping
WASM=$(readlink -f "$WASM")

require_files "$ENVOY" "$REDIS_SERVER" "$REDIS_CLI" "$SERVER" "$WASM" "$ENVOY_CONFIG"
rm -rf "$OUT" && mkdir -p "$OUT"
LOAD0=$(cut -d' ' -f1-3 /proc/loadavg)

trap stop_started EXIT INT TERM
start_redis "$OUT"
start_service "$OUT"

start() { # name config-file log admin
  # Access log lines reach the file within 100 ms (Envoy's default is 10 s).
  "$ENVOY" -c "$2" --disable-hot-restart --concurrency 2 --log-level warn --file-flush-interval-msec 100 >"$3" 2>&1 &
  PIDS+=($!)
  wait_for "envoy ($1)" "$3" $! curl -fsS "http://127.0.0.1:$4/ready"
}

UP_PORT=$(free_port); UP_ADMIN=$(free_port)
envoy_config --name upstream --listen "$UP_PORT" --admin "$UP_ADMIN" \
  --direct $'ok\n' --access-log "$OUT/upstream-access.log" >"$OUT/upstream.yaml"
start upstream "$OUT/upstream.yaml" "$OUT/upstream.log" "$UP_ADMIN"

declare -A PORTS
for mode in $MODES; do
  shape=""
  [ "$mode" = shaped ] && shape=", \"shape\": {\"max_delay_ms\": $MAX_DELAY_MS}"
  plugin=(--service-field 'transport="grpc"' --service-field timeout_ms=200
          --rule "{\"name\": \"all\", \"key\": [\"literal:shaping-$mode\"], \"capacity\": $CAPACITY, \"rate\": $RATE, \"period_ms\": 1000$shape}")
  ports=()
  for i in $(seq "$FLEET"); do
    port=$(free_port); admin=$(free_port); ports+=("$port")
    envoy_config --listen "$port" --admin "$admin" --wasm "$WASM" "${plugin[@]}" \
      --service "$SVC_PORT" --upstream "$UP_PORT" >"$OUT/$mode-$i.yaml"
    start "$mode-$i" "$OUT/$mode-$i.yaml" "$OUT/$mode-$i.log" "$admin"
  done
  PORTS[$mode]=$(IFS=,; echo "${ports[*]}")
done

for mode in $MODES; do
  lines0=$(wc -l <"$OUT/upstream-access.log")
  say "$mode: $CLIENTS clients over ${PORTS[$mode]} for ${SECS}s"
  # The clients: each request's start (ms, this machine's clock as Envoy's access log writes it),
  # latency (ms), status, and x-ratelimit-delay-ms (empty when absent), one per line.
  python3 - "${PORTS[$mode]}" "$CLIENTS" "$SECS" "$PAUSE_MS" >"$OUT/clients-$mode.tsv" <<'PY'
import http.client, sys, threading, time
ports = [int(p) for p in sys.argv[1].split(",")]
clients, secs, pause = int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]) / 1000
deadline = time.monotonic() + secs
recs, lock = [], threading.Lock()
def client(c):
    conns, j, mine = {}, 0, []
    while time.monotonic() < deadline:
        port = ports[(c + j) % len(ports)]
        j += 1
        start, t0 = time.time(), time.monotonic()
        try:
            conn = conns.get(port) or http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conns[port] = conn
            conn.request("GET", f"/bench/{c}/{j}")
            r = conn.getresponse()
            r.read()
            status, held = r.status, r.getheader("x-ratelimit-delay-ms") or ""
        except OSError:
            conns.pop(port, None)
            status, held = 0, ""
        mine.append(f"{start * 1000:.1f}\t{(time.monotonic() - t0) * 1000:.1f}\t{status}\t{held}")
        time.sleep(pause)
    with lock:
        recs.extend(mine)
threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
for t in threads: t.start()
for t in threads: t.join()
print("\n".join(recs))
PY
  # The last held requests are let go up to MAX_DELAY_MS after the clients stopped asking; the
  # clients waited for them, and the access log is flushed every 100 ms.
  sleep 0.5
  tail -n +"$((lines0 + 1))" "$OUT/upstream-access.log" >"$OUT/arrivals-$mode.log"
done

python3 - "$OUT" "$CAPACITY" "$RATE" "$MAX_DELAY_MS" $MODES <<'PY' | tee "$OUT/summary.md"
import math, sys
out, capacity, rate, max_delay = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
modes = sys.argv[5:]
def q(v, p):
    v = sorted(v)
    return v[min(len(v), max(1, math.ceil(len(v) * p))) - 1] if v else 0
rows, windows = [], {}
for m in modes:
    arrivals = sorted(float(l.split()[0]) * 1000 for l in open(f"{out}/arrivals-{m}.log") if l.split()[1:2] == ["200"])
    recs = [l.rstrip("\n").split("\t") for l in open(f"{out}/clients-{m}.tsv") if l.strip()]
    ok = [r for r in recs if r[2] == "200"]
    refused = sum(r[2] == "429" for r in recs)
    other = sum(r[2] not in ("200", "429") for r in recs)
    unheld = [float(r[1]) for r in ok if not r[3]]
    held = [float(r[3]) for r in ok if r[3]]
    base = q(unheld, 0.5)
    added = [max(0.0, float(r[1]) - base) for r in ok]
    w = [0] * (int((arrivals[-1] - arrivals[0]) // 100) + 1 if arrivals else 0)
    for a in arrivals:
        w[int((a - arrivals[0]) // 100)] += 1
    windows[m] = w
    span = (arrivals[-1] - min(float(r[0]) for r in recs)) / 1000 if arrivals else 0
    rows.append(f"| {m} | {len(recs)} | {len(arrivals)} (one bucket: {capacity + int(rate * span)} over {span:.2f} s) | "
                f"{refused} | {other} | {max(w, default=0)} / {max(w[1:], default=0)} | {len(held)} | "
                f"{q(added, 0.5):.0f} / {q(added, 0.99):.0f} | {q(held, 0.5):.0f} / {q(held, 0.99):.0f} |")
print(f"one bucket of {capacity} + {rate}/s, shaped up to {max_delay} ms; bound per 100 ms: "
      f"{capacity + rate // 10} (burst and refill), {rate // 10} (refill) once the burst is spent\n")
print("| mode | requests | reached the upstream | 429 | other | most per 100 ms (first / later windows) | held | added wait p50 / p99 ms | held p50 / p99 ms |")
print("|---|---|---|---|---|---|---|---|---|")
print("\n".join(rows))
print("\nupstream arrivals per 100 ms from each mode's first arrival:\n")
print("| window (ms) | " + " | ".join(modes) + " |")
print("|---|" + "---|" * len(modes))
for i in range(max(len(w) for w in windows.values())):
    print(f"| {i * 100} | " + " | ".join(str(windows[m][i]) if i < len(windows[m]) else "" for m in modes) + " |")
PY
echo "load average before the run: $LOAD0; after: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/summary.md"
