//! Tollgate's wire contract (contract/README.md), in one place for both sides: the filter
//! (wasm32-wasip1) and the decision service depend on this crate and define none of it again.
//!
//! - [`algorithm`]: how a bucket counts, with its JSON name, protobuf code and store tag;
//! - [`arithmetic`]: each algorithm's integer arithmetic, the one both sides count with;
//! - [`calendar`]: calendar periods (day, week, month, year in a zone) and the span a store
//!   counts a calendar window by;
//! - [`bounds`]: the largest values, lists and bodies a valid message holds;
//! - [`fields`]: the JSON field names;
//! - [`headers`]: the rate limit headers both sides write (`RateLimit-Policy`, `RateLimit`,
//!   `Retry-After`);
//! - [`take`]: a take and its answer (and a batch's), the messages themselves;
//! - [`json`], [`proto`]: their two encodings, tested on contract/fixtures/cases.json;
//! - [`slots`]: an acquire and a release of concurrency slots, and their answers;
//! - [`settle`]: a settle (reserve, then settle) and its answer.
//!
//! Plain Rust: no proxy-wasm, no async runtime. The `serde` feature (the service's) adds the
//! serde derives of the answers; the filter leaves it off, so its module does not carry them.

pub mod algorithm;
pub mod arithmetic;
pub mod bounds;
pub mod calendar;
pub mod fields;
pub mod headers;
pub mod json;
pub mod proto;
pub mod settle;
pub mod slots;
pub mod take;

#[cfg(test)]
mod tests;

pub use algorithm::Algorithm;
pub use take::{
    BatchResponse, Bucket, BucketResult, DecodeError, MessageError, Sender, StreamAnswer,
    TakeRequest, TakeResponse,
};
