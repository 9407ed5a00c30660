//! Envoy: the one generator of its configuration ([`EnvoySpec`]) and the running process ([`Envoy`]).

use super::http::{http_get, http_get_status};
use super::process::{free_port, Components, Proc, TempDir, READY_TIMEOUT, START_ATTEMPTS};
use super::stats::{parse_stats, tollgate_stats, TOLLGATE_STATS};
use std::collections::BTreeMap;
use std::fs;
use std::path::Path;
use std::process::{Command, ExitStatus};
use std::thread;
use std::time::{Duration, Instant};

/// What the generated Envoy configuration contains.
#[derive(Clone, Debug)]
pub struct EnvoySpec {
    /// The plugin configuration (JSON). `None`: no Tollgate filter on the edge listener.
    pub plugin_config: Option<String>,
    /// The name of the cluster the plugin calls (`service.cluster`): `tollgate` unless a test copies
    /// the name a deployment generates.
    pub service_cluster: String,
    /// Ports of the `tollgate` cluster's endpoints (the service, a gate, or a closed port; several
    /// replicas are taken in turn, round-robin).
    pub service_ports: Vec<u16>,
    /// Port of the `upstream` cluster's endpoint.
    pub upstream_port: u16,
    /// `--concurrency`.
    pub concurrency: u32,
    /// The edge listener answers itself (direct_response) instead of routing to `upstream`.
    pub direct_response: bool,
    /// `--component-log-level` (e.g. `wasm:debug`).
    pub log_level: String,
    /// `--log-level`, for every component not named in `log_level`.
    pub base_log_level: String,
    /// `connect_timeout` of both clusters, in milliseconds.
    pub connect_timeout_ms: u64,
    /// Headers the edge route adds to every request it forwards upstream (e.g. one naming the Envoy,
    /// for [`Upstream::start_counting_by`]).
    pub request_headers: Vec<(String, String)>,
    /// The edge connection manager's `use_remote_address`. True (an edge proxy): Envoy appends the
    /// peer to x-forwarded-for and the `source.address` the filter reads is the real peer. False
    /// (Envoy's default): Envoy leaves x-forwarded-for alone and takes `source.address` from its
    /// rightmost entry.
    pub use_remote_address: bool,
    /// The `tollgate` cluster speaks HTTP/2 (required for gRPC). False: HTTP/1.1.
    pub service_http2: bool,
    /// The edge connection manager's `xff_num_trusted_hops`: with it Envoy itself resolves the client
    /// address from x-forwarded-for and `source.address` is that address.
    pub xff_num_trusted_hops: u32,
    /// More command-line arguments (e.g. `--drain-time-s 0`).
    pub extra_args: Vec<String>,
}

impl EnvoySpec {
    pub fn new(plugin_config: Option<String>, service_port: u16, upstream_port: u16) -> EnvoySpec {
        EnvoySpec {
            plugin_config,
            service_cluster: "tollgate".to_string(),
            service_ports: vec![service_port],
            upstream_port,
            concurrency: 2,
            direct_response: false,
            log_level: "wasm:debug".to_string(),
            base_log_level: "info".to_string(),
            connect_timeout_ms: 1000,
            request_headers: Vec::new(),
            use_remote_address: true,
            service_http2: true,
            xff_num_trusted_hops: 0,
            extra_args: Vec::new(),
        }
    }

    /// The bootstrap YAML.
    pub fn yaml(&self, wasm: &Path, listen_port: u16, admin_port: u16) -> String {
        let route = if self.direct_response {
            "direct_response: {status: 200, body: {inline_string: \"direct\\n\"}}".to_string()
        } else {
            "route: {cluster: upstream, timeout: 5s}".to_string()
        };
        let request_headers: String = self
            .request_headers
            .iter()
            .map(|(k, v)| format!("\n                - header: {{key: \"{k}\", value: \"{v}\"}}"))
            .collect();
        let request_headers = if request_headers.is_empty() {
            String::new()
        } else {
            format!("\n                request_headers_to_add:{request_headers}")
        };
        let service_endpoints: String = self
            .service_ports
            .iter()
            .map(|p| {
                format!(
                    "        - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {p}}}}}}}\n"
                )
            })
            .collect();
        let connect_timeout = format!("{}s", self.connect_timeout_ms as f64 / 1000.0);
        let wasm_filter = match &self.plugin_config {
            None => String::new(),
            Some(json) => {
                let indented: String = json
                    .lines()
                    .map(|l| format!("                    {l}\n"))
                    .collect();
                format!(
                    r#"          - name: envoy.filters.http.wasm
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
              config:
                name: tollgate
                vm_config:
                  vm_id: tollgate
                  runtime: envoy.wasm.runtime.v8
                  code: {{local: {{filename: "{wasm}"}}}}
                configuration:
                  "@type": type.googleapis.com/google.protobuf.StringValue
                  value: |
{indented}"#,
                    wasm = wasm.display()
                )
            }
        };
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
          use_remote_address: {use_remote_address}
          xff_num_trusted_hops: {xff_num_trusted_hops}
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
                {route}{request_headers}
          http_filters:
{wasm_filter}          - name: envoy.filters.http.router
            typed_config: {{"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}}
  clusters:
  - name: "{service_cluster}"
    type: STATIC
    connect_timeout: {connect_timeout}
    load_assignment:
      cluster_name: "{service_cluster}"
      endpoints:
      - lb_endpoints:
{service_endpoints}{service_protocol}  - name: upstream
    type: STATIC
    connect_timeout: {connect_timeout}
    load_assignment:
      cluster_name: upstream
      endpoints:
      - lb_endpoints:
        - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {upstream_port}}}}}}}
"#,
            upstream_port = self.upstream_port,
            service_cluster = self.service_cluster,
            use_remote_address = self.use_remote_address,
            xff_num_trusted_hops = self.xff_num_trusted_hops,
            service_protocol = if self.service_http2 {
                "    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        \"@type\": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {http2_protocol_options: {}}
"
            } else {
                ""
            },
        )
    }
}

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
        let mut attempt = 1;
        loop {
            match Envoy::try_start_once(c, dir, spec, limit, bootstrap) {
                Err(f) if attempt < START_ATTEMPTS && f.log.contains("Address already in use") => {
                    attempt += 1;
                }
                other => return other,
            }
        }
    }

    fn try_start_once(
        c: &Components,
        dir: &TempDir,
        spec: &EnvoySpec,
        limit: Duration,
        bootstrap: &dyn Fn(u16, u16) -> String,
    ) -> Result<Envoy, EnvoyFailure> {
        let port = free_port();
        let admin_port = free_port();
        let cfg = dir.path().join(format!("envoy-{port}.yaml"));
        fs::write(&cfg, bootstrap(port, admin_port)).expect("write envoy config");
        let mut cmd = Command::new(&c.envoy);
        cmd.arg("-c")
            .arg(&cfg)
            .args(["--concurrency", &spec.concurrency.to_string()])
            .arg("--disable-hot-restart")
            .args(["--log-level", &spec.base_log_level])
            .args(["--component-log-level", &spec.log_level])
            .args(&spec.extra_args);
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
            if http_get_status(admin_port, "/ready") == Some(200) && proc.exited().is_none() {
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
    }

    /// Lines of Envoy's log that show the module failing: its panic hook's `panic:` line, or a V8
    /// trap (`Uncaught RuntimeError`, e.g. `unreachable` after a panic with `panic = "abort"`).
    pub fn module_failures(&self) -> Vec<String> {
        self.proc
            .log_text()
            .lines()
            .filter(|l| {
                (l.contains("wasm log") && l.contains("panic: "))
                    || l.contains("Uncaught RuntimeError")
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
