//! Property tests of the shared tables (fallback shares, lease pools) under arbitrary
//! interleavings of what the workers of one proxy do to them: takes, answers, refunds, deposits,
//! evictions by colliding keys, CAS conflicts (another worker won the race) and clocks that step
//! back and forth per worker. Each operation is one call of the module's own API on one shared
//! store, the granularity at which workers interleave (a call is one CAS loop).
//!
//! Invariants:
//! - a fallback share never holds more than its local capacity, and a bucket never admits more
//!   than `capacity + rate × t` (local terms) over the run, whatever evicts it or answers say;
//! - a lease pool never pays out more tokens than were deposited into it.

use crate::core::base::store::fake::FakeStore;
use crate::core::base::store::CasStore;
use crate::core::config::{Algorithm, Lease};
use crate::core::local::bucket::{calendar_rate, Limits, MICRO};
use crate::core::local::fallback::{self, Shares};
use crate::core::local::lease;
use crate::core::wire::BucketResult;
use proptest::prelude::*;
use std::collections::HashMap;

/// What one worker does next.
#[derive(Debug, Clone)]
enum Op {
    /// A fallback take of `cost` on key `key` by worker `w`.
    Take { w: usize, key: u8, cost: u64 },
    /// An answer from the service for `key`: `remaining` global tokens, `repaid` of the debt.
    Answer {
        w: usize,
        key: u8,
        remaining: u64,
        repaid: u64,
    },
    /// A take then its refund (a request whose other bucket denied).
    TakeRefund { w: usize, key: u8, cost: u64 },
    /// The next `n` writes lose a CAS race.
    Conflicts { n: u32 },
    /// Shared time moves on.
    Advance { ms: u64 },
    /// Worker `w`'s clock is set `skew` ms from shared time (may be behind).
    Skew { w: usize, skew: i64 },
}

const WORKERS: usize = 3;
const PERIOD: u64 = 600_000;
const CAP: u64 = 12;

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..WORKERS, 0u8..4, 1u64..4).prop_map(|(w, key, cost)| Op::Take { w, key, cost }),
        // The service's bucket is drained (it admitted the rest of the fleet): answers only ever
        // lower a share, so the bound below is the fallback's own.
        3 => (0..WORKERS, 0u8..4, 0u64..8)
            .prop_map(|(w, key, repaid)| Op::Answer { w, key, remaining: 0, repaid }),
        1 => (0..WORKERS, 0u8..4, 1u64..4).prop_map(|(w, key, cost)| Op::TakeRefund { w, key, cost }),
        1 => (0u32..10).prop_map(|n| Op::Conflicts { n }),
        2 => (0u64..3_000).prop_map(|ms| Op::Advance { ms }),
        1 => (0..WORKERS, -5_000i64..5_000).prop_map(|(w, skew)| Op::Skew { w, skew }),
    ]
}

fn clock(base: u64, skew: i64) -> u64 {
    base.saturating_add_signed(skew)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn fallback_shares_never_admit_more_than_capacity_plus_refill(
        ops in proptest::collection::vec(op(), 1..200),
        max_keys in 1u32..5,
        instances in 1u64..4,
        algorithm in 0usize..4,
    ) {
        let store = FakeStore::default();
        fallback::prepare(&store, max_keys);
        let sh = Shares { max_keys, instances, horizon_ms: 5_000, previous: [0; 3] };
        let algorithm = Algorithm::ALL[algorithm];
        // 12 per 10 min globally, per proxy 12 / instances: slow enough that a second full
        // start would show.
        // A calendar window counts by days from UTC's midnight (its limits' rate word).
        let day = contract::calendar::Calendar { unit: contract::calendar::Unit::Day, zone: "UTC".into() };
        let l = match algorithm {
            Algorithm::CalendarWindow => Limits::local(CAP, calendar_rate(&day), PERIOD, algorithm, instances),
            _ => Limits::local(CAP, CAP, PERIOD, algorithm, instances),
        };
        let mut base = 1_000_000u64;
        let mut skew = [0i64; WORKERS];
        let (mut lo, mut hi) = (u64::MAX, 0u64);
        let mut admitted: HashMap<u8, u64> = HashMap::new();
        for op in ops {
            match op {
                Op::Take { w, key, cost } => {
                    let now = clock(base, skew[w]);
                    lo = lo.min(now);
                    hi = hi.max(now);
                    let r = fallback::take(&store, &sh, &format!("k{key}"), &l, now, cost);
                    prop_assert!(r.remaining <= l.capacity);
                    if r.allowed {
                        *admitted.entry(key).or_default() += cost;
                    }
                }
                Op::TakeRefund { w, key, cost } => {
                    let now = clock(base, skew[w]);
                    lo = lo.min(now);
                    hi = hi.max(now);
                    let k = format!("k{key}");
                    if fallback::take(&store, &sh, &k, &l, now, cost).allowed {
                        fallback::refund(&store, &sh, &k, &l, now, cost);
                    }
                }
                Op::Answer { w, key, remaining, repaid } => {
                    let now = clock(base, skew[w]);
                    fallback::remember_one(&store, &sh, &format!("k{key}"), &l, now, remaining, repaid);
                }
                Op::Conflicts { n } => store.conflicts.set(n),
                Op::Advance { ms } => base += ms,
                Op::Skew { w, skew: s } => skew[w] = s,
            }
        }
        let span = hi.saturating_sub(lo);
        for (key, n) in admitted {
            let bound = match algorithm {
                // capacity + rate × t, with the rate split exactly: 12 / instances per period.
                Algorithm::TokenBucket => {
                    l.capacity
                        + (u128::from(span) * u128::from(CAP) / (u128::from(PERIOD) * u128::from(instances)))
                            as u64
                        + 1
                }
                // One capacity per window the run touched (a sliding window admits no more than
                // its capacity in any fixed window either).
                Algorithm::FixedWindow | Algorithm::SlidingWindow => l.capacity * (span / PERIOD + 2),
                Algorithm::CalendarWindow => l.capacity * (span / 86_400_000 + 2),
            };
            prop_assert!(n <= bound, "key {key}: admitted {n} > {bound} over {span} ms");
        }
        // No stored share holds more than the local capacity.
        for (name, (v, _)) in store.map.borrow().iter() {
            if name.ends_with(".ready") || v.get(1) != Some(&1) {
                continue;
            }
            let level = u64::from_le_bytes(v[18..26].try_into().unwrap());
            match algorithm {
                Algorithm::TokenBucket => prop_assert!(level <= l.capacity * MICRO),
                Algorithm::FixedWindow | Algorithm::CalendarWindow => prop_assert!(level <= l.capacity),
                // Both counts, packed.
                Algorithm::SlidingWindow => {
                    prop_assert!(level & 0xFFFF_FFFF <= l.capacity && level >> 32 <= l.capacity)
                }
            }
        }
    }

    #[test]
    fn lease_pools_never_pay_more_than_was_deposited(
        ops in proptest::collection::vec(
            prop_oneof![
                3 => (0..WORKERS, 1u64..4).prop_map(|(w, c)| (0u8, w, c)),
                2 => (0..WORKERS, 1u64..30).prop_map(|(w, c)| (1u8, w, c)),
                2 => (0..WORKERS, 1u64..4).prop_map(|(w, c)| (2u8, w, c)),
                1 => (0..WORKERS, 0u64..10).prop_map(|(w, c)| (3u8, w, c)),
                2 => (0..WORKERS, 0u64..2_000).prop_map(|(w, c)| (4u8, w, c)),
                1 => (0..WORKERS, 0u64..3).prop_map(|(w, c)| (5u8, w, c)),
            ],
            1..200,
        ),
        max_keys in 1u32..3,
    ) {
        let store = FakeStore::default();
        crate::core::local::table::prepare(&store, crate::core::local::table::POOLS_TABLE, max_keys, &[0]);
        let rule_l = Limits::local(100, 100, 10_000, Algorithm::TokenBucket, 1);
        let slots: Vec<_> = (0..3)
            .map(|k| crate::core::local::table::place_in(store.memos(), crate::core::local::table::POOLS_TABLE, &format!("k{k}"), &rule_l, max_keys))
            .collect();
        let size = lease::pool::Sizing { lease: Lease { size: Some(20), max_age_ms: 1_000 }, capacity: 100, instances: 1, claim_ms: 50 };
        let mut now = 1_000_000u64;
        let (mut deposited, mut paid) = (vec![0u64; 3], vec![0u64; 3]);
        let mut key = 0usize;
        for (kind, w, n) in ops {
            key = (key + w) % 3;
            let slot = &slots[key];
            match kind {
                // A request's take from the pool.
                0 => {
                    if let (lease::pool::Take::Hit(..), _) = lease::pool::take(&store, slot, &size, 100, n, now) {
                        paid[key] += n;
                    }
                }
                // An allowed refill deposits `n` extra tokens.
                1 => {
                    let answer = BucketResult { allowed: true, limit: 100, remaining: 50, ..BucketResult::default() };
                    lease::pool::deposit(&store, slot, n, &answer, now, now + size.lease.max_age_ms, 0);
                    deposited[key] += n;
                }
                // A rescue spends what is there, then gives it back (the request was denied after all).
                2 => {
                    if lease::pool::spend(&store, slot, 100, n, now).is_some() {
                        paid[key] += n;
                        if w == 0 {
                            lease::pool::refund(&store, slot, n, now);
                            paid[key] -= n;
                        }
                    }
                }
                3 => store.conflicts.set(n as u32),
                4 => now += n,
                _ => lease::pool::release(&store, slot),
            }
            // Pools of colliding keys share nothing: each key's payout is bounded by its own
            // deposits (an evicted pool's tokens are lost, never handed to the newcomer).
            prop_assert!(paid[key] <= deposited[key], "key {key}: paid {} > deposited {}", paid[key], deposited[key]);
        }
    }
}
