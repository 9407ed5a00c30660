//! The soak's traffic (scripts/soak.sh): valid takes as fast as the service answers them, mixed
//! with hostile requests, while the service's RSS is sampled; at the end, what Redis charged is
//! compared with what was answered.
//!
//! `cargo run --release -p tollgate-server --example soak -- --addr 127.0.0.1:8081 --token T
//! --pid PID --seconds 600 --out soak.csv`
//!
//! Valid traffic: JSON over HTTP/1.1 and gRPC, each take charging 1 token to one or two of
//! `KEYS` buckets that never refill (capacity 1e9, one token a year). Hostile traffic, beside it:
//! 4 MB gRPC bodies of empty buckets, 87,000-bucket JSON bodies, takes without the token,
//! malformed and 17-bucket bodies, slow bodies and silent connections. Every answer is checked
//! against what it must be. At the end each bucket is read with one more take: `charged =
//! capacity - remaining - 1`, which must lie between the takes answered "allowed" and that plus
//! the takes whose outcome is unknown (503 from the store: a script whose reply was lost may have
//! run). Exits non-zero on any lost or doubled decision or wrong answer.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tollgate_server::api::grpc::pb;

const KEYS: usize = 8;
const CAP: u64 = 1_000_000_000;
const YEAR_MS: u64 = 31_536_000_000;

struct Args {
    addr: String,
    token: String,
    pid: u32,
    seconds: u64,
    out: String,
    json_tasks: usize,
    grpc_tasks: usize,
    prefix: String,
}

fn parse() -> Args {
    let mut a = Args {
        addr: "127.0.0.1:8081".into(),
        token: String::new(),
        pid: 0,
        seconds: 600,
        out: "soak.csv".into(),
        json_tasks: 8,
        grpc_tasks: 8,
        prefix: format!("soak-{}", std::process::id()),
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut it = argv.iter();
    while let Some(flag) = it.next() {
        let v = it
            .next()
            .unwrap_or_else(|| panic!("{flag} needs a value"))
            .clone();
        match flag.as_str() {
            "--addr" => a.addr = v,
            "--token" => a.token = v,
            "--pid" => a.pid = v.parse().expect("--pid"),
            "--seconds" => a.seconds = v.parse().expect("--seconds"),
            "--out" => a.out = v,
            "--json-tasks" => a.json_tasks = v.parse().expect("number"),
            "--grpc-tasks" => a.grpc_tasks = v.parse().expect("number"),
            _ => panic!("unknown flag {flag}"),
        }
    }
    assert!(a.addr.starts_with("127.0.0.1:"), "loopback only");
    a.seconds = a.seconds.clamp(1, 3600);
    a
}

/// Per bucket: takes answered allowed, and takes whose outcome is unknown.
struct Counts {
    allowed: Vec<AtomicU64>,
    unknown: Vec<AtomicU64>,
    valid_ok: AtomicU64,
    valid_unavailable: AtomicU64,
    shed: AtomicU64,
    hostile: AtomicU64,
    wrong: AtomicU64,
}

impl Counts {
    fn new() -> Self {
        let v = || (0..KEYS).map(|_| AtomicU64::new(0)).collect();
        Counts {
            allowed: v(),
            unknown: v(),
            valid_ok: AtomicU64::new(0),
            valid_unavailable: AtomicU64::new(0),
            shed: AtomicU64::new(0),
            hostile: AtomicU64::new(0),
            wrong: AtomicU64::new(0),
        }
    }

    fn wrong(&self, what: &str) {
        if self.wrong.fetch_add(1, Ordering::Relaxed) < 20 {
            eprintln!("soak: wrong answer: {what}");
        }
    }

    /// Records a valid take of `keys`: allowed, or a 503 (unknown unless it was shed).
    fn record(&self, keys: &[usize], outcome: Outcome) {
        match outcome {
            Outcome::Allowed => {
                self.valid_ok.fetch_add(1, Ordering::Relaxed);
                for &k in keys {
                    self.allowed[k].fetch_add(1, Ordering::Relaxed);
                }
            }
            Outcome::Shed => {
                self.shed.fetch_add(1, Ordering::Relaxed);
            }
            Outcome::Unknown => {
                self.valid_unavailable.fetch_add(1, Ordering::Relaxed);
                for &k in keys {
                    self.unknown[k].fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }
}

enum Outcome {
    Allowed,
    Shed,
    Unknown,
}

fn key(prefix: &str, k: usize) -> String {
    format!("{prefix}-{k}")
}

/// The keys of the n-th take of a task: one, or two distinct ones.
fn pick(task: usize, n: u64) -> Vec<usize> {
    let a = (task + n as usize) % KEYS;
    if n.is_multiple_of(3) {
        vec![a, (a + 1 + (n as usize / 3) % (KEYS - 1)) % KEYS]
    } else {
        vec![a]
    }
}

fn json_body(prefix: &str, keys: &[usize]) -> Value {
    let buckets: Vec<Value> = keys
        .iter()
        .map(|&k| json!({"key": key(prefix, k), "capacity": CAP, "rate": 1, "period_ms": YEAR_MS}))
        .collect();
    json!({ "buckets": buckets })
}

fn pb_request(prefix: &str, keys: &[usize]) -> pb::TakeRequest {
    pb::TakeRequest {
        buckets: keys
            .iter()
            .map(|&k| pb::Bucket {
                key: key(prefix, k),
                capacity: CAP,
                rate: Some(1),
                period_ms: YEAR_MS,
                cost: None,
                algorithm: 0,
                lease: None,
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }
}

async fn json_task(args: Arc<Args>, counts: Arc<Counts>, task: usize, deadline: Instant) {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let url = format!("http://{}/v1/take", args.addr);
    let mut n = 0u64;
    while Instant::now() < deadline {
        n += 1;
        let keys = pick(task, n);
        let r = client
            .post(&url)
            .bearer_auth(&args.token)
            .json(&json_body(&args.prefix, &keys))
            .send()
            .await;
        let outcome = match r {
            Ok(r) if r.status() == 200 => match r.json::<Value>().await {
                Ok(v) if v["allowed"] == true => Outcome::Allowed,
                Ok(v) => {
                    counts.wrong(&format!("a take was denied: {v}"));
                    continue;
                }
                Err(_) => Outcome::Unknown,
            },
            Ok(r) if r.status() == 503 => {
                let v: Value = r.json().await.unwrap_or(Value::Null);
                let msg = v["error"]["message"].as_str().unwrap_or_default();
                if msg.contains("shed") {
                    Outcome::Shed
                } else {
                    Outcome::Unknown
                }
            }
            Ok(r) => {
                counts.wrong(&format!("valid JSON take answered {}", r.status()));
                Outcome::Unknown
            }
            Err(_) => Outcome::Unknown,
        };
        counts.record(&keys, outcome);
    }
}

async fn grpc_task(args: Arc<Args>, counts: Arc<Counts>, task: usize, deadline: Instant) {
    let url = format!("http://{}", args.addr);
    let mut client = None;
    let mut n = 0u64;
    while Instant::now() < deadline {
        if client.is_none() {
            client = pb::rate_limiter_client::RateLimiterClient::connect(url.clone())
                .await
                .ok();
            if client.is_none() {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        }
        let Some(c) = client.as_mut() else { continue };
        n += 1;
        let keys = pick(task + 100, n);
        let mut req = tonic::Request::new(pb_request(&args.prefix, &keys));
        req.set_timeout(Duration::from_secs(5));
        req.metadata_mut().insert(
            "authorization",
            format!("Bearer {}", args.token).parse().unwrap(),
        );
        let outcome = match c.take(req).await {
            Ok(r) if r.get_ref().allowed => Outcome::Allowed,
            Ok(r) => {
                counts.wrong(&format!("a gRPC take was denied: {:?}", r.get_ref()));
                continue;
            }
            Err(s) if s.code() == tonic::Code::Unavailable && s.message().contains("shed") => {
                Outcome::Shed
            }
            Err(s) if s.code() == tonic::Code::Unavailable => {
                // The store failed, or the connection did: the script may have run.
                Outcome::Unknown
            }
            Err(s) => {
                counts.wrong(&format!("valid gRPC take answered {s:?}"));
                client = None;
                Outcome::Unknown
            }
        };
        counts.record(&keys, outcome);
    }
}

/// Sends `head` + `body` on a fresh connection; the first line of the answer.
async fn raw(addr: &str, head: String, body: Vec<u8>) -> String {
    let Ok(stream) = TcpStream::connect(addr).await else {
        return String::new();
    };
    let (mut rd, mut wr) = stream.into_split();
    let writer = tokio::spawn(async move {
        if wr.write_all(head.as_bytes()).await.is_ok() {
            let _ = wr.write_all(&body).await;
        }
        wr
    });
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match rd.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    drop(writer.await);
    let text = String::from_utf8_lossy(&got);
    text.lines().next().unwrap_or_default().to_string()
}

async fn hostile_task(args: Arc<Args>, counts: Arc<Counts>, deadline: Instant) {
    let h2 = reqwest::Client::builder()
        .http2_prior_knowledge()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let mut frame = vec![0u8];
    frame.extend_from_slice(&4_000_000u32.to_be_bytes());
    frame.extend(std::iter::repeat_n([0x0au8, 0x00], 2_000_000).flatten());
    let frame = axum::body::Bytes::from(frame);
    let huge_json = format!("{{\"buckets\":[{}{{}}]}}", "{},".repeat(86_999)).into_bytes();
    let seventeen = serde_json::to_vec(&json!({"buckets": (0..17).map(|i| json!({"key": format!("x{i}"), "capacity": 1, "period_ms": 1})).collect::<Vec<_>>()})).unwrap();
    let valid = serde_json::to_vec(&json_body(&args.prefix, &[0])).unwrap();
    let head = |auth: bool, len: usize| {
        format!(
            "POST /v1/take HTTP/1.1\r\nHost: s\r\n{}Content-Type: application/json\r\nContent-Length: {len}\r\n\r\n",
            if auth { format!("Authorization: Bearer {}\r\n", args.token) } else { String::new() }
        )
    };
    let mut n = 0u64;
    while Instant::now() < deadline {
        n += 1;
        let (what, got, want) = match n % 5 {
            0 => {
                let r = h2
                    .post(format!("http://{}/tollgate.v1.RateLimiter/Take", args.addr))
                    .header("content-type", "application/grpc")
                    .header("te", "trailers")
                    .bearer_auth(&args.token)
                    .body(frame.clone())
                    .send()
                    .await;
                let status = r
                    .ok()
                    .and_then(|r| r.headers().get("grpc-status").cloned())
                    .map(|v| v.to_str().unwrap_or_default().to_string())
                    .unwrap_or_default();
                ("4 MB gRPC", status, "8".to_string())
            }
            1 => (
                "87,000-bucket JSON",
                raw(&args.addr, head(true, huge_json.len()), huge_json.clone()).await,
                "HTTP/1.1 413 Payload Too Large".to_string(),
            ),
            2 => (
                "no token",
                raw(&args.addr, head(false, valid.len()), valid.clone()).await,
                "HTTP/1.1 401 Unauthorized".to_string(),
            ),
            3 => (
                "17 buckets",
                raw(&args.addr, head(true, seventeen.len()), seventeen.clone()).await,
                "HTTP/1.1 400 Bad Request".to_string(),
            ),
            _ => (
                "malformed",
                raw(&args.addr, head(true, 8), b"{\"bucket".to_vec()).await,
                "HTTP/1.1 400 Bad Request".to_string(),
            ),
        };
        counts.hostile.fetch_add(1, Ordering::Relaxed);
        if got != want {
            counts.wrong(&format!("{what}: {got:?}, expected {want:?}"));
        }
    }
}

/// Slow clients: connections that send a head and one byte of body, or nothing, and wait to be
/// cut; `n` of them at a time, re-opened as they are cut.
async fn slow_task(args: Arc<Args>, counts: Arc<Counts>, silent: bool, deadline: Instant) {
    while Instant::now() < deadline {
        let Ok(mut s) = TcpStream::connect(&args.addr).await else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        if !silent {
            let head = format!(
                "POST /v1/take HTTP/1.1\r\nHost: s\r\nAuthorization: Bearer {}\r\nContent-Length: 1000\r\n\r\n{{",
                args.token
            );
            let _ = s.write_all(head.as_bytes()).await;
        }
        let mut buf = [0u8; 1024];
        let mut got = Vec::new();
        let cut = tokio::time::timeout(Duration::from_secs(30), async {
            loop {
                match s.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => got.extend_from_slice(&buf[..n]),
                }
            }
        })
        .await;
        counts.hostile.fetch_add(1, Ordering::Relaxed);
        let first = String::from_utf8_lossy(&got)
            .lines()
            .next()
            .unwrap_or_default()
            .to_string();
        if cut.is_err() {
            counts.wrong("a slow connection was not cut within 30 s");
        } else if !silent && !first.starts_with("HTTP/1.1 408") {
            counts.wrong(&format!("slow body answered {first:?}"));
        }
    }
}

fn rss_kb(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS"), field("VmHWM"))
}

/// The bucket's charged tokens, read with one more take of cost 1.
async fn charged(args: &Args, k: usize) -> Option<u64> {
    let client = reqwest::Client::new();
    for _ in 0..50 {
        let r = client
            .post(format!("http://{}/v1/take", args.addr))
            .bearer_auth(&args.token)
            .json(&json_body(&args.prefix, &[k]))
            .send()
            .await;
        if let Ok(r) = r {
            if r.status() == 200 {
                let v: Value = r.json().await.ok()?;
                let remaining = v["buckets"][0]["remaining"].as_u64()?;
                return Some(CAP - remaining - 1);
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    None
}

#[tokio::main]
async fn main() {
    let args = Arc::new(parse());
    let counts = Arc::new(Counts::new());
    let start = Instant::now();
    let deadline = start + Duration::from_secs(args.seconds);
    let mut tasks = Vec::new();
    for t in 0..args.json_tasks {
        tasks.push(tokio::spawn(json_task(
            args.clone(),
            counts.clone(),
            t,
            deadline,
        )));
    }
    for t in 0..args.grpc_tasks {
        tasks.push(tokio::spawn(grpc_task(
            args.clone(),
            counts.clone(),
            t,
            deadline,
        )));
    }
    tasks.push(tokio::spawn(hostile_task(
        args.clone(),
        counts.clone(),
        deadline,
    )));
    for i in 0..12 {
        tasks.push(tokio::spawn(slow_task(
            args.clone(),
            counts.clone(),
            i % 3 == 0,
            deadline,
        )));
    }
    let mut csv = std::fs::File::create(&args.out).expect("--out");
    writeln!(
        csv,
        "seconds,vmrss_kb,vmhwm_kb,valid_allowed,valid_unknown,shed,hostile,wrong"
    )
    .unwrap();
    let mut samples = Vec::new();
    while Instant::now() < deadline {
        tokio::time::sleep(Duration::from_secs(5)).await;
        let (rss, hwm) = rss_kb(args.pid);
        let s = start.elapsed().as_secs();
        let line = format!(
            "{s},{rss},{hwm},{},{},{},{},{}",
            counts.valid_ok.load(Ordering::Relaxed),
            counts.valid_unavailable.load(Ordering::Relaxed),
            counts.shed.load(Ordering::Relaxed),
            counts.hostile.load(Ordering::Relaxed),
            counts.wrong.load(Ordering::Relaxed)
        );
        writeln!(csv, "{line}").unwrap();
        if s % 60 < 5 {
            eprintln!("soak: {line}");
        }
        samples.push((s, rss));
    }
    for t in tasks {
        let _ = t.await;
    }
    let secs = start.elapsed().as_secs_f64();
    let ok = counts.valid_ok.load(Ordering::Relaxed);
    let mut failed = counts.wrong.load(Ordering::Relaxed) > 0;
    println!(
        "soak: {secs:.0} s, {ok} valid takes allowed ({:.0}/s), {} unknown (store unavailable), {} shed, {} hostile requests, {} wrong answers",
        ok as f64 / secs,
        counts.valid_unavailable.load(Ordering::Relaxed),
        counts.shed.load(Ordering::Relaxed),
        counts.hostile.load(Ordering::Relaxed),
        counts.wrong.load(Ordering::Relaxed)
    );
    let minute = |from: u64, to: u64| {
        let v: Vec<u64> = samples
            .iter()
            .filter(|(s, _)| (from..to).contains(s))
            .map(|(_, r)| *r)
            .collect();
        v.iter().sum::<u64>() / v.len().max(1) as u64
    };
    let last = samples.last().map(|(s, _)| *s).unwrap_or(0);
    let max = samples.iter().map(|(_, r)| *r).max().unwrap_or(0);
    println!(
        "soak: VmRSS mean of the 2nd minute {} kB, of the last minute {} kB, max {} kB, VmHWM {} kB",
        minute(60, 120),
        minute(last.saturating_sub(60), last + 1),
        max,
        rss_kb(args.pid).1
    );
    for k in 0..KEYS {
        let allowed = counts.allowed[k].load(Ordering::Relaxed);
        let unknown = counts.unknown[k].load(Ordering::Relaxed);
        let got = charged(&args, k).await;
        let fine = got.is_some_and(|c| allowed <= c && c <= allowed + unknown);
        println!(
            "soak: bucket {k}: answered allowed {allowed}, unknown {unknown}, charged in Redis {} -> {}",
            got.map(|c| c.to_string()).unwrap_or_else(|| "?".into()),
            if fine { "ok" } else { "LOST OR DOUBLED" }
        );
        failed |= !fine;
    }
    if failed {
        std::process::exit(1);
    }
}
