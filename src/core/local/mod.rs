//! This Envoy's own state in shared data, kept in step with the service's answers: what decides
//! when the service cannot be asked, or need not be.
//!
//! - `table`: the shared-data tables (slots by a bucket's hashed identity, one record format).
//! - `bucket`: local bucket math (integer micro-tokens), one module per algorithm.
//! - `record`: the admission record, every request's one read at admission: the breaker's
//!   state and, apart from it, the marks the other stages leave (debts, denials, the number of
//!   proxies).
//! - `breaker`: the circuit breaker over its state in the admission record.
//! - `fallback`: the fallback shares kept in step with the answers, and their debts.
//! - `denials`: exact mode's remembered denials, answered by every worker without a callout.
//! - `lease`: lease mode, pools of tokens granted by the service, spent by every worker.
//! - `slots`: local concurrency slots, for concurrency rules when the service cannot be asked.
//! - `props` (tests only): property tests of the shares and lease pools under interleaved
//!   workers.

pub mod breaker;
pub mod bucket;
pub mod denials;
pub mod fallback;
pub mod lease;
#[cfg(test)]
mod props;
pub mod record;
pub mod slots;
pub mod table;
