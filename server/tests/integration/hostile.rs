//! Hostile clients against the real binary: oversized bodies answered with the bound in constant
//! memory, a slowloris that cannot freeze the service, load shed at once at the take limit, a
//! full memory store answering clearly, and a thousand `TakeStream` streams holding messages not
//! yet whole within the service's budget. Figures are printed (`--nocapture` shows them).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use std::time::{Duration, Instant};

use common::binary::ServerProc;
use common::RedisProc;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tollgate_server::domain::MAX_TAKE_BYTES;

const TOKEN: &str = "hostile-test-token-7e1c9a3f5b0d2e4c6a8f";

fn take_body(key: &str) -> Value {
    json!({"buckets": [{"key": key, "capacity": 1000000, "period_ms": 1000}]})
}

/// Sends `head` then `body` on a raw connection (write errors ignored: the server may close
/// early) and returns everything it answered before closing, and how long the answer took.
async fn raw_exchange(addr: &str, head: String, body: Vec<u8>) -> (String, Duration) {
    let t = Instant::now();
    let stream = TcpStream::connect(addr).await.unwrap();
    let (mut rd, mut wr) = stream.into_split();
    let writer = tokio::spawn(async move {
        if wr.write_all(head.as_bytes()).await.is_ok() {
            for chunk in body.chunks(16 * 1024) {
                if wr.write_all(chunk).await.is_err() {
                    break;
                }
            }
        }
        wr
    });
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let read = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            match rd.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    assert!(read.is_ok(), "no answer within 20 s");
    let elapsed = t.elapsed();
    drop(writer.await);
    (String::from_utf8_lossy(&got).into_owned(), elapsed)
}

/// 16 concurrent gRPC takes of 4 MB (2,000,000 empty buckets) and 16 concurrent JSON takes of
/// 87,000 `{}` buckets (half with a Content-Length, half chunked), all with the token: every one
/// is answered with the bound, and the service's peak RSS grows by less than 32 MB. Without the
/// token the same bodies get 401 before a byte of them is read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_bodies_are_refused_with_the_bound_in_constant_memory() {
    let svc = ServerProc::start(&["--token", TOKEN]);
    let client = reqwest::Client::new();
    let h2 = reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .unwrap();
    // Warm up both transports once, then take the baseline.
    let r = client
        .post(svc.url("/v1/take"))
        .bearer_auth(TOKEN)
        .json(&take_body("warm"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let mut grpc = common::grpc_client(&svc.url("")).await;
    let mut req = tonic::Request::new(tollgate_server::api::grpc::pb::TakeRequest {
        buckets: vec![common::pb_bucket("warm")],
        ..Default::default()
    });
    req.metadata_mut()
        .insert("authorization", format!("Bearer {TOKEN}").parse().unwrap());
    grpc.take(req).await.unwrap();
    let rss_before = svc.status_kb("VmRSS");

    // gRPC: one frame holding `0a 00` two million times.
    let mut frame = vec![0u8];
    frame.extend_from_slice(&4_000_000u32.to_be_bytes());
    frame.extend(std::iter::repeat_n([0x0au8, 0x00], 2_000_000).flatten());
    let frame = axum::body::Bytes::from(frame);
    // JSON: 87,000 empty buckets, about 256 KiB.
    let json_body = format!("{{\"buckets\":[{}{{}}]}}", "{},".repeat(86_999));
    assert!(json_body.len() > 256 * 1000, "{}", json_body.len());

    let mut tasks = Vec::new();
    for i in 0..16 {
        let (h2, url, frame) = (
            h2.clone(),
            svc.url("/tollgate.v1.RateLimiter/Take"),
            frame.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let r = h2
                .post(url)
                .header("content-type", "application/grpc")
                .header("te", "trailers")
                .bearer_auth(TOKEN)
                .body(frame)
                .send()
                .await
                .unwrap();
            let status = r.headers().get("grpc-status").cloned();
            let message = r.headers().get("grpc-message").cloned();
            assert_eq!(
                status.as_ref().map(|v| v.to_str().unwrap()),
                Some("8"),
                "gRPC #{i}: RESOURCE_EXHAUSTED expected, got {:?}",
                r.headers()
            );
            let bound = MAX_TAKE_BYTES.to_string();
            let message = message.map(|m| m.to_str().unwrap().to_string()).unwrap();
            assert!(message.contains(&bound), "gRPC #{i}: {message}");
        }));
        let (addr, body) = (svc.addr(), json_body.clone());
        tasks.push(tokio::spawn(async move {
            let framing = if i % 2 == 0 {
                format!("Content-Length: {}\r\n", body.len())
            } else {
                "Transfer-Encoding: chunked\r\n".to_string()
            };
            let payload = if i % 2 == 0 {
                body.into_bytes()
            } else {
                let mut p = Vec::new();
                for c in body.as_bytes().chunks(8192) {
                    p.extend_from_slice(format!("{:x}\r\n", c.len()).as_bytes());
                    p.extend_from_slice(c);
                    p.extend_from_slice(b"\r\n");
                }
                p.extend_from_slice(b"0\r\n\r\n");
                p
            };
            let head = format!(
                "POST /v1/take HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {TOKEN}\r\n\
                 Content-Type: application/json\r\n{framing}\r\n"
            );
            let (answer, _) = raw_exchange(&addr, head, payload).await;
            let bound = MAX_TAKE_BYTES.to_string();
            assert!(answer.starts_with("HTTP/1.1 413"), "JSON #{i}: {answer}");
            assert!(answer.contains("resource_exhausted"), "JSON #{i}: {answer}");
            assert!(answer.contains(&bound), "JSON #{i}: {answer}");
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let peak = svc.status_kb("VmHWM");
    let rss_after = svc.status_kb("VmRSS");
    eprintln!(
        "oversized bodies: VmRSS before {rss_before} kB, VmHWM after {peak} kB (growth {} kB), VmRSS after {rss_after} kB",
        peak.saturating_sub(rss_before)
    );
    assert!(
        peak.saturating_sub(rss_before) < 32 * 1024,
        "peak RSS grew by {} kB",
        peak - rss_before
    );

    // Without the token: 401, the body unread.
    let (answer, t) = raw_exchange(
        &svc.addr(),
        format!(
            "POST /v1/take HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n",
            json_body.len()
        ),
        json_body.into_bytes(),
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 401"), "{answer}");
    eprintln!("unauthenticated oversized JSON: 401 in {t:?}");
    let r = h2
        .post(svc.url("/tollgate.v1.RateLimiter/Take"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(frame)
        .send()
        .await
        .unwrap();
    assert_eq!(
        r.headers().get("grpc-status").map(|v| v.to_str().unwrap()),
        Some("16"),
        "{:?}",
        r.headers()
    );
    // Still serving.
    let r = client
        .post(svc.url("/v1/take"))
        .bearer_auth(TOKEN)
        .json(&take_body("after"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
}

/// The median of some durations.
fn median(mut d: Vec<Duration>) -> Duration {
    d.sort();
    d[d.len() / 2]
}

/// `--max-in-flight 64` and 74 connections that send a take's head with `Content-Length: 1000`
/// and one byte of body, plus 10 that send half a head, then wait. Meanwhile /healthz and a real
/// take on fresh connections answer at once; each slow body is cut with 408 at the body timeout,
/// each slow head at the header timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slowloris_cannot_hold_the_service() {
    let (body_ms, header_ms) = (2000u64, 3000u64);
    let svc = ServerProc::start(&[
        "--token",
        TOKEN,
        "--max-in-flight",
        "64",
        "--body-timeout-ms",
        &body_ms.to_string(),
        "--header-timeout-ms",
        &header_ms.to_string(),
    ]);
    let slow_bodies = 64 + 10;
    let start = Instant::now();
    let mut slow = Vec::new();
    for _ in 0..slow_bodies {
        let mut s = TcpStream::connect(svc.addr()).await.unwrap();
        s.write_all(
            format!(
                "POST /v1/take HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {TOKEN}\r\n\
                 Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{{"
            )
            .as_bytes(),
        )
        .await
        .unwrap();
        slow.push((true, s));
    }
    for _ in 0..10 {
        let mut s = TcpStream::connect(svc.addr()).await.unwrap();
        s.write_all(b"POST /v1/take HTTP/1.1\r\nHost: t\r\nContent-")
            .await
            .unwrap();
        slow.push((false, s));
    }
    let opened = start.elapsed();
    // Each slow connection: when was it answered or closed, and with what.
    let watchers: Vec<_> = slow
        .into_iter()
        .map(|(body, mut s)| {
            tokio::spawn(async move {
                let mut got = Vec::new();
                let mut buf = [0u8; 1024];
                loop {
                    match tokio::time::timeout(Duration::from_secs(15), s.read(&mut buf)).await {
                        Ok(Ok(0)) | Ok(Err(_)) => break,
                        Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
                        Err(_) => panic!("a slow connection was still open after 15 s"),
                    }
                }
                (
                    body,
                    start.elapsed(),
                    String::from_utf8_lossy(&got).into_owned(),
                )
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(100)).await;

    let mut health = Vec::new();
    let mut takes = Vec::new();
    for i in 0..7 {
        // A fresh client each time: a new connection, as a probe makes.
        let client = reqwest::Client::new();
        let t = Instant::now();
        let r = client.get(svc.url("/healthz")).send().await.unwrap();
        assert_eq!(r.status(), 200);
        health.push(t.elapsed());
        let client = reqwest::Client::new();
        let t = Instant::now();
        let r = client
            .post(svc.url("/v1/take"))
            .bearer_auth(TOKEN)
            .json(&take_body(&format!("real-{i}")))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["allowed"], true, "{v}");
        takes.push(t.elapsed());
    }
    assert!(
        start.elapsed() < Duration::from_millis(body_ms),
        "the probes ran past the body timeout ({:?}): the test proves nothing",
        start.elapsed()
    );
    eprintln!(
        "slowloris ({slow_bodies} slow bodies + 10 slow heads, opened in {opened:?}): /healthz {health:?}, take {takes:?}"
    );
    let (h, t) = (median(health.clone()), median(takes.clone()));
    assert!(h < Duration::from_millis(100), "/healthz median {h:?}");
    assert!(t < Duration::from_millis(100), "take median {t:?}");

    let mut body_cuts = Vec::new();
    let mut head_cuts = Vec::new();
    for w in watchers {
        let (body, at, answer) = w.await.unwrap();
        if body {
            assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
            assert!(answer.contains("deadline_exceeded"), "{answer}");
            body_cuts.push(at);
        } else {
            head_cuts.push(at);
        }
    }
    let range = |v: &[Duration]| (v.iter().min().copied(), v.iter().max().copied());
    eprintln!(
        "slow bodies cut at {:?}, slow heads at {:?} (since the first connect)",
        range(&body_cuts),
        range(&head_cuts)
    );
    // Cut at the timeout: not before it, and not long after (a generous margin for a loaded
    // machine, plus the time it took to open them all).
    let late = Duration::from_millis(1500) + opened;
    for at in &body_cuts {
        assert!(*at >= Duration::from_millis(body_ms), "{at:?}");
        assert!(*at < Duration::from_millis(body_ms) + late, "{at:?}");
    }
    for at in &head_cuts {
        assert!(*at >= Duration::from_millis(header_ms), "{at:?}");
        assert!(*at < Duration::from_millis(header_ms) + late, "{at:?}");
    }
}

/// `--max-in-flight 1` and a take stuck on a Redis that sleeps: the next takes (JSON and gRPC)
/// are shed at once with 503 / UNAVAILABLE and counted, while /healthz and /metrics answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn takes_beyond_the_limit_are_shed_at_once() {
    let redis = RedisProc::start_on(common::free_port(), &["--enable-debug-command", "yes"]);
    let svc = ServerProc::start(&[
        "--redis-url",
        &redis.url(),
        "--redis-timeout-ms",
        "5000",
        "--max-in-flight",
        "1",
    ]);
    let client = reqwest::Client::new();
    let r = client
        .post(svc.url("/v1/take"))
        .json(&take_body("warm"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    // Redis busy for 1.5 s: the next take holds the only permit that long.
    let port = redis.port.to_string();
    let sleeper = std::thread::spawn(move || {
        std::process::Command::new(common::redis_cli_bin())
            .args(["-p", &port, "DEBUG", "SLEEP", "1.5"])
            .output()
            .unwrap()
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let stuck = tokio::spawn({
        let (client, url) = (client.clone(), svc.url("/v1/take"));
        async move {
            client
                .post(url)
                .json(&take_body("stuck"))
                .send()
                .await
                .unwrap()
                .status()
        }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let t = Instant::now();
    let r = client
        .post(svc.url("/v1/take"))
        .json(&take_body("shed"))
        .send()
        .await
        .unwrap();
    let shed_in = t.elapsed();
    assert_eq!(r.status(), 503);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "unavailable", "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("shed"),
        "{v}"
    );
    let mut g = common::grpc_client(&svc.url("")).await;
    let t = Instant::now();
    let e = g
        .take(tollgate_server::api::grpc::pb::TakeRequest {
            buckets: vec![common::pb_bucket("shed")],
            ..Default::default()
        })
        .await
        .expect_err("shed");
    let grpc_shed_in = t.elapsed();
    assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
    let t = Instant::now();
    assert_eq!(
        client
            .get(svc.url("/healthz"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    let health_in = t.elapsed();
    let metrics = common::get_text(svc.url("/metrics")).await;
    assert!(metrics.contains("tollgate_shed_total 2"), "{metrics}");
    eprintln!(
        "shedding: JSON 503 in {shed_in:?}, gRPC UNAVAILABLE in {grpc_shed_in:?}, /healthz in {health_in:?} while a take held the only permit"
    );
    assert!(shed_in < Duration::from_millis(500), "{shed_in:?}");
    assert!(
        grpc_shed_in < Duration::from_millis(500),
        "{grpc_shed_in:?}"
    );
    assert_eq!(stuck.await.unwrap(), 200, "the stuck take was answered");
    sleeper.join().unwrap();
}

/// `--memory-max-buckets 2`: a take needing a third bucket gets 503 saying the store is full;
/// known buckets keep answering.
#[tokio::test]
async fn a_full_memory_store_says_so() {
    let svc = ServerProc::start(&["--memory-max-buckets", "2"]);
    let client = reqwest::Client::new();
    for key in ["a", "b"] {
        let r = client
            .post(svc.url("/v1/take"))
            .json(&take_body(key))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    let r = client
        .post(svc.url("/v1/take"))
        .json(&take_body("c"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "unavailable", "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("full"),
        "{v}"
    );
    let r = client
        .post(svc.url("/v1/take"))
        .json(&take_body("a"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let metrics = common::get_text(svc.url("/metrics")).await;
    assert!(
        metrics.contains("tollgate_store_errors_total{kind=\"full\"} 1"),
        "{metrics}"
    );
}

/// Reads until the peer closes (or 10 s pass); returns what came and when it closed.
async fn until_closed(s: &mut TcpStream, since: Instant) -> (String, Duration) {
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    loop {
        match tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => break,
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
            Err(_) => panic!("still open after 10 s"),
        }
    }
    (String::from_utf8_lossy(&got).into_owned(), since.elapsed())
}

/// `--max-connections 4`: a fifth connection is closed on accept and counted; a connection
/// idle for `--idle-timeout-ms` is closed, one that never sends a request is closed at
/// `--header-timeout-ms`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_are_capped_and_idle_ones_closed() {
    let svc = ServerProc::start(&[
        "--max-connections",
        "4",
        "--idle-timeout-ms",
        "500",
        "--header-timeout-ms",
        "3000",
    ]);
    // Four silent connections fill the cap.
    let t0 = Instant::now();
    let mut silent = Vec::new();
    for _ in 0..4 {
        silent.push(TcpStream::connect(svc.addr()).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut fifth = TcpStream::connect(svc.addr()).await.unwrap();
    let t = Instant::now();
    let _ = fifth
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
        .await;
    let (answer, closed_in) = until_closed(&mut fifth, t).await;
    assert_eq!(answer, "", "the fifth connection was served");
    assert!(closed_in < Duration::from_millis(500), "{closed_in:?}");
    // The silent ones are closed at the header timeout, freeing their slots.
    for s in &mut silent {
        let (answer, at) = until_closed(s, t0).await;
        assert_eq!(answer, "");
        assert!(
            at >= Duration::from_millis(3000) && at < Duration::from_millis(5000),
            "{at:?}"
        );
    }
    // An idle keep-alive connection is closed after the idle timeout.
    let mut s = TcpStream::connect(svc.addr()).await.unwrap();
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 1024];
    let n = s.read(&mut buf).await.unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    let (rest, idle_closed) = until_closed(&mut s, Instant::now()).await;
    assert_eq!(rest, "");
    assert!(
        idle_closed >= Duration::from_millis(400) && idle_closed < Duration::from_millis(2500),
        "{idle_closed:?}"
    );
    // HTTP/2: an idle connection is closed with GOAWAY, so a client just opens another one.
    let h2 = reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .unwrap();
    for _ in 0..2 {
        let r = h2.get(svc.url("/healthz")).send().await.unwrap();
        assert_eq!(r.status(), 200);
        tokio::time::sleep(Duration::from_millis(900)).await;
    }
    eprintln!(
        "connection cap: 5th closed in {closed_in:?}; idle keep-alive closed after {idle_closed:?}"
    );
    let metrics = common::get_text(svc.url("/metrics")).await;
    assert!(
        metrics.contains("tollgate_connections_refused_total 1"),
        "{metrics}"
    );
}

/// 1,000 `TakeStream` streams over 8 connections (125 each, within `--http2-max-streams`), each
/// announcing a message of a million bytes, sending 128 KiB of it at once and then a byte every
/// 100 ms, and opened again a second after the service ended it, for 6 s. Meanwhile a normal
/// client asks one message at a time on a stream of its own, and a real Envoy with the filter
/// (two workers, each on its stream; `timeout_ms` 250: the service here is a debug build sharing
/// two cores with the attack) asks for every request sent to it. With `--stream-buffer-bytes` 16 MiB,
/// the service's RSS stays within 80 MiB of its baseline: the budget, plus 64 MiB for the 1,000
/// streams' own state (about 20 KiB each: 18 to 22 MB measured with streams that send a prefix
/// alone), HTTP/2's windows (1 MiB a connection) and what the allocator keeps of freed buffers.
/// Without the budget the streams would hold 128 MB of partial messages. Every one of the normal
/// client's messages is answered, none refused for the bytes other streams hold, and every
/// request through Envoy is decided by the service (allowed, no failed take, nothing decided by
/// the fallback).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_holding_partial_messages_cannot_bloat_the_service() {
    use common::h2_stream::{self, H2Stream};
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;
    use tollgate_server::api::grpc::pb;

    const BUDGET: u64 = 16 * 1024 * 1024;
    const MARGIN_KB: u64 = 64 * 1024;
    const CONNECTIONS: usize = 8;
    const STREAMS: usize = 1000;
    const ATTACK: Duration = Duration::from_secs(6);
    let svc = ServerProc::start(&["--stream-buffer-bytes", &BUDGET.to_string()]);
    let plugin = tollgate_testkit::plugin::Plugin::new("grpc", 250)
        .rule(r#"{"name": "all", "key": ["literal:through-envoy"], "capacity": 1000000, "period_ms": 1000}"#)
        .failure_mode("fallback")
        .json();
    let envoy = common::envoy::EnvoyProc::start(&plugin, svc.port).await;
    let web = reqwest::Client::new();
    let through_envoy = async || {
        let r = web.get(envoy.url("/")).send().await.unwrap();
        assert_eq!(r.status(), 200, "{:?}", r.headers());
    };
    through_envoy().await;

    // The normal client: the generated one, its messages sent through a channel.
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<pb::TakeBatchRequest>();
    let outgoing =
        futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) });
    let mut grpc = common::grpc_client(&svc.url("")).await;
    let mut answers = grpc.take_stream(outgoing).await.unwrap().into_inner();
    let message = |id: u64| pb::TakeBatchRequest {
        takes: vec![pb::TakeRequest {
            buckets: vec![pb::Bucket {
                capacity: 1_000_000,
                ..common::pb_bucket(&format!("normal-{}", id % 10))
            }],
            ..Default::default()
        }],
        id,
        ..Default::default()
    };
    let mut id = 0u64;
    let mut ask = async || -> Duration {
        id += 1;
        let t = Instant::now();
        tx.send(message(id)).unwrap();
        let a = tokio::time::timeout(Duration::from_secs(5), answers.message())
            .await
            .expect("an answer within 5 s")
            .expect("the stream goes on")
            .expect("an answer");
        assert_eq!(a.id, id, "{a:?}");
        assert!(a.error.is_none() && a.results[0].allowed, "{a:?}");
        t.elapsed()
    };
    for _ in 0..20 {
        ask().await;
    }
    let baseline = svc.status_kb("VmRSS");

    // RSS sampled every 25 ms; the attack stops early once it is past the bound.
    let bound_kb = baseline + BUDGET / 1024 + MARGIN_KB;
    let stop = Arc::new(AtomicBool::new(false));
    let peak = Arc::new(AtomicU64::new(baseline));
    let sampler = std::thread::spawn({
        let (stop, peak, pid) = (stop.clone(), peak.clone(), svc.pid());
        move || {
            while !stop.load(Ordering::Relaxed) {
                let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
                let rss: u64 = status
                    .lines()
                    .find_map(|l| l.strip_prefix("VmRSS:"))
                    .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
                    .unwrap();
                peak.fetch_max(rss, Ordering::Relaxed);
                if rss > bound_kb {
                    stop.store(true, Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_millis(25));
            }
        }
    });

    let mut conns = Vec::new();
    for _ in 0..CONNECTIONS {
        conns.push(h2_stream::connect(&svc.addr()).await);
    }
    let bulk = axum::body::Bytes::from(vec![0x0a; 128 * 1024 - 5]);
    let started = Instant::now();
    let opened = Arc::new(AtomicU64::new(0));
    let mut hostile = Vec::new();
    for i in 0..STREAMS {
        let (conn, bulk, stop, opened) = (
            conns[i % CONNECTIONS].clone(),
            bulk.clone(),
            stop.clone(),
            opened.clone(),
        );
        hostile.push(tokio::spawn(async move {
            let mut endings: Vec<tonic::Code> = Vec::new();
            while started.elapsed() < ATTACK && !stop.load(Ordering::Relaxed) {
                let Ok(mut s) = H2Stream::open(&conn, None).await else {
                    break;
                };
                opened.fetch_add(1, Ordering::Relaxed);
                if s.send(h2_stream::prefix(1_000_000)).is_err() || s.send(bulk.clone()).is_err() {
                    continue;
                }
                let mut tick = tokio::time::interval(Duration::from_millis(100));
                loop {
                    tokio::select! {
                        end = s.next() => {
                            match end {
                                Err(status) => endings.push(status.code()),
                                Ok(answer) => panic!("a partial message was answered: {answer:?}"),
                            }
                            break;
                        }
                        _ = tick.tick() => {
                            let trickle = axum::body::Bytes::from_static(&[0x0a]);
                            if stop.load(Ordering::Relaxed) || s.send(trickle).is_err() {
                                break;
                            }
                        }
                    }
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            endings
        }));
    }

    let mut latencies = Vec::new();
    let allowed_before = envoy.counter("allowed").await;
    let mut sent_through_envoy = 0;
    while started.elapsed() < ATTACK && !stop.load(Ordering::Relaxed) {
        latencies.push(ask().await);
        through_envoy().await;
        sent_through_envoy += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let decided_by_service = envoy.counter("allowed").await - allowed_before;
    let mut endings: Vec<tonic::Code> = Vec::new();
    for h in hostile {
        endings.extend(h.await.unwrap());
    }
    let held_to_the_end = stop.load(Ordering::Relaxed);
    stop.store(true, Ordering::Relaxed);
    sampler.join().unwrap();
    let peak = peak.load(Ordering::Relaxed);
    let hwm = svc.status_kb("VmHWM");
    let m = common::get_text(svc.url("/metrics")).await;
    let count = |code| endings.iter().filter(|c| **c == code).count();
    let refusals: Vec<&str> = m
        .lines()
        .filter(|l| l.starts_with("tollgate_stream_refusals_total"))
        .collect();
    latencies.sort();
    let at = |q: f64| latencies[((latencies.len() - 1) as f64 * q) as usize];
    eprintln!(
        "hostile streams: {} opened over {CONNECTIONS} connections in {:?} ({STREAMS} at once), ended UNAVAILABLE {}, DEADLINE_EXCEEDED {}, other {}; {refusals:?}",
        opened.load(Ordering::Relaxed),
        started.elapsed(),
        count(tonic::Code::Unavailable),
        count(tonic::Code::DeadlineExceeded),
        endings.len() - count(tonic::Code::Unavailable) - count(tonic::Code::DeadlineExceeded),
    );
    eprintln!(
        "VmRSS baseline {baseline} kB, peak {peak} kB (growth {} kB, bound {} kB), VmHWM {hwm} kB",
        peak - baseline,
        bound_kb - baseline
    );
    eprintln!(
        "normal client meanwhile: {} messages, latency median {:?}, p99 {:?}, max {:?}",
        latencies.len(),
        at(0.5),
        at(0.99),
        at(1.0)
    );
    assert!(
        !held_to_the_end && peak <= bound_kb,
        "VmRSS grew by {} kB, past {} kB",
        peak - baseline,
        bound_kb - baseline
    );
    // Each answered within 5 s (`ask`); the machine's load, not the streams' bounds, sets the
    // latency (1,000 streams pumping bytes into a debug build).
    assert!(latencies.len() >= 10, "{} normal messages", latencies.len());
    assert!(at(0.5) < Duration::from_secs(1), "median {:?}", at(0.5));
    for reason in ["buffer", "deadline"] {
        assert!(
            refusals
                .iter()
                .any(|l| l.contains(&format!("reason=\"{reason}\"")) && !l.ends_with(" 0")),
            "no {reason} refusal: {refusals:?}"
        );
    }
    // The proxy beside the attack: each of its requests decided by the service.
    let mut failures = Vec::new();
    for c in [
        "callout_failure.timeout",
        "callout_failure.grpc_status",
        "callout_failure.reset",
        "fallback.allowed",
        "fallback.limited",
        "stream.lost",
    ] {
        let n = envoy.counter(c).await;
        if n > 0 {
            failures.push(format!("{c} {n}"));
        }
    }
    eprintln!(
        "through Envoy meanwhile: {sent_through_envoy} requests, {decided_by_service} allowed by the service, {failures:?}"
    );
    assert_eq!(decided_by_service, sent_through_envoy, "{failures:?}");
    assert!(failures.is_empty(), "{failures:?}");
    // Still serving.
    assert!(ask().await < Duration::from_secs(1));
}
