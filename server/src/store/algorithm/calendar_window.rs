//! Calendar window: at most `capacity` tokens per calendar period (a day, a week, a month, a
//! year from midnight in a zone). The bucket's `rate` and `period_ms` carry the span the service
//! computed for it (`crate::calendar`, [`contract::calendar::Span::pack`]); the window is picked
//! from it on the store's clock. The arithmetic is the contract's
//! ([`contract::arithmetic::calendar_window`], a fixed window whose index is the window's first
//! millisecond); `lua/calendar_window.lua` is the same on Redis.

use super::fixed_window::{Counted, FixedWindow};
use super::{limits, Counter};
use crate::domain::{BucketSpec, SettleResult, SettleSpec};
use contract::arithmetic::calendar_window as cw;
use contract::take::BucketResult;

/// The calendar window.
#[derive(Debug)]
pub struct CalendarWindow;

impl Counter for CalendarWindow {
    const CODE: u64 = 3;
    const LUA: &'static str = include_str!("../lua/calendar_window.lua");
    /// The fixed window's: the window and the limits (so the span) it was last charged with.
    type State = Counted;

    /// The current window (a clock behind the stored window keeps counting in that one), a
    /// window counted with another capacity carried over to this one.
    fn load(b: &BucketSpec, stored: Option<Counted>, now: u64) -> Counted {
        let (new, now_ms) = (limits(b), now / 1000);
        let window = match stored {
            Some(s) => cw::carry(s.window, s.limits.capacity, &new, now_ms),
            None => cw::new(&new, now_ms),
        };
        Counted {
            window,
            limits: new,
        }
    }

    fn take(b: &BucketSpec, s: &mut Counted, now: u64) -> (BucketResult, bool) {
        let d = cw::take(&mut s.window, &limits(b), now / 1000, b.cost, b.lease);
        (d, d.allowed)
    }

    fn mark(s: &Counted) -> u64 {
        FixedWindow::mark(s)
    }

    /// Only to the window that was charged, never below 0.
    fn refund(b: &BucketSpec, s: &mut Counted, amount: u64, mark: u64) -> bool {
        FixedWindow::refund(b, s, amount, mark)
    }

    fn settle(spec: &SettleSpec, s: &mut Counted, existed: bool) -> bool {
        FixedWindow::settle(spec, s, existed)
    }

    fn settle_result(b: &BucketSpec, s: &Counted, now: u64) -> SettleResult {
        FixedWindow::settle_result(b, s, now)
    }

    fn until_idle_ms(s: &Counted, now: u64) -> u64 {
        cw::reset_ms(&s.window, &s.limits, now / 1000)
    }
}
