//! The pure core: no proxy-wasm import; every function here is deterministic given its inputs
//! (time is passed in), so it is unit-tested on the host target.

pub mod batch;
pub mod breaker;
pub mod bucket;
pub mod callout;
pub mod config;
pub mod decide;
pub mod fallback;
pub mod flow;
pub mod hash;
pub mod headers;
pub mod hostmap;
pub mod inflight;
pub mod instance;
pub mod lease;
pub mod ledger;
pub mod plan;
#[cfg(test)]
mod props;
pub mod rules;
pub mod settle;
pub mod store;
pub mod table;
pub mod usage;
pub mod wire;
