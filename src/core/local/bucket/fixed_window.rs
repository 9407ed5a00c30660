//! Fixed window: at most the local capacity per window `floor(now_ms / period_ms)`: the
//! contract's arithmetic ([`contract::arithmetic::fixed_window`]). State: `level` tokens used,
//! `stamp` the window index.

use super::{counted, Limits, Local, State};
use contract::arithmetic::fixed_window::Window;
use contract::take::BucketResult;

pub(super) struct FixedWindow;

/// The contract's window of a stored state (the calendar window's too).
pub(super) fn window(s: State) -> Window {
    Window {
        w: s.stamp,
        count: s.level,
    }
}

/// The stored state of a window.
pub(super) fn state(w: Window) -> State {
    State {
        level: w.count,
        stamp: w.w,
    }
}

impl Local for FixedWindow {
    const CODE: u8 = 1;
    const REFUNDABLE: bool = false;
    const WINDOWED: bool = true;

    fn take(l: &Limits, s: Option<State>, now_ms: u64, cost: u64) -> (State, BucketResult) {
        let c = counted(l);
        // A clock behind the newest window stored counts in that window (see `project`).
        let mut w = match s {
            Some(s) => window(Self::project(l, s, now_ms)),
            None => Window::new(&c, now_ms),
        };
        let mut result = w.take(&c, now_ms, cost, cost);
        result.reset_ms = result.reset_ms.max(1);
        if !result.allowed {
            // A share retries at its window's end, even for a cost above it (the service answers
            // a period there: it can never pay), as the share may grow with the next answer.
            result.retry_after_ms = result.reset_ms;
        }
        (state(w), result)
    }

    /// The answer's `reset_ms` is the window's end.
    fn spend_within_ms(reset_ms: u64, _period_ms: u64) -> Option<u64> {
        Some(reset_ms)
    }

    /// Going back never reopens a window that was already spent.
    fn project(l: &Limits, s: State, now_ms: u64) -> State {
        let mut w = window(s);
        w.roll(&counted(l), now_ms);
        state(w)
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
        let mut w = window(s);
        w.refund(cost, w.w);
        state(w)
    }

    /// The count used, rounded up, never above the new capacity.
    fn carry(old: &Limits, s: State, new: &Limits, now_ms: u64) -> State {
        let p = window(Self::project(old, s, now_ms));
        let mut w = p.carry(&counted(old), &counted(new), now_ms);
        w.count = w.count.min(new.capacity);
        state(w)
    }
}
