//! Sliding window counter: at most the local capacity within any window of `period_ms`, estimated
//! as the current fixed window's count plus the previous window's count weighted by the part of
//! it the sliding window still covers, `cur + ceil(prev × (period − elapsed) / period)`: the
//! service's algorithm (contract/README.md), on the local share. State: `stamp` the current window
//! index, `level` both counts (`prev << 32 | cur`; a local capacity is at most 10⁹ < 2³²).

use super::{to_u64, Limits, Local, State};
use contract::take::BucketResult;

pub(super) struct SlidingWindow;

const LOW: u64 = 0xFFFF_FFFF;

/// The window index, its count and the previous window's.
#[derive(Debug, Clone, Copy)]
struct Counts {
    w: u64,
    cur: u64,
    prev: u64,
}

impl Counts {
    fn of(s: State) -> Counts {
        Counts {
            w: s.stamp,
            cur: s.level & LOW,
            prev: s.level >> 32,
        }
    }

    fn state(self) -> State {
        State {
            level: (self.prev.min(LOW) << 32) | self.cur.min(LOW),
            stamp: self.w,
        }
    }

    /// The estimate at `now_ms` (the counts brought up to then).
    fn used(self, period: u64, now_ms: u64) -> u64 {
        let period = period.max(1);
        let into = now_ms
            .saturating_sub(self.w.saturating_mul(period))
            .min(period);
        let weighted =
            (u128::from(self.prev) * u128::from(period - into)).div_ceil(u128::from(period));
        self.cur.saturating_add(to_u64(weighted))
    }

    /// ms from `now_ms` until `into` ms into window `w`.
    fn until(w: u64, period: u64, into: u64, now_ms: u64) -> u64 {
        w.saturating_mul(period)
            .saturating_add(into)
            .saturating_sub(now_ms)
    }
}

/// How far into a window `weight`, counted in the window before, has slid out enough to leave
/// `room`.
fn room_at(weight: u64, room: u64, period: u64) -> u64 {
    if weight == 0 {
        return 0;
    }
    period.saturating_sub(to_u64(
        u128::from(room) * u128::from(period) / u128::from(weight),
    ))
}

impl Local for SlidingWindow {
    const CODE: u8 = 2;
    const REFUNDABLE: bool = false;
    const WINDOWED: bool = true;

    fn take(l: &Limits, state: Option<State>, now_ms: u64, cost: u64) -> (State, BucketResult) {
        let period = l.period_ms.max(1);
        let mut c = match state {
            Some(s) => Counts::of(Self::project(l, s, now_ms)),
            None => Counts {
                w: now_ms / period,
                cur: 0,
                prev: 0,
            },
        };
        let allowed = c.used(period, now_ms).saturating_add(cost) <= l.capacity;
        let retry_after_ms = if allowed {
            c.cur += cost;
            0
        } else if cost > l.capacity {
            period
        } else {
            let room = l.capacity - cost;
            match room.checked_sub(c.cur) {
                // The previous window slides out enough within this one.
                Some(r) => Counts::until(c.w, period, room_at(c.prev, r, period), now_ms).max(1),
                // In the next window, this one's count slides out.
                None => Counts::until(c.w + 1, period, room_at(c.cur, room, period), now_ms),
            }
        };
        let reset_ms = if c.cur > 0 {
            Counts::until(c.w + 2, period, 0, now_ms)
        } else if c.prev > 0 {
            Counts::until(c.w + 1, period, 0, now_ms)
        } else {
            0
        };
        let result = BucketResult {
            allowed,
            limit: l.capacity,
            remaining: l.capacity.saturating_sub(c.used(period, now_ms)),
            reset_ms,
            retry_after_ms,
            granted: if allowed { cost } else { 0 },
        };
        (c.state(), result)
    }

    /// After a grant the answer's `reset_ms` is the end of the next window (the grant weighs
    /// until then); the window it was counted in ends a period sooner.
    fn spend_within_ms(reset_ms: u64, period_ms: u64) -> Option<u64> {
        Some(reset_ms.saturating_sub(period_ms))
    }

    /// Moved to the current window: the count becomes the previous window's (or nothing, after a
    /// window without takes). A clock behind the newest window counts in that window.
    fn project(l: &Limits, s: State, now_ms: u64) -> State {
        let c = Counts::of(s);
        let w = now_ms / l.period_ms.max(1);
        let (cur, prev) = if w <= c.w {
            return s;
        } else if w == c.w + 1 {
            (0, c.cur)
        } else {
            (0, 0)
        };
        Counts { w, cur, prev }.state()
    }

    /// A window that counts what leaves `left`, nothing before it.
    fn holding(l: &Limits, left: u64, now_ms: u64) -> State {
        Counts {
            w: now_ms / l.period_ms.max(1),
            cur: l.capacity - left.min(l.capacity),
            prev: 0,
        }
        .state()
    }

    fn available(l: &Limits, p: State, now_ms: u64) -> u64 {
        l.capacity
            .saturating_sub(Counts::of(p).used(l.period_ms, now_ms))
    }

    fn refund(_: &Limits, s: State, cost: u64) -> State {
        let mut c = Counts::of(s);
        c.cur = c.cur.saturating_sub(cost);
        c.state()
    }

    /// Both counts, rounded up, with the same period; with another, the estimate under the old
    /// period becomes the count of the new current window (as the service does).
    fn carry(
        old: &Limits,
        p: State,
        new: &Limits,
        now_ms: u64,
        scale: &dyn Fn(u64, bool) -> u64,
    ) -> State {
        let c = Counts::of(p);
        let up = |v: u64| scale(v, true).min(new.capacity);
        if old.period_ms == new.period_ms {
            Counts {
                w: c.w,
                cur: up(c.cur),
                prev: up(c.prev),
            }
            .state()
        } else {
            Counts {
                w: now_ms / new.period_ms.max(1),
                cur: up(c.used(old.period_ms, now_ms)),
                prev: 0,
            }
            .state()
        }
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
