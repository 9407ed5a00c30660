//! The outage bound, exactly, on every transport: README's `capacity + rate × elapsed + N` with no
//! slack, over windows that end shortly after the service (or Redis) is back.
//!
//! `faults.rs` checks each fault over a whole run against `1.05 × (capacity + rate × elapsed) + N`,
//! a window ending 2.5 s after the fault: enough room to hide a few tokens admitted twice. Here one
//! fleet per transport (the gRPC stream, the default; a unary gRPC call per batch; HTTP) goes
//! through the four faults one after another, under load all along:
//!
//! | fault | applied | lifted |
//! |---|---|---|
//! | service stopped | SIGSTOP: callouts hang until they time out | SIGCONT |
//! | service killed | SIGKILL: connections reset, then refused | started again on its port |
//! | Redis stopped | SIGSTOP: the service's takes hang, its Redis timeout answers them | SIGCONT |
//! | Redis killed | SIGKILL: the service's takes fail at once | started again on its port, from its append-only file |
//!
//! Redis keeps an append-only file (no fsync: a killed process loses nothing it wrote), so the
//! bucket survives its restart; a Redis that lost it would start every bucket full again, which no
//! limiter could count.
//!
//! After each fault's end the load goes on for [`AFTER`], and the window from the start of the load
//! to that moment must hold: admitted (200s to requests started in it) at most `capacity + rate ×
//! elapsed + N`. Each window contains every fault so far; the bucket is empty before the first
//! (the load is 30 times the refill), so whatever the fleet admitted twice in any outage (on
//! credit, then again from the global bucket) stays in every later window.
//!
//! The refill, 20 tokens a second, is what makes a short outage count: each of 1 s gives the
//! fleet 20 tokens on credit, all of which the global bucket gathers too, against a slack of N.
//! Before the fallback's recovery (`src/core/local/fallback/`), the proxies back first spent
//! what the others owed (and what those still admitted on credit while their breakers stayed
//! open): the windows ended 4 to 27 tokens over the bound on every transport (the 100 a
//! minute needs outages of 5 s and runs of 12 s to show the same, a token or two over).
//!
//! One combined run per transport instead of twelve: each fault starts from the state the last
//! one left (the breaker closed again, shares and debts as the recovery left them), which is the
//! point of a window that spans them all, and the four faults cost one fleet's start (about 11 s
//! a transport). Each run prints a `ROW |` line per fault for BENCHMARKS.md ("The outage bound,
//! exactly"): the fault, how long it lasted, admitted / bound (ideal), 200s during the fault /
//! after it in the window, and per Envoy when the service decided for it again (ms after the end;
//! in recovery a proxy whose shares are empty decides alone, so this is later than the breaker's
//! close).
// A test reports a failure by panicking; the crate's no-panic lints are for the filter itself.
#![allow(
    clippy::panic,
    clippy::expect_used,
    clippy::unwrap_used,
    clippy::indexing_slicing
)]

use crate::common;
use crate::every_transport;

use common::faults::fleet::{self, Fleet, Load, Sample, Sampler, Seen};
use common::faults::redis_ctl::signal;
use common::*;
use std::thread;
use std::time::{Duration, Instant};

/// Envoys in the fleet (and the fallback's `instances`).
const N: usize = 4;
/// Client connections (dealt to the Envoys in turn) and each one's pause after an answer: about
/// 300 requests a second when the path is fast.
const CLIENTS: usize = 32;
const PAUSE: Duration = Duration::from_millis(100);
/// The key's bucket: 100 tokens, 20 a second.
const CAPACITY: u64 = 100;
const RATE: u64 = 20;
const PERIOD_MS: u64 = 1_000;
/// The callout timeout (a hang is noticed after it) and the service's Redis timeout below it.
const TIMEOUT_MS: u64 = 50;
const REDIS_TIMEOUT_MS: &str = "40";
/// Load before the first fault: the capacity (100) is spent within a few hundred ms.
const WARM: Duration = Duration::from_millis(700);
/// How long each fault lasts.
const OUTAGE: Duration = Duration::from_millis(1000);
/// Load after each fault's end; the window ends there (and the next fault starts).
const AFTER: Duration = Duration::from_millis(1000);

/// One fault the run applies and lifts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    ServiceStopped,
    ServiceKilled,
    RedisStopped,
    RedisKilled,
}

const FAULTS: [Fault; 4] = [
    Fault::ServiceStopped,
    Fault::ServiceKilled,
    Fault::RedisStopped,
    Fault::RedisKilled,
];

impl Fault {
    fn name(self) -> &'static str {
        match self {
            Fault::ServiceStopped => "service SIGSTOP",
            Fault::ServiceKilled => "service SIGKILL, restarted",
            Fault::RedisStopped => "Redis SIGSTOP",
            Fault::RedisKilled => "Redis SIGKILL, restarted",
        }
    }
}

fn plugin(transport: Transport, key: &str) -> String {
    let rule = serde_json::json!({"name": "outage", "key": [format!("literal:{key}")],
                                  "capacity": CAPACITY, "rate": RATE, "period_ms": PERIOD_MS});
    fleet::with_fallback(transport, TIMEOUT_MS, N)
        .rule(rule)
        .json()
}

/// Redis with an append-only file in `dir` (no fsync: what a killed process wrote is in the
/// kernel's hands), on `port` when given: started again there, it loads what it held.
fn redis_keeping_its_data(c: &Components, dir: &TempDir, port: Option<u16>) -> Redis {
    let extra = ["--appendonly", "yes", "--appendfsync", "no"];
    for _ in 0..3 {
        let port = port.unwrap_or_else(free_port);
        let log = dir.log_file(&format!("redis-{port}"));
        let mut proc =
            tollgate_testkit::redis::spawn(&c.redis_server, port, dir.path(), &extra, log);
        if wait_until("redis-server", &mut proc, || redis_ping(port)).is_ok() {
            return Redis { port, proc };
        }
    }
    panic!("redis-server with an append-only file did not start");
}

fn service_on(c: &Components, dir: &TempDir, port: Option<u16>, redis: &Redis) -> Service {
    let flags = ["--redis-timeout-ms", REDIS_TIMEOUT_MS];
    match port {
        Some(p) => Service::start_on(c, dir, p, Some(&redis.url()), &flags),
        None => Service::start_with(c, dir, Some(&redis.url()), &flags),
    }
}

/// One fault as it went: when it was applied, lifted, and the end of its window.
struct Applied {
    fault: Fault,
    at: Instant,
    end: Instant,
    window_end: Instant,
}

every_transport!(exact_bound_through_four_faults);

fn exact_bound_through_four_faults(transport: Transport) {
    let label = format!("outage-{}", format!("{transport:?}").to_lowercase());
    let c = Components::get();
    let dir = TempDir::new(&label);
    let mut redis = redis_keeping_its_data(&c, &dir, None);
    let mut service = service_on(&c, &dir, None, &redis);
    let fleet = Fleet::start(&c, &dir, N, &plugin(transport, &label), service.port);

    let sampler = Sampler::start(&fleet.admin_ports(), Duration::from_millis(20));
    let load = Load::start(
        &fleet.ports(),
        CLIENTS,
        PAUSE,
        Duration::from_secs(60),
        (1, 8),
    );
    thread::sleep(WARM);
    let mut applied = Vec::new();
    for fault in FAULTS {
        let at = Instant::now();
        match fault {
            Fault::ServiceStopped => signal(service.proc.pid(), "STOP"),
            Fault::ServiceKilled => service.proc.kill(),
            Fault::RedisStopped => signal(redis.proc.pid(), "STOP"),
            Fault::RedisKilled => redis.proc.kill(),
        }
        thread::sleep(OUTAGE);
        match fault {
            Fault::ServiceStopped => signal(service.proc.pid(), "CONT"),
            Fault::ServiceKilled => service = service_on(&c, &dir, Some(service.port), &redis),
            Fault::RedisStopped => signal(redis.proc.pid(), "CONT"),
            Fault::RedisKilled => redis = redis_keeping_its_data(&c, &dir, Some(redis.port)),
        }
        let end = Instant::now();
        thread::sleep(AFTER);
        applied.push(Applied {
            fault,
            at,
            end,
            window_end: Instant::now(),
        });
    }
    let seen = load.finish();
    let samples = sampler.finish();
    let stats = tg_total(&fleet.envoys);

    let tname = transport_name(transport);
    eprintln!(
        "{tname}: 200s per 500 ms from the start: {:?}",
        seen.per_window(200, seen.started, Duration::from_millis(500))
    );
    let mut broken = Vec::new();
    for a in &applied {
        let row = judge(tname, a, &seen, &samples);
        eprintln!("{}", row.line);
        broken.extend(row.broken);
    }
    eprintln!(
        "{tname}: {} requests in {:.2} s, statuses {:?}; filter stats {stats:?}",
        seen.recs.len(),
        seen.elapsed.as_secs_f64(),
        seen.statuses()
    );
    if seen.bad() > 0 {
        broken.push(format!(
            "only 200 and 429 may reach a client: {:?}",
            seen.statuses()
        ));
    }
    drop(service);
    assert!(broken.is_empty(), "{tname}: {}", broken.join("; "));
}

/// How BENCHMARKS.md names a transport.
fn transport_name(t: Transport) -> &'static str {
    match t {
        Transport::Grpc => "gRPC stream",
        Transport::GrpcUnary => "gRPC unary",
        Transport::Http => "HTTP",
    }
}

/// A fault's row and what it broke.
struct Row {
    line: String,
    broken: Vec<String>,
}

fn judge(tname: &str, a: &Applied, seen: &Seen, samples: &[Vec<Sample>]) -> Row {
    let admitted = seen.count_between(200, seen.started, a.window_end);
    let elapsed = a.window_end.duration_since(seen.started).as_secs_f64();
    let ideal = CAPACITY as f64 + RATE as f64 * elapsed * 1000.0 / PERIOD_MS as f64;
    let bound = ideal + N as f64;
    let during = seen.count_between(200, a.at, a.end);
    let after = seen.count_between(200, a.end, a.window_end);
    // Per Envoy, when the service decided for it again after the fault's end (the read of its
    // counters that first showed a service decision: an upper bound).
    let back: Vec<String> = fleet::growth_brackets(samples, a.end, |s: &Sample| s.decided)
        .iter()
        .map(|b| b.map_or("–".to_string(), |(_, high)| high.as_millis().to_string()))
        .collect();
    let per_envoy_after: Vec<u64> = (0..N)
        .map(|e| {
            seen.recs
                .iter()
                .filter(|r| r.client % N == e && r.status == 200)
                .filter(|r| r.start >= a.end && r.start < a.window_end)
                .count() as u64
        })
        .collect();
    eprintln!(
        "{tname}, {}: 200s after the end per Envoy {per_envoy_after:?}",
        a.fault.name()
    );
    let line = format!(
        "ROW | {tname} | {} | {} ms | {admitted} / {bound:.1} (ideal {ideal:.1}) | {during} / {after} | {} |",
        a.fault.name(),
        a.end.duration_since(a.at).as_millis(),
        back.join(", "),
    );
    let mut broken = Vec::new();
    if admitted as f64 > bound {
        broken.push(format!(
            "{}: admitted {admitted} > {bound:.1} = {CAPACITY} + {RATE}/min × {elapsed:.2} s + {N}",
            a.fault.name()
        ));
    }
    Row { line, broken }
}
