//! A real Envoy with the Tollgate filter as one more proxy of a service under test: its
//! bootstrap from the test kit's generator (every route answered by Envoy itself, no upstream),
//! started on free ports, ready when its admin says so, its Tollgate counters read from the
//! admin's stats. Killed by PID on drop. It needs the components the end-to-end tests need
//! (`TOLLGATE_ENVOY`, `TOLLGATE_WASM`: `make build`) and fails without them.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, Instant};

use tollgate_testkit::envoy::EnvoySpec;
use tollgate_testkit::process::{free_port, Components, Proc, TempDir};

/// A running Envoy in front of the service.
pub struct EnvoyProc {
    /// Its listener.
    pub port: u16,
    admin: u16,
    proc: Proc,
    _dir: TempDir,
}

impl EnvoyProc {
    /// Envoy with `plugin` (the filter's configuration) asking the service on `service_port`,
    /// two workers, quiet logs; waits up to 30 s for it to be ready.
    pub async fn start(plugin: &str, service_port: u16) -> EnvoyProc {
        let c = Components::get();
        let dir = TempDir::new("envoy");
        let mut spec = EnvoySpec::new(Some(plugin.to_string()), service_port, 0).under_load();
        spec.answer_directly("ok");
        spec.upstream_ports.clear();
        let (port, admin) = (free_port(), free_port());
        let cfg = dir.path().join("envoy.yaml");
        std::fs::write(&cfg, spec.yaml(&c.wasm, port, admin)).unwrap();
        let cmd = spec.command(&c.envoy, &cfg);
        let proc = Proc::spawn("envoy", cmd, dir.log_file("envoy"));
        let envoy = EnvoyProc {
            port,
            admin,
            proc,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let ready = reqwest::get(envoy.admin_url("/ready")).await;
            if ready.is_ok_and(|r| r.status() == 200) {
                return envoy;
            }
            assert!(
                Instant::now() < deadline,
                "envoy did not start:\n{}",
                envoy.proc.log_text()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn admin_url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.admin)
    }

    /// `http://127.0.0.1:<listener><path>`.
    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    /// The filter's counter `tollgate.<name>` (0 when Envoy has not defined it).
    pub async fn counter(&self, name: &str) -> u64 {
        let stats = reqwest::get(self.admin_url("/stats?filter=^wasmcustom\\.tollgate\\."))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let want = format!("wasmcustom.tollgate.{name}");
        stats
            .lines()
            .filter_map(|l| l.split_once(": "))
            .find(|(k, _)| *k == want)
            .and_then(|(_, v)| v.trim().parse().ok())
            .unwrap_or(0)
    }
}
