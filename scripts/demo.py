#!/usr/bin/env python3
"""N proxies, one limit: what "100 per minute" means behind four Envoys, in four setups side by side.

`make demo` runs this after `make build`. It starts, on free 127.0.0.1 ports:

    client (this script, a steady ~40 req/s)
      -> front Envoy (ROUND_ROBIN over the fleet)
        -> 4 Envoys, --concurrency 2 each, running the limiter under test
          -> upstream (an HTTP server thread in this script that counts what reaches it)

and, for the filter, Redis and tollgate-server. The same client load runs against four setups:

  1. each Envoy with Envoy's own local_ratelimit at 100/min: four buckets, about 4 x (100 + refill) get
     through;
  2. the Tollgate filter, global mode: one bucket in Redis, 100 plus the refill get through;
  3. the same filter with the service stopped: each Envoy falls back to its share, 100/4 plus a quarter
     of the refill, so the fleet as a whole still stays within 100 plus the refill;
  4. the same filter, the service stopped half-way through the load (a bad day): the fleet goes on from
     what it last knew of the global bucket, so the whole run stays within 100 plus the refill.

Each Tollgate setup has a key of its own, so one setup's spending does not show in the next.

`--flood` (`make flood`) runs another load instead: wrk's 64 connections through the same fleet, so
nearly every request is denied, for Envoy's local_ratelimit, Tollgate exact (denials remembered, the
default, and not), and lease mode, in interleaved rounds; it prints requests per second, p99 and what
reached the upstream against the ideal.

It prints a table (admitted, expected bound, limited) and writes a chart of cumulative admitted
requests over time (.run/demo/demo.png, when matplotlib from `scripts/tools.sh demo` is importable).
Everything it starts it stops, by PID, also on Ctrl-C.

Layout: `Procs` (children and their shutdown), `Upstream` (the counting server), `*_args` and
`envoy_config` (Envoy configurations, from the workspace's generator `tollgate-envoy-config`),
`drive` (the paced client), `run_mode` (one setup end to end), `main` (table, chart).
"""

from __future__ import annotations

import http.client
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / ".run" / "demo"

N_ENVOYS = 4
CAPACITY = 100  # tokens
RATE = 100  # tokens per PERIOD_S
PERIOD_S = 60
DURATION_S = float(os.environ.get("DEMO_DURATION_S", "20"))
REQ_PER_S = float(os.environ.get("DEMO_RPS", "40"))
CLIENT_THREADS = 8
ENVOY_HEADER = "x-demo-envoy"


def component(var: str, default_rel: str) -> str:
    path = os.environ.get(var) or str(ROOT / default_rel)
    if not os.path.isfile(path):
        sys.exit(f"demo: {var}={path} is missing; run `make build` (or set {var})")
    return path


def free_port() -> int:
    """A port the kernel says is free now (it could be taken before we bind it: good enough locally)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(what: str, check, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{what} not ready after {timeout_s:.0f} s (logs in {RUN})")


def http_get(url: str, timeout: float = 1.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, ""


# ------------------------------------------------------------------------------------------------
# Child processes


class Procs:
    """The processes this demo started; `stop` ends one by PID, `stop_all` ends the rest."""

    def __init__(self) -> None:
        self.children: dict[str, subprocess.Popen] = {}

    def start(self, name: str, argv: list[str], env: dict | None = None) -> subprocess.Popen:
        log = open(RUN / f"{name}.log", "wb")
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             env={**os.environ, **(env or {})})
        log.close()
        self.children[name] = p
        return p

    def stop(self, name: str) -> None:
        p = self.children.pop(name, None)
        if p is None or p.poll() is not None:
            return
        p.terminate()  # SIGTERM to this PID only
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=5)

    def check_alive(self, name: str) -> None:
        p = self.children[name]
        if p.poll() is not None:
            raise RuntimeError(f"{name} exited with {p.returncode}; see {RUN / (name + '.log')}")

    def stop_all(self) -> None:
        for name in reversed(list(self.children)):
            self.stop(name)


# ------------------------------------------------------------------------------------------------
# The upstream: counts every request that got through, per mode, per Envoy, with its time.


class Upstream:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.mode = "idle"
        self.t0 = time.monotonic()
        self.hits: dict[str, list[tuple[float, str]]] = {}
        upstream = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as Envoy's connection pool expects

            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                envoy = self.headers.get(ENVOY_HEADER, "?")
                with upstream.lock:
                    upstream.hits.setdefault(upstream.mode, []).append(
                        (time.monotonic() - upstream.t0, envoy))
                body = b"ok\n"
                self.send_response(200)
                self.send_header("content-type", "text/plain")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        class Server(ThreadingHTTPServer):
            def handle_error(self, request, client_address) -> None:
                # Envoy closing its pooled connections as a round ends is no error of the demo's.
                if isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
                    return
                super().handle_error(request, client_address)

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def begin(self, mode: str) -> None:
        with self.lock:
            self.mode = mode
            self.t0 = time.monotonic()
            self.hits[mode] = []

    def end(self) -> list[tuple[float, str]]:
        with self.lock:
            hits = self.hits.get(self.mode, [])
            self.mode = "idle"
            return hits

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# ------------------------------------------------------------------------------------------------
# Envoy configurations: written by the workspace's one generator (testkit/src/envoy.rs, the tests' too),
# through its command line (testkit/src/bin/tollgate-envoy-config.rs)


def local_ratelimit_args() -> list[str]:
    """Envoy's own limiter: one token bucket per Envoy (shared by its workers), 100 per minute."""
    return ["--local-ratelimit", f"{CAPACITY},{RATE},{PERIOD_S}"]


def tollgate_args(wasm: str, key: str, service_port: int, service: dict | None = None,
                  rule: dict | None = None) -> list[str]:
    """The Tollgate filter: one global bucket for every request (key `literal:<key>`); `service` and
    `rule` add to the plugin's `service` and to its rule. The generator's builder writes the plugin
    configuration (testkit/src/plugin.rs)."""
    args = ["--wasm", wasm]
    for name, value in {"transport": "grpc", "timeout_ms": 250, **(service or {})}.items():
        args += ["--service-field", f"{name}={json.dumps(value)}"]
    rule = {"name": "demo", "key": [f"literal:{key}"], "capacity": CAPACITY, "rate": RATE,
            "period_ms": PERIOD_S * 1000, **(rule or {})}
    fields = {
        "failure_mode": "fallback",
        # Four Envoys: each one's fallback bucket holds a quarter of the limit and refills at a quarter rate.
        "fallback": {"instances": N_ENVOYS, "max_keys": 1000},
        "response": {"status": 429, "headers": ["draft"]},
    }
    args += ["--rule", json.dumps(rule)]
    for name, value in fields.items():
        args += ["--field", f"{name}={json.dumps(value)}"]
    return args + ["--failure-policy", "FAIL_RELOAD", "--service", str(service_port)]


def envoy_config(generator: str, listen: int, args: list[str]) -> str:
    """An Envoy bootstrap listening on `listen` (admin on any port), from the generator's `args`."""
    out = subprocess.run([generator, "--listen", str(listen), *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"tollgate-envoy-config {' '.join(args)}: {out.stderr.strip()}")
    return out.stdout


class Envoy:
    def __init__(self, procs: Procs, envoy_bin: str, name: str, config: str, concurrency: int) -> None:
        self.name = name
        cfg = RUN / f"{name}.yaml"
        cfg.write_text(config)
        self.admin_file = RUN / f"{name}.admin"
        self.admin_file.unlink(missing_ok=True)
        procs.start(name, [envoy_bin, "-c", str(cfg), "--disable-hot-restart", "--concurrency",
                           str(concurrency), "--log-level", "warn", "--admin-address-path",
                           str(self.admin_file)])
        self.procs = procs
        self.admin = ""

    def wait_ready(self) -> None:
        def ready() -> bool:
            self.procs.check_alive(self.name)
            if not self.admin and self.admin_file.exists():
                self.admin = self.admin_file.read_text().strip()
            return bool(self.admin) and http_get(f"http://{self.admin}/ready")[0] == 200

        wait_until(self.name, ready)

    def tollgate_stats(self) -> dict[str, int]:
        status, text = http_get(f"http://{self.admin}/stats?filter=tollgate")
        out: dict[str, int] = {}
        for line in text.splitlines() if status == 200 else []:
            name, _, value = line.partition(": ")
            if value.strip().isdigit():
                out[name.removeprefix("wasmcustom.")] = int(value)
        return out


# ------------------------------------------------------------------------------------------------
# The client: a steady, bounded request rate over keep-alive connections


def drive(port: int, duration_s: float, rps: float) -> tuple[Counter, float]:
    """Sends round(duration_s * rps) GETs at a steady pace; returns the status counts and elapsed time."""
    total = int(round(duration_s * rps))
    statuses: Counter = Counter()
    lock = threading.Lock()
    t0 = time.monotonic()

    def worker(k: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        for i in range(k, total, CLIENT_THREADS):
            delay = t0 + i / rps - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            try:
                conn.request("GET", f"/demo/{i}")
                resp = conn.getresponse()
                resp.read()
                code = str(resp.status)
            except (OSError, http.client.HTTPException) as e:
                code = type(e).__name__
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            with lock:
                statuses[code] += 1
        conn.close()

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(CLIENT_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=duration_s + 30)
    return statuses, time.monotonic() - t0


# ------------------------------------------------------------------------------------------------
# One setup, end to end


def flood(port: int, duration_s: float) -> tuple[float, float]:
    """wrk -t2 -c64 for `duration_s` against `port` (after a 1 s warm-up): requests per second and
    the p99 latency in ms."""
    subprocess.run(["wrk", "-t2", "-c64", "-d1s", f"http://127.0.0.1:{port}/"], capture_output=True)
    out = subprocess.run(["wrk", "-t2", "-c64", f"-d{duration_s:g}s", "--latency",
                          f"http://127.0.0.1:{port}/"], capture_output=True, text=True).stdout
    rps, p99 = 0.0, 0.0
    for line in out.splitlines():
        f = line.split()
        if line.startswith("Requests/sec:"):
            rps = float(f[1])
        elif f[:1] == ["99%"]:
            v = f[1]
            p99 = (float(v[:-2]) / 1000 if v.endswith("us") else float(v[:-2]) if v.endswith("ms")
                   else float(v[:-1]) * 1000)
    return rps, p99


def start_fleet(procs: Procs, envoy_bin: str, generator: str, upstream: Upstream, mode: str,
                limiter: list[str]) -> tuple[list, "Envoy", int]:
    """N Envoys running `limiter` behind a round-robin front Envoy; the fleet, the front, its port."""
    fleet_ports = [free_port() for _ in range(N_ENVOYS)]
    fleet = [Envoy(procs, envoy_bin, f"{mode}-envoy{i + 1}",
                   envoy_config(generator, port, limiter + ["--upstream", str(upstream.port),
                                                           "--request-header", f"{ENVOY_HEADER}={i + 1}"]),
                   concurrency=2)
             for i, port in enumerate(fleet_ports)]
    front_port = free_port()
    spread = ["--upstream-cluster", "fleet"] + [a for p in fleet_ports for a in ("--upstream", str(p))]
    front = Envoy(procs, envoy_bin, f"{mode}-front", envoy_config(generator, front_port, spread), concurrency=1)
    for e in fleet + [front]:
        e.wait_ready()
    return fleet, front, front_port


def flood_main(procs: Procs, envoy_bin: str, generator: str, upstream: Upstream, wasm: str,
               service_port: int) -> None:
    """`--flood`: the fleet under wrk's 64 connections (nearly every request denied), each setup in
    FLOOD_ROUNDS interleaved rounds of FLOOD_S seconds: requests per second at the front, p99, what
    reached the upstream against the ideal, and the filter's callouts."""
    rounds = int(os.environ.get("FLOOD_ROUNDS", "3"))
    seconds = float(os.environ.get("FLOOD_S", "5"))
    setups = [
        ("local_ratelimit", lambda k: local_ratelimit_args()),
        ("exact", lambda k: tollgate_args(wasm, k, service_port)),
        ("exact, denials not remembered",
         lambda k: tollgate_args(wasm, k, service_port, service={"remember_denials_ms": 0})),
        ("lease (adaptive)", lambda k: tollgate_args(wasm, k, service_port, rule={"lease": {}})),
    ]
    print(f"flood: {N_ENVOYS} Envoys behind a front Envoy, one key at {CAPACITY}/min, wrk -t2 -c64, "
          f"{rounds} rounds of {seconds:g} s per setup, interleaved; load average {os.getloadavg()[0]:.2f}",
          flush=True)
    rows: dict[str, list[tuple[float, float, int, float, int]]] = {name: [] for name, _ in setups}
    for r in range(rounds):
        for i, (name, args) in enumerate(setups):
            mode = f"flood{r}-{i}"
            fleet, front, port = start_fleet(procs, envoy_bin, generator, upstream, mode, args(f"flood-{r}-{i}"))
            upstream.begin(mode)
            t0 = time.monotonic()
            rps, p99 = flood(port, seconds)
            elapsed = time.monotonic() - t0
            time.sleep(0.2)
            admitted = len(upstream.end())
            stats = Counter()
            for e in fleet:
                stats.update(e.tollgate_stats())
            # Unary calls are the cluster's requests (batches among them); on the stream (the
            # default) a request is a whole stream, and each message (`batch.callouts`) is what a
            # callout was: the larger count is the callouts'.
            callouts = max(stats.get("tollgate.batch.callouts", 0),
                           stats.get("cluster.tollgate.upstream_rq_total", 0))
            for e in [front] + fleet:
                procs.stop(e.name)
            # local_ratelimit: one bucket per Envoy; Tollgate: one, so capacity + refill over the run.
            ideal = (N_ENVOYS if name == "local_ratelimit" else 1) * (CAPACITY + RATE * elapsed / PERIOD_S)
            rows[name].append((rps, p99, admitted, ideal, callouts))
            print(f"  round {r + 1} {name}: {rps:.0f} req/s, p99 {p99:.2f} ms, admitted {admitted} "
                  f"(ideal {ideal:.1f}), callouts {callouts}", flush=True)
    base = sorted(x[0] for x in rows["local_ratelimit"])[rounds // 2]
    print()
    print("| setup | req/s (median) | ratio to local_ratelimit | p99 ms (median) | admitted per round | ideal | callouts per request |")
    print("|---|---|---|---|---|---|---|")
    for name, _ in setups:
        xs = rows[name]
        rps = sorted(x[0] for x in xs)[rounds // 2]
        p99 = sorted(x[1] for x in xs)[rounds // 2]
        admitted = ", ".join(str(x[2]) for x in xs)
        ideal = ", ".join(f"{x[3]:.1f}" for x in xs)
        per = sorted(x[4] / max(1.0, x[0] * seconds) for x in xs)[rounds // 2]
        print(f"| {name} | {rps:.0f} | {rps / base:.2f} | {p99:.2f} | {admitted} | {ideal} | {per:.3f} |")


def run_mode(procs: Procs, envoy_bin: str, generator: str, upstream: Upstream, mode: str,
             limiter: list[str], midway=None) -> dict:
    """Runs the client load against a fresh fleet whose Envoys run `limiter` (generator options).
    `midway`, if given, is called half-way through the load (e.g. to stop the service); the time it
    was called at is in the result."""
    fleet, front, front_port = start_fleet(procs, envoy_bin, generator, upstream, mode, limiter)

    print(f"  {mode}: {N_ENVOYS} Envoys + front up; {int(DURATION_S * REQ_PER_S)} requests over "
          f"{DURATION_S:.0f} s ...", flush=True)
    upstream.begin(mode)
    midway_at: list[float] = []
    timer = None
    if midway is not None:
        def at_midway() -> None:
            midway_at.append(time.monotonic() - upstream.t0)
            midway()

        timer = threading.Timer(DURATION_S / 2, at_midway)
        timer.daemon = True  # an interrupted demo does not wait for it
        timer.start()
    statuses, elapsed = drive(front_port, DURATION_S, REQ_PER_S)
    if timer is not None:
        timer.join()
    time.sleep(0.2)  # the last admitted requests reach the upstream
    hits = upstream.end()
    stats = Counter()
    for e in fleet:
        stats.update(e.tollgate_stats())
    for e in [front] + fleet:
        procs.stop(e.name)
    return {"mode": mode, "statuses": statuses, "elapsed": elapsed, "hits": hits, "stats": stats,
            "midway_at": midway_at[0] if midway_at else None}


# ------------------------------------------------------------------------------------------------


def chart(results: list[dict], labels: dict[str, str], path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no chart: matplotlib is not importable (run `bash scripts/tools.sh demo`)"
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    for r in results:
        times = sorted(t for t, _ in r["hits"])
        # Held flat to the end of the run: nothing more got through after the last admission.
        xs_mode = [0.0] + times + [max(r["elapsed"], times[-1] if times else 0.0)]
        ys_mode = list(range(len(times) + 1)) + [len(times)]
        # The global and fallback lines nearly coincide, and the outage's first half is the global line
        # again: the wider, paler ones underneath stay visible.
        width, alpha, style = {"global": (5.0, 0.55, "-"), "outage": (2.6, 0.9, "-.")}.get(
            r["mode"], (1.8, 1.0, "-"))
        ax.step(xs_mode, ys_mode, where="post", label=labels[r["mode"]], linewidth=width, alpha=alpha,
                linestyle=style)
        if r.get("midway_at") is not None:
            ax.axvline(r["midway_at"], color="grey", linestyle=":", linewidth=1)
            ax.annotate("4: service stopped", (r["midway_at"], 0), xytext=(4, 6), textcoords="offset points",
                        fontsize=8, color="grey")
    xs = [i * DURATION_S / 100 for i in range(101)]
    ax.plot(xs, [CAPACITY + RATE * x / PERIOD_S for x in xs], "k--", linewidth=1,
            label=f"the limit: {CAPACITY} + refill ({RATE}/min)")
    ax.set_xlabel("seconds since the first request")
    ax.set_ylabel("requests that reached the upstream (cumulative)")
    ax.set_title(f"{N_ENVOYS} Envoys behind a round-robin balancer, one limit of {CAPACITY}/min, "
                 f"{REQ_PER_S:.0f} req/s offered", fontsize=10)
    ax.set_xlim(0, DURATION_S)
    ax.set_ylim(0, None)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return f"chart: {path.relative_to(ROOT)}"


def _interrupt(*_args) -> None:
    raise KeyboardInterrupt


def main() -> int:
    envoy_bin = component("TOLLGATE_ENVOY", ".tools/envoy")
    redis_bin = component("TOLLGATE_REDIS_SERVER", ".tools/redis-server")
    server_bin = component("TOLLGATE_SERVER", "dist/tollgate-server")
    wasm = component("TOLLGATE_WASM", "dist/tollgate.wasm")
    generator = component("TOLLGATE_ENVOY_CONFIG", "target/debug/tollgate-envoy-config")
    RUN.mkdir(parents=True, exist_ok=True)

    procs = Procs()
    upstream = Upstream()
    # Ctrl-C and SIGTERM end the demo through the `finally` below. SIGINT is set explicitly: a shell
    # that starts the demo in the background would otherwise have it ignored.
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    started = time.monotonic()
    try:
        redis_port, service_port = free_port(), free_port()
        procs.start("redis", [redis_bin, "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                              "--appendonly", "no"])
        procs.start("service", [server_bin, "--listen", f"127.0.0.1:{service_port}", "--redis-url",
                                f"redis://127.0.0.1:{redis_port}", "--log-format", "text"])

        def service_ready() -> bool:
            procs.check_alive("service")
            return http_get(f"http://127.0.0.1:{service_port}/readyz")[0] == 200

        wait_until("tollgate-server (and Redis behind it)", service_ready)
        if "--flood" in sys.argv[1:]:
            flood_main(procs, envoy_bin, generator, upstream, wasm, service_port)
            return 0
        print(f"demo: {N_ENVOYS} Envoys, limit {CAPACITY} per {PERIOD_S} s, the same client in each setup",
              flush=True)

        results = [run_mode(procs, envoy_bin, generator, upstream, "local", local_ratelimit_args())]
        results.append(run_mode(procs, envoy_bin, generator, upstream, "global",
                                tollgate_args(wasm, "demo-global", service_port)))
        # The service answers for the first half of this run; then it is stopped and stays stopped, so
        # nothing listens on its port for the rest of the demo.
        outage = run_mode(procs, envoy_bin, generator, upstream, "outage",
                          tollgate_args(wasm, "demo-outage", service_port), midway=lambda: procs.stop("service"))
        procs.stop("service")
        results.append(run_mode(procs, envoy_bin, generator, upstream, "fallback",
                                tollgate_args(wasm, "demo-fallback", service_port)))
        results.append(outage)
    except KeyboardInterrupt:
        print("\ndemo: interrupted, stopping everything", file=sys.stderr)
        return 130
    except RuntimeError as e:  # a component did not come up: say which, and where its log is
        print(f"demo: {e}", file=sys.stderr)
        return 1
    finally:
        procs.stop_all()
        upstream.close()

    share = CAPACITY / N_ENVOYS
    labels = {
        "local": f"1. Envoy local_ratelimit {CAPACITY}/min on each Envoy",
        "global": "2. Tollgate, global (Redis)",
        "fallback": f"3. Tollgate, service stopped: fallback {share:g}/min per Envoy",
        "outage": f"4. Tollgate, service stopped at {DURATION_S / 2:g} s",
    }
    rows = []
    for r in results:
        refill = RATE * r["elapsed"] / PERIOD_S
        if r["mode"] == "local":
            # Envoy 1.40's local_ratelimit refills continuously (tokens_per_fill / fill_interval), per Envoy.
            per = math.floor(refill)
            bound = f"~ {N_ENVOYS} x ({CAPACITY} + {per}) = {N_ENVOYS * (CAPACITY + per)}"
        elif r["mode"] == "global":
            bound = f"= {CAPACITY} + {math.floor(refill)} refill = {CAPACITY + math.floor(refill)}"
        elif r["mode"] == "outage":
            bound = f"<= {CAPACITY} + {math.floor(refill)} refill = {CAPACITY + math.floor(refill)}"
        else:
            bound = f"<= {N_ENVOYS} x ({share:g} + {refill / N_ENVOYS:.1f}) = {math.floor(CAPACITY + refill)}"
        other = sum(v for k, v in r["statuses"].items() if k not in ("200", "429"))
        rows.append((labels[r["mode"]], str(len(r["hits"])), bound, str(r["statuses"]["429"]), str(other)))

    head = ("setup", "admitted", "expected", "limited (429)", "errors")
    widths = [max(len(x[i]) for x in rows + [head]) for i in range(len(head))]
    line = "  ".join("-" * w for w in widths)
    print()
    print(f"What reached the upstream: {int(DURATION_S * REQ_PER_S)} requests in {DURATION_S:.0f} s per setup, "
          f"round-robin over {N_ENVOYS} Envoys, limit {CAPACITY}/min")
    print("  ".join(h.ljust(w) for h, w in zip(head, widths)))
    print(line)
    for row in rows:
        print("  ".join(c.ljust(w) if i == 0 or i == 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
    print()
    for r in results:
        per_envoy = Counter(e for _, e in r["hits"])
        split = ", ".join(f"{per_envoy[str(i + 1)]}" for i in range(N_ENVOYS))
        s = r["stats"]
        decided = ""
        if r["mode"] != "local":
            decided = (f"; decided by the service {s['tollgate.allowed'] + s['tollgate.limited']}, "
                       f"by the fallback {s['tollgate.fallback.allowed'] + s['tollgate.fallback.limited']}")
            failures = {k.removeprefix("tollgate.callout_failure."): v for k, v in s.items()
                        if k.startswith("tollgate.callout_failure.") and v}
            if failures:
                decided += f" (failed callouts: {failures})"
        if r.get("midway_at") is not None:
            before = sum(1 for t, _ in r["hits"] if t < r["midway_at"])
            # How far the line gets above the limit line at its highest (the k-th admission at time t
            # against 100 + refill(t)); at most 0 means on or under it throughout.
            times = sorted(t for t, _ in r["hits"])
            excess = max((k + 1 - (CAPACITY + RATE * t / PERIOD_S) for k, t in enumerate(times)), default=0.0)
            decided += (f"; admitted before the stop at {r['midway_at']:.1f} s {before}, "
                        f"after it {len(r['hits']) - before}; highest above the limit line {excess:+.2f}")
        print(f"  {r['mode']:>8}: per Envoy {split}{decided}")
    print(f"  {chart(results, labels, RUN / 'demo.png')}")
    print(f"demo: done in {time.monotonic() - started:.0f} s; logs in {RUN.relative_to(ROOT)}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
