//! Test support shared by Tollgate's end-to-end tests (`tests/`) and the service's tests
//! (`server/tests/`), so both start and stop real processes the same way:
//!
//! - [`process`]: where the real components are (a missing one fails the test: nothing skips),
//!   scratch directories, free 127.0.0.1 ports, child processes killed by PID on drop with their
//!   logs printed when a test panics, and waiting for readiness;
//! - [`redis`]: a private `redis-server` per test (no persistence), PING, `redis-cli`, and joining
//!   nodes into a Redis Cluster;
//! - [`envoy`]: the one generator of Envoy configuration (tests, benchmarks, demo, checked-in
//!   files), and `envoy --mode validate`; [`envoy_files`]: the checked-in files it writes
//!   (`make configs`), a test failing when one differs;
//! - [`plugin`]: the one builder of the filter's plugin configuration (tests, checked-in files,
//!   and through `tollgate-envoy-config` the demo and the benchmarks);
//! - [`docs`]: README.md and docs/*.md as the tests read them: code blocks with the kind each
//!   declares (the convention is there), links and heading anchors;
//! - [`otlp`]: an OTLP/gRPC trace receiver (OpenTelemetry's generated collector service) that
//!   keeps the spans it is sent, for the tests of the service's traces.
//!
//! A test reports a failure by panicking, so the workspace's no-panic lints do not apply here.
#![allow(
    clippy::panic,
    clippy::expect_used,
    clippy::unwrap_used,
    clippy::indexing_slicing
)]

pub mod docs;
pub mod envoy;
pub mod envoy_files;
pub mod otlp;
pub mod plugin;
pub mod process;
pub mod redis;
