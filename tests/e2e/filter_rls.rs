//! The filter's `rls` transport: Tollgate's filter asking an RLS v3 server (here tollgate-server's
//! own RLS endpoint, with a limits file in envoyproxy/ratelimit's format) through
//! `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`, with its failure modes and
//! fallback around it. Real Envoy, real Redis, the real service.
// A test reports a failure by panicking; the crate's no-panic lints are for the filter itself.
#![allow(
    clippy::panic,
    clippy::expect_used,
    clippy::unwrap_used,
    clippy::indexing_slicing
)]

use crate::common;
// Only its service and limits-file helpers are used here.
#[allow(dead_code)]
use crate::native_rls as rls;

use common::*;
use rls::{start_service, LimitsFile};
use std::time::Duration;

/// The server's limits: 5 per hour per API key under the rule's descriptor, as the filter's default
/// descriptor spells it (`rule=<name>`, then the header's name).
const LIMITS: &str = "domain: edge
descriptors:
  - key: rule
    value: per-key
    descriptors:
      - key: x-api-key
        rate_limit:
          unit: hour
          requests_per_unit: 5
";

fn filter_config() -> String {
    Plugin::new("rls", 1000)
        .service("domain", r#""edge""#)
        .rule(r#"{"name": "per-key", "key": ["header:x-api-key"], "capacity": 5, "rate": 5, "period_ms": 3600000}"#)
        .failure_mode("fallback")
        .fallback(1, 1000)
        .field("breaker", r#"{"failures": 1, "open_ms": 60000}"#)
        .response(r#"{"headers": ["x-ratelimit"]}"#)
        .json()
}

#[test]
fn the_filter_limits_through_an_rls_server_and_falls_back_from_its_answers() {
    let c = Components::get();
    let dir = TempDir::new("filter-rls");
    let redis = Redis::start(&c, &dir);
    let limits = LimitsFile::new(&dir, LIMITS);
    let mut service = start_service(&c, &dir, Some(&redis.url()), &limits, 1000, &[]);
    let upstream = Upstream::start();
    let envoy = Envoy::start(
        &c,
        &dir,
        &EnvoySpec::new(Some(filter_config()), service.port, upstream.port),
    );
    let url = envoy.url("/");

    // 32 clients at once on one key: exactly the server's 5 pass.
    let statuses: Vec<u16> = burst(
        std::slice::from_ref(&url),
        32,
        2,
        &[("x-api-key", "a")],
        Duration::from_secs(60),
    )
    .iter()
    .map(|r| r.status)
    .collect();
    assert_eq!(count(&statuses, 200), 5, "{statuses:?}");
    assert_eq!(count(&statuses, 429), 59);
    let client = Client::new();
    let denied = client.get(&url, &[("x-api-key", "a")]);
    assert_eq!(denied.status, 429);
    assert_eq!(denied.header("x-ratelimit-limit"), Some("5"), "{denied:?}");
    assert_eq!(denied.header("x-ratelimit-remaining"), Some("0"));
    assert!(denied.header("retry-after").is_some());
    // Another key is another bucket on the server.
    let b = client.statuses(&url, &[("x-api-key", "b")], 3);
    assert_eq!(b, vec![200, 200, 200]);
    let stats = envoy.tg_all();
    assert_eq!(stats.get("allowed"), Some(&8), "{stats:?}");
    assert_eq!(upstream.requests(), 8);

    // The server goes away: the fallback continues from its answers. Key `a` had none left, `b`
    // had 2, and a key never seen gets the static split (5 / 1 proxy).
    service.proc.kill();
    assert_eq!(
        count(&client.statuses(&url, &[("x-api-key", "a")], 3), 200),
        0
    );
    assert_eq!(
        count(&client.statuses(&url, &[("x-api-key", "b")], 4), 200),
        2
    );
    assert_eq!(
        count(&client.statuses(&url, &[("x-api-key", "new")], 7), 200),
        5
    );
    let stats = envoy.tg_all();
    assert_eq!(stats.get("fallback.allowed"), Some(&7), "{stats:?}");
    drop(envoy);
    drop(redis);
}
