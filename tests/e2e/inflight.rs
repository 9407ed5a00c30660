//! Concurrency limits end to end: real Envoys, the service and Redis. A `kind: "concurrency"` rule
//! holds at most `max_in_flight` requests per key in flight across the fleet: a slow upstream
//! counts what is in flight at it and records the maximum; slots go back when streams end; the
//! slots of an Envoy killed with SIGKILL come back at their deadline, not before.

// A test reports a failure by panicking; the crate's no-panic lints are for the filter itself.
#![allow(
    clippy::panic,
    clippy::expect_used,
    clippy::unwrap_used,
    clippy::indexing_slicing
)]

use crate::both_transports;
use crate::common;

use common::*;
use serde_json::json;
use std::io::Write;
use std::net::TcpStream;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

/// The fleets of these tests share the machine's two cores: one at a time.
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// The plugin configuration: one concurrency rule for every request (one key for all), on top of
/// a rate rule far from its limit (the two kinds in one request).
fn plugin(max: u64, deadline_ms: u64) -> String {
    plugin_with(max, deadline_ms, "http")
}

fn plugin_with(max: u64, deadline_ms: u64, transport: &str) -> String {
    Plugin::new(transport, 1000)
        .rule(r#"{"name": "rate", "key": ["literal:all"], "capacity": 1000000, "period_ms": 1000}"#)
        .rule(
            json!({"name": "slots", "kind": "concurrency", "key": ["literal:all"],
                     "max_in_flight": max, "deadline_ms": deadline_ms,
                     "response": {"headers": ["x-ratelimit"]}}),
        )
        .json()
}

struct Fleet {
    _dir: TempDir,
    _redis: Redis,
    _service: Service,
    upstream: Upstream,
    envoys: Vec<Envoy>,
}

fn fleet(label: &str, max: u64, deadline_ms: u64, delay: Duration, hold: Duration) -> Fleet {
    fleet_over(Transport::Http, label, max, deadline_ms, delay, hold)
}

fn fleet_over(
    t: Transport,
    label: &str,
    max: u64,
    deadline_ms: u64,
    delay: Duration,
    hold: Duration,
) -> Fleet {
    let c = Components::get();
    let dir = TempDir::new(label);
    let redis = Redis::start(&c, &dir);
    let service = Service::start(&c, &dir, Some(&redis.url()));
    let upstream = Upstream::start_slow(delay, hold);
    let specs: Vec<EnvoySpec> = (0..3)
        .map(|_| {
            let cfg = plugin_with(max, deadline_ms, t.name());
            let mut s = EnvoySpec::new(Some(cfg), service.port, upstream.port);
            s.log_level = "wasm:info".to_string();
            s
        })
        .collect();
    let envoys = Envoy::start_all(&c, &dir, &specs);
    Fleet {
        _dir: dir,
        _redis: redis,
        _service: service,
        upstream,
        envoys,
    }
}

fn sum(envoys: &[Envoy], name: &str) -> u64 {
    envoys.iter().map(|e| e.tg(name)).sum()
}

const CLIENTS: usize = 32;
const PER_CLIENT: usize = 6;

both_transports!(never_more_than_max_in_flight_across_three_envoys);

/// With either transport the slots go as JSON over the service cluster (HTTP/1.1 or HTTP/2).
fn never_more_than_max_in_flight_across_three_envoys(t: Transport) {
    let _serial = serial();
    const MAX: u64 = 4;
    let f = Arc::new(fleet_over(
        t,
        "inflight-fleet",
        MAX,
        10_000,
        Duration::from_millis(150),
        Duration::from_millis(150),
    ));
    let urls: Vec<String> = f.envoys.iter().map(|e| e.url("/work")).collect();
    let replies = status_and_retry_after(burst(
        &urls,
        CLIENTS,
        PER_CLIENT,
        &[],
        Duration::from_secs(30),
    ));
    assert_eq!(replies.len(), CLIENTS * PER_CLIENT, "all answered in time");
    let ok = replies.iter().filter(|(s, _)| *s == 200).count() as u64;
    let denied: Vec<&(u16, Option<String>)> = replies.iter().filter(|(s, _)| *s == 429).collect();
    let max_seen = f.upstream.max_in_flight();
    eprintln!(
        "admitted {ok}, denied {}, upstream max in flight {max_seen}, upstream requests {}",
        denied.len(),
        f.upstream.requests()
    );
    assert_eq!(
        ok + denied.len() as u64,
        replies.len() as u64,
        "only 200 or 429"
    );
    assert!(max_seen <= MAX, "{max_seen} in flight at the upstream");
    assert!(max_seen >= 2, "requests did run concurrently: {max_seen}");
    assert!(
        !denied.is_empty(),
        "32 clients over 4 slots: some were denied"
    );
    assert!(
        denied.iter().all(|(_, ra)| ra.as_deref() == Some("1")),
        "a denial says Retry-After: 1"
    );
    assert_eq!(
        f.upstream.requests(),
        ok,
        "every admitted request reached the upstream"
    );
    // Every slot was given back when its stream ended (the deadline, 10 s, has not passed).
    let acquired = sum(&f.envoys, "inflight.acquired");
    assert_eq!(acquired, ok, "{:?}", tg_total(&f.envoys));
    assert!(
        eventually(Duration::from_secs(3), || sum(
            &f.envoys,
            "inflight.released"
        ) == acquired),
        "released {} of {acquired}: {:?}",
        sum(&f.envoys, "inflight.released"),
        tg_total(&f.envoys)
    );
    assert_eq!(sum(&f.envoys, "inflight.release_failed"), 0);
    // So all MAX slots are free again: MAX requests at once are all admitted.
    let together: Vec<u16> = (0..MAX as usize)
        .map(|i| {
            let url = f.envoys[i % 3].url("/again");
            thread::spawn(move || Client::new().get(&url, &[]).status)
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|h| h.join().expect("client"))
        .collect();
    assert_eq!(together, vec![200; MAX as usize]);
}

#[test]
fn a_killed_envoys_slots_come_back_at_their_deadline() {
    let _serial = serial();
    const MAX: u64 = 2;
    const DEADLINE: Duration = Duration::from_millis(3000);
    let mut f = fleet(
        "inflight-killed",
        MAX,
        DEADLINE.as_millis() as u64,
        Duration::from_millis(50),
        Duration::from_secs(8),
    );
    // Two requests through Envoy 0 hold both slots at the upstream.
    let t0 = Instant::now();
    let holders: Vec<_> = (0..MAX)
        .map(|_| {
            let url = f.envoys[0].url("/hold");
            thread::spawn(move || Client::new().try_get(&url, &[]).map(|r| r.status).ok())
        })
        .collect();
    assert!(
        eventually(Duration::from_secs(10), || f.upstream.in_flight() == MAX),
        "both held at the upstream"
    );
    let url = f.envoys[1].url("/work");
    let client = Client::new();
    assert_eq!(client.get(&url, &[]).status, 429, "full while held");
    // Envoy 0 dies without a word: its slots are never released.
    f.envoys[0].proc.kill();
    for h in holders {
        let _ = h.join();
    }
    let mut first_ok = None;
    // Generous: on a loaded machine the first admission may come a few seconds late; what is
    // checked is that it never comes early.
    let give_up = t0 + DEADLINE + Duration::from_secs(10);
    while Instant::now() < give_up {
        let at = Instant::now();
        if client.get(&url, &[]).status == 200 {
            first_ok = Some(at);
            break;
        }
        thread::sleep(Duration::from_millis(100));
    }
    let first_ok = first_ok.expect("the slots came back after their deadline");
    let after = first_ok.duration_since(t0);
    eprintln!("first admission {after:?} after the slots were taken (deadline {DEADLINE:?})");
    assert!(
        after >= DEADLINE,
        "admitted after {after:?}, before the deadline"
    );
}

/// 32 clients against one Envoy, each `PER_CLIENT` requests to `url`; every status and
/// Retry-After. Bounded by a 30 s deadline.
fn hammer(url: &str) -> Vec<(u16, Option<String>)> {
    status_and_retry_after(burst(
        &[url.to_string()],
        CLIENTS,
        PER_CLIENT,
        &[],
        Duration::from_secs(30),
    ))
}

fn status_and_retry_after(replies: Vec<Reply>) -> Vec<(u16, Option<String>)> {
    replies
        .into_iter()
        .map(|r| (r.status, r.header("retry-after").map(str::to_string)))
        .collect()
}

/// The service cannot be reached: `failure_mode: fallback` holds local slots, shared by the
/// Envoy's two workers, at most max_in_flight / instances = 6 / 2 = 3, and gives them back.
#[test]
fn without_the_service_local_slots_cap_each_envoy() {
    let _serial = serial();
    let c = Components::get();
    let dir = TempDir::new("inflight-fallback");
    let upstream = Upstream::start_slow(Duration::from_millis(150), Duration::from_millis(150));
    let mut cfg: serde_json::Value = serde_json::from_str(&plugin_with(6, 10_000, "grpc")).unwrap();
    cfg["fallback"] = json!({"instances": 2});
    cfg["breaker"] = json!({"failures": 0});
    let spec = EnvoySpec::new(Some(cfg.to_string()), closed_port(), upstream.port);
    let envoy = Envoy::start(&c, &dir, &spec);
    let replies = hammer(&envoy.url("/work"));
    let ok = replies.iter().filter(|(s, _)| *s == 200).count() as u64;
    let denied = replies.iter().filter(|(s, _)| *s == 429).count() as u64;
    eprintln!(
        "fallback: admitted {ok}, denied {denied}, upstream max in flight {}",
        upstream.max_in_flight()
    );
    assert_eq!(ok + denied, (CLIENTS * PER_CLIENT) as u64);
    assert!(
        upstream.max_in_flight() <= 3,
        "{}",
        upstream.max_in_flight()
    );
    assert!(
        upstream.max_in_flight() >= 2,
        "{}",
        upstream.max_in_flight()
    );
    assert!(denied > 0);
    assert_eq!(
        envoy.tg("inflight.fallback_acquired"),
        ok,
        "{:?}",
        envoy.tg_all()
    );
    assert_eq!(envoy.tg("inflight.fallback_limited"), denied);
    // Every local slot was given back: 3 at once are admitted again.
    let again: Vec<u16> = (0..3)
        .map(|_| {
            let url = envoy.url("/again");
            thread::spawn(move || Client::new().get(&url, &[]).status)
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|h| h.join().expect("client"))
        .collect();
    assert_eq!(again, vec![200; 3]);
}

/// A slot goes back when the stream ends early: the client hangs up while the upstream still holds
/// its request, or the upstream resets it. With one slot and a 20 s deadline, the next request is
/// admitted at once both times.
#[test]
fn a_disconnect_or_an_upstream_reset_releases_the_slot() {
    let _serial = serial();
    let c = Components::get();
    let dir = TempDir::new("inflight-early-end");
    let redis = Redis::start(&c, &dir);
    let service = Service::start(&c, &dir, Some(&redis.url()));
    let upstream = Upstream::start_slow(Duration::from_millis(20), Duration::from_secs(8));
    let spec = EnvoySpec::new(Some(plugin(1, 20_000)), service.port, upstream.port);
    let envoy = Envoy::start(&c, &dir, &spec);
    let client = Client::new();
    // The client goes away while its request is held upstream. A raw socket, not `Client`: the
    // client must hang up with its request unanswered, which a client library does not do.
    let mut conn = TcpStream::connect(("127.0.0.1", envoy.port)).expect("connect");
    conn.write_all(b"GET /hold HTTP/1.1\r\nhost: x\r\n\r\n")
        .expect("send");
    assert!(
        eventually(Duration::from_secs(5), || upstream.in_flight() == 1),
        "held upstream"
    );
    assert_eq!(
        client.get(&envoy.url("/work"), &[]).status,
        429,
        "the one slot is held"
    );
    let t = Instant::now();
    drop(conn);
    assert!(
        eventually(Duration::from_secs(3), || client
            .get(&envoy.url("/work"), &[])
            .status
            == 200),
        "the slot came back after the client left"
    );
    eprintln!("admitted {:?} after the client hung up", t.elapsed());
    // The upstream resets a request: 503 to the client, and the slot comes back.
    assert_eq!(client.get(&envoy.url("/reset"), &[]).status, 503);
    assert_eq!(
        client.get(&envoy.url("/work"), &[]).status,
        200,
        "released after the reset"
    );
    assert!(
        eventually(Duration::from_secs(3), || envoy.tg("inflight.released")
            == envoy.tg("inflight.acquired")),
        "{:?}",
        envoy.tg_all()
    );
    assert_eq!(envoy.tg("inflight.release_failed"), 0);
}
