//! Configuration pushes as a control plane makes them: Envoy's edge listener is served from a
//! watched LDS file, and [`Pushed::push`] replaces it (a new plugin configuration) while Envoy runs,
//! then waits until Envoy accepted it.

use super::{Components, Envoy, EnvoySpec, TempDir};
use std::fs;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// An Envoy whose edge listener comes from `<dir>/lds/listeners.yaml`.
pub struct Pushed {
    pub envoy: Envoy,
    spec: EnvoySpec,
    wasm: PathBuf,
    lds_dir: PathBuf,
    pushes: u64,
}

impl Pushed {
    /// Starts Envoy for `spec` with its listener behind LDS; old listeners drain at once.
    pub fn start(c: &Components, dir: &TempDir, spec: EnvoySpec) -> Pushed {
        Pushed::start_draining(c, dir, spec, 0)
    }

    /// As [`Pushed::start`], a replaced listener's connections drained for `drain_s` seconds
    /// (Envoy's `--drain-time-s`) before they are closed: requests in flight on them may end.
    pub fn start_draining(
        c: &Components,
        dir: &TempDir,
        mut spec: EnvoySpec,
        drain_s: u32,
    ) -> Pushed {
        spec.extra_args
            .extend(["--drain-time-s".into(), drain_s.to_string()]);
        let lds_dir = dir.path().join("lds");
        fs::create_dir_all(&lds_dir).expect("lds dir");
        let lds = lds_dir.join("listeners.yaml");
        let wasm = c.wasm.clone();
        let envoy =
            Envoy::try_start_from(c, dir, &spec, Duration::from_secs(30), &|port, admin| {
                fs::write(&lds, spec.lds_resource(&wasm, port)).expect("write lds");
                spec.lds_bootstrap(admin, &lds, &lds_dir)
            })
            .unwrap_or_else(|f| panic!("envoy did not start: {:?}\n{}", f.status, f.log));
        Pushed {
            envoy,
            spec,
            wasm,
            lds_dir,
            pushes: 0,
        }
    }

    /// Replaces the plugin configuration: writes the new listener beside the old file and renames
    /// it over (what Envoy's watched directory expects), then waits until Envoy reports the update.
    pub fn push(&mut self, plugin_config: &str) {
        self.spec.plugin_config = Some(plugin_config.to_string());
        let lds = self.lds_dir.join("listeners.yaml");
        let tmp = self.lds_dir.join(".listeners.yaml.tmp");
        fs::write(&tmp, self.spec.lds_resource(&self.wasm, self.envoy.port)).expect("write lds");
        fs::rename(&tmp, &lds).expect("rename lds");
        self.pushes += 1;
        let want = self.pushes + 1; // the initial load counts as one update
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let stats = self.envoy.stats("listener_manager.lds.update");
            let ok = stats
                .get("listener_manager.lds.update_success")
                .copied()
                .unwrap_or(0);
            let rejected = stats
                .get("listener_manager.lds.update_rejected")
                .copied()
                .unwrap_or(0);
            assert_eq!(rejected, 0, "Envoy rejected push {}", self.pushes);
            if ok >= want {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "push {} not applied: {stats:?}",
                self.pushes
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        // The new listener serves once its filter chain (and the plugin's VMs) are warm.
        let deadline = Instant::now() + Duration::from_secs(10);
        while self
            .envoy
            .stats("listener_manager.total_listeners_warming")
            .values()
            .any(|&v| v > 0)
        {
            assert!(Instant::now() < deadline, "listener still warming");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}
