//! The in-process store: the same semantics as the Redis scripts, for one instance.
//!
//! Used when no Redis is configured (a single replica, development, tests). One mutex guards a
//! map of bucket states, so a take is atomic; a batch holds it once for all its takes, in order.
//! Arithmetic mirrors `lua/token_bucket.lua` and `lua/fixed_window.lua` exactly (integer
//! micro-tokens, a carried refill remainder), in `u128` (a token bucket's balance in `i128`: it
//! may owe tokens after a settle). A bucket is its algorithm and key; its
//! state records the limits it was last charged with, and a take with other limits carries it over
//! as the scripts do (tokens held, or the window's count, scaled to the new capacity keeping the
//! fraction; see `lua/token_bucket.lua`). The clock is monotonic (`Instant`); fixed windows are counted from the store's creation.
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

use super::{Store, StoreError};
use crate::domain::{
    Algorithm, BucketDecision, BucketSpec, SettleDecision, SettleResult, Settlement, TakeDecision,
    SETTLE_ID_TTL_MS,
};

const MICRO: u128 = 1_000_000;
/// [`MICRO`] for the signed balance: a token bucket may owe tokens after a settle.
const MICRO_I: i128 = 1_000_000;
/// Same clamp as the scripts' `MAX_MS`.
const MAX_MS: u128 = 9_007_199_254_740_991;
const TTL_MARGIN_MS: u64 = 1000;
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

/// The limits a bucket was last charged with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Limits {
    capacity: u64,
    rate: u64,
    period_ms: u64,
}

impl Limits {
    fn of(b: &BucketSpec) -> Self {
        Limits {
            capacity: b.capacity,
            rate: b.rate,
            period_ms: b.period_ms,
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum State {
    /// Micro-tokens (below zero while the bucket owes, after a settle; never below minus its
    /// capacity), last charge (µs), refill remainder (1/period_ms of a micro-token).
    Token {
        t: i128,
        ts: u64,
        f: u128,
        limits: Limits,
    },
    /// Window index and count in it.
    Window { w: u64, count: u64, limits: Limits },
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
        u64::try_from(self.epoch.elapsed().as_micros()).unwrap_or(u64::MAX)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A poisoned lock only means another take panicked mid-way; the map itself is consistent
        // because it is written only after all decisions are made.
        match self.inner.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// Decides and charges at the given clock reading (µs since the store's epoch).
    fn take_at(&self, specs: &[BucketSpec], now: u64) -> Result<TakeDecision, StoreError> {
        self.take_locked(&mut self.lock(), specs, now)
    }

    /// Decides a batch under one lock, each take in order at one clock reading: a later take
    /// sees what the earlier ones charged.
    fn take_batch_at(
        &self,
        takes: &[Vec<BucketSpec>],
        now: u64,
    ) -> Result<Vec<TakeDecision>, StoreError> {
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
            let mut state = load(b, Some(stored), now);
            if let State::Token { t, .. } = &mut state {
                let cap_m = i128::from(b.capacity) * MICRO_I;
                *t = (*t + i128::from(b.cost) * MICRO_I).min(cap_m);
            }
            let expires_us = now.saturating_add(ttl_ms(&state, now).saturating_mul(1000));
            inner.put(id, state, expires_us);
            n += 1;
        }
        n
    }

    /// Settles at the given clock reading, as `settle.lua` does.
    fn settle_at(&self, s: &Settlement, now: u64) -> Result<SettleDecision, StoreError> {
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
            let mut state = load(b, stored, now);
            if !duplicate && settle_one(spec, &mut state, stored.is_some()) {
                let expires_us = now.saturating_add(ttl_ms(&state, now).saturating_mul(1000));
                inner.put(id, state, expires_us);
            }
            out.push(settle_result(b, &state));
        }
        Ok(SettleDecision {
            duplicate,
            buckets: out,
        })
    }

    /// One take, with the lock held.
    fn take_locked(
        &self,
        inner: &mut Inner,
        specs: &[BucketSpec],
        now: u64,
    ) -> Result<TakeDecision, StoreError> {
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
                .or_insert_with(|| (load(b, stored, now), false));
            let (decision, charged) = decide(b, &mut entry.0, now);
            entry.1 |= charged;
            out.push(decision);
        }
        let decision = TakeDecision::from_buckets(out);
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

fn cap_ms(v: u128) -> u64 {
    u64::try_from(v.min(MAX_MS)).unwrap_or(u64::MAX)
}

fn ceil_div(a: u128, b: u128) -> u128 {
    a.div_ceil(b.max(1))
}

/// Refills `(t, ts, f)` up to `now` under `l`, as `tb_refill` in token_bucket.lua.
fn refill(l: &Limits, t: &mut i128, ts: &mut u64, f: &mut u128, now: u64) {
    if now <= *ts {
        return;
    }
    let cap_m = i128::from(l.capacity) * MICRO_I;
    if *t >= cap_m {
        *t = cap_m;
        *f = 0;
    } else {
        // Same units as token_bucket.lua: f is in 1/period_ms of a micro-token.
        let period = u128::from(l.period_ms);
        let x = u128::from(now - *ts) * u128::from(l.rate) * 1000 + *f;
        let add = x / period;
        // Positive here, at most twice the capacity in micro-tokens (with a debt).
        let missing = u128::try_from(cap_m - *t).unwrap_or(0);
        if add >= missing {
            *t = cap_m;
            *f = 0;
        } else {
            // add < missing <= 2e15: it fits.
            *t += i128::try_from(add).unwrap_or(0);
            *f = x % period;
        }
    }
    *ts = now;
}

/// The state as of `now` under `b`'s limits: refilled token bucket, or the current window. A
/// bucket last charged with other limits is carried over as the scripts do: refilled under its old
/// limits, then its tokens scaled to the new capacity keeping the fraction held (rounded down, the
/// remainder dropped); a window's count carries while its window has not ended, scaled keeping the
/// fraction used (rounded up).
fn load(b: &BucketSpec, stored: Option<State>, now: u64) -> State {
    let new = Limits::of(b);
    let cap_m = i128::from(b.capacity) * MICRO_I;
    match b.algorithm {
        Algorithm::TokenBucket => {
            let (mut t, mut ts, mut f) = match stored {
                Some(State::Token { t, ts, f, limits }) => {
                    let (mut t, mut ts, mut f) = (t, ts, f);
                    if limits != new {
                        refill(&limits, &mut t, &mut ts, &mut f, now);
                        if limits.capacity != new.capacity {
                            // Rounded down, a debt too (it grows): as the script's floor.
                            t = (t * i128::from(new.capacity))
                                .div_euclid(i128::from(limits.capacity.max(1)));
                        }
                        t = t.min(cap_m);
                        f = 0;
                    }
                    (t, ts, f)
                }
                _ => (cap_m, now, 0),
            };
            refill(&new, &mut t, &mut ts, &mut f, now);
            State::Token {
                t,
                ts,
                f,
                limits: new,
            }
        }
        Algorithm::FixedWindow => {
            let now_ms = now / 1000;
            let mut w = now_ms / b.period_ms;
            let mut count = 0;
            if let Some(State::Window {
                w: sw,
                count: n,
                limits,
            }) = stored
            {
                if limits.period_ms == b.period_ms {
                    if sw >= w {
                        (w, count) = (sw, n);
                    }
                } else if u128::from(now_ms) < (u128::from(sw) + 1) * u128::from(limits.period_ms) {
                    count = n;
                }
                if count > 0 && limits.capacity != b.capacity {
                    count = u64::try_from(
                        (u128::from(count) * u128::from(b.capacity))
                            .div_ceil(u128::from(limits.capacity.max(1))),
                    )
                    .unwrap_or(u64::MAX);
                }
            }
            State::Window {
                w,
                count,
                limits: new,
            }
        }
    }
}

fn tb_reset_ms(b: &BucketSpec, t: i128) -> u64 {
    let missing = u128::try_from(i128::from(b.capacity) * MICRO_I - t).unwrap_or(0);
    cap_ms(ceil_div(
        missing * u128::from(b.period_ms),
        u128::from(b.rate) * MICRO,
    ))
}

fn window_reset_ms(period_ms: u64, w: u64, now: u64) -> u64 {
    ((w + 1) * period_ms).saturating_sub(now / 1000)
}

/// Decides one bucket on its scratch state, charging it when it can pay.
fn decide(b: &BucketSpec, state: &mut State, now: u64) -> (BucketDecision, bool) {
    match state {
        State::Token { t, .. } => {
            let cost_m = i128::from(b.cost) * MICRO_I;
            let allowed = b.cost <= b.capacity && *t >= cost_m;
            let mut granted = 0;
            let retry = if allowed {
                // Lease: as many whole tokens as held, up to `lease`, at least `cost`.
                let whole = u64::try_from(*t / MICRO_I).unwrap_or(u64::MAX);
                granted = b.lease.min(whole).max(b.cost);
                *t -= i128::from(granted) * MICRO_I;
                0
            } else if b.cost > b.capacity {
                b.period_ms
            } else {
                // The whole deficit, a debt included.
                let deficit = u128::try_from(cost_m - *t).unwrap_or(0);
                cap_ms(ceil_div(
                    deficit * u128::from(b.period_ms),
                    u128::from(b.rate) * MICRO,
                ))
            };
            let d = BucketDecision {
                allowed,
                limit: b.capacity,
                remaining: whole_tokens(*t),
                reset_ms: tb_reset_ms(b, *t),
                retry_after_ms: retry,
                granted,
            };
            (d, allowed)
        }
        State::Window { w, count, .. } => {
            let reset = window_reset_ms(b.period_ms, *w, now);
            let allowed = *count + b.cost <= b.capacity;
            let mut granted = 0;
            let retry = if allowed {
                granted = b.lease.min(b.capacity - *count).max(b.cost);
                *count += granted;
                0
            } else if b.cost > b.capacity {
                b.period_ms
            } else {
                reset
            };
            let d = BucketDecision {
                allowed,
                limit: b.capacity,
                remaining: b.capacity.saturating_sub(*count),
                reset_ms: reset,
                retry_after_ms: retry,
                granted,
            };
            (d, allowed)
        }
    }
}

/// Whole tokens held: 0 while the bucket owes.
fn whole_tokens(t: i128) -> u64 {
    u64::try_from(t.max(0) / MICRO_I).unwrap_or(u64::MAX)
}

/// Whole tokens owed, rounded up: 0 unless the balance is below zero.
fn debt_tokens(t: i128) -> u64 {
    let owed = (-t).max(0);
    u64::try_from((owed + MICRO_I - 1) / MICRO_I).unwrap_or(u64::MAX)
}

/// Applies one bucket of a settlement to its loaded state; `existed`: the bucket was stored (an
/// expired token bucket is full, so a refund gives nothing back). Returns whether it changed.
fn settle_one(s: &crate::domain::SettleSpec, state: &mut State, existed: bool) -> bool {
    let b = &s.bucket;
    match state {
        State::Token { t, .. } => {
            let cap_m = i128::from(b.capacity) * MICRO_I;
            if s.used < s.estimate && existed {
                *t = (*t + i128::from(s.estimate - s.used) * MICRO_I).min(cap_m);
                true
            } else if s.used > s.estimate {
                *t = (*t - i128::from(s.used - s.estimate) * MICRO_I).max(-cap_m);
                true
            } else {
                false
            }
        }
        State::Window { w, count, .. } => {
            // A refund needs the window that was charged; an extra charge without one goes to
            // the current window.
            let charged_here = match s.window {
                Some(m) => m == *w,
                None => s.used > s.estimate,
            };
            if !charged_here || s.used == s.estimate {
                false
            } else if s.used < s.estimate {
                let back = (s.estimate - s.used).min(*count);
                *count -= back;
                back > 0
            } else {
                *count = (*count + (s.used - s.estimate)).min(b.capacity.saturating_mul(2));
                true
            }
        }
    }
}

fn settle_result(b: &BucketSpec, state: &State) -> SettleResult {
    match state {
        State::Token { t, .. } => SettleResult {
            remaining: whole_tokens(*t),
            debt: debt_tokens(*t),
        },
        State::Window { count, .. } => SettleResult {
            remaining: b.capacity.saturating_sub(*count),
            debt: count.saturating_sub(b.capacity),
        },
    }
}

fn ttl_ms(state: &State, now: u64) -> u64 {
    let until = match state {
        State::Token { t, limits, .. } => {
            let b = BucketSpec {
                key: String::new(),
                capacity: limits.capacity,
                rate: limits.rate,
                period_ms: limits.period_ms,
                cost: 1,
                algorithm: Algorithm::TokenBucket,
                lease: 1,
            };
            tb_reset_ms(&b, *t)
        }
        State::Window { w, limits, .. } => window_reset_ms(limits.period_ms, *w, now),
    };
    until.saturating_add(TTL_MARGIN_MS).min(MAX_IDLE_MS)
}

#[async_trait::async_trait]
impl Store for MemoryStore {
    async fn take(&self, buckets: &[BucketSpec]) -> Result<TakeDecision, StoreError> {
        self.take_at(buckets, self.now_us())
    }

    async fn take_batch(&self, takes: &[Vec<BucketSpec>]) -> Result<Vec<TakeDecision>, StoreError> {
        self.take_batch_at(takes, self.now_us())
    }

    async fn acquire(
        &self,
        specs: &[crate::inflight::SlotSpec],
        slot: &str,
    ) -> Result<crate::inflight::AcquireDecision, StoreError> {
        Ok(self.slots.acquire(specs, slot, self.now_us() / 1000))
    }

    async fn release(&self, slot: &str, keys: &[String]) -> Result<Vec<bool>, StoreError> {
        Ok(self.slots.release(slot, keys))
    }

    async fn refund(&self, buckets: &[BucketSpec]) -> Result<u64, StoreError> {
        Ok(self.refund_at(buckets, self.now_us()))
    }

    async fn settle(&self, settlement: &Settlement) -> Result<SettleDecision, StoreError> {
        self.settle_at(settlement, self.now_us())
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
    let full = tb_reset_ms(b, 0).max(b.period_ms);
    Duration::from_millis(full.saturating_add(TTL_MARGIN_MS).min(MAX_IDLE_MS))
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
        }
    }

    fn at(s: &MemoryStore, specs: &[BucketSpec], now: u64) -> TakeDecision {
        s.take_at(specs, now)
            .unwrap_or_else(|e| unreachable!("{e}"))
    }

    fn keyed(key: &str) -> BucketSpec {
        BucketSpec {
            key: key.into(),
            ..tb(1, 1, 100, 1)
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
        assert_eq!(d.buckets[0].reset_ms, MAX_MS as u64);
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
