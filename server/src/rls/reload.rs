//! The limits file, loaded at startup and again whenever it changes.
//!
//! The file is polled: its identity (device, inode, size, modification time, after following
//! symlinks) is compared every `--rls-config-poll-ms`. That sees an edit in place, an atomic rename
//! over it (a new inode) and a Kubernetes ConfigMap update (its `..data` symlink swapped). A file
//! that does not parse is refused with the error in the log (`rls limits file refused`), and the
//! limits in force stay. Bucket keys depend on the domain, the descriptor's entries and the limit
//! alone, so every limit that did not change keeps its counts across a reload.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, SystemTime};

use super::config::Limits;

/// What identifies one version of the file on disk.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Stamp {
    dev: u64,
    ino: u64,
    len: u64,
    modified: Option<SystemTime>,
}

fn stamp(path: &Path) -> std::io::Result<Stamp> {
    let m = std::fs::metadata(path)?;
    #[cfg(unix)]
    let (dev, ino) = {
        use std::os::unix::fs::MetadataExt;
        (m.dev(), m.ino())
    };
    #[cfg(not(unix))]
    let (dev, ino) = (0, 0);
    Ok(Stamp {
        dev,
        ino,
        len: m.len(),
        modified: m.modified().ok(),
    })
}

/// The limits in force, the file they come from, and how answers are written.
#[derive(Debug)]
pub struct LimitsFile {
    path: PathBuf,
    current: RwLock<Arc<Limits>>,
    seen: Mutex<Option<Stamp>>,
    headers: bool,
}

impl LimitsFile {
    /// Loads `path`; the error names the file and what is wrong in it.
    pub fn load(path: &Path) -> Result<LimitsFile, String> {
        let seen = stamp(path).ok();
        let limits = read(path)?;
        Ok(LimitsFile {
            path: path.to_path_buf(),
            current: RwLock::new(Arc::new(limits)),
            seen: Mutex::new(seen),
            headers: false,
        })
    }

    /// With `on` (`--rls-headers`), answers carry `response_headers_to_add` (`RateLimit-Policy`,
    /// `RateLimit`, `x-ratelimit-*`, `retry-after`); without, none, as envoyproxy/ratelimit
    /// unless `LIMIT_RESPONSE_HEADERS_ENABLED`: Envoy's own `enable_x_ratelimit_headers` writes
    /// them from the statuses, and both at once would send every header twice.
    pub fn with_headers(mut self, on: bool) -> Self {
        self.headers = on;
        self
    }

    /// Whether answers carry the service's response headers.
    pub fn headers(&self) -> bool {
        self.headers
    }

    /// Limits given directly (tests); never reloaded.
    pub fn fixed(limits: Limits) -> LimitsFile {
        LimitsFile {
            path: PathBuf::new(),
            current: RwLock::new(Arc::new(limits)),
            seen: Mutex::new(None),
            headers: false,
        }
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The limits in force.
    pub fn current(&self) -> Arc<Limits> {
        match self.current.read() {
            Ok(g) => g.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// Loads the file again if it changed since the last look. `Ok(true)`: new limits are in
    /// force; `Err`: the file changed but was refused (the old limits stay).
    pub fn check(&self) -> Result<bool, String> {
        if self.path.as_os_str().is_empty() {
            return Ok(false);
        }
        // Missing for a moment (a writer's unlink then create): keep the limits, look again later.
        let Ok(now) = stamp(&self.path) else {
            return Ok(false);
        };
        let mut seen = match self.seen.lock() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        };
        if seen.as_ref() == Some(&now) {
            return Ok(false);
        }
        *seen = Some(now);
        drop(seen);
        let limits = read(&self.path)?;
        match self.current.write() {
            Ok(mut g) => *g = Arc::new(limits),
            Err(poisoned) => *poisoned.into_inner() = Arc::new(limits),
        }
        Ok(true)
    }

    /// Polls the file every `every` until the returned task is aborted; counts each change in
    /// `metrics` (`tollgate_rls_config_reloads_total`, `tollgate_rls_config_ok`).
    pub fn watch(
        self: Arc<Self>,
        every: Duration,
        metrics: Arc<crate::metrics::Metrics>,
    ) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every.max(Duration::from_millis(10)));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let this = self.clone();
                // File reads and parsing off the async workers.
                let result = tokio::task::spawn_blocking(move || this.check()).await;
                match result {
                    Ok(Ok(true)) => {
                        metrics.rls_reload(true);
                        tracing::info!(
                            file = %self.path.display(),
                            domains = ?self.current().domains(),
                            "rls limits file reloaded"
                        )
                    }
                    Ok(Ok(false)) => {}
                    Ok(Err(e)) => {
                        metrics.rls_reload(false);
                        tracing::error!(
                            file = %self.path.display(),
                            error = %e,
                            "rls limits file refused; the limits in force stay"
                        )
                    }
                    Err(e) => tracing::error!(error = %e, "rls limits file check failed"),
                }
            }
        })
    }
}

fn read(path: &Path) -> Result<Limits, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("{}: cannot read: {e}", path.display()))?;
    Limits::parse(&text).map_err(|e| format!("{}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reloads_on_rename_and_refuses_bad_files() {
        let dir = std::env::temp_dir().join(format!("tollgate-rls-reload-{}", std::process::id()));
        let _ = std::fs::create_dir_all(&dir);
        let path = dir.join("limits.yaml");
        let write = |text: &str| {
            let tmp = dir.join("limits.yaml.tmp");
            std::fs::write(&tmp, text).map_err(|e| e.to_string())?;
            std::fs::rename(&tmp, &path).map_err(|e| e.to_string())
        };
        let rpu = |f: &LimitsFile| {
            f.current()
                .lookup("d", [("k", "v")].into_iter())
                .map(|x| x.limit.requests_per_unit)
        };
        let one = |n: u32| {
            format!("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {{unit: second, requests_per_unit: {n}}}\n")
        };
        assert_eq!(write(&one(1)), Ok(()));
        let f = LimitsFile::load(&path);
        assert!(f.is_ok(), "{f:?}");
        let Ok(f) = f else { return };
        assert_eq!(f.check(), Ok(false));
        assert_eq!(rpu(&f), Some(1));
        assert_eq!(write(&one(2)), Ok(()));
        assert_eq!(f.check(), Ok(true));
        assert_eq!(rpu(&f), Some(2));
        assert_eq!(write("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: fortnight, requests_per_unit: 3}\n"), Ok(()));
        let e = f.check().err().unwrap_or_default();
        assert!(e.contains("fortnight") && e.contains("d.k"), "{e}");
        assert_eq!(rpu(&f), Some(2));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
