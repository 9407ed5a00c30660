//! End to end, lease mode: real Envoys (each `--concurrency 2`) running the real module, the real
//! service and real Redis. What is checked is what clients see, what reaches the upstream, and how
//! many decisions the service made (its `tollgate_decisions_total`).
//!
//! Each test but the last runs over both transports.
//!
//! - `fleet_never_exceeds_the_limit`: three Envoys hit round-robin by concurrent
//!   clients admit at most capacity + refill, at least that minus the tokens the pools can strand,
//!   with a small fraction of the service decisions one callout per request would take.
//! - `denials_are_cached_and_pools_spent`: after the service denies, further requests are denied
//!   by the filter without a callout; granted tokens are all spent, none more.
//! - `an_expired_pool_asks_again`: a pool unused for `max_age_ms` gives its tokens back and the next
//!   request asks the service again.
//! - `unspent_tokens_go_back_to_the_bucket`: tokens a pool did not spend within `max_age_ms` are
//!   refunded by the worker's timer, so the proxy admits the whole capacity, not less.
//! - `an_adaptive_pool_follows_the_rate`: without a `size`, the first requests ask one token at a
//!   time, and the grants grow with the rate, never above capacity / instances.
//! - `a_lease_fleet_admits_what_exact_mode_admits`: four Envoys, round-robin clients far above a
//!   limit of 200/s for 5 s: exact mode and adaptive lease each admit at most the ideal
//!   (capacity + rate × elapsed, counted at the upstream), and lease at least 0.98 of it.
//! - `service_down_falls_back`: with the service unreachable, lease rules use the fallback buckets.
//! - `a_quiet_leasing_fleet_stays_counted`: two Envoys paying from minute-long leases make no
//!   callout for 12 s and are still counted among the live instances.

// A test reports a failure by panicking; the crate's no-panic lints are for the filter itself.
#![allow(
    clippy::panic,
    clippy::expect_used,
    clippy::unwrap_used,
    clippy::indexing_slicing
)]

use crate::both_transports;
use crate::common;

use common::config::{plugin, SLOW_PERIOD_MS};
use common::load::{Load, Tally};
use common::*;
use serde_json::json;
use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

both_transports!(
    fleet_never_exceeds_the_limit,
    denials_are_cached_and_pools_spent,
    an_expired_pool_asks_again,
    unspent_tokens_go_back_to_the_bucket,
    an_adaptive_pool_follows_the_rate,
);

/// The fleet test starts several Envoys and loads them; it runs alone so the timings hold.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// A lease rule on one shared key (every request, every Envoy, one global bucket).
fn lease_rule(
    capacity: u64,
    rate: u64,
    period_ms: u64,
    size: u64,
    max_age_ms: u64,
) -> serde_json::Value {
    json!({"name": "lease", "key": ["literal:shared"], "capacity": capacity, "rate": rate,
           "period_ms": period_ms, "lease": {"size": size, "max_age_ms": max_age_ms}})
}

/// The service's decisions so far (`tollgate_decisions_total`, all outcomes).
fn decisions(service: &Service) -> u64 {
    decisions_by(service, "")
}

/// The service's decisions so far whose `outcome` label contains `outcome` ("" = all).
fn decisions_by(service: &Service, outcome: &str) -> u64 {
    let text = service.metrics();
    let total: f64 = text
        .lines()
        .filter(|l| l.starts_with("tollgate_decisions_total"))
        .filter(|l| l.contains(&format!("outcome=\"{outcome}")))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    // The family appears with the first decision; before that the exposition still ends in EOF.
    assert!(
        text.contains("# EOF"),
        "the service's /metrics did not answer:\n{text}"
    );
    total as u64
}

fn stat(stats: &BTreeMap<String, u64>, name: &str) -> u64 {
    stats.get(name).copied().unwrap_or(0)
}

/// The load tested the limit: more than `demand` requests sent, every 200 a request the upstream
/// counted (`admitted`), no callout failed.
fn assert_fair_load(
    what: &str,
    tally: &Tally,
    admitted: u64,
    stats: &BTreeMap<String, u64>,
    demand: f64,
) {
    assert!(
        tally.sent() as f64 > demand,
        "{what}: demand must exceed the limit by far: {} requests",
        tally.sent()
    );
    assert_eq!(
        tally.count(200),
        admitted,
        "{what}: a 200 is a request at the upstream"
    );
    assert_eq!(
        stat(stats, "failure_closed.limited"),
        0,
        "{what}: no failed callout: {stats:?}"
    );
}

/// Three Envoys, one limit, lease size 20: the upstream sees at most capacity + refill, never more,
/// and the service is asked a small fraction of the times requests arrive.
fn fleet_never_exceeds_the_limit(transport: Transport) {
    let _serial = serial();
    const N: u64 = 3;
    const CAPACITY: u64 = 300;
    const RATE: u64 = 4; // per second: slow against a demand of hundreds per second
    const PERIOD_MS: u64 = 1000;
    const L: u64 = 20;

    let c = Components::get();
    let dir = TempDir::new("lease-fleet");
    let redis = Redis::start(&c, &dir);
    let service = Service::start(&c, &dir, Some(&redis.url()));
    let upstream = Upstream::start();
    // Failing closed: a failed callout shows up as a missing admission, never as a fallback one.
    let cfg = plugin(
        transport,
        vec![lease_rule(CAPACITY, RATE, PERIOD_MS, L, 1000)],
        json!({"failure_mode": "deny"}),
    );
    let envoys: Vec<Envoy> = (0..N)
        .map(|_| {
            let mut spec = EnvoySpec::new(Some(cfg.clone()), service.port, upstream.port);
            spec.log_level = "wasm:info".into();
            Envoy::start(&c, &dir, &spec)
        })
        .collect();
    let before = decisions(&service);
    let allowed_before = decisions_by(&service, "allowed");

    let tally = Load::run(
        &envoys,
        12,
        Duration::from_millis(3250),
        u64::MAX,
        Duration::ZERO,
    );
    let elapsed = tally.elapsed;
    let admitted = upstream.requests();
    let refill = (RATE as f64 * elapsed.as_secs_f64() * 1000.0 / PERIOD_MS as f64).floor() as u64;
    let limit = CAPACITY + refill;
    let asked = decisions(&service) - before;
    let granting = decisions_by(&service, "allowed") - allowed_before;
    let stats = tg_total(&envoys);
    eprintln!(
        "lease fleet ({}): {} requests in {:.3} s, admitted {admitted} (limit {limit} = {CAPACITY} + {refill}), \
         service decisions {asked} ({granting} allowed), statuses {:?}, filter stats {stats:?}",
        transport.name(),
        tally.sent(),
        elapsed.as_secs_f64(),
        tally.statuses
    );

    assert_eq!(
        tally.count(200) + tally.count(429),
        tally.sent(),
        "only 200 and 429: {:?}",
        tally.statuses
    );
    assert_fair_load("fleet", &tally, admitted, &stats, 3.0 * limit as f64);
    // Every admitted request spent a token the service charged within the run: never more.
    assert!(
        admitted <= limit,
        "admitted {admitted} > {limit}: the limit was exceeded"
    );
    // What can be charged and not spent: the tokens in a pool when the run ends (a pool holds at
    // most L: one refill in flight per pool, asking for L minus what the pool holds) or expired
    // (none here: every Envoy has demand throughout, and a pool lives 1 s), so at most N × L, one
    // pool per Envoy, shared by its workers. One more for a refill falling in the last few ms.
    let stranded = N * L + 1;
    assert!(
        admitted + stranded >= limit,
        "admitted {admitted} < {limit} - {stranded}: more lost than the pools can hold"
    );
    // One callout per request would be `sent` decisions. The denial cache answers most 429s.
    // When a cached denial ends (a token is due), every request then in flight on that Envoy asks
    // (only one may refill, the others ask plainly and are mostly denied): that is where most of
    // the decisions in the exhausted phase come from.
    assert!(
        asked * (L / 2) <= tally.sent(),
        "{asked} service decisions for {} requests: more than one per L/2",
        tally.sent()
    );
    // While tokens last, a granting decision brings about 3/4 L of them (the refill asks for L
    // minus what is left); once exhausted each brings one. On average well above L/4.
    assert!(
        granting * (L / 4) <= admitted,
        "{granting} granting decisions for {admitted} admissions: the pools are not used"
    );
    assert!(stat(&stats, "lease.local") > 0 && stat(&stats, "lease.local_limited") > 0);
    assert_eq!(
        stat(&stats, "allowed") + stat(&stats, "limited"),
        tally.sent(),
        "allowed/limited count every decision, local or not"
    );
}

/// One Envoy, capacity 5 that never refills within the test, lease size 5: exactly 5 requests pass,
/// the tokens granted in a batch are all spent (none lost, none extra), and after the service's
/// denial the others are denied locally, with the service's Retry-After.
fn denials_are_cached_and_pools_spent(transport: Transport) {
    let cfg = plugin(
        transport,
        vec![lease_rule(5, 1, SLOW_PERIOD_MS, 5, 60_000)],
        json!({"failure_mode": "deny", "response": {"headers": ["x-ratelimit"]}}),
    );
    let s = Stack::start("lease-deny", &cfg);
    let service = s.service.as_ref().unwrap();
    let mut replies: Vec<Reply> = (0..5).map(|_| s.get("/", &[])).collect();
    // The first request's lease (5 granted, 4 pooled); the fourth left 1, below 5 / 4, and started
    // a background refill, which the empty bucket denies. No request waited for it.
    assert!(
        eventually(Duration::from_secs(5), || decisions(service) == 2),
        "the background refill was answered"
    );
    replies.extend((0..7).map(|_| s.get("/", &[])));
    let statuses: Vec<u16> = replies.iter().map(|r| r.status).collect();
    assert_eq!(statuses, [vec![200; 5], vec![429; 7]].concat());
    assert_eq!(s.upstream.requests(), 5);
    let asked = decisions(service);
    // Nothing after the refill's denial: it is cached.
    assert_eq!(asked, 2, "service decisions");
    assert_eq!(s.envoy.tg("lease.refills"), 1);
    assert_eq!(s.envoy.tg("lease.local_limited"), 7);
    assert_eq!(s.envoy.tg("lease.granted"), 5);
    assert_eq!(s.envoy.tg("limited"), 7);
    let last = replies.last().unwrap();
    let retry: u64 = last.header("retry-after").unwrap().parse().unwrap();
    // One token per hour: the service said about an hour, and the filter counts down from there.
    assert!((3500..=3600).contains(&retry), "retry-after {retry}");
    assert_eq!(last.header("x-ratelimit-remaining"), Some("0"));
}

/// A pool unused for max_age_ms is dropped (counted), and the next request asks the service.
fn an_expired_pool_asks_again(transport: Transport) {
    let cfg = plugin(
        transport,
        vec![lease_rule(1000, 1000, SLOW_PERIOD_MS, 10, 1000)],
        json!({}),
    );
    let s = Stack::start("lease-expiry", &cfg);
    let service = s.service.as_ref().unwrap();
    assert_eq!(s.get("/", &[]).status, 200);
    assert_eq!(decisions(service), 1);
    // 9 pooled; the first 6 local takes leave 3 or more, above the refill mark (10 / 4 = 3).
    for _ in 0..4 {
        assert_eq!(s.get("/", &[]).status, 200);
    }
    assert_eq!(decisions(service), 1, "spent from the pool");
    assert_eq!(s.envoy.tg("lease.local"), 4);
    thread::sleep(Duration::from_millis(1100));
    assert_eq!(s.get("/", &[]).status, 200);
    assert_eq!(decisions(service), 2, "the expired pool asked again");
    assert_eq!(s.envoy.tg("lease.expired"), 5, "the 5 left expired");
    assert_eq!(
        s.envoy.tg("lease.returned"),
        5,
        "and went back to the bucket"
    );
    assert_eq!(s.envoy.tg("lease.granted"), 20);
    assert_eq!(s.upstream.requests(), 6);
}

/// One Envoy, capacity 10 that never refills within the test, a lease of 6 that lives 500 ms. The
/// first request leases 6 and spends 1; the 5 left are not spent before they expire, and the
/// worker's timer gives them back. So the proxy admits the whole capacity, 10, and not 1 + 4.
fn unspent_tokens_go_back_to_the_bucket(transport: Transport) {
    let cfg = plugin(
        transport,
        vec![lease_rule(10, 1, SLOW_PERIOD_MS, 6, 500)],
        json!({"failure_mode": "deny"}),
    );
    let s = Stack::start("lease-refund", &cfg);
    assert_eq!(s.get("/", &[]).status, 200);
    assert!(
        eventually(Duration::from_secs(5), || s.envoy.tg("lease.returned") == 5),
        "the 5 unspent tokens were given back: {:?}",
        s.envoy.tg_all()
    );
    let statuses = s.client.statuses(&s.url("/"), &[], 14);
    assert_eq!(
        count(&statuses, 200),
        9,
        "1 + 9 = the capacity: {statuses:?}, filter stats {:?}",
        s.envoy.tg_all()
    );
    assert_eq!(s.upstream.requests(), 10);
    assert_eq!(s.envoy.tg("lease.expired"), 5);
    assert_eq!(s.envoy.tg("lease.returned"), 5);
}

/// Without a `size`: the first requests of a key find no rate and ask for their cost alone; under
/// steady traffic the grants grow with the rate, bounded by capacity / instances (here 1000 / 4).
fn an_adaptive_pool_follows_the_rate(transport: Transport) {
    let rule = json!({"name": "lease", "key": ["literal:shared"], "capacity": 1000,
                      "period_ms": SLOW_PERIOD_MS, "lease": {"max_age_ms": 1000}});
    let cfg = plugin(
        transport,
        vec![rule],
        // One Envoy here; the bound is for a fleet of at least 4 (the service reports 1 live
        // instance, floored at min_instances).
        json!({"failure_mode": "deny", "fallback": {"instances": 4, "min_instances": 4}}),
    );
    let s = Stack::start("lease-adaptive", &cfg);
    let service = s.service.as_ref().unwrap();
    let first = s.get("/", &[]);
    assert_eq!(
        first.status,
        200,
        "{first:?}, filter stats {:?}",
        s.envoy.tg_all()
    );
    assert_eq!(s.envoy.tg("lease.granted"), 0, "no rate known: no lease");
    // Sequential requests for 2 s (a rate of a few hundred a second here), at most 700: with at
    // most 250 more held in the pool, the bucket of 1000 never runs out.
    let start = Instant::now();
    let mut sent = 1;
    while start.elapsed() < Duration::from_secs(2) && sent < 700 {
        assert_eq!(s.get("/", &[]).status, 200);
        sent += 1;
    }
    let asked = decisions(service);
    let granted = s.envoy.tg("lease.granted");
    eprintln!(
        "adaptive lease ({}): {sent} requests, {asked} service decisions, {granted} tokens granted, \
         filter stats {:?}",
        transport.name(),
        s.envoy.tg_all()
    );
    assert!(sent > 100, "too slow to say anything: {sent} requests");
    assert!(
        asked * 5 <= sent,
        "{asked} decisions for {sent} requests: the pool did not grow with the rate"
    );
    assert!(
        s.envoy.tg("lease.local") * 2 > sent,
        "most requests were local"
    );
    // Never more than capacity / instances in one grant, so with every request spending one
    // token, at most that many tokens can be held beyond what was spent.
    assert!(
        granted <= sent + 250,
        "granted {granted} for {sent} requests"
    );
    assert_eq!(s.upstream.requests(), sent);
}

/// Accuracy, end to end: 4 Envoys (`--concurrency 2`) behind round-robin clients that ask far more
/// than a limit of 200 a second (capacity 200) for 5 s, first on an exact rule, then on an
/// adaptive lease rule (each its own bucket). The ideal is capacity + rate × elapsed. Nothing may
/// pass above it; exact mode is the reference, and the lease fleet, which holds tokens in four
/// pools and gives back what it does not spend, must reach 0.98 of it.
#[test]
pub(crate) fn a_lease_fleet_admits_what_exact_mode_admits() {
    let _serial = serial();
    const N: usize = 4;
    const CAPACITY: u64 = 200;
    const RATE: u64 = 200; // per second
    const SECONDS: u64 = 5;
    let c = Components::get();
    let dir = TempDir::new("lease-accuracy");
    let redis = Redis::start(&c, &dir);
    let service = Service::start(&c, &dir, Some(&redis.url()));
    let upstream = Upstream::start();
    let rule = |name: &str, lease: Option<serde_json::Value>| {
        let mut r = json!({"name": name, "match": {"path_prefix": format!("/{name}")},
                           "key": [format!("literal:{name}")], "capacity": CAPACITY,
                           "rate": RATE, "period_ms": 1000});
        if let Some(l) = lease {
            r["lease"] = l;
        }
        r
    };
    let cfg = plugin(
        Transport::Http,
        vec![rule("exact", None), rule("lease", Some(json!({})))],
        json!({"failure_mode": "deny", "fallback": {"instances": N}}),
    );
    let specs: Vec<EnvoySpec> = (0..N)
        .map(|_| EnvoySpec::new(Some(cfg.clone()), service.port, upstream.port))
        .collect();
    let envoys = Envoy::start_all(&c, &dir, &specs);
    let mut ratios = Vec::new();
    for mode in ["exact", "lease"] {
        let before = upstream.requests();
        let path = format!("/{mode}");
        let tally = Load::round_robin_on(
            &envoys,
            &path,
            16,
            Duration::from_secs(SECONDS),
            u64::MAX,
            Duration::ZERO,
        )
        .wait()
        .tally();
        let elapsed = tally.elapsed;
        let admitted = upstream.requests() - before;
        let ideal = CAPACITY as f64 + RATE as f64 * elapsed.as_secs_f64();
        let ratio = admitted as f64 / ideal;
        let stats = tg_total(&envoys);
        eprintln!(
            "accuracy {mode}: {} requests in {:.3} s ({:.0}/s), admitted {admitted} of ideal {ideal:.0} \
             ({ratio:.4}), service decisions so far {}, filter stats {stats:?}",
            tally.sent(),
            elapsed.as_secs_f64(),
            tally.sent() as f64 / elapsed.as_secs_f64(),
            decisions(&service)
        );
        assert_fair_load(mode, &tally, admitted, &stats, 2.0 * ideal);
        // The bucket is created by the first take, after the load began: the ideal measured from
        // the first send is an upper bound.
        assert!(
            admitted as f64 <= ideal,
            "{mode}: admitted {admitted} > ideal {ideal:.1}: the limit was exceeded"
        );
        ratios.push(ratio);
    }
    assert!(
        ratios[1] >= 0.98,
        "lease admitted {:.4} of the ideal (exact {:.4}): more than 2 % lost",
        ratios[1],
        ratios[0]
    );
    let stats = tg_total(&envoys);
    assert!(stat(&stats, "lease.local") > 0 && stat(&stats, "lease.refills") > 0);
}

/// The service unreachable: lease rules go through the failure mode as before (fallback buckets).
#[test]
fn service_down_falls_back() {
    let cfg = plugin(
        Transport::Http,
        vec![lease_rule(5, 1, SLOW_PERIOD_MS, 5, 1000)],
        json!({"failure_mode": "fallback"}),
    );
    let s = Stack::start_without_service("lease-down", &cfg, closed_port());
    let statuses = s.client.statuses(&s.url("/"), &[], 10);
    assert_eq!(statuses, [vec![200; 5], vec![429; 5]].concat());
    assert_eq!(s.upstream.requests(), 5);
    assert_eq!(s.envoy.tg("fallback.allowed"), 5);
    assert_eq!(s.envoy.tg("fallback.limited"), 5);
    assert_eq!(s.envoy.tg("lease.local"), 0);
    assert_eq!(s.envoy.tg("lease.granted"), 0);
}

/// Two Envoys serving one hot key from leases that last a minute call the service seldom: for
/// 12 s (longer than the 10 s the instance registry used to keep an id) neither calls at all.
/// The service still counts both: a proxy that asks seldom because its lease pays is still part
/// of the fleet, so no other proxy's fallback share grows while it is quiet.
#[test]
fn a_quiet_leasing_fleet_stays_counted() {
    let c = Components::get();
    let dir = TempDir::new("lease-quiet");
    let redis = Redis::start(&c, &dir);
    let service = Service::start(&c, &dir, Some(&redis.url()));
    let upstream = Upstream::start();
    let cfg = plugin(
        Transport::Http,
        vec![lease_rule(100_000, 100_000, 60_000, 200, 60_000)],
        json!({"failure_mode": "deny"}),
    );
    let envoys: Vec<Envoy> = (0..2)
        .map(|_| {
            Envoy::start(
                &c,
                &dir,
                &EnvoySpec::new(Some(cfg.clone()), service.port, upstream.port),
            )
        })
        .collect();
    let client = Client::new();
    // Each Envoy's first request leases 200 tokens: its pool pays the rest.
    for e in &envoys {
        assert_eq!(client.statuses(&e.url("/"), &[], 2), vec![200, 200]);
    }
    let asked = decisions(&service);
    let quiet = Instant::now();
    while quiet.elapsed() < Duration::from_secs(12) {
        for e in &envoys {
            assert_eq!(client.statuses(&e.url("/"), &[], 1), vec![200]);
        }
        thread::sleep(Duration::from_millis(500));
    }
    assert_eq!(
        decisions(&service),
        asked,
        "for 12 s the pools paid every request: no callout"
    );
    // A third caller asks now: the first answer may still be the count as last learned; the one a
    // report later is the registry's after the quiet spell.
    let take = |id: &str| -> u64 {
        let body = format!(
            r#"{{"buckets":[{{"key":"probe","capacity":10,"period_ms":60000}}],"instance":"{id}"}}"#
        );
        let r = client.post(
            &format!("http://127.0.0.1:{}/v1/take", service.port),
            &[("content-type", "application/json")],
            body.as_bytes(),
        );
        assert_eq!(r.status, 200, "{r:?}");
        let v: serde_json::Value = serde_json::from_str(&r.body).expect("JSON");
        v["instances"].as_u64().expect("instances")
    };
    take("00000000000000aa");
    thread::sleep(Duration::from_millis(1500));
    assert_eq!(
        take("00000000000000aa"),
        3,
        "both quiet Envoys and the new caller are live instances"
    );
}
