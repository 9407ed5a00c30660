//! Live instances and the per-rule decision metric, through the real service over real Redis.
//!
//! - `replicas_count_the_deployment_together`: two replicas on one Redis each hear some proxies;
//!   within about a second every answer, from either replica and either transport, reports all of
//!   them; a proxy that stops calling drops out after the TTL.
//! - `an_instance_stays_counted_for_the_configured_ttl`: with `instance_ttl_ms` 4 s, a proxy heard
//!   again 3 s after its first call is still counted when one that called once has dropped out,
//!   and drops out itself 4 s after its last call.
//! - `every_operation_counts_its_caller`: a proxy that only settles, acquires, releases or refunds
//!   (a lease holder that takes rarely) is live too.
//! - `rule_label_is_bounded`: decisions are counted per rule name, and rule names beyond the cap
//!   are folded into `other`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{bucket, get_text, post_take, unique, RedisProc, Service};
use serde_json::{json, Value};
use tollgate_server::api::grpc::pb;
use tollgate_server::api::instances::DEFAULT_TTL_MS;
use tollgate_server::metrics::MAX_RULE_LABELS;
use tollgate_server::ServiceConfig;

fn take_from(instance: &str, key: &str) -> Value {
    json!({"buckets": [bucket(key, 1000, 1000, 1000, 1)], "instance": instance})
}

/// Takes from `instance` through `svc` until an answer reports `want` instances; the answers seen.
async fn until_count(
    client: &reqwest::Client,
    svc: &Service,
    instance: &str,
    want: u64,
    within: Duration,
) -> Vec<u64> {
    let key = unique("inst");
    let deadline = Instant::now() + within;
    let mut seen = Vec::new();
    loop {
        let (status, body) = post_take(client, svc, &take_from(instance, &key)).await;
        assert_eq!(status, 200, "{body}");
        let n = body["instances"].as_u64().unwrap_or(0);
        seen.push(n);
        if n == want || Instant::now() > deadline {
            return seen;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A replica on `redis` counting instances for `ttl_ms`.
async fn replica(redis: &RedisProc, ttl_ms: u64) -> Service {
    let config = ServiceConfig {
        instance_ttl_ms: ttl_ms,
        ..ServiceConfig::default()
    };
    Service::start_with(Arc::new(common::redis_store(&redis.url(), 500)), config).await
}

/// The count an answer to a take without an id reports, asked twice 1.1 s apart: the second
/// answer carries the count the first one's report (one a second at most) learned.
async fn count_now(client: &reqwest::Client, svc: &Service) -> u64 {
    let take = json!({"buckets": [bucket(&unique("watch"), 1000, 1000, 1000, 1)]});
    post_take(client, svc, &take).await;
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    post_take(client, svc, &take).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (status, body) = post_take(client, svc, &take).await;
    assert_eq!(status, 200, "{body}");
    body["instances"].as_u64().unwrap_or(0)
}

const TEST_TTL_MS: u64 = 3_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_count_the_deployment_together() {
    let redis = RedisProc::start();
    let a = replica(&redis, TEST_TTL_MS).await;
    let b = replica(&redis, TEST_TTL_MS).await;
    let client = reqwest::Client::new();

    // Proxies p1, p2 call replica a; p3 calls replica b. A take without an id is not counted.
    let (s, body) = post_take(
        &client,
        &a,
        &json!({"buckets": [bucket("x", 5, 5, 1000, 1)]}),
    )
    .await;
    assert_eq!(s, 200);
    assert!(body.get("instances").is_none_or(|n| n == 0), "{body}");
    for p in ["p1", "p2"] {
        post_take(&client, &a, &take_from(p, "k")).await;
    }
    post_take(&client, &b, &take_from("p3", "k")).await;
    let seen = until_count(&client, &a, "p1", 3, Duration::from_secs(5)).await;
    assert_eq!(
        seen.last(),
        Some(&3),
        "replica a learns p3 from Redis: {seen:?}"
    );
    let seen = until_count(&client, &b, "p3", 3, Duration::from_secs(5)).await;
    assert_eq!(
        seen.last(),
        Some(&3),
        "replica b learns p1 and p2: {seen:?}"
    );

    // gRPC answers carry it too, a batch in every result.
    let mut g = b.grpc().await;
    let one = pb::TakeRequest {
        buckets: vec![common::pb_bucket(&unique("g"))],
        instance: "p3".into(),
    };
    let r = g.take(one.clone()).await.unwrap().into_inner();
    assert_eq!(r.instances, 3);
    let r = g
        .take_batch(pb::TakeBatchRequest {
            takes: vec![one.clone(), one],
            instance: "p3".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(r.results.iter().all(|t| t.instances == 3), "{r:?}");

    // A bad id is refused, naming the field.
    let (s, body) = post_take(&client, &a, &take_from("not ok", "k")).await;
    assert_eq!(
        (s, body["error"]["field"].as_str()),
        (400, Some("instance"))
    );

    // Only p1 keeps calling: p2 and p3 drop out once the TTL has passed.
    let seen = until_count(
        &client,
        &a,
        "p1",
        1,
        Duration::from_millis(TEST_TTL_MS + 4_000),
    )
    .await;
    assert_eq!(seen.last(), Some(&1), "{seen:?}");
    let metrics = get_text(a.url("/metrics")).await;
    assert!(metrics.contains("tollgate_live_instances 1"), "{metrics}");
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_stays_counted_for_the_configured_ttl() {
    const TTL: Duration = Duration::from_millis(4_000);
    let redis = RedisProc::start();
    let svc = replica(&redis, 4_000).await;
    let client = reqwest::Client::new();
    let t0 = Instant::now();
    post_take(&client, &svc, &take_from("once", "k")).await;
    post_take(&client, &svc, &take_from("again", "k")).await;
    assert_eq!(count_now(&client, &svc).await, 2);
    // `again` is heard 3 s in, within its TTL; `once` never again.
    tokio::time::sleep(
        (t0 + Duration::from_millis(3_000)).saturating_duration_since(Instant::now()),
    )
    .await;
    post_take(&client, &svc, &take_from("again", "k")).await;
    // Past `once`'s TTL (and the report that follows it), well before `again`'s ends.
    tokio::time::sleep(
        (t0 + TTL + Duration::from_millis(200)).saturating_duration_since(Instant::now()),
    )
    .await;
    let n = count_now(&client, &svc).await;
    let at = t0.elapsed();
    assert!(
        at < Duration::from_millis(7_000),
        "too slow to tell ({at:?})"
    );
    assert_eq!(n, 1, "{at:?} in: `again` counted, `once` dropped out");
    // 4 s after `again`'s last call it has dropped out too.
    tokio::time::sleep(
        (t0 + Duration::from_millis(7_200)).saturating_duration_since(Instant::now()),
    )
    .await;
    assert_eq!(count_now(&client, &svc).await, 0);
    svc.stop().await;
}

/// A replica started while the deployment runs has heard only its own callers: its answers say
/// "unknown" (0, the filter keeps the count it had) until it has learned the shared count, never
/// its own smaller one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_started_mid_run_answers_the_shared_count() {
    let redis = RedisProc::start();
    let a = Service::start(Arc::new(common::redis_store(&redis.url(), 500)), None).await;
    let client = reqwest::Client::new();
    for p in ["p1", "p2", "p3"] {
        post_take(&client, &a, &take_from(p, "k")).await;
    }
    let seen = until_count(&client, &a, "p1", 3, Duration::from_secs(5)).await;
    assert_eq!(seen.last(), Some(&3), "{seen:?}");
    // One more take after the report interval: replica a reports all three to Redis.
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    post_take(&client, &a, &take_from("p1", "k")).await;
    tokio::time::sleep(Duration::from_millis(300)).await;

    let b = Service::start(Arc::new(common::redis_store(&redis.url(), 500)), None).await;
    let seen = until_count(&client, &b, "p4", 4, Duration::from_secs(5)).await;
    assert_eq!(seen.last(), Some(&4), "{seen:?}");
    assert!(
        seen.iter().all(|&n| n == 0 || n == 4),
        "a fresh replica answered a count of its own: {seen:?}"
    );
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_operation_counts_its_caller() {
    let redis = RedisProc::start();
    let svc = Service::start(Arc::new(common::redis_store(&redis.url(), 500)), None).await;
    let client = reqwest::Client::new();
    let post = |path: &'static str, body: Value| {
        let (client, url) = (client.clone(), svc.url(path));
        async move {
            let r = client.post(url).json(&body).send().await.unwrap();
            let status = r.status().as_u16();
            (status, r.json::<Value>().await.unwrap_or(Value::Null))
        }
    };
    let b = bucket(&unique("ops"), 1000, 1000, 1000, 1);
    let mut settle_bucket = b.clone();
    settle_bucket["estimate"] = json!(5);
    settle_bucket["used"] = json!(3);
    settle_bucket.as_object_mut().unwrap().remove("cost");
    let slot = json!({"key": unique("ops-slot"), "limit": 4, "ttl_ms": 10_000});
    for (path, body) in [
        (
            "/v1/settle",
            json!({"id": "s-1", "instance": "settler", "buckets": [settle_bucket]}),
        ),
        (
            "/v1/acquire",
            json!({"instance": "acquirer", "buckets": [slot]}),
        ),
        (
            "/v1/release",
            json!({"instance": "releaser", "slot": "00ff", "keys": ["k"]}),
        ),
        (
            "/v1/refund",
            json!({"instance": "refunder", "buckets": [b]}),
        ),
    ] {
        let (status, body) = post(path, body).await;
        assert_eq!(status, 200, "{path}: {body}");
    }
    // With one take of its own, the replica counts five proxies.
    let seen = until_count(&client, &svc, "taker", 5, Duration::from_secs(5)).await;
    assert_eq!(seen.last(), Some(&5), "{seen:?}");
    // A bad id is refused by field on every operation.
    let (status, body) = post(
        "/v1/release",
        json!({"instance": "no good", "slot": "00ff", "keys": ["k"]}),
    )
    .await;
    assert_eq!(
        (status, body["error"]["field"].as_str()),
        (400, Some("instance")),
        "{body}"
    );
    svc.stop().await;
}

#[tokio::test]
async fn rule_label_is_bounded() {
    let redis = RedisProc::start();
    let svc = Service::start(Arc::new(common::redis_store(&redis.url(), 500)), None).await;
    let client = reqwest::Client::new();
    let named = |rule: &str, key: &str, cap: u64| {
        let mut b = bucket(key, cap, cap, 60_000, 1);
        b["rule"] = json!(rule);
        b
    };
    // "api" admits one and denies one; "web" is charged alongside "api" and denied by it only.
    let k = unique("r");
    let both =
        json!({"buckets": [named("api", &format!("{k}a"), 1), named("web", &format!("{k}w"), 9)]});
    assert_eq!(
        post_take(&client, &svc, &both).await.1["allowed"],
        json!(true)
    );
    assert_eq!(
        post_take(&client, &svc, &both).await.1["allowed"],
        json!(false)
    );
    // More distinct rule names than the cap: the rest count as `other`.
    for i in 0..MAX_RULE_LABELS + 5 {
        let take = json!({"buckets": [named(&format!("r{i}"), &k, 1000)]});
        assert_eq!(post_take(&client, &svc, &take).await.0, 200);
    }
    let m = get_text(svc.url("/metrics")).await;
    let line = |rule: &str, outcome: &str| {
        m.lines()
            .find(|l| {
                l.starts_with("tollgate_rule_decisions_total{")
                    && l.contains(&format!("rule=\"{rule}\""))
                    && l.contains(&format!("outcome=\"{outcome}\""))
            })
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<u64>().ok())
    };
    assert_eq!(line("api", "allowed"), Some(1), "{m}");
    assert_eq!(line("api", "limited"), Some(1), "{m}");
    assert_eq!(line("web", "allowed"), Some(1), "{m}");
    assert_eq!(line("web", "limited"), Some(0), "web could pay: {m}");
    let labels = m
        .lines()
        .filter(|l| l.starts_with("tollgate_rule_decisions_total{") && l.contains("allowed"))
        .count();
    assert_eq!(labels, MAX_RULE_LABELS + 1, "the cap and `other`: {m}");
    // api, web and r0..r61 took the 64 labels; r62..r68 are `other`.
    assert_eq!(line("other", "allowed"), Some(7), "{m}");
    // The aggregate counter is unchanged by the label.
    assert!(
        m.contains("tollgate_decisions_total{outcome=\"allowed\"}"),
        "{m}"
    );
    svc.stop().await;
}

/// On a Redis Cluster the registry is one key in whatever slot it hashes to, and buckets whose
/// limits change keep their counts there too.
#[tokio::test]
async fn on_a_cluster() {
    use tollgate_server::domain::{Algorithm, BucketSpec};
    use tollgate_server::store::Store;
    let nodes = common::start_cluster(3);
    let store = common::cluster_store(&nodes, 1000);
    let ids = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    assert_eq!(
        store
            .live_instances(&ids(&["a", "b"]), DEFAULT_TTL_MS)
            .await
            .unwrap(),
        Some(2)
    );
    assert_eq!(
        store
            .live_instances(&ids(&["c"]), DEFAULT_TTL_MS)
            .await
            .unwrap(),
        Some(3)
    );
    assert_eq!(
        store.live_instances(&[], DEFAULT_TTL_MS).await.unwrap(),
        Some(3)
    );
    // Two buckets in different slots, one take: lowered limits carry both over.
    let spec = |key: &str, cap: u64, cost: u64| BucketSpec {
        key: key.into(),
        capacity: cap,
        rate: cap,
        period_ms: 3_600_000,
        cost,
        algorithm: Algorithm::TokenBucket,
        lease: cost,
        max_delay_ms: 0,
    };
    let d = store
        .take(&[spec("slot-a", 100, 40), spec("slot-b", 10, 4)])
        .await
        .unwrap();
    assert!(d.allowed);
    let d = store
        .take(&[spec("slot-a", 50, 1), spec("slot-b", 5, 1)])
        .await
        .unwrap();
    assert!(d.allowed);
    assert_eq!(
        (d.buckets[0].remaining, d.buckets[1].remaining),
        (29, 2),
        "60 % of 50 and of 5, less one"
    );
}
