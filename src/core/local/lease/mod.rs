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
//! as the remembered denials ([`table::place_in`](crate::core::local::table::place_in)). A pool also remembers:
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
//! Layout: `pool`: [`Pool`] and its encoding; [`Sizing`]; [`take`], [`spend`], [`refund`], [`release`],
//! [`deposit`], [`deny`], [`reclaim`] on one pool; [`local`] (before the callout), [`apply`],
//! [`refilled`] and [`rescue`] (after it) over a request's [`Plan`]; [`Chores`], the callouts they
//! leave to send; [`Count`], the lease metrics; `tests`.

use crate::core::base::store::CasStore;
use crate::core::config::{Config, Lease, RateLimit, Rule};
use crate::core::local::bucket;
use crate::core::local::record::learned_instances;
use crate::core::local::table::Place;
use crate::core::wire::plan::{Outcome, Plan};
use crate::core::wire::{Bucket, BucketResult, TakeRequest, TakeResponse};

pub mod pool;
use pool::*;

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
    pub slot: Place,
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
    fn held(&mut self, plan: &Plan, i: usize, slot: &Place, expires_ms: u64) {
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
            instances: 0,
        });
    }
}

/// The lease-rule buckets of a plan: (bucket index, the rule's limit, lease).
fn leased<'a>(cfg: &'a Config, plan: &Plan) -> Vec<(usize, &'a RateLimit, Lease)> {
    plan.rules
        .iter()
        .enumerate()
        .filter_map(|(i, &r)| {
            let l = cfg.rules.get(r)?.rate_limit()?;
            Some((i, l, l.lease?))
        })
        .collect()
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
    let mut hits: Vec<(Place, u64)> = Vec::new();
    let mut claims: Vec<(usize, Place, u64)> = Vec::new();
    let mut denied = false;
    for (i, l, lease) in &lease_buckets {
        let Some(b) = plan.request.buckets.get(*i) else {
            continue;
        };
        let cost = b.cost();
        let slot = slot(store.memos(), l, &b.key, cfg.fallback.max_keys);
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
                delay_ms: 0,
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
                    let cap = cfg
                        .rules
                        .get(r)
                        .and_then(Rule::rate_limit)
                        .map_or(0, |l| l.capacity);
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
                delay_ms: 0,
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
    let mut paid: Vec<(Place, u64)> = Vec::new();
    let mut results = Vec::with_capacity(lease_buckets.len());
    for (i, l, _) in &lease_buckets {
        let b = plan.request.buckets.get(*i)?;
        let cost = b.cost();
        let slot = slot(store.memos(), l, &b.key, cfg.fallback.max_keys);
        match spend(store, &slot, l.capacity, cost, now_ms) {
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
        delay_ms: 0,
    }))
}

/// When tokens granted now to a bucket of a rule limited by `l` stop being spendable.
fn expiry(l: &RateLimit, lease: &Lease, answer: &BucketResult, now_ms: u64) -> u64 {
    let until = now_ms.saturating_add(lease.max_age_ms);
    match bucket::spend_within_ms(l.algorithm, answer.reset_ms, l.period_ms) {
        // A token of this window must not be spent in the next one.
        Some(ms) => until.min(now_ms.saturating_add(ms)),
        None => until,
    }
}

/// Applies a callout's outcome to the pools of `plan`'s lease rules: an allowed refill deposits
/// `granted − cost`; a bucket that denied caches its denial; a failure only ends the claims.
/// Returns the tokens granted to refills, and what the deposits dropped.
pub fn apply<S: CasStore + ?Sized>(
    cfg: &Config,
    plan: &Plan,
    outcome: &Outcome,
    store: &S,
    now_ms: u64,
) -> (u64, Chores) {
    let (mut granted, mut chores) = (0, Chores::default());
    for (i, l, lease) in leased(cfg, plan) {
        let Some(b) = plan.request.buckets.get(i) else {
            continue;
        };
        // A lease that only carries a fallback debt is no refill claim.
        let claimed = plan.own_lease(i).is_some();
        let cost = b.cost();
        let slot = slot(store.memos(), l, &b.key, cfg.fallback.max_keys);
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
                let until = expiry(l, &lease, r, now_ms);
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
                    deny(
                        store,
                        &slot,
                        cost,
                        r,
                        claimed,
                        cfg.service.remember_denials_ms,
                        now_ms,
                    );
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
    let Some((i, l, lease)) = leased(cfg, plan).into_iter().next() else {
        return (0, chores);
    };
    let Some(b) = plan.request.buckets.get(i) else {
        return (0, chores);
    };
    let slot = slot(store.memos(), l, &b.key, cfg.fallback.max_keys);
    let asked = b.lease.unwrap_or(1);
    match outcome {
        Outcome::Allowed(resp) => {
            let Some(r) = resp.buckets.get(i) else {
                release(store, &slot);
                return (0, chores);
            };
            let g = r.granted.min(asked);
            let until = expiry(l, &lease, r, now_ms);
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
                Some(r) => deny(
                    store,
                    &slot,
                    b.cost(),
                    r,
                    true,
                    cfg.service.remember_denials_ms,
                    now_ms,
                ),
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
    for (i, l, _) in leased(cfg, plan) {
        if let Some(b) = plan.request.buckets.get(i) {
            let place = slot(store.memos(), l, &b.key, cfg.fallback.max_keys);
            release(store, &place);
        }
    }
}

#[cfg(test)]
mod tests;
