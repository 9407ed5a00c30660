//! A running Envoy: started from an [`EnvoySpec`] and waited for (admin `/ready`), its stats, and the
//! check that the module never panicked or trapped in it.

use super::envoy::EnvoySpec;
use super::http::{http_get, http_get_status};
use super::process::{free_port, Components, Proc, TempDir, READY_TIMEOUT, START_ATTEMPTS};
use super::stats::{parse_stats, tollgate_stats, TOLLGATE_STATS};
use std::collections::BTreeMap;
use std::fs;
use std::process::ExitStatus;
use std::thread;
use std::time::{Duration, Instant};

/// A running Envoy.
pub struct Envoy {
    pub port: u16,
    pub admin_port: u16,
    pub proc: Proc,
}

/// Every test that ran Envoy also checks that the module never panicked or trapped.
impl Drop for Envoy {
    fn drop(&mut self) {
        if thread::panicking() {
            return;
        }
        let failures = self.module_failures();
        if !failures.is_empty() {
            panic!("the module failed in Envoy:\n{}", failures.join("\n"));
        }
    }
}

/// Envoy refused to start or exited: its exit status (None = still running) and its log.
#[derive(Debug)]
pub struct EnvoyFailure {
    pub status: Option<ExitStatus>,
    pub log: String,
}

impl Envoy {
    /// Starts Envoy and waits for admin `/ready`; fails the test if it does not come up.
    pub fn start(c: &Components, dir: &TempDir, spec: &EnvoySpec) -> Envoy {
        match Envoy::try_start(c, dir, spec, READY_TIMEOUT) {
            Ok(e) => e,
            Err(f) => {
                eprintln!("----- envoy log -----\n{}\n----- end -----", f.log);
                panic!("envoy did not start: {:?}", f.status);
            }
        }
    }

    /// Starts one Envoy per spec, all at once, and waits until every one is ready.
    pub fn start_all(c: &Components, dir: &TempDir, specs: &[EnvoySpec]) -> Vec<Envoy> {
        thread::scope(|s| {
            let starting: Vec<_> = specs
                .iter()
                .map(|spec| s.spawn(move || Envoy::start(c, dir, spec)))
                .collect();
            starting
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| panic!("an Envoy did not start"))
                })
                .collect()
        })
    }

    /// Starts Envoy; `Err` when it exits or is not ready within `limit` (the process is then killed).
    pub fn try_start(
        c: &Components,
        dir: &TempDir,
        spec: &EnvoySpec,
        limit: Duration,
    ) -> Result<Envoy, EnvoyFailure> {
        Envoy::try_start_from(c, dir, spec, limit, &|port, admin| {
            spec.yaml(&c.wasm, port, admin)
        })
    }

    /// As [`Envoy::try_start`], with the bootstrap written by `bootstrap(listen_port, admin_port)`
    /// instead of `spec.yaml` (the spec still gives the command line).
    pub fn try_start_from(
        c: &Components,
        dir: &TempDir,
        spec: &EnvoySpec,
        limit: Duration,
        bootstrap: &dyn Fn(u16, u16) -> String,
    ) -> Result<Envoy, EnvoyFailure> {
        // One start on two new ports; retried when Envoy found a port taken.
        let once = || -> Result<Envoy, EnvoyFailure> {
            let port = free_port();
            let admin_port = free_port();
            let cfg = dir.path().join(format!("envoy-{port}.yaml"));
            fs::write(&cfg, bootstrap(port, admin_port)).expect("write envoy config");
            let cmd = spec.command(&c.envoy, &cfg);
            let mut proc = Proc::spawn("envoy", cmd, dir.path().join(format!("envoy-{port}.log")));
            let deadline = Instant::now() + limit;
            loop {
                // Exit first: a port clash must not pass for readiness of someone else's Envoy.
                if let Some(st) = proc.exited() {
                    let log = proc.log_text();
                    // Already exited: dropping does not print the log unless panicking.
                    return Err(EnvoyFailure {
                        status: Some(st),
                        log,
                    });
                }
                // Ready, and ours: a port taken by another Envoy between `free_port` and our
                // bind would answer /ready too (ours then exits on "cannot bind"), so the admin
                // that answered must name our configuration file.
                if http_get_status(admin_port, "/ready") == Some(200)
                    && http_get(admin_port, "/server_info")
                        .is_some_and(|r| r.body.contains(&*cfg.to_string_lossy()))
                    && proc.exited().is_none()
                {
                    return Ok(Envoy {
                        port,
                        admin_port,
                        proc,
                    });
                }
                if Instant::now() > deadline {
                    proc.kill();
                    return Err(EnvoyFailure {
                        status: None,
                        log: proc.log_text(),
                    });
                }
                thread::sleep(Duration::from_millis(25));
            }
        };
        let mut attempt = 1;
        loop {
            match once() {
                Err(f) if attempt < START_ATTEMPTS && f.log.contains("Address already in use") => {
                    attempt += 1;
                }
                other => return other,
            }
        }
    }

    /// Lines of Envoy's log that show the module failing: its panic hook's `panic:` line, or any
    /// exception V8 threw out of a call into it (`Uncaught RuntimeError`, e.g. `unreachable` after
    /// a panic with `panic = "abort"`; `Uncaught RangeError` when the call stack ran out).
    pub fn module_failures(&self) -> Vec<String> {
        self.proc
            .log_text()
            .lines()
            .filter(|l| {
                (l.contains("wasm log") && l.contains("panic: ")) || l.contains("Uncaught ")
            })
            .map(str::to_string)
            .collect()
    }

    /// The base URL of the edge listener.
    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    /// Every stat whose name contains `filter` (admin `/stats?filter=`), as name -> value.
    /// Histograms are skipped.
    pub fn stats(&self, filter: &str) -> BTreeMap<String, u64> {
        let reply = http_get(self.admin_port, &format!("/stats?filter={filter}"))
            .expect("envoy admin /stats");
        assert_eq!(reply.status, 200, "admin /stats: {}", reply.body);
        parse_stats(&reply.body)
    }

    /// One Tollgate counter or gauge by its name without prefix (e.g. `fallback.limited`); 0 when
    /// the stat does not exist (yet).
    pub fn tg(&self, name: &str) -> u64 {
        let full = format!("wasmcustom.tollgate.{name}");
        self.stats(&format!(
            "^wasmcustom\\.tollgate\\.{}$",
            name.replace('.', "\\.")
        ))
        .get(&full)
        .copied()
        .unwrap_or(0)
    }

    /// All Tollgate stats (names without the `wasmcustom.tollgate.` prefix).
    pub fn tg_all(&self) -> BTreeMap<String, u64> {
        tollgate_stats(self.stats(TOLLGATE_STATS))
    }
}
