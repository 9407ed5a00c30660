//! Processes and ports (the shared test support, `testkit/`): where the real components are,
//! scratch directories, free 127.0.0.1 ports, child processes killed by PID on drop (their logs
//! printed when a test panics), and waiting.

pub use tollgate_testkit::process::*;
