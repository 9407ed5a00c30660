//! Tollgate: global rate limiting for Envoy and Istio, as a proxy-wasm HTTP filter.
//!
//! The filter asks the Tollgate decision service, once per request, to take tokens from every bucket
//! the request's matching rules name (all or none), and denies the request locally when the service
//! says so. Rules in lease mode ask for tokens in batches instead and admit most requests from a
//! pool shared by the proxy's worker threads, without a callout. When the service cannot answer, one configurable failure mode decides (a local fallback
//! bucket shared by the worker threads, allow, or deny), and a circuit breaker keeps a dead service
//! from costing a timeout per request.
//!
//! Layout:
//! - [`core`]: everything that decides, plain Rust without proxy-wasm, unit-tested natively; in
//!   layers, each using only those listed before it:
//!   - `base`: SHA-256 (`hash`), the host's header map format (`hostmap`), the CAS storage trait
//!     (`store`), a place in a shared-data table and the memo of the last ones found (`place`),
//!     the VM's one table of callouts in flight (`ledger`), the VM's requests held until their
//!     time (`held`, shaping).
//!   - `config`: the plugin configuration, parsed and validated once (`model`, `reader`, and
//!     the tables it reads by: `rules`, a rule's fields, `fields`, every other section's,
//!     `transports`, what each transport carries).
//!   - `rules`: rule matching, key building (`rules::keys`), a bucket's limit (`rules::limits`),
//!     the model a JSON body asks for (`rules::model`).
//!   - `wire`: the contract crate's codecs with this VM's instance id and rule names, and Envoy's
//!     RLS v3 request and response; `plan` (the plain data of a decision), `instance`, `callout`
//!     (every callout encoded for the adapter), `batch` (group commit), `stream` (a worker's
//!     stream of takes).
//!   - `settle`: rules charged by the response: the reservation, what each ending settles, the
//!     root context's retry queue; `usage`: the usage an LLM response reports.
//!   - `local`: this Envoy's state in shared data: `table`, `record` (the admission record),
//!     `bucket` (local bucket math, one module per algorithm), `breaker`, `fallback` (the shares kept in step with the answers),
//!     `denials` (exact mode's remembered denials), `lease` (pools of tokens granted by the
//!     service), `slots` (local concurrency slots), `props` (tests only).
//!   - `decide`: the per-request decision: plan a callout, interpret its result, build the
//!     verdict; `headers`: `Retry-After`, `RateLimit` / `RateLimit-Policy`, `X-RateLimit-*`.
//!   - `inflight`: concurrency limits, a slot per key acquired and released once.
//!   - `outbox`: how each take of a configuration leaves (a call, a message on the stream, the
//!     batch queue), and what of its traffic waits or is in flight in a worker.
//!   - `flow`: the per-request state machine (pause only after a dispatch, resume only if
//!     paused), over the `Host` port; `stages`: the local stages behind one trait, listed once;
//!     `slots`: a request's concurrency slots as it drives them; `background`: what no request
//!     waits for (a refill's answer, a late answer, the pools' sweep, the timer's period).
//! - `host` (wasm only): the thin adapter, the only module that calls proxy-wasm.

// Tests may unwrap and index: a failing test is the point.
#![cfg_attr(
    test,
    allow(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::panic,
        clippy::indexing_slicing
    )
)]

pub mod core;

// The adapter runs in the module; its dispatcher is also unit-tested natively against a fake host.
#[cfg(any(target_family = "wasm", test, feature = "dynamic-module"))]
mod host;
