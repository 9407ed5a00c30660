//! The real `tollgate-server` binary as a child process: started on a free port with the given
//! flags, its output collected, its memory read from `/proc`, killed by PID on drop.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The binary Cargo built for this test run.
pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_tollgate-server")
}

/// A running `tollgate-server`.
pub struct ServerProc {
    pub port: u16,
    child: Child,
    output: Arc<Mutex<String>>,
}

impl ServerProc {
    /// Starts the binary with `args` (plus `--listen` on a free port, JSON logs) and waits for
    /// its `listening` line.
    pub fn start(args: &[&str]) -> Self {
        let port = super::free_port();
        let mut child = Command::new(bin())
            .args([
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--log-format",
                "json",
            ])
            .args(args)
            .env_remove("TOLLGATE_TOKEN")
            .env_remove("TOLLGATE_REDIS_URL")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn tollgate-server");
        let output = Arc::new(Mutex::new(String::new()));
        collect(child.stdout.take().unwrap(), output.clone());
        collect(child.stderr.take().unwrap(), output.clone());
        let p = ServerProc {
            port,
            child,
            output,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while !p.logs().contains("listening") {
            assert!(
                Instant::now() < deadline,
                "tollgate-server did not start:\n{}",
                p.logs()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        p
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{}", self.port, path)
    }

    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Everything it wrote so far (stdout and stderr).
    pub fn logs(&self) -> String {
        self.output.lock().unwrap().clone()
    }

    /// A `/proc/<pid>/status` field in kB (`VmRSS`, `VmHWM`).
    pub fn status_kb(&self, field: &str) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or_else(|| panic!("no {field} in /proc/{}/status", self.pid()))
    }
}

impl Drop for ServerProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs the binary with `args` until it exits (or `limit` passes, then kills it); returns its
/// exit success and everything it wrote.
pub fn run_to_end(args: &[&str], limit: Duration) -> (bool, String) {
    let mut child = Command::new(bin())
        .args(args)
        .env_remove("TOLLGATE_TOKEN")
        .env_remove("TOLLGATE_REDIS_URL")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn tollgate-server");
    let output = Arc::new(Mutex::new(String::new()));
    collect(child.stdout.take().unwrap(), output.clone());
    collect(child.stderr.take().unwrap(), output.clone());
    let deadline = Instant::now() + limit;
    let ok = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s.success();
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break false;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    // Let the readers drain the pipes.
    std::thread::sleep(Duration::from_millis(100));
    let out = output.lock().unwrap().clone();
    (ok, out)
}

fn collect(pipe: impl Read + Send + 'static, into: Arc<Mutex<String>>) {
    std::thread::spawn(move || {
        for line in BufReader::new(pipe).lines().map_while(Result::ok) {
            let mut o = into.lock().unwrap();
            o.push_str(&line);
            o.push('\n');
        }
    });
}
