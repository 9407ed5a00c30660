//! The harness itself, on real processes: Envoy without the filter routes to the counting upstream,
//! Redis answers PING, the gate forwards, refuses and black-holes as told.

// A test reports a failure by panicking; the crate's no-panic lints are for the filter itself.
#![allow(
    clippy::panic,
    clippy::expect_used,
    clippy::unwrap_used,
    clippy::indexing_slicing
)]

use crate::common;

use common::*;
use std::time::Duration;

#[test]
fn envoy_without_filter_reaches_the_counting_upstream() {
    let c = Components::get();
    let dir = TempDir::new("harness");
    let upstream = Upstream::start();
    let spec = EnvoySpec::new(None, closed_port(), upstream.port);
    let envoy = Envoy::start(&c, &dir, &spec);
    let client = Client::new();
    for _ in 0..5 {
        let r = client.get(&envoy.url("/x"), &[("x-test", "1")]);
        assert_eq!(r.status, 200);
        assert_eq!(r.body, "upstream\n");
    }
    assert_eq!(upstream.requests(), 5);
    assert!(upstream.heads()[0].starts_with("GET /x HTTP/1.1"));
    let stats = envoy.stats("cluster.upstream.upstream_rq_total");
    assert_eq!(stats.get("cluster.upstream.upstream_rq_total"), Some(&5));
}

#[test]
fn redis_and_gate_modes() {
    let c = Components::get();
    let dir = TempDir::new("harness-redis");
    let mut redis = Redis::start(&c, &dir);
    assert!(redis_ping(redis.port));
    let gate = Gate::start(GateMode::Forward, redis.port);
    assert!(redis_ping(gate.port), "forwarded PING");
    gate.set_mode(GateMode::Refuse);
    assert!(!redis_ping(gate.port), "refused");
    gate.set_mode(GateMode::BlackHole);
    let t = std::time::Instant::now();
    assert!(!redis_ping(gate.port), "black hole answers nothing");
    assert!(t.elapsed() >= Duration::from_millis(400));
    assert_eq!(gate.accepted(), 3);
    redis.stop();
    assert!(!redis_ping(redis.port));
}

/// A module panic or trap in Envoy's log fails the test that ran that Envoy.
#[test]
#[should_panic(expected = "the module failed in Envoy")]
fn a_module_failure_in_envoys_log_fails_the_test() {
    use std::io::Write;
    let c = Components::get();
    let dir = TempDir::new("harness-panic");
    let spec = EnvoySpec::new(None, closed_port(), closed_port());
    let mut envoy = Envoy::start(&c, &dir, &spec);
    envoy.proc.kill();
    let mut log = std::fs::OpenOptions::new()
        .append(true)
        .open(&envoy.proc.log)
        .expect("open envoy log");
    writeln!(
        log,
        "[critical][wasm] wasm log tollgate: panic: injected by the test"
    )
    .expect("write");
    drop(envoy);
}
