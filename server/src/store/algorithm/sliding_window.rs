//! Sliding window counter: a window of `period_ms` that slides with the clock, estimated from the
//! current fixed window's count and the previous one's, weighted by what the sliding window still
//! covers of it; `rate` is ignored. The arithmetic is the contract's
//! ([`contract::arithmetic::sliding_window`]); `lua/sliding_window.lua` is the same on Redis (its
//! header documents the stored fields).

use super::{limits, Counter, Limits};
use crate::domain::{BucketSpec, SettleResult, SettleSpec};
use contract::take::BucketResult;

/// The sliding window counter.
#[derive(Debug)]
pub struct SlidingWindow;

/// A sliding window's state, with the limits it was last charged with.
#[derive(Debug, Clone, Copy)]
pub struct Counts {
    counts: contract::arithmetic::sliding_window::Counts,
    limits: Limits,
}

impl Counter for SlidingWindow {
    const CODE: u64 = 2;
    const LUA: &'static str = include_str!("../lua/sliding_window.lua");
    type State = Counts;

    fn load(b: &BucketSpec, stored: Option<Counts>, now: u64) -> Counts {
        let (new, now_ms) = (limits(b), now / 1000);
        let counts = match stored {
            Some(s) => s.counts.carry(&s.limits, &new, now_ms),
            None => contract::arithmetic::sliding_window::Counts::new(&new, now_ms),
        };
        Counts {
            counts,
            limits: new,
        }
    }

    fn take(b: &BucketSpec, s: &mut Counts, now: u64) -> (BucketResult, bool) {
        let d = s.counts.take(&limits(b), now / 1000, b.cost, b.lease);
        (d, d.allowed)
    }

    fn mark(s: &Counts) -> u64 {
        s.counts.w
    }

    /// To the window that was charged while it still weighs: the current or the previous one.
    fn refund(_: &BucketSpec, s: &mut Counts, amount: u64, mark: u64) -> bool {
        s.counts.refund(amount, mark)
    }

    fn settle(spec: &SettleSpec, s: &mut Counts, _existed: bool) -> bool {
        let l = limits(&spec.bucket);
        s.counts.settle(&l, spec.estimate, spec.used, spec.window)
    }

    fn settle_result(b: &BucketSpec, s: &Counts, now: u64) -> SettleResult {
        let (remaining, debt) = s.counts.standing(&limits(b), now / 1000);
        SettleResult { remaining, debt }
    }

    /// The end of the next window: this window's count weighs until then.
    fn until_idle_ms(s: &Counts, now: u64) -> u64 {
        s.counts.until_idle_ms(&s.limits, now / 1000)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::Algorithm;

    fn sw(cap: u64, period: u64, cost: u64) -> BucketSpec {
        BucketSpec {
            key: "k".into(),
            capacity: cap,
            rate: cap,
            period_ms: period,
            cost,
            algorithm: Algorithm::TokenBucket,
            lease: cost,
            max_delay_ms: 0,
        }
    }

    fn take_at(b: &BucketSpec, s: Option<Counts>, ms: u64) -> (Counts, BucketResult) {
        let mut st = SlidingWindow::load(b, s, ms * 1000);
        let (d, _) = SlidingWindow::take(b, &mut st, ms * 1000);
        (st, d)
    }

    #[test]
    fn the_previous_window_weighs_by_what_is_still_covered() {
        let b = sw(10, 1000, 1);
        let mut s = None;
        // 10 at the end of window 0.
        for _ in 0..10 {
            let (n, d) = take_at(&b, s, 900);
            assert!(d.allowed);
            s = Some(n);
        }
        let (n, d) = take_at(&b, s, 999);
        assert!(!d.allowed);
        assert_eq!(d.retry_after_ms, 101, "at 1100 ms 10 × 0.9 = 9 weigh");
        s = Some(n);
        // At 1100 ms, 90 % of window 0 is still covered: 9 weigh, 1 left.
        let (n, d) = take_at(&b, s, 1100);
        assert!(d.allowed && d.remaining == 0, "{d:?}");
        let (n, d) = take_at(&b, Some(n), 1100);
        assert!(!d.allowed);
        // 1 + ceil(10 × (1000 − e) / 1000) <= 9 from e = 200.
        assert_eq!(d.retry_after_ms, 100);
        assert_eq!(d.reset_ms, 1900, "the take at 1100 ms weighs until 3000 ms");
        // At 1500 ms: 1 + ceil(5) = 6 used, 4 left.
        let (_, d) = take_at(&b, Some(n), 1500);
        assert!(d.allowed);
        assert_eq!(d.remaining, 3);
    }

    #[test]
    fn a_full_current_window_waits_for_the_next() {
        let b = sw(4, 1000, 1);
        let mut s = None;
        for _ in 0..4 {
            let (n, d) = take_at(&b, s, 100);
            assert!(d.allowed);
            s = Some(n);
        }
        let (_, d) = take_at(&b, s, 100);
        // Next window from 1000 ms; 4 × (1000 − e) / 1000 <= 3 at e = 250: 1150 ms from now.
        assert_eq!(d.retry_after_ms, 1150);
        let (_, d) = take_at(&b, s, 1249);
        assert!(!d.allowed);
        let (_, d) = take_at(&b, s, 1250);
        assert!(d.allowed);
        // Two windows later nothing weighs.
        let (_, d) = take_at(&b, s, 2000);
        assert_eq!(d.remaining, 3);
    }

    #[test]
    fn a_changed_limit_keeps_the_count() {
        let (s, _) = take_at(&sw(10, 1000, 6), None, 100);
        // 10 -> 5: 6 of 10 is 3 of 5.
        let (_, d) = take_at(&sw(5, 1000, 1), Some(s), 200);
        assert_eq!((d.allowed, d.remaining), (true, 1));
        // Another period: the old estimate (6) is the new window's count.
        let (_, d) = take_at(&sw(10, 60_000, 1), Some(s), 200);
        assert_eq!((d.allowed, d.remaining), (true, 3));
    }
}
