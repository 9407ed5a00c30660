//! Local bucket math for the fallback path, in integer micro-tokens.
//!
//! The same algorithms as the service (contract/README.md), scaled for one of `instances`
//! proxies: capacity is `floor(capacity / instances)` and the refill rate is exactly
//! `rate / instances` per period (the division is folded into the refill computation, so no rate
//! is rounded away). Intermediates are `u128`: `capacity × period × instances × 10⁶` does not fit
//! in 64 bits at the contract's upper bounds.

use crate::core::config::Algorithm;
use crate::core::wire::BucketResult;

/// Micro-tokens per token.
pub const MICRO: u64 = 1_000_000;

/// The limits of one local bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Local capacity in whole tokens (already divided by `instances`).
    pub capacity: u64,
    /// The global capacity the local one was divided from (part of the bucket's identity).
    pub global: u64,
    /// Global tokens per period (divided by `divisor` during refill).
    pub rate: u64,
    /// Period in ms.
    pub period_ms: u64,
    /// How many proxies share the limit.
    pub divisor: u64,
    /// Token bucket or fixed window.
    pub algorithm: Algorithm,
}

impl Limits {
    /// The local share of a global limit among `instances` proxies.
    pub fn local(
        capacity: u64,
        rate: u64,
        period_ms: u64,
        algorithm: Algorithm,
        instances: u64,
    ) -> Self {
        let divisor = instances.max(1);
        Limits {
            capacity: capacity / divisor,
            global: capacity,
            rate: rate.max(1),
            period_ms: period_ms.max(1),
            divisor,
            algorithm,
        }
    }
}

/// A bucket's state. Token bucket: `level` = micro-tokens, `stamp` = time of the last update (ms).
/// Fixed window: `level` = tokens used, `stamp` = the window index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct State {
    /// Micro-tokens held, or tokens used in the window.
    pub level: u64,
    /// Last update (ms), or window index.
    pub stamp: u64,
}

fn to_u64(v: u128) -> u64 {
    u64::try_from(v).unwrap_or(u64::MAX)
}

fn div_ceil(a: u128, b: u128) -> u128 {
    if b == 0 {
        return 0;
    }
    a.div_ceil(b)
}

/// ms for `micro` micro-tokens to refill.
fn refill_time(l: &Limits, micro: u128) -> u128 {
    div_ceil(
        micro * u128::from(l.period_ms) * u128::from(l.divisor),
        u128::from(l.rate) * u128::from(MICRO),
    )
}

/// Tries to take `cost` tokens at `now_ms`. `state` is `None` for a new bucket (it starts full).
/// Returns the new state (to store whether or not the take succeeded: a token bucket's refill
/// was applied) and the result in the contract's terms.
pub fn take(l: &Limits, state: Option<State>, now_ms: u64, cost: u64) -> (State, BucketResult) {
    match l.algorithm {
        Algorithm::TokenBucket => take_token_bucket(l, state, now_ms, cost),
        Algorithm::FixedWindow => take_fixed_window(l, state, now_ms, cost),
    }
}

fn take_token_bucket(
    l: &Limits,
    state: Option<State>,
    now_ms: u64,
    cost: u64,
) -> (State, BucketResult) {
    let cap = u128::from(l.capacity) * u128::from(MICRO);
    let (mut tokens, stamp) = match state {
        None => (cap, now_ms),
        Some(s) => {
            let s = project(l, s, now_ms);
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

fn take_fixed_window(
    l: &Limits,
    state: Option<State>,
    now_ms: u64,
    cost: u64,
) -> (State, BucketResult) {
    let period = l.period_ms.max(1);
    // A clock behind the newest window stored counts in that window (see `project`).
    let (mut used, window) = match state {
        Some(s) => {
            let p = project(l, s, now_ms);
            (p.level, p.stamp)
        }
        None => (0, now_ms / period),
    };
    let allowed = used.saturating_add(cost) <= l.capacity;
    if allowed {
        used += cost;
    }
    let reset_ms = window
        .saturating_add(1)
        .saturating_mul(period)
        .saturating_sub(now_ms)
        .max(1);
    let result = BucketResult {
        allowed,
        limit: l.capacity,
        remaining: l.capacity.saturating_sub(used),
        reset_ms,
        retry_after_ms: if allowed { 0 } else { reset_ms },
        granted: if allowed { cost } else { 0 },
    };
    (
        State {
            level: used,
            stamp: window,
        },
        result,
    )
}

/// The state at `now_ms` with nothing taken: a token bucket refilled (never above capacity), a
/// fixed window moved to the current window (its count reset when the window changed). A clock
/// that steps back refills nothing (and does not refill twice later).
pub fn project(l: &Limits, s: State, now_ms: u64) -> State {
    match l.algorithm {
        Algorithm::TokenBucket => {
            let cap = u128::from(l.capacity) * u128::from(MICRO);
            let elapsed = now_ms.saturating_sub(s.stamp);
            let refill = u128::from(elapsed) * u128::from(l.rate) * u128::from(MICRO)
                / (u128::from(l.period_ms) * u128::from(l.divisor)).max(1);
            State {
                level: to_u64((u128::from(s.level) + refill).min(cap)),
                stamp: s.stamp.max(now_ms),
            }
        }
        Algorithm::FixedWindow => {
            let window = now_ms / l.period_ms.max(1);
            // A clock behind the newest window counts in that window: going back never reopens
            // a window that was already spent.
            if window <= s.stamp {
                s
            } else {
                State {
                    level: 0,
                    stamp: window,
                }
            }
        }
    }
}

/// A bucket that holds nothing at `now_ms` (a token bucket refills from then on; a fixed window
/// is spent until the next window).
pub fn empty(l: &Limits, now_ms: u64) -> State {
    share(l, 0, 0, now_ms)
}

/// This proxy's share, at `now_ms`, of a global bucket that an answer reported holding
/// `remaining` whole tokens, less `debt` tokens this proxy admitted on its own and still owes:
/// `remaining / divisor − debt` tokens (token bucket), or the window's count that leaves that
/// many (fixed window). Never more than the local capacity.
pub fn share(l: &Limits, remaining: u64, debt: u64, now_ms: u64) -> State {
    let share = (remaining / l.divisor.max(1)).min(l.capacity);
    let left = share.saturating_sub(debt);
    match l.algorithm {
        Algorithm::TokenBucket => State {
            level: left.saturating_mul(MICRO),
            stamp: now_ms,
        },
        Algorithm::FixedWindow => State {
            level: l.capacity - left,
            stamp: now_ms / l.period_ms.max(1),
        },
    }
}

/// Whole tokens a state holds at `now_ms` (what a take of that many could pay).
pub fn available(l: &Limits, s: State, now_ms: u64) -> u64 {
    let p = project(l, s, now_ms);
    match l.algorithm {
        Algorithm::TokenBucket => p.level / MICRO,
        Algorithm::FixedWindow => l.capacity.saturating_sub(p.level),
    }
}

/// The stricter of two states of one bucket at `now_ms` (the one that holds fewer tokens).
pub fn stricter(l: &Limits, a: State, b: State, now_ms: u64) -> State {
    let (a, b) = (project(l, a, now_ms), project(l, b, now_ms));
    let a_holds = match l.algorithm {
        Algorithm::TokenBucket => a.level <= b.level,
        Algorithm::FixedWindow => a.level >= b.level,
    };
    if a_holds {
        a
    } else {
        b
    }
}

/// Gives back `cost` tokens taken earlier (all-or-nothing across several buckets).
pub fn refund(l: &Limits, s: State, cost: u64) -> State {
    match l.algorithm {
        Algorithm::TokenBucket => {
            let cap = u128::from(l.capacity) * u128::from(MICRO);
            let level = (u128::from(s.level) + u128::from(cost) * u128::from(MICRO)).min(cap);
            State {
                level: to_u64(level),
                stamp: s.stamp,
            }
        }
        Algorithm::FixedWindow => State {
            level: s.level.saturating_sub(cost),
            stamp: s.stamp,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tb(capacity: u64, rate: u64, period_ms: u64, instances: u64) -> Limits {
        Limits::local(capacity, rate, period_ms, Algorithm::TokenBucket, instances)
    }

    #[test]
    fn starts_full_and_drains() {
        let l = tb(3, 3, 1000, 1);
        let mut s = None;
        for expect in [2, 1, 0] {
            let (ns, r) = take(&l, s, 10_000, 1);
            assert!(r.allowed);
            assert_eq!(r.remaining, expect);
            s = Some(ns);
        }
        let (_, r) = take(&l, s, 10_000, 1);
        assert!(!r.allowed);
        assert_eq!(r.retry_after_ms, 334, "1/3 s for one token, rounded up");
        assert_eq!(r.reset_ms, 1000);
        assert_eq!(r.limit, 3);
    }

    #[test]
    fn refill_keeps_fractions() {
        // 1 token per 3 ms: after 1 ms a third of a token, after 3 ms one token.
        let l = tb(1, 1, 3, 1);
        let (s, _) = take(&l, None, 0, 1);
        assert_eq!(s.level, 0);
        let (s, r) = take(&l, Some(s), 1, 1);
        assert!(!r.allowed);
        assert_eq!(s.level, 333_333);
        let (s, r) = take(&l, Some(s), 2, 1);
        assert!(!r.allowed);
        assert_eq!(s.level, 666_666);
        // Each update rounds down by less than one micro-token: 999 999 after three updates.
        let (s, r) = take(&l, Some(s), 3, 1);
        assert!(!r.allowed);
        assert_eq!(s.level, 999_999);
        let (_, r) = take(&l, Some(s), 4, 1);
        assert!(r.allowed, "fractions accumulated across calls");
    }

    #[test]
    fn instances_split_capacity_and_rate() {
        // Global 10 per second over 3 proxies: local capacity 3, refill 10/3 per second exactly.
        let l = tb(10, 10, 1000, 3);
        assert_eq!(l.capacity, 3);
        let (s, _) = take(&l, None, 0, 3);
        assert_eq!(s.level, 0);
        let (s, _) = take(&l, Some(s), 300, 0);
        assert_eq!(s.level, 1_000_000, "300 ms × 10/3 per s = 1 token");
        let (s, _) = take(&l, Some(s), 900, 0);
        assert_eq!(s.level, 3_000_000);
        // Capacity smaller than instances: the local share rounds down to nothing.
        let l = tb(2, 2, 1000, 3);
        let (_, r) = take(&l, None, 0, 1);
        assert!(!r.allowed);
    }

    #[test]
    fn cost_above_capacity_is_denied_not_an_error() {
        let l = tb(5, 5, 1000, 1);
        let (s, r) = take(&l, None, 0, 6);
        assert!(!r.allowed);
        assert_eq!(r.retry_after_ms, 1000);
        assert_eq!(s.level, 5_000_000, "nothing taken");
    }

    #[test]
    fn clock_going_back_refills_nothing() {
        let l = tb(2, 2, 1000, 1);
        let (s, _) = take(&l, None, 5_000, 2);
        let (s2, r) = take(&l, Some(s), 4_000, 1);
        assert!(!r.allowed);
        assert_eq!(s2.stamp, 5_000);
    }

    #[test]
    fn extremes_do_not_overflow() {
        let l = tb(1_000_000_000, 1_000_000_000, 31_536_000_000, 10_000);
        let (s, r) = take(&l, None, u64::MAX / 2, 1_000_000_000);
        assert!(!r.allowed);
        let (_, r) = take(&l, Some(s), u64::MAX, 1);
        assert!(r.allowed);
        let l = tb(1, 1, 1, 1);
        let (_, r) = take(&l, Some(State { level: 0, stamp: 0 }), u64::MAX, 1);
        assert!(r.allowed);
    }

    #[test]
    fn hand_built_zero_limits_do_not_panic() {
        for algorithm in [Algorithm::TokenBucket, Algorithm::FixedWindow] {
            let l = Limits {
                capacity: 0,
                global: 0,
                rate: 0,
                period_ms: 0,
                divisor: 0,
                algorithm,
            };
            let (s, r) = take(&l, None, u64::MAX, 1);
            assert!(!r.allowed);
            take(&l, Some(s), u64::MAX, u64::MAX);
            refund(&l, s, u64::MAX);
        }
    }

    #[test]
    fn fixed_window_counts_per_window() {
        let l = Limits::local(2, 2, 1000, Algorithm::FixedWindow, 1);
        let (s, r) = take(&l, None, 5_100, 1);
        assert!(r.allowed && r.remaining == 1 && r.reset_ms == 900);
        let (s, r) = take(&l, Some(s), 5_200, 1);
        assert!(r.allowed && r.remaining == 0);
        let (s, r) = take(&l, Some(s), 5_999, 1);
        assert!(!r.allowed);
        assert_eq!(r.retry_after_ms, 1);
        let (_, r) = take(&l, Some(s), 6_000, 2);
        assert!(r.allowed, "new window");
    }

    #[test]
    fn refund_gives_back_up_to_capacity() {
        let l = tb(3, 3, 1000, 1);
        let (s, _) = take(&l, None, 0, 2);
        assert_eq!(refund(&l, s, 2).level, 3_000_000);
        assert_eq!(refund(&l, s, 10).level, 3_000_000);
        let f = Limits::local(3, 3, 1000, Algorithm::FixedWindow, 1);
        let (s, _) = take(&f, None, 0, 2);
        assert_eq!(refund(&f, s, 2).level, 0);
    }
}
