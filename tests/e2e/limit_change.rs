//! A changed limit keeps the count, end to end with real Envoy, the real service and real Redis.
//!
//! - `lowered_limit_gives_no_burst`: under load, a rule goes from 100 per minute to 50 per minute
//!   with an LDS push. The bucket keeps its count: the first answers under the new limit show what
//!   was left, halved (the fraction held is kept), and what is admitted after the change stays within
//!   that plus the refill, never a fresh 50.
// A test reports a failure by panicking; the crate's no-panic lints are for the filter itself.
#![allow(
    clippy::panic,
    clippy::expect_used,
    clippy::unwrap_used,
    clippy::indexing_slicing
)]

use crate::common;

use common::config::plugin;
use common::push::Pushed;
use common::*;
use serde_json::json;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

/// One answered request: when it was answered, its status, and the `x-ratelimit-limit` and
/// `-remaining` it carried.
#[derive(Debug, Clone, Copy)]
struct Seen {
    at: Instant,
    status: u16,
    limit: u64,
    remaining: u64,
}

#[test]
fn lowered_limit_gives_no_burst() {
    let c = Components::get();
    let dir = TempDir::new("limit-change");
    let redis = Redis::start(&c, &dir);
    let service = Service::start(&c, &dir, Some(&redis.url()));
    let upstream = Upstream::start();
    let cfg = |per_minute: u64| {
        plugin(
            Transport::Http,
            vec![
                json!({"name": "api", "key": ["literal:all"], "capacity": per_minute,
                        "rate": per_minute, "period_ms": 60_000}),
            ],
            json!({"failure_mode": "deny", "response": {"headers": ["x-ratelimit"], "on_allowed": true}}),
        )
    };
    let mut spec = EnvoySpec::new(Some(cfg(100)), service.port, upstream.port);
    spec.log_level = "wasm:info".into();
    let mut envoy = Pushed::start(&c, &dir, spec);
    let base = envoy.envoy.url("/");

    // Load: 4 clients, each a request every 100 ms (about 40 per second in all), from before the
    // change until 3 s after it: the 60 tokens left last longer than the push takes.
    let stop = Arc::new(AtomicBool::new(false));
    let admitted = Arc::new(AtomicU64::new(0));
    let seen = Arc::new(Mutex::new(Vec::<Seen>::new()));
    let load: Vec<_> = (0..4)
        .map(|_| {
            let (stop, admitted, seen, base) =
                (stop.clone(), admitted.clone(), seen.clone(), base.clone());
            thread::spawn(move || {
                let client = Client::new();
                while !stop.load(Ordering::Relaxed) {
                    if let Ok(r) = client.try_get(&base, &[]) {
                        let n = |h: &str| r.header(h).and_then(|v| v.parse().ok()).unwrap_or(0);
                        let s = Seen {
                            at: Instant::now(),
                            status: r.status,
                            limit: n("x-ratelimit-limit"),
                            remaining: n("x-ratelimit-remaining"),
                        };
                        if r.status == 200 {
                            admitted.fetch_add(1, Ordering::Relaxed);
                        }
                        seen.lock().unwrap().push(s);
                    }
                    thread::sleep(Duration::from_millis(100));
                }
            })
        })
        .collect();

    // 40 of 100 spent: about 60 left when the limit is halved.
    let deadline = Instant::now() + Duration::from_secs(20);
    while admitted.load(Ordering::Relaxed) < 40 {
        assert!(Instant::now() < deadline, "the load never got 40 through");
        thread::sleep(Duration::from_millis(2));
    }
    let pushed_at = Instant::now();
    envoy.push(&cfg(50));
    let applied_at = Instant::now();
    thread::sleep(Duration::from_secs(3));
    stop.store(true, Ordering::Relaxed);
    for t in load {
        t.join().unwrap();
    }
    let end = Instant::now();

    let seen = seen.lock().unwrap().clone();
    let ok = |limit: u64| {
        seen.iter()
            .filter(move |s| s.status == 200 && s.limit == limit)
    };
    let before = ok(100).count() as u64;
    let after = ok(50).count() as u64;
    let denied = seen.iter().filter(|s| s.status == 429).count();
    // What the old limit had left at its last answer, and the first answer under the new one.
    let last_old = ok(100)
        .map(|s| s.remaining)
        .min()
        .expect("answers under the old limit");
    let last_old_at = ok(100).map(|s| s.at).max().unwrap();
    let first_new = seen
        .iter()
        .filter(|s| s.limit == 50)
        .min_by_key(|s| s.at)
        .copied()
        .expect("answers under the new limit");
    // Refill allowance, rounded up plus one for a fraction carried: 100/min between the last
    // answer under the old limit and the first under the new one, 50/min from then on.
    let refill = |per_min: f64, d: Duration| (per_min * d.as_secs_f64() / 60.0).ceil() as u64 + 1;
    let gap = first_new.at.saturating_duration_since(last_old_at);
    let carried = (last_old + refill(100.0, gap)) / 2;
    let bound = carried + refill(50.0, end.saturating_duration_since(first_new.at));
    eprintln!(
        "admitted under 100/min: {before} (last remaining {last_old}); first answer under 50/min: \
         {first_new:?}; admitted under 50/min: {after} (bound {bound}); denied {denied}; upstream \
         {}; push took {:?}",
        upstream.requests(),
        applied_at - pushed_at
    );
    assert_eq!(
        upstream.requests(),
        before + after,
        "every 200 reached upstream"
    );
    assert!(
        first_new.remaining <= carried,
        "the first answer under 50/min shows what was left, halved ({carried} at most), not a \
         fresh bucket: {first_new:?}"
    );
    assert!(
        after <= bound,
        "admitted after the change: {after}, at most {bound} (what was left, halved, and the refill)"
    );
    assert!(
        after >= (last_old / 2).saturating_sub(1),
        "the carried tokens are there to spend: {after} admitted, {last_old} were left"
    );
    assert!(
        after < 50,
        "a fresh bucket would have admitted 50 after the change"
    );
    assert!(denied > 0, "the load ran into the limit");
    drop(envoy);
    drop(service);
    drop(redis);
}
