//! Fixed window: at most the local capacity per window `floor(now_ms / period_ms)`. State:
//! `level` tokens used, `stamp` the window index.

use super::{Limits, Local, State};
use contract::take::BucketResult;

pub(super) struct FixedWindow;

impl Local for FixedWindow {
    const CODE: u8 = 1;
    const REFUNDABLE: bool = false;
    const WINDOWED: bool = true;

    fn take(l: &Limits, state: Option<State>, now_ms: u64, cost: u64) -> (State, BucketResult) {
        let period = l.period_ms.max(1);
        // A clock behind the newest window stored counts in that window (see `project`).
        let (mut used, window) = match state {
            Some(s) => {
                let p = Self::project(l, s, now_ms);
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

    /// The answer's `reset_ms` is the window's end.
    fn spend_within_ms(reset_ms: u64, _period_ms: u64) -> Option<u64> {
        Some(reset_ms)
    }

    fn project(l: &Limits, s: State, now_ms: u64) -> State {
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

    fn holding(l: &Limits, left: u64, now_ms: u64) -> State {
        State {
            level: l.capacity - left.min(l.capacity),
            stamp: now_ms / l.period_ms.max(1),
        }
    }

    fn available(l: &Limits, p: State, _now_ms: u64) -> u64 {
        l.capacity.saturating_sub(p.level)
    }

    fn refund(_: &Limits, s: State, cost: u64) -> State {
        State {
            level: s.level.saturating_sub(cost),
            stamp: s.stamp,
        }
    }

    /// The count used, rounded up, while the window it was counted in lasts (under the old
    /// period); a new period starts its first window with it.
    fn carry(
        old: &Limits,
        p: State,
        new: &Limits,
        now_ms: u64,
        scale: &dyn Fn(u64, bool) -> u64,
    ) -> State {
        let window = now_ms / new.period_ms.max(1);
        let old_end = p.stamp.saturating_add(1).saturating_mul(old.period_ms);
        let used = if old.period_ms == new.period_ms || now_ms < old_end {
            scale(p.level, true).min(new.capacity)
        } else {
            0
        };
        State {
            level: used,
            stamp: if old.period_ms == new.period_ms {
                p.stamp
            } else {
                window
            },
        }
    }
}
