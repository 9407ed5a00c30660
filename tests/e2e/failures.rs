//! End to end, the service failing in each way a deployment sees: down (closed port), answering 503
//! because Redis is down, hung (callouts time out), misnamed (unknown cluster). Each goes to the
//! failure mode: the local fallback (capacity / instances), allow or deny. Also shadow mode and the
//! circuit breaker opening and closing. Both transports.

// A test reports a failure by panicking; the crate's no-panic lints are for the filter itself.
#![allow(
    clippy::panic,
    clippy::expect_used,
    clippy::unwrap_used,
    clippy::indexing_slicing
)]

use crate::both_transports;
use crate::common;

use common::config::{plugin, rule};
use common::*;
use serde_json::json;
use std::time::{Duration, Instant};

both_transports!(
    fallback_when_service_down,
    fallback_when_redis_down,
    fallback_on_timeout,
    fallback_on_unknown_cluster,
    failure_mode_allow,
    failure_mode_deny,
    shadow_never_denies,
    breaker_opens_and_closes,
    service_token_required,
    breaker_backs_off,
);

/// Capacity 10 split over 3 instances: the fallback bucket holds floor(10 / 3) = 3.
fn fallback_rules() -> Vec<serde_json::Value> {
    vec![rule("per-ip", &["client_ip"], 10)]
}

fn fallback_extra() -> serde_json::Value {
    json!({"failure_mode": "fallback", "fallback": {"instances": 3, "max_keys": 1000}})
}

/// Sends 8 requests and checks the fallback's verdicts and counters: 3 admitted, 5 limited, only the
/// admitted ones at the upstream, and a callout failure of one of `causes` counted.
fn assert_fallback(s: &Stack, causes: &[&str]) {
    let replies: Vec<Reply> = (0..8).map(|_| s.get("/", &[])).collect();
    for r in replies.iter().filter(|r| r.status == 429) {
        assert!(r.header("retry-after").is_some(), "fallback denial: {r:?}");
    }
    let st: Vec<u16> = replies.iter().map(|r| r.status).collect();
    assert_eq!(
        st,
        vec![200, 200, 200, 429, 429, 429, 429, 429],
        "floor(10/3) = 3"
    );
    assert_eq!(s.upstream.requests(), 3);
    let stats = s.envoy.tg_all();
    let get = |k: &str| stats.get(k).copied().unwrap_or(0);
    assert_eq!(get("fallback.allowed"), 3, "{stats:?}");
    assert_eq!(get("fallback.limited"), 5, "{stats:?}");
    assert_eq!(get("allowed"), 0, "the service decided nothing: {stats:?}");
    let failures: u64 = causes
        .iter()
        .map(|c| get(&format!("callout_failure.{c}")))
        .sum();
    assert!(
        failures >= 1,
        "a callout failure counted as one of {causes:?}: {stats:?}"
    );
}

/// The service's port is closed.
fn fallback_when_service_down(t: Transport) {
    let s = Stack::start_without_service(
        "down",
        &plugin(t, fallback_rules(), fallback_extra()),
        closed_port(),
    );
    // Envoy reports a refused connection as a 503 / UNAVAILABLE of its own, told apart from the
    // service's by its text.
    assert_fallback(&s, &["connect"]);
}

/// Redis is killed after the stack started: the service answers 503 / UNAVAILABLE.
fn fallback_when_redis_down(t: Transport) {
    let mut s = Stack::start("redis-down", &plugin(t, fallback_rules(), fallback_extra()));
    if let Some(r) = s.redis.as_mut() {
        r.stop();
    }
    let causes: &[&str] = match t {
        Transport::Http => &["status"],
        Transport::Grpc | Transport::GrpcUnary => &["grpc_status"],
    };
    assert_fallback(&s, causes);
}

/// The service accepts connections and never answers: each callout times out after 200 ms.
fn fallback_on_timeout(t: Transport) {
    let gate = Gate::start(GateMode::BlackHole, 0);
    let mut extra = fallback_extra();
    extra["service"] = json!({"timeout_ms": 200});
    let s = Stack::start_without_service("timeout", &plugin(t, fallback_rules(), extra), gate.port);
    let started = Instant::now();
    let r = s.get("/", &[]);
    assert_eq!(r.status, 200, "{r:?}");
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(150) && took < Duration::from_millis(1500),
        "the first request waited for the callout timeout: {took:?}"
    );
    assert!(
        s.envoy.tg("callout_failure.timeout") >= 1,
        "{:?}",
        s.envoy.tg_all()
    );
    // The rest: two more admitted, then limited (the first one counted already).
    let st = s.client.statuses(&s.url("/"), &[], 7);
    assert_eq!(st, vec![200, 200, 429, 429, 429, 429, 429]);
    assert_eq!(s.envoy.tg("fallback.allowed"), 3);
    assert_eq!(s.envoy.tg("fallback.limited"), 5);
    assert_eq!(s.upstream.requests(), 3);
}

/// The configured cluster does not exist in Envoy: the dispatch fails at once.
fn fallback_on_unknown_cluster(t: Transport) {
    let mut extra = fallback_extra();
    extra["service"] = json!({"cluster": "no-such-cluster"});
    let s = Stack::start("unknown-cluster", &plugin(t, fallback_rules(), extra));
    assert_fallback(&s, &["dispatch"]);
}

/// failure_mode allow: every request passes and is counted.
fn failure_mode_allow(t: Transport) {
    let s = Stack::start_without_service(
        "allow",
        &plugin(
            t,
            vec![rule("one", &["literal:x"], 1)],
            json!({"failure_mode": "allow"}),
        ),
        closed_port(),
    );
    assert_eq!(s.client.statuses(&s.url("/"), &[], 6), vec![200; 6]);
    assert_eq!(s.upstream.requests(), 6);
    assert_eq!(
        s.envoy.tg("failure_open.allowed"),
        6,
        "{:?}",
        s.envoy.tg_all()
    );
}

/// failure_mode deny: every request gets the configured denial; nothing reaches the upstream.
fn failure_mode_deny(t: Transport) {
    let s = Stack::start_without_service(
        "deny",
        &plugin(
            t,
            vec![rule("one", &["literal:x"], 100)],
            json!({"failure_mode": "deny", "response": {"status": 503}}),
        ),
        closed_port(),
    );
    for _ in 0..6 {
        let r = s.get("/", &[]);
        assert_eq!(r.status, 503, "{r:?}");
        assert!(r.header("retry-after").is_some(), "{r:?}");
    }
    assert_eq!(s.upstream.requests(), 0);
    assert_eq!(
        s.envoy.tg("failure_closed.limited"),
        6,
        "{:?}",
        s.envoy.tg_all()
    );
}

/// shadow: the service's denials are counted, never enforced.
fn shadow_never_denies(t: Transport) {
    let s = Stack::start(
        "shadow",
        &plugin(
            t,
            vec![rule("per-ip", &["client_ip"], 2)],
            json!({"shadow": true}),
        ),
    );
    assert_eq!(s.client.statuses(&s.url("/"), &[], 6), vec![200; 6]);
    assert_eq!(s.upstream.requests(), 6);
    let stats = s.envoy.tg_all();
    assert_eq!(stats.get("shadow_limited"), Some(&4), "{stats:?}");
    assert_eq!(stats.get("limited").copied().unwrap_or(0), 0, "{stats:?}");
}

/// The breaker opens after `failures` consecutive failures: the service (behind a gate that refuses
/// connections) stops receiving calls while the fallback decides. When the service is back and the
/// open period is over, calls resume and the limit is global again (capacity 4, not the fallback's 2).
fn breaker_opens_and_closes(t: Transport) {
    let c = Components::get();
    let dir = TempDir::new("breaker");
    let redis = Redis::start(&c, &dir);
    let service = Service::start(&c, &dir, Some(&redis.url()));
    let gate = Gate::start(GateMode::Refuse, service.port);
    let cfg = plugin(
        t,
        vec![rule("per-user", &["header:x-user"], 4)],
        json!({"fallback": {"instances": 2},
               "breaker": {"failures": 3, "open_ms": 3000, "max_open_ms": 3000}}),
    );
    let upstream = Upstream::start();
    let envoy = Envoy::start(
        &c,
        &dir,
        &EnvoySpec::new(Some(cfg), gate.port, upstream.port),
    );
    let client = Client::new();
    let url = envoy.url("/");

    // Open: three failed calls, then the fallback alone (floor(4/2) = 2 per user).
    let opened_at = Instant::now();
    let a = client.statuses(&url, &[("x-user", "a")], 4);
    assert_eq!(
        a,
        vec![200, 200, 429, 429],
        "fallback while the service is down"
    );
    let calls = gate.accepted();
    // A stream that answered nothing is reopened at once, then after a backoff: a take in it
    // fails without a connection (a failure all the same).
    let least = if t == Transport::Grpc { 2 } else { 3 };
    assert!(
        (least..=6).contains(&calls),
        "3 failures (per worker at most) before opening, got {calls} connections"
    );
    let more = client.statuses(&url, &[("x-user", "b")], 20);
    assert_eq!(count(&more, 200), 2, "{more:?}");
    assert!(
        opened_at.elapsed() < Duration::from_millis(2500),
        "test too slow to observe the open breaker"
    );
    assert_eq!(gate.accepted(), calls, "no calls while the breaker is open");
    assert!(envoy.tg("breaker.opened") >= 1, "{:?}", envoy.tg_all());
    assert_eq!(envoy.tg("breaker.open"), 1, "{:?}", envoy.tg_all());

    // Close: the service is reachable again; after the open period a probe succeeds.
    gate.set_mode(GateMode::Forward);
    std::thread::sleep(Duration::from_millis(3300).saturating_sub(opened_at.elapsed()));
    let mut recovered = false;
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut probes = 0;
    while Instant::now() < deadline && probes < 50 {
        probes += 1;
        // Fresh users so the fallback's buckets do not interfere.
        let r = client.get(&url, &[("x-user", &format!("probe{probes}"))]);
        assert_eq!(r.status, 200, "{r:?}");
        if envoy.tg("breaker.open") == 0 {
            recovered = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(recovered, "breaker closed again: {:?}", envoy.tg_all());
    let c_ = client.statuses(&url, &[("x-user", "c")], 6);
    assert_eq!(
        c_,
        vec![200, 200, 200, 200, 429, 429],
        "global limit (4), not the fallback's 2"
    );
    assert_eq!(upstream.requests(), 2 + 2 + probes as u64 + 4);
}

/// The token the service is started with (one it accepts: 32 bytes or more, no placeholder).
const TOKEN: &str = "e2e-token-5f0c3a9e1b7d4c2a8e6f0b1d3c5a7e9f";

/// The service requires a bearer token: the filter's configured token is accepted (global limit);
/// a wrong one is refused (401 / UNAUTHENTICATED), which is a failed callout like any other.
fn service_token_required(t: Transport) {
    let c = Components::get();
    let dir = TempDir::new("token");
    let redis = Redis::start(&c, &dir);
    let service = Service::start_with(&c, &dir, Some(&redis.url()), &["--token", TOKEN]);
    let upstream = Upstream::start();
    let client = Client::new();
    for (token, expect) in [(TOKEN, "global"), ("wrong", "fallback")] {
        let mut extra = json!({"fallback": {"instances": 2}});
        extra["service"] = json!({"token": token});
        let cfg = plugin(t, vec![rule("per-ip", &["client_ip"], 4)], extra);
        // A fresh Envoy per token; both share the service and Redis, so the rule key differs.
        let cfg = cfg.replace("\"per-ip\"", &format!("\"per-ip-{expect}\""));
        let envoy = Envoy::start(
            &c,
            &dir,
            &EnvoySpec::new(Some(cfg), service.port, upstream.port),
        );
        let st = client.statuses(&envoy.url("/"), &[], 5);
        let stats = envoy.tg_all();
        let get = |k: &str| stats.get(k).copied().unwrap_or(0);
        if expect == "global" {
            assert_eq!(st, vec![200, 200, 200, 200, 429], "{stats:?}");
            assert_eq!(get("allowed"), 4, "{stats:?}");
        } else {
            assert_eq!(st, vec![200, 200, 429, 429, 429], "fallback: floor(4/2)");
            let cause = match t {
                Transport::Http => "callout_failure.status",
                Transport::Grpc | Transport::GrpcUnary => "callout_failure.grpc_status",
            };
            assert!(get(cause) >= 1, "{stats:?}");
            assert_eq!(get("allowed"), 0, "{stats:?}");
        }
    }
}

/// While the service stays down, each failed probe doubles the open period up to `max_open_ms`:
/// the calls reaching the (refusing) service thin out, 300 → 600 → 1200 → 1200 ms apart.
fn breaker_backs_off(t: Transport) {
    let gate = Gate::start(GateMode::Refuse, 0);
    let cfg = plugin(
        t,
        vec![rule("per-ip", &["client_ip"], 1_000_000)],
        json!({"breaker": {"failures": 1, "open_ms": 300, "max_open_ms": 1200}}),
    );
    let s = Stack::start_without_service("backoff", &cfg, gate.port);
    let started = Instant::now();
    let mut calls: Vec<Duration> = Vec::new();
    let mut seen = 0;
    for _ in 0..400 {
        if started.elapsed() > Duration::from_millis(3700) {
            break;
        }
        assert_eq!(s.get("/", &[]).status, 200);
        let now = gate.accepted();
        if now > seen {
            // Connection attempts within 100 ms of each other belong to one call.
            let at = started.elapsed();
            if calls
                .last()
                .is_none_or(|l| at - *l > Duration::from_millis(100))
            {
                calls.push(at);
            }
            seen = now;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let gaps: Vec<u128> = calls
        .windows(2)
        .map(|w| (w[1] - w[0]).as_millis())
        .collect();
    eprintln!("calls at {calls:?}, {gaps:?} ms apart");
    assert!(gaps.len() >= 3, "calls at {calls:?}");
    assert!(
        (250..=800).contains(&gaps[0]),
        "first open period ~300 ms: {gaps:?}"
    );
    assert!(
        (500..=1100).contains(&gaps[1]),
        "doubled to ~600 ms: {gaps:?}"
    );
    assert!(
        (1000..=1700).contains(&gaps[2]),
        "doubled to ~1200 ms: {gaps:?}"
    );
    assert!(
        gaps.iter().all(|g| *g <= 1700),
        "capped at max_open_ms: {gaps:?}"
    );
    assert!(s.envoy.tg("breaker.opened") >= 1);
}
