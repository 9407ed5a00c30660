//! End to end, a rule with `"algorithm": "sliding_window"` through real Envoy, the real module, the
//! real service and real Redis: exact under contention through the service, a burst at the end of
//! one window still counted at the start of the next (where a fixed window admits afresh), and the
//! filter's fallback bounded by the last answer when the service is killed.

// A test reports a failure by panicking; the crate's no-panic lints are for the filter itself.
#![allow(
    clippy::panic,
    clippy::expect_used,
    clippy::unwrap_used,
    clippy::indexing_slicing
)]

use crate::both_transports;
use crate::common;

use common::clock::{now_ms, sleep_into_next_window};
use common::config::plugin;
use common::*;
use serde_json::{json, Value};
use std::time::Duration;

both_transports!(
    exact_under_32_parallel_clients,
    slides_across_a_window_boundary,
);

/// A day: a window no test crosses but in the first minutes of a UTC day, and even then the
/// previous window still weighs almost all of its count.
const DAY_MS: u64 = 86_400_000;

/// A sliding-window rule named `name` on one literal key.
fn sliding(name: &str, capacity: u64, period_ms: u64) -> Value {
    json!({"name": name, "key": [format!("literal:{name}")], "capacity": capacity,
           "period_ms": period_ms, "algorithm": "sliding_window"})
}

/// 32 clients on connections of their own (spread over Envoy's workers), 8 requests each, all
/// at once: the service admits exactly the capacity, counted at the upstream.
fn exact_under_32_parallel_clients(t: Transport) {
    const CAPACITY: usize = 50;
    let s = Stack::start(
        "sliding-concurrency",
        &plugin(t, vec![sliding("shared", 50, DAY_MS)], json!({})),
    );
    let all: Vec<u16> = burst(&[s.url("/")], 32, 8, &[], Duration::from_secs(60))
        .iter()
        .map(|r| r.status)
        .collect();
    assert_eq!(all.len(), 256, "every request answered in time");
    eprintln!(
        "sliding window, 32 clients x 8: {} admitted, {} limited",
        count(&all, 200),
        count(&all, 429)
    );
    assert_eq!(count(&all, 200), CAPACITY, "admitted");
    assert_eq!(count(&all, 429), all.len() - CAPACITY, "the rest limited");
    assert_eq!(s.upstream.requests(), CAPACITY as u64, "at the upstream");
    assert_eq!(s.envoy.tg("allowed"), CAPACITY as u64);
}

/// Requests to `path` one after the other until the first 429 (at most `max`): how many were
/// admitted, and the 429.
fn admitted_until_denied(s: &Stack, path: &str, max: usize) -> (usize, Reply) {
    for n in 0..max {
        let r = s.get(path, &[]);
        if r.status == 429 {
            return (n, r);
        }
        assert_eq!(r.status, 200, "{r:?}");
    }
    panic!("{max} admitted on {path}, none denied");
}

/// 10 per 4 s, sliding and fixed side by side. 10 admitted early in a window; a quarter into the
/// next window the fixed window admits 10 again, while the sliding window still counts 3/4 of the
/// burst (ceil(7.5) = 8) and admits 2 (3 if the requests ran late). Two windows after the burst
/// it has slid out: 10 again.
fn slides_across_a_window_boundary(t: Transport) {
    const PERIOD: u64 = 4000;
    let mut sw = sliding("sw", 10, PERIOD);
    sw["match"] = json!({"path_prefix": "/sw"});
    let mut fw = sliding("fw", 10, PERIOD);
    fw["algorithm"] = json!("fixed_window");
    fw["match"] = json!({"path_prefix": "/fw"});
    let s = Stack::start(
        "sliding-boundary",
        &plugin(
            t,
            vec![sw, fw],
            json!({"response": {"headers": ["x-ratelimit"]}}),
        ),
    );
    sleep_into_next_window(PERIOD, 50);
    for path in ["/sw", "/fw"] {
        let (n, _) = admitted_until_denied(&s, path, 20);
        assert_eq!(n, 10, "{path}: the capacity within one window");
    }

    sleep_into_next_window(PERIOD, PERIOD / 4);
    let (fixed, _) = admitted_until_denied(&s, "/fw", 20);
    // How far into the window the sliding burst ran (on a loaded machine it starts later than a
    // quarter in, and more of the last window has slid out by then).
    let into = |ms: u64| (ms % PERIOD) as f64 / PERIOD as f64;
    let started = into(now_ms());
    let (slid, denied) = admitted_until_denied(&s, "/sw", 20);
    let ended = into(now_ms());
    eprintln!(
        "{started:.2} to {ended:.2} into the next window: fixed window admitted {fixed}, sliding \
         window {slid}"
    );
    assert_eq!(fixed, 10, "a fixed window starts afresh");
    // The last window weighs 10 × (1 − f) at f into this one (rounded up): at a quarter, 8 of 10,
    // so 2 admitted; 3 if the burst ran past the point where it weighs 7.
    let weighs = |f: f64| (10.0 * (1.0 - f)).ceil() as usize;
    let (lo, hi) = (10 - weighs(started), 10 - weighs(ended));
    assert!(
        (lo..=hi).contains(&slid),
        "part of the burst still weighs: {slid} admitted, {lo}..={hi} expected from {started:.2} to \
         {ended:.2} into the window"
    );
    assert_eq!(denied.header("retry-after"), Some("1"), "{denied:?}");

    sleep_into_next_window(PERIOD, 50);
    sleep_into_next_window(PERIOD, 50);
    let (n, _) = admitted_until_denied(&s, "/sw", 20);
    assert_eq!(n, 10, "two windows later the burst has slid out");
    assert_eq!(s.upstream.requests(), (10 + 10 + fixed + slid + 10) as u64);
}

/// Capacity 20 a day, one proxy. The service admits 15 and is killed: the fallback continues from
/// the last answer (5 left), not from a fresh 20, so the proxy admits 20 in all, the capacity.
#[test]
fn fallback_bounded_when_the_service_is_killed() {
    let cfg = plugin(
        Transport::Http,
        vec![sliding("k", 20, DAY_MS)],
        json!({"failure_mode": "fallback", "fallback": {"instances": 1, "max_keys": 100},
               "breaker": {"failures": 0}}),
    );
    let mut s = Stack::start("sliding-fallback", &cfg);
    for i in 0..15 {
        assert_eq!(s.get("/", &[]).status, 200, "request {i}");
    }
    drop(s.service.take());
    let during: Vec<u16> = (0..20).map(|_| s.get("/", &[]).status).collect();
    let stats = s.envoy.tg_all();
    eprintln!(
        "service killed after 15: fallback admitted {} of 20, upstream saw {} in all",
        count(&during, 200),
        s.upstream.requests()
    );
    assert_eq!(count(&during, 200), 5, "{during:?}");
    assert_eq!(count(&during, 429), 15, "{during:?}");
    assert_eq!(stats.get("fallback.allowed"), Some(&5), "{stats:?}");
    assert_eq!(
        s.upstream.requests(),
        20,
        "15 + 5: the capacity, not one more"
    );
}
