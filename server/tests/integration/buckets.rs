//! Inspect and reset (`GET /v1/buckets`, `POST /v1/buckets/reset`): what an operator sees of one
//! bucket (tokens, debt, window counts, live slots, time to full) on the store's clock, that
//! reading it changes nothing, that a reset gives a full bucket back; over the memory store, real
//! Redis and a real Redis Cluster; and that only the admin token opens them.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use std::sync::Arc;

use common::{bucket, post_take, redis_store, unique, RedisProc, Service};
use serde_json::{json, Value};
use tollgate_server::domain::{Algorithm, BucketSpec, SettleSpec, Settlement, SlotSpec};
use tollgate_server::store::Store;
use tollgate_server::ServiceConfig;

const ADMIN: &str = "admin-secret";
const TAKES: &str = "take-secret";

async fn admin_service(store: Arc<dyn Store>) -> Service {
    Service::start_with(
        store,
        ServiceConfig {
            admin_token: Some(ADMIN.into()),
            ..ServiceConfig::default()
        },
    )
    .await
}

async fn inspect(client: &reqwest::Client, svc: &Service, query: &str) -> (u16, Value) {
    let r = client
        .get(svc.url(&format!("/v1/buckets?{query}")))
        .bearer_auth(ADMIN)
        .send()
        .await
        .expect("GET /v1/buckets");
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

async fn reset(client: &reqwest::Client, svc: &Service, body: &Value) -> (u16, Value) {
    let r = client
        .post(svc.url("/v1/buckets/reset"))
        .bearer_auth(ADMIN)
        .json(body)
        .send()
        .await
        .expect("POST /v1/buckets/reset");
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

async fn allowed(client: &reqwest::Client, svc: &Service, b: Value) -> bool {
    let (s, body) = post_take(client, svc, &json!({ "buckets": [b] })).await;
    assert_eq!(s, 200, "{body}");
    body["allowed"] == json!(true)
}

fn with_alg(mut b: Value, alg: &str) -> Value {
    b["algorithm"] = json!(alg);
    b
}

fn spec(key: &str, capacity: u64, period_ms: u64, algorithm: Algorithm) -> BucketSpec {
    BucketSpec {
        key: key.into(),
        capacity,
        rate: capacity,
        period_ms,
        cost: 1,
        algorithm,
        lease: 1,
        max_delay_ms: 0,
    }
}

/// A field of an answer as an integer.
fn n(v: &Value, field: &str) -> u64 {
    v[field]
        .as_u64()
        .unwrap_or_else(|| panic!("{field} in {v}"))
}

async fn inspect_and_reset(store: Arc<dyn Store>) {
    let svc = admin_service(store.clone()).await;
    let client = reqwest::Client::new();

    // A token bucket of 5 per 10 s, 3 taken: 2 left, full again within 6 s.
    let key = unique("tb");
    let q = format!("key={key}&capacity=5&period_ms=10000");
    assert!(allowed(&client, &svc, bucket(&key, 5, 5, 10_000, 3)).await);
    let (s, v) = inspect(&client, &svc, &q).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        (
            v["exists"].clone(),
            n(&v, "remaining"),
            n(&v, "debt"),
            n(&v, "used")
        ),
        (json!(true), 2, 0, 3),
        "{v}"
    );
    let reset_ms = n(&v, "reset_ms");
    assert!(reset_ms > 5_000 && reset_ms <= 6_000, "{v}");
    // Reading changed nothing: still exactly 2 to take.
    for _ in 0..3 {
        inspect(&client, &svc, &q).await;
    }
    assert!(allowed(&client, &svc, bucket(&key, 5, 5, 10_000, 2)).await);
    assert!(!allowed(&client, &svc, bucket(&key, 5, 5, 10_000, 1)).await);
    let (_, v) = inspect(&client, &svc, &q).await;
    assert_eq!(n(&v, "remaining"), 0, "{v}");
    assert!(n(&v, "reset_ms") > 9_000, "{v}");

    // A reset gives a full bucket back; a second finds nothing to delete.
    let (s, v) = reset(&client, &svc, &json!({ "key": key })).await;
    assert_eq!((s, v), (200, json!({ "reset": true })));
    let (_, v) = inspect(&client, &svc, &q).await;
    assert_eq!(
        (v["exists"].clone(), n(&v, "remaining"), n(&v, "reset_ms")),
        (json!(false), 5, 0),
        "{v}"
    );
    assert!(allowed(&client, &svc, bucket(&key, 5, 5, 10_000, 5)).await);
    let (_, v) = reset(&client, &svc, &json!({ "key": key })).await;
    assert_eq!(v, json!({ "reset": true }));
    let (_, v) = reset(&client, &svc, &json!({ "key": key })).await;
    assert_eq!(v, json!({ "reset": false }));

    // Debt: an emptied bucket charged 3 more by a settle owes 3; full again after 8 tokens' time.
    let debtor = unique("debt");
    let b = spec(&debtor, 5, 10_000, Algorithm::TokenBucket);
    assert!(allowed(&client, &svc, bucket(&debtor, 5, 5, 10_000, 5)).await);
    store
        .settle(&Settlement {
            id: unique("settle"),
            buckets: vec![SettleSpec {
                bucket: b,
                estimate: 0,
                used: 3,
                window: None,
            }],
        })
        .await
        .unwrap();
    let (_, v) = inspect(
        &client,
        &svc,
        &format!("key={debtor}&capacity=5&period_ms=10000"),
    )
    .await;
    assert_eq!(
        (n(&v, "remaining"), n(&v, "debt"), n(&v, "used")),
        (0, 3, 8),
        "{v}"
    );
    assert!(
        n(&v, "reset_ms") > 15_000 && n(&v, "reset_ms") <= 16_000,
        "{v}"
    );

    // The windows: their counts and when they end, each its own bucket beside the token bucket's.
    for alg in ["fixed_window", "sliding_window"] {
        let q = format!("key={key}&capacity=3&period_ms=60000&algorithm={alg}");
        for _ in 0..2 {
            assert!(allowed(&client, &svc, with_alg(bucket(&key, 3, 3, 60_000, 1), alg)).await);
        }
        let (_, v) = inspect(&client, &svc, &q).await;
        assert_eq!(
            (v["exists"].clone(), n(&v, "remaining"), n(&v, "used")),
            (json!(true), 1, 2),
            "{alg}: {v}"
        );
        assert!(
            n(&v, "reset_ms") > 0 && n(&v, "reset_ms") <= 120_000,
            "{alg}: {v}"
        );
        let (_, r) = reset(&client, &svc, &json!({ "key": key, "algorithm": alg })).await;
        assert_eq!(r, json!({ "reset": true }), "{alg}");
        let (_, v) = inspect(&client, &svc, &q).await;
        assert_eq!((n(&v, "remaining"), n(&v, "used")), (3, 0), "{alg}: {v}");
    }

    // Concurrency: the live slots and their deadlines; a reset frees them all.
    let cc = unique("cc");
    let slot = SlotSpec {
        key: cc.clone(),
        limit: 2,
        ttl_ms: 30_000,
    };
    for id in ["a", "b"] {
        assert!(
            store
                .acquire(std::slice::from_ref(&slot), id)
                .await
                .unwrap()
                .allowed
        );
    }
    let q = format!("kind=concurrency&key={cc}");
    let (s, v) = inspect(&client, &svc, &q).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(n(&v, "in_flight"), 2, "{v}");
    let deadlines = v["deadlines_ms"].as_array().expect("deadlines");
    assert_eq!(deadlines.len(), 2, "{v}");
    assert!(
        deadlines
            .iter()
            .all(|d| d.as_u64().is_some_and(|d| d > 25_000 && d <= 30_000)),
        "{v}"
    );
    assert!(
        !store
            .acquire(std::slice::from_ref(&slot), "c")
            .await
            .unwrap()
            .allowed
    );
    let (_, r) = reset(&client, &svc, &json!({ "kind": "concurrency", "key": cc })).await;
    assert_eq!(r, json!({ "reset": true }));
    let (_, v) = inspect(&client, &svc, &q).await;
    assert_eq!(v, json!({ "in_flight": 0, "deadlines_ms": [] }));
    assert!(
        store
            .acquire(std::slice::from_ref(&slot), "c")
            .await
            .unwrap()
            .allowed
    );

    // A bucket never charged reads as full and owing nothing; nothing is created by reading it.
    let (_, v) = inspect(
        &client,
        &svc,
        &format!("key={}&capacity=7&period_ms=1000", unique("none")),
    )
    .await;
    assert_eq!(
        v,
        json!({ "exists": false, "remaining": 7, "debt": 0, "used": 0, "reset_ms": 0 })
    );

    // A bad query or body names its field, and touches nothing.
    for (q, field) in [
        (format!("key={key}&period_ms=1000"), "capacity"),
        (format!("key={key}&capacity=0&period_ms=1000"), "capacity"),
        ("capacity=1&period_ms=1000".to_string(), "key"),
        (
            format!("key={key}&capacity=1&period_ms=1000&lease=2"),
            "lease",
        ),
        (format!("key={key}&kind=slots"), "kind"),
    ] {
        let (s, v) = inspect(&client, &svc, &q).await;
        assert_eq!(
            (s, v["error"]["field"].clone()),
            (400, json!(field)),
            "{q}: {v}"
        );
    }
    let (s, v) = reset(&client, &svc, &json!({ "key": key, "algorithm": "leaky" })).await;
    assert_eq!(
        (s, v["error"]["field"].clone()),
        (400, json!("algorithm")),
        "{v}"
    );
    svc.stop().await;
}

#[tokio::test]
async fn memory_inspect_and_reset() {
    inspect_and_reset(common::memory_store()).await;
}

#[tokio::test]
async fn redis_inspect_and_reset() {
    let redis = RedisProc::start();
    inspect_and_reset(Arc::new(redis_store(&redis.url(), 1000))).await;
}

/// Reading a bucket on Redis writes nothing: its hash and its TTL stay as the take left them
/// (the TTL only runs down), and a bucket never charged is not created.
#[tokio::test]
async fn redis_inspection_writes_nothing() {
    let redis = RedisProc::start();
    let svc = admin_service(Arc::new(redis_store(&redis.url(), 1000))).await;
    let client = reqwest::Client::new();
    let key = unique("ro");
    assert!(allowed(&client, &svc, bucket(&key, 5, 5, 10_000, 3)).await);
    let hkey = format!("test:tb:{{{key}}}");
    let read = |args: &[&str]| redis.cmd(args).unwrap_or_default();
    let (hash, ttl) = (
        read(&["HGETALL", &hkey]),
        read(&["PTTL", &hkey]).trim().parse::<i64>().unwrap(),
    );
    assert!(ttl > 0, "{ttl}");
    for _ in 0..5 {
        let (s, _) = inspect(
            &client,
            &svc,
            &format!("key={key}&capacity=5&period_ms=10000"),
        )
        .await;
        assert_eq!(s, 200);
    }
    assert_eq!(read(&["HGETALL", &hkey]), hash);
    let after = read(&["PTTL", &hkey]).trim().parse::<i64>().unwrap();
    assert!(after > 0 && after <= ttl, "{ttl} then {after}");
    let none = unique("none");
    inspect(
        &client,
        &svc,
        &format!("key={none}&capacity=5&period_ms=10000"),
    )
    .await;
    assert_eq!(
        read(&["EXISTS", &format!("test:tb:{{{none}}}")]).trim(),
        "0"
    );
    svc.stop().await;
}

/// On a Cluster, each bucket is one key in its own hash slot: keys whose braces would move the
/// hash tag are read and reset as any other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_inspect_and_reset() {
    let nodes = common::start_cluster(3);
    let store: Arc<dyn Store> = Arc::new(common::cluster_store(&nodes, 1000));
    inspect_and_reset(store.clone()).await;
    let svc = admin_service(store).await;
    let client = reqwest::Client::new();
    for key in ["{a}b", "x{y}", "}{", "tenant:{42}"] {
        let q = format!(
            "key={}&capacity=2&period_ms=60000",
            url::form_urlencoded::byte_serialize(key.as_bytes()).collect::<String>()
        );
        assert!(allowed(&client, &svc, bucket(key, 2, 2, 60_000, 2)).await);
        let (_, v) = inspect(&client, &svc, &q).await;
        assert_eq!((n(&v, "remaining"), n(&v, "used")), (0, 2), "{key}: {v}");
        let (_, r) = reset(&client, &svc, &json!({ "key": key })).await;
        assert_eq!(r, json!({ "reset": true }), "{key}");
        assert!(
            allowed(&client, &svc, bucket(key, 2, 2, 60_000, 2)).await,
            "{key}"
        );
    }
    svc.stop().await;
}

/// The statuses of an inspection (with its body) and a reset sent with `token` as the bearer.
async fn statuses(
    client: &reqwest::Client,
    svc: &Service,
    token: Option<&str>,
) -> ((u16, Value), u16) {
    let mut get = client.get(svc.url("/v1/buckets?key=k&capacity=1&period_ms=1000"));
    let mut post = client
        .post(svc.url("/v1/buckets/reset"))
        .json(&json!({ "key": "k" }));
    if let Some(t) = token {
        get = get.bearer_auth(t);
        post = post.bearer_auth(t);
    }
    let (g, p) = (get.send().await.unwrap(), post.send().await.unwrap());
    let status = g.status().as_u16();
    (
        (status, g.json().await.unwrap_or(Value::Null)),
        p.status().as_u16(),
    )
}

/// Without an admin token the endpoints do not exist (404); with one, only it opens them: no
/// token, the takes' token or a wrong one is 401, and the admin token does not open takes.
#[tokio::test]
async fn only_the_admin_token_opens_them() {
    let client = reqwest::Client::new();
    let reset_body = json!({ "key": "k" });

    let off = Service::start(common::memory_store(), Some(TAKES)).await;
    for token in [None, Some(TAKES), Some(ADMIN)] {
        let ((g, body), p) = statuses(&client, &off, token).await;
        assert_eq!((g, p), (404, 404), "{token:?}");
        assert_eq!(body["error"]["code"], json!("not_found"), "{body}");
    }
    off.stop().await;

    let on = Service::start_with(
        common::memory_store(),
        ServiceConfig {
            token: Some(TAKES.into()),
            admin_token: Some(ADMIN.into()),
            ..ServiceConfig::default()
        },
    )
    .await;
    for token in [
        None,
        Some(TAKES),
        Some("admin-secre"),
        Some("admin-secretX"),
    ] {
        let ((g, _), p) = statuses(&client, &on, token).await;
        assert_eq!((g, p), (401, 401), "{token:?}");
    }
    let (s, _) = inspect(&client, &on, "key=k&capacity=1&period_ms=1000").await;
    assert_eq!(s, 200);
    let (s, _) = reset(&client, &on, &reset_body).await;
    assert_eq!(s, 200);
    let take = client
        .post(on.url("/v1/take"))
        .bearer_auth(ADMIN)
        .json(&json!({ "buckets": [bucket("k", 1, 1, 1000, 1)] }))
        .send()
        .await
        .unwrap();
    assert_eq!(take.status().as_u16(), 401, "the admin token does not take");
    on.stop().await;
}

/// The gRPC form (`tollgate.admin.v1.Admin`): the same reading and reset, the same token rules.
async fn over_grpc(store: Arc<dyn Store>) {
    use tollgate_server::api::grpc::admin_pb::{admin_client::AdminClient, BucketRef};
    let svc = Service::start_with(
        store,
        ServiceConfig {
            token: Some(TAKES.into()),
            admin_token: Some(ADMIN.into()),
            ..ServiceConfig::default()
        },
    )
    .await;
    let client = reqwest::Client::new();
    let key = unique("grpc");
    let take = client
        .post(svc.url("/v1/take"))
        .bearer_auth(TAKES)
        .json(&json!({ "buckets": [bucket(&key, 5, 5, 10_000, 3)] }))
        .send()
        .await
        .unwrap();
    assert_eq!(take.status().as_u16(), 200);
    let mut admin = AdminClient::connect(format!("http://{}", svc.addr))
        .await
        .expect("connect");
    let with = |token: Option<&str>, r: BucketRef| {
        let mut req = tonic::Request::new(r);
        if let Some(t) = token {
            req.metadata_mut()
                .insert("authorization", format!("Bearer {t}").parse().unwrap());
        }
        req
    };
    let tb = BucketRef {
        key: key.clone(),
        capacity: 5,
        period_ms: 10_000,
        ..BucketRef::default()
    };
    let v = admin
        .inspect_bucket(with(Some(ADMIN), tb.clone()))
        .await
        .expect("inspect")
        .into_inner();
    assert_eq!((v.exists, v.remaining, v.used), (true, 2, 3), "{v:?}");
    assert!(v.reset_ms > 5_000 && v.reset_ms <= 6_000, "{v:?}");
    for token in [None, Some(TAKES)] {
        let e = admin
            .inspect_bucket(with(token, tb.clone()))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated, "{token:?}");
    }
    let e = admin
        .inspect_bucket(with(
            Some(ADMIN),
            BucketRef {
                capacity: 0,
                ..tb.clone()
            },
        ))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert!(e.message().contains("capacity"), "{e:?}");
    let r = admin
        .reset_bucket(with(Some(ADMIN), tb.clone()))
        .await
        .expect("reset")
        .into_inner();
    assert!(r.reset);
    let v = admin
        .inspect_bucket(with(Some(ADMIN), tb))
        .await
        .unwrap()
        .into_inner();
    assert_eq!((v.exists, v.remaining), (false, 5), "{v:?}");
    svc.stop().await;

    let off = Service::start(common::memory_store(), None).await;
    let mut admin = AdminClient::connect(format!("http://{}", off.addr))
        .await
        .expect("connect");
    let e = admin
        .reset_bucket(with(Some(ADMIN), BucketRef::default()))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound, "{e:?}");
    off.stop().await;
}

#[tokio::test]
async fn memory_over_grpc() {
    over_grpc(common::memory_store()).await;
}

#[tokio::test]
async fn redis_over_grpc() {
    let redis = RedisProc::start();
    over_grpc(Arc::new(redis_store(&redis.url(), 1000))).await;
}

/// A calendar bucket inspected: its count, and its period as RFC 3339 in its zone.
async fn a_calendar_bucket_shows_its_period(store: Arc<dyn Store>) {
    let svc = admin_service(store).await;
    let client = reqwest::Client::new();
    let key = common::unique("cal-inspect");
    let b = json!({"key": key, "capacity": 500, "period_ms": 2_678_400_000u64, "cost": 20,
        "algorithm": "calendar_window", "calendar": "month", "time_zone": "Europe/Berlin"});
    assert!(allowed(&client, &svc, b).await);
    let (s, v) = inspect(
        &client,
        &svc,
        &format!(
            "key={key}&capacity=500&period_ms=2678400000&algorithm=calendar_window\
             &calendar=month&time_zone=Europe%2FBerlin"
        ),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        (v["exists"].as_bool(), v["used"].as_u64()),
        (Some(true), Some(20)),
        "{v}"
    );
    let p = &v["period"];
    let start = p["start"].as_str().unwrap_or_default();
    let end = p["end"].as_str().unwrap_or_default();
    // The 1st at midnight in Berlin, whichever offset it has then.
    assert!(
        start.get(7..19) == Some("-01T00:00:00") && end.get(7..19) == Some("-01T00:00:00"),
        "{v}"
    );
    let reset = v["reset_ms"].as_u64().unwrap_or_default();
    let end_ms = p["end_ms"].as_u64().unwrap_or_default();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    assert!((now + reset).abs_diff(end_ms) < 2_000, "{v}");
    svc.stop().await;
}

#[tokio::test]
async fn memory_a_calendar_bucket_shows_its_period() {
    a_calendar_bucket_shows_its_period(common::memory_store()).await;
}

#[tokio::test]
async fn redis_a_calendar_bucket_shows_its_period() {
    let redis = RedisProc::start();
    a_calendar_bucket_shows_its_period(Arc::new(redis_store(&redis.url(), 1000))).await;
}
