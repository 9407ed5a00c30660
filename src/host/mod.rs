//! The proxy-wasm adapter: the only module that talks to the host. It owns the ABI itself (no
//! SDK): the exports Envoy calls, the imports it calls back, and the bookkeeping of contexts and
//! callouts in between, and implements the core's [`crate::core::flow::Host`] port over them.
//!
//! - `abi.rs`: the host calls the adapter makes, as a trait (Envoy's imports, or a fake in tests).
//! - `dispatch.rs`: contexts, the VM's ledger of callouts ([`crate::core::base::ledger`]: one entry per
//!   callout, its variant says who waits), and what each callback does; pure over `abi`.
//! - `metrics.rs`: the metric ids each configuration defines, and what the core's counts add to.
//! - `pace.rs`: resumes and local replies paced, so Envoy never nests more than a round of them
//!   (its after-call queue runs one inside another when they call back into the VM).
//! - `plugin.rs`: one configuration as the adapter keeps it, and who waits for each callout.
//! - `proxy.rs`: the core's `Host` port over the ABI, for one context; settlement delivery.
//! - `request.rs`: what the adapter reads of a request for the core (match headers first).
//! - `wasm.rs` (wasm only): the imports, the `proxy_on_*` exports, allocator, logger, panic hook.
//! - `native/` (the `dynamic-module` feature): the same dispatcher behind Envoy's dynamic module
//!   ABI instead (its own map in `native/mod.rs`).

mod abi;
mod dispatch;
mod metrics;
#[cfg(any(test, feature = "dynamic-module"))]
mod native;
pub(crate) mod pace;
mod plugin;
mod proxy;
mod request;
#[cfg(target_family = "wasm")]
mod wasm;
