//! Sliding window counter: a window of `period_ms` that slides with the clock, estimated from two
//! fixed windows (`floor(now_ms / period_ms)` and the one before it) as the current window's count
//! plus the previous window's count weighted by the part of it the sliding window still covers:
//! `used = cur + ceil(prev × (period − elapsed) / period)`, where `elapsed` is how far `now` is
//! into the current window (rounded up, against the caller). A take of `cost` is admitted when
//! `used + cost <= capacity`; `rate` is ignored. The Lua is `server/src/store/lua/sliding_window.lua`.
//!
//! A changed limit keeps the count: with the same period both counts are scaled to the new
//! capacity keeping the fraction used (rounded up); with another period, the estimate under the
//! old limits becomes the new current window's count (scaled likewise).

use super::{scale_used, to_u64, Limits, MAX_MS};
use crate::bounds::MAX_DEBT;
use crate::take::BucketResult;

/// A sliding window's state: the current window index, its count and the previous window's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Counts {
    /// The current window index.
    pub w: u64,
    /// Tokens counted in it.
    pub cur: u64,
    /// Tokens counted in the window before it.
    pub prev: u64,
}

/// Milliseconds from `now_ms` until `e` ms into window `w`.
#[inline(never)]
fn until(w: u64, period: u64, e: u64, now_ms: u64) -> u64 {
    // Saturated only past 2^64 ms of clock, where any answer is MAX_MS anyway.
    w.saturating_mul(period)
        .saturating_add(e)
        .saturating_sub(now_ms)
        .min(MAX_MS)
}

/// The first `elapsed` into a window at which `weight` counted in the window before it has slid
/// out far enough to leave `room` (`ceil(weight × (period − e) / period) <= room`).
#[inline(never)]
fn room_at(weight: u64, room: u64, period: u64) -> u64 {
    if weight == 0 {
        return 0;
    }
    period.saturating_sub(to_u64(
        u128::from(room) * u128::from(period) / u128::from(weight),
    ))
}

impl Counts {
    /// Nothing counted, at `now_ms`.
    pub fn new(l: &Limits, now_ms: u64) -> Counts {
        Counts {
            w: now_ms / l.period(),
            cur: 0,
            prev: 0,
        }
    }

    /// Moved to the window of `now_ms` when that is a later one: the count becomes the previous
    /// window's (or nothing, after a window without takes). A clock behind the current window
    /// keeps counting in it.
    pub fn roll(&mut self, l: &Limits, now_ms: u64) {
        let w = now_ms / l.period();
        if w == self.w.saturating_add(1) {
            (self.prev, self.cur) = (self.cur, 0);
        } else if w > self.w {
            (self.prev, self.cur) = (0, 0);
        } else {
            return;
        }
        self.w = w;
    }

    /// The estimate at `now_ms`: the current count plus the previous one weighted by what the
    /// sliding window still covers of it, rounded up.
    pub fn used(&self, l: &Limits, now_ms: u64) -> u64 {
        let period = l.period();
        let into = now_ms
            .saturating_sub(self.w.saturating_mul(period))
            .min(period);
        let weighted =
            (u128::from(self.prev) * u128::from(period - into)).div_ceil(u128::from(period));
        self.cur.saturating_add(to_u64(weighted))
    }

    /// Counts kept under `old` (rolled up to `now_ms` under `old`), counted under `new`.
    pub fn carry(self, old: &Limits, new: &Limits, now_ms: u64) -> Counts {
        let mut s = self;
        s.roll(old, now_ms);
        let (c, cap) = (old.capacity, new.capacity);
        if old.period() == new.period() {
            Counts {
                w: s.w,
                cur: scale_used(s.cur, c, cap),
                prev: scale_used(s.prev, c, cap),
            }
        } else {
            Counts {
                w: now_ms / new.period(),
                cur: scale_used(s.used(old, now_ms), c, cap),
                prev: 0,
            }
        }
    }

    /// Milliseconds until a denied take of `cost` could pay.
    fn retry_ms(&self, l: &Limits, cost: u64, now_ms: u64) -> u64 {
        let p = l.period();
        let room = l.capacity - cost;
        match room.checked_sub(self.cur) {
            // The current count leaves room: wait for the previous window to slide out enough.
            Some(r) => until(self.w, p, room_at(self.prev, r, p), now_ms).max(1),
            // Not in this window: in the next one, this window's count slides out.
            None => until(self.w + 1, p, room_at(self.cur, room, p), now_ms),
        }
    }

    /// Milliseconds until nothing counted weighs any more (full again).
    pub fn reset_ms(&self, l: &Limits, now_ms: u64) -> u64 {
        if self.cur > 0 {
            until(self.w + 2, l.period(), 0, now_ms)
        } else if self.prev > 0 {
            until(self.w + 1, l.period(), 0, now_ms)
        } else {
            0
        }
    }

    /// Milliseconds until the current window's count no longer weighs (the next window's end).
    pub fn until_idle_ms(&self, l: &Limits, now_ms: u64) -> u64 {
        until(self.w + 2, l.period(), 0, now_ms)
    }

    /// Takes `cost` (the counts rolled up to now) when the estimate leaves room: what it leaves
    /// up to `lease`, at least `cost`.
    pub fn take(&mut self, l: &Limits, now_ms: u64, cost: u64, lease: u64) -> BucketResult {
        let u = self.used(l, now_ms);
        let allowed = u.saturating_add(cost) <= l.capacity;
        let mut granted = 0;
        let retry_after_ms = if allowed {
            granted = lease.min(l.capacity - u).max(cost);
            self.cur += granted;
            0
        } else if cost > l.capacity {
            l.period_ms
        } else {
            self.retry_ms(l, cost, now_ms)
        };
        BucketResult {
            allowed,
            limit: l.capacity,
            remaining: l.capacity.saturating_sub(self.used(l, now_ms)),
            reset_ms: self.reset_ms(l, now_ms),
            retry_after_ms,
            granted,
            delay_ms: 0,
            window: if allowed { self.w } else { 0 },
        }
    }

    /// The count of window `w` while it still weighs: the current or the previous one.
    fn count_of(&mut self, w: Option<u64>) -> Option<&mut u64> {
        match w {
            Some(m) if m == self.w => Some(&mut self.cur),
            Some(m) if m.checked_add(1) == Some(self.w) => Some(&mut self.prev),
            _ => None,
        }
    }

    /// Gives back `amount` tokens to window `mark` while it still weighs, never below 0.
    /// Returns whether it still weighed.
    pub fn refund(&mut self, amount: u64, mark: u64) -> bool {
        match self.count_of(Some(mark)) {
            Some(n) => {
                *n -= amount.min(*n);
                true
            }
            None => false,
        }
    }

    /// Settles a reservation (contract/README.md, "Settle") in the window the estimate was
    /// charged in while it still weighs: a refund lowers its count (not below 0), an extra charge
    /// raises it in full (to the capacity plus [`MAX_DEBT`] at most). Without `window`, an extra
    /// charge counts in the current window and a refund is dropped (it might give back another
    /// window's tokens). Returns whether the state changed.
    pub fn settle(&mut self, l: &Limits, estimate: u64, used: u64, window: Option<u64>) -> bool {
        let window = match window {
            Some(m) => Some(m),
            None if used > estimate => Some(self.w),
            None => None,
        };
        let most = l.capacity + MAX_DEBT;
        match self.count_of(window) {
            Some(n) if used < estimate => {
                let back = (estimate - used).min(*n);
                *n -= back;
                back > 0
            }
            Some(n) if used > estimate => {
                *n = n.saturating_add(used - estimate).min(most);
                true
            }
            _ => false,
        }
    }

    /// Tokens left at `now_ms`, and the estimate above the capacity (a debt).
    pub fn standing(&self, l: &Limits, now_ms: u64) -> (u64, u64) {
        let u = self.used(l, now_ms);
        (l.capacity.saturating_sub(u), u.saturating_sub(l.capacity))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn take_at(l: &Limits, s: &mut Counts, ms: u64) -> BucketResult {
        s.roll(l, ms);
        s.take(l, ms, 1, 1)
    }

    #[test]
    fn the_previous_window_weighs_by_what_is_still_covered() {
        let l = Limits::whole(10, 10, 1000);
        let mut s = Counts::new(&l, 900);
        for _ in 0..10 {
            assert!(take_at(&l, &mut s, 900).allowed);
        }
        assert_eq!(take_at(&l, &mut s, 999).retry_after_ms, 101);
        let r = take_at(&l, &mut s, 1100);
        assert!(r.allowed && r.remaining == 0, "{r:?}");
        let r = take_at(&l, &mut s, 1100);
        assert_eq!((r.retry_after_ms, r.reset_ms), (100, 1900));
        assert_eq!(take_at(&l, &mut s, 1500).remaining, 3);
    }
}
