//! Lease mode's tests: one pool, and a request's pools before and after its callout.

use super::*;
use crate::core::base::store::fake::FakeStore;
use crate::core::decide::decide;
use crate::core::rules::Request;
use crate::core::wire::plan::Step as DecideStep;

/// A fixed size of 8, claims holding 70 ms.
const L: Sizing = Sizing {
    lease: Lease {
        size: Some(8),
        max_age_ms: 1000,
    },
    capacity: 100,
    instances: 1,
    claim_ms: 70,
};

/// Adaptive, at most 25 (capacity 100, 4 proxies).
const A: Sizing = Sizing {
    lease: Lease {
        size: None,
        max_age_ms: 1000,
    },
    capacity: 100,
    instances: 4,
    claim_ms: 70,
};

fn cfg(rules: &str) -> Config {
    Config::parse(
        format!(r#"{{"service":{{"cluster":"svc","timeout_ms":20}},"rules":[{rules}]}}"#)
            .as_bytes(),
    )
    .unwrap()
}

fn one() -> Config {
    cfg(r#"{"name":"r","key":["literal:k"],"capacity":100,"period_ms":1000,"lease":{"size":8}}"#)
}

fn plan(c: &Config) -> Plan {
    let req = Request {
        headers: vec![(":path".into(), b"/".to_vec())],
        peer: None,
        properties: Vec::new(),
        ..Default::default()
    };
    match decide(c, &req).step {
        DecideStep::Callout(p) => p,
        DecideStep::Continue => panic!("no rule matched"),
    }
}

fn answer(allowed: bool, granted: u64, retry: u64) -> BucketResult {
    BucketResult {
        allowed,
        limit: 100,
        remaining: 50,
        reset_ms: 500,
        retry_after_ms: retry,
        granted,
        delay_ms: 0,
        window: 0,
    }
}

fn pool(s: &FakeStore, c: &Config) -> Pool {
    let p = plan(c);
    let sl = slot(
        s.memos(),
        c.rules[0].rate_limit().unwrap(),
        &p.request.buckets[0].key,
        c.fallback.max_keys,
    );
    Pool::decode(&sl.id, s.map.borrow().get(&sl.name).map(|e| e.0.as_slice())).unwrap()
}

fn the_slot() -> Place {
    Place {
        name: "tollgate.lease.0".into(),
        id: [7; 16],
    }
}

fn stored(s: &FakeStore, sl: &Place) -> Pool {
    Pool::decode(&sl.id, s.map.borrow().get(&sl.name).map(|e| e.0.as_slice())).unwrap()
}

#[test]
fn empty_pool_claims_the_refill_once() {
    let s = FakeStore::default();
    let sl = the_slot();
    assert_eq!(take(&s, &sl, &L, 100, 1, 0), (Take::Ask(Some(8)), 0));
    // While the refill is in flight another request asks for its own cost only.
    assert_eq!(take(&s, &sl, &L, 100, 1, 10), (Take::Ask(None), 0));
    // The claim lapses on its own (a request that never settled).
    assert_eq!(take(&s, &sl, &L, 100, 1, 70).0, Take::Ask(Some(8)));
}

#[test]
fn below_the_low_mark_a_hit_starts_one_background_refill() {
    let s = FakeStore::default();
    let sl = the_slot();
    take(&s, &sl, &L, 100, 1, 0);
    // Granted 8 for cost 1: 7 go to the pool.
    assert_eq!(
        deposit(&s, &sl, 7, &answer(true, 8, 0), 0, 1000, 0),
        Dropped::default()
    );
    // size / 4 = 2: takes that leave 2 or more start nothing.
    for left in (2..7).rev() {
        let (t, _) = take(&s, &sl, &L, 100, 1, 5);
        let Take::Hit(r, None) = t else {
            panic!("{t:?}")
        };
        assert_eq!(r.remaining, left + 50, "pool + global remaining");
        assert_eq!(r.reset_ms, 495);
    }
    // The take that leaves 1 is paid too, and claims the refill of 8 - 1.
    assert!(matches!(
        take(&s, &sl, &L, 100, 1, 6).0,
        Take::Hit(_, Some(7))
    ));
    // One refill at a time: the last token is spent without another.
    assert!(matches!(take(&s, &sl, &L, 100, 1, 7).0, Take::Hit(_, None)));
    // Empty, refill in flight: ask for the cost alone.
    assert_eq!(take(&s, &sl, &L, 100, 1, 7).0, Take::Ask(None));
    // The background refill's grant goes to the pool whole and ends the claim.
    deposit(&s, &sl, 7, &answer(true, 7, 0), 8, 1008, 0);
    let p = stored(&s, &sl);
    assert_eq!((p.tokens, p.refill_until_ms), (7, 0));
    // A lost refill's claim lapses: the next hit below the mark claims again.
    for _ in 0..5 {
        take(&s, &sl, &L, 100, 1, 9);
    }
    assert!(matches!(
        take(&s, &sl, &L, 100, 1, 9).0,
        Take::Hit(_, Some(7))
    ));
    assert!(matches!(
        take(&s, &sl, &L, 100, 1, 78).0,
        Take::Hit(_, None)
    ));
    deposit(&s, &sl, 1, &answer(true, 1, 0), 79, 1079, 0);
    assert!(matches!(
        take(&s, &sl, &L, 100, 1, 80).0,
        Take::Hit(_, Some(8))
    ));
}

#[test]
fn adaptive_size_follows_the_rate_within_its_bounds() {
    let s = FakeStore::default();
    let sl = the_slot();
    deposit(&s, &sl, 1_000_000, &answer(true, 0, 0), 0, u64::MAX, 0);
    // Nothing observed yet: a pool of one.
    assert_eq!(A.target(&stored(&s, &sl)), 1);
    // 12 tokens a second for 3 s: about 12 per max_age (1 s).
    let mut now = 1;
    for _ in 0..36 {
        take(&s, &sl, &A, 100, 1, now);
        now += 83;
    }
    let t = A.target(&stored(&s, &sl));
    assert!((10..=14).contains(&t), "{t}");
    // 100 a second: capped at capacity / N = 25.
    for _ in 0..300 {
        take(&s, &sl, &A, 100, 1, now);
        now += 10;
    }
    assert_eq!(A.target(&stored(&s, &sl)), 25);
    // Back to 4 a second: within a few windows the size follows down.
    for _ in 0..12 {
        take(&s, &sl, &A, 100, 1, now);
        now += 250;
    }
    let t = A.target(&stored(&s, &sl));
    assert!((3..=6).contains(&t), "{t}");
    // A long silence restarts the average.
    take(&s, &sl, &A, 100, 1, now + 60_000);
    take(&s, &sl, &A, 100, 1, now + 60_300);
    assert!(A.target(&stored(&s, &sl)) <= 4);
    // A fixed size ignores the rate.
    assert_eq!(L.target(&stored(&s, &sl)), 8);
    // Once the answers said 10 proxies share the bucket: at most 100 / 10.
    for _ in 0..300 {
        take(&s, &sl, &A, 100, 1, now);
        now += 10;
    }
    assert_eq!(A.target(&stored(&s, &sl)), 25);
    deposit(&s, &sl, 5, &answer(true, 5, 0), now, u64::MAX, 10);
    assert_eq!(A.target(&stored(&s, &sl)), 10);
}

#[test]
fn a_rising_rate_shows_before_its_window_ends() {
    let s = FakeStore::default();
    let sl = the_slot();
    for i in 0..20 {
        take(&s, &sl, &A, 100, 1, 1 + i);
    }
    // 20 tokens within the first window of 250 ms: at least 80 a second.
    assert_eq!(A.target(&stored(&s, &sl)), 25);
}

#[test]
fn tokens_expire_and_are_counted() {
    let s = FakeStore::default();
    let sl = the_slot();
    deposit(&s, &sl, 7, &answer(true, 8, 0), 0, 1000, 0);
    assert!(matches!(take(&s, &sl, &L, 100, 1, 999).0, Take::Hit(..)));
    // At the expiry the 6 left are dropped, and this request refills.
    assert_eq!(take(&s, &sl, &L, 100, 1, 1000), (Take::Ask(Some(8)), 6));
    // A refund after expiry does not bring them back.
    refund(&s, &sl, 3, 1001);
    assert_eq!(take(&s, &sl, &L, 100, 1, 1001).0, Take::Ask(None));
}

#[test]
fn reclaim_takes_only_expired_tokens_and_only_once() {
    let s = FakeStore::default();
    let sl = the_slot();
    deposit(&s, &sl, 7, &answer(true, 8, 0), 0, 1000, 0);
    assert_eq!(reclaim(&s, &sl, 999), 0);
    assert_eq!(reclaim(&s, &sl, 1000), 7);
    assert_eq!(reclaim(&s, &sl, 1001), 0);
    assert_eq!(stored(&s, &sl).tokens, 0);
    // Not stored (contention): nothing reclaimed, the tokens stay where they are.
    deposit(&s, &sl, 3, &answer(true, 3, 0), 1001, 2000, 0);
    s.conflicts.set(crate::core::base::store::MAX_CAS_ATTEMPTS);
    assert_eq!(reclaim(&s, &sl, 2000), 0);
    assert_eq!(reclaim(&s, &sl, 2000), 3);
}

#[test]
fn watched_pools_give_back_their_expired_tokens_once() {
    let s = FakeStore::default();
    let sl = the_slot();
    let bucket = Bucket {
        key: "r|k".into(),
        capacity: 100,
        rate: None,
        period_ms: 1000,
        cost: None,
        algorithm: None,
        lease: None,
        max_delay_ms: 0,
        calendar: None,
    };
    let held = |expires_ms| Held {
        slot: sl.clone(),
        bucket: bucket.clone(),
        expires_ms,
    };
    deposit(&s, &sl, 7, &answer(true, 8, 0), 0, 1000, 0);
    // Two workers watch the same pool.
    let (mut w1, mut w2) = (Vec::new(), Vec::new());
    watch(&mut w1, held(1000));
    watch(&mut w1, held(1000));
    watch(&mut w2, held(1000));
    assert_eq!(w1.len(), 1, "one entry per pool");
    assert_eq!(sweep(&s, &mut w1, 999), (Vec::new(), 0));
    // Renewed by a later deposit: still watched, nothing given back at the old expiry.
    deposit(&s, &sl, 2, &answer(true, 2, 0), 500, 1500, 0);
    assert_eq!(sweep(&s, &mut w1, 1000), (Vec::new(), 0));
    assert_eq!(w1[0].expires_ms, 1500);
    let (returns, n) = sweep(&s, &mut w1, 1500);
    assert_eq!(n, 9);
    assert_eq!(returns[0].buckets[0].cost, Some(9));
    assert_eq!(returns[0].buckets[0].key, "r|k");
    assert!(w1.is_empty(), "empty now: no longer watched");
    // The other worker finds nothing left to give back.
    assert_eq!(sweep(&s, &mut w2, 1600), (Vec::new(), 0));
    assert!(w2.is_empty());
    // The watch list is bounded; the pool expiring soonest makes room.
    let mut many = Vec::new();
    for i in 0..=MAX_WATCHED as u64 {
        watch(
            &mut many,
            Held {
                slot: Place {
                    name: format!("tollgate.lease.{i}"),
                    id: [1; 16],
                },
                bucket: bucket.clone(),
                expires_ms: 10_000 - i,
            },
        );
    }
    assert_eq!(many.len(), MAX_WATCHED);
    let soonest_before = 10_000 - (MAX_WATCHED as u64 - 1);
    assert!(!many.iter().any(|h| h.expires_ms == soonest_before));
    assert!(many.iter().any(|h| h.expires_ms == 10_000));
}

proptest::proptest! {
    /// Any interleaving of takes (which claim background refills), refill answers, lapsed
    /// claims, reclaims at expiry and clock steps: a pool never pays out, plus gives back, more
    /// than was deposited into it, and never has two refills claimed at once.
    #[test]
    fn one_refill_at_a_time_and_never_more_out_than_in(
        ops in proptest::collection::vec((0u8..5, 1u64..40), 1..300),
        fixed in proptest::bool::ANY,
    ) {
        let s = FakeStore::default();
        let sl = the_slot();
        let sizing = if fixed { L } else { A };
        let (mut now, mut deposited, mut out) = (1u64, 0u64, 0u64);
        // The refill claimed and not answered yet, and until when its claim holds.
        let mut claim: Option<u64> = None;
        for (kind, n) in ops {
            match kind {
                0 | 1 => {
                    let (t, expired) = take(&s, &sl, &sizing, 100, n % 4 + 1, now);
                    // Expired tokens are given back by the caller: out as well.
                    out += expired;
                    let claimed = matches!(t, Take::Hit(_, Some(_)) | Take::Ask(Some(_)));
                    if let Take::Hit(..) = t {
                        out += n % 4 + 1;
                    }
                    if claimed {
                        proptest::prop_assert!(
                            claim.is_none_or(|until| now >= until),
                            "a second refill claimed at {now} while one holds until {claim:?}"
                        );
                        claim = Some(now + sizing.claim_ms);
                    }
                }
                2 => {
                    // The refill's answer: a grant goes to the pool, the claim ends.
                    if claim.take().is_some() {
                        let d = deposit(&s, &sl, n, &answer(true, n, 0), now, now + 1000, 0);
                        out += d.expired;
                        deposited += n;
                    }
                }
                3 => out += reclaim(&s, &sl, now),
                _ => now += n * 7,
            }
            proptest::prop_assert!(out <= deposited, "out {out} > in {deposited}");
        }
    }
}

#[test]
fn cached_denial_covers_the_cost_and_above_until_retry() {
    let s = FakeStore::default();
    let sl = the_slot();
    take(&s, &sl, &L, 100, 3, 0);
    deny(&s, &sl, 3, &answer(false, 0, 400), true, 1000, 0);
    let (t, _) = take(&s, &sl, &L, 100, 3, 100);
    let Take::Denied(r) = t else { panic!("{t:?}") };
    assert_eq!((r.allowed, r.retry_after_ms), (false, 300));
    assert!(matches!(take(&s, &sl, &L, 100, 5, 100).0, Take::Denied(_)));
    // A smaller cost might be payable: ask.
    assert!(matches!(take(&s, &sl, &L, 100, 2, 100).0, Take::Ask(_)));
    // The claim of the denied request ended, so after the retry time the next one refills.
    let s = FakeStore::default();
    deny(&s, &sl, 3, &answer(false, 0, 400), true, 1000, 0);
    assert_eq!(take(&s, &sl, &L, 100, 3, 400).0, Take::Ask(Some(8)));
}

#[test]
fn pooled_tokens_are_spent_before_a_cached_denial_applies() {
    // Granted tokens are already charged: spending them is always within the limit.
    let s = FakeStore::default();
    let sl = the_slot();
    deposit(&s, &sl, 4, &answer(true, 5, 0), 0, 1000, 0);
    deny(&s, &sl, 1, &answer(false, 0, 500), false, 1000, 0);
    assert!(matches!(take(&s, &sl, &L, 100, 1, 1).0, Take::Hit(..)));
}

#[test]
fn lost_cas_race_never_spends() {
    let s = FakeStore::default();
    let sl = the_slot();
    deposit(&s, &sl, 7, &answer(true, 8, 0), 0, 1000, 0);
    s.conflicts.set(crate::core::base::store::MAX_CAS_ATTEMPTS);
    assert_eq!(take(&s, &sl, &L, 100, 1, 1).0, Take::Ask(None));
    let mut n = 0;
    while let Take::Hit(..) = take(&s, &sl, &L, 100, 1, 2).0 {
        n += 1;
    }
    assert_eq!(n, 7, "all 7 still there");
}

#[test]
fn no_refill_is_claimed_while_a_denial_holds() {
    let s = FakeStore::default();
    let sl = the_slot();
    deposit(&s, &sl, 2, &answer(true, 3, 0), 0, 1000, 0);
    deny(&s, &sl, 1, &answer(false, 0, 500), false, 1000, 0);
    // Below the mark, but the service has nothing: spend the pool down to zero.
    assert!(matches!(take(&s, &sl, &L, 100, 1, 1).0, Take::Hit(_, None)));
    assert!(matches!(take(&s, &sl, &L, 100, 1, 1).0, Take::Hit(_, None)));
    assert!(matches!(take(&s, &sl, &L, 100, 1, 1).0, Take::Denied(_)));
}

#[test]
fn eviction_by_another_key_drops_and_counts() {
    let s = FakeStore::default();
    let a = the_slot();
    let b = Place {
        name: a.name.clone(),
        id: [9; 16],
    };
    deposit(&s, &a, 7, &answer(true, 8, 0), 0, 1000, 0);
    assert_eq!(
        deposit(&s, &b, 3, &answer(true, 4, 0), 1, 1001, 0),
        Dropped {
            expired: 0,
            evicted: 7
        }
    );
    assert_eq!(take(&s, &a, &L, 100, 1, 2).0, Take::Ask(Some(8)));
    assert!(s.map.borrow().values().all(|(v, _)| v.len() == POOL_BYTES));
}

#[test]
fn local_admits_from_the_pool_and_refills_in_the_background() {
    let c = one();
    let s = FakeStore::default();
    let mut p = plan(&c);
    assert_eq!(local(&c, &mut p, &s, 0).0, Local::Call);
    assert_eq!(p.request.buckets[0].lease, Some(8), "this request refills");
    let resp = TakeResponse {
        allowed: true,
        buckets: vec![answer(true, 8, 0)],
        instances: 0,
        delay_ms: 0,
    };
    let (granted, chores) = apply(&c, &p, &Outcome::Allowed(resp), &s, 0);
    assert_eq!((granted, chores.dropped, chores.refills.len()), (8, 0, 0));
    assert_eq!(
        chores.watch.len(),
        1,
        "the pool is watched until it expires"
    );
    assert_eq!(chores.watch[0].expires_ms, 1000);
    assert_eq!(pool(&s, &c).tokens, 7);
    assert_eq!(pool(&s, &c).expires_ms, 1000, "max_age_ms defaults to 1000");
    for i in 0..5 {
        let mut p = plan(&c);
        let (l, chores) = local(&c, &mut p, &s, 1);
        assert!(
            matches!(l, Local::Answer(Outcome::Allowed(_))),
            "request {i}: {l:?}"
        );
        assert_eq!(chores, Chores::default());
        assert_eq!(p.request.buckets[0].lease, None);
    }
    // The sixth leaves 1: admitted, and a background refill of 7 is due.
    let mut p = plan(&c);
    let (l, chores) = local(&c, &mut p, &s, 2);
    assert!(matches!(l, Local::Answer(Outcome::Allowed(_))));
    assert_eq!(chores.refills.len(), 1);
    let r = &chores.refills[0];
    assert_eq!(r.rules, vec![0]);
    assert_eq!(r.request.buckets.len(), 1);
    let b = &r.request.buckets[0];
    assert_eq!((b.key.as_str(), b.cost, b.lease), ("r|k", None, Some(7)));
    // Its answer fills the pool with everything granted.
    let resp = TakeResponse {
        allowed: true,
        buckets: vec![answer(true, 7, 0)],
        instances: 0,
        delay_ms: 0,
    };
    assert_eq!(refilled(&c, r, &Outcome::Allowed(resp), &s, 3).0, 7);
    assert_eq!((pool(&s, &c).tokens, pool(&s, &c).refill_until_ms), (8, 0));
    assert_eq!(pool(&s, &c).expires_ms, 1003);
}

#[test]
fn a_background_refill_denied_or_failed_ends_its_claim() {
    let c = one();
    let s = FakeStore::default();
    let p = plan(&c);
    let sl = slot(
        s.memos(),
        c.rules[0].rate_limit().unwrap(),
        &p.request.buckets[0].key,
        c.fallback.max_keys,
    );
    deposit(&s, &sl, 2, &answer(true, 3, 0), 0, 1000, 0);
    let mut p = plan(&c);
    let (_, chores) = local(&c, &mut p, &s, 1);
    let r = &chores.refills[0];
    refilled(
        &c,
        r,
        &Outcome::Failed(crate::core::wire::plan::Cause::Timeout),
        &s,
        2,
    );
    assert_eq!(pool(&s, &c).refill_until_ms, 0);
    let resp = TakeResponse {
        allowed: false,
        buckets: vec![answer(false, 0, 300)],
        instances: 0,
        delay_ms: 0,
    };
    refilled(&c, r, &Outcome::Limited(resp), &s, 2);
    assert_eq!(
        (pool(&s, &c).refill_until_ms, pool(&s, &c).denied_until_ms),
        (0, 302)
    );
    abandon(&c, r, &s);
    assert_eq!(pool(&s, &c).tokens, 1);
}

#[test]
fn expired_token_bucket_tokens_are_given_back_and_fixed_window_ones_are_not() {
    let c = one();
    let s = FakeStore::default();
    let p = plan(&c);
    let sl = slot(
        s.memos(),
        c.rules[0].rate_limit().unwrap(),
        &p.request.buckets[0].key,
        c.fallback.max_keys,
    );
    deposit(&s, &sl, 5, &answer(true, 6, 0), 0, 1000, 0);
    let mut p = plan(&c);
    let (_, chores) = local(&c, &mut p, &s, 1000);
    assert_eq!(chores.dropped, 5);
    assert_eq!(chores.returns.len(), 1);
    let b = &chores.returns[0].buckets[0];
    assert_eq!(
        (b.key.as_str(), b.cost, b.lease, b.capacity),
        ("r|k", Some(5), None, 100)
    );
    let c = cfg(
        r#"{"name":"r","key":["literal:k"],"capacity":100,"period_ms":1000,"algorithm":"fixed_window","lease":{"size":8}}"#,
    );
    let s = FakeStore::default();
    let p = plan(&c);
    let sl = slot(
        s.memos(),
        c.rules[0].rate_limit().unwrap(),
        &p.request.buckets[0].key,
        c.fallback.max_keys,
    );
    deposit(&s, &sl, 5, &answer(true, 6, 0), 0, 500, 0);
    let mut p = plan(&c);
    let (_, chores) = local(&c, &mut p, &s, 500);
    assert_eq!((chores.dropped, chores.returns.len()), (5, 0));
}

#[test]
fn a_rule_without_lease_means_one_callout_and_the_pool_is_refunded() {
    let c = cfg(
        r#"{"name":"a","key":["literal:k"],"capacity":100,"period_ms":1000,"lease":{"size":8}},
           {"name":"b","key":["literal:k"],"capacity":100,"period_ms":1000}"#,
    );
    let s = FakeStore::default();
    let p = plan(&c);
    let sl = slot(
        s.memos(),
        c.rules[0].rate_limit().unwrap(),
        &p.request.buckets[0].key,
        c.fallback.max_keys,
    );
    deposit(&s, &sl, 7, &answer(true, 8, 0), 0, 1000, 0);
    let mut p = plan(&c);
    assert_eq!(local(&c, &mut p, &s, 1).0, Local::Call);
    assert_eq!(pool(&s, &c).tokens, 7, "taken, then refunded");
    assert_eq!(p.request.buckets[0].lease, None, "no refill needed");
    assert_eq!(p.request.buckets[1].lease, None);
}

#[test]
fn partial_local_then_callout_refunds_and_claims() {
    let c = cfg(
        r#"{"name":"a","key":["literal:k"],"capacity":100,"period_ms":1000,"lease":{"size":8}},
           {"name":"b","key":["literal:j"],"capacity":100,"period_ms":1000,"lease":{"size":4}}"#,
    );
    let s = FakeStore::default();
    let p0 = plan(&c);
    let sa = slot(
        s.memos(),
        c.rules[0].rate_limit().unwrap(),
        &p0.request.buckets[0].key,
        c.fallback.max_keys,
    );
    deposit(&s, &sa, 7, &answer(true, 8, 0), 0, 1000, 0);
    let mut p = plan(&c);
    assert_eq!(local(&c, &mut p, &s, 1).0, Local::Call);
    assert_eq!(pool(&s, &c).tokens, 7, "bucket a refunded");
    assert_eq!(p.request.buckets[0].lease, None);
    assert_eq!(p.request.buckets[1].lease, Some(4), "bucket b refills");
    // The service grants b 4 (3 to the pool); a's cost was charged at the service.
    let resp = TakeResponse {
        allowed: true,
        buckets: vec![answer(true, 1, 0), answer(true, 4, 0)],
        instances: 0,
        delay_ms: 0,
    };
    assert_eq!(apply(&c, &p, &Outcome::Allowed(resp), &s, 2).0, 4);
    let mut p = plan(&c);
    assert!(matches!(
        local(&c, &mut p, &s, 3).0,
        Local::Answer(Outcome::Allowed(_))
    ));
    assert_eq!(pool(&s, &c).tokens, 6);
}

#[test]
fn a_cached_denial_denies_the_request_without_a_callout() {
    let c = cfg(
        r#"{"name":"a","key":["literal:k"],"capacity":100,"period_ms":1000,"lease":{"size":8}},
           {"name":"b","key":["literal:j"],"capacity":10,"period_ms":1000,"lease":{"size":4}}"#,
    );
    let s = FakeStore::default();
    let p0 = plan(&c);
    let sa = slot(
        s.memos(),
        c.rules[0].rate_limit().unwrap(),
        &p0.request.buckets[0].key,
        c.fallback.max_keys,
    );
    deposit(&s, &sa, 7, &answer(true, 8, 0), 0, 1000, 0);
    // The service denied b (a could pay): b's denial is cached, a stays as it was.
    let mut p = plan(&c);
    local(&c, &mut p, &s, 0);
    let resp = TakeResponse {
        allowed: false,
        buckets: vec![answer(true, 0, 0), answer(false, 0, 700)],
        instances: 0,
        delay_ms: 0,
    };
    apply(&c, &p, &Outcome::Limited(resp), &s, 0);
    let mut p = plan(&c);
    let (l, _) = local(&c, &mut p, &s, 200);
    let Local::Answer(Outcome::Limited(r)) = l else {
        panic!("{l:?}")
    };
    assert!(!r.allowed && r.buckets[0].allowed && !r.buckets[1].allowed);
    assert_eq!(r.buckets[1].retry_after_ms, 500);
    assert_eq!(pool(&s, &c).tokens, 7, "a's local take refunded");
    // After the retry time it asks again.
    let mut p = plan(&c);
    assert_eq!(local(&c, &mut p, &s, 700).0, Local::Call);
}

#[test]
fn a_cached_denial_is_held_no_longer_than_remember_denials_ms() {
    // A daily fixed window denied: its retry time is hours away. An operator's reset, a refund or
    // a settlement may refill it long before, so the pool asks again after remember_denials_ms
    // (here 250 ms), as exact mode's remembered denials do.
    let c = Config::parse(
        br#"{"service":{"cluster":"svc","timeout_ms":20,"remember_denials_ms":250},
             "rules":[{"name":"r","key":["literal:k"],"capacity":100,"period_ms":86400000,
                       "algorithm":"fixed_window","lease":{"size":8}}]}"#,
    )
    .unwrap();
    let s = FakeStore::default();
    let mut p = plan(&c);
    local(&c, &mut p, &s, 0);
    let resp = TakeResponse {
        allowed: false,
        buckets: vec![answer(false, 0, 86_000_000)],
        instances: 0,
        delay_ms: 0,
    };
    apply(&c, &p, &Outcome::Limited(resp), &s, 0);
    let mut p = plan(&c);
    let (l, _) = local(&c, &mut p, &s, 249);
    let Local::Answer(Outcome::Limited(r)) = l else {
        panic!("{l:?}")
    };
    assert_eq!(
        r.buckets[0].retry_after_ms,
        86_000_000 - 249,
        "Retry-After is still the service's"
    );
    let mut p = plan(&c);
    assert_eq!(local(&c, &mut p, &s, 250).0, Local::Call, "asks again");
    // remember_denials_ms 0: a lease pool remembers no denial either.
    let c0 = Config::parse(
        br#"{"service":{"cluster":"svc","timeout_ms":20,"remember_denials_ms":0},
             "rules":[{"name":"r","key":["literal:k"],"capacity":100,"period_ms":1000,
                       "lease":{"size":8}}]}"#,
    )
    .unwrap();
    let s = FakeStore::default();
    let mut p = plan(&c0);
    local(&c0, &mut p, &s, 0);
    let resp = TakeResponse {
        allowed: false,
        buckets: vec![answer(false, 0, 700)],
        instances: 0,
        delay_ms: 0,
    };
    apply(&c0, &p, &Outcome::Limited(resp), &s, 0);
    let mut p = plan(&c0);
    assert_eq!(local(&c0, &mut p, &s, 0).0, Local::Call);
}

#[test]
fn failure_releases_the_claim_and_keeps_the_pool() {
    let c = one();
    let s = FakeStore::default();
    let mut p = plan(&c);
    local(&c, &mut p, &s, 0);
    apply(
        &c,
        &p,
        &Outcome::Failed(crate::core::wire::plan::Cause::Timeout),
        &s,
        0,
    );
    let mut p = plan(&c);
    local(&c, &mut p, &s, 1);
    assert_eq!(
        p.request.buckets[0].lease,
        Some(8),
        "claim released: refills again"
    );
}

#[test]
fn rescue_spends_below_the_mark_and_is_all_or_nothing() {
    let c = one();
    let s = FakeStore::default();
    let p = plan(&c);
    let sl = slot(
        s.memos(),
        c.rules[0].rate_limit().unwrap(),
        &p.request.buckets[0].key,
        c.fallback.max_keys,
    );
    deposit(&s, &sl, 2, &answer(true, 3, 0), 0, 1000, 0);
    for _ in 0..2 {
        assert!(matches!(rescue(&c, &p, &s, 1), Some(Outcome::Allowed(_))));
    }
    assert_eq!(rescue(&c, &p, &s, 1), None, "empty");
    deposit(&s, &sl, 2, &answer(true, 3, 0), 2, 1000, 0);
    assert_eq!(rescue(&c, &p, &s, 1000), None, "expired");
    // Two lease buckets, the second empty: the first is refunded.
    let c = cfg(
        r#"{"name":"a","key":["literal:k"],"capacity":100,"period_ms":1000,"lease":{"size":8}},
           {"name":"b","key":["literal:j"],"capacity":100,"period_ms":1000,"lease":{"size":4}}"#,
    );
    let s = FakeStore::default();
    let p = plan(&c);
    let sa = slot(
        s.memos(),
        c.rules[0].rate_limit().unwrap(),
        &p.request.buckets[0].key,
        c.fallback.max_keys,
    );
    deposit(&s, &sa, 2, &answer(true, 3, 0), 0, 1000, 0);
    assert_eq!(rescue(&c, &p, &s, 1), None);
    assert_eq!(pool(&s, &c).tokens, 2);
}

#[test]
fn fixed_window_tokens_do_not_outlive_their_window() {
    let c = cfg(
        r#"{"name":"r","key":["literal:k"],"capacity":100,"period_ms":1000,"algorithm":"fixed_window","lease":{"size":8,"max_age_ms":5000}}"#,
    );
    let s = FakeStore::default();
    let mut p = plan(&c);
    local(&c, &mut p, &s, 0);
    let resp = TakeResponse {
        allowed: true,
        buckets: vec![answer(true, 8, 0)],
        instances: 0,
        delay_ms: 0,
    };
    apply(&c, &p, &Outcome::Allowed(resp), &s, 0);
    assert_eq!(
        pool(&s, &c).expires_ms,
        500,
        "the window's end, not max_age_ms"
    );
}

#[test]
fn sliding_window_tokens_do_not_outlive_their_window() {
    let c = cfg(
        r#"{"name":"r","key":["literal:k"],"capacity":100,"period_ms":400,"algorithm":"sliding_window","lease":{"size":8,"max_age_ms":5000}}"#,
    );
    let s = FakeStore::default();
    let mut p = plan(&c);
    local(&c, &mut p, &s, 0);
    let resp = TakeResponse {
        allowed: true,
        buckets: vec![answer(true, 8, 0)],
        instances: 0,
        delay_ms: 0,
    };
    apply(&c, &p, &Outcome::Allowed(resp), &s, 0);
    assert_eq!(
        pool(&s, &c).expires_ms,
        100,
        "the grant weighs 500 ms more; its window ends a period (400 ms) sooner"
    );
}

#[test]
fn granted_beyond_the_lease_is_not_trusted() {
    let c = one();
    let s = FakeStore::default();
    let mut p = plan(&c);
    local(&c, &mut p, &s, 0);
    let resp = TakeResponse {
        allowed: true,
        buckets: vec![answer(true, 1000, 0)],
        instances: 0,
        delay_ms: 0,
    };
    assert_eq!(apply(&c, &p, &Outcome::Allowed(resp), &s, 0).0, 8);
    assert_eq!(pool(&s, &c).tokens, 7);
}
