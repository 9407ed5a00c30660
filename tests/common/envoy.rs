//! Envoy configuration for the tests: the workspace's one generator, [`tollgate_testkit::envoy`]
//! (also behind the benchmarks, the demo and the checked-in configurations).

pub use tollgate_testkit::envoy::*;
