//! Lease mode: a proxy asks the service for a batch of tokens and admits later requests from a
//! local pool, so most requests need no callout while the global limit is never exceeded.
//!
//! Why it is exact in the safe direction: every token in a pool was charged to the global bucket
//! by the service first (`granted` in the answer), and a pool only ever loses tokens (spent,
//! refunded within the same request, expired, evicted). Spending pooled tokens can therefore never
//! admit more than the service charged. Tokens a pool drops unspent at `max_age_ms` are given back
//! to the global bucket (a refund callout, token buckets only: a fixed window's tokens expire with
//! their window), so over time a fleet of leasing proxies admits what exact mode admits.
//!
//! One pool per (key, rule limits) and proxy, in shared data (so every worker of the proxy spends
//! it), in a bounded hashed table of its own, `tollgate.lease.<n>`, built with the same slot scheme
//! as the fallback buckets ([`fallback::slot_in`]). A pool also remembers:
//! - a **refill in flight** (until when): one refill at a time per pool, and a claim whose callout
//!   is lost (its answer never comes) lapses on its own;
//! - a **denial** (until when, and for which cost): when the service denied a cost because the
//!   bucket could not pay it before `retry_after_ms`, no request of that cost or more can be
//!   admitted sooner, so such requests are denied locally until then, without a callout;
//! - the global `remaining` and `reset` of the last answer, for the rate limit headers;
//! - the **rate** the key is asked for at this proxy: tokens per second, averaged over windows of
//!   a quarter of `max_age_ms` (each window's rate weighs half; a gap of four windows restarts it).
//!
//! Size: a fixed `lease.size`, or (adaptive, the default) what the key spends here in `max_age_ms`
//! at its current rate, so about one refill per `max_age_ms`: at least 1, at most capacity / N (the
//! proxies sharing the bucket, as the answers report them, else `fallback.instances`); the service
//! grants at most what it holds.
//!
//! Refill policy: a request paid from the pool that leaves it below a quarter of the size starts a
//! **background refill** (a callout no request waits for, [`Chores::refills`]) for the difference,
//! so no request waits while the pool has tokens. A request the pool cannot pay asks the service
//! itself, as without lease, and when no refill is in flight it carries the refill (`lease`).
//!
//! When the service denies or cannot answer, the tokens already granted are still good: a request
//! its pools can pay is admitted from them ([`rescue`]); otherwise the denial or the failure mode
//! stands, as without lease.
//!
//! Layout: [`Pool`] and its encoding; [`Sizing`]; [`take`], [`spend`], [`refund`], [`release`],
//! [`deposit`], [`deny`], [`reclaim`] on one pool; [`local`] (before the callout), [`settle`],
//! [`refilled`] and [`rescue`] (after it) over a request's [`Plan`]; [`Chores`], the callouts they
//! leave to send; [`Count`], the lease metrics.

use crate::core::base::store::{update, CasStore, Step};
use crate::core::config::{Config, Lease, Rule};
use crate::core::local::bucket::{self, Limits};
use crate::core::local::fallback::{self, learned_instances};
use crate::core::local::table::{self, Slot};
use crate::core::wire::plan::{Outcome, Plan};
use crate::core::wire::{Bucket, BucketResult, TakeRequest, TakeResponse};

/// Words per pool record ([`table`]).
const WORDS: usize = 11;
/// Stored bytes per pool.
pub const POOL_BYTES: usize = 1 + table::ID_BYTES + 8 * WORDS;
/// How long a refill claim outlives the callout timeout: a request whose context was destroyed
/// before its answer (client gone) never settles, and its claim must lapse on its own.
pub const CLAIM_MARGIN_MS: u64 = 50;

/// One proxy's pool for one bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Pool {
    /// Tokens granted by the service and not spent yet.
    pub tokens: u64,
    /// When `tokens` are dropped (ms since the epoch).
    pub expires_ms: u64,
    /// A refill callout is in flight until then (0: none).
    pub refill_until_ms: u64,
    /// The service denied `denied_cost` until then (0: no denial known).
    pub denied_until_ms: u64,
    /// The cost that was denied: a request of this cost or more cannot be paid sooner.
    pub denied_cost: u64,
    /// The global bucket's remaining tokens, as of the last answer.
    pub remaining: u64,
    /// When the global bucket is full again (or its window ends), as of the last answer.
    pub reset_at_ms: u64,
    /// Tokens asked per second at this proxy, in thousandths, as of the last full window.
    pub rate_milli: u64,
    /// When the current rate window began (0: none yet).
    pub window_ms: u64,
    /// Tokens asked in the current rate window.
    pub window_tokens: u64,
    /// The proxies sharing the bucket, as learned from the service's answers when the pool was
    /// last filled (0: not known, the configured number holds).
    pub instances: u64,
}

impl Pool {
    fn encode(&self, id: &[u8; 16]) -> Vec<u8> {
        let words = [
            self.tokens,
            self.expires_ms,
            self.refill_until_ms,
            self.denied_until_ms,
            self.denied_cost,
            self.remaining,
            self.reset_at_ms,
            self.rate_milli,
            self.window_ms,
            self.window_tokens,
            self.instances,
        ];
        table::encode(table::POOL, id, &words)
    }

    /// The pool stored in a slot, if it belongs to `id` (else: none yet, or evicted).
    fn decode(id: &[u8; 16], bytes: Option<&[u8]>) -> Option<Pool> {
        let (owner, n) = table::decode::<WORDS>(table::POOL, bytes?)?;
        if owner != *id {
            return None;
        }
        let [tokens, expires_ms, refill_until_ms, denied_until_ms, denied_cost, remaining, reset_at_ms, rate_milli, window_ms, window_tokens, instances] =
            n;
        Some(Pool {
            tokens,
            expires_ms,
            refill_until_ms,
            denied_until_ms,
            denied_cost,
            remaining,
            reset_at_ms,
            rate_milli,
            window_ms,
            window_tokens,
            instances,
        })
    }

    /// Drops tokens past their expiry; how many were dropped.
    fn expire(&mut self, now_ms: u64) -> u64 {
        if self.tokens > 0 && now_ms >= self.expires_ms {
            return std::mem::take(&mut self.tokens);
        }
        0
    }

    /// Counts `cost` tokens asked at `now_ms` into the rate, over windows of `window_ms`.
    fn observe(&mut self, cost: u64, now_ms: u64, window_ms: u64) {
        let elapsed = now_ms.saturating_sub(self.window_ms);
        if self.window_ms == 0 || now_ms < self.window_ms {
            self.window_ms = now_ms;
            self.window_tokens = 0;
        } else if elapsed >= window_ms {
            let sample = per_second_milli(self.window_tokens, elapsed);
            self.rate_milli = if self.rate_milli == 0 || elapsed >= window_ms.saturating_mul(4) {
                sample
            } else {
                self.rate_milli / 2 + sample / 2
            };
            self.window_ms = now_ms;
            self.window_tokens = 0;
        }
        self.window_tokens = self.window_tokens.saturating_add(cost);
    }

    /// The rate now (thousandths of a token per second): the average, or the current window's
    /// tokens over a whole window when that is more than twice as much (a rise shows before its
    /// window ends; the jitter of a steady rate does not). The window's first token opened it and
    /// spans no time: one lone request is no rate.
    fn rate_now(&self, window_ms: u64) -> u64 {
        let current = per_second_milli(self.window_tokens.saturating_sub(1), window_ms);
        if current > self.rate_milli.saturating_mul(2) {
            current
        } else {
            self.rate_milli
        }
    }

    /// What the headers report: the pool plus the global remaining, at most the capacity.
    fn result(&self, capacity: u64, now_ms: u64) -> BucketResult {
        BucketResult {
            allowed: true,
            limit: capacity,
            remaining: self.tokens.saturating_add(self.remaining).min(capacity),
            reset_ms: self.reset_at_ms.saturating_sub(now_ms),
            retry_after_ms: 0,
            granted: 0,
        }
    }
}

/// `tokens` per `ms` milliseconds, in thousandths of a token per second.
fn per_second_milli(tokens: u64, ms: u64) -> u64 {
    let r = u128::from(tokens) * 1_000_000 / u128::from(ms.max(1));
    u64::try_from(r).unwrap_or(u64::MAX)
}

/// How big one bucket's pool should be, and how long a refill claim holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sizing {
    /// The rule's lease settings.
    pub lease: Lease,
    /// The bucket's capacity.
    pub capacity: u64,
    /// The proxies sharing it as configured (`fallback.instances`, at least `min_instances`): an
    /// adaptive pool holds at most capacity / N, N as learned from the answers when it was, else
    /// this.
    pub instances: u64,
    /// How long a refill claim holds: the callout timeout plus [`CLAIM_MARGIN_MS`].
    pub claim_ms: u64,
}

impl Sizing {
    /// The sizing of a bucket of `capacity` under `lease`, in configuration `cfg`.
    pub fn new(cfg: &Config, lease: Lease, capacity: u64) -> Sizing {
        Sizing {
            lease,
            capacity,
            instances: cfg.fallback.instances.max(cfg.fallback.min_instances),
            claim_ms: claim_ms(cfg),
        }
    }

    /// The rate window: a quarter of `max_age_ms`, between 10 ms and a second.
    fn window_ms(&self) -> u64 {
        (self.lease.max_age_ms / 4).clamp(10, 1000)
    }

    /// The tokens a full pool holds: the fixed size, or what the key spends in `max_age_ms`.
    pub fn target(&self, p: &Pool) -> u64 {
        match self.lease.size {
            Some(n) => n,
            None => {
                let t = u128::from(p.rate_now(self.window_ms()))
                    * u128::from(self.lease.max_age_ms)
                    / 1_000_000;
                let n = if p.instances > 0 {
                    p.instances
                } else {
                    self.instances
                };
                let most = (self.capacity / n.max(1)).max(1);
                u64::try_from(t).unwrap_or(u64::MAX).clamp(1, most)
            }
        }
    }
}

/// The pool slot of a rule's bucket `key`. The identity covers the key and the rule's global
/// limits, so a changed limit is another pool.
pub fn slot(rule: &Rule, key: &str, max_keys: u32) -> Slot {
    let l = Limits::local(rule.capacity, rule.rate, rule.period_ms, rule.algorithm, 1);
    fallback::slot_in(table::POOLS_TABLE, key, &l, max_keys)
}

/// What one pool says about one request's cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Take {
    /// Paid from the pool (stored). `Some(n)`: the pool ran low and this request claimed its
    /// refill: a background callout should ask for `lease = n`.
    Hit(BucketResult, Option<u64>),
    /// The service denied this cost until later: deny without asking.
    Denied(BucketResult),
    /// Ask the service. `Some(n)`: this request claimed the refill and asks for `lease = n`.
    Ask(Option<u64>),
}

/// Tries to pay `cost` from the pool at `slot`, and counts it into the key's rate. Also returns
/// the tokens dropped at expiry (stored: they are gone from the pool).
pub fn take<S: CasStore + ?Sized>(
    store: &S,
    slot: &Slot,
    sizing: &Sizing,
    capacity: u64,
    cost: u64,
    now_ms: u64,
) -> (Take, u64) {
    let done = update(store, &slot.name, |cur| {
        let mut p = Pool::decode(&slot.id, cur).unwrap_or_default();
        let expired = p.expire(now_ms);
        p.observe(cost, now_ms, sizing.window_ms());
        let target = sizing.target(&p);
        let refilling = now_ms < p.refill_until_ms;
        // The service just said it has nothing to give before then: spend what is here.
        let denied = now_ms < p.denied_until_ms;
        let claim = now_ms.saturating_add(sizing.claim_ms);
        let t = if p.tokens >= cost {
            p.tokens -= cost;
            let want = target.saturating_sub(p.tokens);
            let refill = if !refilling && !denied && p.tokens < target.div_ceil(4) && want > 0 {
                p.refill_until_ms = claim;
                Some(want)
            } else {
                None
            };
            Take::Hit(p.result(capacity, now_ms), refill)
        } else if denied && cost >= p.denied_cost {
            Take::Denied(BucketResult {
                allowed: false,
                retry_after_ms: p.denied_until_ms - now_ms,
                ..p.result(capacity, now_ms)
            })
        } else {
            let want = target.saturating_sub(p.tokens);
            if refilling || want <= cost {
                Take::Ask(None)
            } else {
                p.refill_until_ms = claim;
                Take::Ask(Some(want))
            }
        };
        Step::Write(p.encode(&slot.id), (t, expired))
    });
    if done.stored {
        return done.value;
    }
    match done.value {
        // Not stored (CAS gave up under contention): the token was not taken, so it must not be
        // spent, a claim that was not stored is no claim, and nothing expired. Ask the service,
        // plainly.
        (Take::Hit(..) | Take::Ask(_), _) => (Take::Ask(None), 0),
        (t, _) => (t, 0),
    }
}

/// Gives back `cost` taken from the pool earlier in the same request (the request went to the
/// service or was denied after all). Tokens past their expiry are not given back.
pub fn refund<S: CasStore + ?Sized>(store: &S, slot: &Slot, cost: u64, now_ms: u64) {
    update(store, &slot.name, |cur| match Pool::decode(&slot.id, cur) {
        Some(mut p) if now_ms < p.expires_ms => {
            p.tokens = p.tokens.saturating_add(cost);
            Step::Write(p.encode(&slot.id), ())
        }
        _ => Step::Keep(()),
    });
}

/// Pays `cost` from the pool whatever the refill mark and claims say (the service could not
/// be asked); `None` when the pool cannot pay.
pub fn spend<S: CasStore + ?Sized>(
    store: &S,
    slot: &Slot,
    capacity: u64,
    cost: u64,
    now_ms: u64,
) -> Option<BucketResult> {
    let done = update(store, &slot.name, |cur| match Pool::decode(&slot.id, cur) {
        Some(mut p) if now_ms < p.expires_ms && p.tokens >= cost => {
            p.tokens -= cost;
            Step::Write(p.encode(&slot.id), Some(p.result(capacity, now_ms)))
        }
        _ => Step::Keep(None),
    });
    done.value.filter(|_| done.stored)
}

/// Ends a refill claim without a deposit (the callout failed or was not made).
pub fn release<S: CasStore + ?Sized>(store: &S, slot: &Slot) {
    update(store, &slot.name, |cur| match Pool::decode(&slot.id, cur) {
        Some(mut p) if p.refill_until_ms != 0 => {
            p.refill_until_ms = 0;
            Step::Write(p.encode(&slot.id), ())
        }
        _ => Step::Keep(()),
    });
}

/// Takes the tokens of an expired pool out of it (stored); how many. They are the caller's to
/// give back to the service.
pub fn reclaim<S: CasStore + ?Sized>(store: &S, slot: &Slot, now_ms: u64) -> u64 {
    let done = update(store, &slot.name, |cur| match Pool::decode(&slot.id, cur) {
        Some(mut p) if p.tokens > 0 && now_ms >= p.expires_ms => {
            let n = p.expire(now_ms);
            Step::Write(p.encode(&slot.id), n)
        }
        _ => Step::Keep(0),
    });
    if done.stored {
        done.value
    } else {
        0
    }
}

/// Tokens a [`deposit`] found gone: this pool's own, past their expiry (the caller gives them
/// back), and another bucket's pool evicted from the slot (lost: its key is unknown here).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Dropped {
    /// This pool's tokens past their expiry.
    pub expired: u64,
    /// The unexpired tokens of another bucket's pool that held the slot.
    pub evicted: u64,
}

/// After an allowed answer to a refill: adds `extra` tokens to the pool, to be spent until
/// `expires_ms`, ends the claim and any cached denial, and remembers the answer's global state and
/// the proxies sharing the bucket (`instances`, as learned from the answers; 0: not known).
pub fn deposit<S: CasStore + ?Sized>(
    store: &S,
    slot: &Slot,
    extra: u64,
    answer: &BucketResult,
    now_ms: u64,
    expires_ms: u64,
    instances: u64,
) -> Dropped {
    let done = update(store, &slot.name, |cur| {
        let (mut p, dropped) = match Pool::decode(&slot.id, cur) {
            Some(mut p) => {
                let expired = p.expire(now_ms);
                (
                    p,
                    Dropped {
                        expired,
                        evicted: 0,
                    },
                )
            }
            // Another bucket's pool in this slot is evicted: its unexpired tokens are lost.
            None => (
                Pool::default(),
                Dropped {
                    expired: 0,
                    evicted: evicted_tokens(cur, now_ms),
                },
            ),
        };
        p.tokens = p.tokens.saturating_add(extra);
        // A deposit renews the pool's expiry: no token is spent later than `max_age_ms` after
        // the latest grant (for a fixed window, never past the window it was granted in, since
        // the caller caps `expires_ms` at the window's end and older tokens are from that window).
        p.expires_ms = expires_ms;
        p.refill_until_ms = 0;
        p.denied_until_ms = 0;
        p.denied_cost = 0;
        p.remaining = answer.remaining;
        p.reset_at_ms = now_ms.saturating_add(answer.reset_ms);
        if instances > 0 {
            p.instances = instances;
        }
        Step::Write(p.encode(&slot.id), dropped)
    });
    if done.stored {
        done.value
    } else {
        // Not stored: nothing was deposited and nothing dropped; the grant is lost (charged,
        // never spent: the safe side).
        Dropped {
            expired: 0,
            evicted: extra,
        }
    }
}

/// Unexpired tokens of whatever pool occupies a slot (for the `expired` count on eviction).
fn evicted_tokens(cur: Option<&[u8]>, now_ms: u64) -> u64 {
    let Some(b) = cur else { return 0 };
    let Some(id) = b.get(1..17) else { return 0 };
    let mut other = [0u8; 16];
    other.copy_from_slice(id);
    match Pool::decode(&other, Some(b)) {
        Some(p) if now_ms < p.expires_ms => p.tokens,
        _ => 0,
    }
}

/// After a denial: remembers that `cost` cannot be paid before `retry_after_ms` (if this bucket
/// denied), and ends this request's claim if it held one.
pub fn deny<S: CasStore + ?Sized>(
    store: &S,
    slot: &Slot,
    cost: u64,
    answer: &BucketResult,
    claimed: bool,
    now_ms: u64,
) {
    if answer.allowed && !claimed {
        // This bucket could pay and this request held no claim: nothing to remember.
        return;
    }
    update(store, &slot.name, |cur| {
        let mut p = Pool::decode(&slot.id, cur).unwrap_or_default();
        // Dropped tokens are found (and given back) by the next take, which sees the same expiry.
        if claimed {
            p.refill_until_ms = 0;
        }
        if !answer.allowed && answer.retry_after_ms > 0 {
            p.denied_until_ms = now_ms.saturating_add(answer.retry_after_ms);
            p.denied_cost = cost;
        }
        p.remaining = answer.remaining;
        p.reset_at_ms = now_ms.saturating_add(answer.reset_ms);
        Step::Write(p.encode(&slot.id), ())
    });
}

/// Lease counters (metric names `tollgate.lease.<name>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Count {
    /// A request admitted from the pools, without a callout.
    Local,
    /// A request denied by a cached denial, without a callout.
    LocalLimited,
    /// Tokens granted by the service to lease requests.
    Granted,
    /// Tokens dropped unspent (expired, or evicted with their slot); best effort.
    Expired,
    /// Background refills sent (callouts no request waited for).
    Refills,
    /// Expired tokens given back to the service (refund callouts sent for them).
    Returned,
}

impl Count {
    /// Every counter, for defining the metrics.
    pub const ALL: [Count; 6] = [
        Count::Local,
        Count::LocalLimited,
        Count::Granted,
        Count::Expired,
        Count::Refills,
        Count::Returned,
    ];

    /// The metric name.
    pub fn metric(self) -> &'static str {
        match self {
            Count::Local => "tollgate.lease.local",
            Count::LocalLimited => "tollgate.lease.local_limited",
            Count::Granted => "tollgate.lease.granted",
            Count::Expired => "tollgate.lease.expired",
            Count::Refills => "tollgate.lease.refills",
            Count::Returned => "tollgate.lease.returned",
        }
    }
}

/// What the pools decide before any callout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Local {
    /// Decided locally: `Allowed` (every bucket paid from its pool) or `Limited` (a cached
    /// denial). In the contract's shape, so the rest of the filter treats it like an answer.
    Answer(Outcome),
    /// Ask the service for every bucket; the plan's buckets that claimed a refill carry `lease`.
    Call,
}

/// Callouts the pools leave to send beside the request's own, and what they dropped.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Chores {
    /// Tokens dropped unspent (expired or evicted), for [`Count::Expired`].
    pub dropped: u64,
    /// Background refills: one-bucket plans whose `lease` is the refill; their answers go to
    /// [`refilled`]. A refill that cannot be sent must be [`abandon`]ed.
    pub refills: Vec<Plan>,
    /// Expired tokens to give back to the global bucket: one-bucket requests whose `cost` is the
    /// number of tokens (a refund callout, answer not awaited).
    pub returns: Vec<TakeRequest>,
    /// Token-bucket pools this request deposited into: the worker watches them, so their tokens
    /// are given back when they expire even if no request comes for that key again ([`sweep`]).
    pub watch: Vec<Held>,
}

/// A pool a worker deposited into, and when its tokens expire (as of that deposit).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    /// The pool's slot.
    pub slot: Slot,
    /// Its bucket, as sent to the service (`cost` and `lease` cleared).
    pub bucket: Bucket,
    /// When its tokens expire, as of the last look.
    pub expires_ms: u64,
}

/// Most pools one worker watches per configuration; past that, a newly watched pool replaces the
/// one expiring soonest (an unwatched pool's tokens still return when a request finds them
/// expired).
pub const MAX_WATCHED: usize = 256;

/// Adds `h` to the watched pools `held` (an entry for the same pool is renewed).
pub fn watch(held: &mut Vec<Held>, h: Held) {
    if let Some(w) = held.iter_mut().find(|w| w.slot == h.slot) {
        w.expires_ms = w.expires_ms.max(h.expires_ms);
        return;
    }
    if held.len() >= MAX_WATCHED {
        if let Some(i) = (0..held.len()).min_by_key(|&i| held.get(i).map_or(0, |w| w.expires_ms)) {
            held.swap_remove(i);
        }
    }
    held.push(h);
}

/// Looks at the watched pools whose tokens are due to expire: takes out what expired (with CAS,
/// so of the workers watching one pool only one gets its tokens) and returns the refunds to send
/// for them, with the number of tokens. A pool renewed since is watched until its new expiry; an
/// empty, evicted or vanished one is no longer watched.
pub fn sweep<S: CasStore + ?Sized>(
    store: &S,
    held: &mut Vec<Held>,
    now_ms: u64,
) -> (Vec<TakeRequest>, u64) {
    let (mut returns, mut tokens) = (Vec::new(), 0);
    held.retain_mut(|h| {
        if now_ms < h.expires_ms {
            return true;
        }
        let n = reclaim(store, &h.slot, now_ms);
        if n > 0 {
            tokens += n;
            returns.push(TakeRequest {
                buckets: vec![Bucket {
                    cost: Some(n),
                    ..h.bucket.clone()
                }],
            });
        }
        let pool = store
            .get(&h.slot.name)
            .and_then(|(v, _)| Pool::decode(&h.slot.id, Some(&v)));
        match pool {
            Some(p) if p.tokens > 0 && p.expires_ms > now_ms => {
                h.expires_ms = p.expires_ms;
                true
            }
            _ => false,
        }
    });
    (returns, tokens)
}

impl Chores {
    /// Tokens dropped from bucket `i` of `plan` by expiry: counted, and for a token bucket given
    /// back (a fixed window's tokens expire with their window: there is nothing to give back).
    fn expired(&mut self, plan: &Plan, i: usize, n: u64) {
        if n == 0 {
            return;
        }
        self.dropped += n;
        if let Some(b) = plan.request.buckets.get(i) {
            if bucket::refundable(b.algorithm.unwrap_or_default()) {
                self.returns.push(TakeRequest {
                    buckets: vec![Bucket {
                        cost: Some(n),
                        lease: None,
                        ..b.clone()
                    }],
                });
            }
        }
    }

    /// Bucket `i` of `plan` got tokens expiring at `expires_ms` in pool `slot`: watch it (token
    /// buckets only, as for [`Chores::expired`]).
    fn held(&mut self, plan: &Plan, i: usize, slot: &Slot, expires_ms: u64) {
        if let Some(b) = plan.request.buckets.get(i) {
            if bucket::refundable(b.algorithm.unwrap_or_default()) {
                self.watch.push(Held {
                    slot: slot.clone(),
                    bucket: Bucket {
                        cost: None,
                        lease: None,
                        ..b.clone()
                    },
                    expires_ms,
                });
            }
        }
    }

    /// A background refill of `lease` tokens for bucket `i` of `plan`.
    fn refill(&mut self, plan: &Plan, i: usize, lease: u64) {
        let (Some(b), Some(&rule)) = (plan.request.buckets.get(i), plan.rules.get(i)) else {
            return;
        };
        self.refills.push(Plan {
            request: TakeRequest {
                buckets: vec![Bucket {
                    cost: None,
                    // A lease of one is a take of one.
                    lease: Some(lease).filter(|&n| n > 1),
                    ..b.clone()
                }],
            },
            rules: vec![rule],
            debt: Vec::new(),
            rls: None,
        });
    }
}

/// The lease-rule buckets of a plan: (bucket index, rule, lease).
fn leased<'a>(cfg: &'a Config, plan: &Plan) -> Vec<(usize, &'a Rule, Lease)> {
    plan.rules
        .iter()
        .enumerate()
        .filter_map(|(i, &r)| {
            let rule = cfg.rules.get(r)?;
            Some((i, rule, rule.lease?))
        })
        .collect()
}

fn claim_ms(cfg: &Config) -> u64 {
    cfg.service.timeout_ms.saturating_add(CLAIM_MARGIN_MS)
}

/// Consults the pools of `plan`'s lease rules. All buckets paid locally → admitted; a cached
/// denial on any bucket → denied (the service would deny the whole request: all or nothing);
/// otherwise what was taken is given back and the whole request goes to the service, with
/// `lease` set on the buckets whose refill this request claimed. A plan with a rule without
/// lease always goes to the service. Also returns the background refills this request claimed
/// and the expired tokens to give back.
pub fn local<S: CasStore + ?Sized>(
    cfg: &Config,
    plan: &mut Plan,
    store: &S,
    now_ms: u64,
) -> (Local, Chores) {
    let lease_buckets = leased(cfg, plan);
    let mut chores = Chores::default();
    if lease_buckets.is_empty() {
        return (Local::Call, chores);
    }
    let all_leased = lease_buckets.len() == plan.request.buckets.len();
    let mut results: Vec<Option<BucketResult>> = vec![None; plan.request.buckets.len()];
    let mut hits: Vec<(Slot, u64)> = Vec::new();
    let mut claims: Vec<(usize, Slot, u64)> = Vec::new();
    let mut denied = false;
    for (i, rule, lease) in &lease_buckets {
        let Some(b) = plan.request.buckets.get(*i) else {
            continue;
        };
        let cost = b.cost.unwrap_or(1);
        let slot = slot(rule, &b.key, cfg.fallback.max_keys);
        let sizing = Sizing::new(cfg, *lease, b.capacity);
        let (t, e) = take(store, &slot, &sizing, b.capacity, cost, now_ms);
        chores.expired(plan, *i, e);
        match t {
            Take::Hit(r, refill) => {
                hits.push((slot, cost));
                if let Some(x) = results.get_mut(*i) {
                    *x = Some(r);
                }
                if let Some(n) = refill {
                    // The pool runs low: refill it in the background, whatever this request's
                    // fate (a request that goes to the service gives its take back, which does
                    // not make the pool any fuller than it was).
                    chores.refill(plan, *i, n);
                }
            }
            Take::Denied(r) => {
                denied = true;
                if let Some(x) = results.get_mut(*i) {
                    *x = Some(r);
                }
            }
            Take::Ask(Some(n)) => claims.push((*i, slot, n)),
            Take::Ask(None) => {}
        }
    }
    if all_leased && !denied && hits.len() == plan.request.buckets.len() {
        let buckets = results.into_iter().flatten().collect();
        return (
            Local::Answer(Outcome::Allowed(TakeResponse {
                allowed: true,
                buckets,
                instances: 0,
            })),
            chores,
        );
    }
    for (slot, cost) in &hits {
        refund(store, slot, *cost, now_ms);
    }
    if denied {
        for (_, slot, _) in &claims {
            release(store, slot);
        }
        // Buckets not denied: nothing is known or charged; report them as full so the headers'
        // tightest bucket is the one that denied.
        let buckets = plan
            .rules
            .iter()
            .zip(results)
            .map(|(&r, res)| {
                res.unwrap_or_else(|| {
                    let cap = cfg.rules.get(r).map_or(0, |rule| rule.capacity);
                    BucketResult {
                        allowed: true,
                        limit: cap,
                        remaining: cap,
                        ..BucketResult::default()
                    }
                })
            })
            .collect();
        return (
            Local::Answer(Outcome::Limited(TakeResponse {
                allowed: false,
                buckets,
                instances: 0,
            })),
            chores,
        );
    }
    for (i, _, n) in claims {
        if let Some(b) = plan.request.buckets.get_mut(i) {
            b.lease = Some(n);
        }
    }
    (Local::Call, chores)
}

/// When the service did not admit a request (it denied, failed, or the breaker is open) the
/// tokens already granted are still good: a request that every bucket's pool can pay is admitted
/// from the pools (a refill request leaves the pool to the others, so its own denial may find
/// tokens there); else `None`, and the denial or the failure mode stands.
pub fn rescue<S: CasStore + ?Sized>(
    cfg: &Config,
    plan: &Plan,
    store: &S,
    now_ms: u64,
) -> Option<Outcome> {
    let lease_buckets = leased(cfg, plan);
    if lease_buckets.is_empty() || lease_buckets.len() != plan.request.buckets.len() {
        return None;
    }
    let mut paid: Vec<(Slot, u64)> = Vec::new();
    let mut results = Vec::with_capacity(lease_buckets.len());
    for (i, rule, _) in &lease_buckets {
        let b = plan.request.buckets.get(*i)?;
        let cost = b.cost.unwrap_or(1);
        let slot = slot(rule, &b.key, cfg.fallback.max_keys);
        match spend(store, &slot, rule.capacity, cost, now_ms) {
            Some(r) => {
                results.push(r);
                paid.push((slot, cost));
            }
            None => {
                for (slot, cost) in &paid {
                    refund(store, slot, *cost, now_ms);
                }
                return None;
            }
        }
    }
    Some(Outcome::Allowed(TakeResponse {
        allowed: true,
        buckets: results,
        instances: 0,
    }))
}

/// When tokens granted now to a bucket of `rule` stop being spendable.
fn expiry(rule: &Rule, lease: &Lease, answer: &BucketResult, now_ms: u64) -> u64 {
    let until = now_ms.saturating_add(lease.max_age_ms);
    match bucket::spend_within_ms(rule.algorithm, answer.reset_ms, rule.period_ms) {
        // A token of this window must not be spent in the next one.
        Some(ms) => until.min(now_ms.saturating_add(ms)),
        None => until,
    }
}

/// Applies a callout's outcome to the pools of `plan`'s lease rules: an allowed refill deposits
/// `granted − cost`; a bucket that denied caches its denial; a failure only ends the claims.
/// Returns the tokens granted to refills, and what the deposits dropped.
pub fn settle<S: CasStore + ?Sized>(
    cfg: &Config,
    plan: &Plan,
    outcome: &Outcome,
    store: &S,
    now_ms: u64,
) -> (u64, Chores) {
    let (mut granted, mut chores) = (0, Chores::default());
    for (i, rule, lease) in leased(cfg, plan) {
        let Some(b) = plan.request.buckets.get(i) else {
            continue;
        };
        // A lease that only carries a fallback debt is no refill claim.
        let claimed = plan.own_lease(i).is_some();
        let cost = b.cost.unwrap_or(1);
        let slot = slot(rule, &b.key, cfg.fallback.max_keys);
        match outcome {
            Outcome::Allowed(resp) => {
                let Some(r) = resp.buckets.get(i) else {
                    continue;
                };
                if !claimed {
                    continue;
                }
                // Never more than asked for; an answer without `granted` deposits nothing. The
                // debt is repaid first (fallback::remember), the rest fills the pool.
                let g = r
                    .granted
                    .saturating_sub(plan.repaid(i, r.granted))
                    .min(plan.own_lease(i).unwrap_or(cost));
                granted += g;
                let until = expiry(rule, &lease, r, now_ms);
                let n = learned_instances(store).unwrap_or(0);
                let d = deposit(store, &slot, g.saturating_sub(cost), r, now_ms, until, n);
                chores.dropped += d.evicted;
                chores.expired(plan, i, d.expired);
                if g > cost {
                    chores.held(plan, i, &slot, until);
                }
            }
            Outcome::Limited(resp) => {
                if let Some(r) = resp.buckets.get(i) {
                    deny(store, &slot, cost, r, claimed, now_ms);
                }
            }
            Outcome::Failed(_) => {
                if claimed {
                    release(store, &slot);
                }
            }
        }
    }
    (granted, chores)
}

/// Applies the outcome of a background refill ([`Chores::refills`]: one bucket, no request
/// waiting) to its pool: everything granted (at most the lease) is deposited; a denial is cached;
/// a failure ends the claim. Returns the tokens granted, and what the deposit dropped.
pub fn refilled<S: CasStore + ?Sized>(
    cfg: &Config,
    plan: &Plan,
    outcome: &Outcome,
    store: &S,
    now_ms: u64,
) -> (u64, Chores) {
    let mut chores = Chores::default();
    let Some((i, rule, lease)) = leased(cfg, plan).into_iter().next() else {
        return (0, chores);
    };
    let Some(b) = plan.request.buckets.get(i) else {
        return (0, chores);
    };
    let slot = slot(rule, &b.key, cfg.fallback.max_keys);
    let asked = b.lease.unwrap_or(1);
    match outcome {
        Outcome::Allowed(resp) => {
            let Some(r) = resp.buckets.get(i) else {
                release(store, &slot);
                return (0, chores);
            };
            let g = r.granted.min(asked);
            let until = expiry(rule, &lease, r, now_ms);
            let n = learned_instances(store).unwrap_or(0);
            let d = deposit(store, &slot, g, r, now_ms, until, n);
            chores.dropped += d.evicted;
            chores.expired(plan, i, d.expired);
            if g > 0 {
                chores.held(plan, i, &slot, until);
            }
            (g, chores)
        }
        Outcome::Limited(resp) => {
            match resp.buckets.get(i) {
                Some(r) => deny(store, &slot, b.cost.unwrap_or(1), r, true, now_ms),
                None => release(store, &slot),
            }
            (0, chores)
        }
        Outcome::Failed(_) => {
            release(store, &slot);
            (0, chores)
        }
    }
}

/// A background refill that could not be sent (breaker open, dispatch failed): ends its claim.
pub fn abandon<S: CasStore + ?Sized>(cfg: &Config, plan: &Plan, store: &S) {
    for (i, rule, _) in leased(cfg, plan) {
        if let Some(b) = plan.request.buckets.get(i) {
            release(store, &slot(rule, &b.key, cfg.fallback.max_keys));
        }
    }
}

#[cfg(test)]
mod tests {
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
        cfg(
            r#"{"name":"r","key":["literal:k"],"capacity":100,"period_ms":1000,"lease":{"size":8}}"#,
        )
    }

    fn plan(c: &Config) -> Plan {
        let req = Request {
            headers: vec![(":path".into(), b"/".to_vec())],
            peer: None,
        };
        match decide(c, &req) {
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
        }
    }

    fn pool(s: &FakeStore, c: &Config) -> Pool {
        let p = plan(c);
        let sl = slot(&c.rules[0], &p.request.buckets[0].key, c.fallback.max_keys);
        Pool::decode(&sl.id, s.map.borrow().get(&sl.name).map(|e| e.0.as_slice())).unwrap()
    }

    fn the_slot() -> Slot {
        Slot {
            name: "tollgate.lease.0".into(),
            id: [7; 16],
        }
    }

    fn stored(s: &FakeStore, sl: &Slot) -> Pool {
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
                    slot: Slot {
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
        deny(&s, &sl, 3, &answer(false, 0, 400), true, 0);
        let (t, _) = take(&s, &sl, &L, 100, 3, 100);
        let Take::Denied(r) = t else { panic!("{t:?}") };
        assert_eq!((r.allowed, r.retry_after_ms), (false, 300));
        assert!(matches!(take(&s, &sl, &L, 100, 5, 100).0, Take::Denied(_)));
        // A smaller cost might be payable: ask.
        assert!(matches!(take(&s, &sl, &L, 100, 2, 100).0, Take::Ask(_)));
        // The claim of the denied request ended, so after the retry time the next one refills.
        let s = FakeStore::default();
        deny(&s, &sl, 3, &answer(false, 0, 400), true, 0);
        assert_eq!(take(&s, &sl, &L, 100, 3, 400).0, Take::Ask(Some(8)));
    }

    #[test]
    fn pooled_tokens_are_spent_before_a_cached_denial_applies() {
        // Granted tokens are already charged: spending them is always within the limit.
        let s = FakeStore::default();
        let sl = the_slot();
        deposit(&s, &sl, 4, &answer(true, 5, 0), 0, 1000, 0);
        deny(&s, &sl, 1, &answer(false, 0, 500), false, 0);
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
        deny(&s, &sl, 1, &answer(false, 0, 500), false, 0);
        // Below the mark, but the service has nothing: spend the pool down to zero.
        assert!(matches!(take(&s, &sl, &L, 100, 1, 1).0, Take::Hit(_, None)));
        assert!(matches!(take(&s, &sl, &L, 100, 1, 1).0, Take::Hit(_, None)));
        assert!(matches!(take(&s, &sl, &L, 100, 1, 1).0, Take::Denied(_)));
    }

    #[test]
    fn eviction_by_another_key_drops_and_counts() {
        let s = FakeStore::default();
        let a = the_slot();
        let b = Slot {
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
        };
        let (granted, chores) = settle(&c, &p, &Outcome::Allowed(resp), &s, 0);
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
        let sl = slot(&c.rules[0], &p.request.buckets[0].key, c.fallback.max_keys);
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
        let sl = slot(&c.rules[0], &p.request.buckets[0].key, c.fallback.max_keys);
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
        let sl = slot(&c.rules[0], &p.request.buckets[0].key, c.fallback.max_keys);
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
        let sl = slot(&c.rules[0], &p.request.buckets[0].key, c.fallback.max_keys);
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
        let sa = slot(&c.rules[0], &p0.request.buckets[0].key, c.fallback.max_keys);
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
        };
        assert_eq!(settle(&c, &p, &Outcome::Allowed(resp), &s, 2).0, 4);
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
        let sa = slot(&c.rules[0], &p0.request.buckets[0].key, c.fallback.max_keys);
        deposit(&s, &sa, 7, &answer(true, 8, 0), 0, 1000, 0);
        // The service denied b (a could pay): b's denial is cached, a stays as it was.
        let mut p = plan(&c);
        local(&c, &mut p, &s, 0);
        let resp = TakeResponse {
            allowed: false,
            buckets: vec![answer(true, 0, 0), answer(false, 0, 700)],
            instances: 0,
        };
        settle(&c, &p, &Outcome::Limited(resp), &s, 0);
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
    fn failure_releases_the_claim_and_keeps_the_pool() {
        let c = one();
        let s = FakeStore::default();
        let mut p = plan(&c);
        local(&c, &mut p, &s, 0);
        settle(
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
        let sl = slot(&c.rules[0], &p.request.buckets[0].key, c.fallback.max_keys);
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
        let sa = slot(&c.rules[0], &p.request.buckets[0].key, c.fallback.max_keys);
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
        };
        settle(&c, &p, &Outcome::Allowed(resp), &s, 0);
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
        };
        settle(&c, &p, &Outcome::Allowed(resp), &s, 0);
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
        };
        assert_eq!(settle(&c, &p, &Outcome::Allowed(resp), &s, 0).0, 8);
        assert_eq!(pool(&s, &c).tokens, 7);
    }
}
