//! The one generator of Envoy configuration. The end-to-end tests, the benchmarks
//! (`scripts/bench-*.sh`), the demo (`scripts/demo.py`) and the checked-in configurations
//! (`envoy.yaml`, `deploy/envoy/envoy.yaml`, see [`crate::envoy_files`]) all write theirs with it;
//! the scripts through the `tollgate-envoy-config` binary.
//!
//! [`EnvoySpec`] says what the edge listener holds: its HTTP filters (the Tollgate wasm filter with
//! a plugin configuration, the module without one, a native dynamic module, Envoy's own
//! `local_ratelimit`, Envoy's own ratelimit filter calling the service's RLS endpoint, filters from
//! a checked-in file), its routes (to the upstream cluster, or answered by Envoy itself) and
//! connection manager settings; and the clusters: the service's (HTTP/2 unless told otherwise, one
//! endpoint per replica) and the upstream (one or several endpoints, taken in turn). It renders a
//! static bootstrap ([`EnvoySpec::yaml`]) or, for configuration pushes, a bootstrap that reads the
//! listener from an LDS file ([`EnvoySpec::lds_bootstrap`], [`EnvoySpec::lds_resource`]).
//!
//! Every piece is written at column 0 and indented where it is placed, so each is written once.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

/// What the generated Envoy configuration contains.
#[derive(Clone, Debug)]
pub struct EnvoySpec {
    /// The edge listener's name, also its connection manager's `stat_prefix` and route table name.
    pub listener_name: String,
    /// The address the edge listener binds (`127.0.0.1`).
    pub listen_address: String,
    /// The plugin configuration (JSON). `None`: no Tollgate filter on the edge listener (unless
    /// `bare_module`).
    pub plugin_config: Option<String>,
    /// The wasm filter's `config.name` and `vm_id` (`tollgate`).
    pub module_name: String,
    /// With no `plugin_config`: load the module anyway, with no plugin configuration (e.g. an
    /// empty module, the benchmarks' baseline).
    pub bare_module: bool,
    /// The wasm filter's `failure_policy` (e.g. `FAIL_RELOAD`); `None`: Envoy's default.
    pub failure_policy: Option<String>,
    /// The wasm filter's `fail_open`: a module that cannot load is skipped.
    pub fail_open: bool,
    /// A native filter: an Envoy dynamic module (`envoy.filters.http.dynamic_modules`), first in
    /// the chain (where the wasm filter would be).
    pub dynamic_module: Option<DynamicModule>,
    /// The Tollgate filter as its native build, the dynamic module at this path
    /// (`.../libtollgate.so`), in the wasm module's place with the same plugin configuration.
    /// `None`: the wasm build. [`EnvoySpec::empty`] takes it from the environment
    /// ([`native_from_env`]), so a whole suite runs against either build.
    pub native: Option<PathBuf>,
    /// Envoy's own ratelimit filter, after the Tollgate filter if there is one.
    pub native_rls: Option<NativeRls>,
    /// Envoy's own `local_ratelimit` filter (one bucket per Envoy), after the above.
    pub local_ratelimit: Option<LocalRateLimit>,
    /// More HTTP filters before the router, each a YAML mapping at column 0 (`name:`,
    /// `typed_config:`), e.g. taken from a checked-in file.
    pub extra_http_filters: Vec<String>,
    /// HTTP filters first in the chain, before the wasm filter (as `extra_http_filters`), e.g. an
    /// authorization filter whose dynamic metadata the rules read.
    pub first_http_filters: Vec<String>,
    /// More clusters (each a YAML mapping at column 0), e.g. an authorization server's.
    pub extra_clusters: Vec<String>,
    /// The virtual host's name (`all`).
    pub virtual_host_name: String,
    /// More fields of the virtual host, as YAML at column 0 (e.g. `rate_limits:` from a checked-in
    /// file).
    pub virtual_host_extra: Option<String>,
    /// The edge listener's routes, in order (one `/` route to the upstream cluster unless told
    /// otherwise).
    pub routes: Vec<Route>,
    /// Headers every route to the upstream adds to the requests it forwards (e.g. one naming the
    /// Envoy, for a counting upstream).
    pub request_headers: Vec<(String, String)>,
    /// A file the connection manager appends one line per request to: the request's start time in
    /// seconds (millisecond precision) and the response code.
    pub access_log: Option<String>,
    /// The edge connection manager's `use_remote_address`. True (an edge proxy): Envoy appends the
    /// peer to x-forwarded-for and the `source.address` the filter reads is the real peer. False
    /// (Envoy's default): Envoy leaves x-forwarded-for alone and takes `source.address` from its
    /// rightmost entry.
    pub use_remote_address: bool,
    /// The edge connection manager's `xff_num_trusted_hops`: with it Envoy itself resolves the client
    /// address from x-forwarded-for and `source.address` is that address.
    pub xff_num_trusted_hops: u32,
    /// The name of the cluster the plugin calls (`service.cluster`): `tollgate` unless a test copies
    /// the name a deployment generates.
    pub service_cluster: String,
    /// The service's host: `None` is 127.0.0.1 (a STATIC cluster); a name makes it STRICT_DNS.
    pub service_host: Option<String>,
    /// Ports of the service cluster's endpoints (the service, a gate, or a closed port; several
    /// replicas are taken in turn, round-robin). Empty: no service cluster.
    pub service_ports: Vec<u16>,
    /// The service cluster speaks HTTP/2 (required for gRPC). False: HTTP/1.1.
    pub service_http2: bool,
    /// An HTTP health check of the service's endpoints on this path (e.g. `/readyz`).
    pub service_health_check: Option<String>,
    /// The name of the cluster the routes forward to (`upstream`).
    pub upstream_cluster: String,
    /// The upstream's host: `None` is 127.0.0.1 (a STATIC cluster); a name makes it STRICT_DNS.
    pub upstream_host: Option<String>,
    /// Ports of the upstream cluster's endpoints (round-robin). Empty: no upstream cluster.
    pub upstream_ports: Vec<u16>,
    /// `connect_timeout` of the clusters, in milliseconds.
    pub connect_timeout_ms: u64,
    /// The upstream cluster's `connect_timeout` when it differs from the service's.
    pub upstream_connect_timeout_ms: Option<u64>,
    /// The bootstrap's `stats_flush_interval`, in seconds (Envoy's default, 5 s, when `None`).
    pub stats_flush_interval_s: Option<u32>,
    /// More listeners of the bootstrap (mappings at column 0, e.g. another spec's
    /// [`EnvoySpec::listener`]), after the edge listener.
    pub extra_listeners: Vec<String>,
    /// Comments written into the configuration, by place (see [`Note`]).
    pub notes: Vec<(Note, String)>,
    /// `--concurrency`.
    pub concurrency: u32,
    /// `--component-log-level` (e.g. `wasm:debug`).
    pub log_level: String,
    /// `--log-level`, for every component not named in `log_level`.
    pub base_log_level: String,
    /// More command-line arguments (e.g. `--drain-time-s 0`).
    pub extra_args: Vec<String>,
}

/// Where a comment goes in the generated configuration: above the element it names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Note {
    /// The top of the file.
    File,
    /// The edge connection manager's `use_remote_address`.
    RemoteAddress,
    /// The wasm filter's `failure_policy` or `fail_open`.
    ModuleFailure,
    /// The wasm filter's `configuration`.
    Configuration,
    /// The service cluster.
    ServiceCluster,
    /// The service cluster's health checks.
    HealthChecks,
}

/// One route of the edge listener.
#[derive(Clone, Debug)]
pub struct Route {
    /// The path prefix it matches.
    pub prefix: String,
    /// What it does.
    pub action: Action,
    /// Response headers it sets (overwriting).
    pub response_headers: Vec<(String, String)>,
    /// The route switches the wasm filter off (`typed_per_filter_config`, `disabled: true`):
    /// Envoy does not call the module for it.
    pub skip_module: bool,
    /// A comment above the route.
    pub note: Option<String>,
    /// The route's `max_stream_duration` in seconds: counted from when the request arrived, a
    /// filter's pause included (the `timeout` starts only when the router has the request).
    pub max_stream_duration_s: Option<u32>,
}

/// What a route does.
#[derive(Clone, Debug)]
pub enum Action {
    /// Forwards to the upstream cluster, with a route timeout in seconds (Envoy's 15 s when `None`).
    Upstream { timeout_s: Option<u32> },
    /// Envoy answers itself.
    Direct { status: u16, body: String },
}

impl Route {
    /// A route of `prefix` to the upstream cluster.
    pub fn upstream(prefix: &str, timeout_s: Option<u32>) -> Route {
        Route::with(prefix, Action::Upstream { timeout_s })
    }

    /// A route of `prefix` that Envoy answers itself with 200 and `body`.
    pub fn direct(prefix: &str, body: &str) -> Route {
        Route::with(
            prefix,
            Action::Direct {
                status: 200,
                body: body.to_string(),
            },
        )
    }

    fn with(prefix: &str, action: Action) -> Route {
        Route {
            prefix: prefix.to_string(),
            action,
            response_headers: Vec::new(),
            skip_module: false,
            max_stream_duration_s: None,
            note: None,
        }
    }
}

/// Envoy's native rate limit filter (`envoy.filters.http.ratelimit`) as a client of the service's
/// RLS v3 endpoint, over the service cluster.
#[derive(Clone, Debug)]
pub struct NativeRls {
    /// The filter's `domain`.
    pub domain: String,
    /// The upstream routes' `rate_limits`, as flow YAML (JSON is fine), e.g.
    /// `[{actions: [{generic_key: {descriptor_value: a}}]}]`.
    pub rate_limits: String,
    /// Put `rate_limits` in the route's `typed_per_filter_config` (`RateLimitPerRoute`) instead
    /// of its `route.rate_limits`: Envoy 1.40 reads a rate limit's `hits_addend` and
    /// `apply_on_stream_done` there only (Envoy Gateway's and Envoy AI Gateway's pattern).
    pub per_route: bool,
    /// Sent as `authorization: Bearer <token>` in the gRPC service's `initial_metadata`.
    pub token: Option<String>,
    /// The filter's and the gRPC call's timeout, in milliseconds.
    pub timeout_ms: u64,
    /// `failure_mode_deny`: a service failure is a 500, never a pass (so a test sees it).
    pub failure_mode_deny: bool,
    /// `enable_x_ratelimit_headers: DRAFT_VERSION_03`: Envoy writes `x-ratelimit-limit`,
    /// `-remaining` and `-reset` itself, from the answer's descriptor statuses.
    pub x_ratelimit_headers: bool,
}

impl NativeRls {
    /// Denying on failure, 2 s timeout, no token.
    pub fn new(domain: &str, rate_limits: &str) -> NativeRls {
        NativeRls {
            domain: domain.to_string(),
            rate_limits: rate_limits.to_string(),
            per_route: false,
            token: None,
            timeout_ms: 2000,
            failure_mode_deny: true,
            x_ratelimit_headers: false,
        }
    }
}

/// The native build the environment asks for: `TOLLGATE_FILTER_BUILD=native` runs the Tollgate
/// filter as the dynamic module `TOLLGATE_NATIVE` (default `dist/libtollgate.so` under the
/// workspace); anything else (or nothing), the wasm module.
pub fn native_from_env() -> Option<PathBuf> {
    if std::env::var("TOLLGATE_FILTER_BUILD").ok().as_deref() != Some("native") {
        return None;
    }
    Some(
        std::env::var_os("TOLLGATE_NATIVE")
            .map(PathBuf::from)
            .unwrap_or_else(|| crate::process::workspace_root().join("dist/libtollgate.so")),
    )
}

/// An HTTP filter from an Envoy dynamic module: the shared library `lib<name>.so`, which Envoy
/// looks for in `$ENVOY_DYNAMIC_MODULES_SEARCH_PATH`, else in its working directory.
#[derive(Clone, Debug)]
pub struct DynamicModule {
    /// `dynamic_module_config.name`: the library's name without `lib` and `.so`.
    pub name: String,
    /// `filter_name`: which of the module's filters (the module reads it).
    pub filter_name: String,
    /// `filter_config`, passed to the module as the bytes of a `StringValue`; `None`: none.
    pub filter_config: Option<String>,
}

impl DynamicModule {
    /// The filter (a mapping at column 0).
    fn filter(&self) -> String {
        let mut config = format!(
            "dynamic_module_config: {{name: {}}}\nfilter_name: {}\n",
            quote(&self.name),
            quote(&self.filter_name)
        );
        if let Some(c) = &self.filter_config {
            let _ = writeln!(
                config,
                "filter_config:\n  \"@type\": type.googleapis.com/google.protobuf.StringValue\n  \
                 value: {}",
                quote(c)
            );
        }
        format!(
            "name: envoy.filters.http.dynamic_modules\ntyped_config:\n  \"@type\": \
             type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter\n{}",
            indent(&config, 2)
        )
    }
}

/// Envoy's `local_ratelimit` filter: one token bucket per Envoy, shared by its workers.
#[derive(Clone, Copy, Debug)]
pub struct LocalRateLimit {
    pub max_tokens: u64,
    pub tokens_per_fill: u64,
    pub fill_interval_s: u64,
}

impl EnvoySpec {
    /// An edge listener with no HTTP filter but the router, one `/` route to the upstream cluster,
    /// no clusters; Envoy's defaults elsewhere (`use_remote_address: false`).
    pub fn empty() -> EnvoySpec {
        EnvoySpec {
            listener_name: "edge".to_string(),
            listen_address: "127.0.0.1".to_string(),
            plugin_config: None,
            module_name: "tollgate".to_string(),
            bare_module: false,
            failure_policy: None,
            fail_open: false,
            dynamic_module: None,
            native: native_from_env(),
            native_rls: None,
            local_ratelimit: None,
            extra_http_filters: Vec::new(),
            first_http_filters: Vec::new(),
            extra_clusters: Vec::new(),
            virtual_host_name: "all".to_string(),
            virtual_host_extra: None,
            routes: vec![Route::upstream("/", None)],
            request_headers: Vec::new(),
            access_log: None,
            use_remote_address: false,
            xff_num_trusted_hops: 0,
            service_cluster: "tollgate".to_string(),
            service_host: None,
            service_ports: Vec::new(),
            service_http2: true,
            service_health_check: None,
            upstream_cluster: "upstream".to_string(),
            upstream_host: None,
            upstream_ports: Vec::new(),
            connect_timeout_ms: 250,
            upstream_connect_timeout_ms: None,
            stats_flush_interval_s: None,
            extra_listeners: Vec::new(),
            notes: Vec::new(),
            concurrency: 2,
            log_level: "wasm:debug,dynamic_modules:debug".to_string(),
            base_log_level: "info".to_string(),
            extra_args: Vec::new(),
        }
    }

    /// What a test usually runs: the Tollgate filter with `plugin_config` (if any), the service on
    /// `service_port`, the upstream on `upstream_port` behind a `/` route with a 5 s timeout, an
    /// edge proxy (`use_remote_address: true`), 1 s connect timeouts, debug logs of the module.
    pub fn new(plugin_config: Option<String>, service_port: u16, upstream_port: u16) -> EnvoySpec {
        EnvoySpec {
            plugin_config,
            routes: vec![Route::upstream("/", Some(5))],
            use_remote_address: true,
            service_ports: vec![service_port],
            upstream_ports: vec![upstream_port],
            connect_timeout_ms: 1000,
            ..EnvoySpec::empty()
        }
    }

    /// For an Envoy of a fleet under load (thousands of requests a second) behind a load balancer:
    /// quiet logs, quick connect failures (250 ms), `use_remote_address: false`.
    pub fn under_load(mut self) -> EnvoySpec {
        self.base_log_level = "warn".to_string();
        self.log_level = "wasm:warn".to_string();
        self.connect_timeout_ms = 250;
        self.use_remote_address = false;
        self
    }

    /// Every route answered by Envoy itself with 200 and `body` (no upstream needed).
    pub fn answer_directly(&mut self, body: &str) {
        self.routes = vec![Route::direct("/", body)];
    }

    /// The static bootstrap: admin, the edge listener (and any extra ones), the clusters.
    pub fn yaml(&self, wasm: &Path, listen_port: u16, admin_port: u16) -> String {
        let mut listeners = item(&self.listener(wasm, listen_port));
        for l in &self.extra_listeners {
            listeners.push_str(&item(l));
        }
        let clusters = self.clusters();
        let clusters = if clusters.is_empty() {
            String::new()
        } else {
            format!("  clusters:\n{}", indent(&clusters, 2))
        };
        format!(
            "{file}{admin}{flush}static_resources:\n  listeners:\n{listeners}{clusters}",
            file = self.note(Note::File),
            admin = admin(admin_port),
            flush = self
                .stats_flush_interval_s
                .map(|s| format!("stats_flush_interval: {s}s\n"))
                .unwrap_or_default(),
            listeners = indent(&listeners, 2),
        )
    }

    /// A bootstrap whose listeners come from the LDS file `lds` (watched through `lds_dir`, where a
    /// push renames the new file over it); the clusters stay static.
    pub fn lds_bootstrap(&self, admin_port: u16, lds: &Path, lds_dir: &Path) -> String {
        format!(
            "node: {{id: tollgate-test, cluster: tollgate-test}}\n{admin}static_resources:\n  \
             clusters:\n{clusters}dynamic_resources:\n  lds_config:\n    resource_api_version: V3\n    \
             path_config_source:\n      path: {lds}\n      watched_directory: {{path: {lds_dir}}}\n",
            admin = admin(admin_port),
            clusters = indent(&self.clusters(), 2),
            lds = lds.display(),
            lds_dir = lds_dir.display(),
        )
    }

    /// The LDS file holding the edge listener.
    pub fn lds_resource(&self, wasm: &Path, listen_port: u16) -> String {
        format!(
            "resources:\n- \"@type\": type.googleapis.com/envoy.config.listener.v3.Listener\n{}",
            indent(&self.listener(wasm, listen_port), 2)
        )
    }

    /// The edge listener (a mapping at column 0).
    pub fn listener(&self, wasm: &Path, listen_port: u16) -> String {
        let routes: String = self.routes.iter().map(|r| item(&self.route(r))).collect();
        let access_log = match &self.access_log {
            Some(path) => format!(
                "access_log:\n- name: envoy.access_loggers.file\n  typed_config:\n    \"@type\": \
                 type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog\n    \
                 path: {path}\n    log_format: {{text_format_source: {{inline_string: \
                 \"%START_TIME(%s.%3f)% %RESPONSE_CODE%\\n\"}}}}\n",
                path = quote(path)
            ),
            None => String::new(),
        };
        let hops = match self.xff_num_trusted_hops {
            0 => String::new(),
            n => format!("xff_num_trusted_hops: {n}\n"),
        };
        let manager = format!(
            "\"@type\": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager\n\
             stat_prefix: {name}\n{note}use_remote_address: {remote}\n{hops}{access_log}\
             route_config:\n  name: {name}\n  virtual_hosts:\n  - name: {vhost}\n    domains: [\"*\"]\n    \
             routes:\n{routes}{vhost_extra}http_filters:\n{filters}",
            name = self.listener_name,
            note = self.note(Note::RemoteAddress),
            remote = self.use_remote_address,
            vhost = self.virtual_host_name,
            routes = indent(&routes, 4),
            vhost_extra = indent(self.virtual_host_extra.as_deref().unwrap_or(""), 4),
            filters = self.http_filters(wasm),
        );
        format!(
            "name: {name}\naddress: {{socket_address: {{address: {address}, port_value: {listen_port}}}}}\n\
             filter_chains:\n- filters:\n  - name: envoy.filters.network.http_connection_manager\n    \
             typed_config:\n{manager}",
            name = self.listener_name,
            address = self.listen_address,
            manager = indent(&manager, 6),
        )
    }

    /// One route (a mapping at column 0).
    fn route(&self, r: &Route) -> String {
        let mut out = comment(r.note.as_deref().unwrap_or(""));
        let _ = writeln!(out, "match: {{prefix: {}}}", quote(&r.prefix));
        match &r.action {
            Action::Upstream { timeout_s } => {
                let mut fields = format!("cluster: {}", self.upstream_cluster);
                if let Some(t) = timeout_s {
                    let _ = write!(fields, ", timeout: {t}s");
                }
                if let Some(t) = r.max_stream_duration_s {
                    let _ = write!(
                        fields,
                        ", max_stream_duration: {{max_stream_duration: {t}s}}"
                    );
                }
                if let Some(rls) = self.native_rls.as_ref().filter(|r| !r.per_route) {
                    let _ = write!(fields, ", rate_limits: {}", rls.rate_limits);
                }
                let _ = writeln!(out, "route: {{{fields}}}");
                if !self.request_headers.is_empty() {
                    out.push_str("request_headers_to_add:\n");
                    for (k, v) in &self.request_headers {
                        let _ =
                            writeln!(out, "- header: {{key: {}, value: {}}}", quote(k), quote(v));
                    }
                }
            }
            Action::Direct { status, body } => {
                let _ = writeln!(
                    out,
                    "direct_response: {{status: {status}, body: {{inline_string: {}}}}}",
                    quote(body)
                );
            }
        }
        if !r.response_headers.is_empty() {
            out.push_str("response_headers_to_add:\n");
            for (k, v) in &r.response_headers {
                let _ = writeln!(
                    out,
                    "- header: {{key: {}, value: {}}}\n  append_action: OVERWRITE_IF_EXISTS_OR_ADD",
                    quote(k),
                    quote(v)
                );
            }
        }
        let per_route = self
            .native_rls
            .as_ref()
            .filter(|rls| rls.per_route && matches!(r.action, Action::Upstream { .. }));
        if r.skip_module || per_route.is_some() {
            out.push_str("typed_per_filter_config:\n");
        }
        if r.skip_module {
            let _ = write!(
                out,
                "  {}:\n    \"@type\": type.googleapis.com/envoy.config.route.v3.FilterConfig\n    \
                 disabled: true\n",
                self.filter_name()
            );
        }
        if let Some(rls) = per_route {
            let _ = writeln!(
                out,
                "  envoy.filters.http.ratelimit:\n    \"@type\": \
                 type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimitPerRoute\n    \
                 rate_limits: {}",
                rls.rate_limits
            );
        }
        out
    }

    /// The edge listener's HTTP filters (a list at column 0): the first filters, the wasm filter,
    /// the dynamic module, the native ratelimit filter, `local_ratelimit`, the extra filters, the
    /// router, in that order (those present).
    pub fn http_filters(&self, wasm: &Path) -> String {
        let mut filters = self.first_http_filters.clone();
        if self.loads_module() {
            filters.push(self.wasm_filter(wasm));
        }
        if let Some(m) = &self.dynamic_module {
            filters.push(m.filter());
        }
        if let Some(rls) = &self.native_rls {
            let metadata = match &rls.token {
                Some(t) => format!(
                    "\n      initial_metadata: [{{key: authorization, value: \"Bearer {t}\"}}]"
                ),
                None => String::new(),
            };
            let x_headers = if rls.x_ratelimit_headers {
                "\n  enable_x_ratelimit_headers: DRAFT_VERSION_03"
            } else {
                ""
            };
            filters.push(format!(
                r#"name: envoy.filters.http.ratelimit
typed_config:
  "@type": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit
  domain: {domain}
  failure_mode_deny: {deny}
  timeout: {timeout}{x_headers}
  rate_limit_service:
    transport_api_version: V3
    grpc_service:
      envoy_grpc: {{cluster_name: {cluster}}}
      timeout: {timeout}{metadata}
"#,
                domain = quote(&rls.domain),
                deny = rls.failure_mode_deny,
                timeout = seconds(rls.timeout_ms),
                cluster = quote(&self.service_cluster),
            ));
        }
        if let Some(l) = &self.local_ratelimit {
            filters.push(format!(
                r#"name: envoy.filters.http.local_ratelimit
typed_config:
  "@type": type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit
  stat_prefix: local_rate_limit
  token_bucket: {{max_tokens: {}, tokens_per_fill: {}, fill_interval: {}s}}
  filter_enabled: {{default_value: {{numerator: 100, denominator: HUNDRED}}, runtime_key: local_rate_limit_enabled}}
  filter_enforced: {{default_value: {{numerator: 100, denominator: HUNDRED}}, runtime_key: local_rate_limit_enforced}}
"#,
                l.max_tokens, l.tokens_per_fill, l.fill_interval_s
            ));
        }
        filters.extend(self.extra_http_filters.iter().cloned());
        filters.push(
            "name: envoy.filters.http.router\ntyped_config: {\"@type\": \
             type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}\n"
                .to_string(),
        );
        filters.iter().map(|f| item(f)).collect()
    }

    /// The command line of `envoy` running the bootstrap file `config` as this spec says (its
    /// workers, log levels and extra arguments; no hot restart).
    pub fn command(&self, envoy: &Path, config: &Path) -> Command {
        let mut cmd = Command::new(envoy);
        cmd.arg("-c")
            .arg(config)
            .args(["--concurrency", &self.concurrency.to_string()])
            .arg("--disable-hot-restart")
            .args(["--log-level", &self.base_log_level])
            .args(["--component-log-level", &self.log_level])
            .args(&self.extra_args);
        if let Some(dir) = self.native.as_deref().and_then(Path::parent) {
            cmd.env("ENVOY_DYNAMIC_MODULES_SEARCH_PATH", dir);
        }
        cmd
    }

    /// The edge listener runs the wasm filter: with a plugin configuration, or bare.
    pub fn loads_module(&self) -> bool {
        self.plugin_config.is_some() || self.bare_module
    }

    /// The Tollgate filter's name in the chain (what a route's per-filter configuration names).
    pub fn filter_name(&self) -> &'static str {
        if self.native.is_some() {
            "tollgate"
        } else {
            "envoy.filters.http.wasm"
        }
    }

    /// The Tollgate filter as the dynamic module `library`, with the plugin configuration as its
    /// filter configuration and its metrics under the wasm build's names (`wasmcustom.`).
    fn native_filter(&self, library: &Path) -> String {
        let name = library
            .file_stem()
            .and_then(|s| s.to_str())
            .and_then(|s| s.strip_prefix("lib"))
            .unwrap_or("tollgate");
        let mut config = format!(
            "dynamic_module_config: {{name: {}, do_not_close: true, metrics_namespace: wasmcustom}}\nfilter_name: tollgate\n",
            quote(name)
        );
        if let Some(json) = &self.plugin_config {
            let _ = write!(
                config,
                "{note}filter_config:\n  \"@type\": type.googleapis.com/google.protobuf.StringValue\n  \
                 value: |\n{json}",
                note = self.note(Note::Configuration),
                json = indent(json, 4),
            );
        }
        format!(
            "name: tollgate\ntyped_config:\n  \"@type\": \
             type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter\n{}",
            indent(&config, 2)
        )
    }

    /// The wasm filter running `wasm`, with the plugin configuration if there is one (or the
    /// native build, if the spec says so).
    fn wasm_filter(&self, wasm: &Path) -> String {
        if let Some(library) = &self.native {
            return self.native_filter(library);
        }
        let mut config = format!(
            "name: {name}\nvm_config:\n  vm_id: {name}\n  runtime: envoy.wasm.runtime.v8\n  \
             code: {{local: {{filename: {wasm}}}}}\n",
            name = self.module_name,
            wasm = quote(&wasm.display().to_string()),
        );
        if self.failure_policy.is_some() || self.fail_open {
            config.push_str(&self.note(Note::ModuleFailure));
        }
        if let Some(p) = &self.failure_policy {
            let _ = writeln!(config, "failure_policy: {p}");
        }
        if self.fail_open {
            config.push_str("fail_open: true\n");
        }
        if let Some(json) = &self.plugin_config {
            let _ = write!(
                config,
                "{note}configuration:\n  \"@type\": type.googleapis.com/google.protobuf.StringValue\n  \
                 value: |\n{json}",
                note = self.note(Note::Configuration),
                json = indent(json, 4),
            );
        }
        format!(
            "name: envoy.filters.http.wasm\ntyped_config:\n  \"@type\": \
             type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm\n  config:\n{}",
            indent(&config, 4)
        )
    }

    /// The clusters (a list at column 0): the service's, then the upstream, those with endpoints.
    pub fn clusters(&self) -> String {
        let mut out = String::new();
        if !self.service_ports.is_empty() {
            let mut extra = String::new();
            if self.service_http2 {
                extra.push_str(HTTP2);
            }
            if let Some(path) = &self.service_health_check {
                let _ = write!(
                    extra,
                    "{}health_checks:\n- timeout: 1s\n  interval: 5s\n  unhealthy_threshold: 2\n  \
                     healthy_threshold: 1\n  http_health_check: {{path: {path}}}\n",
                    self.note(Note::HealthChecks),
                    path = quote(path)
                );
            }
            out.push_str(&self.note(Note::ServiceCluster));
            out.push_str(&item(&cluster(
                &self.service_cluster,
                self.service_host.as_deref(),
                &self.service_ports,
                self.connect_timeout_ms,
                &extra,
            )));
        }
        if !self.upstream_ports.is_empty() {
            out.push_str(&item(&cluster(
                &self.upstream_cluster,
                self.upstream_host.as_deref(),
                &self.upstream_ports,
                self.upstream_connect_timeout_ms
                    .unwrap_or(self.connect_timeout_ms),
                "",
            )));
        }
        for c in &self.extra_clusters {
            out.push_str(&item(c));
        }
        out
    }

    /// The comment lines of `note` (none when the spec has none there).
    fn note(&self, place: Note) -> String {
        self.notes
            .iter()
            .filter(|(p, _)| *p == place)
            .map(|(_, text)| comment(text))
            .collect()
    }
}

const HTTP2: &str = r#"typed_extension_protocol_options:
  envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
    "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
    explicit_http_config: {http2_protocol_options: {}}
"#;

/// A cluster of `host` (127.0.0.1 and STATIC when `None`, else STRICT_DNS) on `ports`, taken in
/// turn (a mapping at column 0), followed by `extra` fields.
pub fn cluster(
    name: &str,
    host: Option<&str>,
    ports: &[u16],
    connect_timeout_ms: u64,
    extra: &str,
) -> String {
    let (kind, address) = match host {
        None => ("STATIC\n", "127.0.0.1"),
        Some(h) => ("STRICT_DNS\ndns_lookup_family: V4_PREFERRED\n", h),
    };
    let endpoints: String = ports
        .iter()
        .map(|p| {
            format!(
                "    - endpoint: {{address: {{socket_address: {{address: {address}, port_value: {p}}}}}}}\n"
            )
        })
        .collect();
    format!(
        "name: {name}\ntype: {kind}connect_timeout: {timeout}\nload_assignment:\n  \
         cluster_name: {name}\n  endpoints:\n  - lb_endpoints:\n{endpoints}{extra}",
        name = quote(name),
        timeout = seconds(connect_timeout_ms),
    )
}

fn admin(port: u16) -> String {
    format!("admin:\n  address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}\n")
}

/// A duration in milliseconds as Envoy's seconds (`0.25s`, `2s`).
fn seconds(ms: u64) -> String {
    format!("{}s", ms as f64 / 1000.0)
}

/// `text` as YAML comment lines at column 0 (nothing when empty).
fn comment(text: &str) -> String {
    text.lines()
        .map(|l| {
            if l.is_empty() {
                "#\n".to_string()
            } else {
                format!("# {l}\n")
            }
        })
        .collect()
}

/// `s` as a YAML double-quoted scalar when it needs quoting (a JSON string is one), else as is.
pub fn quote(s: &str) -> String {
    // Words YAML 1.1 reads as booleans or null stay quoted; so does anything starting with a digit.
    const KEYWORDS: [&str; 10] = [
        "true", "false", "yes", "no", "on", "off", "y", "n", "null", "~",
    ];
    let plain = s.starts_with(|c: char| c.is_ascii_alphabetic() || c == '/' || c == '.')
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "._-/|".contains(c))
        && !KEYWORDS.contains(&s.to_ascii_lowercase().as_str());
    if plain {
        return s.to_string();
    }
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// `text` with every non-empty line indented by `n` spaces, each line ending in a newline.
pub fn indent(text: &str, n: usize) -> String {
    text.lines()
        .map(|l| {
            if l.is_empty() {
                "\n".to_string()
            } else {
                format!("{:n$}{l}\n", "")
            }
        })
        .collect()
}

/// The mapping `text` (at column 0) as an item of a YAML list; comment lines before the mapping
/// stay above the item.
fn item(text: &str) -> String {
    let split = text
        .lines()
        .take_while(|l| l.starts_with('#'))
        .map(|l| l.len() + 1)
        .sum::<usize>()
        .min(text.len());
    let (comments, body) = text.split_at(split);
    let body = indent(body, 2);
    format!("{comments}- {}", body.get(2..).unwrap_or(""))
}

/// The configuration with every `filename: <...>.wasm` pointing at the module under test, so
/// validate mode can load it wherever the real deployment keeps it.
pub fn with_module(yaml: &str, wasm: &Path) -> String {
    let mut out = String::new();
    for line in yaml.split_inclusive('\n') {
        let Some(at) = line.find("filename:") else {
            out.push_str(line);
            continue;
        };
        let start = at + "filename:".len();
        let rest = &line[start..];
        let lead = rest.len() - rest.trim_start().len();
        let token_end = rest[lead..]
            .find(['}', ',', '\n', ' '])
            .map(|i| lead + i)
            .unwrap_or(rest.len());
        let token = rest[lead..token_end].trim_matches(['"', '\'']);
        if token.ends_with(".wasm") {
            out.push_str(&line[..start]);
            out.push_str(&format!(" \"{}\"", wasm.display()));
            out.push_str(&rest[token_end..]);
        } else {
            out.push_str(line);
        }
    }
    out
}

/// `envoy --mode validate` of the file `config`: Ok, or Err with Envoy's output.
pub fn validate(envoy: &Path, config: &Path) -> Result<(), String> {
    let out = std::process::Command::new(envoy)
        .args([
            "--mode",
            "validate",
            "--disable-hot-restart",
            "--log-level",
            "warn",
            "-c",
        ])
        .arg(config)
        .output()
        .expect("run envoy --mode validate");
    let t = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if out.status.success() && t.contains("OK") {
        Ok(())
    } else {
        Err(t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoting_leaves_plain_words_and_escapes_the_rest() {
        assert_eq!(quote("tollgate"), "tollgate");
        assert_eq!(quote("/v1/"), "/v1/");
        assert_eq!(quote("outbound|8081||tollgate"), "outbound|8081||tollgate");
        assert_eq!(quote("a b"), "\"a b\"");
        assert_eq!(quote("say \"hi\"\n"), "\"say \\\"hi\\\"\\n\"");
        assert_eq!(quote(""), "\"\"");
        assert_eq!(quote("-x"), "\"-x\"");
        assert_eq!(quote("1"), "\"1\"");
        assert_eq!(quote("on"), "\"on\"");
    }

    #[test]
    fn an_item_keeps_its_comments_above_it() {
        assert_eq!(item("# c\na: 1\nb: 2\n"), "# c\n- a: 1\n  b: 2\n");
        assert_eq!(item("a: 1\n"), "- a: 1\n");
    }

    #[test]
    fn clusters_only_with_endpoints() {
        let spec = EnvoySpec::empty();
        assert_eq!(spec.clusters(), "");
        let yaml = spec.yaml(Path::new("m.wasm"), 1, 2);
        assert!(!yaml.contains("clusters:"), "{yaml}");
        let spec = EnvoySpec::new(None, 3, 4);
        let clusters = spec.clusters();
        assert!(clusters.contains("port_value: 3") && clusters.contains("port_value: 4"));
        assert!(clusters.contains("http2_protocol_options"));
    }

    #[test]
    fn a_dynamic_module_comes_first_with_its_configuration_as_a_string() {
        let mut spec = EnvoySpec::empty();
        spec.answer_directly("ok");
        spec.dynamic_module = Some(DynamicModule {
            name: "dm_probe".to_string(),
            filter_name: "probe".to_string(),
            filter_config: Some("stream".to_string()),
        });
        let filters = spec.http_filters(Path::new("m.wasm"));
        assert_eq!(
            filters,
            "- name: envoy.filters.http.dynamic_modules\n  typed_config:\n    \"@type\": \
             type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter\n    \
             dynamic_module_config: {name: dm_probe}\n    filter_name: probe\n    filter_config:\n      \
             \"@type\": type.googleapis.com/google.protobuf.StringValue\n      value: stream\n\
             - name: envoy.filters.http.router\n  typed_config: {\"@type\": \
             type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}\n"
        );
        assert!(!spec.loads_module(), "no wasm filter beside it");
    }
}
