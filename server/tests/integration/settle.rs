//! Settles (`POST /v1/settle`, gRPC `Settle`, `Store::settle`): a reservation settled once its
//! response said what it used. Over the memory store and real Redis (standalone and Cluster):
//! a refund is taken again, an extra charge puts a token bucket into debt and takes wait exactly
//! until it has refilled, an id is applied once, a fixed window is charged in its window only,
//! and every invalid field is named. The fixtures of `settle_cases` are read by both codecs.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{bucket, post_take, redis_store, unique, RedisProc, Service};
use serde_json::{json, Value};
use tollgate_server::store::Store;

const HOUR: u64 = 3_600_000;

async fn post_settle(client: &reqwest::Client, svc: &Service, body: &Value) -> (u16, Value) {
    let r = client
        .post(svc.url("/v1/settle"))
        .json(body)
        .send()
        .await
        .expect("settle sent");
    let status = r.status().as_u16();
    (status, r.json().await.expect("a JSON body"))
}

/// A settle of one bucket: the bucket as its take named it, and the amounts.
fn settle(
    id: &str,
    key: &str,
    cap: u64,
    rate: u64,
    period: u64,
    estimate: u64,
    used: u64,
) -> Value {
    json!({"id": id, "buckets": [{
        "key": key, "capacity": cap, "rate": rate, "period_ms": period,
        "estimate": estimate, "used": used,
    }]})
}

async fn take(client: &reqwest::Client, svc: &Service, b: Value) -> Value {
    let (s, body) = post_take(client, svc, &json!({ "buckets": [b] })).await;
    assert_eq!(s, 200, "{body}");
    body
}

/// A refund, a repeated id, an extra charge into debt (in full) and a refund out
/// of it, on a bucket that does not refill during the test: every number is exact.
async fn refund_debt_and_dedupe(store: Arc<dyn Store>) {
    let svc = Service::start(store, None).await;
    let client = reqwest::Client::new();
    let key = unique("slow");
    let b = |cost| bucket(&key, 10, 10, HOUR, cost);
    assert_eq!(
        take(&client, &svc, b(5)).await["buckets"][0]["remaining"],
        5
    );
    // Used 2 of the 5 reserved: 3 come back.
    let s1 = settle("p-1", &key, 10, 10, HOUR, 5, 2);
    let (s, body) = post_settle(&client, &svc, &s1).await;
    assert_eq!(
        (s, body),
        (
            200,
            json!({"duplicate": false, "buckets": [{"remaining": 8}]})
        )
    );
    // The same id again (its answer was lost): nothing more comes back.
    let (s, body) = post_settle(&client, &svc, &s1).await;
    assert_eq!(
        (s, body),
        (
            200,
            json!({"duplicate": true, "buckets": [{"remaining": 8}]})
        )
    );
    // Used 12 where 2 were reserved: 10 more, of 8 held, owes 2.
    let (s, body) = post_settle(&client, &svc, &settle("p-2", &key, 10, 10, HOUR, 2, 12)).await;
    assert_eq!(
        (s, body),
        (
            200,
            json!({"duplicate": false, "buckets": [{"remaining": 0, "debt": 2}]})
        )
    );
    // A debt is charged in full, past minus the capacity: 1,000 more owes 1,002.
    let (s, body) = post_settle(&client, &svc, &settle("p-3", &key, 10, 10, HOUR, 0, 1000)).await;
    assert_eq!(
        (s, body),
        (
            200,
            json!({"duplicate": false, "buckets": [{"remaining": 0, "debt": 1002}]})
        )
    );
    // A take now waits for the whole deficit: 1,002 owed + 1 token, at 10 an hour (a few ms of
    // refill may have passed).
    let d = take(&client, &svc, b(1)).await;
    assert_eq!(d["allowed"], json!(false), "{d}");
    assert_eq!(d["buckets"][0]["remaining"], json!(0), "{d}");
    let retry = d["buckets"][0]["retry_after_ms"].as_u64().unwrap();
    assert!(
        (1003 * HOUR / 10 - 60_000..=1003 * HOUR / 10).contains(&retry),
        "{d}"
    );
    // Giving 1,002 back pays the debt: nothing owed, nothing whole held yet.
    let (s, body) = post_settle(&client, &svc, &settle("p-4", &key, 10, 10, HOUR, 1002, 0)).await;
    assert_eq!(
        (s, body),
        (
            200,
            json!({"duplicate": false, "buckets": [{"remaining": 0}]})
        )
    );
    // A bucket never charged is full: a refund gives nothing back and it stays full.
    let fresh = unique("fresh");
    let (s, body) = post_settle(&client, &svc, &settle("p-5", &fresh, 10, 10, HOUR, 4, 1)).await;
    assert_eq!(
        (s, body),
        (
            200,
            json!({"duplicate": false, "buckets": [{"remaining": 10}]})
        )
    );
    let metrics = common::get_text(svc.url("/metrics")).await;
    assert!(
        metrics.contains("tollgate_settlements_total{outcome=\"applied\"} 5"),
        "{metrics}"
    );
    assert!(
        metrics.contains("tollgate_settlements_total{outcome=\"duplicate\"} 1"),
        "{metrics}"
    );
    svc.stop().await;
}

/// Overshoots settled one after the other add up, nothing forgiven, down to the contract's floor
/// (`MAX_DEBT`, where the arithmetic would stop being exact); a repeated id adds nothing.
async fn overshoots_add_up_to_the_floor(store: Arc<dyn Store>) {
    let svc = Service::start(store, None).await;
    let client = reqwest::Client::new();
    let key = unique("deep");
    assert_eq!(
        take(&client, &svc, bucket(&key, 10, 10, HOUR, 10)).await["allowed"],
        json!(true)
    );
    // 24 responses that each reported 3,000 for an estimate of 1.
    for i in 0..24 {
        let id = format!("o-{i}");
        let (s, body) = post_settle(&client, &svc, &settle(&id, &key, 10, 10, HOUR, 1, 3000)).await;
        assert_eq!(s, 200, "{body}");
        assert_eq!(body["buckets"][0]["debt"], json!(2999 * (i + 1)), "{body}");
        let (_, again) =
            post_settle(&client, &svc, &settle(&id, &key, 10, 10, HOUR, 1, 3000)).await;
        assert_eq!(again["duplicate"], json!(true), "{again}");
        assert_eq!(
            again["buckets"][0]["debt"],
            json!(2999 * (i + 1)),
            "{again}"
        );
    }
    // The floor: 9 settles of the largest amount owe MAX_DEBT, not more.
    let max = contract::bounds::MAX_AMOUNT;
    let mut debt = 0;
    for i in 0..9 {
        let s = settle(&format!("m-{i}"), &key, 10, 10, HOUR, 0, max);
        let (_, body) = post_settle(&client, &svc, &s).await;
        debt = body["buckets"][0]["debt"].as_u64().unwrap();
    }
    assert_eq!(debt, contract::bounds::MAX_DEBT);
    svc.stop().await;
}

/// 10 tokens a second: empty it, settle 5 more than reserved, and takes are denied until the
/// debt has refilled (about 600 ms: 5 owed + the 1 a take needs), then admitted.
async fn debt_refills_then_takes_pass(store: Arc<dyn Store>) {
    let svc = Service::start(store, None).await;
    let client = reqwest::Client::new();
    let key = unique("fast");
    let b = |cost| bucket(&key, 10, 10, 1000, cost);
    assert_eq!(take(&client, &svc, b(10)).await["allowed"], json!(true));
    let settled_at = Instant::now();
    let (s, body) = post_settle(&client, &svc, &settle("f-1", &key, 10, 10, 1000, 10, 15)).await;
    assert_eq!(s, 200, "{body}");
    // Less than a token may have refilled since the take (under 100 ms on this path).
    let debt = body["buckets"][0]["debt"].as_u64().unwrap();
    assert!((4..=5).contains(&debt), "{body}");
    let d = take(&client, &svc, b(1)).await;
    assert_eq!(d["allowed"], json!(false), "{d}");
    let retry = d["buckets"][0]["retry_after_ms"].as_u64().unwrap();
    assert!((450..=600).contains(&retry), "the whole deficit: {d}");
    // Half-way, still owing: denied.
    tokio::time::sleep(Duration::from_millis(250)).await;
    let d = take(&client, &svc, b(1)).await;
    assert_eq!(d["allowed"], json!(false), "{d}");
    // Once the debt has refilled (600 ms after the settle at most), a take passes.
    let due = settled_at + Duration::from_millis(620);
    tokio::time::sleep_until(due.into()).await;
    let d = take(&client, &svc, b(1)).await;
    assert_eq!(d["allowed"], json!(true), "{d}");
    svc.stop().await;
}

/// A fixed window: an extra charge without a window counts in the current window (in full); a refund needs the window it was charged in; another window is left alone.
async fn fixed_window_charged_in_its_window(store: Arc<dyn Store>) {
    let svc = Service::start(store, None).await;
    let client = reqwest::Client::new();
    let key = unique("fw");
    let mut b = bucket(&key, 10, 10, HOUR, 4);
    b["algorithm"] = json!("fixed_window");
    assert_eq!(
        take(&client, &svc, b.clone()).await["buckets"][0]["remaining"],
        6
    );
    let fw = |id: &str, estimate: u64, used: u64, window: Option<u64>| {
        let mut s = settle(id, &key, 10, 10, HOUR, estimate, used);
        s["buckets"][0]["algorithm"] = json!("fixed_window");
        if let Some(w) = window {
            s["buckets"][0]["window"] = json!(w);
        }
        s
    };
    // 5 more than the 4 reserved: 9 of 10 used.
    let (s, body) = post_settle(&client, &svc, &fw("w-1", 4, 9, None)).await;
    assert_eq!(
        (s, body),
        (
            200,
            json!({"duplicate": false, "buckets": [{"remaining": 1}]})
        )
    );
    // A refund without its window is dropped; one naming another window too.
    for (id, window) in [("w-2", None), ("w-3", Some(1u64))] {
        let (s, body) = post_settle(&client, &svc, &fw(id, 9, 0, window)).await;
        assert_eq!(
            (s, body),
            (
                200,
                json!({"duplicate": false, "buckets": [{"remaining": 1}]})
            )
        );
    }
    // Over the capacity: counted in full, owed until the window ends.
    let (s, body) = post_settle(&client, &svc, &fw("w-4", 0, 1000, None)).await;
    assert_eq!(
        (s, body),
        (
            200,
            json!({"duplicate": false, "buckets": [{"remaining": 0, "debt": 999}]})
        )
    );
    let d = take(&client, &svc, {
        let mut one = b.clone();
        one["cost"] = json!(1);
        one
    })
    .await;
    assert_eq!(d["allowed"], json!(false), "{d}");
    svc.stop().await;
}

/// Every invalid field is refused with its name, and nothing is applied.
async fn invalid_fields_are_named(store: Arc<dyn Store>) {
    let svc = Service::start(store, None).await;
    let client = reqwest::Client::new();
    let key = unique("bad");
    let good = settle("v-1", &key, 10, 10, HOUR, 3, 5);
    let with = |path: &[&str], v: Value| {
        let mut s = good.clone();
        let mut at = &mut s;
        for (i, p) in path.iter().enumerate() {
            if i + 1 == path.len() {
                at[*p] = v.clone();
            } else if let Ok(n) = p.parse::<usize>() {
                at = &mut at[n];
            } else {
                at = &mut at[*p];
            }
        }
        s
    };
    let mut no_id = good.clone();
    no_id.as_object_mut().unwrap().remove("id");
    let mut no_used = good.clone();
    no_used["buckets"][0]
        .as_object_mut()
        .unwrap()
        .remove("used");
    let many = json!({"id": "v-2", "buckets": vec![good["buckets"][0].clone(); 17]});
    let cases = [
        (no_id, "id"),
        (with(&["id"], json!("has space")), "id"),
        (with(&["id"], json!("")), "id"),
        (with(&["id"], json!("x".repeat(129))), "id"),
        (with(&["id"], json!(7)), "id"),
        (with(&["buckets"], json!([])), "buckets"),
        (many, "buckets"),
        (with(&["extra"], json!(1)), "extra"),
        (no_used, "buckets[0].used"),
        (
            with(&["buckets", "0", "estimate"], json!(1_000_000_001u64)),
            "buckets[0].estimate",
        ),
        (
            with(&["buckets", "0", "used"], json!(-1)),
            "buckets[0].used",
        ),
        (with(&["buckets", "0", "cost"], json!(1)), "buckets[0].cost"),
        (
            with(&["buckets", "0", "capacity"], json!(0)),
            "buckets[0].capacity",
        ),
        (with(&["buckets", "0", "key"], json!("")), "buckets[0].key"),
        (
            with(&["buckets", "0", "window"], json!(3)),
            "buckets[0].window",
        ),
        (
            with(&["buckets", "0", "algorithm"], json!("gcra")),
            "buckets[0].algorithm",
        ),
        (
            with(&["buckets", "0", "rule"], json!("r\n")),
            "buckets[0].rule",
        ),
    ];
    for (body, field) in cases {
        let (s, reply) = post_settle(&client, &svc, &body).await;
        assert_eq!(s, 400, "{body} -> {reply}");
        assert_eq!(reply["error"]["field"], json!(field), "{body} -> {reply}");
    }
    // Nothing was charged by any of them: the bucket is full.
    let d = take(&client, &svc, bucket(&key, 10, 10, HOUR, 10)).await;
    assert_eq!(d["allowed"], json!(true), "{d}");
    svc.stop().await;
}

/// The same settle over gRPC: applied once, then `duplicate`; a missing id is INVALID_ARGUMENT.
async fn over_grpc(store: Arc<dyn Store>) {
    use tollgate_server::api::grpc::pb;
    let svc = Service::start(store, None).await;
    let mut c = svc.grpc().await;
    let key = unique("grpc");
    let req = |id: &str| pb::SettleRequest {
        instance: String::new(),
        id: id.into(),
        buckets: vec![pb::SettleBucket {
            key: key.clone(),
            capacity: 10,
            period_ms: HOUR,
            estimate: 1,
            used: 4,
            ..Default::default()
        }],
    };
    let r = c.settle(req("g-1")).await.unwrap().into_inner();
    assert!(!r.duplicate);
    assert_eq!((r.buckets[0].remaining, r.buckets[0].debt), (7, 0));
    let r = c.settle(req("g-1")).await.unwrap().into_inner();
    assert!(r.duplicate);
    assert_eq!(r.buckets[0].remaining, 7);
    let e = c.settle(req("")).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert!(e.message().contains("id"), "{e:?}");
    svc.stop().await;
}

/// A take with other limits carries a debt over like tokens: scaled to the new capacity, rounded
/// against the caller (owing 4 of 10 becomes owing 8 of 20).
async fn changed_limit_carries_the_debt(store: Arc<dyn Store>) {
    let svc = Service::start(store, None).await;
    let client = reqwest::Client::new();
    let key = unique("carry");
    assert_eq!(
        take(&client, &svc, bucket(&key, 10, 10, HOUR, 10)).await["allowed"],
        json!(true)
    );
    let (s, body) = post_settle(&client, &svc, &settle("c-1", &key, 10, 10, HOUR, 1, 5)).await;
    assert_eq!(
        (s, body),
        (
            200,
            json!({"duplicate": false, "buckets": [{"remaining": 0, "debt": 4}]})
        )
    );
    // Capacity 20 now: owes 8, so one token is 9 away at 10 an hour (a few ms of refill aside).
    let d = take(&client, &svc, bucket(&key, 20, 10, HOUR, 1)).await;
    assert_eq!(d["allowed"], json!(false), "{d}");
    assert_eq!(d["buckets"][0]["remaining"], json!(0), "{d}");
    let retry = d["buckets"][0]["retry_after_ms"].as_u64().unwrap();
    assert!(
        (9 * HOUR / 10 - 60_000..=9 * HOUR / 10).contains(&retry),
        "{d}"
    );
    // reset_ms counts the debt as well: 8 owed + 20 to fill.
    let reset = d["buckets"][0]["reset_ms"].as_u64().unwrap();
    assert!(
        (28 * HOUR / 10 - 60_000..=28 * HOUR / 10).contains(&reset),
        "{d}"
    );
    svc.stop().await;
}

async fn all(store: Arc<dyn Store>) {
    refund_debt_and_dedupe(store.clone()).await;
    overshoots_add_up_to_the_floor(store.clone()).await;
    changed_limit_carries_the_debt(store.clone()).await;
    debt_refills_then_takes_pass(store.clone()).await;
    fixed_window_charged_in_its_window(store.clone()).await;
    invalid_fields_are_named(store.clone()).await;
    over_grpc(store).await;
}

#[tokio::test]
async fn memory_settles() {
    all(common::memory_store()).await;
}

#[tokio::test]
async fn redis_settles() {
    let redis = RedisProc::start();
    all(Arc::new(redis_store(&redis.url(), 1000))).await;
    // Every key a settle wrote expires: the buckets and the ids' records.
    let keys = redis.cmd(&["KEYS", "test:*"]).unwrap_or_default();
    for k in keys.lines().filter(|k| !k.is_empty()) {
        let ttl: i64 = redis
            .cmd(&["PTTL", k])
            .and_then(|t| t.trim().parse().ok())
            .unwrap_or(-3);
        assert!(ttl > 0, "{k} has no TTL ({ttl})");
    }
    assert!(keys.contains("test:settled:{"), "{keys}");
}

/// A fixed window settled in the window its take charged: on Redis the window index is
/// floor(TIME in ms / period), which the test reads from the server.
#[tokio::test]
async fn redis_fixed_window_refund_in_its_window() {
    let redis = RedisProc::start();
    let svc = Service::start(Arc::new(redis_store(&redis.url(), 1000)), None).await;
    let client = reqwest::Client::new();
    let key = unique("fwmark");
    let mut b = bucket(&key, 10, 10, HOUR, 6);
    b["algorithm"] = json!("fixed_window");
    assert_eq!(take(&client, &svc, b).await["buckets"][0]["remaining"], 4);
    let time = redis.cmd(&["TIME"]).unwrap();
    let secs: u64 = time.lines().next().unwrap().trim().parse().unwrap();
    let window = secs * 1000 / HOUR;
    let mut s = settle("m-1", &key, 10, 10, HOUR, 6, 1);
    s["buckets"][0]["algorithm"] = json!("fixed_window");
    s["buckets"][0]["window"] = json!(window);
    let (st, body) = post_settle(&client, &svc, &s).await;
    assert_eq!(
        (st, body),
        (
            200,
            json!({"duplicate": false, "buckets": [{"remaining": 9}]})
        )
    );
    svc.stop().await;
}

/// Redis Cluster: a settle over buckets of two hash slots is one script per slot, each with the
/// id's record in its own slot; sent again, it is a duplicate in both and changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_settles_across_slots_once() {
    use tollgate_server::domain::{Algorithm, BucketSpec};
    use tollgate_server::store::keys::{redis_key, slot};
    let nodes = common::start_cluster(3);
    let store: Arc<dyn Store> = Arc::new(common::cluster_store(&nodes, 1000));
    let slot_of = |k: &str| {
        slot(&redis_key(
            "test:",
            &BucketSpec {
                key: k.into(),
                capacity: 1,
                rate: 1,
                period_ms: 1,
                cost: 1,
                algorithm: Algorithm::TokenBucket,
                lease: 1,
                max_delay_ms: 0,
            },
        ))
    };
    let a = unique("a");
    let b = (0..100)
        .map(|i| format!("{a}-other-{i}"))
        .find(|k| slot_of(k) != slot_of(&a))
        .unwrap();
    let svc = Service::start(store.clone(), None).await;
    let client = reqwest::Client::new();
    for k in [&a, &b] {
        assert_eq!(
            take(&client, &svc, bucket(k, 10, 10, HOUR, 5)).await["allowed"],
            json!(true)
        );
    }
    let body = json!({"id": "c-1", "buckets": [
        {"key": a, "capacity": 10, "rate": 10, "period_ms": HOUR, "estimate": 5, "used": 1},
        {"key": b, "capacity": 10, "rate": 10, "period_ms": HOUR, "estimate": 5, "used": 12},
    ]});
    let (s, reply) = post_settle(&client, &svc, &body).await;
    assert_eq!(
        (s, reply),
        (
            200,
            json!({"duplicate": false, "buckets": [{"remaining": 9}, {"remaining": 0, "debt": 2}]})
        )
    );
    let (s, reply) = post_settle(&client, &svc, &body).await;
    assert_eq!(
        (s, reply),
        (
            200,
            json!({"duplicate": true, "buckets": [{"remaining": 9}, {"remaining": 0, "debt": 2}]})
        )
    );
    svc.stop().await;
    // The whole suite holds on the Cluster too.
    refund_debt_and_dedupe(store.clone()).await;
    changed_limit_carries_the_debt(store.clone()).await;
    invalid_fields_are_named(store).await;
    drop(nodes);
}

/// contract/fixtures/cases.json, `settle_cases`: each request decodes to the same settle from
/// JSON and from protobuf, and each answer encodes to the fixture in both forms.
#[test]
fn settle_fixtures_agree_in_both_encodings() {
    use prost::Message;
    use tollgate_server::api::grpc::pb;
    use tollgate_server::domain::SettleResponse;
    use tollgate_server::ops::settle as op;
    let text = std::fs::read_to_string(common::workspace().join("contract/fixtures/cases.json"))
        .expect("read cases.json");
    let v: Value = serde_json::from_str(&text).expect("parse cases.json");
    let cases = v["settle_cases"].as_array().expect("settle_cases");
    assert!(cases.len() >= 4);
    let hex = |s: &Value| -> Vec<u8> {
        let s = s.as_str().expect("hex");
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex digit"))
            .collect()
    };
    for c in cases {
        let name = c["name"].as_str().expect("name");
        let req_json = serde_json::to_vec(&c["request_json"]).unwrap();
        let (req_pb, resp_pb) = (hex(&c["request_pb_hex"]), hex(&c["response_pb_hex"]));
        let from_json = op::validate(op::decode_json(&req_json).unwrap()).unwrap();
        let from_pb =
            op::validate(op::raw_from_pb(&pb::SettleRequest::decode(&*req_pb).unwrap()).unwrap())
                .unwrap();
        assert_eq!(from_json, from_pb, "{name}");
        let d: SettleResponse = serde_json::from_value(c["response_json"].clone()).unwrap();
        assert_eq!(
            serde_json::to_value(&d).unwrap(),
            c["response_json"],
            "{name}"
        );
        assert_eq!(op::pb_from_answer(&d).encode_to_vec(), resp_pb, "{name}");
        assert_eq!(
            pb::SettleResponse::decode(&*resp_pb).unwrap(),
            op::pb_from_answer(&d),
            "{name}"
        );
    }
}
