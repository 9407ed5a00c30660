//! Token bucket: holds up to the local capacity in micro-tokens, refills continuously at
//! `rate / divisor` per period. State: `level` micro-tokens held, `stamp` the last update (ms).

use super::{div_ceil, to_u64, Limits, Local, State, MICRO};
use contract::take::BucketResult;

pub(super) struct TokenBucket;

/// ms for `micro` micro-tokens to refill.
fn refill_time(l: &Limits, micro: u128) -> u128 {
    div_ceil(
        micro * u128::from(l.period_ms) * u128::from(l.divisor),
        u128::from(l.rate) * u128::from(MICRO),
    )
}

impl Local for TokenBucket {
    const CODE: u8 = 0;
    const REFUNDABLE: bool = true;
    const WINDOWED: bool = false;

    fn take(l: &Limits, state: Option<State>, now_ms: u64, cost: u64) -> (State, BucketResult) {
        let cap = u128::from(l.capacity) * u128::from(MICRO);
        let (mut tokens, stamp) = match state {
            None => (cap, now_ms),
            Some(s) => {
                let s = Self::project(l, s, now_ms);
                (u128::from(s.level), s.stamp)
            }
        };
        let need = u128::from(cost) * u128::from(MICRO);
        let allowed = tokens >= need;
        if allowed {
            tokens -= need;
        }
        let retry_after_ms = if allowed {
            0
        } else if need > cap {
            // Can never be paid: tell the client to come back after a period.
            l.period_ms
        } else {
            to_u64(refill_time(l, need - tokens).max(1))
        };
        let result = BucketResult {
            allowed,
            limit: l.capacity,
            remaining: to_u64(tokens / u128::from(MICRO)),
            reset_ms: to_u64(refill_time(l, cap - tokens)),
            retry_after_ms,
            granted: if allowed { cost } else { 0 },
        };
        (
            State {
                level: to_u64(tokens),
                stamp,
            },
            result,
        )
    }

    fn project(l: &Limits, s: State, now_ms: u64) -> State {
        let cap = u128::from(l.capacity) * u128::from(MICRO);
        let elapsed = now_ms.saturating_sub(s.stamp);
        let refill = u128::from(elapsed) * u128::from(l.rate) * u128::from(MICRO)
            / (u128::from(l.period_ms) * u128::from(l.divisor)).max(1);
        State {
            level: to_u64((u128::from(s.level) + refill).min(cap)),
            stamp: s.stamp.max(now_ms),
        }
    }

    fn holding(_: &Limits, left: u64, now_ms: u64) -> State {
        State {
            level: left.saturating_mul(MICRO),
            stamp: now_ms,
        }
    }

    fn available(_: &Limits, p: State, _now_ms: u64) -> u64 {
        p.level / MICRO
    }

    /// Compared in micro-tokens, not whole tokens.
    fn holds_no_more(_: &Limits, a: State, b: State, _now_ms: u64) -> bool {
        a.level <= b.level
    }

    fn refund(l: &Limits, s: State, cost: u64) -> State {
        let cap = u128::from(l.capacity) * u128::from(MICRO);
        let level = (u128::from(s.level) + u128::from(cost) * u128::from(MICRO)).min(cap);
        State {
            level: to_u64(level),
            stamp: s.stamp,
        }
    }

    /// The tokens held, rounded down.
    fn carry(
        _old: &Limits,
        p: State,
        new: &Limits,
        _now_ms: u64,
        scale: &dyn Fn(u64, bool) -> u64,
    ) -> State {
        State {
            level: scale(p.level, false).min(new.capacity.saturating_mul(MICRO)),
            stamp: p.stamp,
        }
    }
}
