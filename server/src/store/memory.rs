//! The in-process store: the same semantics as the Redis scripts, for one instance.
//!
//! Used when no Redis is configured (a single replica, development, tests). One mutex guards a
//! map of bucket states, so a take is atomic; a batch holds it once for all its takes, in order.
//! The arithmetic is the contract's ([`contract::arithmetic`], through [`super::algorithm`]: the
//! reference its Lua is tested against, `server/tests/integration/lua_reference.rs`); this store only keeps the states, the clock and the bounds. A bucket is its algorithm
//! and key; its state records the limits it was last charged with, and a take with other limits
//! carries it over as the scripts do. The clock is monotonic (`Instant`), read from the wall
//! clock at the store's creation on: windows are counted from the Unix epoch, as Redis's are, and
//! a calendar window's span (computed on the wall clock) picks the window it means.
//!
//! Memory is bounded twice. By expiry: a bucket is dropped once it would be full again (or its
//! window has ended) plus a margin, like the Redis keys' PEXPIRE, but never kept idle longer than
//! [`MAX_IDLE_MS`] (a bucket that takes longer to refill starts full again after a day idle).
//! Expiry times are kept in order beside the map, so each take removes the few buckets that have
//! expired (at most [`SWEEP_BATCH`]) without scanning the others. And by a cap: a take that
//! needs a new bucket while [`MemoryStore::max_buckets`] are held fails with
//! [`StoreError::Full`] (503), charging nothing.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::algorithm::{self, State};
use super::{Store, StoreError};
use crate::domain::{
    Algorithm, BucketSpec, BucketState, ResetTarget, SettleResponse, Settlement, SlotsState,
    TakeResponse, SETTLE_ID_TTL_MS,
};

/// Longest time an idle bucket is kept: one day.
pub const MAX_IDLE_MS: u64 = 86_400_000;
/// Default of [`MemoryStore::max_buckets`] (`--memory-max-buckets`).
pub const DEFAULT_MAX_BUCKETS: usize = 100_000;
/// Expired buckets removed by one take at most; the rest go on the next takes (or at once when
/// the store is full).
pub const SWEEP_BATCH: usize = 64;

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Id {
    algorithm: Algorithm,
    key: String,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    state: State,
    expires_us: u64,
    /// Tells apart entries of `Inner::expiry` that expire in the same microsecond.
    seq: u64,
}

struct Inner {
    buckets: HashMap<Arc<Id>, Entry>,
    /// Every bucket once, by `(expires_us, seq)`: the next to expire first.
    expiry: BTreeMap<(u64, u64), Arc<Id>>,
    next_seq: u64,
    /// Settlement ids applied, with their expiry (µs); `settled_order` holds them in the order
    /// they expire (every id lives [`SETTLE_ID_TTL_MS`] on a monotonic clock).
    settled: HashMap<String, u64>,
    settled_order: std::collections::VecDeque<(u64, String)>,
}

impl Inner {
    /// Removes up to `limit` buckets expired at `now`, soonest first.
    fn sweep(&mut self, now: u64, limit: usize) {
        for _ in 0..limit {
            match self.expiry.first_key_value() {
                Some((&(expires_us, _), _)) if expires_us <= now => {
                    if let Some((_, id)) = self.expiry.pop_first() {
                        self.buckets.remove(&*id);
                    }
                }
                _ => return,
            }
        }
    }

    /// Stores a charged bucket's new state and expiry.
    fn put(&mut self, id: Id, state: State, expires_us: u64) {
        match self.buckets.get_mut(&id) {
            Some(e) => {
                e.state = state;
                if e.expires_us != expires_us {
                    let old = (e.expires_us, e.seq);
                    e.expires_us = expires_us;
                    if let Some(k) = self.expiry.remove(&old) {
                        self.expiry.insert((expires_us, e.seq), k);
                    }
                }
            }
            None => {
                let seq = self.next_seq;
                self.next_seq += 1;
                let id = Arc::new(id);
                self.expiry.insert((expires_us, seq), id.clone());
                self.buckets.insert(
                    id,
                    Entry {
                        state,
                        expires_us,
                        seq,
                    },
                );
            }
        }
    }
}

/// In-memory [`Store`].
pub struct MemoryStore {
    epoch: Instant,
    /// The wall clock at `epoch`, in µs since the Unix epoch.
    epoch_us: u64,
    max_buckets: usize,
    inner: Mutex<Inner>,
    /// Concurrency slots (`acquire` / `release`).
    slots: super::slots::SlotTable,
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// An empty store whose clock starts now, holding at most [`DEFAULT_MAX_BUCKETS`].
    pub fn new() -> Self {
        Self::with_max_buckets(DEFAULT_MAX_BUCKETS)
    }

    /// An empty store holding at most `max_buckets` (at least 1).
    pub fn with_max_buckets(max_buckets: usize) -> Self {
        MemoryStore {
            epoch: Instant::now(),
            epoch_us: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(0)),
            max_buckets: max_buckets.max(1),
            inner: Mutex::new(Inner {
                buckets: HashMap::new(),
                expiry: BTreeMap::new(),
                next_seq: 0,
                settled: HashMap::new(),
                settled_order: std::collections::VecDeque::new(),
            }),
            slots: super::slots::SlotTable::default(),
        }
    }

    /// Most buckets held at once.
    pub fn max_buckets(&self) -> usize {
        self.max_buckets
    }

    /// Number of buckets held (for tests of expiry).
    pub fn len(&self) -> usize {
        match self.inner.lock() {
            Ok(g) => g.buckets.len(),
            Err(p) => p.into_inner().buckets.len(),
        }
    }

    /// Whether no bucket is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn now_us(&self) -> u64 {
        let elapsed = u64::try_from(self.epoch.elapsed().as_micros()).unwrap_or(u64::MAX);
        self.epoch_us.saturating_add(elapsed)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A poisoned lock only means another take panicked mid-way; the map itself is consistent
        // because it is written only after all decisions are made.
        match self.inner.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// Decides and charges at the given clock reading (µs since the Unix epoch).
    fn take_at(&self, specs: &[BucketSpec], now: u64) -> Result<TakeResponse, StoreError> {
        self.take_locked(&mut self.lock(), specs, now)
    }

    /// Decides a batch under one lock, each take in order at one clock reading: a later take
    /// sees what the earlier ones charged.
    fn take_batch_at(
        &self,
        takes: &[Vec<BucketSpec>],
        now: u64,
    ) -> Result<Vec<TakeResponse>, StoreError> {
        let mut inner = self.lock();
        takes
            .iter()
            .map(|specs| self.take_locked(&mut inner, specs, now))
            .collect()
    }

    /// Gives tokens back (token buckets that still exist), as `tb_refund` in token_bucket.lua.
    fn refund_at(&self, specs: &[BucketSpec], now: u64) -> u64 {
        let mut inner = self.lock();
        let mut n = 0;
        for b in specs {
            if b.algorithm != Algorithm::TokenBucket {
                continue;
            }
            let id = Id {
                algorithm: b.algorithm,
                key: b.key.clone(),
            };
            let Some(stored) = inner
                .buckets
                .get(&id)
                .filter(|e| e.expires_us > now)
                .map(|e| e.state)
            else {
                continue;
            };
            let mut state = State::load(b, Some(stored), now);
            if state.refund(b, b.cost, 0) {
                let expires_us = now.saturating_add(ttl_ms(&state, now).saturating_mul(1000));
                inner.put(id, state, expires_us);
                n += 1;
            }
        }
        n
    }

    /// Settles at the given clock reading, as `settle.lua` does.
    fn settle_at(&self, s: &Settlement, now: u64) -> Result<SettleResponse, StoreError> {
        let mut inner = self.lock();
        inner.sweep(now, SWEEP_BATCH);
        while let Some((expires_us, _)) = inner.settled_order.front() {
            if *expires_us > now {
                break;
            }
            if let Some((_, id)) = inner.settled_order.pop_front() {
                inner.settled.remove(&id);
            }
        }
        let duplicate = inner.settled.contains_key(&s.id);
        if !duplicate {
            // Room for the id and for every bucket an extra charge would create.
            let new = s
                .buckets
                .iter()
                .filter(|b| {
                    b.used > b.estimate
                        && !inner.buckets.contains_key(&Id {
                            algorithm: b.bucket.algorithm,
                            key: b.bucket.key.clone(),
                        })
                })
                .count();
            if inner.settled.len() >= self.max_buckets
                || inner.buckets.len() + new > self.max_buckets
            {
                inner.sweep(now, usize::MAX);
                if inner.settled.len() >= self.max_buckets {
                    return Err(StoreError::Full(inner.settled.len()));
                }
                if inner.buckets.len() + new > self.max_buckets {
                    return Err(StoreError::Full(inner.buckets.len()));
                }
            }
            let expires_us = now.saturating_add(SETTLE_ID_TTL_MS * 1000);
            inner.settled.insert(s.id.clone(), expires_us);
            inner.settled_order.push_back((expires_us, s.id.clone()));
        }
        let mut out = Vec::with_capacity(s.buckets.len());
        for spec in &s.buckets {
            let b = &spec.bucket;
            let id = Id {
                algorithm: b.algorithm,
                key: b.key.clone(),
            };
            let stored = inner
                .buckets
                .get(&id)
                .filter(|e| e.expires_us > now)
                .map(|e| e.state);
            let mut state = State::load(b, stored, now);
            if !duplicate && state.settle(spec, stored.is_some()) {
                let expires_us = now.saturating_add(ttl_ms(&state, now).saturating_mul(1000));
                inner.put(id, state, expires_us);
            }
            out.push(state.settle_result(b, now));
        }
        Ok(SettleResponse {
            duplicate,
            buckets: out,
        })
    }

    /// Reads a bucket at the given clock reading, changing nothing (as `inspect.lua`).
    fn inspect_at(&self, b: &BucketSpec, now: u64) -> BucketState {
        let inner = self.lock();
        let stored = inner
            .buckets
            .get(&Id {
                algorithm: b.algorithm,
                key: b.key.clone(),
            })
            .filter(|e| e.expires_us > now)
            .map(|e| e.state);
        let mut state = State::load(b, stored, now);
        // A cost above the capacity can never be paid: the take charges nothing and answers the
        // time until full (or the window's end).
        let never = b.capacity.saturating_add(1);
        let probe = BucketSpec {
            cost: never,
            lease: never,
            ..b.clone()
        };
        let (d, _) = state.take(&probe, now);
        let held = state.settle_result(b, now);
        BucketState::new(stored.is_some(), b.capacity, held, d.reset_ms)
    }

    /// Forgets a bucket at the given clock reading; whether it was held (and not expired).
    fn reset_at(&self, algorithm: Algorithm, key: &str, now: u64) -> bool {
        let mut inner = self.lock();
        let id = Id {
            algorithm,
            key: key.to_string(),
        };
        match inner.buckets.remove(&id) {
            Some(e) => {
                inner.expiry.remove(&(e.expires_us, e.seq));
                e.expires_us > now
            }
            None => false,
        }
    }

    /// One take, with the lock held.
    fn take_locked(
        &self,
        inner: &mut Inner,
        specs: &[BucketSpec],
        now: u64,
    ) -> Result<TakeResponse, StoreError> {
        inner.sweep(now, SWEEP_BATCH);
        let mut scratch: HashMap<Id, (State, bool)> = HashMap::new();
        let mut out = Vec::with_capacity(specs.len());
        for b in specs {
            let id = Id {
                algorithm: b.algorithm,
                key: b.key.clone(),
            };
            let stored = inner
                .buckets
                .get(&id)
                .filter(|e| e.expires_us > now)
                .map(|e| e.state);
            let entry = scratch
                .entry(id)
                .or_insert_with(|| (State::load(b, stored, now), false));
            let (decision, charged) = entry.0.take(b, now);
            entry.1 |= charged;
            out.push(decision);
        }
        let decision = TakeResponse::from_buckets(out);
        if decision.allowed {
            let new = scratch
                .iter()
                .filter(|(id, (_, dirty))| *dirty && !inner.buckets.contains_key(*id))
                .count();
            if new > 0 && inner.buckets.len() + new > self.max_buckets {
                // Make room from expired buckets only (never a live one: that would forget a
                // limit), all of them this time: each is removed once, so this stays amortised.
                inner.sweep(now, usize::MAX);
                if inner.buckets.len() + new > self.max_buckets {
                    return Err(StoreError::Full(inner.buckets.len()));
                }
            }
            for (id, (state, dirty)) in scratch {
                if dirty {
                    let ttl_ms = ttl_ms(&state, now);
                    let expires_us = now.saturating_add(ttl_ms.saturating_mul(1000));
                    inner.put(id, state, expires_us);
                }
            }
        }
        Ok(decision)
    }
}

fn ttl_ms(state: &State, now: u64) -> u64 {
    state.ttl_ms(now, MAX_IDLE_MS)
}

#[async_trait::async_trait]
impl Store for MemoryStore {
    async fn take(&self, buckets: &[BucketSpec]) -> Result<TakeResponse, StoreError> {
        self.take_at(buckets, self.now_us())
    }

    async fn take_batch(&self, takes: &[Vec<BucketSpec>]) -> Result<Vec<TakeResponse>, StoreError> {
        self.take_batch_at(takes, self.now_us())
    }

    async fn acquire(
        &self,
        specs: &[crate::domain::SlotSpec],
        slot: &str,
    ) -> Result<crate::domain::AcquireResponse, StoreError> {
        Ok(self.slots.acquire(specs, slot, self.now_us() / 1000))
    }

    async fn release(&self, slot: &str, keys: &[String]) -> Result<Vec<bool>, StoreError> {
        Ok(self.slots.release(slot, keys, self.now_us() / 1000))
    }

    async fn refund(&self, buckets: &[BucketSpec]) -> Result<u64, StoreError> {
        Ok(self.refund_at(buckets, self.now_us()))
    }

    async fn settle(&self, settlement: &Settlement) -> Result<SettleResponse, StoreError> {
        self.settle_at(settlement, self.now_us())
    }

    async fn inspect(&self, bucket: &BucketSpec) -> Result<BucketState, StoreError> {
        Ok(self.inspect_at(bucket, self.now_us()))
    }

    async fn inspect_slots(&self, key: &str) -> Result<SlotsState, StoreError> {
        Ok(self.slots.inspect(key, self.now_us() / 1000))
    }

    async fn reset(&self, target: &ResetTarget) -> Result<bool, StoreError> {
        let now = self.now_us();
        Ok(match target {
            ResetTarget::Bucket(a, key) => self.reset_at(*a, key, now),
            ResetTarget::Slots(key) => self.slots.reset(key, now / 1000),
        })
    }

    async fn ping(&self) -> Result<(), StoreError> {
        Ok(())
    }

    /// `None`: this replica's store is its own, so its own count of instances is the truth.
    async fn live_instances(&self, _: &[String], _: u64) -> Result<Option<u64>, StoreError> {
        Ok(None)
    }

    fn kind(&self) -> &'static str {
        "memory"
    }
}

/// How long an idle bucket is kept at most, for a given spec (tests use it to wait for expiry).
pub fn max_idle(b: &BucketSpec) -> Duration {
    // Two periods: a sliding window's count still weighs in the window after its own.
    let full = algorithm::token_bucket::fill_ms(b).max(b.period_ms.saturating_mul(2));
    Duration::from_millis(
        full.saturating_add(algorithm::TTL_MARGIN_MS)
            .min(MAX_IDLE_MS),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tb(cap: u64, rate: u64, period: u64, cost: u64) -> BucketSpec {
        BucketSpec {
            key: "k".into(),
            capacity: cap,
            rate,
            period_ms: period,
            cost,
            algorithm: Algorithm::TokenBucket,
            lease: cost,
            max_delay_ms: 0,
        }
    }

    fn at(s: &MemoryStore, specs: &[BucketSpec], now: u64) -> TakeResponse {
        s.take_at(specs, now)
            .unwrap_or_else(|e| unreachable!("{e}"))
    }

    fn keyed(key: &str) -> BucketSpec {
        BucketSpec {
            key: key.into(),
            ..tb(1, 1, 100, 1)
        }
    }

    mod settle_props {
        use super::*;
        use crate::domain::{SettleSpec, Settlement};
        use proptest::prelude::*;

        proptest! {
            /// Settles of one bucket at one instant (no refill), some ids sent twice: the balance
            /// is exactly what the settlements applied once each make it: a refund given back up
            /// to the capacity, every extra charge in full below zero (down to the contract's
            /// floor only). Never forgiven, never charged twice.
            #[test]
            fn settles_apply_once_and_forgive_nothing(
                    settles in proptest::collection::vec((0u8..12, 0u64..5000, 0u64..5000), 1..60)) {
                let s = MemoryStore::new();
                let spec = tb(1000, 1, 3_600_000, 1000);
                let now = 1_000_000;
                // The bucket exists and is empty: the reservation of 1,000 was taken.
                prop_assert!(at(&s, std::slice::from_ref(&spec), now).allowed);
                let cap = 1000i128;
                let floor = -i128::from(contract::bounds::MAX_DEBT);
                let mut model = 0i128;
                let mut seen: Vec<u8> = Vec::new();
                for (id, estimate, used) in settles {
                    let d = s
                        .settle_at(
                            &Settlement {
                                id: format!("i-{id}"),
                                buckets: vec![SettleSpec {
                                    bucket: spec.clone(),
                                    estimate,
                                    used,
                                    window: None,
                                }],
                            },
                            now,
                        )
                        .unwrap_or_else(|e| unreachable!("{e}"));
                    prop_assert_eq!(d.duplicate, seen.contains(&id));
                    if !d.duplicate {
                        seen.push(id);
                        let delta = i128::from(estimate) - i128::from(used);
                        model = (model + delta).clamp(floor, cap);
                    }
                    let b = &d.buckets[0];
                    prop_assert_eq!(i128::from(b.remaining), model.max(0));
                    prop_assert_eq!(i128::from(b.debt), (-model).max(0));
                }
            }
        }
    }

    #[test]
    fn refill_fraction_is_carried_between_charges() {
        // 1 token per 3 ms. At 4 ms there are 1.333... tokens: a charge keeps 0.333...; at 6 ms
        // exactly 2 tokens were earned in all, so a second token must be there. Rounding each
        // charge to whole micro-tokens would leave 0.999999 and deny.
        let s = MemoryStore::new();
        assert!(at(&s, &[tb(10, 1, 3, 10)], 0).allowed);
        assert!(at(&s, &[tb(10, 1, 3, 1)], 4000).allowed);
        assert!(!at(&s, &[tb(10, 1, 3, 1)], 5999).allowed);
        assert!(at(&s, &[tb(10, 1, 3, 1)], 6000).allowed);
        assert!(!at(&s, &[tb(10, 1, 3, 1)], 6000).allowed);
    }

    #[test]
    fn idle_buckets_expire() {
        let s = MemoryStore::new();
        // Full again 100 ms after the charge; kept 1 s longer (the margin), then swept.
        assert!(at(&s, &[tb(1, 1, 100, 1)], 0).allowed);
        let mut other = tb(1, 1, 100, 1);
        other.key = "other".into();
        assert!(at(&s, std::slice::from_ref(&other), 1_000_000).allowed);
        assert_eq!(s.len(), 2);
        // Swept by the next take after its expiry.
        assert!(at(&s, std::slice::from_ref(&other), 2_000_000).allowed);
        assert_eq!(s.len(), 1, "the idle bucket is gone, the busy one stays");
    }

    #[test]
    fn cost_above_capacity_is_denied_with_a_period() {
        let s = MemoryStore::new();
        let d = at(&s, &[tb(5, 5, 1000, 6)], 0);
        assert!(!d.allowed);
        assert_eq!(d.buckets[0].retry_after_ms, 1000);
        assert_eq!(d.buckets[0].remaining, 5);
    }

    #[test]
    fn large_values_do_not_overflow() {
        let s = MemoryStore::new();
        let b = tb(1_000_000_000, 1, 31_536_000_000, 1_000_000_000);
        let d = at(&s, std::slice::from_ref(&b), 0);
        assert!(d.allowed);
        assert_eq!(d.buckets[0].reset_ms, algorithm::MAX_MS);
        assert!(s.is_empty() || s.len() == 1);
    }

    #[test]
    fn a_full_store_refuses_new_buckets_and_charges_nothing() {
        let s = MemoryStore::with_max_buckets(2);
        assert!(at(&s, &[keyed("a")], 0).allowed);
        assert!(at(&s, &[keyed("b")], 0).allowed);
        // "a" has refilled at 200 ms; with a third bucket the take is refused and "a" is not
        // charged either.
        assert!(matches!(
            s.take_at(&[keyed("a"), keyed("c")], 200_000),
            Err(StoreError::Full(2))
        ));
        assert_eq!(s.len(), 2);
        assert!(at(&s, &[keyed("a")], 200_000).allowed, "a was not charged");
        assert!(!at(&s, &[keyed("a")], 200_000).allowed);
        // A denial needs no room, even for a bucket never seen.
        assert!(!at(&s, &[tb(1, 1, 100, 2)], 200_000).allowed);
        // Once "b" has expired (1.1 s), there is room again.
        assert!(at(&s, &[keyed("c")], 1_200_000).allowed);
        assert_eq!(s.len(), 2);
    }

    #[test]
    fn idle_time_is_capped_at_a_day() {
        // Refilling 1e9 tokens at one per year would keep the bucket for centuries.
        let b = tb(1_000_000_000, 1, 31_536_000_000, 1);
        assert_eq!(max_idle(&b), Duration::from_millis(MAX_IDLE_MS));
        let day_us = MAX_IDLE_MS * 1000;
        let remaining_after = |idle_us: u64| {
            let s = MemoryStore::new();
            assert!(at(&s, std::slice::from_ref(&b), 0).allowed);
            at(&s, std::slice::from_ref(&b), idle_us).buckets[0].remaining
        };
        assert_eq!(
            remaining_after(day_us - 1),
            999_999_998,
            "kept just under a day"
        );
        assert_eq!(
            remaining_after(day_us),
            999_999_999,
            "forgotten after a day: full again"
        );
    }

    #[test]
    fn expiry_follows_the_latest_charge_and_sweeps_in_batches() {
        let s = MemoryStore::new();
        // 200 buckets expiring at 1.1 s; "hot" is charged again at 1 s, so lives until 2.1 s.
        for i in 0..200 {
            assert!(at(&s, &[keyed(&format!("k{i}"))], 0).allowed);
        }
        assert!(at(&s, &[keyed("hot")], 0).allowed);
        assert!(at(&s, &[keyed("hot")], 1_000_000).allowed);
        assert_eq!(s.len(), 201);
        // Each take removes at most SWEEP_BATCH expired buckets.
        at(&s, &[keyed("hot")], 1_050_000);
        at(&s, &[keyed("hot")], 1_200_000);
        assert_eq!(s.len(), 201 - SWEEP_BATCH);
        for _ in 0..4 {
            at(&s, &[keyed("hot")], 1_200_000);
        }
        assert_eq!(s.len(), 1, "only the bucket charged later is left");
        assert!(at(&s, &[keyed("other")], 3_000_000).allowed);
        assert_eq!(s.len(), 1, "hot has expired too");
    }
}
