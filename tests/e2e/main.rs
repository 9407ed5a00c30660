//! The end-to-end tests, one test binary: each file here was its own binary, and each linked the
//! whole test kit and compiled `common` again; as modules of one binary they are linked once.
//! A test's name is its file's module and its function: `faults::redis_sigstop` (nextest filters in
//! `.config/nextest.toml` match them by `binary(e2e)` and that prefix).
//!
//! - [`common`]: the harness (`tests/common/`, shared with `tests/deploy/` and `tests/image.rs`);
//!   [`native_rls`]: Envoy's native ratelimit filter against the service's RLS endpoint.
//! - [`authz`]
//! - [`bad_days`]
//! - [`buckets`]
//! - [`calendar`]
//! - [`callouts`]
//! - [`concurrency`]
//! - [`config`]
//! - [`failures`]
//! - [`faults`]
//! - [`filter_rls`]
//! - [`fleet`]
//! - [`harness`]
//! - [`inflight`]
//! - [`lease`]
//! - [`ledger`]
//! - [`limit_change`]
//! - [`limits`]
//! - [`models`]
//! - [`native`]: scenarios of the others run against the native build too
//! - [`outage`]
//! - [`overload`]
//! - [`rls`]
//! - [`rules`]
//! - [`scale`]
//! - [`shaping`]
//! - [`sliding_window`]
//! - [`tokens`]
//! - [`topology`]
//! - [`traces`]
#![allow(
    clippy::panic,
    clippy::expect_used,
    clippy::unwrap_used,
    clippy::indexing_slicing
)]

#[path = "../common/mod.rs"]
mod common;
#[path = "../common/rls.rs"]
mod native_rls;

mod authz;
mod bad_days;
mod buckets;
mod calendar;
mod callouts;
mod concurrency;
mod config;
mod failures;
mod faults;
mod filter_rls;
mod fleet;
mod harness;
mod inflight;
mod lease;
mod ledger;
mod limit_change;
mod limits;
mod models;
mod native;
mod outage;
mod overload;
mod rls;
mod rules;
mod scale;
mod shaping;
mod sliding_window;
mod tokens;
mod topology;
mod traces;
