//! Sliding window counter: a window of `period_ms` that slides with the clock, estimated from two
//! fixed windows (`floor(now_ms / period_ms)` and the one before it) as the current window's count
//! plus the previous window's count weighted by the part of the previous window the sliding window
//! still covers: `used = cur + ceil(prev × (period − elapsed) / period)`, where `elapsed` is how
//! far `now` is into the current window (the weighted count is rounded up, against the caller). A
//! take of `cost` is admitted when `used + cost <= capacity`; `rate` is ignored. Unlike a fixed
//! window, a burst at the end of one window is still counted at the start of the next.
//!
//! The same arithmetic as `lua/sliding_window.lua` (its header documents the stored fields).
//!
//! A changed limit keeps the count, as a fixed window's does: with the same period both counts
//! are scaled to the new capacity keeping the fraction used (rounded up); with another period, the
//! estimate under the old limits becomes the new current window's count (scaled likewise), so
//! nothing counted is handed out again.

use super::fixed_window::scale_used;
use super::{cap_ms, Counter, Limits};
use crate::domain::{BucketSpec, SettleResult, SettleSpec};
use contract::take::BucketResult as BucketDecision;

/// The sliding window counter.
#[derive(Debug)]
pub struct SlidingWindow;

/// A sliding window's state: the current window index, its count and the previous window's.
#[derive(Debug, Clone, Copy)]
pub struct Counts {
    w: u64,
    cur: u64,
    prev: u64,
    limits: Limits,
}

/// Moves `s` to window `w` (a clock behind the stored window keeps counting in that one).
fn roll(s: &mut Counts, w: u64) {
    if w == s.w.saturating_add(1) {
        (s.prev, s.cur) = (s.cur, 0);
    } else if w > s.w {
        (s.prev, s.cur) = (0, 0);
    } else {
        return;
    }
    s.w = w;
}

/// How far `now_ms` is into window `w` (0 when the clock is behind it), at most a period.
fn elapsed(w: u64, period: u64, now_ms: u64) -> u64 {
    now_ms.saturating_sub(w.saturating_mul(period)).min(period)
}

/// The estimate: the current count plus the previous one weighted by what the sliding window
/// still covers of it, rounded up.
fn used(s: &Counts, period: u64, now_ms: u64) -> u64 {
    let left = u128::from(period - elapsed(s.w, period, now_ms));
    let weighted = (u128::from(s.prev) * left).div_ceil(u128::from(period.max(1)));
    s.cur
        .saturating_add(u64::try_from(weighted).unwrap_or(u64::MAX))
}

/// Milliseconds from `now_ms` until `elapsed` is `e` into window `w`.
fn until(w: u64, period: u64, e: u64, now_ms: u64) -> u128 {
    (u128::from(w) * u128::from(period) + u128::from(e)).saturating_sub(u128::from(now_ms))
}

/// The first `elapsed` into a window at which `weight` counted in the window before it has slid
/// out far enough to leave `room` (`ceil(weight × (period − e) / period) <= room`).
fn room_at(weight: u64, room: u64, period: u64) -> u64 {
    if weight == 0 {
        return 0;
    }
    let keep = u128::from(room) * u128::from(period) / u128::from(weight);
    period.saturating_sub(u64::try_from(keep).unwrap_or(u64::MAX))
}

/// Milliseconds until a denied take of `cost` could pay.
fn retry_ms(b: &BucketSpec, s: &Counts, now_ms: u64) -> u64 {
    let p = b.period_ms.max(1);
    match (b.capacity - b.cost).checked_sub(s.cur) {
        // The current count leaves room: wait for the previous window to slide out enough.
        Some(room) => cap_ms(until(s.w, p, room_at(s.prev, room, p), now_ms).max(1)),
        // Not in this window: in the next one, this window's count slides out.
        None => cap_ms(until(
            s.w + 1,
            p,
            room_at(s.cur, b.capacity - b.cost, p),
            now_ms,
        )),
    }
}

/// Milliseconds until nothing counted weighs any more (full again).
fn reset_ms(s: &Counts, now_ms: u64) -> u64 {
    let p = s.limits.period_ms;
    if s.cur > 0 {
        cap_ms(until(s.w + 2, p, 0, now_ms))
    } else if s.prev > 0 {
        cap_ms(until(s.w + 1, p, 0, now_ms))
    } else {
        0
    }
}

impl Counter for SlidingWindow {
    const CODE: u64 = 2;
    const LUA: &'static str = include_str!("../lua/sliding_window.lua");
    type State = Counts;

    fn load(b: &BucketSpec, stored: Option<Counts>, now: u64) -> Counts {
        let now_ms = now / 1000;
        let period = b.period_ms.max(1);
        let mut s = Counts {
            w: now_ms / period,
            cur: 0,
            prev: 0,
            limits: Limits::of(b),
        };
        if let Some(mut old) = stored {
            let (c, p) = (old.limits.capacity, old.limits.period_ms.max(1));
            roll(&mut old, now_ms / p);
            if p == period {
                s.w = old.w;
                s.cur = scale_used(old.cur, c, b.capacity);
                s.prev = scale_used(old.prev, c, b.capacity);
            } else {
                s.cur = scale_used(used(&old, p, now_ms), c, b.capacity);
            }
        }
        s
    }

    fn take(b: &BucketSpec, s: &mut Counts, now: u64) -> (BucketDecision, bool) {
        let now_ms = now / 1000;
        let u = used(s, b.period_ms, now_ms);
        let allowed = u.saturating_add(b.cost) <= b.capacity;
        let mut granted = 0;
        let retry = if allowed {
            granted = b.lease.min(b.capacity - u).max(b.cost);
            s.cur += granted;
            0
        } else if b.cost > b.capacity {
            b.period_ms
        } else {
            retry_ms(b, s, now_ms)
        };
        let d = BucketDecision {
            allowed,
            limit: b.capacity,
            remaining: b.capacity.saturating_sub(used(s, b.period_ms, now_ms)),
            reset_ms: reset_ms(s, now_ms),
            retry_after_ms: retry,
            granted,
        };
        (d, allowed)
    }

    fn mark(s: &Counts) -> u64 {
        s.w
    }

    /// To the window that was charged while it still weighs: the current or the previous one.
    fn refund(_: &BucketSpec, s: &mut Counts, amount: u64, mark: u64) -> bool {
        match count_of(s, Some(mark)) {
            Some(n) => {
                *n -= amount.min(*n);
                true
            }
            None => false,
        }
    }

    /// In the window the estimate was charged in while it still weighs (the current or the
    /// previous one): a refund lowers its count (not below 0), an extra charge raises it in full
    /// (to the capacity plus [`contract::bounds::MAX_DEBT`] at most). Without `window`, an extra charge counts in the current window and a
    /// refund is dropped (it might give back another window's tokens).
    fn settle(spec: &SettleSpec, s: &mut Counts, _existed: bool) -> bool {
        let window = match spec.window {
            Some(m) => Some(m),
            None if spec.used > spec.estimate => Some(s.w),
            None => None,
        };
        let most = spec.bucket.capacity + contract::bounds::MAX_DEBT;
        match count_of(s, window) {
            Some(n) if spec.used < spec.estimate => {
                let back = (spec.estimate - spec.used).min(*n);
                *n -= back;
                back > 0
            }
            Some(n) if spec.used > spec.estimate => {
                *n = n.saturating_add(spec.used - spec.estimate).min(most);
                true
            }
            _ => false,
        }
    }

    fn settle_result(b: &BucketSpec, s: &Counts, now: u64) -> SettleResult {
        let u = used(s, b.period_ms, now / 1000);
        SettleResult {
            remaining: b.capacity.saturating_sub(u),
            debt: u.saturating_sub(b.capacity),
        }
    }

    /// The end of the next window: this window's count weighs until then.
    fn until_idle_ms(s: &Counts, now: u64) -> u64 {
        cap_ms(until(s.w + 2, s.limits.period_ms, 0, now / 1000))
    }
}

/// The count of window `w` when it still weighs: the current or the previous one.
fn count_of(s: &mut Counts, w: Option<u64>) -> Option<&mut u64> {
    match w {
        Some(m) if m == s.w => Some(&mut s.cur),
        Some(m) if m.checked_add(1) == Some(s.w) => Some(&mut s.prev),
        _ => None,
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
        }
    }

    fn take_at(b: &BucketSpec, s: Option<Counts>, ms: u64) -> (Counts, BucketDecision) {
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
