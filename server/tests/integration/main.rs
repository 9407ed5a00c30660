//! The service's integration tests, one binary (one link of the service and its dependencies, not
//! one per file): each module is one subject, run against the memory store, real Redis processes
//! (standalone, Cluster, Sentinel, TLS) and the real `tollgate-server` binary. [`common`] starts
//! them; under `make test` the Sentinel suites run one at a time (`.config/nextest.toml`).
//!
//! One subject: `cargo test -p tollgate-server --test integration redis_sentinel::`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

mod batch;
mod behaviour;
mod binary;
mod buckets;
mod calendar;
mod check;
mod coalesce;
mod contract;
mod docs;
mod hostile;
mod inflight;
mod instances;
mod lua_reference;
mod redis;
mod redis_sentinel;
mod redis_tls;
mod refund;
mod service;
mod settle;
mod shaping;
mod take_stream;
mod traces;
