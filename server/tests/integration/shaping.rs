//! Shaping (contract/README.md, "Shaping"): a take on a token bucket that cannot pay now but can
//! within its `max_delay_ms` is granted with the delay until its tokens are there; a longer wait
//! is refused as without shaping. Over the memory store, real Redis and a Redis Cluster: the store's
//! answers (grants with increasing delays, refusal past the max delay, all or nothing over buckets, a
//! refund of a held grant), the service's validation, and a burst of concurrent takes through
//! the service whose grants, each sent at its delay, stay within the bucket's limit.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{bucket, post_take, unique, Service};
use serde_json::{json, Value};
use tollgate_server::domain::{Algorithm, BucketSpec, TakeResponse};
use tollgate_server::store::Store;

/// One token every 10 s, so the few ms a test takes between takes refill almost nothing.
const SLOW_MS: u64 = 10_000;

/// A shaped token bucket of `capacity`, one token per [`SLOW_MS`], waiting up to `max_delay_ms`.
fn shaped(key: &str, capacity: u64, max_delay_ms: u64) -> BucketSpec {
    BucketSpec {
        key: key.into(),
        capacity,
        rate: 1,
        period_ms: SLOW_MS,
        cost: 1,
        algorithm: Algorithm::TokenBucket,
        lease: 1,
        max_delay_ms,
    }
}

async fn take(s: &dyn Store, b: &[BucketSpec]) -> TakeResponse {
    s.take(b).await.expect("store answers")
}

/// `delay` is the wait for the `k`-th token owed: `k × SLOW_MS`, less the refill since the
/// bucket was emptied (at most a second here).
fn owes(delay: u64, k: u64) -> bool {
    (k * SLOW_MS - 1000..=k * SLOW_MS).contains(&delay)
}

async fn shaped_grants_wait_in_turn_and_no_longer_than_allowed(s: Arc<dyn Store>) {
    let b = shaped(&unique("shaped"), 2, 60_000);
    for _ in 0..2 {
        let d = take(&*s, std::slice::from_ref(&b)).await;
        assert!(d.allowed && d.delay_ms == 0, "paid now: {d:?}");
    }
    // Six more fit within a minute, each waiting 10 s after the one before.
    let mut last = 0;
    for k in 1..=6 {
        let d = take(&*s, std::slice::from_ref(&b)).await;
        let r = d.buckets[0];
        assert!(d.allowed && r.allowed, "{k}: {d:?}");
        assert_eq!((r.granted, r.retry_after_ms, r.remaining), (1, 0, 0));
        assert_eq!(d.delay_ms, r.delay_ms);
        assert!(owes(r.delay_ms, k) && r.delay_ms > last, "{k}: {d:?}");
        last = r.delay_ms;
    }
    // The seventh would wait 70 s: refused as without shaping, nothing charged.
    for _ in 0..2 {
        let d = take(&*s, std::slice::from_ref(&b)).await;
        let r = d.buckets[0];
        assert!(!d.allowed && r.delay_ms == 0 && d.delay_ms == 0, "{d:?}");
        assert!(owes(r.retry_after_ms, 7), "{d:?}");
    }
    // The last one held leaves: its token comes back to a bucket below zero, and the next take
    // waits as long as it did.
    assert_eq!(s.refund(std::slice::from_ref(&b)).await.unwrap(), 1);
    let d = take(&*s, std::slice::from_ref(&b)).await;
    assert!(d.allowed && owes(d.delay_ms, 6), "{d:?}");
}

async fn a_shaped_take_is_all_or_nothing(s: Arc<dyn Store>) {
    let (a, b) = (
        shaped(&unique("a"), 1, 60_000),
        shaped(&unique("b"), 1, 15_000),
    );
    // Both buckets empty.
    assert!(take(&*s, &[a.clone(), b.clone()]).await.allowed);
    // Both shaped, `a` twice: the request is held for the longest wait.
    let d = take(&*s, &[a.clone(), a.clone(), b.clone()]).await;
    assert!(d.allowed, "{d:?}");
    let r = &d.buckets;
    assert!(owes(r[0].delay_ms, 1) && owes(r[1].delay_ms, 2) && owes(r[2].delay_ms, 1));
    assert_eq!(d.delay_ms, r[1].delay_ms, "the largest delay");
    // `b` would now wait 20 s, more than its 15: nothing is charged, `a` included.
    let d = take(&*s, &[a.clone(), b.clone()]).await;
    assert!(
        !d.allowed && d.buckets[0].allowed && !d.buckets[1].allowed,
        "{d:?}"
    );
    assert!(d.buckets.iter().all(|r| r.delay_ms == 0 && r.granted == 0));
    let d = take(&*s, std::slice::from_ref(&a)).await;
    assert!(d.allowed && owes(d.delay_ms, 3), "a was not charged: {d:?}");
}

async fn without_max_delay_nothing_is_shaped(s: Arc<dyn Store>) {
    let b = shaped(&unique("plain"), 1, 0);
    assert!(take(&*s, std::slice::from_ref(&b)).await.allowed);
    let d = take(&*s, std::slice::from_ref(&b)).await;
    assert!(!d.allowed && d.delay_ms == 0 && owes(d.buckets[0].retry_after_ms, 1));
}

#[tokio::test]
async fn max_delay_is_bounded_and_for_token_buckets_only() {
    let svc = Service::start(common::memory_store(), None).await;
    let client = reqwest::Client::new();
    let mut window = bucket(&unique("w"), 10, 10, 1000, 1);
    window["algorithm"] = json!("fixed_window");
    window["max_delay_ms"] = json!(100);
    let mut sliding = window.clone();
    sliding["algorithm"] = json!("sliding_window");
    let mut long = bucket(&unique("l"), 10, 10, 1000, 1);
    long["max_delay_ms"] = json!(60_001);
    for (b, says) in [
        (&window, "shaping is for token_bucket only"),
        (&sliding, "shaping is for token_bucket only"),
        (&long, "must be at most 60000"),
    ] {
        let (status, body) = post_take(&client, &svc, &json!({ "buckets": [b] })).await;
        assert_eq!(status, 400, "{body}");
        assert_eq!(body["error"]["field"], "buckets[0].max_delay_ms", "{body}");
        let message = body["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(says), "{body}");
    }
    // 0 on a window is no shaping, and allowed.
    window["max_delay_ms"] = json!(0);
    assert_eq!(
        post_take(&client, &svc, &json!({ "buckets": [window] }))
            .await
            .0,
        200
    );
}

/// What one take of the burst was answered, and when.
struct Answer {
    body: Value,
    /// When the answer arrived, from the burst's start.
    at: Duration,
}

/// 50 concurrent takes at a bucket of capacity 10, 10 per second, max delay 1 s, through the
/// service: 10 granted now, 10 with delays spread up to 1 s (a few more if the burst lasts
/// long enough to refill some), the rest refused with a retry time. The grants' delays are
/// distinct, each a tenth of a second after the one before; and, each request going at its
/// delay, no window of the grants holds more than capacity + rate × its length (allowing for
/// the time an answer takes to arrive).
async fn a_burst_is_shaped_within_the_limit(store: Arc<dyn Store>) {
    let svc = Arc::new(Service::start(store, None).await);
    let client = reqwest::Client::new();
    let mut b = bucket(&unique("burst"), 10, 10, 1000, 1);
    b["max_delay_ms"] = json!(1000);
    let body = json!({ "buckets": [b] });
    let start = Instant::now();
    let tasks: Vec<_> = (0..50)
        .map(|_| {
            let (client, svc, body) = (client.clone(), svc.clone(), body.clone());
            tokio::spawn(async move {
                let (status, body) = post_take(&client, &svc, &body).await;
                assert_eq!(status, 200, "{body}");
                Answer {
                    body,
                    at: start.elapsed(),
                }
            })
        })
        .collect();
    let mut answers = Vec::new();
    for t in tasks {
        answers.push(t.await.unwrap());
    }
    let burst_ms = start.elapsed().as_millis() as u64;
    let (granted, refused): (Vec<&Answer>, Vec<&Answer>) = answers
        .iter()
        .partition(|a| a.body["allowed"] == json!(true));
    let delay = |a: &Answer| a.body["delay_ms"].as_u64().unwrap_or(0);
    // The burst's own length refills a token every 100 ms.
    let extra = burst_ms / 100 + 1;
    assert!(
        (20..=20 + extra as usize).contains(&granted.len()),
        "{} granted in {burst_ms} ms",
        granted.len()
    );
    assert_eq!(granted.iter().filter(|a| delay(a) == 0).count() as u64, 10);
    for a in &refused {
        let r = &a.body["buckets"][0];
        assert!(r["retry_after_ms"].as_u64().unwrap() > 0, "{}", a.body);
        assert_eq!(delay(a), 0, "{}", a.body);
    }
    // In grant order the waits come a tenth of a second apart: each is the time until the
    // bucket, below zero by the grants before it, refills its token.
    let mut delays: Vec<u64> = granted
        .iter()
        .map(|a| delay(a))
        .filter(|&d| d > 0)
        .collect();
    delays.sort_unstable();
    assert!(
        delays.len() >= 10 && *delays.last().unwrap() <= 1000,
        "{delays:?}"
    );
    for pair in delays.windows(2) {
        let gap = pair[1] - pair[0];
        assert!(
            (100 - burst_ms.min(100)..=100 + burst_ms).contains(&gap),
            "{delays:?}"
        );
    }
    // Counted: each grant with a delay, and its delay.
    let metrics = common::get_text(svc.url("/metrics")).await;
    let value = |name: &str| {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
            .and_then(|v| v.parse::<f64>().ok())
    };
    let shaped = delays.len() as f64;
    assert_eq!(value("tollgate_shaped_total"), Some(shaped), "{metrics}");
    assert_eq!(
        value("tollgate_shaped_delay_seconds_count"),
        Some(shaped),
        "{metrics}"
    );
    // Each request sent at its delay: in any window [from, to] of those times, at most
    // capacity + rate × (to − from) requests, plus what the arrival of an answer (up to the
    // burst's length) may have shifted into the window.
    let mut sent: Vec<u64> = granted
        .iter()
        .map(|a| a.at.as_millis() as u64 + delay(a))
        .collect();
    sent.sort_unstable();
    for (i, from) in sent.iter().enumerate() {
        for (j, to) in sent.iter().enumerate().skip(i) {
            let inside = (j - i + 1) as u64;
            let bound = 10 + (to - from + burst_ms) / 100 + 1;
            assert!(
                inside <= bound,
                "{inside} sent in [{from}, {to}] ms: {sent:?}"
            );
        }
    }
}

// Two worker threads: the burst's takes are decided concurrently.
crate::store_suite!(
    multi_thread: shaped_grants_wait_in_turn_and_no_longer_than_allowed,
    a_shaped_take_is_all_or_nothing,
    without_max_delay_nothing_is_shaped,
    a_burst_is_shaped_within_the_limit,
);

/// A Redis Cluster: a shaped take over buckets of two slots is decided slot by slot, and a slot
/// that denies gives back what a shaped charge in the other took, below zero (the two keys of
/// `a_shaped_take_is_all_or_nothing` fall in different slots but for one chance in 16,384).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster() {
    let nodes = common::start_cluster(3);
    let s: Arc<dyn Store> = Arc::new(common::cluster_store(&nodes, 1000));
    shaped_grants_wait_in_turn_and_no_longer_than_allowed(s.clone()).await;
    a_shaped_take_is_all_or_nothing(s.clone()).await;
    a_burst_is_shaped_within_the_limit(s).await;
    drop(nodes);
}
