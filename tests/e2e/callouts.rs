//! End to end, callouts that end badly for the module's bookkeeping: clients that go away while
//! their callout is in flight (Envoy deletes the request and never reports the callout to it), and
//! cluster names Envoy refuses at dispatch. Envoy must stay flat in memory and the module healthy.
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
