//! Coalescing against real Redis (`store::coalesce`): many tasks taking from one bucket at once
//! admit exactly its capacity, through the wrapper and through the service; the takes really share
//! script calls; a Redis Cluster keeps each slot's buckets exact; an outage fails every waiting
//! take.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::{bucket, post_take, redis_store, unique, RedisProc, Service};
use tollgate_server::domain::{Algorithm, BucketSpec};
use tollgate_server::store::coalesce::{CoalesceConfig, Coalescer};
use tollgate_server::store::keys;
use tollgate_server::store::Store;

const HOUR: u64 = 3_600_000;

fn tb(key: &str, capacity: u64) -> BucketSpec {
    BucketSpec {
        key: key.into(),
        capacity,
        rate: 1,
        period_ms: HOUR,
        cost: 1,
        algorithm: Algorithm::TokenBucket,
        lease: 1,
        max_delay_ms: 0,
    }
}

fn coalescing(store: impl Store, calls: usize) -> Arc<Coalescer> {
    Arc::new(Coalescer::new(
        Arc::new(store),
        CoalesceConfig {
            max_takes: 64,
            calls,
            max_wait: Some(Duration::from_secs(5)),
            ..Default::default()
        },
    ))
}

/// `tasks` tasks, each taking `each` times from the buckets `specs` gives it; how many takes of
/// each task were admitted.
async fn race(
    store: Arc<Coalescer>,
    tasks: usize,
    each: usize,
    specs: impl Fn(usize) -> Vec<BucketSpec>,
) -> Vec<usize> {
    let handles: Vec<_> = (0..tasks)
        .map(|t| {
            let (store, specs) = (store.clone(), specs(t));
            tokio::spawn(async move {
                let mut n = 0;
                for _ in 0..each {
                    if store.take(&specs).await.expect("a decision").allowed {
                        n += 1;
                    }
                }
                n
            })
        })
        .collect();
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await.unwrap());
    }
    out
}

/// `cmdstat_<cmd>`'s `calls=` from `INFO commandstats`.
fn calls(r: &RedisProc, cmd: &str) -> u64 {
    let info = r.cmd(&["INFO", "commandstats"]).unwrap_or_default();
    info.lines()
        .find_map(|l| l.strip_prefix(&format!("cmdstat_{cmd}:calls=")))
        .and_then(|rest| rest.split(',').next()?.parse().ok())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_tasks_one_bucket_exactly_capacity_and_fewer_redis_calls() {
    let r = RedisProc::start();
    for calls_in_flight in [1, 2] {
        let store = coalescing(redis_store(&r.url(), 1000), calls_in_flight);
        store.ping().await.expect("redis answers");
        let before = calls(&r, "fcall");
        let key = format!("one-bucket-{calls_in_flight}");
        // 64 tasks x 8 takes = 512 takes for 300 tokens (no refill within the test).
        let admitted: usize = race(store, 64, 8, |_| vec![tb(&key, 300)])
            .await
            .iter()
            .sum();
        assert_eq!(
            admitted, 300,
            "exactly the capacity ({calls_in_flight} calls)"
        );
        let scripts = calls(&r, "fcall") - before;
        assert!(
            scripts < 512 / 2,
            "512 takes shared {scripts} calls of the take function ({calls_in_flight} calls)"
        );
        assert!(scripts > 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_the_service_exactly_capacity() {
    let r = RedisProc::start();
    // The service coalesces by default (ServiceConfig::default()).
    let svc = Service::start(Arc::new(redis_store(&r.url(), 1000)), None).await;
    let key = unique("svc-coalesce");
    let body = serde_json::json!({ "buckets": [bucket(&key, 100, 1, HOUR, 1)] });
    let before = calls(&r, "fcall");
    let handles: Vec<_> = (0..32)
        .map(|_| {
            let body = body.clone();
            let client = reqwest::Client::new();
            let svc_addr = svc.addr;
            tokio::spawn(async move {
                let mut admitted = 0;
                for _ in 0..6 {
                    let res = client
                        .post(format!("http://{svc_addr}/v1/take"))
                        .json(&body)
                        .send()
                        .await
                        .expect("answer");
                    let status = res.status().as_u16();
                    let v: serde_json::Value = res.json().await.expect("json");
                    match status {
                        200 => admitted += usize::from(v["allowed"] == true),
                        other => panic!("status {other}: {v}"),
                    }
                }
                admitted
            })
        })
        .collect();
    let mut admitted = 0;
    for h in handles {
        admitted += h.await.unwrap();
    }
    assert_eq!(admitted, 100, "192 takes of a 100-token bucket");
    let scripts = calls(&r, "fcall") - before;
    assert!(
        scripts > 0 && scripts <= 192,
        "{scripts} calls of the take function"
    );
    // The next take sees the bucket empty, as a lone take.
    let (status, v) = post_take(&reqwest::Client::new(), &svc, &body).await;
    assert_eq!((status, v["allowed"].as_bool()), (200, Some(false)), "{v}");
    svc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_fails_every_waiting_take() {
    let mut r = RedisProc::start();
    let store = coalescing(redis_store(&r.url(), 200), 1);
    let d = store.take(&[tb("outage", 10)]).await.expect("redis up");
    assert!(d.allowed);
    r.kill();
    let handles: Vec<_> = (0..32)
        .map(|i| {
            let store = store.clone();
            tokio::spawn(async move { store.take(&[tb(&format!("outage-{i}"), 10)]).await })
        })
        .collect();
    for h in handles {
        let r = h.await.unwrap();
        assert!(r.is_err(), "no decision without Redis: {r:?}");
    }
    r.restart();
    let mut ok = false;
    for _ in 0..50 {
        if let Ok(d) = store.take(&[tb("outage", 10)]).await {
            assert!(d.allowed);
            ok = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(ok, "takes are decided again once Redis is back");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_each_slot_exact() {
    let nodes = common::start_cluster(3);
    let store = common::cluster_store(&nodes, 1000);
    let store = coalescing(store, 1);
    assert_eq!(store.kind(), "redis-cluster");
    // Eight buckets, spread over the slots; four tasks per bucket, each taking 10 times from it.
    let buckets: Vec<BucketSpec> = (0..8).map(|i| tb(&format!("slot-{i}"), 25)).collect();
    let slots: std::collections::HashSet<u16> = buckets
        .iter()
        .map(|b| keys::slot(&keys::redis_key("test:", b)))
        .collect();
    assert!(slots.len() > 1);
    let per_task = race(store.clone(), 32, 10, |t| vec![buckets[t % 8].clone()]).await;
    for (i, _) in buckets.iter().enumerate() {
        let admitted: usize = per_task.iter().skip(i).step_by(8).sum();
        assert_eq!(admitted, 25, "bucket {i}: 40 takes for 25 tokens");
    }
    // A take spanning two slots is all or nothing: b is empty, a keeps its tokens.
    let b = &buckets[0];
    let slot_of = |s: &BucketSpec| keys::slot(&keys::redis_key("test:", s));
    let a = (0..)
        .map(|i| tb(&format!("span-a{i}"), 5))
        .find(|a| slot_of(a) != slot_of(b))
        .unwrap();
    let d = store.take(&[a.clone(), b.clone()]).await.unwrap();
    assert!(!d.allowed);
    let d = store.take(&[a]).await.unwrap();
    assert_eq!(d.buckets[0].remaining, 4, "{d:?}");
}
