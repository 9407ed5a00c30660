//! Token bucket: holds up to `capacity` tokens, refills continuously at `rate / period_ms`, starts
//! full. Integer micro-tokens and a carried refill remainder, so no fraction of a token is lost
//! between charges; the balance is signed (`i128`) because a settle may leave the bucket owing,
//! the whole overshoot (down to minus [`contract::bounds::MAX_DEBT`] at most). The same
//! arithmetic as `lua/token_bucket.lua` (its header documents the stored fields and the
//! carry-over of a changed limit).

use super::{cap_ms, Counter, Limits};
use crate::domain::{BucketSpec, SettleResult, SettleSpec};
use contract::take::BucketResult as BucketDecision;

const MICRO: u128 = 1_000_000;
const MICRO_I: i128 = 1_000_000;
/// The lowest balance, in micro-tokens (`MAX_DEBT_M` in token_bucket.lua).
const FLOOR_M: i128 = -(contract::bounds::MAX_DEBT as i128) * MICRO_I;

/// The token bucket.
#[derive(Debug)]
pub struct TokenBucket;

/// A token bucket's state.
#[derive(Debug, Clone, Copy)]
pub struct Tokens {
    /// Micro-tokens held: below zero while the bucket owes (after a settle), never below
    /// [`FLOOR_M`].
    t: i128,
    /// Last update (µs).
    ts: u64,
    /// Refill remainder, in 1/period_ms of a micro-token.
    f: u128,
    limits: Limits,
}

/// Refills `s` up to `now` under `l`, as `tb_refill` in token_bucket.lua.
fn refill(l: &Limits, s: &mut Tokens, now: u64) {
    if now <= s.ts {
        return;
    }
    let cap_m = i128::from(l.capacity) * MICRO_I;
    if s.t >= cap_m {
        s.t = cap_m;
        s.f = 0;
    } else {
        // Same units as token_bucket.lua: f is in 1/period_ms of a micro-token.
        let period = u128::from(l.period_ms);
        let x = u128::from(now - s.ts) * u128::from(l.rate) * 1000 + s.f;
        let add = x / period;
        // Positive here, at most the capacity plus MAX_DEBT in micro-tokens (with a debt).
        let missing = u128::try_from(cap_m - s.t).unwrap_or(0);
        if add >= missing {
            s.t = cap_m;
            s.f = 0;
        } else {
            // add < missing <= 2e15: it fits.
            s.t += i128::try_from(add).unwrap_or(0);
            s.f = x % period;
        }
    }
    s.ts = now;
}

/// Milliseconds until `t` micro-tokens are full again under `l`.
fn reset_ms(l: &Limits, t: i128) -> u64 {
    let missing = u128::try_from(i128::from(l.capacity) * MICRO_I - t).unwrap_or(0);
    cap_ms((missing * u128::from(l.period_ms)).div_ceil((u128::from(l.rate) * MICRO).max(1)))
}

/// Milliseconds for an empty bucket of `b`'s limits to fill (tests wait for expiry with it).
pub fn fill_ms(b: &BucketSpec) -> u64 {
    reset_ms(&Limits::of(b), 0)
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

impl Counter for TokenBucket {
    const CODE: u64 = 0;
    const LUA: &'static str = include_str!("../lua/token_bucket.lua");
    type State = Tokens;

    /// Refilled up to now; a bucket charged with other limits is first refilled under those, then
    /// its tokens scaled to the new capacity keeping the fraction held (rounded down, a debt too:
    /// it grows; the remainder dropped), never above it.
    fn load(b: &BucketSpec, stored: Option<Tokens>, now: u64) -> Tokens {
        let new = Limits::of(b);
        let cap_m = i128::from(b.capacity) * MICRO_I;
        let mut s = match stored {
            Some(mut s) => {
                if s.limits != new {
                    let old = s.limits;
                    refill(&old, &mut s, now);
                    if old.capacity != new.capacity {
                        s.t = (s.t * i128::from(new.capacity))
                            .div_euclid(i128::from(old.capacity.max(1)));
                    }
                    s.t = s.t.clamp(FLOOR_M, cap_m);
                    s.f = 0;
                    s.limits = new;
                }
                s
            }
            None => Tokens {
                t: cap_m,
                ts: now,
                f: 0,
                limits: new,
            },
        };
        refill(&new, &mut s, now);
        s
    }

    fn take(b: &BucketSpec, s: &mut Tokens, _now: u64) -> (BucketDecision, bool) {
        let cost_m = i128::from(b.cost) * MICRO_I;
        let allowed = b.cost <= b.capacity && s.t >= cost_m;
        let mut granted = 0;
        let retry = if allowed {
            // Lease: as many whole tokens as held, up to `lease`, at least `cost`.
            let whole = u64::try_from(s.t / MICRO_I).unwrap_or(u64::MAX);
            granted = b.lease.min(whole).max(b.cost);
            s.t -= i128::from(granted) * MICRO_I;
            0
        } else if b.cost > b.capacity {
            b.period_ms
        } else {
            // The whole deficit, a debt included.
            let deficit = u128::try_from(cost_m - s.t).unwrap_or(0);
            cap_ms(
                (deficit * u128::from(b.period_ms)).div_ceil((u128::from(b.rate) * MICRO).max(1)),
            )
        };
        let d = BucketDecision {
            allowed,
            limit: b.capacity,
            remaining: whole_tokens(s.t),
            reset_ms: reset_ms(&s.limits, s.t),
            retry_after_ms: retry,
            granted,
        };
        (d, allowed)
    }

    fn mark(_: &Tokens) -> u64 {
        0
    }

    /// Added back, capped at the capacity (the state was refilled up to now by `load`).
    fn refund(b: &BucketSpec, s: &mut Tokens, amount: u64, _mark: u64) -> bool {
        let cap_m = i128::from(b.capacity) * MICRO_I;
        s.t = (s.t + i128::from(amount) * MICRO_I).min(cap_m);
        true
    }

    /// A refund (only to a bucket that existed: an expired one is full), or an extra charge in
    /// full, into debt (down to [`FLOOR_M`]).
    fn settle(spec: &SettleSpec, s: &mut Tokens, existed: bool) -> bool {
        let cap_m = i128::from(spec.bucket.capacity) * MICRO_I;
        if spec.used < spec.estimate && existed {
            s.t = (s.t + i128::from(spec.estimate - spec.used) * MICRO_I).min(cap_m);
            true
        } else if spec.used > spec.estimate {
            s.t = (s.t - i128::from(spec.used - spec.estimate) * MICRO_I).max(FLOOR_M);
            true
        } else {
            false
        }
    }

    fn settle_result(_: &BucketSpec, s: &Tokens, _now: u64) -> SettleResult {
        SettleResult {
            remaining: whole_tokens(s.t),
            debt: debt_tokens(s.t),
        }
    }

    fn until_idle_ms(s: &Tokens, _now: u64) -> u64 {
        reset_ms(&s.limits, s.t)
    }
}
