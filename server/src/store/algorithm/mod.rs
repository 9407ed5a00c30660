//! The algorithms, one module each, behind one trait ([`Counter`]): each maps the memory store's
//! state onto its arithmetic (the contract's, [`contract::arithmetic`], in exact integers: the
//! reference `server/tests/integration/lua_reference.rs` tests the Lua against), and owns its Lua (the same
//! arithmetic on Redis, in `lua/<name>.lua`, registered in the scripts' `ALGORITHMS` table under
//! its code) and that code in the scripts' ARGV; its name, protobuf code and key tag are the
//! contract's (`contract::Algorithm`). The stores and the script drivers (take, batch, refund, settle)
//! dispatch through this module and know no algorithm's internals.
//!
//! Every algorithm gets the bucket's limits (capacity, rate, period_ms) in the same ARGV places
//! (`redis/scripts.rs`) and ignores those it does not use. Adding an algorithm: a module with a
//! [`Counter`] and its `.lua`, one line in `algorithms!` below; its arithmetic and name in the
//! contract.
//!
//! | module | algorithm |
//! |---|---|
//! | `token_bucket` | holds up to capacity, refills continuously; may owe tokens after a settle |
//! | `fixed_window` | at most capacity per window `floor(now / period_ms)` |
//! | `sliding_window` | the current window's count plus the previous one's, weighted by how much of it the sliding window still covers |
//! | `calendar_window` | at most capacity per calendar period; `rate` and `period_ms` carry the span the service computed |

pub mod calendar_window;
pub mod fixed_window;
pub mod sliding_window;
pub mod token_bucket;

use crate::domain::{Algorithm, BucketSpec, SettleResult, SettleSpec};
use contract::take::BucketResult;

pub use contract::arithmetic::{Limits, MAX_MS};
/// Extra lifetime of a bucket beyond the moment it would be full again (or its windows end), as
/// the scripts' `TTL_MARGIN_MS`.
pub const TTL_MARGIN_MS: u64 = 1000;

/// The limits a bucket is charged with (shared by no one: the service's buckets are whole).
pub fn limits(b: &BucketSpec) -> Limits {
    Limits::whole(b.capacity, b.rate, b.period_ms)
}

/// One algorithm: its memory-store arithmetic (the reference its Lua is tested against, both
/// running the behaviour suite) and what the scripts know it by. Times are µs on the store's
/// clock; every function gets the caller's (validated) bucket.
pub trait Counter {
    /// Its code in the scripts' ARGV (`ALGORITHMS[code]` in Lua).
    const CODE: u64;
    /// Its Lua file, registering `ALGORITHMS[CODE]` (interface in `lua/prelude.lua`).
    const LUA: &'static str;
    /// Its state in the memory store, with the limits it was last charged with.
    type State: Copy + std::fmt::Debug;

    /// The state at `now` under `b`'s limits: `stored` (if it has not expired) brought up to now
    /// and, when it was charged with other limits, carried over to these; a new bucket otherwise.
    fn load(b: &BucketSpec, stored: Option<Self::State>, now: u64) -> Self::State;
    /// Decides one bucket of a take on its loaded state, charging it when it can pay (granted =
    /// `cost`, or up to `lease`). Returns the decision and whether the state changed.
    fn take(b: &BucketSpec, s: &mut Self::State, now: u64) -> (BucketResult, bool);
    /// What a refund of the charge just made needs to find it again (a window index; 0 if
    /// nothing).
    fn mark(s: &Self::State) -> u64;
    /// Gives back `amount` tokens charged under `mark` (a lease's unspent tokens, or a charge
    /// undone). Returns whether anything was given back.
    fn refund(b: &BucketSpec, s: &mut Self::State, amount: u64, mark: u64) -> bool;
    /// Settles one bucket of a reservation (contract/README.md, "Settle"); `existed`: the bucket
    /// was stored. Returns whether the state changed.
    fn settle(spec: &SettleSpec, s: &mut Self::State, existed: bool) -> bool;
    /// What a settle answers for the bucket as it stands at `now`.
    fn settle_result(b: &BucketSpec, s: &Self::State, now: u64) -> SettleResult;
    /// Milliseconds until the bucket no longer matters (full again, its windows ended), without
    /// the margin: a missing bucket must read the same as this one would by then.
    fn until_idle_ms(s: &Self::State, now: u64) -> u64;
}

/// Declares the algorithms: the memory store's [`State`] (one variant each) and the dispatch
/// from [`Algorithm`] to each one's [`Counter`].
macro_rules! algorithms {
    ($($variant:ident => $module:ident :: $counter:ident),* $(,)?) => {
        /// A bucket's state in the memory store, whatever its algorithm.
        #[derive(Debug, Clone, Copy)]
        pub enum State {
            $(
                #[allow(missing_docs)]
                $variant(<$module::$counter as Counter>::State),
            )*
        }

        /// The code of `a` in the scripts' ARGV.
        pub fn code(a: Algorithm) -> u64 {
            match a {
                $(Algorithm::$variant => <$module::$counter as Counter>::CODE,)*
            }
        }

        /// Every algorithm's Lua, to concatenate between the prelude and a driver.
        pub fn lua() -> String {
            [$(<$module::$counter as Counter>::LUA),*].join("\n")
        }

        /// The Lua of `a` alone: a script whose buckets all use `a` needs no other (a script
        /// defines every function it holds on each call, so one algorithm's script costs Redis
        /// less per call than all of them).
        pub fn lua_of(a: Algorithm) -> &'static str {
            match a {
                $(Algorithm::$variant => <$module::$counter as Counter>::LUA,)*
            }
        }

        impl State {
            /// `b`'s state at `now` ([`Counter::load`]); a stored state of another algorithm (it
            /// cannot be: the algorithm is part of the bucket's identity) counts as none.
            pub fn load(b: &BucketSpec, stored: Option<State>, now: u64) -> State {
                match b.algorithm {
                    $(Algorithm::$variant => State::$variant($module::$counter::load(
                        b,
                        match stored {
                            Some(State::$variant(s)) => Some(s),
                            _ => None,
                        },
                        now,
                    )),)*
                }
            }

            /// [`Counter::take`].
            pub fn take(&mut self, b: &BucketSpec, now: u64) -> (BucketResult, bool) {
                match self {
                    $(State::$variant(s) => $module::$counter::take(b, s, now),)*
                }
            }

            /// [`Counter::mark`].
            pub fn mark(&self) -> u64 {
                match self {
                    $(State::$variant(s) => $module::$counter::mark(s),)*
                }
            }

            /// [`Counter::refund`].
            pub fn refund(&mut self, b: &BucketSpec, amount: u64, mark: u64) -> bool {
                match self {
                    $(State::$variant(s) => $module::$counter::refund(b, s, amount, mark),)*
                }
            }

            /// [`Counter::settle`].
            pub fn settle(&mut self, spec: &SettleSpec, existed: bool) -> bool {
                match self {
                    $(State::$variant(s) => $module::$counter::settle(spec, s, existed),)*
                }
            }

            /// [`Counter::settle_result`].
            pub fn settle_result(&self, b: &BucketSpec, now: u64) -> SettleResult {
                match self {
                    $(State::$variant(s) => $module::$counter::settle_result(b, s, now),)*
                }
            }

            /// How long the bucket is kept: [`Counter::until_idle_ms`] plus the margin, at most
            /// `max_ms`.
            pub fn ttl_ms(&self, now: u64, max_ms: u64) -> u64 {
                let until = match self {
                    $(State::$variant(s) => $module::$counter::until_idle_ms(s, now),)*
                };
                until.saturating_add(TTL_MARGIN_MS).min(max_ms)
            }
        }
    };
}

algorithms!(
    TokenBucket => token_bucket::TokenBucket,
    FixedWindow => fixed_window::FixedWindow,
    SlidingWindow => sliding_window::SlidingWindow,
    CalendarWindow => calendar_window::CalendarWindow,
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_lua_registers_under_its_code() {
        for (lua, code) in [
            (
                token_bucket::TokenBucket::LUA,
                token_bucket::TokenBucket::CODE,
            ),
            (
                fixed_window::FixedWindow::LUA,
                fixed_window::FixedWindow::CODE,
            ),
            (
                calendar_window::CalendarWindow::LUA,
                calendar_window::CalendarWindow::CODE,
            ),
        ] {
            assert!(lua.contains(&format!("ALGORITHMS[{code}] = {{")), "{code}");
        }
    }

    #[test]
    fn the_lua_debt_floor_is_the_contracts() {
        let floor = format!(
            "local MAX_DEBT_M = -{}\n",
            u128::from(contract::bounds::MAX_DEBT) * 1_000_000
        );
        assert!(token_bucket::TokenBucket::LUA.contains(&floor), "{floor}");
        let max = contract::bounds::MAX_DEBT;
        for (lua, line) in [
            (
                include_str!("../lua/prelude.lua"),
                format!("local WINDOW_MAX_DEBT = {max}\n"),
            ),
            (
                sliding_window::SlidingWindow::LUA,
                format!("local SW_MAX_DEBT = {max}\n"),
            ),
        ] {
            assert!(lua.contains(&line), "{line}");
        }
    }
}
