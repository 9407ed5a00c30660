//! The VM's one ledger of callouts, end to end with real Envoy, the real service and real Redis:
//! what a deployment does that the unit tests' fake host cannot show.
//!
//! - `two_configurations_in_one_vm_each_admit_their_own_limit`: two listeners whose Wasm filters
//!   share one `vm_config` (one VM per worker runs both configurations) and batch their takes
//!   behind a slowed service: each admits exactly its own limit, every client is answered. (Before
//!   the ledger, each configuration numbered its queued requests from 1, and one listener's answers
//!   reached the other's requests.)
//! - `a_batch_of_many_rules_fits_what_the_filter_reads`: 12 rules on every request and 128 clients
//!   over HTTP: batches are bounded by the bytes of their answer, so none is too large to read, no
//!   take fails and the breaker never opens while the service is healthy.
//! - `settlements_pending_at_a_push_are_delivered_after_it`: a settlement that cannot be delivered
//!   when a configuration push removes its configuration is delivered by the new one.
//! - `a_timed_out_acquire_leaves_no_slot_behind`: the service answers later than the filter waits
//!   while clients hold concurrency slots; the filter named every slot it asked for and releases it
//!   by name, so once the load is over Redis holds no slot (before: ghosts until their deadline,
//!   and a 429 for everyone meanwhile).
#![allow(
    clippy::panic,
    clippy::expect_used,
    clippy::unwrap_used,
    clippy::indexing_slicing
)]

use crate::common;

use common::config::{plugin, rule};
use common::faults::delay::DelayProxy;
use common::faults::redis_ctl::RedisConn;
use common::push::Pushed;
use common::*;
use serde_json::json;
use std::thread;
use std::time::{Duration, Instant};

#[test]
fn two_configurations_in_one_vm_each_admit_their_own_limit() {
    let c = Components::get();
    let dir = TempDir::new("two-configs");
    let redis = Redis::start(&c, &dir);
    let service = Service::start(&c, &dir, Some(&redis.url()));
    // 5 ms on every answer: callouts overlap, so requests queue for batches on both listeners.
    let slow = DelayProxy::start(service.port);
    slow.set_delay(Duration::from_millis(5));
    let upstream = Upstream::start();
    let extra = json!({"failure_mode": "deny", "response": {"headers": ["x-ratelimit"]}});
    let wide = plugin(
        Transport::Http,
        vec![
            json!({"name": "wide", "key": ["literal:a"], "capacity": 1_000_000,
                    "rate": 1_000_000, "period_ms": 1000}),
        ],
        extra.clone(),
    );
    let narrow = plugin(
        Transport::Http,
        vec![rule("narrow", &["literal:b"], 5)],
        extra,
    );
    let mut a = EnvoySpec::new(Some(wide), slow.port, upstream.port);
    let mut b = a.clone();
    b.listener_name = "edge_b".into();
    b.plugin_config = Some(narrow);
    let b_port = free_port();
    a.extra_listeners = vec![b.listener(&c.wasm, b_port)];
    let envoy = Envoy::start(&c, &dir, &a);
    let urls = [envoy.url("/"), format!("http://127.0.0.1:{b_port}/")];

    // 64 clients on each listener, each on a connection of its own, for up to 3 s; every one
    // must be answered (a client whose request is never answered fails the test).
    let deadline = Instant::now() + Duration::from_secs(3);
    let (a_replies, b_replies): (Vec<Reply>, Vec<Reply>) = thread::scope(|s| {
        let clients: Vec<_> = (0..128)
            .map(|i| {
                let url = &urls[i % 2];
                s.spawn(move || {
                    let client = Client::new();
                    let mut got = Vec::new();
                    while Instant::now() < deadline && got.len() < 40 {
                        got.push(client.get(url, &[]));
                    }
                    got
                })
            })
            .collect();
        let mut a = Vec::new();
        let mut b = Vec::new();
        for (i, h) in clients.into_iter().enumerate() {
            let got = h.join().expect("client");
            if i % 2 == 0 {
                a.extend(got)
            } else {
                b.extend(got)
            }
        }
        (a, b)
    });
    let b_admitted = b_replies.iter().filter(|r| r.status == 200).count();
    let b_limits: std::collections::BTreeSet<Option<&str>> = b_replies
        .iter()
        .filter(|r| r.status == 429)
        .map(|r| r.header("x-ratelimit-limit"))
        .collect();
    let stats = envoy.tg_all();
    eprintln!(
        "A {} replies ({} admitted), B {} ({b_admitted} admitted, 429 limits {b_limits:?}); \
         upstream saw {}; {stats:?}",
        a_replies.len(),
        a_replies.iter().filter(|r| r.status == 200).count(),
        b_replies.len(),
        upstream.requests(),
    );
    assert!(
        stats.get("batch.callouts").copied().unwrap_or(0) > 0,
        "the test needs batches: {stats:?}"
    );
    // Listener A admits everything (its limit is never reached); B exactly its 5.
    assert!(a_replies.iter().all(|r| r.status == 200), "A denied");
    assert_eq!(b_admitted, 5, "B admitted other than its limit");
    assert_eq!(
        b_limits,
        [Some("5")].into(),
        "a B denial carried another rule's limit"
    );
    assert_eq!(upstream.requests() as usize, a_replies.len() + 5);
    drop(envoy);
    drop(slow);
    drop(service);
    drop(redis);
}

#[test]
fn a_batch_of_many_rules_fits_what_the_filter_reads() {
    let c = Components::get();
    let dir = TempDir::new("wide-batch");
    let redis = Redis::start(&c, &dir);
    let service = Service::start(&c, &dir, Some(&redis.url()));
    let upstream = Upstream::start();
    // 12 rules match every request: an answer carries 12 bucket results per take.
    let rules = (0..12)
        .map(|i| {
            json!({"name": format!("r{i}"), "key": [format!("literal:{i}")],
                   "capacity": 1_000_000_000u64, "rate": 1_000_000_000u64, "period_ms": 1000})
        })
        .collect();
    let cfg = plugin(
        Transport::Http,
        rules,
        json!({"failure_mode": "fallback", "service": {"batch": 64}}),
    );
    let envoy = Envoy::start(
        &c,
        &dir,
        &EnvoySpec::new(Some(cfg), service.port, upstream.port),
    );
    let replies = burst(&[envoy.url("/")], 128, 60, &[], Duration::from_secs(4));
    let stats = envoy.tg_all();
    eprintln!("{} replies; {stats:?}", replies.len());
    let batches = stats.get("batch.callouts").copied().unwrap_or(0);
    let takes = stats.get("batch.takes").copied().unwrap_or(0);
    assert!(
        batches > 0 && takes > 2 * batches,
        "the test needs full batches: {stats:?}"
    );
    assert!(replies.iter().all(|r| r.status == 200));
    for name in [
        "callout_failure.decode",
        "breaker.opened",
        "fallback.allowed",
    ] {
        assert_eq!(
            stats.get(name).copied().unwrap_or(0),
            0,
            "{name}: {stats:?}"
        );
    }
    assert_eq!(stats.get("allowed").copied(), Some(replies.len() as u64));
    drop(envoy);
    drop(service);
    drop(redis);
}

#[test]
fn settlements_pending_at_a_push_are_delivered_after_it() {
    let c = Components::get();
    let dir = TempDir::new("settle-push");
    let redis = Redis::start(&c, &dir);
    let service = Service::start(&c, &dir, Some(&redis.url()));
    let gate = Gate::start(GateMode::Forward, service.port);
    let llm = Llm::start();
    let charged = |unused_rule: &str| {
        plugin(
            Transport::Http,
            vec![
                json!({"name": "llm", "key": ["literal:tenant"], "capacity": 10_000, "rate": 1,
                       "period_ms": 3_600_000,
                       "cost": {"header": "x-max-tokens", "default": 100, "max": 4000},
                       "charge": "response"}),
                // Changes nothing but the configuration (a new root context per push).
                json!({"name": unused_rule, "match": {"path_prefix": "/never"},
                       "key": ["literal:x"], "capacity": 1, "period_ms": 1000}),
            ],
            json!({"service": {"batch": 0}, "failure_mode": "deny",
                   "response": {"headers": ["x-ratelimit"]}}),
        )
    };
    let spec = EnvoySpec::new(Some(charged("first")), gate.port, llm.port);
    let mut pushed = Pushed::start(&c, &dir, spec);
    let url = pushed.envoy.url("/v1/chat");
    // A stream that reports 1,000 tokens used (100 reserved) over about a second.
    let stream = [
        ("x-llm-stream", "1"),
        ("x-llm-usage", "1000"),
        ("x-llm-chunks", "4"),
        ("x-llm-chunk-ms", "250"),
    ];
    let client = Client::new();
    let (url2, stream2) = (url.clone(), stream);
    let streaming = thread::spawn(move || Client::new().get(&url2, &stream2).status);
    // Admitted: the service is then cut off before the stream ends, so its settlement fails.
    thread::sleep(Duration::from_millis(300));
    gate.set_mode(GateMode::Refuse);
    gate.drop_connections();
    assert_eq!(streaming.join().unwrap(), 200);
    thread::sleep(Duration::from_millis(200));
    assert!(
        pushed.envoy.tg("settle.retried") > 0,
        "the settlement was not held back"
    );
    // The push replaces the configuration; then the service comes back.
    pushed.push(&charged("second"));
    gate.set_mode(GateMode::Forward);
    // Delivered by the new configuration: the bucket then holds 10,000 - 100 reserved - 900
    // settled, and a probe of one token leaves 8,999.
    assert!(
        eventually(Duration::from_secs(8), || pushed
            .envoy
            .tg("settle.delivered")
            > 0),
        "never delivered: {:?}",
        pushed.envoy.tg_all()
    );
    let body = json!({"buckets": [{"key": "llm|tenant", "capacity": 10_000, "rate": 1,
                                   "period_ms": 3_600_000}]});
    let probe = client.post(
        &format!("http://127.0.0.1:{}/v1/take", service.port),
        &[("content-type", "application/json")],
        body.to_string().as_bytes(),
    );
    let v: serde_json::Value = serde_json::from_str(&probe.body).expect("JSON answer");
    assert_eq!(v["buckets"][0]["remaining"], 8_999, "{v}");
    drop(pushed);
    drop(gate);
    drop(service);
    drop(redis);
}

/// Slots held in Redis: the live members of every concurrency-slot set (`<prefix>cc:{key}`; the
/// live-instance registry is a sorted set too).
fn slots_in_redis(redis: &mut RedisConn) -> u64 {
    let keys = redis.ok(&["KEYS", "*cc:*"]);
    let mut n = 0;
    for k in keys.lines().filter(|k| !k.is_empty()) {
        if redis.ok(&["TYPE", k]) == "zset" {
            // Live slots only: a set also remembers released names, at negative scores.
            n += redis
                .ok(&["ZCOUNT", k, "(0", "+inf"])
                .parse::<u64>()
                .unwrap_or(0);
        }
    }
    n
}

#[test]
fn a_timed_out_acquire_leaves_no_slot_behind() {
    let c = Components::get();
    let dir = TempDir::new("slot-timeout");
    let redis = Redis::start(&c, &dir);
    let service = Service::start(&c, &dir, Some(&redis.url()));
    let slow = DelayProxy::start(service.port);
    let upstream = Upstream::start_slow(Duration::from_millis(20), Duration::ZERO);
    // 4 slots per key, a 30 s deadline, and a filter that waits 20 ms for an answer.
    let cfg = Plugin::defaults()
        .service("timeout_ms", 20)
        .batch(0)
        .failure_mode("fallback")
        .field("breaker", r#"{"failures": 0}"#)
        .rule(r#"{"name": "slots", "kind": "concurrency", "key": ["literal:all"], "max_in_flight": 4, "deadline_ms": 30000}"#)
        .json();
    let specs: Vec<EnvoySpec> = (0..2)
        .map(|_| EnvoySpec::new(Some(cfg.clone()), slow.port, upstream.port))
        .collect();
    let envoys = Envoy::start_all(&c, &dir, &specs);
    let urls: Vec<String> = envoys.iter().map(|e| e.url("/work")).collect();
    let mut conn = RedisConn::open(redis.port);
    // 32 clients; the service's answers are 60 ms late for the first 2 s (the acquires still reach
    // it at once and are applied), then on time.
    slow.set_delay(Duration::from_millis(60));
    let start = Instant::now();
    let replies = thread::scope(|s| {
        let load = s.spawn(|| burst(&urls, 32, 1000, &[], Duration::from_millis(2500)));
        thread::sleep(Duration::from_secs(2));
        slow.set_delay(Duration::ZERO);
        load.join().expect("load")
    });
    let over = Instant::now();
    let late = envoys
        .iter()
        .map(|e| e.tg("inflight.fallback_acquired") + e.tg("inflight.fallback_limited"))
        .sum::<u64>();
    eprintln!(
        "{} replies in {:?}, {late} acquires timed out; statuses {:?}",
        replies.len(),
        over - start,
        replies
            .iter()
            .fold(std::collections::BTreeMap::new(), |mut m, r| {
                *m.entry(r.status).or_insert(0u64) += 1;
                m
            })
    );
    assert!(late > 0, "the test needs acquires that time out");
    // Nothing is in flight now: within a second Redis holds no slot (the test allows 3 s, for a
    // suite that shares two cores with other Envoys; a ghost would hold its slot for 30 s).
    let mut held = u64::MAX;
    while over.elapsed() < Duration::from_secs(3) {
        held = slots_in_redis(&mut conn);
        if held == 0 {
            break;
        }
        thread::sleep(Duration::from_millis(50));
    }
    if held != 0 {
        let keys = conn.ok(&["KEYS", "*cc:*"]);
        for k in keys.lines().filter(|k| !k.is_empty()) {
            if conn.ok(&["TYPE", k]) == "zset" {
                eprintln!(
                    "{k}: {}",
                    conn.ok(&["ZRANGE", k, "0", "-1", "WITHSCORES"])
                        .replace('\n', " ")
                );
            }
        }
        eprintln!("now {}", conn.ok(&["TIME"]).replace('\n', " "));
        for e in &envoys {
            eprintln!(
                "{:?}",
                e.tg_all()
                    .into_iter()
                    .filter(|(k, _)| k.starts_with("inflight"))
                    .collect::<Vec<_>>()
            );
        }
    }
    eprintln!("no slot left {:?} after the load", over.elapsed());
    assert_eq!(held, 0, "slots no request owns, 3 s after the load");
    // And the key is usable at once: 4 requests at a time pass (one each: a client's next request
    // could arrive before Envoy has sent its previous one's release).
    let after = burst(&urls, 4, 1, &[], Duration::from_secs(5));
    assert!(
        after.iter().all(|r| r.status == 200),
        "{:?}",
        after.iter().map(|r| r.status).collect::<Vec<_>>()
    );
    drop(envoys);
    drop(slow);
    drop(service);
    drop(redis);
}
