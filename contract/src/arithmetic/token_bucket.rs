//! Token bucket: holds up to `capacity` tokens, refills continuously at `rate / divisor` per
//! `period_ms`, starts full. Integer micro-tokens and a carried refill remainder, so no fraction
//! of a token is lost between charges (a caller that keeps no remainder passes 0 and loses less
//! than a micro-token per update); the balance is signed because a settle may leave the bucket
//! owing the whole overshoot, down to minus [`MAX_DEBT`] at most. The Lua is
//! `server/src/store/lua/token_bucket.lua` (its header documents the stored fields).

use super::{cap_ms, to_u64, Limits};
use crate::bounds::MAX_DEBT;
use crate::take::BucketResult;

/// Micro-tokens per token.
pub const MICRO: u64 = 1_000_000;
const MICRO_I: i128 = MICRO as i128;
/// The lowest balance, in micro-tokens (`MAX_DEBT_M` in token_bucket.lua).
pub const FLOOR_M: i128 = -(MAX_DEBT as i128) * MICRO_I;

/// A token bucket's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tokens {
    /// Micro-tokens held: below zero while the bucket owes, never below [`FLOOR_M`].
    pub held: i128,
    /// Last update (µs).
    pub at_us: u64,
    /// Refill remainder, in 1/(period_ms × divisor) of a micro-token.
    pub rem: u128,
}

/// Micro-tokens of capacity.
fn cap_m(l: &Limits) -> i128 {
    micro(l.capacity)
}

/// Micro-tokens of `tokens`.
fn micro(tokens: u64) -> i128 {
    i128::from(tokens) * MICRO_I
}

/// Micro-tokens from `a` up to `b`, 0 if none.
fn gap(a: i128, b: i128) -> u128 {
    u128::try_from(b - a).unwrap_or(0)
}

/// Milliseconds for `micro` micro-tokens to refill under `l`, rounded up.
#[inline(never)]
pub fn fill_ms(l: &Limits, micro: u128) -> u64 {
    // At most (capacity + MAX_DEBT) × 10⁶ × one year × divisor: it fits.
    let time = micro * u128::from(l.period_ms) * u128::from(l.divisor);
    cap_ms(time.div_ceil((u128::from(l.rate) * u128::from(MICRO)).max(1)))
}

impl Tokens {
    /// A full bucket at `now_us`.
    pub fn full(l: &Limits, now_us: u64) -> Tokens {
        Tokens {
            held: cap_m(l),
            at_us: now_us,
            rem: 0,
        }
    }

    /// Adds the micro-tokens earned between the last update and `now_us`: `elapsed_us × rate ×
    /// 10⁶ / (period_ms × 1000 × divisor)`, the remainder kept. A clock behind the last update
    /// refills nothing (and does not refill twice later).
    #[inline(never)]
    pub fn refill(&mut self, l: &Limits, now_us: u64) {
        if now_us <= self.at_us {
            return;
        }
        let cap_m = cap_m(l);
        if self.held >= cap_m {
            self.held = cap_m;
            self.rem = 0;
        } else {
            let per = (u128::from(l.period_ms) * u128::from(l.divisor)).max(1);
            // At most 2^64 µs × 10^9 × 1000 + rem: it fits.
            let x = u128::from(now_us - self.at_us) * u128::from(l.rate) * 1000 + self.rem;
            let add = x / per;
            // Positive here, at most the capacity plus MAX_DEBT in micro-tokens (with a debt).
            if add >= gap(self.held, cap_m) {
                self.held = cap_m;
                self.rem = 0;
            } else {
                // add < missing <= 9e15: it fits.
                self.held += i128::try_from(add).unwrap_or(0);
                self.rem = x % per;
            }
        }
        self.at_us = now_us;
    }

    /// A bucket kept under `old`, counted under `new` from `now_us`: refilled up to now under
    /// `old`, then its micro-tokens scaled to the new capacity keeping the fraction held (rounded
    /// down, a debt too: it grows), never above it; the remainder dropped.
    pub fn carry(&mut self, old: &Limits, new: &Limits, now_us: u64) {
        self.refill(old, now_us);
        if old.capacity != new.capacity {
            // Rounded down, a debt too: -ceil(-held × new / old).
            let (new_c, old_c) = (u128::from(new.capacity), u128::from(old.capacity.max(1)));
            let size = self.held.unsigned_abs() * new_c;
            self.held = if self.held >= 0 {
                i128::try_from(size / old_c).unwrap_or(i128::MAX)
            } else {
                -i128::try_from(size.div_ceil(old_c)).unwrap_or(i128::MAX)
            };
        }
        self.held = self.held.clamp(FLOOR_M, cap_m(new));
        self.rem = 0;
    }

    /// Takes `cost` (brought up to now by [`Tokens::refill`]) when the bucket holds it: as many
    /// whole tokens as held up to `lease`, at least `cost`. No shaping: [`Tokens::take_shaped`]
    /// with a `max_delay_ms` of 0.
    pub fn take(&mut self, l: &Limits, cost: u64, lease: u64) -> BucketResult {
        self.take_shaped(l, cost, lease, 0)
    }

    /// [`Tokens::take`], shaped (contract/README.md, "Shaping"): a cost the bucket cannot pay now
    /// but whose tokens refill within `max_delay_ms` is granted now and charged now, the balance
    /// going below zero by the deficit (at most `rate × max_delay_ms / period_ms`), and answered
    /// with `delay_ms`, the time until the tokens are there (rounded up, a debt included); a grant
    /// that waits takes exactly `cost` (no lease). A wait longer than `max_delay_ms` is denied as
    /// without shaping. Grants are therefore spaced as the refill allows: a take after a delayed
    /// one waits for its own tokens after the earlier one's.
    pub fn take_shaped(
        &mut self,
        l: &Limits,
        cost: u64,
        lease: u64,
        max_delay_ms: u64,
    ) -> BucketResult {
        let cost_m = micro(cost);
        let now = cost <= l.capacity && self.held >= cost_m;
        // The whole deficit, a debt included; 0 when it can pay now.
        let wait = if now || cost > l.capacity {
            0
        } else {
            fill_ms(l, gap(self.held, cost_m)).max(1)
        };
        let allowed = now || (cost <= l.capacity && wait <= max_delay_ms);
        let (mut granted, mut retry_after_ms, mut delay_ms) = (0, 0, 0);
        if now {
            granted = lease.min(self.whole()).max(cost);
        } else if allowed {
            granted = cost;
            delay_ms = wait;
        } else if cost > l.capacity {
            // Can never be paid: a full period is the honest "not soon".
            retry_after_ms = l.period_ms;
        } else {
            retry_after_ms = wait;
        }
        self.held -= micro(granted);
        BucketResult {
            allowed,
            limit: l.capacity,
            remaining: self.whole(),
            reset_ms: self.reset_ms(l),
            retry_after_ms,
            granted,
            delay_ms,
            window: 0,
        }
    }

    /// Gives back `amount` tokens, capped at the capacity; on a bucket below zero (a shaped grant
    /// whose caller left while held, a debt) it lowers what is owed.
    pub fn refund(&mut self, l: &Limits, amount: u64) {
        self.held = (self.held + micro(amount)).min(cap_m(l));
    }

    /// Settles a reservation of `estimate` that used `used` (contract/README.md, "Settle"): a
    /// refund (only to a bucket that `existed`: an expired one is full), or an extra charge in
    /// full, into debt (down to [`FLOOR_M`]). Returns whether the state changed.
    pub fn settle(&mut self, l: &Limits, estimate: u64, used: u64, existed: bool) -> bool {
        if used < estimate && existed {
            self.refund(l, estimate - used);
            true
        } else if used > estimate {
            self.held = (self.held - micro(used - estimate)).max(FLOOR_M);
            true
        } else {
            false
        }
    }

    /// Whole tokens held: 0 while the bucket owes.
    pub fn whole(&self) -> u64 {
        to_u64(u128::try_from(self.held).unwrap_or(0) / u128::from(MICRO))
    }

    /// Whole tokens owed, rounded up: 0 unless the balance is below zero.
    pub fn debt(&self) -> u64 {
        to_u64(
            u128::try_from(-self.held)
                .unwrap_or(0)
                .div_ceil(u128::from(MICRO)),
        )
    }

    /// Milliseconds until the bucket is full again.
    pub fn reset_ms(&self, l: &Limits) -> u64 {
        fill_ms(l, gap(self.held, cap_m(l)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_share_refills_at_its_part_of_the_rate() {
        // 10 per second over 3 proxies: 10/3 per second, exactly.
        let l = Limits {
            capacity: 3,
            rate: 10,
            period_ms: 1000,
            divisor: 3,
        };
        let mut t = Tokens::full(&l, 0);
        assert!(t.take(&l, 3, 3).allowed);
        t.refill(&l, 300_000);
        assert_eq!(t.held, 1_000_000, "300 ms × 10/3 per s = 1 token");
        let r = t.take(&l, 2, 2);
        assert!(!r.allowed);
        assert_eq!(r.retry_after_ms, 300);
        assert_eq!(r.reset_ms, 600);
    }

    #[test]
    fn a_settle_owes_and_the_debt_refills_first() {
        let l = Limits::whole(5, 5, 1000);
        let mut t = Tokens::full(&l, 0);
        assert!(t.settle(&l, 1, 8, true));
        assert_eq!((t.whole(), t.debt()), (0, 2));
        let r = t.take(&l, 1, 1);
        assert_eq!(
            r.retry_after_ms, 600,
            "2 owed and 1 to take, at 5 per second"
        );
        t.refill(&l, 400_000);
        assert_eq!((t.whole(), t.debt()), (0, 0));
    }

    #[test]
    fn a_shaped_take_waits_for_its_tokens_and_no_longer_than_allowed() {
        // 10 per second, max delay 1 s: 10 now, 10 more each 100 ms later, then refused.
        let l = Limits::whole(10, 10, 1000);
        let mut t = Tokens::full(&l, 0);
        for _ in 0..10 {
            let r = t.take_shaped(&l, 1, 1, 1000);
            assert_eq!((r.allowed, r.delay_ms), (true, 0));
        }
        for i in 1..=10 {
            let r = t.take_shaped(&l, 1, 5, 1000);
            assert_eq!((r.allowed, r.delay_ms, r.granted), (true, 100 * i, 1));
            assert_eq!((r.remaining, r.retry_after_ms), (0, 0));
        }
        assert_eq!(t.debt(), 10, "at most rate × max delay below zero");
        let r = t.take_shaped(&l, 1, 1, 1000);
        assert_eq!((r.allowed, r.delay_ms, r.retry_after_ms), (false, 0, 1100));
        assert_eq!(t.debt(), 10, "a refusal charges nothing");
        // The last one held leaves: its token comes back, the next waits as long as it did.
        t.refund(&l, 1);
        assert_eq!(t.take_shaped(&l, 1, 1, 1000).delay_ms, 1000);
        // A cost above capacity is never shaped.
        assert!(!t.take_shaped(&l, 11, 11, 60_000).allowed);
    }

    #[test]
    fn no_shaping_is_the_plain_take() {
        let l = Limits::whole(2, 1, 1000);
        let (mut a, mut b) = (Tokens::full(&l, 0), Tokens::full(&l, 0));
        for _ in 0..4 {
            assert_eq!(a.take(&l, 1, 1), b.take_shaped(&l, 1, 1, 0));
        }
        assert_eq!(a, b);
    }

    #[test]
    fn a_lower_capacity_keeps_the_fraction_held() {
        let (old, new) = (Limits::whole(100, 100, 1000), Limits::whole(50, 50, 1000));
        let mut t = Tokens::full(&old, 0);
        t.take(&old, 40, 40);
        t.carry(&old, &new, 0);
        assert_eq!(t.whole(), 30);
    }
}
