//! Envoy's native rate limit filter (`envoy.filters.http.ratelimit`) as the client of
//! `tollgate-server`'s RLS v3 endpoint: its Envoy configuration (from the one generator), and the
//! service started with a limits file.
//!
//! Included once by the end-to-end binary (`tests/e2e/main.rs`) as `crate::native_rls`, beside `crate::common`.

use std::fs;
use std::path::{Path, PathBuf};

use crate::common::{Components, EnvoySpec, NativeRls, Service, TempDir};

/// The Envoy configuration for Envoy's native ratelimit filter with `domain` and the route's
/// `rate_limits` (flow YAML), calling the service on `service_port` (the `tollgate` cluster, HTTP/2);
/// no Tollgate filter. Start several with [`Envoy::start_all`].
pub fn native_spec(
    domain: &str,
    rate_limits: &str,
    service_port: u16,
    upstream_port: u16,
) -> EnvoySpec {
    let mut spec = EnvoySpec::new(None, service_port, upstream_port);
    spec.native_rls = Some(NativeRls::new(domain, rate_limits));
    spec.use_remote_address = false;
    spec.log_level = "filter:info".to_string();
    spec
}

/// A limits file in `dir`, replaced atomically (written beside, then renamed over) by
/// [`LimitsFile::replace`].
pub struct LimitsFile {
    pub path: PathBuf,
}

impl LimitsFile {
    pub fn new(dir: &TempDir, text: &str) -> LimitsFile {
        let f = LimitsFile {
            path: dir.path().join("limits.yaml"),
        };
        f.replace(text);
        f
    }

    /// Writes `text` to a temporary file and renames it over the limits file.
    pub fn replace(&self, text: &str) {
        let tmp = self.path.with_extension("yaml.tmp");
        fs::write(&tmp, text).expect("write limits");
        fs::rename(&tmp, &self.path).expect("rename limits");
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// `tollgate-server` with `--rls-config <file>` polled every `poll_ms`, on `redis_url` (None: the
/// memory store), with `extra` flags.
pub fn start_service(
    c: &Components,
    dir: &TempDir,
    redis_url: Option<&str>,
    limits: &LimitsFile,
    poll_ms: u64,
    extra: &[&str],
) -> Service {
    let path = limits.path().to_str().expect("UTF-8 path").to_string();
    let poll = poll_ms.to_string();
    let mut args = vec!["--rls-config", &path, "--rls-config-poll-ms", &poll];
    args.extend_from_slice(extra);
    Service::start_with(c, dir, redis_url, &args)
}
