//! End to end, an operator's question "why is this client limited?": a client drains its bucket
//! through real Envoy (429), the operator reads the bucket from the real service on real Redis
//! (`GET /v1/buckets` with the admin token: no tokens left, full again later), resets it
//! (`POST /v1/buckets/reset`), and the client's requests pass again (within the second the Envoy
//! remembers the denial it saw).

use crate::both_transports;
use crate::common;

use common::config::{plugin, rule, SLOW_PERIOD_MS};
use common::envoy::EnvoySpec;
use common::envoy_process::Envoy;
use common::http::Client;
use common::process::{Components, TempDir};
use common::redis::Redis;
use common::service::Service;
use common::upstream::Upstream;
use common::*;
use serde_json::{json, Value};

both_transports!(
    drained_inspected_reset_and_passing_again,
    a_leasing_envoy_sees_a_reset_within_remember_denials_ms
);

/// The admin token (one the service accepts: 32 bytes or more, no placeholder).
const ADMIN: &str = "e2e-admin-token-3b9f1d7c5a0e2f4b6d8c1a3e5f7b9d0c";

fn drained_inspected_reset_and_passing_again(t: Transport) {
    let c = Components::get();
    let dir = TempDir::new("buckets");
    let redis = Redis::start(&c, &dir);
    let service = Service::start_with(&c, &dir, Some(&redis.url()), &["--admin-token", ADMIN]);
    let upstream = Upstream::start();
    let cfg = plugin(
        t,
        vec![rule("per-key", &["header:x-api-key"], 2)],
        json!({}),
    );
    let envoy = Envoy::start(
        &c,
        &dir,
        &EnvoySpec::new(Some(cfg), service.port, upstream.port),
    );
    let client = Client::new();
    let url = envoy.url("/");
    let tenant = [("x-api-key", "tenant-a")];
    assert_eq!(client.statuses(&url, &tenant, 3), vec![200, 200, 429]);

    // The key as the filter sends it: the rule's name, then each key part (src/core/rules/keys.rs).
    let admin = format!("http://127.0.0.1:{}", service.port);
    let auth = format!("Bearer {ADMIN}");
    let query =
        format!("/v1/buckets?key=per-key%7Ctenant-a&capacity=2&rate=1&period_ms={SLOW_PERIOD_MS}");
    let r = client.get(&format!("{admin}{query}"), &[("authorization", &auth)]);
    assert_eq!(r.status, 200, "{r:?}");
    let v: Value = serde_json::from_str(&r.body).expect("JSON");
    assert_eq!(
        (
            v["exists"].clone(),
            v["remaining"].clone(),
            v["used"].clone()
        ),
        (json!(true), json!(0), json!(2)),
        "{v}"
    );
    // Two tokens at one per hour: full again in (1 h, 2 h].
    let reset_ms = v["reset_ms"].as_u64().expect("reset_ms");
    assert!(
        reset_ms > SLOW_PERIOD_MS && reset_ms <= 2 * SLOW_PERIOD_MS,
        "{v}"
    );
    // The admin endpoints are not reachable with no token.
    assert_eq!(client.get(&format!("{admin}{query}"), &[]).status, 401);

    let r = client.post(
        &format!("{admin}/v1/buckets/reset"),
        &[
            ("authorization", &auth),
            ("content-type", "application/json"),
        ],
        br#"{"key": "per-key|tenant-a"}"#,
    );
    assert_eq!(
        (r.status, r.body.trim()),
        (200, r#"{"reset":true}"#),
        "{r:?}"
    );
    // The Envoy remembers the denial it saw for up to `service.remember_denials_ms` (1 s by
    // default), so the reset shows there within that time.
    let reset_at = std::time::Instant::now();
    while client.statuses(&url, &tenant, 1) != vec![200] {
        assert!(
            reset_at.elapsed() < std::time::Duration::from_millis(1500),
            "the reset shows within the second a denial is remembered"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert_eq!(client.statuses(&url, &tenant, 2), vec![200, 429]);
    // Another client's bucket was not touched by any of it.
    assert_eq!(
        client.statuses(&url, &[("x-api-key", "tenant-b")], 3),
        vec![200, 200, 429]
    );
    assert_eq!(upstream.requests(), 6);
}

/// Lease mode: the pool remembers the service's denial (its `Retry-After` is an hour away) for
/// at most `service.remember_denials_ms`, as exact mode does, so an operator's reset shows here
/// within it too.
fn a_leasing_envoy_sees_a_reset_within_remember_denials_ms(t: Transport) {
    let c = Components::get();
    let dir = TempDir::new("buckets-lease");
    let redis = Redis::start(&c, &dir);
    let service = Service::start_with(&c, &dir, Some(&redis.url()), &["--admin-token", ADMIN]);
    let upstream = Upstream::start();
    let mut leased = rule("per-key", &["header:x-api-key"], 2);
    leased["lease"] = json!({"size": 1});
    let cfg = plugin(t, vec![leased], json!({}));
    let mut spec = EnvoySpec::new(Some(cfg), service.port, upstream.port);
    spec.concurrency = 1;
    let envoy = Envoy::start(&c, &dir, &spec);
    let client = Client::new();
    let url = envoy.url("/");
    let tenant = [("x-api-key", "tenant-l")];
    assert_eq!(client.statuses(&url, &tenant, 3), vec![200, 200, 429]);
    let r = client.post(
        &format!("http://127.0.0.1:{}/v1/buckets/reset", service.port),
        &[
            ("authorization", &format!("Bearer {ADMIN}")),
            ("content-type", "application/json"),
        ],
        br#"{"key": "per-key|tenant-l"}"#,
    );
    assert_eq!(r.status, 200, "{r:?}");
    let reset_at = std::time::Instant::now();
    while client.statuses(&url, &tenant, 1) != vec![200] {
        assert!(
            reset_at.elapsed() < std::time::Duration::from_millis(1500),
            "the reset shows within the second a lease pool remembers a denial"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    eprintln!(
        "lease pool: the reset showed after {} ms",
        reset_at.elapsed().as_millis()
    );
}
