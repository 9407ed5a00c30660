//! One behavioural suite, run against every store: the memory store and real Redis.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use tollgate_server::domain::{Algorithm, BucketSpec, SettleSpec, Settlement};
use tollgate_server::store::Store;

fn tb(key: &str, capacity: u64, rate: u64, period_ms: u64, cost: u64) -> BucketSpec {
    BucketSpec {
        key: key.into(),
        capacity,
        rate,
        period_ms,
        cost,
        algorithm: Algorithm::TokenBucket,
        lease: cost,
        max_delay_ms: 0,
    }
}

fn fw(key: &str, capacity: u64, period_ms: u64, cost: u64) -> BucketSpec {
    BucketSpec {
        algorithm: Algorithm::FixedWindow,
        ..tb(key, capacity, capacity, period_ms, cost)
    }
}

fn sw(key: &str, capacity: u64, period_ms: u64, cost: u64) -> BucketSpec {
    BucketSpec {
        algorithm: Algorithm::SlidingWindow,
        ..tb(key, capacity, capacity, period_ms, cost)
    }
}

/// A long period makes refill negligible during a test.
const HOUR: u64 = 3_600_000;

async fn take(s: &dyn Store, b: &[BucketSpec]) -> tollgate_server::domain::TakeResponse {
    s.take(b).await.expect("store answers")
}

async fn starts_full_and_counts_down(s: Arc<dyn Store>) {
    let b = tb(&common::unique("full"), 3, 3, HOUR, 1);
    for left in [2, 1, 0] {
        let d = take(&*s, std::slice::from_ref(&b)).await;
        assert!(d.allowed);
        assert_eq!(d.buckets[0].remaining, left);
        assert_eq!(d.buckets[0].limit, 3);
        assert_eq!(d.buckets[0].retry_after_ms, 0);
    }
    let d = take(&*s, std::slice::from_ref(&b)).await;
    assert!(!d.allowed);
    assert_eq!(d.buckets[0].remaining, 0);
    // One token per 20 minutes is missing.
    let r = d.buckets[0].retry_after_ms;
    assert!((1_199_000..=1_200_000).contains(&r), "retry_after_ms {r}");
    let reset = d.buckets[0].reset_ms;
    assert!((3_599_000..=3_600_000).contains(&reset), "reset_ms {reset}");
}

async fn all_or_nothing(s: Arc<dyn Store>) {
    let a = tb(&common::unique("a"), 10, 10, HOUR, 3);
    let b = tb(&common::unique("b"), 2, 2, HOUR, 3);
    let d = take(&*s, &[a.clone(), b.clone()]).await;
    assert!(!d.allowed);
    assert!(d.buckets[0].allowed && !d.buckets[1].allowed);
    // Nothing was charged: `a` still holds 10.
    let probe = tb(&a.key, 10, 10, HOUR, 10);
    let d = take(&*s, &[probe]).await;
    assert!(d.allowed, "{d:?}");
    assert_eq!(d.buckets[0].remaining, 0);
}

async fn same_key_twice_is_charged_twice(s: Arc<dyn Store>) {
    let k = common::unique("dup");
    let d = take(&*s, &[tb(&k, 3, 3, HOUR, 2), tb(&k, 3, 3, HOUR, 2)]).await;
    assert!(!d.allowed, "4 tokens from a bucket of 3: {d:?}");
    let d = take(&*s, &[tb(&k, 4, 4, HOUR, 2), tb(&k, 4, 4, HOUR, 2)]).await;
    assert!(d.allowed);
    assert_eq!(d.buckets[1].remaining, 0);
}

async fn cost_above_capacity_is_denied(s: Arc<dyn Store>) {
    let d = take(&*s, &[tb(&common::unique("big"), 5, 5, 1000, 6)]).await;
    assert!(!d.allowed);
    assert_eq!(d.buckets[0].retry_after_ms, 1000);
    assert_eq!(d.buckets[0].remaining, 5);
}

async fn a_changed_limit_keeps_the_count(s: Arc<dyn Store>) {
    let k = common::unique("change");
    let d = take(&*s, &[tb(&k, 100, 100, HOUR, 40)]).await;
    assert_eq!((d.allowed, d.buckets[0].remaining), (true, 60));
    // 100 -> 50: the fraction held (60 %) is kept, 30 tokens, not a fresh 50.
    let d = take(&*s, &[tb(&k, 50, 50, HOUR, 1)]).await;
    assert_eq!((d.allowed, d.buckets[0].limit), (true, 50));
    assert_eq!(d.buckets[0].remaining, 29, "{d:?}");
    let d = take(&*s, &[tb(&k, 50, 50, HOUR, 30)]).await;
    assert!(!d.allowed, "29 left, never a fresh bucket: {d:?}");
    // 50 -> 100: 29 of 50 becomes 58 of 100.
    let d = take(&*s, &[tb(&k, 100, 100, HOUR, 1)]).await;
    assert_eq!((d.allowed, d.buckets[0].remaining), (true, 57), "{d:?}");
    // The algorithm is part of a bucket's identity, the limits are not.
    assert!(take(&*s, &[fw(&k, 1, HOUR, 1)]).await.allowed);
    // Braces and long keys are ordinary keys.
    for key in [format!("{k}{{x}}"), format!("{k}}}"), "é{".repeat(60) + &k] {
        assert!(take(&*s, &[tb(&key, 1, 1, HOUR, 1)]).await.allowed, "{key}");
        assert!(
            !take(&*s, &[tb(&key, 2, 1, HOUR, 1)]).await.allowed,
            "{key}"
        );
    }
}

async fn a_changed_window_limit_keeps_the_count(s: Arc<dyn Store>) {
    let k = common::unique("fwchange");
    // A window of a day: the test does not cross its end but in the last second of a UTC day.
    let day = 86_400_000;
    let d = take(&*s, &[fw(&k, 10, day, 4)]).await;
    assert_eq!((d.allowed, d.buckets[0].remaining), (true, 6));
    // 10 -> 5: 4 of 10 used is 2 of 5 used, 3 left.
    let d = take(&*s, &[fw(&k, 5, day, 3)]).await;
    assert_eq!((d.allowed, d.buckets[0].remaining), (true, 0), "{d:?}");
    assert!(!take(&*s, &[fw(&k, 5, day, 1)]).await.allowed);
    // A new period keeps the count while the old window lasts: nothing is handed out twice.
    let d = take(&*s, &[fw(&k, 5, HOUR, 1)]).await;
    assert!(!d.allowed, "{d:?}");
}

async fn refills_over_time(s: Arc<dyn Store>) {
    // 1 token per 300 ms (long enough for three takes on a busy machine).
    let b = tb(&common::unique("refill"), 2, 1, 300, 1);
    assert!(take(&*s, std::slice::from_ref(&b)).await.allowed);
    assert!(take(&*s, std::slice::from_ref(&b)).await.allowed);
    let d = take(&*s, std::slice::from_ref(&b)).await;
    assert!(!d.allowed);
    let retry = d.buckets[0].retry_after_ms;
    assert!(retry <= 300 && retry > 0, "{retry}");
    tokio::time::sleep(Duration::from_millis(retry + 10)).await;
    assert!(take(&*s, std::slice::from_ref(&b)).await.allowed);
    assert!(!take(&*s, std::slice::from_ref(&b)).await.allowed);
}

async fn fixed_window(s: Arc<dyn Store>) {
    let b = fw(&common::unique("fw"), 2, 600, 1);
    // Align to the start of a window so the three takes fall in one window.
    let mut d = take(&*s, std::slice::from_ref(&b)).await;
    if d.buckets[0].reset_ms < 400 {
        tokio::time::sleep(Duration::from_millis(d.buckets[0].reset_ms + 5)).await;
        d = take(&*s, std::slice::from_ref(&b)).await;
    }
    assert!(d.allowed);
    assert!(take(&*s, std::slice::from_ref(&b)).await.allowed);
    let d = take(&*s, std::slice::from_ref(&b)).await;
    assert!(!d.allowed);
    let r = d.buckets[0];
    assert_eq!(r.remaining, 0);
    assert!(r.reset_ms <= 600 && r.retry_after_ms == r.reset_ms, "{r:?}");
    tokio::time::sleep(Duration::from_millis(r.reset_ms + 5)).await;
    assert!(take(&*s, std::slice::from_ref(&b)).await.allowed);
}

async fn large_values(s: Arc<dyn Store>) {
    let b = tb(
        &common::unique("large"),
        1_000_000_000,
        1_000_000_000,
        31_536_000_000,
        1_000_000_000,
    );
    let d = take(&*s, std::slice::from_ref(&b)).await;
    assert!(d.allowed);
    assert_eq!(d.buckets[0].remaining, 0);
    assert_eq!(d.buckets[0].reset_ms, 31_536_000_000);
    let d = take(&*s, std::slice::from_ref(&b)).await;
    assert!(!d.allowed);
    assert!(d.buckets[0].retry_after_ms > 31_535_000_000);
    // Slow refill, huge capacity: times are clamped to an exact integer, not wrapped.
    let b = tb(
        &common::unique("slow"),
        1_000_000_000,
        1,
        31_536_000_000,
        1_000_000_000,
    );
    let d = take(&*s, std::slice::from_ref(&b)).await;
    assert!(d.allowed);
    assert_eq!(d.buckets[0].reset_ms, 9_007_199_254_740_991);
}

async fn sixteen_buckets_mixed(s: Arc<dyn Store>) {
    let k = common::unique("mix");
    let buckets: Vec<BucketSpec> = (0..16)
        .map(|i| {
            if i % 2 == 0 {
                tb(&format!("{k}-{i}"), 5, 5, HOUR, 1)
            } else {
                fw(&format!("{k}-{i}"), 5, HOUR, 1)
            }
        })
        .collect();
    for _ in 0..5 {
        assert!(take(&*s, &buckets).await.allowed);
    }
    let d = take(&*s, &buckets).await;
    assert!(!d.allowed);
    assert!(d.buckets.iter().all(|b| !b.allowed && b.remaining == 0));
}

/// Lease mode: grants as many as held up to the lease (at least cost); a denied request grants 0.
async fn lease_grants_what_is_there(s: Arc<dyn Store>) {
    let k = common::unique("lease");
    let leased = |cost: u64, lease: u64| BucketSpec {
        lease,
        ..tb(&k, 100, 100, HOUR, cost)
    };
    let d = take(&*s, &[leased(2, 50)]).await;
    assert!(d.allowed);
    assert_eq!((d.buckets[0].granted, d.buckets[0].remaining), (50, 50));
    let d = take(&*s, &[leased(2, 70)]).await;
    assert_eq!(
        (d.buckets[0].granted, d.buckets[0].remaining),
        (50, 0),
        "partial grant"
    );
    let d = take(&*s, &[leased(1, 10)]).await;
    assert!(!d.allowed);
    assert_eq!(d.buckets[0].granted, 0);
    // Without a lease, granted == cost.
    let d = take(&*s, &[tb(&common::unique("nolease"), 5, 5, HOUR, 2)]).await;
    assert_eq!(d.buckets[0].granted, 2);
    // Fixed window: what the window has left, at least cost; a denied request grants nothing.
    let w = fw(&common::unique("lease-fw"), 20, HOUR, 2);
    let d = take(
        &*s,
        &[BucketSpec {
            lease: 14,
            ..w.clone()
        }],
    )
    .await;
    assert_eq!((d.buckets[0].granted, d.buckets[0].remaining), (14, 6));
    let d = take(
        &*s,
        &[BucketSpec {
            lease: 50,
            ..w.clone()
        }],
    )
    .await;
    assert_eq!((d.buckets[0].granted, d.buckets[0].remaining), (6, 0));
    let other = tb(&common::unique("lease-other"), 10, 10, HOUR, 1);
    let d = take(&*s, &[other.clone(), BucketSpec { lease: 50, ..w }]).await;
    assert!(!d.allowed);
    assert!(d.buckets.iter().all(|b| b.granted == 0), "{d:?}");
    assert_eq!(
        take(
            &*s,
            &[BucketSpec {
                cost: 10,
                lease: 10,
                ..other
            }]
        )
        .await
        .buckets[0]
            .granted,
        10
    );
}

/// Waits until `at_ms` into a window of `period_ms` (the store's windows, read from a fixed
/// window's `reset_ms`), at least until the next window starts.
async fn into_next_window(s: &dyn Store, period_ms: u64, at_ms: u64) {
    let probe = fw(&common::unique("probe"), 1, period_ms, 1);
    let reset = take(s, &[probe]).await.buckets[0].reset_ms;
    tokio::time::sleep(Duration::from_millis(reset + at_ms)).await;
}

/// The previous window weighs by the part of it the sliding window still covers: a burst at the
/// end of one window is still counted early in the next, and has left two windows later.
async fn sliding_window(s: Arc<dyn Store>) {
    let p = 1500;
    let k = common::unique("sw");
    into_next_window(&*s, p, 10).await;
    let d = take(&*s, &[sw(&k, 10, p, 10)]).await;
    assert_eq!((d.allowed, d.buckets[0].remaining), (true, 0), "{d:?}");
    let d = take(&*s, &[sw(&k, 10, p, 1)]).await;
    assert!(!d.allowed);
    // Room for 1 once 10 × (p − e) / p <= 9 in the next window: e = p / 10 into it.
    let r = d.buckets[0];
    assert!(
        r.retry_after_ms > p && r.retry_after_ms <= p + p / 10,
        "{r:?}"
    );
    assert!(r.reset_ms > p && r.reset_ms <= 2 * p, "{r:?}");
    // A third of the way into the next window, 10 × 2/3 (and more) still weigh: 3 or fewer
    // more are admitted, where a fixed window would admit 10.
    into_next_window(&*s, p, p / 3).await;
    let mut admitted = 0;
    while take(&*s, &[sw(&k, 10, p, 1)]).await.allowed {
        admitted += 1;
        assert!(admitted <= 10);
    }
    assert!((1..=3).contains(&admitted), "admitted {admitted}");
    // Two windows after the burst only the few admitted since weigh.
    into_next_window(&*s, p, 10).await;
    let d = take(&*s, &[sw(&k, 10, p, 10 - admitted)]).await;
    assert!(d.allowed, "{d:?}");
}

/// Lease and a changed limit, as a fixed window: the count is kept, scaled keeping the fraction
/// used; another period carries the estimate into the new window.
async fn sliding_window_lease_and_changed_limit(s: Arc<dyn Store>) {
    let day = 86_400_000;
    let k = common::unique("swchange");
    let d = take(
        &*s,
        &[BucketSpec {
            lease: 4,
            ..sw(&k, 10, day, 2)
        }],
    )
    .await;
    assert_eq!((d.buckets[0].granted, d.buckets[0].remaining), (4, 6));
    // 10 -> 5: 4 of 10 used is 2 of 5, 3 left.
    let d = take(&*s, &[sw(&k, 5, day, 3)]).await;
    assert_eq!((d.allowed, d.buckets[0].remaining), (true, 0), "{d:?}");
    assert!(!take(&*s, &[sw(&k, 5, day, 1)]).await.allowed);
    // Another period: the 5 used carry into the new window.
    let d = take(&*s, &[sw(&k, 5, HOUR, 1)]).await;
    assert!(!d.allowed, "{d:?}");
}

/// Settle in the window the estimate was charged in (the current one here): a refund lowers its
/// count, an extra charge raises it in full (the excess is the debt); without
/// `window` a refund is dropped.
async fn sliding_window_settle(s: Arc<dyn Store>) {
    let day = 86_400_000;
    let k = common::unique("swsettle");
    let d = take(&*s, &[sw(&k, 10, day, 6)]).await;
    assert!(d.allowed);
    // The window index, as the store counts it: the take just made is in the current window.
    let settle = |id: &str, estimate: u64, used: u64, window: Option<u64>| Settlement {
        id: common::unique(id),
        buckets: vec![SettleSpec {
            bucket: sw(&k, 10, day, 1),
            estimate,
            used,
            window,
        }],
    };
    let r = s.settle(&settle("drop", 6, 2, None)).await.unwrap();
    assert_eq!((r.buckets[0].remaining, r.buckets[0].debt), (4, 0));
    let r = s.settle(&settle("more", 2, 40, None)).await.unwrap();
    assert_eq!((r.buckets[0].remaining, r.buckets[0].debt), (0, 34));
    assert!(!take(&*s, &[sw(&k, 10, day, 1)]).await.allowed);
}

/// A Redis Cluster: buckets in other slots are taken slot by slot, and a denial gives back what
/// the other slots charged (to the window the take charged).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sliding_window_on_a_cluster() {
    let nodes = common::start_cluster(3);
    let s: Arc<dyn Store> = Arc::new(common::cluster_store(&nodes, 1000));
    let a = sw(&common::unique("cl-a"), 10, HOUR, 3);
    let mut i = 0;
    let mut b = sw(&common::unique("cl-b"), 2, HOUR, 3);
    while tollgate_server::store::keys::slot(&tollgate_server::store::keys::redis_key("test:", &a))
        == tollgate_server::store::keys::slot(&tollgate_server::store::keys::redis_key("test:", &b))
    {
        i += 1;
        b.key = format!("cl-b-{i}");
    }
    let d = take(&*s, &[a.clone(), b.clone()]).await;
    assert!(!d.allowed, "b cannot pay 3 of 2");
    // a was charged in its slot, then given back: all 10 are there.
    let d = take(
        &*s,
        &[BucketSpec {
            cost: 10,
            lease: 10,
            ..a.clone()
        }],
    )
    .await;
    assert!(d.allowed, "{d:?}");
    sliding_window_lease_and_changed_limit(s.clone()).await;
    sliding_window_settle(s.clone()).await;
    sliding_window(s).await;
    drop(nodes);
}

async fn batch(
    s: &dyn Store,
    takes: &[Vec<BucketSpec>],
) -> Vec<tollgate_server::domain::TakeResponse> {
    let ds = s.take_batch(takes).await.expect("store answers");
    assert_eq!(ds.len(), takes.len());
    ds
}

/// Takes in one batch are decided as each would be alone, in order.
async fn batch_takes_are_independent(s: Arc<dyn Store>) {
    let (a, b, c) = (
        tb(&common::unique("ba"), 3, 3, HOUR, 1),
        fw(&common::unique("bb"), 5, HOUR, 2),
        tb(&common::unique("bc"), 5, 5, 1000, 6),
    );
    let ds = batch(
        &*s,
        &[
            vec![a.clone()],
            vec![b.clone()],
            vec![c.clone()],
            vec![a.clone(), b.clone()],
        ],
    )
    .await;
    assert!(ds[0].allowed && ds[1].allowed && ds[3].allowed, "{ds:?}");
    assert_eq!(ds[0].buckets[0].remaining, 2);
    assert_eq!(
        (ds[1].buckets[0].remaining, ds[1].buckets[0].granted),
        (3, 2)
    );
    // Cost above capacity: denied, as a single take would be, and the others are not affected.
    assert!(!ds[2].allowed);
    assert_eq!(ds[2].buckets[0].retry_after_ms, 1000);
    assert_eq!(ds[2].buckets[0].granted, 0);
    // The last take sees what the first two charged.
    assert_eq!(
        (ds[3].buckets[0].remaining, ds[3].buckets[1].remaining),
        (1, 1)
    );
    // And a single take afterwards sees the whole batch.
    let d = take(&*s, std::slice::from_ref(&a)).await;
    assert_eq!(d.buckets[0].remaining, 0);
}

/// Two takes of one bucket of capacity 1 in one batch: exactly one is admitted, the first.
async fn batch_same_bucket_admits_once(s: Arc<dyn Store>) {
    let b = tb(&common::unique("bsame"), 1, 1, HOUR, 1);
    let ds = batch(&*s, &[vec![b.clone()], vec![b.clone()]]).await;
    assert!(ds[0].allowed && !ds[1].allowed, "{ds:?}");
    assert_eq!(ds[1].buckets[0].remaining, 0);
    assert!(ds[1].buckets[0].retry_after_ms > 0);
    // A full batch of 64 takes of a bucket of 10: exactly the first 10.
    let k = tb(&common::unique("b64"), 10, 10, HOUR, 1);
    let ds = batch(&*s, &vec![vec![k]; 64]).await;
    let admitted: Vec<bool> = ds.iter().map(|d| d.allowed).collect();
    assert_eq!(admitted.iter().filter(|a| **a).count(), 10);
    assert!(admitted[..10].iter().all(|a| *a), "{admitted:?}");
}

/// A take denied inside a batch charges none of its own buckets; the other takes are charged.
async fn batch_denied_take_charges_nothing(s: Arc<dyn Store>) {
    let x = tb(&common::unique("bx"), 5, 5, HOUR, 1);
    let y = tb(&common::unique("by"), 1, 1, HOUR, 2);
    let z = fw(&common::unique("bz"), 3, HOUR, 1);
    let ds = batch(
        &*s,
        &[vec![z.clone()], vec![x.clone(), y.clone()], vec![z.clone()]],
    )
    .await;
    assert!(ds[0].allowed && !ds[1].allowed && ds[2].allowed, "{ds:?}");
    assert!(ds[1].buckets[0].allowed && !ds[1].buckets[1].allowed);
    assert!(ds[1].buckets.iter().all(|b| b.granted == 0));
    assert_eq!(ds[2].buckets[0].remaining, 1);
    // x still holds all 5 tokens; z was charged twice.
    let d = take(&*s, &[tb(&x.key, 5, 5, HOUR, 5)]).await;
    assert!(d.allowed, "x was not charged: {d:?}");
    let d = take(&*s, std::slice::from_ref(&z)).await;
    assert!(d.allowed);
    assert_eq!(d.buckets[0].remaining, 0);
}

crate::store_suite!(
    starts_full_and_counts_down,
    all_or_nothing,
    same_key_twice_is_charged_twice,
    cost_above_capacity_is_denied,
    a_changed_limit_keeps_the_count,
    a_changed_window_limit_keeps_the_count,
    refills_over_time,
    fixed_window,
    large_values,
    sixteen_buckets_mixed,
    lease_grants_what_is_there,
    batch_takes_are_independent,
    batch_same_bucket_admits_once,
    batch_denied_take_charges_nothing,
    sliding_window,
    sliding_window_lease_and_changed_limit,
    sliding_window_settle,
);
