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
//! - [`core`]: everything that decides, plain Rust without proxy-wasm, unit-tested natively.
//!   - `config`: the plugin configuration, parsed and validated once.
//!   - `rules`: rule matching, key building (`rules::keys`), a bucket's limit (`rules::limits`).
//!   - `decide`: the per-request decision: plan a callout, interpret its result, build the verdict.
//!   - `plan`: the plain data of a decision (plan, callout result, outcome, verdict).
//!   - `flow`: the per-request state machine (pause only after a dispatch, resume only if paused).
//!   - `callout`: every callout encoded for the adapter (a take or batch, acquire, release,
//!     refund, settle).
//!   - `ledger`: the VM's one table of callouts in flight, and who waits for each.
//!   - `batch`: group commit: the queue behind a configuration's callout, bounded by count and
//!     bytes, and a batch answer split back onto its takes.
//!   - `wire`: the contract crate's codecs with this VM's instance id and rule names, and Envoy's
//!     RLS v3 request and response.
//!   - `lease`: lease mode, pools of tokens granted by the service, spent by every worker.
//!   - `inflight`: concurrency limits, a slot per key acquired and released once.
//!   - `settle`: rules charged by the response: the reservation, what each ending settles, the
//!     root context's retry queue.
//!   - `usage`: the usage an LLM response reports (JSON body or SSE stream), in bounded memory.
//!   - `bucket`, `fallback`: local bucket math (one module per algorithm) and the fallback shares
//!     kept in step with the answers.
//!   - `instance`: this Envoy's instance id and the live instance count the answers carry.
//!   - `breaker`: the circuit breaker over a serialisable shared state.
//!   - `table`: the shared-data tables (slots by a bucket's hashed identity, one record format).
//!   - `headers`: `Retry-After`, `RateLimit` / `RateLimit-Policy`, `X-RateLimit-*`.
//!   - `hash`: SHA-256 for bounding long key parts and for slot identities.
//!   - `hostmap`, `store`: the host's header map format; the CAS storage trait.
//!   - `props` (tests only): property tests of the shares and lease pools under interleaved
//!     workers.
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
#[cfg(any(target_family = "wasm", test))]
mod host;
