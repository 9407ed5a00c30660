//! Fixed window: at most `capacity` tokens per window `floor(now_ms / period_ms)`; `rate` is
//! ignored. A clock behind the newest window counted keeps counting in that window: going back
//! never reopens a window that was already spent. The Lua is `server/src/store/lua/fixed_window.lua`.

use super::{scale_used, Limits};
use crate::bounds::MAX_DEBT;
use crate::take::BucketResult;

/// A fixed window's state: the window index and the tokens counted in it (above the capacity
/// only after a settle charged more, by [`MAX_DEBT`] at most).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    /// The window index.
    pub w: u64,
    /// Tokens counted in it.
    pub count: u64,
}

impl Window {
    /// An unused window at `now_ms`.
    pub fn new(l: &Limits, now_ms: u64) -> Window {
        Window {
            w: now_ms / l.period(),
            count: 0,
        }
    }

    /// Moved to the window of `now_ms` when that is a later one (its count then starts at 0).
    pub fn roll(&mut self, l: &Limits, now_ms: u64) {
        let w = now_ms / l.period();
        if w > self.w {
            *self = Window { w, count: 0 };
        }
    }

    /// A window counted under `old`, counted under `new` from `now_ms`: the count carries while
    /// its window (under the old period) has not ended, scaled to the new capacity keeping the
    /// fraction used (rounded up); another period starts its first window with it.
    pub fn carry(self, old: &Limits, new: &Limits, now_ms: u64) -> Window {
        let mut s = self;
        if old.period_ms == new.period_ms {
            s.roll(new, now_ms);
        } else {
            let ended = u128::from(now_ms) >= (u128::from(s.w) + 1) * u128::from(old.period_ms);
            s = Window {
                w: now_ms / new.period(),
                count: if ended { 0 } else { s.count },
            };
        }
        s.count = scale_used(s.count, old.capacity, new.capacity);
        s
    }

    /// Milliseconds from `now_ms` until the window ends.
    pub fn reset_ms(&self, l: &Limits, now_ms: u64) -> u64 {
        self.w
            .saturating_add(1)
            .saturating_mul(l.period_ms)
            .saturating_sub(now_ms)
    }

    /// Takes `cost` (the window rolled up to now) when the window has room: what it has left up
    /// to `lease`, at least `cost`.
    pub fn take(&mut self, l: &Limits, now_ms: u64, cost: u64, lease: u64) -> BucketResult {
        let reset_ms = self.reset_ms(l, now_ms);
        self.take_in(l.capacity, cost, lease, reset_ms, l.period_ms)
    }

    /// Takes `cost` from a window that ends in `reset_ms`, of `capacity` tokens; a cost above
    /// the capacity is told to retry in `never_ms`. Every window (fixed or calendar) takes so.
    pub fn take_in(
        &mut self,
        capacity: u64,
        cost: u64,
        lease: u64,
        reset_ms: u64,
        never_ms: u64,
    ) -> BucketResult {
        let allowed = self.count.saturating_add(cost) <= capacity;
        let mut granted = 0;
        let retry_after_ms = if allowed {
            granted = lease.min(capacity - self.count).max(cost);
            self.count += granted;
            0
        } else if cost > capacity {
            never_ms
        } else {
            reset_ms
        };
        BucketResult {
            allowed,
            limit: capacity,
            remaining: capacity.saturating_sub(self.count),
            reset_ms,
            retry_after_ms,
            granted,
            delay_ms: 0,
            window: if allowed { self.w } else { 0 },
        }
    }

    /// Gives back `amount` tokens charged in window `mark`, never below 0: only to that window.
    /// Returns whether it was the window.
    pub fn refund(&mut self, amount: u64, mark: u64) -> bool {
        if mark != self.w {
            return false;
        }
        self.count -= amount.min(self.count);
        true
    }

    /// Settles a reservation (contract/README.md, "Settle") only in the window the estimate was
    /// charged in: a refund needs that window (`window`); an extra charge without one goes to
    /// the current window, in full (up to the capacity plus [`MAX_DEBT`]). Returns whether the
    /// state changed.
    pub fn settle(&mut self, l: &Limits, estimate: u64, used: u64, window: Option<u64>) -> bool {
        let charged_here = match window {
            Some(m) => m == self.w,
            None => used > estimate,
        };
        if !charged_here || used == estimate {
            false
        } else if used < estimate {
            let back = (estimate - used).min(self.count);
            self.count -= back;
            back > 0
        } else {
            self.count = (self.count + (used - estimate)).min(l.capacity + MAX_DEBT);
            true
        }
    }

    /// Tokens left in the window, and tokens counted above the capacity (a debt).
    pub fn standing(&self, l: &Limits) -> (u64, u64) {
        (
            l.capacity.saturating_sub(self.count),
            self.count.saturating_sub(l.capacity),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_per_window_and_a_new_period_carries_the_count() {
        let l = Limits::whole(2, 2, 1000);
        let mut s = Window::new(&l, 5_100);
        let r = s.take(&l, 5_100, 1, 1);
        assert!(r.allowed && r.remaining == 1 && r.reset_ms == 900);
        s.take(&l, 5_200, 1, 1);
        let r = s.take(&l, 5_999, 1, 1);
        assert_eq!((r.allowed, r.retry_after_ms), (false, 1));
        let mut later = s;
        later.roll(&l, 6_000);
        assert!(later.take(&l, 6_000, 2, 2).allowed, "a new window");
        // 2 of 2 used is 5 of 5 under another period, while the old window lasts.
        let other = Limits::whole(5, 5, 60_000);
        assert_eq!(s.carry(&l, &other, 5_999).count, 5);
        assert_eq!(s.carry(&l, &other, 6_000).count, 0);
    }
}
