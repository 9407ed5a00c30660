//! Token bucket: holds up to `capacity` tokens, refills continuously at `rate / period_ms`, starts
//! full; a settle may leave it owing. The arithmetic is the contract's
//! ([`contract::arithmetic::token_bucket`]); `lua/token_bucket.lua` is the same on Redis (its
//! header documents the stored fields and the carry-over of a changed limit).

use super::{limits, Counter, Limits};
use crate::domain::{BucketSpec, SettleResult, SettleSpec};
use contract::arithmetic::token_bucket::{self as tb, Tokens, MICRO};
use contract::take::BucketResult;

/// The token bucket.
#[derive(Debug)]
pub struct TokenBucket;

/// A token bucket's state, with the limits it was last charged with.
#[derive(Debug, Clone, Copy)]
pub struct Held {
    tokens: Tokens,
    limits: Limits,
}

/// Milliseconds for an empty bucket of `b`'s limits to fill (tests wait for expiry with it).
pub fn fill_ms(b: &BucketSpec) -> u64 {
    tb::fill_ms(&limits(b), u128::from(b.capacity) * u128::from(MICRO))
}

impl Counter for TokenBucket {
    const CODE: u64 = 0;
    const LUA: &'static str = include_str!("../lua/token_bucket.lua");
    type State = Held;

    /// Refilled up to now; a bucket charged with other limits is first carried over to these.
    fn load(b: &BucketSpec, stored: Option<Held>, now: u64) -> Held {
        let new = limits(b);
        let mut s = match stored {
            Some(mut s) => {
                if s.limits != new {
                    s.tokens.carry(&s.limits, &new, now);
                    s.limits = new;
                }
                s
            }
            None => Held {
                tokens: Tokens::full(&new, now),
                limits: new,
            },
        };
        s.tokens.refill(&new, now);
        s
    }

    fn take(b: &BucketSpec, s: &mut Held, _now: u64) -> (BucketResult, bool) {
        let d = s
            .tokens
            .take_shaped(&limits(b), b.cost, b.lease, b.max_delay_ms);
        (d, d.allowed)
    }

    fn mark(_: &Held) -> u64 {
        0
    }

    /// Added back, capped at the capacity (the state was refilled up to now by `load`); below zero
    /// (a shaped grant whose caller left while held) it lowers what is owed.
    fn refund(b: &BucketSpec, s: &mut Held, amount: u64, _mark: u64) -> bool {
        s.tokens.refund(&limits(b), amount);
        true
    }

    fn settle(spec: &SettleSpec, s: &mut Held, existed: bool) -> bool {
        let l = limits(&spec.bucket);
        s.tokens.settle(&l, spec.estimate, spec.used, existed)
    }

    fn settle_result(_: &BucketSpec, s: &Held, _now: u64) -> SettleResult {
        SettleResult {
            remaining: s.tokens.whole(),
            debt: s.tokens.debt(),
        }
    }

    fn until_idle_ms(s: &Held, _now: u64) -> u64 {
        s.tokens.reset_ms(&s.limits)
    }
}
