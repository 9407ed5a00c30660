//! The pure core: no proxy-wasm import; every function here is deterministic given its inputs
//! (time is passed in), so it is unit-tested on the host target.
//!
//! In layers, from the ground up; each uses only those below it:
//! - `base`: hashing, the host's header map format, the CAS store trait, the callout ledger.
//! - `config`: the plugin configuration (model, reader, a rule's fields), parsed once.
//! - `rules`: rule matching, key building, a bucket's limit.
//! - `wire`: what a callout carries: the codecs, the plain data of a decision (`plan`), the
//!   instance id (`instance`), every callout's body (`callout`), batches (`batch`), a worker's
//!   stream of takes (`stream`).
//! - `settle`: rules charged by the response, and the usage a response reports.
//! - `local`: this Envoy's state in shared data: tables (`table`), the admission record
//!   (`record`), bucket math (`bucket`), the
//!   breaker (`breaker`), fallback shares (`fallback`), remembered denials (`denials`), lease
//!   pools (`lease`), local concurrency slots (`slots`), their property tests (`props`).
//! - `decide`: the per-request decision (plan a callout, interpret its result, resolve the
//!   verdict) and the rate limit headers.
//! - `inflight`: concurrency limits, a slot per key acquired and released once.
//! - `outbox`: how each take of a configuration leaves (a call, a message on the stream, the batch
//!   queue), and what of its traffic waits or is in flight in the worker; the adapter carries it
//!   out.
//! - `flow`: the per-request state machine over the `Host` port, on top.

pub mod base;
pub mod config;
pub mod decide;
pub mod flow;
pub mod inflight;
pub mod local;
pub mod outbox;
pub mod rules;
pub mod settle;
pub mod wire;
