//! Calendar window: at most `capacity` tokens per calendar period (a day, a week from Monday, a
//! month, a year, from midnight in a zone: [`crate::calendar`]). The bucket's [`Limits`] carry the
//! [`Span`] its windows are picked from in their `rate` and `period_ms` slots ([`Span::pack`]):
//! the service computes the span from the bucket's calendar and its own clock, the store picks
//! the window with its own. Counting is the fixed window's ([`Window`], whose index is here the
//! window's first millisecond); only a changed capacity carries (scaled, keeping the fraction
//! used), since the span moves on by itself. A clock behind the newest window counted keeps
//! counting in that window. The Lua is `server/src/store/lua/calendar_window.lua`.

use super::fixed_window::Window;
use super::{scale_used, Limits};
use crate::calendar::Span;
use crate::take::BucketResult;

/// The span a calendar bucket's limits carry.
pub fn span(l: &Limits) -> Span {
    Span::unpack(l.rate, l.period_ms)
}

/// Limits carrying `span`, for a bucket of `capacity` shared by `divisor` proxies.
pub fn limits(capacity: u64, span: &Span, divisor: u64) -> Limits {
    let (rate, period_ms) = span.pack();
    Limits {
        capacity,
        rate,
        period_ms,
        divisor,
    }
}

/// An unused window at `now_ms`.
pub fn new(l: &Limits, now_ms: u64) -> Window {
    Window {
        w: span(l).window(now_ms).0,
        count: 0,
    }
}

/// Moved to the window of `now_ms` when that is a later one (its count then starts at 0).
pub fn roll(s: &mut Window, l: &Limits, now_ms: u64) {
    let w = span(l).window(now_ms).0;
    if w > s.w {
        *s = Window { w, count: 0 };
    }
}

/// A window counted with capacity `old`, counted with capacity `new` from `now_ms`.
pub fn carry(s: Window, old: u64, new: &Limits, now_ms: u64) -> Window {
    let mut s = s;
    roll(&mut s, new, now_ms);
    s.count = scale_used(s.count, old, new.capacity);
    s
}

/// Milliseconds from `now_ms` until the window counted ends (the window of `now_ms`, or, on a
/// clock behind it, the one after).
pub fn reset_ms(s: &Window, l: &Limits, now_ms: u64) -> u64 {
    let span = span(l);
    let (start, end) = span.window(now_ms);
    let end = if s.w > start {
        span.boundary.saturating_add(span.after)
    } else {
        end
    };
    end.saturating_sub(now_ms)
}

/// Takes `cost` (the window rolled up to now) when the window has room: what it has left up to
/// `lease`, at least `cost`. A cost above the capacity is told the end of the window.
pub fn take(s: &mut Window, l: &Limits, now_ms: u64, cost: u64, lease: u64) -> BucketResult {
    let reset = reset_ms(s, l, now_ms);
    s.take_in(l.capacity, cost, lease, reset, reset)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::calendar::{days_from_civil, Unit, DAY_MS};

    #[test]
    fn a_month_counts_until_its_end_and_the_next_starts_at_zero() {
        let dec1 = (days_from_civil(2026, 12, 1) * DAY_MS) as u64;
        let jan1 = (days_from_civil(2027, 1, 1) * DAY_MS) as u64;
        let now = dec1 + 5 * DAY_MS as u64;
        let l = limits(3, &Span::fixed(Unit::Month, 0, now), 1);
        let mut s = new(&l, now);
        assert_eq!(s.w, dec1);
        let r = take(&mut s, &l, now, 2, 2);
        assert!(r.allowed && r.remaining == 1 && r.reset_ms == jan1 - now);
        let r = take(&mut s, &l, now + 1, 2, 2);
        assert_eq!((r.allowed, r.retry_after_ms), (false, jan1 - now - 1));
        // The service's span late in December names January's start; a store still in December
        // keeps the count, one in January starts afresh.
        let late = limits(3, &Span::fixed(Unit::Month, 0, jan1 - DAY_MS as u64), 1);
        let mut same = s;
        roll(&mut same, &late, jan1 - 1);
        assert_eq!(same.count, 2);
        roll(&mut same, &late, jan1);
        assert_eq!((same.w, same.count), (jan1, 0));
        // A capacity raised to 6 keeps the fraction used: 4 of 6.
        assert_eq!(carry(s, 3, &limits(6, &span(&l), 1), now).count, 4);
    }
}
