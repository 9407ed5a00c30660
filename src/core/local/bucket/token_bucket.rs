//! Token bucket: holds up to the local capacity in micro-tokens, refills continuously at
//! `rate / divisor` per period: the contract's arithmetic
//! ([`contract::arithmetic::token_bucket`]), with no refill remainder kept (less than a
//! micro-token is dropped per update). State: `level` micro-tokens held, `stamp` the last update
//! (ms).

use super::{counted, Limits, Local, State, MICRO};
use contract::arithmetic::token_bucket::Tokens;
use contract::take::BucketResult;

pub(super) struct TokenBucket;

/// `ms` in µs, the contract's token-bucket clock (saturated: no clock is that late).
fn us(ms: u64) -> u64 {
    ms.min(u64::MAX / 1000) * 1000
}

/// The contract's state of `s` (a local share never owes).
fn tokens(s: State) -> Tokens {
    Tokens {
        held: i128::from(s.level),
        at_us: us(s.stamp),
        rem: 0,
    }
}

fn state(t: Tokens) -> State {
    State {
        level: u64::try_from(t.held).unwrap_or(0),
        stamp: t.at_us / 1000,
    }
}

impl Local for TokenBucket {
    const CODE: u8 = 0;
    const REFUNDABLE: bool = true;
    const WINDOWED: bool = false;

    fn take(l: &Limits, s: Option<State>, now_ms: u64, cost: u64) -> (State, BucketResult) {
        let (c, now_us) = (counted(l), us(now_ms));
        let mut t = match s {
            None => Tokens::full(&c, now_us),
            Some(s) => tokens(s),
        };
        t.refill(&c, now_us);
        let result = t.take(&c, cost, cost);
        (state(t), result)
    }

    fn project(l: &Limits, s: State, now_ms: u64) -> State {
        let mut t = tokens(s);
        t.refill(&counted(l), us(now_ms));
        state(t)
    }

    fn holding(_: &Limits, left: u64, now_ms: u64) -> State {
        State {
            level: left.saturating_mul(MICRO),
            stamp: now_ms,
        }
    }

    fn available(_: &Limits, p: State, _now_ms: u64) -> u64 {
        p.level / MICRO
    }

    /// Compared in micro-tokens, not whole tokens; of two that hold as many, the one stamped
    /// later (a share empty until the service's grants ahead are due starts refilling later).
    fn holds_no_more(_: &Limits, a: State, b: State, _now_ms: u64) -> bool {
        a.level < b.level || (a.level == b.level && a.stamp >= b.stamp)
    }

    fn refund(l: &Limits, s: State, cost: u64) -> State {
        let mut t = tokens(s);
        t.refund(&counted(l), cost);
        state(t)
    }

    /// The tokens held, rounded down.
    fn carry(old: &Limits, s: State, new: &Limits, now_ms: u64) -> State {
        let mut t = tokens(s);
        t.carry(&counted(old), &counted(new), us(now_ms));
        state(t)
    }
}
