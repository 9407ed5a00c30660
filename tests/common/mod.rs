//! End-to-end harness: real Redis, the real `tollgate-server` and real Envoy with the real module, each a
//! child process on free 127.0.0.1 ports, configured from files in a per-test temporary directory.
//!
//! One module per concern, everything re-exported here:
//! - [`process`]: where the binaries are ([`Components`]; missing = test failure), scratch directories,
//!   free ports, child processes killed by PID on drop (logs printed when a test panics), waiting.
//! - [`redis`], [`service`]: Redis and `tollgate-server`, started and waited for (PING, `/healthz`);
//!   either can be started again on the port it had (`start_on`), the service under a shifted clock.
//! - [`envoy`]: [`EnvoySpec`], testkit's generator of Envoy configuration, the one the benchmarks,
//!   the demo and the checked-in files use too (listener, the Tollgate wasm filter or Envoy's native
//!   ratelimit filter, the service cluster over HTTP/2, the upstream);
//!   [`envoy_process`]: [`Envoy`], started and waited for (admin `/ready`); dropping it fails the
//!   test if the module panicked or trapped.
//! - [`upstream`]: a counting HTTP/1.1 server in the test process; [`llm`]: one that answers like an
//!   LLM API (JSON or a Server-Sent Events stream, with usage).
//! - [`gate`]: a TCP listener in front of the service that forwards, refuses or black-holes.
//! - [`http`]: clients (ureq) through Envoy and to admin endpoints; [`stats`]: admin `/stats` parsing.
//! - [`stack`]: Redis + service + upstream + Envoy for one plugin configuration, the usual setup.
//! - [`clock`]: the wall clock and windows (Redis `TIME` is the same clock);
//! - [`config`]: plugin configurations ([`Plugin`], testkit's builder), [`Transport`] and
//!   `both_transports!`.
//! - [`load`]: client threads loading the Envoys, every request recorded: round-robin per request,
//!   or one connection each (abandoning requests on demand) for the fault matrix.
//! - [`push`]: LDS pushes; [`loopback`]: clients by source address; [`faults`]: faults under load.
#![allow(dead_code)]

pub mod clock;
pub mod config;
pub mod envoy;
pub mod envoy_process;
pub mod faults;
pub mod gate;
pub mod http;
pub mod llm;
pub mod load;
pub mod loopback;
pub mod process;
pub mod push;
pub mod redis;
pub mod service;
pub mod stack;
pub mod stats;
pub mod upstream;

// Each test binary uses a part of the harness: the re-exports it leaves unused are not a fault.
#[allow(unused_imports)]
pub use config::{Plugin, Transport};
#[allow(unused_imports)]
pub use envoy::{EnvoySpec, NativeRls};
#[allow(unused_imports)]
pub use envoy_process::{Envoy, EnvoyFailure};
#[allow(unused_imports)]
pub use gate::{Gate, GateMode};
#[allow(unused_imports)]
pub use http::{burst, count, http_get, http_get_status, Client, Reply};
#[allow(unused_imports)]
pub use llm::Llm;
#[allow(unused_imports)]
pub use process::{
    closed_port, eventually, free_port, libfaketime, required_component, wait_until,
    workspace_root, Components, Proc, TempDir,
};
#[allow(unused_imports)]
pub use redis::{redis_ping, Redis};
#[allow(unused_imports)]
pub use service::Service;
#[allow(unused_imports)]
pub use stack::Stack;
#[allow(unused_imports)]
pub use stats::{parse_stats, tg_total, tollgate_stats, tollgate_stats_at, TOLLGATE_STATS};
#[allow(unused_imports)]
pub use upstream::Upstream;
