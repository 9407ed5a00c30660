//! End to end, callouts that end badly for the module's bookkeeping: clients that go away while
//! their callout is in flight (Envoy deletes the request and never reports the callout to it), and
//! cluster names Envoy refuses at dispatch, and hundreds of requests answered by one callback
//! (`many_answers_at_once_stay_shallow`: Envoy runs the answers one inside another, so they must
//! reach it a round at a time). Envoy must stay flat in memory and the module healthy.
//!
//! `TOLLGATE_DISCONNECTS` sets how many clients disconnect (default 5,000, about 15 s per transport
//! here; the figure, 100,000, about 2 minutes per transport: `TOLLGATE_DISCONNECTS=100000
//! cargo test --test e2e callouts:: disconnect -- --nocapture` prints Envoy's heap and RSS and the
//! VMs' linear memory before and after).

#![allow(
    clippy::panic,
    clippy::expect_used,
    clippy::unwrap_used,
    clippy::indexing_slicing
)]

use crate::both_transports;
use crate::common;

use common::config::{plugin, rule};
use common::faults::delay::DelayProxy;
use common::loopback::{reset_all, rss_kib, send_requests};
use common::*;
use serde_json::json;
use std::thread;
use std::time::{Duration, Instant};
use tollgate::core::wire::plan::Decision;

both_transports!(clients_that_disconnect_mid_callout_leave_envoy_flat);

/// Requests sent at once; each waits until the callouts of its batch were dispatched, then resets.
const BATCH: u64 = 200;
/// Callout timeout: ends a black-holed callout soon after its client left, and keeps the callouts
/// in flight under the cluster's default limit of 1,024 active requests.
const TIMEOUT_MS: u64 = 300;
/// At most this many callouts in flight before the next batch is sent.
const MAX_ACTIVE: u64 = 1_024 - 2 * BATCH;
/// How late the service's answers are on the stream: each batch's messages are answered this long
/// after it was sent, and the next batch waits as long (two batches in flight, as the calls').
const LATE: Duration = Duration::from_millis(TIMEOUT_MS / 3);

/// Envoy's live heap may differ by this much between two quiet moments (stats, caches).
const HEAP_SLACK: u64 = 2 * 1024 * 1024;

fn disconnects() -> u64 {
    std::env::var("TOLLGATE_DISCONNECTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5_000)
}

/// A counter or gauge of the `tollgate` cluster (e.g. `upstream_rq_total`).
fn cluster_stat(e: &Envoy, name: &str) -> u64 {
    let full = format!("cluster.tollgate.{name}");
    e.stats(&format!("^cluster\\.tollgate\\.{name}$"))
        .get(&full)
        .copied()
        .unwrap_or(0)
}

/// Callouts started so far: the `tollgate` cluster's requests, or, for the stream of takes
/// (each take its own message here), the messages sent on it.
fn callouts(e: &Envoy, t: Transport) -> u64 {
    if t == Transport::Grpc {
        e.tg("batch.callouts")
    } else {
        cluster_stat(e, "upstream_rq_total")
    }
}

/// What stands between Envoy and the service while clients leave: a black hole for calls (each
/// abandoned call ends at its timeout); for the stream, a proxy that holds every answer back
/// (each message is answered after its client left: a black-holed stream would time out, be
/// given up and back off, failing takes before they are sent).
enum Between {
    Hole(Gate),
    Late(DelayProxy),
}

impl Between {
    fn start(t: Transport, service: u16) -> Between {
        if t == Transport::Grpc {
            let late = DelayProxy::start(service);
            late.set_delay(LATE);
            Between::Late(late)
        } else {
            Between::Hole(Gate::start(GateMode::BlackHole, service))
        }
    }

    fn port(&self) -> u16 {
        match self {
            Between::Hole(g) => g.port,
            Between::Late(p) => p.port,
        }
    }

    /// The service answers again, at once.
    fn open(&self) {
        match self {
            Between::Hole(g) => {
                g.set_mode(GateMode::Forward);
                g.drop_connections();
            }
            Between::Late(p) => p.set_delay(Duration::ZERO),
        }
    }
}

/// Waits until no callout is pending (the abandoned ones ended at Envoy). The stream of each
/// worker stays open (`--concurrency 2`: two).
fn settle(e: &Envoy, t: Transport) {
    let open = if t == Transport::Grpc { 2 } else { 0 };
    assert!(
        eventually(Duration::from_secs(20), || e.tg("callouts.pending") == 0
            && cluster_stat(e, "upstream_rq_active") <= open),
        "callouts still pending: {} (cluster active {})",
        e.tg("callouts.pending"),
        cluster_stat(e, "upstream_rq_active")
    );
}

/// Requests the module decided (every decision counter).
fn decided(e: &Envoy) -> u64 {
    e.tg_all()
        .iter()
        .filter(|(k, _)| {
            Decision::ALL
                .iter()
                .any(|d| d.metric() == format!("tollgate.{k}"))
        })
        .map(|(_, v)| v)
        .sum()
}

/// Live heap of Envoy (tcmalloc's allocated bytes: what RSS would be without the allocator's
/// caches), in bytes.
fn heap(e: &Envoy) -> u64 {
    e.stats("^server\\.memory_allocated$")
        .get("server.memory_allocated")
        .copied()
        .unwrap_or(0)
}

/// Envoy's live heap once it stopped moving for 2 s: a closed connection's memory is given back
/// over the seconds after it closed.
fn quiet_heap(e: &Envoy) -> u64 {
    let mut last: Vec<u64> = vec![heap(e)];
    for _ in 0..40 {
        thread::sleep(Duration::from_millis(500));
        last.push(heap(e));
        let window = &last[last.len().saturating_sub(5)..];
        let (lo, hi) = (window.iter().min(), window.iter().max());
        if window.len() == 5 && hi.zip(lo).is_some_and(|(h, l)| h - l < 256 * 1024) {
            break;
        }
    }
    last.last().copied().unwrap_or(0)
}

/// Sends requests whose clients leave mid-callout until `n` callouts were dispatched: batch by
/// batch, each batch's clients reset once the cluster shows its callouts started. Returns
/// (requests sent, callouts dispatched).
fn abandon_callouts(e: &Envoy, t: Transport, n: u64) -> (u64, u64) {
    let calls0 = callouts(e, t);
    let (mut sent, mut calls) = (0, 0);
    let deadline = Instant::now() + Duration::from_secs(240);
    while calls < n {
        assert!(
            Instant::now() < deadline,
            "{calls} of {n} callouts after 240 s"
        );
        assert!(
            eventually(Duration::from_secs(10), || cluster_stat(
                e,
                "upstream_rq_active"
            ) <= MAX_ACTIVE),
            "callouts do not end"
        );
        let before = callouts(e, t);
        let batch = send_requests(e.port, "/x", BATCH.min(n - calls), sent);
        let want = before + batch.len() as u64;
        eventually(Duration::from_millis(TIMEOUT_MS / 2), || {
            callouts(e, t) >= want
        });
        sent += batch.len() as u64;
        reset_all(batch);
        if t == Transport::Grpc {
            // The stream's messages in flight show in no cluster stat: bounded by time instead.
            thread::sleep(LATE);
        }
        calls = callouts(e, t) - calls0;
    }
    settle(e, t);
    (sent, callouts(e, t) - calls0)
}

fn clients_that_disconnect_mid_callout_leave_envoy_flat(t: Transport) {
    let c = Components::get();
    let dir = TempDir::new("callouts-disconnect");
    let redis = Redis::start(&c, &dir);
    let service = Service::start(&c, &dir, Some(&redis.url()));
    // Every callout stays in flight until its timeout, or every message until after its client
    // left.
    let between = Between::start(t, service.port);
    let upstream = Upstream::start();
    let cfg = plugin(
        t,
        // Room for every take: the stream's reach the service (only their answers are late).
        vec![rule("all", &["literal:all"], 1_000_000)],
        // One callout per request (no group commit): what is measured is each request's own
        // callout being abandoned.
        json!({"service": {"timeout_ms": TIMEOUT_MS, "batch": 0}, "failure_mode": "allow",
               "breaker": {"failures": 10_000}}),
    );
    let mut spec = EnvoySpec::new(Some(cfg), between.port(), upstream.port);
    spec.log_level = "wasm:info".to_string();
    spec.base_log_level = "warning".to_string();
    let mut envoy = Envoy::start(&c, &dir, &spec);

    // Warm up: connection pools, the VMs' maps at their working size, the allocator's arenas.
    let n = disconnects();
    let warm = abandon_callouts(&envoy, t, (n / 10).max(1_000));
    let heap0 = quiet_heap(&envoy);
    let (rss0, mem0) = (rss_kib(envoy.proc.pid()), envoy.tg("vm.memory_bytes"));
    let (decided0, seen0) = (decided(&envoy), envoy.tg("callout_failure.timeout"));
    let started = Instant::now();
    let (sent, calls) = abandon_callouts(&envoy, t, n);
    let took = started.elapsed();
    // Envoy gives a closed connection's memory back over the following seconds; a leak never.
    let freeing = Instant::now();
    eventually(Duration::from_secs(30), || {
        heap(&envoy) <= heap0 + HEAP_SLACK
    });
    let heap1 = heap(&envoy);
    let freeing = freeing.elapsed();
    let (rss1, mem1) = (rss_kib(envoy.proc.pid()), envoy.tg("vm.memory_bytes"));
    let decided = decided(&envoy) - decided0;
    // The requests the module decided are those whose client was still there when the callout
    // timed out (or whose callout could not start); every other callout was abandoned.
    let abandoned = calls - (envoy.tg("callout_failure.timeout") - seen0);
    eprintln!(
        "{}: {abandoned} of {calls} callouts abandoned by their clients ({sent} requests, \
         {decided} decided) in {took:.1?}, after a warm-up of {warm:?}; Envoy heap {heap0} -> \
         {heap1} bytes ({:+}, {freeing:.1?} after the last), RSS {rss0} -> {rss1} KiB ({:+}); VMs' linear memory {mem0} -> \
         {mem1} bytes",
        t.name(),
        i64::try_from(heap1).unwrap() - i64::try_from(heap0).unwrap(),
        i64::try_from(rss1).unwrap() - i64::try_from(rss0).unwrap(),
    );
    assert!(
        abandoned * 100 >= n * 95,
        "only {abandoned} of {n} callouts were abandoned mid-flight"
    );
    assert_eq!(envoy.tg("callouts.pending"), 0, "no bookkeeping left");
    // Linear memory never shrinks; a page more in one VM is the allocator meeting a new peak, not
    // bookkeeping (100,000 leaked map entries would be 20 pages and more).
    assert!(
        mem1 <= mem0 + 4 * 65_536,
        "the VMs' linear memory grew from {mem0} to {mem1} bytes"
    );
    assert!(
        heap1 <= heap0 + HEAP_SLACK,
        "Envoy's heap grew from {heap0} to {heap1} bytes over {abandoned} abandoned callouts"
    );
    assert!(
        rss1 <= rss0 + 32 * 1024,
        "Envoy's RSS grew from {rss0} to {rss1} KiB over {abandoned} abandoned callouts"
    );

    // The module is healthy: with the service reachable again, a request is decided by it.
    between.open();
    let client = Client::new();
    assert!(
        eventually(Duration::from_secs(5), || client
            .get(&envoy.url("/after"), &[])
            .status
            == 200
            && envoy.tg("allowed") >= 1),
        "stats after: {:?}",
        envoy.tg_all()
    );
    assert!(envoy.proc.exited().is_none());
}

/// Names Envoy cannot dispatch to: an unknown cluster (HTTP: `BadArgument`; gRPC: `ParseFailure`),
/// and a gRPC name whose bytes parse as a `GrpcService` message without a target, which made
/// Envoy 1.40 abort the whole process when the module passed the name as it is. Each is a counted
/// dispatch failure decided by the failure mode, and Envoy keeps serving.
#[test]
fn cluster_names_envoy_refuses_are_counted_dispatch_failures() {
    let c = Components::get();
    let dir = TempDir::new("callouts-badname");
    let upstream = Upstream::start();
    let cases = [
        (Transport::Http, "nope"),
        (Transport::Grpc, "nope"),
        (Transport::Grpc, "abcdefghi"),
    ];
    let specs: Vec<EnvoySpec> = cases
        .iter()
        .map(|(t, name)| {
            let cfg = plugin(
                *t,
                vec![rule("all", &["literal:all"], 1_000)],
                json!({"service": {"cluster": name}, "failure_mode": "deny"}),
            );
            EnvoySpec::new(Some(cfg), closed_port(), upstream.port)
        })
        .collect();
    let mut envoys = Envoy::start_all(&c, &dir, &specs);
    let client = Client::new();
    for ((t, name), e) in cases.iter().zip(envoys.iter_mut()) {
        for _ in 0..3 {
            assert_eq!(
                client.get(&e.url("/"), &[]).status,
                429,
                "{t:?} {name}: failure_mode deny answers"
            );
        }
        assert_eq!(e.tg("callout_failure.dispatch"), 3, "{t:?} {name}");
        assert_eq!(e.tg("failure_closed.limited"), 3, "{t:?} {name}");
        assert_eq!(e.tg("callouts.pending"), 0);
        assert!(e.proc.exited().is_none(), "{t:?} {name}: Envoy is still up");
    }
    assert_eq!(upstream.requests(), 0);
}

/// Clients of [`many_answers_at_once_stay_shallow`], at once on one worker.
const CROWD: usize = 800;

/// Hundreds of requests answered by one callback: the service black-holed, one worker, 800
/// clients in about 250 ms, `failure_mode: deny`. The first take goes as a message, the others
/// queue and leave as batches beside it (up to 8 in flight, 256 queued); when the stream has
/// answered nothing for the timeout, one tick fails every message in flight, and the queue's
/// takes fail at their own timeouts: hundreds of local replies asked for in one `proxy_on_tick`.
/// Envoy runs them after the call, one inside another (each reply's `proxy_on_response_headers`
/// runs the next from its own after-call actions). Before the answers were paced this failed 5
/// runs of 5: `RangeError: Maximum call stack size exceeded` in `proxy_on_response_headers`, the
/// VM failed, about 95 clients answered 503 and 256 not at all (400 timed out in all). Now at
/// most 64 go to Envoy per round (`src/host/pace.rs`): every client gets its 429 within about
/// 1.2 s (650 to 710 timed out, the rest refused by the full queue), and the module does not
/// trap (the harness fails the test on any `Uncaught`).
#[test]
fn many_answers_at_once_stay_shallow() {
    let gate = Gate::start(GateMode::BlackHole, 0);
    let cfg = plugin(
        Transport::Grpc,
        vec![rule("one", &["literal:x"], 100)],
        json!({"failure_mode": "deny", "breaker": {"failures": 0}}),
    );
    let s = Stack::start_without_service_with("shallow", &cfg, gate.port, |spec| {
        spec.concurrency = 1;
        spec.base_log_level = "warn".to_string();
        spec.log_level = "wasm:warn".to_string();
    });
    let started = Instant::now();
    let statuses = at_once(s.envoy.port, "/", CROWD);
    let took = started.elapsed();
    let stats = s.envoy.tg_all();
    let get = |k: &str| stats.get(k).copied().unwrap_or(0);
    eprintln!(
        "ROW | {CROWD} at once, service black-holed, deny | {statuses:?} in {} ms | {} timed \
         out, {} refused by the full queue |",
        took.as_millis(),
        get("failure_mode.timeout"),
        get("failure_mode.queued"),
    );
    assert_eq!(
        statuses.get(&429).copied(),
        Some(CROWD),
        "every client denied: {statuses:?}"
    );
    assert_eq!(get("failure_closed.limited"), CROWD as u64, "{stats:?}");
    // What makes this test: hundreds failed by the tick that gave the stream up.
    assert!(get("failure_mode.timeout") >= 300, "{stats:?}");
    assert!(s.envoy.module_failures().is_empty());
}

/// `n` clients, each on a connection of its own to `port`, send one GET of `path` together
/// (connected and written one after another, a pause of 25 ms after every 100: about 250 ms in
/// all, so the takes leave in several batches); the status each got, counted (0: none within
/// 10 s of the last one sent).
fn at_once(port: u16, path: &str, n: usize) -> std::collections::BTreeMap<u16, usize> {
    use std::io::{Read, Write};
    let request = format!("GET {path} HTTP/1.1\r\nhost: test\r\n\r\n");
    let conns: Vec<std::net::TcpStream> = (0..n)
        .map(|i| {
            if i % 100 == 99 {
                thread::sleep(Duration::from_millis(25));
            }
            let mut c = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
            c.write_all(request.as_bytes()).expect("send");
            c
        })
        .collect();
    let mut statuses = std::collections::BTreeMap::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    for mut c in conns {
        let left = deadline.saturating_duration_since(Instant::now());
        c.set_read_timeout(Some(left.max(Duration::from_millis(10))))
            .expect("timeout");
        let (mut head, mut chunk) = (Vec::new(), [0u8; 1024]);
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            match c.read(&mut chunk) {
                Ok(0) | Err(_) => break,
                Ok(k) => head.extend_from_slice(&chunk[..k]),
            }
        }
        let status = String::from_utf8_lossy(&head)
            .split_whitespace()
            .nth(1)
            .and_then(|x| x.parse().ok())
            .unwrap_or(0);
        *statuses.entry(status).or_default() += 1;
    }
    statuses
}
