//! A small load generator for the decision service (used by scripts/bench-service.sh).
//!
//! `cargo run --release -p tollgate-server --example loadgen -- --addr 127.0.0.1:8081 --mode grpc
//! --connections 4 --concurrency 32 --seconds 5`
//!
//! Modes: `grpc` (tonic, HTTP/2), `stream` (`TakeStream`: each task keeps one stream open on its
//! connection and sends one batch message at a time, as a proxy's worker does), `h2` (JSON over
//! HTTP/2 prior knowledge), `h1` (JSON over HTTP/1.1, one request in flight per connection). Every
//! request takes 1 token from one bucket that never runs dry, so each one runs the full script and
//! writes. `--batch N` (N > 1) sends N such takes per call or message instead (`TakeBatch`,
//! `POST /v1/take_batch`; a stream's messages are batches of 1 by default). Prints decisions/s and the
//! latency percentiles of a call. Loopback only; bounded in time (at most 120 s) and count.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tollgate_server::api::grpc::pb;

struct Args {
    addr: SocketAddr,
    mode: String,
    connections: usize,
    concurrency: usize,
    seconds: u64,
    max_requests: u64,
    key: String,
    batch: usize,
}

fn parse() -> Args {
    let mut a = Args {
        addr: "127.0.0.1:8081".parse().unwrap(),
        mode: "grpc".into(),
        connections: 4,
        concurrency: 32,
        seconds: 5,
        max_requests: 5_000_000,
        key: "bench".into(),
        batch: 1,
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut it = argv.iter();
    while let Some(flag) = it.next() {
        let v = it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--addr" => a.addr = v.parse().expect("--addr host:port"),
            "--mode" => a.mode = v.clone(),
            "--connections" => a.connections = v.parse().expect("number"),
            "--concurrency" => a.concurrency = v.parse().expect("number"),
            "--seconds" => a.seconds = v.parse().expect("number"),
            "--max-requests" => a.max_requests = v.parse().expect("number"),
            "--key" => a.key = v.clone(),
            "--batch" => a.batch = v.parse().expect("number"),
            _ => panic!("unknown flag {flag}"),
        }
    }
    assert!(a.addr.ip().is_loopback(), "loopback addresses only");
    a.seconds = a.seconds.clamp(1, 120);
    a.connections = a.connections.clamp(1, a.concurrency.max(1));
    a.batch = a.batch.clamp(1, 64);
    a
}

type Client = pb::rate_limiter_client::RateLimiterClient<tonic::transport::Channel>;

/// A `TakeStream` stream on `g`'s connection: where its messages go, and its answers.
async fn open_stream(
    mut g: Client,
) -> (
    tokio::sync::mpsc::UnboundedSender<pb::TakeBatchRequest>,
    tonic::Streaming<pb::TakeBatchResponse>,
) {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let messages =
        futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) });
    let answers = g.take_stream(messages).await.expect("TakeStream");
    (tx, answers.into_inner())
}

/// Capacity and rate so high that the bucket never runs dry during a run.
const CAP: u64 = 1_000_000_000;

#[tokio::main]
async fn main() {
    let args = Arc::new(parse());
    let deadline = Instant::now() + Duration::from_secs(args.seconds);
    let per_task_max = args.max_requests / args.concurrency as u64 + 1;
    let take = serde_json::json!({"buckets": [{"key": args.key, "capacity": CAP, "rate": CAP, "period_ms": 1000, "cost": 1}]});
    let (body, url) = if args.batch > 1 {
        let takes = vec![take; args.batch];
        (
            serde_json::json!({ "takes": takes }),
            format!("http://{}/v1/take_batch", args.addr),
        )
    } else {
        (take, format!("http://{}/v1/take", args.addr))
    };
    let body = Arc::new(serde_json::to_vec(&body).unwrap());

    let mut grpc_clients = Vec::new();
    let mut http_clients = Vec::new();
    for _ in 0..args.connections {
        match args.mode.as_str() {
            "grpc" | "stream" => grpc_clients.push(
                pb::rate_limiter_client::RateLimiterClient::connect(format!(
                    "http://{}",
                    args.addr
                ))
                .await
                .expect("connect"),
            ),
            "h2" => http_clients.push(
                reqwest::Client::builder()
                    .http2_prior_knowledge()
                    .build()
                    .unwrap(),
            ),
            "h1" => {}
            m => panic!("unknown mode {m}"),
        }
    }

    let start = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..args.concurrency {
        let (args, body, url) = (args.clone(), body.clone(), url.clone());
        let grpc = grpc_clients.get(i % args.connections.max(1)).cloned();
        let http = match args.mode.as_str() {
            // One connection per task: HTTP/1.1 has one request in flight per connection.
            "h1" => Some(reqwest::Client::builder().http1_only().build().unwrap()),
            _ => http_clients.get(i % args.connections.max(1)).cloned(),
        };
        tasks.push(tokio::spawn(async move {
            let mut stream = match &grpc {
                Some(g) if args.mode == "stream" => Some(open_stream(g.clone()).await),
                _ => None,
            };
            let mut lat = Vec::with_capacity(100_000);
            let mut errors = 0u64;
            let mut n = 0;
            while Instant::now() < deadline && n < per_task_max {
                n += 1;
                let t = Instant::now();
                let ok = if let Some(mut g) = grpc.clone() {
                    let take = pb::TakeRequest {
                        buckets: vec![pb::Bucket {
                            key: args.key.clone(),
                            capacity: CAP,
                            rate: Some(CAP),
                            period_ms: 1000,
                            cost: Some(1),
                            algorithm: 0,
                            lease: None,
                            ..Default::default()
                        }],
                        ..Default::default()
                    };
                    if let Some((tx, answers)) = &mut stream {
                        let req = pb::TakeBatchRequest {
                            takes: vec![take; args.batch],
                            ..Default::default()
                        };
                        tx.send(req).is_ok()
                            && matches!(answers.message().await, Ok(Some(r)) if r.results.iter().all(|t| t.allowed))
                    } else if args.batch > 1 {
                        let req = pb::TakeBatchRequest {
                            takes: vec![take; args.batch],
                            ..Default::default()
                        };
                        matches!(g.take_batch(req).await, Ok(r) if r.get_ref().results.iter().all(|t| t.allowed))
                    } else {
                        matches!(g.take(take).await, Ok(r) if r.get_ref().allowed)
                    }
                } else if let Some(h) = &http {
                    match h
                        .post(&url)
                        .header("content-type", "application/json")
                        .body(body.as_ref().clone())
                        .send()
                        .await
                    {
                        Ok(r) if r.status() == 200 => r.bytes().await.is_ok(),
                        _ => false,
                    }
                } else {
                    false
                };
                if ok {
                    lat.push(t.elapsed().as_micros() as u32);
                } else {
                    errors += 1;
                }
            }
            (lat, errors)
        }));
    }
    let mut all = Vec::new();
    let mut errors = 0;
    for t in tasks {
        let (l, e) = t.await.unwrap();
        all.extend(l);
        errors += e;
    }
    let elapsed = start.elapsed().as_secs_f64();
    let decisions = all.len() * args.batch;
    all.sort_unstable();
    let pct = |p: f64| -> f64 {
        if all.is_empty() {
            return 0.0;
        }
        let i = ((all.len() as f64 - 1.0) * p).round() as usize;
        all[i] as f64 / 1000.0
    };
    println!(
        "mode={} connections={} concurrency={} seconds={:.2} decisions={} errors={} decisions_per_s={:.0} p50_ms={:.3} p99_ms={:.3} batch={}",
        args.mode,
        args.connections,
        args.concurrency,
        elapsed,
        decisions,
        errors,
        decisions as f64 / elapsed,
        pct(0.50),
        pct(0.99),
        args.batch
    );
}
