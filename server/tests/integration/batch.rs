//! Batches over the wire (`POST /v1/take_batch`, `tollgate.v1.RateLimiter/TakeBatch`): answers in
//! order in both forms, every bad batch refused as a whole (nothing charged), a store outage a 503
//! for the whole batch, and exactness with 32 concurrent batch clients against real Redis.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{bucket, pb_bucket, unique, RedisProc, Service};
use prost::Message;
use serde_json::{json, Value};
use tollgate_server::api::grpc::pb;
use tollgate_server::domain::{MAX_BATCH_BYTES, MAX_KEY_BYTES};

const HOUR: u64 = 3_600_000;
const TOKEN: &str = "s3cret";

async fn post_batch(
    client: &reqwest::Client,
    svc: &Service,
    token: Option<&str>,
    body: Vec<u8>,
) -> (u16, Value) {
    let mut req = client
        .post(svc.url("/v1/take_batch"))
        .header("content-type", "application/json")
        .body(body);
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    let resp = req.send().await.expect("POST /v1/take_batch");
    let status = resp.status().as_u16();
    (status, resp.json::<Value>().await.unwrap_or(Value::Null))
}

fn json_batch(takes: &[Value]) -> Vec<u8> {
    serde_json::to_vec(&json!({ "takes": takes })).unwrap()
}

fn take_of(buckets: Vec<Value>) -> Value {
    json!({ "buckets": buckets })
}

fn authed<T>(msg: T) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.metadata_mut()
        .insert("authorization", format!("Bearer {TOKEN}").parse().unwrap());
    r
}

fn pb_take(b: pb::Bucket) -> pb::TakeRequest {
    pb::TakeRequest {
        buckets: vec![b],
        ..Default::default()
    }
}

/// One bucket of capacity 1 (no refill to speak of).
fn one_token(key: &str) -> pb::Bucket {
    pb::Bucket {
        capacity: 1,
        period_ms: HOUR,
        ..pb_bucket(key)
    }
}

#[tokio::test]
async fn batches_answer_in_order_in_both_forms() {
    let svc = Service::start(common::memory_store(), Some(TOKEN)).await;
    let client = reqwest::Client::new();
    let (a, b) = (unique("a"), unique("b"));
    // JSON: take 0 and 2 hit one bucket of 1; take 1 is denied by its second bucket only.
    let body = json_batch(&[
        take_of(vec![bucket(&a, 1, 1, HOUR, 1)]),
        take_of(vec![bucket(&b, 5, 5, HOUR, 1), bucket(&b, 5, 5, HOUR, 9)]),
        take_of(vec![bucket(&a, 1, 1, HOUR, 1)]),
    ]);
    let (status, v) = post_batch(&client, &svc, Some(TOKEN), body).await;
    assert_eq!(status, 200, "{v}");
    let allowed: Vec<&Value> = v["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| &r["allowed"])
        .collect();
    assert_eq!(allowed, [&json!(true), &json!(false), &json!(false)], "{v}");
    assert_eq!(v["results"][1]["buckets"][1]["allowed"], false);
    assert_eq!(v["results"][1]["buckets"][0]["granted"], 0);
    // b was not charged by the denied take.
    let (_, v) = post_batch(
        &client,
        &svc,
        Some(TOKEN),
        json_batch(&[take_of(vec![bucket(&b, 5, 5, HOUR, 5)])]),
    )
    .await;
    assert_eq!(v["results"][0]["allowed"], true, "{v}");

    // gRPC: the same semantics.
    let mut g = svc.grpc().await;
    let c = unique("c");
    let r = g
        .take_batch(authed(pb::TakeBatchRequest {
            takes: vec![pb_take(one_token(&c)), pb_take(one_token(&c))],
            ..Default::default()
        }))
        .await
        .expect("TakeBatch")
        .into_inner();
    let allowed: Vec<bool> = r.results.iter().map(|t| t.allowed).collect();
    assert_eq!(allowed, [true, false]);
    assert_eq!(r.results[1].buckets[0].remaining, 0);

    // Counted: batches and their sizes, and every decision.
    let m = common::get_text(svc.url("/metrics")).await;
    assert!(m.contains("tollgate_batch_takes_count 3"), "{m}");
    assert!(m.contains("tollgate_batch_takes_sum 6.0"), "{m}");
    assert!(
        m.contains(r#"tollgate_decisions_total{outcome="allowed"} 3"#),
        "{m}"
    );
    assert!(
        m.contains(r#"tollgate_decisions_total{outcome="limited"} 3"#),
        "{m}"
    );
    svc.stop().await;
}

/// Over 1 MiB in either form: 64 takes of 16 buckets with long keys (each take valid alone).
fn oversized_takes() -> Vec<pb::TakeRequest> {
    (0..64)
        .map(|i| pb::TakeRequest {
            buckets: (0..16)
                .map(|j| pb_bucket(&format!("{i}-{j}-{}", "k".repeat(MAX_KEY_BYTES - 16))))
                .collect(),
            ..Default::default()
        })
        .collect()
}

#[tokio::test]
async fn bad_batches_are_refused_whole() {
    let store = common::memory_store();
    let svc = Service::start(store.clone(), Some(TOKEN)).await;
    let client = reqwest::Client::new();
    let k = unique("untouched");
    let good = take_of(vec![bucket(&k, 1, 1, HOUR, 1)]);
    let bad_cap = take_of(vec![bucket(&k, 0, 1, HOUR, 1)]);

    // (body, field named)
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (json_batch(&[]), "takes"),
        (b"{}".to_vec(), "takes"),
        (json_batch(&vec![good.clone(); 65]), "takes"),
        (
            json_batch(&[good.clone(), good.clone(), good.clone(), bad_cap.clone()]),
            "takes[3].buckets[0].capacity",
        ),
        (json_batch(&[good.clone(), json!(5)]), "takes[1]"),
        (
            json_batch(&[good.clone(), json!({"buckets": []})]),
            "takes[1].buckets",
        ),
    ];
    for (body, field) in cases {
        let (status, v) = post_batch(&client, &svc, Some(TOKEN), body).await;
        assert_eq!(status, 400, "{field}: {v}");
        assert_eq!(v["error"]["code"], "invalid_argument", "{v}");
        assert_eq!(v["error"]["field"], field, "{v}");
    }
    // Over 1 MiB: 413 naming the bound, before any decoding.
    let big: Vec<Value> = oversized_takes()
        .iter()
        .map(|t| {
            take_of(
                t.buckets
                    .iter()
                    .map(|b| bucket(&b.key, 5, 5, 1000, 1))
                    .collect(),
            )
        })
        .collect();
    let body = json_batch(&big);
    assert!(body.len() > MAX_BATCH_BYTES);
    let (status, v) = post_batch(&client, &svc, Some(TOKEN), body.clone()).await;
    assert_eq!(status, 413, "{v}");
    assert_eq!(v["error"]["code"], "resource_exhausted");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains(&MAX_BATCH_BYTES.to_string()), "{msg}");
    // Without the token: 401, whatever the body (it is not read).
    for t in [None, Some("wrong")] {
        let (status, v) = post_batch(&client, &svc, t, body.clone()).await;
        assert_eq!(status, 401, "{v}");
        assert_eq!(v["error"]["code"], "unauthenticated");
    }
    let (status, _) =
        post_batch(&client, &svc, None, json_batch(std::slice::from_ref(&good))).await;
    assert_eq!(status, 401);

    // gRPC: the same refusals.
    let mut g = svc.grpc().await;
    let code = |r: Result<tonic::Response<pb::TakeBatchResponse>, tonic::Status>| match r {
        Ok(_) => panic!("accepted"),
        Err(s) => (s.code(), s.message().to_string()),
    };
    let valid = || pb_take(one_token(&k));
    let (c, _) = code(
        g.take_batch(authed(pb::TakeBatchRequest {
            takes: vec![],
            ..Default::default()
        }))
        .await,
    );
    assert_eq!(c, tonic::Code::InvalidArgument);
    let (c, m) = code(
        g.take_batch(authed(pb::TakeBatchRequest {
            takes: vec![valid(); 65],
            ..Default::default()
        }))
        .await,
    );
    assert_eq!(c, tonic::Code::InvalidArgument);
    assert!(m.starts_with("takes:"), "{m}");
    let mut zero = one_token(&k);
    zero.capacity = 0;
    let (c, m) = code(
        g.take_batch(authed(pb::TakeBatchRequest {
            takes: vec![valid(), valid(), valid(), pb_take(zero)],
            ..Default::default()
        }))
        .await,
    );
    assert_eq!(c, tonic::Code::InvalidArgument);
    assert!(m.starts_with("takes[3].buckets[0].capacity:"), "{m}");
    let (c, _) = code(
        g.take_batch(pb::TakeBatchRequest {
            takes: vec![valid()],
            ..Default::default()
        })
        .await,
    );
    assert_eq!(c, tonic::Code::Unauthenticated);
    // Over 1 MiB, as raw HTTP/2 (the frame is refused before it is read whole).
    let msg = pb::TakeBatchRequest {
        takes: oversized_takes(),
        ..Default::default()
    }
    .encode_to_vec();
    assert!(msg.len() > MAX_BATCH_BYTES);
    let mut frame = vec![0u8];
    frame.extend_from_slice(&u32::try_from(msg.len()).unwrap().to_be_bytes());
    frame.extend_from_slice(&msg);
    let h2 = reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .unwrap();
    let r = h2
        .post(svc.url("/tollgate.v1.RateLimiter/TakeBatch"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .bearer_auth(TOKEN)
        .body(frame)
        .send()
        .await
        .unwrap();
    let status = r
        .headers()
        .get("grpc-status")
        .map(|v| v.to_str().unwrap().to_string());
    let message = r
        .headers()
        .get("grpc-message")
        .map(|v| v.to_str().unwrap().to_string());
    assert_eq!(status.as_deref(), Some("8"), "{:?}", r.headers());
    assert!(
        message
            .unwrap_or_default()
            .contains(&MAX_BATCH_BYTES.to_string()),
        "{:?}",
        r.headers()
    );

    // None of the refused batches charged anything.
    assert!(
        common::never_charged(store.as_ref(), &k).await,
        "a refused batch charged {k}"
    );
    svc.stop().await;
}

/// Redis down: the whole batch is 503 / UNAVAILABLE within the timeout, never "allowed".
#[tokio::test]
async fn a_store_outage_fails_the_whole_batch() {
    let port = common::free_port();
    let store = Arc::new(common::redis_store(
        &format!("redis://127.0.0.1:{port}"),
        200,
    ));
    let svc = Service::start(store, None).await;
    let client = reqwest::Client::new();
    let k = unique("down");
    let start = Instant::now();
    let (status, v) = post_batch(
        &client,
        &svc,
        None,
        json_batch(&[
            take_of(vec![bucket(&k, 5, 5, HOUR, 1)]),
            take_of(vec![bucket(&k, 5, 5, HOUR, 1)]),
        ]),
    )
    .await;
    assert_eq!(status, 503, "{v}");
    assert_eq!(v["error"]["code"], "unavailable");
    assert!(start.elapsed() < Duration::from_secs(3));
    let mut g = svc.grpc().await;
    let e = g
        .take_batch(pb::TakeBatchRequest {
            takes: vec![pb_take(one_token(&k))],
            ..Default::default()
        })
        .await
        .expect_err("no store");
    assert_eq!(e.code(), tonic::Code::Unavailable);
    svc.stop().await;
}

/// 32 concurrent clients, half JSON and half gRPC, each sending batches of 16 takes of one bucket
/// of capacity C (plus a bucket of their own): exactly C admitted in total, against real Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exact_under_concurrent_batches_redis() {
    const C: u64 = 300;
    const CLIENTS: usize = 32;
    const BATCHES: usize = 4;
    const TAKES: usize = 16;
    let r = RedisProc::start();
    let svc = Arc::new(Service::start(Arc::new(common::redis_store(&r.url(), 2000)), None).await);
    let shared = unique("shared");
    let mut tasks = Vec::new();
    for i in 0..CLIENTS {
        let (svc, shared) = (svc.clone(), shared.clone());
        tasks.push(tokio::spawn(async move {
            let own = unique("own");
            let mut admitted = 0u64;
            if i % 2 == 0 {
                let client = reqwest::Client::new();
                let take = take_of(vec![
                    bucket(&shared, C, 1, HOUR, 1),
                    bucket(&own, 1000, 1000, HOUR, 1),
                ]);
                for _ in 0..BATCHES {
                    let (status, v) =
                        post_batch(&client, &svc, None, json_batch(&vec![take.clone(); TAKES]))
                            .await;
                    assert_eq!(status, 200, "{v}");
                    let results = v["results"].as_array().unwrap();
                    assert_eq!(results.len(), TAKES);
                    admitted += results.iter().filter(|r| r["allowed"] == true).count() as u64;
                }
            } else {
                let mut g = svc.grpc().await;
                let take = pb::TakeRequest {
                    buckets: vec![
                        pb::Bucket {
                            capacity: C,
                            rate: Some(1),
                            period_ms: HOUR,
                            ..pb_bucket(&shared)
                        },
                        pb::Bucket {
                            capacity: 1000,
                            period_ms: HOUR,
                            ..pb_bucket(&own)
                        },
                    ],
                    ..Default::default()
                };
                for _ in 0..BATCHES {
                    let r = g
                        .take_batch(pb::TakeBatchRequest {
                            takes: vec![take.clone(); TAKES],
                            ..Default::default()
                        })
                        .await
                        .expect("TakeBatch")
                        .into_inner();
                    assert_eq!(r.results.len(), TAKES);
                    admitted += r.results.iter().filter(|t| t.allowed).count() as u64;
                }
            }
            admitted
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await.unwrap();
    }
    let asked = (CLIENTS * BATCHES * TAKES) as u64;
    eprintln!(
        "{asked} takes in {} batches: {total} admitted",
        CLIENTS * BATCHES
    );
    assert!(asked > C);
    assert_eq!(total, C, "exactly the capacity is admitted");
    drop(r);
}

/// A batch just under 1 MiB, far over a single take's bound, is decided in both forms.
#[tokio::test]
async fn a_batch_near_the_bound_is_accepted() {
    let svc = Service::start(common::memory_store(), None).await;
    let takes: Vec<pb::TakeRequest> = (0..64)
        .map(|i| pb::TakeRequest {
            buckets: (0..3)
                .map(|j| pb::Bucket {
                    period_ms: HOUR,
                    ..pb_bucket(&format!("{i}-{j}-{}", "k".repeat(MAX_KEY_BYTES - 16)))
                })
                .collect(),
            ..Default::default()
        })
        .collect();
    let msg = pb::TakeBatchRequest {
        takes: takes.clone(),
        ..Default::default()
    };
    let len = msg.encoded_len();
    assert!(len > 10 * tollgate_server::domain::MAX_TAKE_BYTES && len < MAX_BATCH_BYTES);
    let mut g = svc.grpc().await;
    let r = g.take_batch(msg).await.expect("TakeBatch").into_inner();
    assert_eq!(r.results.len(), 64);
    assert!(r.results.iter().all(|t| t.allowed));
    let json: Vec<Value> = takes
        .iter()
        .map(|t| {
            take_of(
                t.buckets
                    .iter()
                    .map(|b| bucket(&b.key, 5, 5, HOUR, 1))
                    .collect(),
            )
        })
        .collect();
    let body = json_batch(&json);
    assert!(body.len() < MAX_BATCH_BYTES);
    let (status, v) = post_batch(&reqwest::Client::new(), &svc, None, body).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["results"].as_array().map(Vec::len), Some(64));
    // The same buckets again: each has 3 of 5 tokens left after the two batches.
    assert_eq!(v["results"][63]["buckets"][2]["remaining"], 3, "{v}");
    svc.stop().await;
}
