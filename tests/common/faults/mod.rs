//! Faults under load: what `tests/e2e/faults.rs` breaks and how it watches.
//!
//! - [`delay`]: a TCP proxy that delays the service's answers (a slow service).
//! - [`redis_ctl`]: commands to a Redis mid-load, signals by PID, a Redis Cluster with replicas.
//! - [`fleet`]: N Envoys behind an L4 round-robin front, the client load (latency of every request,
//!   clients that abandon their requests), and a sampler of each Envoy's decision counters.

pub mod delay;
pub mod fleet;
pub mod redis_ctl;
