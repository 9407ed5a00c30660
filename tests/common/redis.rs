//! A private redis-server per test (the shared test support's, `testkit/`), started and waited
//! for like every component of the end-to-end harness.

use super::process::{free_port, wait_until, Components, Proc, TempDir, START_ATTEMPTS};
pub use tollgate_testkit::redis::ping as redis_ping;

/// A private redis-server on a free port, no persistence.
pub struct Redis {
    pub port: u16,
    pub proc: Proc,
}

impl Redis {
    pub fn start(c: &Components, dir: &TempDir) -> Redis {
        for _ in 0..START_ATTEMPTS {
            if let Some(redis) = Redis::launch(c, dir, free_port()) {
                return redis;
            }
        }
        panic!("redis-server did not start in {START_ATTEMPTS} attempts");
    }

    /// Starts Redis on `port` (e.g. the port of one that was stopped: clients reconnect to it).
    pub fn start_on(c: &Components, dir: &TempDir, port: u16) -> Redis {
        Redis::launch(c, dir, port)
            .unwrap_or_else(|| panic!("redis-server did not start on port {port}"))
    }

    /// One start on `port`; None when the process exited before it answered PING.
    fn launch(c: &Components, dir: &TempDir, port: u16) -> Option<Redis> {
        let log = dir.log_file(&format!("redis-{port}"));
        let mut proc = tollgate_testkit::redis::spawn(&c.redis_server, port, dir.path(), &[], log);
        wait_until("redis-server", &mut proc, || redis_ping(port)).ok()?;
        Some(Redis { port, proc })
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Kills Redis (the service then answers 503).
    pub fn stop(&mut self) {
        self.proc.kill();
    }
}
