//! Fixed window: at most `capacity` tokens per window `floor(now_ms / period_ms)`; `rate` is
//! ignored. The same arithmetic as `lua/fixed_window.lua` (its header documents the stored fields
//! and the carry-over of a changed limit). Windows are counted on the store's clock.

use super::{Counter, Limits};
use crate::domain::{BucketSpec, SettleResult, SettleSpec};
use contract::take::BucketResult as BucketDecision;

/// The fixed window.
#[derive(Debug)]
pub struct FixedWindow;

/// A fixed window's state: the window index and the tokens counted in it.
#[derive(Debug, Clone, Copy)]
pub struct Window {
    w: u64,
    count: u64,
    limits: Limits,
}

fn reset_ms(period_ms: u64, w: u64, now: u64) -> u64 {
    (w.saturating_add(1).saturating_mul(period_ms)).saturating_sub(now / 1000)
}

/// `used` scaled from capacity `old` to `new`, keeping the fraction used, rounded up (against
/// the caller). Shared with the sliding window, which carries a changed limit the same way.
pub(super) fn scale_used(used: u64, old: u64, new: u64) -> u64 {
    if used == 0 || old == new {
        return used;
    }
    u64::try_from((u128::from(used) * u128::from(new)).div_ceil(u128::from(old.max(1))))
        .unwrap_or(u64::MAX)
}

impl Counter for FixedWindow {
    const CODE: u64 = 1;
    const LUA: &'static str = include_str!("../lua/fixed_window.lua");
    type State = Window;

    /// The current window (a clock behind the stored window keeps counting in that one). A
    /// window counted with other limits: its count carries while its window (under the old
    /// period) has not ended, scaled to the new capacity keeping the fraction used.
    fn load(b: &BucketSpec, stored: Option<Window>, now: u64) -> Window {
        let now_ms = now / 1000;
        let mut w = now_ms / b.period_ms.max(1);
        let mut count = 0;
        if let Some(s) = stored {
            if s.limits.period_ms == b.period_ms {
                if s.w >= w {
                    (w, count) = (s.w, s.count);
                }
            } else if u128::from(now_ms) < (u128::from(s.w) + 1) * u128::from(s.limits.period_ms) {
                count = s.count;
            }
            count = scale_used(count, s.limits.capacity, b.capacity);
        }
        Window {
            w,
            count,
            limits: Limits::of(b),
        }
    }

    fn take(b: &BucketSpec, s: &mut Window, now: u64) -> (BucketDecision, bool) {
        let reset = reset_ms(b.period_ms, s.w, now);
        let allowed = s.count + b.cost <= b.capacity;
        let mut granted = 0;
        let retry = if allowed {
            granted = b.lease.min(b.capacity - s.count).max(b.cost);
            s.count += granted;
            0
        } else if b.cost > b.capacity {
            b.period_ms
        } else {
            reset
        };
        let d = BucketDecision {
            allowed,
            limit: b.capacity,
            remaining: b.capacity.saturating_sub(s.count),
            reset_ms: reset,
            retry_after_ms: retry,
            granted,
        };
        (d, allowed)
    }

    fn mark(s: &Window) -> u64 {
        s.w
    }

    /// Only to the window that was charged, never below 0.
    fn refund(_: &BucketSpec, s: &mut Window, amount: u64, mark: u64) -> bool {
        if mark != s.w {
            return false;
        }
        s.count -= amount.min(s.count);
        true
    }

    /// Only in the window the estimate was charged in: a refund needs that window; an extra
    /// charge without one goes to the current window, in full (up to the capacity plus
    /// [`contract::bounds::MAX_DEBT`]).
    fn settle(spec: &SettleSpec, s: &mut Window, _existed: bool) -> bool {
        let charged_here = match spec.window {
            Some(m) => m == s.w,
            None => spec.used > spec.estimate,
        };
        if !charged_here || spec.used == spec.estimate {
            false
        } else if spec.used < spec.estimate {
            let back = (spec.estimate - spec.used).min(s.count);
            s.count -= back;
            back > 0
        } else {
            s.count = (s.count + (spec.used - spec.estimate))
                .min(spec.bucket.capacity + contract::bounds::MAX_DEBT);
            true
        }
    }

    fn settle_result(b: &BucketSpec, s: &Window, _now: u64) -> SettleResult {
        SettleResult {
            remaining: b.capacity.saturating_sub(s.count),
            debt: s.count.saturating_sub(b.capacity),
        }
    }

    fn until_idle_ms(s: &Window, now: u64) -> u64 {
        reset_ms(s.limits.period_ms, s.w, now)
    }
}
