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

mod common;

use common::*;
use serde_json::json;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

/// The fleets of these tests share the machine's two cores: one at a time.
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// An HTTP/1.1 upstream that holds each request `delay` (`hold` for paths starting with `/hold`)
/// before answering, and counts the requests in flight at it: now, and the most ever.
struct SlowUpstream {
    port: u16,
    stop: Arc<AtomicBool>,
    now: Arc<AtomicU64>,
    max: Arc<AtomicU64>,
    total: Arc<AtomicU64>,
}

impl SlowUpstream {
    fn start(delay: Duration, hold: Duration) -> SlowUpstream {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind upstream");
        let port = listener.local_addr().expect("addr").port();
        let stop = Arc::new(AtomicBool::new(false));
        let now = Arc::new(AtomicU64::new(0));
        let max = Arc::new(AtomicU64::new(0));
        let total = Arc::new(AtomicU64::new(0));
        let (s, n, m, t) = (stop.clone(), now.clone(), max.clone(), total.clone());
        thread::spawn(move || {
            for conn in listener.incoming() {
                if s.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(conn) = conn else { continue };
                let (n, m, t) = (n.clone(), m.clone(), t.clone());
                thread::spawn(move || serve(conn, delay, hold, &n, &m, &t));
            }
        });
        SlowUpstream {
            port,
            stop,
            now,
            max,
            total,
        }
    }

    fn in_flight(&self) -> u64 {
        self.now.load(Ordering::SeqCst)
    }

    fn max_in_flight(&self) -> u64 {
        self.max.load(Ordering::SeqCst)
    }

    fn requests(&self) -> u64 {
        self.total.load(Ordering::SeqCst)
    }
}

impl Drop for SlowUpstream {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}

fn serve(
    mut conn: TcpStream,
    delay: Duration,
    hold: Duration,
    now: &AtomicU64,
    max: &AtomicU64,
    total: &AtomicU64,
) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(30)));
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let end = loop {
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            match conn.read(&mut chunk) {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        };
        let head = String::from_utf8_lossy(&buf[..end]).into_owned();
        buf.drain(..end);
        let n = now.fetch_add(1, Ordering::SeqCst) + 1;
        max.fetch_max(n, Ordering::SeqCst);
        total.fetch_add(1, Ordering::SeqCst);
        let path = head.split_whitespace().nth(1).unwrap_or("/");
        if path.starts_with("/reset") {
            // The upstream resets the request: Envoy answers 503 and the stream ends.
            now.fetch_sub(1, Ordering::SeqCst);
            return;
        }
        thread::sleep(if path.starts_with("/hold") {
            hold
        } else {
            delay
        });
        now.fetch_sub(1, Ordering::SeqCst);
        let body = "slow\n";
        let resp = format!(
            "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        if conn.write_all(resp.as_bytes()).is_err() {
            return;
        }
    }
}

/// The plugin configuration: one concurrency rule for every request (one key for all), on top of
/// a rate rule far from its limit (the two kinds in one request).
fn plugin(max: u64, deadline_ms: u64) -> String {
    plugin_with(max, deadline_ms, "http")
}

fn plugin_with(max: u64, deadline_ms: u64, transport: &str) -> String {
    json!({
        "service": {"cluster": "tollgate", "transport": transport, "timeout_ms": 1000},
        "rules": [
            {"name": "rate", "key": ["literal:all"], "capacity": 1_000_000, "period_ms": 1000},
            {"name": "slots", "kind": "concurrency", "key": ["literal:all"],
             "max_in_flight": max, "deadline_ms": deadline_ms,
             "response": {"headers": ["x-ratelimit"]}}
        ]
    })
    .to_string()
}

struct Fleet {
    _dir: TempDir,
    _redis: Redis,
    _service: Service,
    upstream: SlowUpstream,
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
    let upstream = SlowUpstream::start(delay, hold);
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
        eventually(Duration::from_secs(5), || f.upstream.in_flight() == MAX),
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
    let give_up = t0 + DEADLINE + Duration::from_secs(3);
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
    let upstream = SlowUpstream::start(Duration::from_millis(150), Duration::from_millis(150));
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
    let upstream = SlowUpstream::start(Duration::from_millis(20), Duration::from_secs(8));
    let spec = EnvoySpec::new(Some(plugin(1, 20_000)), service.port, upstream.port);
    let envoy = Envoy::start(&c, &dir, &spec);
    let client = Client::new();
    // The client goes away while its request is held upstream.
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
