//! Refunds (`POST /v1/refund`, `Store::refund`): tokens given back to a token bucket can be taken
//! again, never beyond the capacity; a fixed window, a lease or a bad field is refused with the
//! field named; over the memory store and real Redis alike.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use std::sync::Arc;

use common::{bucket, post_take, redis_store, unique, RedisProc, Service};
use serde_json::{json, Value};
use tollgate_server::store::Store;

const HOUR: u64 = 3_600_000;

async fn post_refund(client: &reqwest::Client, svc: &Service, body: &Value) -> (u16, Value) {
    let r = client
        .post(svc.url("/v1/refund"))
        .json(body)
        .send()
        .await
        .expect("refund sent");
    let status = r.status().as_u16();
    (status, r.json().await.expect("a JSON body"))
}

/// Takes `n` single tokens from `key` (capacity 10, one token an hour); how many were admitted.
async fn takes(client: &reqwest::Client, svc: &Service, key: &str, n: usize) -> usize {
    let mut admitted = 0;
    for _ in 0..n {
        let (s, body) = post_take(
            client,
            svc,
            &json!({"buckets": [bucket(key, 10, 1, HOUR, 1)]}),
        )
        .await;
        assert_eq!(s, 200, "{body}");
        if body["allowed"] == json!(true) {
            admitted += 1;
        }
    }
    admitted
}

async fn refunds_are_taken_again_up_to_the_capacity(store: Arc<dyn Store>) {
    let svc = Service::start(store, None).await;
    let client = reqwest::Client::new();
    let key = unique("refund");
    // A lease of 6 on a bucket of 10, then 4 single takes: empty.
    let mut leased = bucket(&key, 10, 1, HOUR, 1);
    leased["lease"] = json!(6);
    let (s, body) = post_take(&client, &svc, &json!({"buckets": [leased]})).await;
    assert_eq!(
        (s, body["buckets"][0]["granted"].clone()),
        (200, json!(6)),
        "{body}"
    );
    assert_eq!(takes(&client, &svc, &key, 5).await, 4);
    // 5 of the 6 leased come back unspent: exactly 5 more takes pass.
    let (s, body) = post_refund(
        &client,
        &svc,
        &json!({"buckets": [bucket(&key, 10, 1, HOUR, 5)]}),
    )
    .await;
    assert_eq!((s, body), (200, json!({"refunded": 1})));
    assert_eq!(takes(&client, &svc, &key, 7).await, 5);
    // A refund never fills a bucket beyond its capacity.
    let (s, _) = post_refund(
        &client,
        &svc,
        &json!({"buckets": [bucket(&key, 10, 1, HOUR, 1000)]}),
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(takes(&client, &svc, &key, 12).await, 10);
    // A bucket that does not exist is full already: nothing to give back.
    let (s, body) = post_refund(
        &client,
        &svc,
        &json!({"buckets": [bucket(&unique("none"), 10, 1, HOUR, 3)]}),
    )
    .await;
    assert_eq!((s, body), (200, json!({"refunded": 0})));
    // Refused, naming the field: a fixed window, a lease, a bad cost.
    let mut fw = bucket(&key, 10, 1, HOUR, 1);
    fw["algorithm"] = json!("fixed_window");
    let mut lease = bucket(&key, 10, 1, HOUR, 1);
    lease["lease"] = json!(5);
    for (b, field) in [
        (fw, "buckets[0].algorithm"),
        (lease, "buckets[0].lease"),
        (bucket(&key, 10, 1, HOUR, 0), "buckets[0].cost"),
    ] {
        let (s, body) = post_refund(&client, &svc, &json!({"buckets": [b]})).await;
        assert_eq!(s, 400, "{body}");
        assert_eq!(body["error"]["field"], json!(field), "{body}");
    }
    svc.stop().await;
}

#[tokio::test]
async fn memory_refunds_are_taken_again_up_to_the_capacity() {
    refunds_are_taken_again_up_to_the_capacity(common::memory_store()).await;
}

#[tokio::test]
async fn redis_refunds_are_taken_again_up_to_the_capacity() {
    let redis = RedisProc::start();
    refunds_are_taken_again_up_to_the_capacity(Arc::new(redis_store(&redis.url(), 1000))).await;
}
