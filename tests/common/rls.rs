//! Envoy's native rate limit filter (`envoy.filters.http.ratelimit`) as the client of
//! `tollgate-server`'s RLS v3 endpoint: the bootstrap, and the service started with a limits file.
//!
//! Included by the tests that need it with `#[path = "common/rls.rs"] mod rls;` beside `mod common;`.

use std::fs;
use std::path::{Path, PathBuf};

use crate::common::{Components, Envoy, EnvoySpec, Service, TempDir};

/// What the generated bootstrap holds besides its ports.
#[derive(Clone, Debug)]
pub struct NativeSpec {
    /// The filter's `domain`.
    pub domain: String,
    /// The route's `rate_limits`, as one line of flow YAML (JSON is fine), e.g.
    /// `[{actions: [{generic_key: {descriptor_value: a}}]}]`.
    pub rate_limits: String,
    /// Port of `tollgate-server` (the `tollgate` cluster, HTTP/2).
    pub service_port: u16,
    /// Port of the `upstream` cluster.
    pub upstream_port: u16,
    /// `--concurrency`.
    pub concurrency: u32,
    /// Sent as `authorization: Bearer <token>` in the gRPC service's `initial_metadata`.
    pub token: Option<String>,
}

impl NativeSpec {
    /// The bootstrap: one listener whose route carries `rate_limits`, the native filter with
    /// `failure_mode_deny` (a service failure is a 500, never a pass, so a test sees it), the
    /// service cluster over HTTP/2.
    pub fn yaml(&self, listen_port: u16, admin_port: u16) -> String {
        format!(
            r#"admin:
  address: {{socket_address: {{address: 127.0.0.1, port_value: {admin_port}}}}}
static_resources:
  listeners:
  - name: edge
    address: {{socket_address: {{address: 127.0.0.1, port_value: {listen_port}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: edge
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
                route:
                  cluster: upstream
                  timeout: 5s
                  rate_limits: {rate_limits}
          http_filters:
          - name: envoy.filters.http.ratelimit
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit
              domain: "{domain}"
              failure_mode_deny: true
              timeout: 2s
              rate_limit_service:
                transport_api_version: V3
                grpc_service:
                  envoy_grpc: {{cluster_name: tollgate}}
                  timeout: 2s{metadata}
          - name: envoy.filters.http.router
            typed_config: {{"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}}
  clusters:
  - name: tollgate
    type: STATIC
    connect_timeout: 1s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {{http2_protocol_options: {{}}}}
    load_assignment:
      cluster_name: tollgate
      endpoints:
      - lb_endpoints:
        - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {service_port}}}}}}}
  - name: upstream
    type: STATIC
    connect_timeout: 1s
    load_assignment:
      cluster_name: upstream
      endpoints:
      - lb_endpoints:
        - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {upstream_port}}}}}}}
"#,
            domain = self.domain,
            metadata = match &self.token {
                None => String::new(),
                Some(t) => format!(
                    "\n                  initial_metadata: [{{key: authorization, value: \"Bearer {t}\"}}]"
                ),
            },
            rate_limits = self.rate_limits,
            service_port = self.service_port,
            upstream_port = self.upstream_port,
        )
    }

    /// Starts `n` Envoys with this bootstrap at once and waits until every one is ready.
    pub fn start(&self, c: &Components, dir: &TempDir, n: usize) -> Vec<Envoy> {
        let mut spec = EnvoySpec::new(None, self.service_port, self.upstream_port);
        spec.concurrency = self.concurrency;
        spec.log_level = "filter:info".to_string();
        std::thread::scope(|s| {
            let starting: Vec<_> = (0..n)
                .map(|_| {
                    let spec = spec.clone();
                    s.spawn(move || {
                        match Envoy::try_start_from(
                            c,
                            dir,
                            &spec,
                            std::time::Duration::from_secs(30),
                            &|port, admin| self.yaml(port, admin),
                        ) {
                            Ok(e) => e,
                            Err(f) => panic!("envoy did not start: {:?}\n{}", f.status, f.log),
                        }
                    })
                })
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
