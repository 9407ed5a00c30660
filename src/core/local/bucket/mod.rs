//! Local buckets: one module per algorithm behind one trait (`Local`), shared by the fallback
//! shares ([`crate::core::local::fallback`]) and the lease pools ([`crate::core::local::lease`]), which call the
//! functions below and know no algorithm's internals.
//!
//! The arithmetic is the service's own, the contract's ([`contract::arithmetic`]), scaled for one
//! of `instances` proxies: capacity is `floor(capacity / instances)` and the refill rate is
//! exactly `rate / instances` per period (the contract's `divisor`). Each module maps its two
//! words of [`State`] onto the contract's state of its algorithm.
//!
//! | module | algorithm | [`State`] |
//! |---|---|---|
//! | `token_bucket` | refills continuously | `level` micro-tokens held, `stamp` last update (ms) |
//! | `fixed_window` | at most capacity per window | `level` tokens used, `stamp` the window index |
//! | `sliding_window` | the current window's count plus the previous one's, weighted | `level` both counts, `stamp` the window index |
//! | `calendar_window` | at most capacity per calendar period | `level` tokens used, `stamp` the window's first ms |
//!
//! Adding an algorithm: a module with a `Local` and one line in `dispatch!` below.

mod calendar_window;
mod fixed_window;
mod sliding_window;
mod token_bucket;

use contract::take::BucketResult;
use contract::Algorithm;

pub use calendar_window::rate_word as calendar_rate;
pub use contract::arithmetic::token_bucket::MICRO;

/// The limits of one local bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Local capacity in whole tokens (already divided by `instances`).
    pub capacity: u64,
    /// The global capacity the local one was divided from (part of the bucket's identity).
    pub global: u64,
    /// Global tokens per period (divided by `divisor` during refill); a calendar window's
    /// calendar instead ([`calendar_rate`]).
    pub rate: u64,
    /// Period in ms.
    pub period_ms: u64,
    /// How many proxies share the limit.
    pub divisor: u64,
    /// How the bucket counts.
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

/// The contract's limits of `l`.
fn counted(l: &Limits) -> contract::arithmetic::Limits {
    contract::arithmetic::Limits {
        capacity: l.capacity,
        rate: l.rate,
        period_ms: l.period_ms,
        divisor: l.divisor,
    }
}

/// A bucket's state: two words each algorithm reads its own way (table above), so a record
/// stores any algorithm's state in the same bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct State {
    /// Micro-tokens held, or tokens used (per algorithm).
    pub level: u64,
    /// Last update (ms), or window index.
    pub stamp: u64,
}

/// One algorithm's local arithmetic.
trait Local {
    /// Its byte in a bucket's identity (the fallback and lease slots).
    const CODE: u8;
    /// Whether tokens charged and not spent can be given back to the service (a refund): not
    /// when they end with their window.
    const REFUNDABLE: bool;
    /// Whether a token granted in a window must be spent within it (lease pools).
    const WINDOWED: bool;

    /// Within how many ms tokens just granted must be spent, from an answer's `reset_ms`: `None`
    /// when they keep (a token bucket's); a window's end otherwise.
    fn spend_within_ms(_reset_ms: u64, _period_ms: u64) -> Option<u64> {
        None
    }
    /// Tries to take `cost` at `now_ms` (`None`: a new bucket); see [`take`].
    fn take(l: &Limits, state: Option<State>, now_ms: u64, cost: u64) -> (State, BucketResult);
    /// See [`project`].
    fn project(l: &Limits, s: State, now_ms: u64) -> State;
    /// A state that holds `left` tokens at `now_ms` (at most the capacity).
    fn holding(l: &Limits, left: u64, now_ms: u64) -> State;
    /// Whole tokens a state brought up to `now_ms` ([`project`]) holds.
    fn available(l: &Limits, p: State, now_ms: u64) -> u64;
    /// Whether `a` holds no more than `b` (both brought up to `now_ms`).
    fn holds_no_more(l: &Limits, a: State, b: State, now_ms: u64) -> bool {
        Self::available(l, a, now_ms) <= Self::available(l, b, now_ms)
    }
    /// See [`refund`].
    fn refund(l: &Limits, s: State, cost: u64) -> State;
    /// See [`carry`].
    fn carry(old: &Limits, s: State, new: &Limits, now_ms: u64) -> State;
}

/// Calls `$f` of the [`Local`] of algorithm `$alg`.
macro_rules! dispatch {
    ($alg:expr, $f:ident ( $($arg:expr),* )) => {
        match $alg {
            Algorithm::TokenBucket => <token_bucket::TokenBucket as Local>::$f($($arg),*),
            Algorithm::FixedWindow => <fixed_window::FixedWindow as Local>::$f($($arg),*),
            Algorithm::SlidingWindow => <sliding_window::SlidingWindow as Local>::$f($($arg),*),
            Algorithm::CalendarWindow => <calendar_window::CalendarWindow as Local>::$f($($arg),*),
        }
    };
    ($alg:expr, $c:ident) => {
        match $alg {
            Algorithm::TokenBucket => <token_bucket::TokenBucket as Local>::$c,
            Algorithm::FixedWindow => <fixed_window::FixedWindow as Local>::$c,
            Algorithm::SlidingWindow => <sliding_window::SlidingWindow as Local>::$c,
            Algorithm::CalendarWindow => <calendar_window::CalendarWindow as Local>::$c,
        }
    };
}

/// The byte of `a` in a bucket's identity.
pub fn code(a: Algorithm) -> u8 {
    dispatch!(a, CODE)
}

/// Whether unspent tokens of `a` can be given back to the service (a token bucket's; a window's
/// end with their window).
pub fn refundable(a: Algorithm) -> bool {
    dispatch!(a, REFUNDABLE)
}

/// Whether tokens of `a` granted in a window must be spent within it.
pub fn windowed(a: Algorithm) -> bool {
    dispatch!(a, WINDOWED)
}

/// Within how many ms tokens of `a` granted by an answer (its `reset_ms`, for a rule of
/// `period_ms`) must be spent: `None` when they keep; the end of the window they were counted in
/// otherwise (a token of one window must not be spent in the next).
pub fn spend_within_ms(a: Algorithm, reset_ms: u64, period_ms: u64) -> Option<u64> {
    dispatch!(a, spend_within_ms(reset_ms, period_ms))
}

/// Tries to take `cost` tokens at `now_ms`. `state` is `None` for a new bucket (it starts full).
/// Returns the new state (to store whether or not the take succeeded: a token bucket's refill
/// was applied) and the result in the contract's terms.
pub fn take(l: &Limits, state: Option<State>, now_ms: u64, cost: u64) -> (State, BucketResult) {
    dispatch!(l.algorithm, take(l, state, now_ms, cost))
}

/// The state at `now_ms` with nothing taken: a token bucket refilled (never above capacity), a
/// window moved to the current window (its count reset, or moved to the previous window's, when
/// the window changed). A clock that steps back refills nothing (and does not refill twice later).
pub fn project(l: &Limits, s: State, now_ms: u64) -> State {
    dispatch!(l.algorithm, project(l, s, now_ms))
}

/// A bucket that holds nothing at `now_ms` (a token bucket refills from then on; a window is
/// spent until it has passed).
pub fn empty(l: &Limits, now_ms: u64) -> State {
    share(l, 0, 0, now_ms)
}

/// A token bucket the service granted ahead of its refill (shaping): nothing held until
/// `zero_at_ms`, when the global balance is back at zero, and refilling from then on. No other
/// algorithm is granted ahead: theirs is [`empty`] at `now_ms`.
pub fn empty_until(l: &Limits, now_ms: u64, zero_at_ms: u64) -> State {
    match l.algorithm {
        Algorithm::TokenBucket => {
            <token_bucket::TokenBucket as Local>::holding(l, 0, zero_at_ms.max(now_ms))
        }
        _ => empty(l, now_ms),
    }
}

/// This proxy's share, at `now_ms`, of a global bucket that an answer reported holding
/// `remaining` whole tokens, less `debt` tokens this proxy admitted on its own and still owes:
/// `remaining / divisor − debt` tokens (a window: the count that leaves that many). Never more
/// than the local capacity.
pub fn share(l: &Limits, remaining: u64, debt: u64, now_ms: u64) -> State {
    let share = (remaining / l.divisor.max(1)).min(l.capacity);
    let left = share.saturating_sub(debt);
    dispatch!(l.algorithm, holding(l, left, now_ms))
}

/// Whole tokens a state holds at `now_ms` (what a take of that many could pay).
pub fn available(l: &Limits, s: State, now_ms: u64) -> u64 {
    let p = project(l, s, now_ms);
    dispatch!(l.algorithm, available(l, p, now_ms))
}

/// The stricter of two states of one bucket at `now_ms` (the one that holds fewer tokens).
pub fn stricter(l: &Limits, a: State, b: State, now_ms: u64) -> State {
    let (a, b) = (project(l, a, now_ms), project(l, b, now_ms));
    if dispatch!(l.algorithm, holds_no_more(l, a, b, now_ms)) {
        a
    } else {
        b
    }
}

/// Gives back `cost` tokens taken earlier (all-or-nothing across several buckets).
pub fn refund(l: &Limits, s: State, cost: u64) -> State {
    dispatch!(l.algorithm, refund(l, s, cost))
}

/// A state kept under limits `old`, as it stands at `now_ms` under limits `new`: brought up to now
/// under `old`, then scaled to `new`'s local capacity keeping the fraction held (token bucket,
/// rounded down) or used (the windows, rounded up; see each algorithm for what carries). Never
/// above the new capacity.
pub fn carry(old: &Limits, s: State, new: &Limits, now_ms: u64) -> State {
    if old == new {
        return s;
    }
    dispatch!(new.algorithm, carry(old, s, new, now_ms))
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
        for &algorithm in Algorithm::ALL {
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
