//! Calendar window: at most the local capacity per calendar period, the contract's arithmetic
//! ([`contract::arithmetic::calendar_window`]). State: `level` tokens used, `stamp` the window's
//! first millisecond. The limits' `rate` word carries the calendar ([`rate_word`]): the span is
//! computed from it and the proxy's clock. A named zone's midnights need a time zone database
//! the filter does not carry: its local windows are UTC's (the service's are the zone's).

use super::fixed_window::{state, window, FixedWindow};
use super::{Limits, Local, State};
use contract::arithmetic::calendar_window as cw;
use contract::calendar::{Calendar, Span, Unit, Zone, MAX_OFFSET_MINUTES};
use contract::take::BucketResult;

pub(super) struct CalendarWindow;

/// Units and offsets in one word: `unit × 10,000 + offset + 1,000` (offsets within ±840 minutes).
const UNIT_STEP: u64 = 10_000;
const OFFSET_BASE: i64 = 1_000;

/// The word a calendar's local limits carry as their `rate`.
pub fn rate_word(c: &Calendar) -> u64 {
    let offset = match Zone::parse(&c.zone) {
        Ok(Zone::Fixed(m)) => i64::from(m),
        _ => 0,
    };
    c.unit.code() * UNIT_STEP + (offset + OFFSET_BASE) as u64
}

/// The contract's limits of `l` at `now_ms`: the span of its windows around then.
fn counted(l: &Limits, now_ms: u64) -> contract::arithmetic::Limits {
    let unit = Unit::from_code(l.rate / UNIT_STEP).unwrap_or(Unit::Day);
    let offset = (l.rate % UNIT_STEP) as i64 - OFFSET_BASE;
    let offset = offset.clamp(
        -i64::from(MAX_OFFSET_MINUTES),
        i64::from(MAX_OFFSET_MINUTES),
    );
    let span = Span::fixed(unit, offset as i32, now_ms);
    cw::limits(l.capacity, &span, l.divisor)
}

impl Local for CalendarWindow {
    const CODE: u8 = 3;
    const REFUNDABLE: bool = false;
    const WINDOWED: bool = true;

    fn take(l: &Limits, s: Option<State>, now_ms: u64, cost: u64) -> (State, BucketResult) {
        let c = counted(l, now_ms);
        let mut w = match s {
            Some(s) => window(Self::project(l, s, now_ms)),
            None => cw::new(&c, now_ms),
        };
        let mut result = cw::take(&mut w, &c, now_ms, cost, cost);
        result.reset_ms = result.reset_ms.max(1);
        (state(w), result)
    }

    /// The answer's `reset_ms` is the window's end.
    fn spend_within_ms(reset_ms: u64, _period_ms: u64) -> Option<u64> {
        Some(reset_ms)
    }

    /// Going back never reopens a window that was already spent.
    fn project(l: &Limits, s: State, now_ms: u64) -> State {
        let mut w = window(s);
        cw::roll(&mut w, &counted(l, now_ms), now_ms);
        state(w)
    }

    fn holding(l: &Limits, left: u64, now_ms: u64) -> State {
        State {
            level: l.capacity - left.min(l.capacity),
            stamp: cw::new(&counted(l, now_ms), now_ms).w,
        }
    }

    fn available(l: &Limits, p: State, now_ms: u64) -> u64 {
        FixedWindow::available(l, p, now_ms)
    }

    fn refund(l: &Limits, s: State, cost: u64) -> State {
        FixedWindow::refund(l, s, cost)
    }

    /// The count used, rounded up, never above the new capacity.
    fn carry(old: &Limits, s: State, new: &Limits, now_ms: u64) -> State {
        let p = window(Self::project(old, s, now_ms));
        let mut w = cw::carry(p, old.capacity, &counted(new, now_ms), now_ms);
        w.count = w.count.min(new.capacity);
        state(w)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use contract::calendar::{days_from_civil, DAY_MS};
    use contract::Algorithm;

    #[test]
    fn a_share_of_a_month_at_an_offset_resets_at_that_midnight() {
        let cal = Calendar {
            unit: Unit::Month,
            zone: "-05:00".into(),
        };
        let l = Limits::local(
            10,
            rate_word(&cal),
            Unit::Month.nominal_ms(),
            Algorithm::CalendarWindow,
            2,
        );
        // 2027-01-01 00:00 at -05:00 is 05:00 UTC.
        let jan1 = (days_from_civil(2027, 1, 1) * DAY_MS + 5 * 3_600_000) as u64;
        let (s, r) = CalendarWindow::take(&l, None, jan1 - 10, 5);
        assert!(r.allowed && r.remaining == 0 && r.reset_ms == 10);
        let (_, r) = CalendarWindow::take(&l, Some(s), jan1 - 1, 1);
        assert_eq!((r.allowed, r.retry_after_ms), (false, 1));
        let (_, r) = CalendarWindow::take(&l, Some(s), jan1, 5);
        assert!(r.allowed, "January's share");
    }
}
