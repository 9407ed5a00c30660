//! A private redis-server per test.

use super::process::{free_port, wait_until, Components, Proc, TempDir, START_ATTEMPTS};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::Duration;

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
        let mut cmd = Command::new(&c.redis_server);
        cmd.args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(dir.path());
        let mut proc = Proc::spawn("redis", cmd, dir.log_file(&format!("redis-{port}")));
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

/// PING over a raw socket: true on `+PONG`.
pub fn redis_ping(port: u16) -> bool {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    if s.write_all(b"PING\r\n").is_err() {
        return false;
    }
    let mut buf = [0u8; 16];
    matches!(s.read(&mut buf), Ok(n) if buf[..n].starts_with(b"+PONG"))
}
