//! One pool: its record in shared data ([`Pool`], its encoding), its size ([`Sizing`]), and what
//! is done to it ([`take`], [`spend`], [`refund`], [`release`], [`deposit`], [`deny`],
//! [`reclaim`]), each one compare-and-swap on its slot.

use crate::core::base::place::Memos;
use crate::core::base::store::{update, CasStore, Change};
use crate::core::config::{Config, Lease, RateLimit};
use crate::core::local::bucket::Limits;
use crate::core::local::table::{self, Place};
use crate::core::wire::BucketResult;

/// Words per pool record ([`table`]).
const WORDS: usize = 12;
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
    /// A denial of `denied_cost` is answered here until then, without asking (0: no denial
    /// known): the service's retry time, at most `service.remember_denials_ms` after its answer.
    pub denied_until_ms: u64,
    /// When the service said `denied_cost` could be paid (what `Retry-After` counts down to).
    pub retry_at_ms: u64,
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
    pub(super) fn encode(&self, id: &[u8; 16]) -> Vec<u8> {
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
            self.retry_at_ms,
        ];
        table::encode(table::POOL, id, &words)
    }

    /// The pool stored in a slot, if it belongs to `id` (else: none yet, or evicted).
    pub(super) fn decode(id: &[u8; 16], bytes: Option<&[u8]>) -> Option<Pool> {
        let (owner, n) = table::decode::<WORDS>(table::POOL, bytes?)?;
        if owner != *id {
            return None;
        }
        let [tokens, expires_ms, refill_until_ms, denied_until_ms, denied_cost, remaining, reset_at_ms, rate_milli, window_ms, window_tokens, instances, retry_at_ms] =
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
            retry_at_ms,
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
            delay_ms: 0,
            window: 0,
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

/// The pool slot of bucket `key` of a rule limited by `rule`. The identity covers the key and the
/// rule's global limits, so a changed limit is another pool. Last found in `memos`.
pub fn slot(memos: &Memos, rule: &RateLimit, key: &str, max_keys: u32) -> Place {
    let rate = rule
        .calendar
        .as_ref()
        .map_or(rule.rate, crate::core::local::bucket::calendar_rate);
    let l = Limits::local(rule.capacity, rate, rule.period_ms, rule.algorithm, 1);
    table::place_in(memos, table::POOLS_TABLE, key, &l, max_keys)
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
    slot: &Place,
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
                retry_after_ms: p.retry_at_ms.max(p.denied_until_ms) - now_ms,
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
        Change::Write(p.encode(&slot.id), (t, expired))
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
pub fn refund<S: CasStore + ?Sized>(store: &S, slot: &Place, cost: u64, now_ms: u64) {
    update(store, &slot.name, |cur| match Pool::decode(&slot.id, cur) {
        Some(mut p) if now_ms < p.expires_ms => {
            p.tokens = p.tokens.saturating_add(cost);
            Change::Write(p.encode(&slot.id), ())
        }
        _ => Change::Keep(()),
    });
}

/// Pays `cost` from the pool whatever the refill mark and claims say (the service could not
/// be asked); `None` when the pool cannot pay.
pub fn spend<S: CasStore + ?Sized>(
    store: &S,
    slot: &Place,
    capacity: u64,
    cost: u64,
    now_ms: u64,
) -> Option<BucketResult> {
    let done = update(store, &slot.name, |cur| match Pool::decode(&slot.id, cur) {
        Some(mut p) if now_ms < p.expires_ms && p.tokens >= cost => {
            p.tokens -= cost;
            Change::Write(p.encode(&slot.id), Some(p.result(capacity, now_ms)))
        }
        _ => Change::Keep(None),
    });
    done.value.filter(|_| done.stored)
}

/// Ends a refill claim without a deposit (the callout failed or was not made).
pub fn release<S: CasStore + ?Sized>(store: &S, slot: &Place) {
    update(store, &slot.name, |cur| match Pool::decode(&slot.id, cur) {
        Some(mut p) if p.refill_until_ms != 0 => {
            p.refill_until_ms = 0;
            Change::Write(p.encode(&slot.id), ())
        }
        _ => Change::Keep(()),
    });
}

/// Takes the tokens of an expired pool out of it (stored); how many. They are the caller's to
/// give back to the service.
pub fn reclaim<S: CasStore + ?Sized>(store: &S, slot: &Place, now_ms: u64) -> u64 {
    let done = update(store, &slot.name, |cur| match Pool::decode(&slot.id, cur) {
        Some(mut p) if p.tokens > 0 && now_ms >= p.expires_ms => {
            let n = p.expire(now_ms);
            Change::Write(p.encode(&slot.id), n)
        }
        _ => Change::Keep(0),
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
    slot: &Place,
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
        Change::Write(p.encode(&slot.id), dropped)
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
/// denied), for at most `cap_ms` (`service.remember_denials_ms`, as exact mode's remembered
/// denials: a bucket an operator resets, or one a refund or settlement refilled early, is asked
/// again within it), and ends this request's claim if it held one.
pub fn deny<S: CasStore + ?Sized>(
    store: &S,
    slot: &Place,
    cost: u64,
    answer: &BucketResult,
    claimed: bool,
    cap_ms: u64,
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
            p.denied_until_ms = now_ms.saturating_add(answer.retry_after_ms.min(cap_ms));
            p.retry_at_ms = now_ms.saturating_add(answer.retry_after_ms);
            p.denied_cost = cost;
        }
        p.remaining = answer.remaining;
        p.reset_at_ms = now_ms.saturating_add(answer.reset_ms);
        Change::Write(p.encode(&slot.id), ())
    });
}

pub(super) fn claim_ms(cfg: &Config) -> u64 {
    cfg.service.timeout_ms.saturating_add(CLAIM_MARGIN_MS)
}
