//! Limits priced in tokens (`"charge": "response"`): a request reserves an estimate, and what its
//! response reports using is settled in the same bucket when the stream ends, once, however it
//! ended. Real Envoy, the real service on real Redis, and an upstream that answers like an LLM API
//! (JSON, or a Server-Sent Events stream whose last event carries `usage`).

#![allow(
    clippy::expect_used,
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use crate::common;

use common::config::plugin;
use common::{
    eventually, Client, Components, Envoy, EnvoySpec, Llm, Redis, Service, TempDir, Transport,
};
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

/// One token an hour: refill never matters within a test.
const SLOW: (u64, u64) = (1, 3_600_000);

/// The reservation of most tests: the client's `x-max-tokens` hint (1,000 when absent, at most
/// 4,000).
fn hint() -> Value {
    json!({"header": "x-max-tokens", "default": 1000, "max": 4000})
}

/// The rule every test uses: one bucket per API key, reserving `cost`, usage from the body or
/// `x-usage-tokens`.
fn llm_rule(capacity: u64, rate: u64, period_ms: u64, cost: Value) -> Value {
    json!({"name": "llm", "key": ["header:x-api-key"],
           "capacity": capacity, "rate": rate, "period_ms": period_ms,
           "cost": cost,
           "charge": "response", "usage": {"header": "x-usage-tokens"}})
}

fn config_with(
    transport: Transport,
    capacity: u64,
    rate: u64,
    period_ms: u64,
    cost: Value,
) -> String {
    plugin(
        transport,
        vec![llm_rule(capacity, rate, period_ms, cost)],
        json!({"service": {"batch": 0}, "response": {"headers": ["x-ratelimit"]}}),
    )
}

fn config(transport: Transport, capacity: u64, rate: u64, period_ms: u64) -> String {
    config_with(transport, capacity, rate, period_ms, hint())
}

struct Fleet {
    envoys: Vec<Envoy>,
    llm: Llm,
    service: Service,
    redis: Redis,
    dir: TempDir,
    components: Components,
}

fn fleet(label: &str, n: usize, cfg: &str) -> Fleet {
    let c = Components::get();
    let dir = TempDir::new(label);
    let redis = Redis::start(&c, &dir);
    let service = Service::start(&c, &dir, Some(&redis.url()));
    let llm = Llm::start();
    let specs: Vec<EnvoySpec> = (0..n)
        .map(|_| {
            let mut s = EnvoySpec::new(Some(cfg.to_string()), service.port, llm.port);
            s.concurrency = 2;
            s
        })
        .collect();
    let envoys = Envoy::start_all(&c, &dir, &specs);
    Fleet {
        envoys,
        llm,
        service,
        redis,
        dir,
        components: c,
    }
}

/// Takes one token from the bucket of `api_key` at the service itself: what it then holds.
fn probe(
    client: &Client,
    port: u16,
    api_key: &str,
    capacity: u64,
    (rate, period_ms): (u64, u64),
) -> i64 {
    let body = json!({"buckets": [{"key": format!("llm|{api_key}"), "capacity": capacity,
                                   "rate": rate, "period_ms": period_ms}]});
    let r = client.post(
        &format!("http://127.0.0.1:{port}/v1/take"),
        &[("content-type", "application/json")],
        body.to_string().as_bytes(),
    );
    assert_eq!(r.status, 200, "probe: {}", r.body);
    let v: Value = serde_json::from_str(&r.body).expect("probe answer is JSON");
    let b = &v["buckets"][0];
    if v["allowed"] == true {
        b["remaining"].as_i64().expect("remaining")
    } else {
        -1
    }
}

/// How the bucket of `api_key` stands at the service, without changing it (a settle of nothing,
/// under a fresh id): (whole tokens held, whole tokens owed).
fn standing(
    client: &Client,
    port: u16,
    api_key: &str,
    capacity: u64,
    (rate, period_ms): (u64, u64),
) -> (u64, u64) {
    static PROBES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let id = format!("probe-{}", PROBES.fetch_add(1, Ordering::Relaxed));
    let body = json!({"id": id, "buckets": [{"key": format!("llm|{api_key}"), "capacity": capacity,
                      "rate": rate, "period_ms": period_ms, "estimate": 0, "used": 0}]});
    let r = client.post(
        &format!("http://127.0.0.1:{port}/v1/settle"),
        &[("content-type", "application/json")],
        body.to_string().as_bytes(),
    );
    assert_eq!(r.status, 200, "standing: {}", r.body);
    let v: Value = serde_json::from_str(&r.body).expect("settle answer is JSON");
    let b = &v["buckets"][0];
    (
        b["remaining"].as_u64().unwrap_or(0),
        b["debt"].as_u64().unwrap_or(0),
    )
}

fn ask(client: &Client, envoy: &Envoy, api_key: &str, headers: &[(&str, &str)]) -> common::Reply {
    let mut all: Vec<(&str, &str)> = vec![("x-api-key", api_key)];
    all.extend_from_slice(headers);
    client.post(
        &envoy.url("/v1/chat/completions"),
        &all,
        br#"{"model":"m","stream":false}"#,
    )
}

/// Waits until `envoy` counted `n` delivered settlements.
fn delivered(envoy: &Envoy, n: u64) {
    assert!(
        eventually(Duration::from_secs(10), || envoy.tg("settle.delivered")
            >= n),
        "settle.delivered stayed at {} (want {n}); stats {:?}",
        envoy.tg("settle.delivered"),
        envoy.tg_all()
    );
    assert_eq!(
        envoy.tg("settle.delivered"),
        n,
        "no settlement applied twice"
    );
}

/// Waits until every settlement of the fleet reached the service, and checks none was given up.
fn all_settled(f: &Fleet) {
    assert!(
        eventually(Duration::from_secs(10), || f.envoys.iter().all(|e| e
            .tg("settle.sent")
            == e.tg("settle.delivered") + e.tg("settle.retried"))),
        "settlements still pending"
    );
    let given_up: u64 = f.envoys.iter().map(|e| e.tg("settle.given_up")).sum();
    assert_eq!(given_up, 0);
}

/// Sends one streamed request by hand and hangs up after the first event arrived.
fn hang_up_mid_stream(envoy: &Envoy, api_key: &str, extra: &str) {
    let port: u16 = envoy
        .url("/")
        .rsplit(':')
        .next()
        .and_then(|p| p.trim_end_matches('/').parse().ok())
        .expect("envoy port");
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect to envoy");
    s.set_read_timeout(Some(Duration::from_secs(10))).ok();
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: llm\r\nx-api-key: {api_key}\r\n{extra}content-length: 2\r\n\r\n{{}}"
    );
    s.write_all(req.as_bytes()).expect("send");
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    while !String::from_utf8_lossy(&got).contains("data: ") {
        let n = s.read(&mut buf).expect("read the stream");
        assert!(n > 0, "the stream ended before its first event");
        got.extend_from_slice(&buf[..n]);
    }
    assert!(String::from_utf8_lossy(&got).starts_with("HTTP/1.1 200"));
    drop(s);
}

#[test]
fn each_way_a_response_ends_is_settled_once() {
    let capacity = 20_000;
    let f = fleet(
        "tokens-endings",
        1,
        &config(Transport::Grpc, capacity, SLOW.0, SLOW.1),
    );
    let e = &f.envoys[0];
    let client = Client::new();
    let mut expect = capacity as i64;
    let check = |expect: &mut i64, what: &str| {
        *expect -= 1;
        assert_eq!(
            probe(&client, f.service.port, "team-a", capacity, SLOW),
            *expect,
            "after {what}"
        );
    };

    // A stream: its last event's usage (300) replaces the estimate (1,000), counted once.
    let r = ask(
        &client,
        e,
        "team-a",
        &[
            ("x-max-tokens", "1000"),
            ("x-llm-stream", "1"),
            ("x-llm-usage", "300"),
        ],
    );
    assert_eq!(r.status, 200);
    assert!(
        r.body.contains("\"total_tokens\":300") && r.body.ends_with("data: [DONE]\n\n"),
        "{}",
        r.body
    );
    delivered(e, 1);
    expect -= 300;
    check(&mut expect, "a stream that used 300");

    // JSON that used more than reserved: the difference is charged on top.
    let r = ask(
        &client,
        e,
        "team-a",
        &[("x-max-tokens", "1000"), ("x-llm-usage", "2500")],
    );
    assert_eq!(r.status, 200);
    delivered(e, 2);
    expect -= 2500;
    check(&mut expect, "a JSON answer that used 2,500");

    // Usage in a response header.
    let r = ask(
        &client,
        e,
        "team-a",
        &[
            ("x-max-tokens", "1000"),
            ("x-llm-usage", "50"),
            ("x-llm-report", "header"),
        ],
    );
    assert_eq!((r.status, r.header("x-usage-tokens")), (200, Some("50")));
    delivered(e, 3);
    expect -= 50;
    check(&mut expect, "a header that said 50");

    // No usage anywhere: the estimate stands and nothing is sent.
    let sent = e.tg("settle.sent");
    let r = ask(
        &client,
        e,
        "team-a",
        &[("x-max-tokens", "700"), ("x-llm-report", "none")],
    );
    assert_eq!(r.status, 200);
    thread::sleep(Duration::from_millis(300));
    assert_eq!(e.tg("settle.sent"), sent);
    expect -= 700;
    check(&mut expect, "a response without usage");

    // The client hangs up mid-stream, before the usage: charged as if it had run to the end,
    // the most it could have reserved (4,000), not its 800.
    let before = f.llm.served().len();
    hang_up_mid_stream(e, "team-a", "x-max-tokens: 800\r\nx-llm-stream: 1\r\nx-llm-chunks: 20\r\nx-llm-chunk-ms: 100\r\nx-llm-usage: 5\r\n");
    assert!(
        eventually(Duration::from_secs(5), || f.llm.served().len() > before),
        "the upstream never saw the stream end"
    );
    assert_eq!(f.llm.served().last().map(|s| s.whole), Some(false));
    delivered(e, 4);
    expect -= 4000;
    check(&mut expect, "a client that hung up mid-stream");

    // The upstream resets after its usage event (400): cut off all the same, the bound is
    // charged (the usage seen, were it larger).
    let r = client.try_get(
        &e.url("/v1/x"),
        &[
            ("x-api-key", "team-a"),
            ("x-max-tokens", "1000"),
            ("x-llm-stream", "1"),
            ("x-llm-usage", "400"),
            ("x-llm-reset", "after"),
        ],
    );
    assert!(
        r.map(|r| r.status == 200).unwrap_or(true),
        "the stream had started: no error status"
    );
    delivered(e, 5);
    expect -= 4000;
    check(&mut expect, "an upstream reset after the usage event");

    // The upstream resets before any usage: the bound too.
    let _ = client.try_get(
        &e.url("/v1/x"),
        &[
            ("x-api-key", "team-a"),
            ("x-max-tokens", "900"),
            ("x-llm-stream", "1"),
            ("x-llm-usage", "10"),
            ("x-llm-reset", "before"),
        ],
    );
    delivered(e, 6);
    expect -= 4000;
    check(&mut expect, "an upstream reset before the usage event");

    // Anthropic's stream: the input tokens in message_start (500), the output tokens in
    // message_delta (1,500): both are charged.
    let r = ask(
        &client,
        e,
        "team-a",
        &[
            ("x-max-tokens", "1000"),
            ("x-llm-stream", "1"),
            ("x-llm-format", "anthropic"),
            ("x-llm-usage", "2000"),
        ],
    );
    assert_eq!(r.status, 200);
    assert!(
        r.body.contains("\"input_tokens\":500") && r.body.contains("\"output_tokens\":1500"),
        "{}",
        r.body
    );
    delivered(e, 7);
    expect -= 2000;
    check(&mut expect, "an Anthropic stream that used 500 + 1,500");
    assert_eq!((e.tg("settle.given_up"), e.tg("settle.retried")), (0, 0));
    eprintln!("bucket after every ending: {expect} of {capacity}, as computed from the usages");
}

#[test]
fn a_bucket_in_debt_denies_before_the_stream_until_the_debt_refills() {
    // 1,000 tokens a minute: one response that used 1,600 of a 100 estimate leaves a debt of 700.
    let f = fleet(
        "tokens-debt",
        1,
        &config(Transport::Http, 1000, 1000, 60_000),
    );
    let e = &f.envoys[0];
    let client = Client::new();
    let r = ask(
        &client,
        e,
        "team-b",
        &[
            ("x-max-tokens", "100"),
            ("x-llm-usage", "1600"),
            ("x-llm-stream", "1"),
        ],
    );
    assert_eq!(r.status, 200);
    delivered(e, 1);
    let seen = f.llm.served().len();
    let r = ask(
        &client,
        e,
        "team-b",
        &[("x-max-tokens", "100"), ("x-llm-stream", "1")],
    );
    assert_eq!(r.status, 429, "in debt: denied before any stream starts");
    assert_eq!(f.llm.served().len(), seen, "the upstream never saw it");
    // Retry-After covers the debt (about 600) and this request's 100 at 1,000/min: about 42 s.
    let retry: u64 = r
        .header("retry-after")
        .and_then(|v| v.parse().ok())
        .expect("Retry-After");
    assert!((40..=43).contains(&retry), "Retry-After {retry}");
    assert_eq!(r.header("x-ratelimit-remaining"), Some("0"));
    assert_eq!(r.header("x-ratelimit-limit"), Some("1000"));
    eprintln!("in debt: 429 with Retry-After {retry} s");
}

/// A fleet of one Envoy (10,000 tokens, one an hour) whose service dies 400 ms into a 1.2 s
/// stream of `api_key` that reserved 1,000 and reports `usage`: the fleet, with its service down
/// and the stream over.
fn service_dies_mid_stream(label: &str, api_key: &str, usage: u64) -> Fleet {
    let mut f = fleet(label, 1, &config(Transport::Http, 10_000, SLOW.0, SLOW.1));
    let url = f.envoys[0].url("/v1/chat/completions");
    let (key, used) = (api_key.to_string(), usage.to_string());
    let stream = thread::spawn(move || {
        Client::new().post(
            &url,
            &[
                ("x-api-key", &key),
                ("x-max-tokens", "1000"),
                ("x-llm-stream", "1"),
                ("x-llm-usage", &used),
                ("x-llm-chunks", "6"),
                ("x-llm-chunk-ms", "200"),
            ],
            b"{}",
        )
    });
    thread::sleep(Duration::from_millis(400));
    f.service.proc.kill();
    let r = stream.join().expect("the stream");
    assert_eq!(r.status, 200);
    assert!(r.body.contains(&format!("\"total_tokens\":{usage}")));
    f
}

#[test]
fn a_settlement_outlives_a_service_that_died_mid_stream() {
    let capacity = 10_000;
    let mut f = service_dies_mid_stream("tokens-service-dies", "team-c", 200);
    let client = Client::new();
    let port = f.service.port;
    let e = &f.envoys[0];
    assert!(
        eventually(Duration::from_secs(3), || e.tg("settle.retried") >= 2),
        "the settlement was not retried: {:?}",
        e.tg_all()
    );
    f.service = Service::start_on(&f.components, &f.dir, port, Some(&f.redis.url()), &[]);
    delivered(e, 1);
    assert_eq!(e.tg("settle.given_up"), 0);
    let left = probe(&client, port, "team-c", capacity, SLOW);
    assert_eq!(left, capacity as i64 - 200 - 1, "200 charged in all, once");
    eprintln!("settled after {} failed attempts", e.tg("settle.retried"));
}

#[test]
fn an_extra_charge_is_owed_through_an_outage_longer_than_the_retries_of_a_refund() {
    // A response that used 2,500 of the 1,000 reserved ends while the service is down, and stays
    // down for 10 s: longer than a refund is retried (about 7 s). The 1,500 extra are applied once
    // it is back, never given up.
    let capacity = 10_000;
    let mut f = service_dies_mid_stream("tokens-outage-debt", "team-d", 2500);
    let client = Client::new();
    let port = f.service.port;
    let e = &f.envoys[0];
    thread::sleep(Duration::from_secs(10));
    assert!(e.tg("settle.retried") >= 8, "{:?}", e.tg_all());
    assert_eq!(
        e.tg("settle.given_up"),
        0,
        "an extra charge is never given up"
    );
    f.service = Service::start_on(&f.components, &f.dir, port, Some(&f.redis.url()), &[]);
    delivered(e, 1);
    let (remaining, debt) = standing(&client, port, "team-d", capacity, SLOW);
    eprintln!(
        "after {} failed attempts over 10 s: {remaining} held, {debt} owed",
        e.tg("settle.retried")
    );
    assert_eq!(
        (remaining, debt),
        (capacity - 2500, 0),
        "2,500 charged in all, once"
    );
}

#[test]
fn the_fallback_counts_an_overshoot_the_service_has_not_heard_of() {
    // The service dies mid-stream; the stream used 9,000 of its 1,000 reserved. This proxy's
    // fallback share had 9,000 (the take's answer): the 8,000 beyond the reservation come out of
    // it too, so requests of 1,000 during the outage find 1,000, not 9,000.
    let f = service_dies_mid_stream("tokens-outage-share", "team-e", 9000);
    let e = &f.envoys[0];
    assert!(
        eventually(Duration::from_secs(3), || e.tg("settle.retried") >= 1),
        "the settlement was not tried: {:?}",
        e.tg_all()
    );
    let client = Client::new();
    let passed = (0..5)
        .filter(|_| {
            let r = ask(
                &client,
                e,
                "team-e",
                &[("x-max-tokens", "1000"), ("x-llm-usage", "1000")],
            );
            assert!(matches!(r.status, 200 | 429), "{} {}", r.status, r.body);
            r.status == 200
        })
        .count();
    eprintln!(
        "outage: {passed} of 5 requests of 1,000 admitted by the fallback; stats {:?}",
        e.tg_all()
    );
    assert_eq!(
        e.tg("fallback.allowed") + e.tg("fallback.limited"),
        5,
        "decided by the fallback"
    );
    assert_eq!(
        passed, 1,
        "9,000 held, 8,000 of them spent by the overshoot"
    );
}

/// Deterministic pseudo-random numbers (a test must not depend on luck, but the mix must vary).
struct Lcg(u64);
impl Lcg {
    fn next(&mut self, lo: u64, hi: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        lo + (self.0 >> 33) % (hi - lo + 1)
    }
}

#[test]
fn three_envoys_admit_no_more_tokens_than_the_bucket_holds() {
    // 10,000 tokens a minute for one API key, three Envoys, a client on each sending a mix of
    // JSON and streamed requests whose usage is sometimes far above their estimate.
    let (capacity, rate, period_ms) = (10_000u64, 10_000u64, 60_000u64);
    let f = fleet(
        "tokens-fleet",
        3,
        &config(Transport::Http, capacity, rate, period_ms),
    );
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let run = Duration::from_secs(6);
    let clients: Vec<_> = f
        .envoys
        .iter()
        .enumerate()
        .map(|(i, e)| {
            let url = e.url("/v1/chat/completions");
            let stop = stop.clone();
            thread::spawn(move || {
                let client = Client::new();
                let mut rng = Lcg(i as u64 + 7);
                let (mut admitted, mut used, mut over, mut denied) = (0u64, 0u64, 0u64, 0u64);
                for _ in 0..3000 {
                    if stop.load(Ordering::Relaxed) || started.elapsed() > run {
                        break;
                    }
                    let estimate = rng.next(100, 600);
                    let usage = rng.next(50, 900);
                    let stream = if rng.next(0, 1) == 1 { "1" } else { "0" };
                    let (e, u) = (estimate.to_string(), usage.to_string());
                    let r = client.post(
                        &url,
                        &[
                            ("x-api-key", "shared"),
                            ("x-max-tokens", &e),
                            ("x-llm-usage", &u),
                            ("x-llm-stream", stream),
                        ],
                        b"{}",
                    );
                    match r.status {
                        200 => {
                            admitted += 1;
                            used += usage;
                            over = over.max(usage.saturating_sub(estimate));
                        }
                        429 => {
                            denied += 1;
                            thread::sleep(Duration::from_millis(20));
                        }
                        s => panic!("unexpected status {s}: {}", r.body),
                    }
                }
                (admitted, used, over, denied)
            })
        })
        .collect();
    let results: Vec<(u64, u64, u64, u64)> = clients
        .into_iter()
        .map(|t| t.join().expect("client"))
        .collect();
    let elapsed_ms = started.elapsed().as_millis() as u64;
    stop.store(true, Ordering::Relaxed);
    let admitted: u64 = results.iter().map(|r| r.0).sum();
    let used: u64 = results.iter().map(|r| r.1).sum();
    let largest_over = results.iter().map(|r| r.2).max().unwrap_or(0);
    let denied: u64 = results.iter().map(|r| r.3).sum();
    all_settled(&f);
    // What the bucket can have paid for: its capacity, its refill over the run, and the overshoot
    // of the requests in flight when it ran dry (one per client), which the debt then repays.
    let refill = rate * elapsed_ms / period_ms;
    let bound = capacity + refill + 3 * largest_over;
    eprintln!(
        "3 Envoys, {elapsed_ms} ms: {admitted} admitted using {used} tokens, {denied} denied; \
         capacity {capacity} + refill {refill} + 3 x largest overshoot {largest_over} = {bound} \
         (over capacity + refill: {})",
        used.saturating_sub(capacity + refill)
    );
    assert!(used <= bound, "admitted {used} tokens, bound {bound}");
    assert!(
        used >= capacity,
        "the refunds let the fleet spend its tokens: only {used}"
    );
}

/// What a wave of concurrent clients got through.
struct Wave {
    /// Requests admitted, and the tokens their responses used (all reported, all whole).
    admitted: u64,
    used: u64,
    /// What the admitted responses used beyond their reservations.
    overshoot: u64,
    denied: u64,
    elapsed_ms: u64,
}

/// `n` clients at once, spread over the fleet's Envoys, each sending streamed requests for
/// `run` that choose their own `x-max-tokens` (1..=50) and use `usage` tokens each;
/// `reserved(hint)` is what the rule reserves for a hint.
fn wave(
    f: &Fleet,
    n: usize,
    run: Duration,
    api_key: &str,
    usage: u64,
    reserved: fn(u64) -> u64,
) -> Wave {
    let started = Instant::now();
    let clients: Vec<_> = (0..n)
        .map(|i| {
            let url = f.envoys[i % f.envoys.len()].url("/v1/chat/completions");
            let key = api_key.to_string();
            thread::spawn(move || {
                let client = Client::new();
                let mut rng = Lcg(i as u64 + 11);
                let (mut admitted, mut over, mut denied) = (0u64, 0u64, 0u64);
                while started.elapsed() < run {
                    let hint = rng.next(1, 50);
                    let (h, u) = (hint.to_string(), usage.to_string());
                    let r = client.post(
                        &url,
                        &[
                            ("x-api-key", &key),
                            ("x-max-tokens", &h),
                            ("x-llm-usage", &u),
                            ("x-llm-stream", "1"),
                            ("x-llm-chunks", "4"),
                            ("x-llm-chunk-ms", "50"),
                        ],
                        b"{}",
                    );
                    match r.status {
                        200 => {
                            assert!(r.body.ends_with("data: [DONE]\n\n"), "{}", r.body);
                            admitted += 1;
                            over += usage.saturating_sub(reserved(hint));
                        }
                        429 => {
                            denied += 1;
                            thread::sleep(Duration::from_millis(50));
                        }
                        s => panic!("unexpected status {s}: {}", r.body),
                    }
                }
                (admitted, over, denied)
            })
        })
        .collect();
    let results: Vec<(u64, u64, u64)> = clients
        .into_iter()
        .map(|t| t.join().expect("client"))
        .collect();
    let elapsed_ms = started.elapsed().as_millis() as u64;
    let admitted: u64 = results.iter().map(|r| r.0).sum();
    all_settled(f);
    Wave {
        admitted,
        used: admitted * usage,
        overshoot: results.iter().map(|r| r.1).sum(),
        denied: results.iter().map(|r| r.2).sum(),
        elapsed_ms,
    }
}

#[test]
fn reserving_the_max_admits_no_more_than_capacity_plus_refill_whatever_clients_say() {
    // 10,000 tokens a minute, three Envoys, 24 clients at once each saying it needs 1..=50
    // tokens while its stream uses 3,000: every request reserves the rule's 4,000 instead.
    let (capacity, rate, period_ms) = (10_000u64, 10_000u64, 60_000u64);
    let cost = json!({"reserve": "max", "max": 4000});
    let f = fleet(
        "tokens-reserve-max",
        3,
        &config_with(Transport::Http, capacity, rate, period_ms, cost),
    );
    let w = wave(&f, 24, Duration::from_secs(3), "max", 3000, |_| 4000);
    let refill = rate * w.elapsed_ms / period_ms;
    eprintln!(
        "reserve max, 3 Envoys, 24 clients, {} ms: {} admitted using {} tokens, {} denied; \
         capacity {capacity} + refill {refill} = {}",
        w.elapsed_ms,
        w.admitted,
        w.used,
        w.denied,
        capacity + refill
    );
    assert_eq!(w.overshoot, 0);
    assert!(
        w.used <= capacity + refill,
        "used {} > capacity + refill {}",
        w.used,
        capacity + refill
    );
    assert!(
        w.admitted >= 3,
        "the refunds let the bucket serve more: {}",
        w.admitted
    );
    let client = Client::new();
    let (_, debt) = standing(&client, f.service.port, "max", capacity, (rate, period_ms));
    assert_eq!(
        debt, 0,
        "nothing owed: no response used more than it reserved"
    );
}

#[test]
fn client_hints_overshoot_only_while_in_flight_and_the_debt_is_the_whole_overshoot() {
    // The same clients against the client-hint reservation (their 1..=50 taken as is): they pass
    // together and use far more. One token an hour, so the debt left is exact.
    let capacity = 10_000u64;
    let f = fleet(
        "tokens-hints",
        3,
        &config(Transport::Http, capacity, SLOW.0, SLOW.1),
    );
    let w = wave(&f, 24, Duration::from_secs(3), "hints", 3000, |hint| hint);
    eprintln!(
        "client hints, 3 Envoys, 24 clients, {} ms: {} admitted using {} tokens, {} denied; \
         capacity {capacity} + overshoot in flight {} = {}",
        w.elapsed_ms,
        w.admitted,
        w.used,
        w.denied,
        w.overshoot,
        capacity + w.overshoot
    );
    assert!(w.admitted >= 24, "each reservation fits: all pass at first");
    assert!(w.used <= capacity + w.overshoot);
    assert!(w.denied > 0, "in debt: the following requests are denied");
    let client = Client::new();
    let (remaining, debt) = standing(&client, f.service.port, "hints", capacity, SLOW);
    eprintln!("afterwards: {remaining} held, {debt} owed");
    assert_eq!(
        (remaining, debt),
        (0, w.used - capacity),
        "everything used beyond the capacity is owed: nothing forgiven"
    );
}

/// The README's example, as written: `envoy.yaml` (what `make run` starts, its stand-in LLM API
/// reporting 42 tokens per completion) and the README's three requests, each reserving the rule's
/// 4,000.
#[test]
fn the_readme_example_answers_as_written() {
    let c = Components::get();
    let dir = TempDir::new("tokens-readme");
    let redis = Redis::start(&c, &dir);
    let service = Service::start(&c, &dir, Some(&redis.url()));
    let root = common::workspace_root();
    let readme = std::fs::read_to_string(root.join("README.md")).expect("README.md");
    let example = "curl -si localhost:10000/v1/chat/completions -H 'x-api-key: demo' | grep";
    assert!(readme.contains(example), "the README shows {example}");
    assert!(readme.contains("# 6000, then about 5960 and 5920"));
    let text = std::fs::read_to_string(root.join("envoy.yaml")).expect("envoy.yaml");
    let module = "filename: dist/tollgate.wasm";
    let text = text.replace(module, &format!("filename: \"{}\"", c.wasm.display()));
    let upstream = common::free_port();
    let spec = EnvoySpec::new(None, service.port, upstream);
    let envoy = Envoy::try_start_from(&c, &dir, &spec, Duration::from_secs(30), &|port, admin| {
        text.replace("port_value: 9901", &format!("port_value: {admin}"))
            .replace("port_value: 10000", &format!("port_value: {port}"))
            .replace("port_value: 10001", &format!("port_value: {upstream}"))
            .replace("port_value: 8081", &format!("port_value: {}", service.port))
    })
    .unwrap_or_else(|f| panic!("envoy.yaml did not start: {:?}\n{}", f.status, f.log));
    let client = Client::new();
    let mut seen = Vec::new();
    for _ in 0..3 {
        let r = client.get(&envoy.url("/v1/chat/completions"), &[("x-api-key", "demo")]);
        assert_eq!(r.status, 200);
        assert!(r.body.contains("\"total_tokens\":42"), "{}", r.body);
        let left: u64 = r
            .header("x-ratelimit-remaining")
            .and_then(|v| v.parse().ok())
            .expect("x-ratelimit-remaining");
        seen.push(left);
        let settled = seen.len() as u64;
        assert!(
            eventually(Duration::from_secs(5), || envoy.tg("settle.delivered")
                >= settled),
            "settlement {settled} not delivered"
        );
    }
    eprintln!("x-ratelimit-remaining: {seen:?}");
    assert_eq!(seen[0], 6000, "4,000 reserved of 10,000");
    // Settled to 42: the next reservation finds about 9,958 (plus a little refill), not 6,000.
    assert!((5958..6000).contains(&seen[1]), "{seen:?}");
    assert!((5916..seen[1]).contains(&seen[2]), "{seen:?}");
}

#[test]
fn a_settlement_that_gives_tokens_back_ends_the_denial_this_envoy_remembered() {
    // 10,000 tokens, one an hour; denials remembered up to 10 s. Two streams reserve 4,000 each, a
    // third is refused (2,000 left) and its denial remembered; both streams settle to 10 each.
    let cfg = plugin(
        Transport::Grpc,
        vec![llm_rule(10_000, SLOW.0, SLOW.1, hint())],
        json!({"service": {"batch": 0, "remember_denials_ms": 10_000}}),
    );
    let f = fleet("tokens-forget", 1, &cfg);
    let e = &f.envoys[0];
    let url = e.url("/v1/chat/completions");
    let streams: Vec<_> = (0..2)
        .map(|_| {
            let url = url.clone();
            thread::spawn(move || {
                Client::new()
                    .post(
                        &url,
                        &[
                            ("x-api-key", "team-f"),
                            ("x-max-tokens", "4000"),
                            ("x-llm-usage", "10"),
                            ("x-llm-stream", "1"),
                            ("x-llm-chunk-ms", "250"),
                        ],
                        br#"{"model":"m","stream":true}"#,
                    )
                    .status
            })
        })
        .collect();
    let client = Client::new();
    assert!(
        eventually(Duration::from_secs(5), || e.tg("allowed") >= 2),
        "both streams admitted"
    );
    let third = ask(&client, e, "team-f", &[("x-max-tokens", "4000")]);
    assert_eq!(third.status, 429, "8,000 of 10,000 reserved");
    for s in streams {
        assert_eq!(s.join().expect("stream thread"), 200);
    }
    delivered(e, 2);
    // 20 used of 10,000: the service would admit 4,000, and this Envoy asks it again instead of
    // repeating the denial it remembered (the settlements gave the tokens back).
    let fourth = ask(&client, e, "team-f", &[("x-max-tokens", "4000")]);
    assert_eq!(fourth.status, 200, "{:?}", fourth.header("retry-after"));
    assert_eq!(e.tg("rule.llm.limited_locally"), 0, "{:?}", e.tg_all());
}

/// A monthly budget (`calendar_window`, a month from midnight in a named zone, `Etc/GMT-1`: an
/// hour east of UTC all year), priced by the response: what each response used is settled in the
/// month it was reserved in, a request whose estimate no longer fits is refused until the 1st,
/// and its `Retry-After` and `RateLimit` reset point at that midnight.
#[test]
fn a_monthly_budget_settles_in_its_month_and_resets_on_the_first() {
    let capacity = 5_000;
    let mut rule = llm_rule(capacity, 1, 1, hint());
    let r = rule.as_object_mut().unwrap();
    r.remove("rate");
    r.remove("period_ms");
    r.insert("algorithm".into(), json!("calendar_window"));
    r.insert("calendar".into(), json!("month"));
    r.insert("time_zone".into(), json!("Etc/GMT-1"));
    let cfg = plugin(
        Transport::Grpc,
        vec![rule],
        json!({"service": {"batch": 0}, "response": {"headers": ["x-ratelimit"]}}),
    );
    let f = fleet("tokens-monthly", 1, &cfg);
    let e = &f.envoys[0];
    let client = Client::new();
    // How the month stands at the service: a settle of nothing, with the calendar.
    let standing = || {
        let body = json!({"id": format!("probe-{}", Instant::now().elapsed().as_nanos()),
            "buckets": [{"key": "llm|team-m", "capacity": capacity, "period_ms": 2_678_400_000u64,
                         "algorithm": "calendar_window", "calendar": "month",
                         "time_zone": "Etc/GMT-1", "estimate": 0, "used": 0}]});
        let r = client.post(
            &format!("http://127.0.0.1:{}/v1/settle", f.service.port),
            &[("content-type", "application/json")],
            body.to_string().as_bytes(),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        let v: Value = serde_json::from_str(&r.body).unwrap();
        v["buckets"][0]["remaining"].as_u64().unwrap()
    };

    // 1,000 reserved, 300 used: 700 come back to this month.
    let r = ask(
        &client,
        e,
        "team-m",
        &[("x-max-tokens", "1000"), ("x-llm-usage", "300")],
    );
    assert_eq!(r.status, 200, "{}", r.body);
    delivered(e, 1);
    assert_eq!(
        standing(),
        4_700,
        "the unused 700 back in the month charged"
    );
    // 4,000 reserved and used: 700 left, and a request reserving 1,000 no longer fits.
    let r = ask(
        &client,
        e,
        "team-m",
        &[("x-max-tokens", "4000"), ("x-llm-usage", "4000")],
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(standing(), 700);
    let asked = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let r = ask(&client, e, "team-m", &[("x-max-tokens", "1000")]);
    assert_eq!(r.status, 429, "{}", r.body);
    // The 1st of next month at midnight, an hour east of UTC.
    let span = contract::calendar::Span::fixed(contract::calendar::Unit::Month, 60, asked);
    let first = span.window(asked).1;
    let want = (first - asked).div_ceil(1000);
    let retry: u64 = r.header("retry-after").unwrap().parse().unwrap();
    assert!(
        retry.abs_diff(want) <= 2,
        "Retry-After {retry} s, the 1st is {want} s away"
    );
    let reset: u64 = r
        .header("x-ratelimit-reset")
        .unwrap_or_else(|| panic!("a reset header: {:?}", r.headers))
        .parse()
        .unwrap();
    assert!(
        reset.abs_diff(want) <= 2,
        "reset {reset} s, the 1st is {want} s away"
    );
    // A request that fits the 700 left goes.
    let r = ask(
        &client,
        e,
        "team-m",
        &[("x-max-tokens", "700"), ("x-llm-usage", "700")],
    );
    assert_eq!(r.status, 200, "{}", r.body);
    all_settled(&f);
    assert_eq!(standing(), 0);
}
