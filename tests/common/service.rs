//! The decision service, `tollgate-server`, as a child process.

use super::http::{http_get, http_get_status};
use super::process::{
    free_port, libfaketime, required_component, wait_until, Components, Proc, TempDir,
    START_ATTEMPTS,
};
use std::path::Path;
use std::process::Command;

/// `tollgate-server` on a free port.
pub struct Service {
    pub port: u16,
    pub proc: Proc,
}

impl Service {
    /// Starts the service against `redis_url` (None = its memory store) and waits for `/healthz`.
    pub fn start(c: &Components, dir: &TempDir, redis_url: Option<&str>) -> Service {
        Service::start_with(c, dir, redis_url, &[])
    }

    /// As [`Service::start`], with `extra` flags. A `--redis-timeout-ms` among them replaces the
    /// harness's default.
    pub fn start_with(
        c: &Components,
        dir: &TempDir,
        redis_url: Option<&str>,
        extra: &[&str],
    ) -> Service {
        for _ in 0..START_ATTEMPTS {
            if let Some(service) =
                Service::launch(&c.server, dir, free_port(), redis_url, extra, &[])
            {
                return service;
            }
        }
        panic!("tollgate-server did not start in {START_ATTEMPTS} attempts");
    }

    /// As [`Service::start_with`], on `port` (e.g. the port of one that was stopped: Envoy's cluster
    /// still points there).
    pub fn start_on(
        c: &Components,
        dir: &TempDir,
        port: u16,
        redis_url: Option<&str>,
        extra: &[&str],
    ) -> Service {
        Service::launch(&c.server, dir, port, redis_url, extra, &[])
            .unwrap_or_else(|| panic!("tollgate-server did not start on port {port}"))
    }

    /// As [`Service::start_with`], with the process's wall clock shifted by `offset` (libfaketime
    /// syntax, e.g. `+3600s`); its monotonic clock is left alone.
    pub fn start_skewed(
        dir: &TempDir,
        redis_url: Option<&str>,
        extra: &[&str],
        offset: &str,
    ) -> Service {
        let faketime = libfaketime();
        // libfaketime shifts a process's clock through LD_PRELOAD, which a static binary (dist/'s
        // musl build) ignores: the skewed replica is the same service built dynamically, the debug
        // build `cargo test --workspace` makes for the service's own tests.
        let dynamic = required_component(
            "TOLLGATE_SERVER_DYNAMIC",
            "target/debug/tollgate-server",
            ". Build it with `cargo build -p tollgate-server` (make test does); \
             libfaketime cannot shift the clock of the static dist/ binary.",
        );
        let env = [
            (
                "LD_PRELOAD",
                faketime.to_str().expect("libfaketime path is UTF-8"),
            ),
            ("FAKETIME", offset),
            ("FAKETIME_DONT_FAKE_MONOTONIC", "1"),
            ("DONT_FAKE_MONOTONIC", "1"),
        ];
        for _ in 0..START_ATTEMPTS {
            if let Some(service) =
                Service::launch(&dynamic, dir, free_port(), redis_url, extra, &env)
            {
                return service;
            }
        }
        panic!("tollgate-server (clock {offset}) did not start in {START_ATTEMPTS} attempts");
    }

    /// One start on `port` with `env` added; None when the process exited before `/healthz` answered.
    fn launch(
        binary: &Path,
        dir: &TempDir,
        port: u16,
        redis_url: Option<&str>,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Option<Service> {
        let mut cmd = Command::new(binary);
        cmd.args(["--listen", &format!("127.0.0.1:{port}")])
            .args(["--log-format", "text"]);
        if !extra.contains(&"--redis-timeout-ms") {
            // A store timeout a busy 2-core machine does not trip (the default, 50 ms, was seen to
            // time out on the first burst of 32 concurrent takes); below the filter's 1 s callouts.
            cmd.args(["--redis-timeout-ms", "500"]);
        }
        cmd.args(extra)
            .envs(env.iter().copied())
            .env_remove("TOLLGATE_REDIS_URL")
            .env_remove("TOLLGATE_REDIS_CLUSTER")
            .env_remove("TOLLGATE_TOKEN")
            .env_remove("TOLLGATE_LISTEN");
        if let Some(url) = redis_url {
            cmd.args(["--redis-url", url]);
        }
        let mut proc = Proc::spawn(
            "tollgate-server",
            cmd,
            dir.log_file(&format!("service-{port}")),
        );
        wait_until("tollgate-server", &mut proc, || {
            http_get_status(port, "/healthz") == Some(200)
        })
        .ok()?;
        Some(Service { port, proc })
    }

    /// The service's Prometheus text.
    pub fn metrics(&self) -> String {
        http_get(self.port, "/metrics")
            .map(|r| r.body)
            .unwrap_or_default()
    }
}
