//! A fallback that counts its proxies, end to end with real Envoys, the real service and real Redis.
//!
//! - `scaling_from_4_to_8_halves_the_fallback_share`: 4 Envoys under load, configured with
//!   `fallback.instances: 4`; 4 more start. Within a few seconds the service counts 8 live
//!   instances, and once it stops answering every Envoy's fallback share is `capacity / 8` (its
//!   `x-ratelimit-limit`) holding at most `remaining / 8` of its last answer, half of what the
//!   static split would give: the fleet stays within the contract's bound (`remaining + N`).
// A test reports a failure by panicking; the crate's no-panic lints are for the filter itself.
#![allow(
    clippy::panic,
    clippy::expect_used,
    clippy::unwrap_used,
    clippy::indexing_slicing
)]

use crate::common;

use common::config::{plugin, SLOW_PERIOD_MS};
use common::*;
use serde_json::json;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

const CAPACITY: u64 = 2000;

/// One answer: which Envoy, when, status, and its `x-ratelimit-limit` / `-remaining`.
#[derive(Debug, Clone, Copy)]
struct Seen {
    envoy: usize,
    at: Instant,
    status: u16,
    limit: u64,
    remaining: u64,
}

fn get(client: &Client, url: &str, envoy: usize) -> Option<Seen> {
    let r = client.try_get(url, &[]).ok()?;
    let n = |h: &str| r.header(h).and_then(|v| v.parse().ok()).unwrap_or(0);
    Some(Seen {
        envoy,
        at: Instant::now(),
        status: r.status,
        limit: n("x-ratelimit-limit"),
        remaining: n("x-ratelimit-remaining"),
    })
}

/// The service's `tollgate_live_instances`.
fn live_instances(client: &Client, service: &Service) -> u64 {
    let body = client
        .get(&format!("http://127.0.0.1:{}/metrics", service.port), &[])
        .body;
    body.lines()
        .find_map(|l| l.strip_prefix("tollgate_live_instances "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

#[test]
fn scaling_from_4_to_8_halves_the_fallback_share() {
    let c = Components::get();
    let dir = TempDir::new("scale");
    let redis = Redis::start(&c, &dir);
    let service = Service::start(&c, &dir, Some(&redis.url()));
    let gate = Gate::start(GateMode::Forward, service.port);
    let upstream = Upstream::start();
    let cfg = plugin(
        Transport::Http,
        vec![
            json!({"name": "api", "key": ["literal:all"], "capacity": CAPACITY, "rate": 1,
                    "period_ms": SLOW_PERIOD_MS}),
        ],
        json!({"failure_mode": "fallback", "fallback": {"instances": 4, "max_keys": 100},
               "service": {"batch": 0},
               "response": {"headers": ["x-ratelimit"], "on_allowed": true}}),
    );
    let spec = || {
        let mut s = EnvoySpec::new(Some(cfg.clone()), gate.port, upstream.port);
        s.concurrency = 1;
        s.log_level = "wasm:info".into();
        s
    };
    let specs: Vec<EnvoySpec> = (0..4).map(|_| spec()).collect();
    let mut envoys = Envoy::start_all(&c, &dir, &specs);
    let client = Client::new();

    // Load: one client per Envoy, a request every 50 ms.
    let seen = Arc::new(Mutex::new(Vec::<Seen>::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let paced = |i: usize, url: String| {
        let (seen, stop) = (seen.clone(), stop.clone());
        thread::spawn(move || {
            let client = Client::new();
            while !stop.load(Ordering::Relaxed) {
                if let Some(s) = get(&client, &url, i) {
                    seen.lock().unwrap().push(s);
                }
                thread::sleep(Duration::from_millis(50));
            }
        })
    };
    let mut load: Vec<_> = envoys
        .iter()
        .enumerate()
        .map(|(i, e)| paced(i, e.url("/")))
        .collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    while live_instances(&client, &service) != 4 {
        assert!(
            Instant::now() < deadline,
            "the service never counted 4 instances"
        );
        thread::sleep(Duration::from_millis(100));
    }

    // Scale to 8.
    let more: Vec<EnvoySpec> = (0..4).map(|_| spec()).collect();
    envoys.extend(Envoy::start_all(&c, &dir, &more));
    let scaled_at = Instant::now();
    load.extend(
        envoys
            .iter()
            .enumerate()
            .skip(4)
            .map(|(i, e)| paced(i, e.url("/"))),
    );
    while live_instances(&client, &service) != 8 {
        assert!(
            scaled_at.elapsed() < Duration::from_secs(10),
            "the service never counted 8 instances"
        );
        thread::sleep(Duration::from_millis(50));
    }
    let counted_after = scaled_at.elapsed();
    // A few seconds of load on all 8, so each has answers that say 8.
    thread::sleep(Duration::from_secs(3));
    stop.store(true, Ordering::Relaxed);
    for t in load {
        t.join().unwrap();
    }

    // The outage: every Envoy is asked 400 times, all 8 at once.
    gate.set_mode(GateMode::Refuse);
    gate.drop_connections();
    let outage_at = Instant::now();
    let urls: Vec<String> = envoys.iter().map(|e| e.url("/")).collect();
    let during: Vec<Seen> = thread::scope(|s| {
        let hs: Vec<_> = urls
            .iter()
            .enumerate()
            .map(|(i, url)| {
                s.spawn(move || {
                    let client = Client::new();
                    (0..400)
                        .filter_map(|_| get(&client, url, i))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        hs.into_iter().flat_map(|h| h.join().unwrap()).collect()
    });

    let seen = seen.lock().unwrap().clone();
    let served = |s: &&Seen| s.status == 200 && s.limit == CAPACITY;
    let mut total_fallback = 0;
    let mut max_left = 0;
    for i in 0..8 {
        // What the last answer to this Envoy said was left.
        let left = seen
            .iter()
            .filter(|s| s.envoy == i && s.at < outage_at)
            .filter(served)
            .max_by_key(|s| s.at)
            .map(|s| s.remaining)
            .unwrap_or_else(|| panic!("envoy {i} had no answer before the outage"));
        let mine: Vec<&Seen> = during.iter().filter(|s| s.envoy == i).collect();
        let admitted = mine.iter().filter(|s| s.status == 200).count() as u64;
        let limits: Vec<u64> = mine
            .iter()
            .filter(|s| s.status == 200)
            .map(|s| s.limit)
            .collect();
        eprintln!(
            "envoy {i}: last answer left {left}; admitted {admitted} of {} in the outage, local \
             limit {:?}",
            mine.len(),
            limits.first()
        );
        assert!(
            limits.iter().all(|&l| l == CAPACITY / 8),
            "envoy {i}: the fallback splits by 8, not by the configured 4: {limits:?}"
        );
        assert!(
            admitted <= left / 8 + 1,
            "envoy {i}: admitted {admitted} > {left} / 8 + 1 (the share of 8)"
        );
        assert!(
            admitted + 1 >= left / 8,
            "envoy {i}: its share is there to spend: {admitted} of {left} / 8"
        );
        total_fallback += admitted;
        max_left = max_left.max(left);
    }
    eprintln!(
        "counted 8 instances {counted_after:?} after the scale-up; fallback admitted \
         {total_fallback} in all, the bound is {} (remaining {max_left} + N 8); the static split \
         of 4 would have allowed about {}",
        max_left + 8,
        max_left / 4 * 8
    );
    assert!(
        counted_after < Duration::from_secs(5),
        "counted after {counted_after:?}"
    );
    assert!(
        total_fallback <= max_left + 8,
        "the fleet stays within the bound: {total_fallback} > {max_left} + 8"
    );
    drop(envoys);
    drop(gate);
    drop(service);
    drop(redis);
}
