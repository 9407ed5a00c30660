//! The service through its real listener: exactness under concurrency, both transports, HTTP/2
//! prior knowledge, bad input, auth, health and metrics.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{bucket, pb_bucket, post_take, RedisProc, Service};
use serde_json::{json, Value};
use tollgate_server::api::grpc::pb;
use tollgate_server::store::Store;

const CLIENTS: usize = 32;

/// `CLIENTS` concurrent HTTP clients, each with its own connection, send `per_client` takes of
/// one bucket; returns how many were allowed.
async fn hammer_count(svc: &Service, body: Value, per_client: usize) -> u64 {
    let allowed = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..CLIENTS {
        let (url, body, allowed) = (svc.url("/v1/take"), body.clone(), allowed.clone());
        tasks.push(tokio::spawn(async move {
            let client = reqwest::Client::new();
            for _ in 0..per_client {
                let r = client.post(&url).json(&body).send().await.expect("send");
                assert_eq!(r.status(), 200);
                let v: Value = r.json().await.expect("json");
                if v["allowed"] == true {
                    allowed.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    for t in tasks {
        t.await.expect("client task");
    }
    allowed.load(Ordering::Relaxed)
}

async fn exact_without_refill(store: Arc<dyn Store>) {
    let svc = Service::start(store, None).await;
    let key = common::unique("exact");
    // Capacity 100, one token per hour: refill is negligible. 32 x 8 = 256 attempts.
    let body = json!({"buckets": [bucket(&key, 100, 1, 3_600_000, 1)]});
    assert_eq!(hammer_count(&svc, body, 8).await, 100);
    svc.stop().await;
}

/// With a real refill: admitted must equal capacity plus the tokens earned while requests kept
/// coming. Upper bound from the whole measured span; lower bound from the span during which the
/// bucket was certainly being hit, minus the one token that may refill after the last request.
async fn exact_with_refill(store: Arc<dyn Store>) {
    let svc = Service::start(store, None).await;
    let key = common::unique("refill");
    // 0.02 token per ms. The capacity is 5 s of refill: refill is lost only while the bucket is
    // full, so only a stall of every client for 5 s could make it drop tokens the bounds below
    // count as earned; and any machine sends more than 20 takes a second, so it runs dry.
    let (cap, rate, period_ms) = (100u64, 20u64, 1000u64);
    let body = json!({"buckets": [bucket(&key, cap, rate, period_ms, 1)]});
    let allowed = Arc::new(AtomicU64::new(0));
    let first_reply = Arc::new(std::sync::Mutex::new(None::<Instant>));
    let last_sent = Arc::new(std::sync::Mutex::new(None::<Instant>));
    // Denials show the bucket ran dry; without them (a loaded machine that has not yet sent
    // capacity plus refill) nothing is measured, so the run goes on until there are some.
    let denied = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let deadline = start + Duration::from_millis(600);
    let hard_deadline = start + Duration::from_secs(20);
    let mut tasks = Vec::new();
    for _ in 0..CLIENTS {
        let (url, body, allowed) = (svc.url("/v1/take"), body.clone(), allowed.clone());
        let (first_reply, last_sent) = (first_reply.clone(), last_sent.clone());
        let denied = denied.clone();
        tasks.push(tokio::spawn(async move {
            let client = reqwest::Client::new();
            let mut n = 0;
            while (Instant::now() < deadline || denied.load(Ordering::Relaxed) < CLIENTS as u64)
                && Instant::now() < hard_deadline
                && n < 100_000
            {
                n += 1;
                let sent = Instant::now();
                let r = client.post(&url).json(&body).send().await.expect("send");
                let status = r.status();
                let v: Value = r.json().await.expect("json");
                assert_eq!(status, 200, "{v}");
                let got = Instant::now();
                {
                    let mut f = first_reply.lock().unwrap();
                    if f.is_none_or(|t| got < t) {
                        *f = Some(got);
                    }
                    let mut l = last_sent.lock().unwrap();
                    if l.is_none_or(|t| sent > t) {
                        *l = Some(sent);
                    }
                }
                if v["allowed"] == true {
                    allowed.fetch_add(1, Ordering::Relaxed);
                } else {
                    denied.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    for t in tasks {
        t.await.expect("client task");
    }
    let end = Instant::now();
    assert!(
        denied.load(Ordering::Relaxed) > 0,
        "the bucket never ran dry in {:?}",
        end - start
    );
    let admitted = allowed.load(Ordering::Relaxed);
    let tokens = |d: Duration| (d.as_micros() as u64 * rate) / (period_ms * 1000);
    let upper = cap + tokens(end - start);
    let (f, l) = (
        first_reply.lock().unwrap().unwrap(),
        last_sent.lock().unwrap().unwrap(),
    );
    let lower = (cap + tokens(l.saturating_duration_since(f))).saturating_sub(1);
    assert!(
        (lower..=upper).contains(&admitted),
        "admitted {admitted}, expected {lower}..={upper} (span {:?})",
        end - start
    );
    svc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exact_under_concurrency_memory() {
    exact_without_refill(common::memory_store()).await;
    exact_with_refill(common::memory_store()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exact_under_concurrency_redis() {
    let r = RedisProc::start();
    exact_without_refill(Arc::new(common::redis_store(&r.url(), 1000))).await;
    exact_with_refill(Arc::new(common::redis_store(&r.url(), 1000))).await;
}

#[tokio::test]
async fn http1_h2_prior_knowledge_and_grpc_share_one_port() {
    let svc = Service::start(common::memory_store(), None).await;
    let key = common::unique("ports");
    let body = json!({"buckets": [bucket(&key, 3, 3, 3_600_000, 1)]});
    let h1 = reqwest::Client::builder().http1_only().build().unwrap();
    let r = h1
        .post(svc.url("/v1/take"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.version(), reqwest::Version::HTTP_11);
    assert_eq!(
        r.json::<Value>().await.unwrap()["buckets"][0]["remaining"],
        2
    );
    let h2 = reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .unwrap();
    let r = h2
        .post(svc.url("/v1/take"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.version(), reqwest::Version::HTTP_2);
    assert_eq!(
        r.json::<Value>().await.unwrap()["buckets"][0]["remaining"],
        1
    );
    let mut g = svc.grpc().await;
    let reply = g
        .take(pb::TakeRequest {
            buckets: vec![pb::Bucket {
                key: key.clone(),
                capacity: 3,
                rate: Some(3),
                period_ms: 3_600_000,
                cost: Some(1),
                algorithm: 0,
                lease: None,
                ..Default::default()
            }],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(reply.allowed);
    assert_eq!(reply.buckets[0].remaining, 0);
    assert_eq!(reply.buckets[0].limit, 3);
    let (status, v) = post_take(&h1, &svc, &body).await;
    assert_eq!(status, 200);
    assert_eq!(v["allowed"], false);
    assert!(v["buckets"][0]["retry_after_ms"].as_u64().unwrap() > 0);
    // A gRPC call to an unknown method is a gRPC error, not an HTTP 404.
    let r = h2
        .post(svc.url("/tollgate.v1.RateLimiter/Nope"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(vec![0u8, 0, 0, 0, 0])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["grpc-status"], "12");
    svc.stop().await;
}

/// The status of GET `path`.
async fn get_status(client: &reqwest::Client, svc: &Service, path: &str) -> u16 {
    client
        .get(svc.url(path))
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

fn bad_http_bodies() -> Vec<(&'static str, String, &'static str)> {
    let ok = |extra: &str| {
        format!(r#"{{"buckets": [{{"key": "k", "capacity": 5, "period_ms": 1000{extra}}}]}}"#)
    };
    // The good body with the JSON text of one of its fields' values replaced.
    let with = |field: &str, value: &str| {
        let good = [("key", "\"k\""), ("capacity", "5"), ("period_ms", "1000")];
        let (_, old) = good
            .iter()
            .find(|(f, _)| *f == field)
            .expect("a field of the good body");
        ok("").replace(
            &format!("\"{field}\": {old}"),
            &format!("\"{field}\": {value}"),
        )
    };
    let many: Vec<Value> = (0..17)
        .map(|i| bucket(&format!("k{i}"), 1, 1, 1, 1))
        .collect();
    vec![
        ("malformed", "{\"buckets\": [".to_string(), ""),
        ("not an object", "[1, 2]".to_string(), ""),
        ("empty body", String::new(), ""),
        (
            "unknown top field",
            r#"{"buckets": [], "x": 1}"#.to_string(),
            "x",
        ),
        ("missing buckets", "{}".to_string(), "buckets"),
        ("empty buckets", r#"{"buckets": []}"#.to_string(), "buckets"),
        (
            "too many buckets",
            json!({"buckets": many}).to_string(),
            "buckets",
        ),
        (
            "unknown bucket field",
            ok(r#", "burst": 3"#),
            "buckets[0].burst",
        ),
        (
            "zero capacity",
            with("capacity", "0"),
            "buckets[0].capacity",
        ),
        (
            "huge capacity",
            with("capacity", "1000000001"),
            "buckets[0].capacity",
        ),
        (
            "negative capacity",
            with("capacity", "-5"),
            "buckets[0].capacity",
        ),
        (
            "string capacity",
            with("capacity", "\"5\""),
            "buckets[0].capacity",
        ),
        (
            "huge u64",
            with("capacity", "18446744073709551616"),
            "buckets[0].capacity",
        ),
        (
            "missing capacity",
            r#"{"buckets": [{"key": "k", "period_ms": 1000}]}"#.to_string(),
            "buckets[0].capacity",
        ),
        ("zero rate", ok(r#", "rate": 0"#), "buckets[0].rate"),
        (
            "zero period",
            with("period_ms", "0"),
            "buckets[0].period_ms",
        ),
        (
            "huge period",
            with("period_ms", "31536000001"),
            "buckets[0].period_ms",
        ),
        ("zero cost", ok(r#", "cost": 0"#), "buckets[0].cost"),
        (
            "huge cost",
            ok(r#", "cost": 1000000001"#),
            "buckets[0].cost",
        ),
        (
            "bad algorithm",
            ok(r#", "algorithm": "leaky""#),
            "buckets[0].algorithm",
        ),
        ("empty key", with("key", "\"\""), "buckets[0].key"),
        (
            "long key",
            with("key", &format!("\"{}\"", "k".repeat(4097))),
            "buckets[0].key",
        ),
        (
            "missing key",
            r#"{"buckets": [{"capacity": 5, "period_ms": 1000}]}"#.to_string(),
            "buckets[0].key",
        ),
    ]
}

async fn bad_input_is_rejected(store: Arc<dyn Store>, redis: Option<&RedisProc>) {
    let svc = Service::start(store, None).await;
    let client = reqwest::Client::new();
    for (what, body, field) in bad_http_bodies() {
        let r = client
            .post(svc.url("/v1/take"))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400, "{what}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["code"], "invalid_argument", "{what}");
        if !field.is_empty() {
            assert_eq!(v["error"]["field"], field, "{what}: {v}");
            assert!(
                v["error"]["message"].as_str().unwrap().contains(field),
                "{what}: {v}"
            );
        }
    }
    // gRPC: the same validation.
    let mut g = svc.grpc().await;
    let good = pb_bucket("k");
    let grpc_cases: Vec<(&str, Vec<pb::Bucket>, &str)> = vec![
        ("empty buckets", vec![], "buckets"),
        ("too many", vec![good.clone(); 17], "buckets"),
        (
            "zero capacity",
            vec![pb::Bucket {
                capacity: 0,
                ..good.clone()
            }],
            "buckets[0].capacity",
        ),
        (
            "zero rate",
            vec![
                good.clone(),
                pb::Bucket {
                    rate: Some(0),
                    ..good.clone()
                },
            ],
            "buckets[1].rate",
        ),
        (
            "zero period",
            vec![pb::Bucket {
                period_ms: 0,
                ..good.clone()
            }],
            "buckets[0].period_ms",
        ),
        (
            "huge cost",
            vec![pb::Bucket {
                cost: Some(2_000_000_000),
                ..good.clone()
            }],
            "buckets[0].cost",
        ),
        (
            "empty key",
            vec![pb::Bucket {
                key: String::new(),
                ..good.clone()
            }],
            "buckets[0].key",
        ),
        (
            "long key",
            vec![pb::Bucket {
                key: "k".repeat(4097),
                ..good.clone()
            }],
            "buckets[0].key",
        ),
        (
            "unknown algorithm",
            vec![pb::Bucket {
                algorithm: 7,
                ..good.clone()
            }],
            "buckets[0].algorithm",
        ),
    ];
    for (what, buckets, field) in grpc_cases {
        let e = g
            .take(pb::TakeRequest {
                buckets,
                ..Default::default()
            })
            .await
            .expect_err(what);
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{what}");
        assert!(e.message().contains(field), "{what}: {}", e.message());
    }
    // Malformed protobuf bytes.
    let h2 = reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .unwrap();
    let garbage = [0u8, 0, 0, 0, 3, 0xff, 0xff, 0xff];
    let r = h2
        .post(svc.url("/tollgate.v1.RateLimiter/Take"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(garbage.to_vec())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let status = r
        .headers()
        .get("grpc-status")
        .map(|v| v.to_str().unwrap().to_string());
    assert_eq!(
        status.as_deref(),
        Some("3"),
        "malformed protobuf: {:?}",
        r.headers()
    );
    // The service survived all of it.
    let (status, _) = post_take(
        &client,
        &svc,
        &json!({"buckets": [bucket("fine", 1, 1, 1000, 1)]}),
    )
    .await;
    assert_eq!(status, 200);
    if let Some(r) = redis {
        // Only the one good request wrote anything.
        assert_eq!(r.cmd(&["DBSIZE"]).as_deref(), Some("1"));
    }
    svc.stop().await;
}

#[tokio::test]
async fn bad_input_memory() {
    bad_input_is_rejected(common::memory_store(), None).await;
}

#[tokio::test]
async fn bad_input_redis_writes_nothing() {
    let r = RedisProc::start();
    bad_input_is_rejected(Arc::new(common::redis_store(&r.url(), 1000)), Some(&r)).await;
}

#[tokio::test]
async fn token_is_required_when_configured() {
    let svc = Service::start(common::memory_store(), Some("s3cret")).await;
    let client = reqwest::Client::new();
    let body = json!({"buckets": [bucket("auth", 5, 5, 1000, 1)]});
    for auth in [
        None,
        Some("Bearer wrong"),
        Some("s3cret"),
        Some("Bearer s3cret2"),
    ] {
        let mut req = client.post(svc.url("/v1/take")).json(&body);
        if let Some(a) = auth {
            req = req.header("authorization", a);
        }
        let r = req.send().await.unwrap();
        assert_eq!(r.status(), 401, "{auth:?}");
        assert_eq!(
            r.json::<Value>().await.unwrap()["error"]["code"],
            "unauthenticated"
        );
    }
    let r = client
        .post(svc.url("/v1/take"))
        .header("authorization", "Bearer s3cret")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let mut g = svc.grpc().await;
    let req = || pb::TakeRequest {
        buckets: vec![pb_bucket("auth")],
        ..Default::default()
    };
    let e = g.take(req()).await.expect_err("no token");
    assert_eq!(e.code(), tonic::Code::Unauthenticated);
    let mut with = tonic::Request::new(req());
    with.metadata_mut()
        .insert("authorization", "Bearer s3cret".parse().unwrap());
    assert!(g.take(with).await.is_ok());
    // Probes need no token.
    assert_eq!(get_status(&client, &svc, "/healthz").await, 200);
    svc.stop().await;
}

#[tokio::test]
async fn health_readiness_and_metrics() {
    let mut r = RedisProc::start();
    let svc = Service::start(Arc::new(common::redis_store(&r.url(), 100)), None).await;
    let client = reqwest::Client::new();
    assert_eq!(get_status(&client, &svc, "/healthz").await, 200);
    assert_eq!(get_status(&client, &svc, "/readyz").await, 200);
    let body = json!({"buckets": [bucket("m", 1, 1, 3_600_000, 1)]});
    assert_eq!(post_take(&client, &svc, &body).await.0, 200);
    assert_eq!(post_take(&client, &svc, &body).await.0, 200);
    assert_eq!(post_take(&client, &svc, &json!({})).await.0, 400);
    r.kill();
    // /readyz answers from a check refreshed every 50 ms here.
    let deadline = Instant::now() + Duration::from_secs(5);
    while get_status(&client, &svc, "/readyz").await != 503 {
        assert!(
            Instant::now() < deadline,
            "/readyz still 200 after Redis died"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(get_status(&client, &svc, "/healthz").await, 200);
    assert_eq!(post_take(&client, &svc, &body).await.0, 503);
    let text = common::get_text(svc.url("/metrics")).await;
    for needle in [
        "tollgate_decisions_total{outcome=\"allowed\"} 1",
        "tollgate_decisions_total{outcome=\"limited\"} 1",
        "tollgate_store_duration_seconds_count 3",
        "tollgate_store_errors_total{kind=",
        "tollgate_requests_total{transport=\"http\",code=\"ok\"} 2",
        "tollgate_requests_total{transport=\"http\",code=\"invalid_argument\"} 1",
        "tollgate_requests_total{transport=\"http\",code=\"unavailable\"} 1",
    ] {
        assert!(text.contains(needle), "missing {needle} in\n{text}");
    }
    svc.stop().await;
}
