//! Sliding window counter: at most the local capacity within any window of `period_ms`, estimated
//! as the current fixed window's count plus the previous window's count weighted by the part of
//! it the sliding window still covers: the contract's arithmetic
//! ([`contract::arithmetic::sliding_window`]), on the local share. State: `stamp` the current
//! window index, `level` both counts (`prev << 32 | cur`; a local capacity is at most 10⁹ < 2³²).

use super::{counted, Limits, Local, State};
use contract::arithmetic::sliding_window::Counts;
use contract::take::BucketResult;

pub(super) struct SlidingWindow;

const LOW: u64 = 0xFFFF_FFFF;

fn counts(s: State) -> Counts {
    Counts {
        w: s.stamp,
        cur: s.level & LOW,
        prev: s.level >> 32,
    }
}

fn state(c: Counts) -> State {
    State {
        level: (c.prev.min(LOW) << 32) | c.cur.min(LOW),
        stamp: c.w,
    }
}

impl Local for SlidingWindow {
    const CODE: u8 = 2;
    const REFUNDABLE: bool = false;
    const WINDOWED: bool = true;

    fn take(l: &Limits, s: Option<State>, now_ms: u64, cost: u64) -> (State, BucketResult) {
        let l = counted(l);
        let mut c = match s {
            Some(s) => counts(s),
            None => Counts::new(&l, now_ms),
        };
        c.roll(&l, now_ms);
        let result = c.take(&l, now_ms, cost, cost);
        (state(c), result)
    }

    /// After a grant the answer's `reset_ms` is the end of the next window (the grant weighs
    /// until then); the window it was counted in ends a period sooner.
    fn spend_within_ms(reset_ms: u64, period_ms: u64) -> Option<u64> {
        Some(reset_ms.saturating_sub(period_ms))
    }

    /// Moved to the current window (a clock behind the newest window counts in that window).
    fn project(l: &Limits, s: State, now_ms: u64) -> State {
        let mut c = counts(s);
        c.roll(&counted(l), now_ms);
        state(c)
    }

    /// A window that counts what leaves `left`, nothing before it.
    fn holding(l: &Limits, left: u64, now_ms: u64) -> State {
        state(Counts {
            w: now_ms / l.period_ms.max(1),
            cur: l.capacity - left.min(l.capacity),
            prev: 0,
        })
    }

    fn available(l: &Limits, p: State, now_ms: u64) -> u64 {
        l.capacity
            .saturating_sub(counts(p).used(&counted(l), now_ms))
    }

    fn refund(_: &Limits, s: State, cost: u64) -> State {
        let mut c = counts(s);
        c.refund(cost, c.w);
        state(c)
    }

    /// Both counts, rounded up, with the same period; with another, the estimate under the old
    /// period becomes the count of the new current window (as the service does).
    fn carry(old: &Limits, s: State, new: &Limits, now_ms: u64) -> State {
        let mut c = counts(s).carry(&counted(old), &counted(new), now_ms);
        c.cur = c.cur.min(new.capacity);
        c.prev = c.prev.min(new.capacity);
        state(c)
    }
}

#[cfg(test)]
mod tests {
    use super::super::{available, carry, share, take, Limits};
    use contract::Algorithm;

    fn sw(capacity: u64, period_ms: u64, instances: u64) -> Limits {
        Limits::local(
            capacity,
            capacity,
            period_ms,
            Algorithm::SlidingWindow,
            instances,
        )
    }

    #[test]
    fn the_previous_window_weighs_by_what_is_still_covered() {
        let l = sw(10, 1000, 1);
        let mut s = None;
        for _ in 0..10 {
            let (n, r) = take(&l, s, 900, 1);
            assert!(r.allowed);
            s = Some(n);
        }
        let (n, r) = take(&l, s, 999, 1);
        assert!(!r.allowed);
        assert_eq!(r.retry_after_ms, 101, "at 1100 ms 10 × 0.9 = 9 weigh");
        let (n, r) = take(&l, Some(n), 1100, 1);
        assert!(r.allowed && r.remaining == 0, "{r:?}");
        let (n, r) = take(&l, Some(n), 1100, 1);
        assert!(!r.allowed);
        assert_eq!(r.retry_after_ms, 100);
        assert_eq!(r.reset_ms, 1900);
        let (n, r) = take(&l, Some(n), 1500, 1);
        assert!(r.allowed);
        assert_eq!(r.remaining, 3);
        assert_eq!(
            available(&l, n, 3000),
            10,
            "two windows later nothing weighs"
        );
    }

    #[test]
    fn a_share_and_a_changed_limit_keep_the_count() {
        // 4 proxies share 40: a share of 10; an answer said 20 left, so 5 here.
        let l = sw(40, 1000, 4);
        let s = share(&l, 20, 0, 100);
        assert_eq!(available(&l, s, 100), 5);
        // Still 5 used by the end of the window, 2.5 (rounded up: 3) used halfway into the next.
        assert_eq!(available(&l, s, 1500), 7);
        // 40 -> 20: 5 of 10 used is 3 of 5 (rounded up).
        let half = sw(20, 1000, 4);
        assert_eq!(available(&half, carry(&l, s, &half, 100), 100), 2);
        // Another period: the estimate carries into the new window.
        let hour = sw(40, 3_600_000, 4);
        assert_eq!(available(&hour, carry(&l, s, &hour, 1500), 1500), 7);
    }
}
