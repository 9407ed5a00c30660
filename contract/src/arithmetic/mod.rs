//! Each algorithm's integer arithmetic, once: the service's memory store runs it (the reference
//! its Lua is tested against, `server/tests/integration/lua_reference.rs`) and the filter's local buckets run
//! it for their fallback shares and lease pools. Pure: no allocation, nothing beyond `core`.
//!
//! Every function gets a bucket's [`Limits`]. The service's are the take's own (`divisor` 1); the
//! filter's are one proxy's share among `divisor` proxies: the capacity already divided (rounded
//! down), the rate divided inside the refill, so no rate is rounded away. Intermediates are
//! `u128`: `capacity × period × divisor × 10⁶` does not fit in 64 bits at the contract's bounds.
//! Times answered are clamped to [`MAX_MS`], so every store answers the same exact integers.
//!
//! | module | state | clock |
//! |---|---|---|
//! | [`token_bucket`] | micro-tokens held (below zero while it owes), last update, refill remainder | µs |
//! | [`fixed_window`] | the window index and its count | ms |
//! | [`calendar_window`] | the window's first ms and its count (a [`fixed_window::Window`]) | ms |
//! | [`sliding_window`] | the window index, its count and the previous window's | ms |

pub mod calendar_window;
pub mod fixed_window;
pub mod sliding_window;
pub mod token_bucket;

/// Times answered are clamped here (2^53 - 1 ms, the scripts' `MAX_MS`): exact in a Lua number.
pub const MAX_MS: u64 = 9_007_199_254_740_991;

/// The limits a bucket is counted under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Capacity in whole tokens (a proxy's share: already divided by `divisor`).
    pub capacity: u64,
    /// Tokens per period, for all `divisor` sharers together (token bucket only).
    pub rate: u64,
    /// Period (or window) in ms.
    pub period_ms: u64,
    /// How many proxies share the rate: 1 for the service's buckets.
    pub divisor: u64,
}

impl Limits {
    /// One bucket's limits, shared by no one.
    pub const fn whole(capacity: u64, rate: u64, period_ms: u64) -> Self {
        Limits {
            capacity,
            rate,
            period_ms,
            divisor: 1,
        }
    }

    /// The period, at least 1 ms (a hand-built limit of 0 divides nothing by zero).
    pub(crate) fn period(&self) -> u64 {
        self.period_ms.max(1)
    }
}

/// A millisecond count clamped to [`MAX_MS`].
#[inline(never)]
pub fn cap_ms(v: u128) -> u64 {
    v.min(MAX_MS as u128) as u64
}

/// `used` scaled from capacity `old` to `new`, keeping the fraction used, rounded up (against
/// the caller); a capacity of 0 is all used. The windows carry a changed limit so.
#[inline(never)]
pub fn scale_used(used: u64, old: u64, new: u64) -> u64 {
    if old == new {
        return used;
    }
    if old == 0 {
        return new;
    }
    if used == 0 {
        return 0;
    }
    to_u64((u128::from(used) * u128::from(new)).div_ceil(u128::from(old.max(1))))
}

/// A `u128` saturated to `u64`.
pub(crate) fn to_u64(v: u128) -> u64 {
    u64::try_from(v).unwrap_or(u64::MAX)
}
