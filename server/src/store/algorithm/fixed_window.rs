//! Fixed window: at most `capacity` tokens per window `floor(now_ms / period_ms)`; `rate` is
//! ignored. The arithmetic is the contract's ([`contract::arithmetic::fixed_window`]);
//! `lua/fixed_window.lua` is the same on Redis (its header documents the stored fields and the
//! carry-over of a changed limit). Windows are counted on the store's clock.

use super::{limits, Counter, Limits};
use crate::domain::{BucketSpec, SettleResult, SettleSpec};
use contract::arithmetic::fixed_window::Window;
use contract::take::BucketResult;

/// The fixed window.
#[derive(Debug)]
pub struct FixedWindow;

/// A fixed window's state, with the limits it was last charged with (a calendar window's too).
#[derive(Debug, Clone, Copy)]
pub struct Counted {
    pub(super) window: Window,
    pub(super) limits: Limits,
}

impl Counter for FixedWindow {
    const CODE: u64 = 1;
    const LUA: &'static str = include_str!("../lua/fixed_window.lua");
    type State = Counted;

    /// The current window (a clock behind the stored window keeps counting in that one), a
    /// window counted with other limits carried over to these.
    fn load(b: &BucketSpec, stored: Option<Counted>, now: u64) -> Counted {
        let (new, now_ms) = (limits(b), now / 1000);
        let window = match stored {
            Some(s) => s.window.carry(&s.limits, &new, now_ms),
            None => Window::new(&new, now_ms),
        };
        Counted {
            window,
            limits: new,
        }
    }

    fn take(b: &BucketSpec, s: &mut Counted, now: u64) -> (BucketResult, bool) {
        let d = s.window.take(&limits(b), now / 1000, b.cost, b.lease);
        (d, d.allowed)
    }

    fn mark(s: &Counted) -> u64 {
        s.window.w
    }

    /// Only to the window that was charged, never below 0.
    fn refund(_: &BucketSpec, s: &mut Counted, amount: u64, mark: u64) -> bool {
        s.window.refund(amount, mark)
    }

    fn settle(spec: &SettleSpec, s: &mut Counted, _existed: bool) -> bool {
        let l = limits(&spec.bucket);
        s.window.settle(&l, spec.estimate, spec.used, spec.window)
    }

    fn settle_result(b: &BucketSpec, s: &Counted, _now: u64) -> SettleResult {
        let (remaining, debt) = s.window.standing(&limits(b));
        SettleResult { remaining, debt }
    }

    fn until_idle_ms(s: &Counted, now: u64) -> u64 {
        s.window.reset_ms(&s.limits, now / 1000)
    }
}
