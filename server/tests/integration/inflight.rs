//! Concurrency slots (acquire / release): one suite over the memory store and real Redis, the
//! scripts' atomicity under concurrent acquires, the Redis key's TTL, and the JSON routes.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use tollgate_server::domain::SlotSpec;
use tollgate_server::ops::acquire::new_slot_id;
use tollgate_server::store::Store;

fn spec(key: &str, limit: u64, ttl_ms: u64) -> SlotSpec {
    SlotSpec {
        key: key.into(),
        limit,
        ttl_ms,
    }
}

async fn holds_at_most_the_limit_and_release_frees(s: Arc<dyn Store>) {
    let k = common::unique("cc");
    let a = [spec(&k, 2, 60_000)];
    let first = s.acquire(&a, &new_slot_id()).await.unwrap();
    let second = s.acquire(&a, &new_slot_id()).await.unwrap();
    assert!(first.allowed && second.allowed);
    assert_eq!(second.buckets[0].in_flight, 2);
    let third = s.acquire(&a, &new_slot_id()).await.unwrap();
    assert!(!third.allowed && third.slot.is_none());
    assert_eq!(third.buckets[0].in_flight, 2);
    assert_eq!(third.buckets[0].retry_after_ms, 1000);
    // Release once: true; twice: false (nothing left to give back).
    let id = first.slot.unwrap();
    assert_eq!(
        s.release(&id, std::slice::from_ref(&k)).await.unwrap(),
        vec![true]
    );
    assert_eq!(
        s.release(&id, std::slice::from_ref(&k)).await.unwrap(),
        vec![false]
    );
    let fourth = s.acquire(&a, &new_slot_id()).await.unwrap();
    assert!(fourth.allowed, "{fourth:?}");
}

async fn all_or_nothing(s: Arc<dyn Store>) {
    let (a, b) = (common::unique("a"), common::unique("b"));
    assert!(
        s.acquire(&[spec(&b, 1, 60_000)], &new_slot_id())
            .await
            .unwrap()
            .allowed
    );
    let d = s
        .acquire(&[spec(&a, 5, 60_000), spec(&b, 1, 60_000)], &new_slot_id())
        .await
        .unwrap();
    assert!(!d.allowed);
    assert!(d.buckets[0].allowed && !d.buckets[1].allowed);
    assert_eq!(d.buckets[0].in_flight, 0, "a was not taken: {d:?}");
    // `a` is untouched: 5 slots are still free.
    for _ in 0..5 {
        assert!(
            s.acquire(&[spec(&a, 5, 60_000)], &new_slot_id())
                .await
                .unwrap()
                .allowed
        );
    }
}

async fn a_slot_comes_back_after_its_deadline(s: Arc<dyn Store>) {
    let k = common::unique("ttl");
    let a = [spec(&k, 1, 300)];
    assert!(s.acquire(&a, &new_slot_id()).await.unwrap().allowed);
    let denied = s.acquire(&a, &new_slot_id()).await.unwrap();
    assert!(!denied.allowed);
    let r = denied.buckets[0].retry_after_ms;
    assert!((1..=300).contains(&r), "retry_after_ms {r}");
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert!(
        !s.acquire(&a, &new_slot_id()).await.unwrap().allowed,
        "not before the deadline"
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        s.acquire(&a, &new_slot_id()).await.unwrap().allowed,
        "after it"
    );
}

async fn concurrent_acquires_never_exceed_the_limit(s: Arc<dyn Store>) {
    let k = common::unique("race");
    let tasks: Vec<_> = (0..64)
        .map(|_| {
            let (s, k) = (s.clone(), k.clone());
            tokio::spawn(async move {
                s.acquire(&[spec(&k, 7, 60_000)], &new_slot_id())
                    .await
                    .unwrap()
                    .allowed
            })
        })
        .collect();
    let mut admitted = 0;
    for t in tasks {
        admitted += usize::from(t.await.unwrap());
    }
    assert_eq!(admitted, 7);
}

/// A caller that names its slots (the filter does, so that it can release them when its acquire
/// timed out after the store took them): asking again under the same id is the same slot, and a
/// release by that id frees it, answer or no answer.
async fn a_named_slot_is_taken_once_and_released_by_its_name(s: Arc<dyn Store>) {
    let k = common::unique("named");
    let a = [spec(&k, 2, 60_000)];
    let id = new_slot_id();
    let first = s.acquire(&a, &id).await.unwrap();
    assert_eq!(first.slot.as_deref(), Some(id.as_str()));
    let again = s.acquire(&a, &id).await.unwrap();
    assert!(again.allowed, "{again:?}");
    assert_eq!(again.buckets[0].in_flight, 1, "the same slot, not a second");
    let other = s.acquire(&a, &new_slot_id()).await.unwrap();
    assert_eq!(other.buckets[0].in_flight, 2);
    assert_eq!(
        s.release(&id, std::slice::from_ref(&k)).await.unwrap(),
        vec![true]
    );
    let after = s.acquire(&a, &new_slot_id()).await.unwrap();
    assert!(
        after.allowed && after.buckets[0].in_flight == 2,
        "{after:?}"
    );
}

/// The filter releases a slot by name when its acquire failed; under load that release can reach
/// the store before the acquire itself: the late acquire then takes nothing.
async fn an_acquire_that_arrives_after_its_release_takes_nothing(s: Arc<dyn Store>) {
    let k = common::unique("late");
    let a = [spec(&k, 1, 60_000)];
    let id = new_slot_id();
    assert_eq!(
        s.release(&id, std::slice::from_ref(&k)).await.unwrap(),
        vec![false]
    );
    let late = s.acquire(&a, &id).await.unwrap();
    assert!(!late.allowed && late.slot.is_none(), "{late:?}");
    assert_eq!(late.buckets[0].in_flight, 0);
    let other = s.acquire(&a, &new_slot_id()).await.unwrap();
    assert!(other.allowed, "the slot is free for others: {other:?}");
}

crate::store_suite!(
    multi_thread:
    holds_at_most_the_limit_and_release_frees,
    a_named_slot_is_taken_once_and_released_by_its_name,
    an_acquire_that_arrives_after_its_release_takes_nothing,
    all_or_nothing,
    a_slot_comes_back_after_its_deadline,
    concurrent_acquires_never_exceed_the_limit,
);

#[tokio::test]
async fn redis_sets_carry_a_ttl_and_go_when_empty() {
    let r = common::RedisProc::start();
    let s = common::redis_store(&r.url(), 500);
    let d = s.acquire(&[spec("t{1}", 3, 5_000)], "ab12").await.unwrap();
    assert!(d.allowed);
    let key = "test:cc:{t%7B1%7D}";
    let pttl: i64 = r.cmd(&["PTTL", key]).unwrap().trim().parse().unwrap();
    assert!((1..=5_000).contains(&pttl), "PTTL {pttl}");
    assert_eq!(
        s.release("ab12", &["t{1}".into()]).await.unwrap(),
        vec![true]
    );
    assert_eq!(r.cmd(&["EXISTS", key]).unwrap().trim(), "0");
}

#[tokio::test]
async fn json_routes_validate_and_answer() {
    let svc = common::Service::start(common::memory_store(), Some("tok")).await;
    let c = reqwest::Client::new();
    let post = |path: &'static str, body: Value, auth: bool| {
        let mut r = c.post(svc.url(path)).json(&body);
        if auth {
            r = r.bearer_auth("tok");
        }
        async move {
            let resp = r.send().await.unwrap();
            let status = resp.status().as_u16();
            (status, resp.json::<Value>().await.unwrap_or(Value::Null))
        }
    };
    let one = json!({"buckets":[{"key":"k","limit":1,"ttl_ms":10_000}]});
    assert_eq!(post("/v1/acquire", one.clone(), false).await.0, 401);
    let (st, ok) = post("/v1/acquire", one.clone(), true).await;
    assert_eq!(st, 200, "{ok}");
    assert_eq!(ok["allowed"], true);
    let slot = ok["slot"].as_str().unwrap().to_string();
    let (_, no) = post("/v1/acquire", one.clone(), true).await;
    assert_eq!(no["allowed"], false);
    assert!(no.get("slot").is_none());
    assert_eq!(
        no["buckets"][0],
        json!({"allowed":false,"limit":1,"in_flight":1,"retry_after_ms":1000})
    );
    let (st, err) = post(
        "/v1/acquire",
        json!({"buckets":[{"key":"k","limit":0,"ttl_ms":1}]}),
        true,
    )
    .await;
    assert_eq!(st, 400);
    assert_eq!(err["error"]["field"], "buckets[0].limit", "{err}");
    let (st, rel) = post("/v1/release", json!({"slot": slot, "keys": ["k"]}), true).await;
    assert_eq!((st, rel), (200, json!({"released":[true]})));
    // The caller may name its slots; a name that is not a slot id is refused by field.
    let named = json!({"slot": "00ff", "buckets":[{"key":"k","limit":1,"ttl_ms":10_000}]});
    let (st, ok) = post("/v1/acquire", named, true).await;
    assert_eq!((st, &ok["slot"]), (200, &json!("00ff")), "{ok}");
    let bad = json!({"slot": "not hex", "buckets":[{"key":"k","limit":1,"ttl_ms":10_000}]});
    let (st, err) = post("/v1/acquire", bad, true).await;
    assert_eq!((st, &err["error"]["field"]), (400, &json!("slot")), "{err}");
    let (st, rel) = post("/v1/release", json!({"slot": "00ff", "keys": ["k"]}), true).await;
    assert_eq!((st, rel), (200, json!({"released":[true]})));
    let (st, err) = post("/v1/release", json!({"slot": "zz", "keys": ["k"]}), true).await;
    assert_eq!((st, &err["error"]["field"]), (400, &json!("slot")));
    let (_, again) = post("/v1/release", json!({"slot": slot, "keys": ["k"]}), true).await;
    assert_eq!(
        again,
        json!({"released":[false]}),
        "released twice: harmless"
    );
    let m = common::get_text(svc.url("/metrics")).await;
    for line in [
        "tollgate_slots_total{outcome=\"acquired\"} 2",
        "tollgate_slots_total{outcome=\"limited\"} 1",
        "tollgate_slots_total{outcome=\"released\"} 2",
        "tollgate_slots_total{outcome=\"already_free\"} 1",
    ] {
        assert!(m.contains(line), "{line} in\n{m}");
    }
    svc.stop().await;
}

#[tokio::test]
async fn grpc_acquire_and_release() {
    use tollgate_server::api::grpc::pb;
    let r = common::RedisProc::start();
    let svc = common::Service::start(Arc::new(common::redis_store(&r.url(), 500)), None).await;
    let mut c = svc.grpc().await;
    let one = || pb::AcquireRequest {
        instance: String::new(),
        slot: String::new(),
        buckets: vec![pb::SlotBucket {
            key: "g".into(),
            limit: 1,
            ttl_ms: 10_000,
        }],
    };
    let held = c.acquire(one()).await.unwrap().into_inner();
    assert!(held.allowed && held.slot.len() == 32, "{held:?}");
    let full = c.acquire(one()).await.unwrap().into_inner();
    assert!(!full.allowed && full.slot.is_empty());
    assert_eq!(full.buckets[0].in_flight, 1);
    assert_eq!(full.buckets[0].retry_after_ms, 1000);
    let bad = c
        .acquire(pb::AcquireRequest {
            instance: String::new(),
            slot: String::new(),
            buckets: vec![pb::SlotBucket {
                key: "g".into(),
                limit: 0,
                ttl_ms: 1,
            }],
        })
        .await
        .unwrap_err();
    assert_eq!(bad.code(), tonic::Code::InvalidArgument);
    assert!(
        bad.message().contains("buckets[0].limit"),
        "{}",
        bad.message()
    );
    let rel = c
        .release(pb::ReleaseRequest {
            instance: String::new(),
            slot: held.slot,
            keys: vec!["g".into()],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(rel.released, vec![true]);
    assert!(c.acquire(one()).await.unwrap().into_inner().allowed);
    svc.stop().await;
}

/// contract/fixtures/cases.json, `slot_cases`: each request decodes to the same thing from JSON and
/// from protobuf, and each answer encodes to the fixture in both forms.
#[test]
fn slot_fixtures_agree_in_both_encodings() {
    use prost::Message;
    use tollgate_server::api::grpc::pb;
    use tollgate_server::domain::{AcquireResponse, ReleaseResponse};
    use tollgate_server::ops::{acquire, release};
    let text = std::fs::read_to_string(common::workspace().join("contract/fixtures/cases.json"))
        .expect("read cases.json");
    let v: Value = serde_json::from_str(&text).expect("parse cases.json");
    let cases = v["slot_cases"].as_array().expect("slot_cases");
    assert!(cases.len() >= 3);
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
        match c["op"].as_str() {
            Some("acquire") => {
                let from_pb = acquire::raw_from_pb(&pb::AcquireRequest::decode(&*req_pb).unwrap());
                assert_eq!(acquire::decode_json(&req_json).unwrap(), from_pb, "{name}");
                let d: AcquireResponse =
                    serde_json::from_value(c["response_json"].clone()).unwrap();
                assert_eq!(
                    serde_json::to_value(&d).unwrap(),
                    c["response_json"],
                    "{name}"
                );
                assert_eq!(
                    acquire::pb_from_answer(&d).encode_to_vec(),
                    resp_pb,
                    "{name}"
                );
            }
            Some("release") => {
                let from_pb = release::raw_from_pb(&pb::ReleaseRequest::decode(&*req_pb).unwrap());
                assert_eq!(release::decode_json(&req_json).unwrap(), from_pb, "{name}");
                let d: ReleaseResponse =
                    serde_json::from_value(c["response_json"].clone()).unwrap();
                let pb_resp = pb::ReleaseResponse {
                    released: d.released.clone(),
                };
                assert_eq!(pb_resp.encode_to_vec(), resp_pb, "{name}");
            }
            other => panic!("{name}: unknown op {other:?}"),
        }
    }
}

/// Redis Cluster: each key's set is its own hash slot; an acquire over keys of several slots is
/// one script per slot, and a denial in one slot gives back what the others took.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_keys_in_several_slots() {
    let nodes = common::start_cluster(3);
    let store: Arc<dyn Store> = Arc::new(common::cluster_store(&nodes, 1000));
    // Keys whose sets hash to different slots.
    let slot_of = |k: &str| {
        tollgate_server::store::keys::slot(&tollgate_server::store::slots::redis_key("test:", k))
    };
    let a = common::unique("a");
    let b = (0..100)
        .map(|i| format!("{a}-other-{i}"))
        .find(|k| slot_of(k) != slot_of(&a))
        .unwrap();
    holds_at_most_the_limit_and_release_frees(store.clone()).await;
    concurrent_acquires_never_exceed_the_limit(store.clone()).await;
    assert!(
        store
            .acquire(&[spec(&b, 1, 60_000)], &new_slot_id())
            .await
            .unwrap()
            .allowed
    );
    let d = store
        .acquire(&[spec(&a, 2, 60_000), spec(&b, 1, 60_000)], &new_slot_id())
        .await
        .unwrap();
    assert!(
        !d.allowed && d.buckets[0].allowed && !d.buckets[1].allowed,
        "{d:?}"
    );
    assert_eq!(d.buckets[0].in_flight, 0, "a's slot was given back: {d:?}");
    for _ in 0..2 {
        assert!(
            store
                .acquire(&[spec(&a, 2, 60_000)], &new_slot_id())
                .await
                .unwrap()
                .allowed,
            "both of a's slots are free"
        );
    }
    let both = store
        .acquire(
            &[
                spec(&common::unique("c"), 3, 60_000),
                spec(&common::unique("d"), 3, 60_000),
            ],
            &new_slot_id(),
        )
        .await
        .unwrap();
    assert!(both.allowed);
    drop(nodes);
}
