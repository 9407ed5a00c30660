//! The native adapter: the same dispatcher and core as the wasm build, loaded by Envoy as a
//! dynamic module (`envoy.filters.http.dynamic_modules`, a shared library speaking a plain C ABI)
//! instead of a proxy-wasm VM. Built with `--features dynamic-module` (`make native`:
//! `dist/libtollgate.so`).
//!
//! What proxy-wasm gives the wasm build and this adapter gives itself, over Envoy 1.40's ABI:
//!
//! - **A VM per worker**: one [`super::dispatch::Dispatcher`] per worker thread (thread-local),
//!   its root context per filter configuration made on the worker's first request under it.
//! - **Callouts** (`calls.rs`): a callout some request waits for is a one-shot HTTP callout of
//!   that request, on the worker's own async client; one no request waits for (a release, a
//!   refund, a settlement, a refill) goes out from the main thread as the configuration's. Envoy
//!   1.40 keeps a configuration's callouts in a map without a lock (`filter_config.cc`), so no
//!   worker may make one, and a request's callouts end with it: Envoy cancels them without a
//!   word when the request ends first, and the adapter sends them again on another request that
//!   waits for them, or ends them itself.
//! - **gRPC** (`grpc.rs`): framing and status over those callouts (the ABI has no gRPC client).
//!   The stream transport keeps its messages, ids and deadlines: with one worker, on one HTTP/2
//!   stream per worker as the wasm build (`stream.rs`); with several, each message as its own call
//!   on the stream's method, its answer back to the stream (Envoy 1.40's streams of a
//!   configuration share a map without a lock).
//! - **Shared data** (`shared.rs`): one map in the process's memory, with proxy-wasm's versions.
//! - **The timer** (`timer.rs`): the ABI has no timer for an HTTP filter; a thread of the module
//!   posts a worker's tick through a waiting request's scheduler when it is due, and every
//!   callback runs the ticks that are due first. A worker with no request in flight has no
//!   scheduler: its background work (a lease's unspent tokens given back, a settlement retried,
//!   the answers of its main-thread callouts read) waits for its next request.
//! - **Answers** (resume, local reply): carried out when the callback returns, as Envoy's wasm
//!   host does, so a local reply's own hooks find the dispatcher free.
//! - **Metrics**: defined when Envoy creates the configuration (the only time the ABI allows),
//!   under the names the wasm build uses; the filter's `metrics_namespace` is `wasmcustom`.
//!
//! `ffi.rs` holds the bindings; `exports.rs` the hooks Envoy calls; `worker.rs` a worker's
//! contexts; `abi.rs` the dispatcher's host calls over them; `calls.rs` its callouts and
//! `stream.rs` its one stream; below them, `config.rs` a configuration as Envoy made it and
//! `state.rs` the data they share.

#[cfg(feature = "dynamic-module")]
mod abi;
#[cfg(feature = "dynamic-module")]
mod calls;
#[cfg(feature = "dynamic-module")]
mod config;
#[cfg(feature = "dynamic-module")]
mod exports;
#[cfg(feature = "dynamic-module")]
mod ffi;
pub(crate) mod grpc;
pub(crate) mod shared;
#[cfg(feature = "dynamic-module")]
mod state;
#[cfg(feature = "dynamic-module")]
mod stream;
#[cfg(feature = "dynamic-module")]
mod timer;
#[cfg(feature = "dynamic-module")]
mod worker;
