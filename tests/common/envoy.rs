//! The one generator of Envoy configuration in the tests: [`EnvoySpec`] says what the edge listener
//! holds (the Tollgate wasm filter with a plugin configuration, Envoy's own ratelimit filter calling
//! the service's RLS endpoint, or filters from a checked-in file), and the clusters: the service's
//! (HTTP/2 unless told otherwise, one endpoint per replica) and the `upstream`. It renders a static
//! bootstrap ([`EnvoySpec::yaml`]) or, for configuration pushes, a bootstrap that reads the listener
//! from an LDS file ([`EnvoySpec::lds_bootstrap`], [`EnvoySpec::lds_resource`]).
//!
//! Every piece is written at column 0 and indented where it is placed, so each is written once.

use std::path::Path;

/// What the generated Envoy configuration contains.
#[derive(Clone, Debug)]
pub struct EnvoySpec {
    /// The plugin configuration (JSON). `None`: no Tollgate filter on the edge listener.
    pub plugin_config: Option<String>,
    /// The wasm filter's `failure_policy` (e.g. `FAIL_RELOAD`); `None`: Envoy's default.
    pub failure_policy: Option<String>,
    /// Envoy's own ratelimit filter, after the Tollgate filter if there is one.
    pub native_rls: Option<NativeRls>,
    /// More HTTP filters before the router, each a YAML mapping at column 0 (`name:`,
    /// `typed_config:`), e.g. taken from a checked-in file.
    pub extra_http_filters: Vec<String>,
    /// More fields of the virtual host, as YAML at column 0 (e.g. `rate_limits:` from a checked-in
    /// file).
    pub virtual_host_extra: Option<String>,
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
    /// for [`super::Upstream::start_counting_by`]).
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

/// Envoy's native rate limit filter (`envoy.filters.http.ratelimit`) as a client of the service's
/// RLS v3 endpoint, over the service cluster. A service failure is a 500 (`failure_mode_deny`),
/// never a pass, so a test sees it.
#[derive(Clone, Debug)]
pub struct NativeRls {
    /// The filter's `domain`.
    pub domain: String,
    /// The route's `rate_limits`, as flow YAML (JSON is fine), e.g.
    /// `[{actions: [{generic_key: {descriptor_value: a}}]}]`.
    pub rate_limits: String,
    /// Sent as `authorization: Bearer <token>` in the gRPC service's `initial_metadata`.
    pub token: Option<String>,
}

impl EnvoySpec {
    pub fn new(plugin_config: Option<String>, service_port: u16, upstream_port: u16) -> EnvoySpec {
        EnvoySpec {
            plugin_config,
            failure_policy: None,
            native_rls: None,
            extra_http_filters: Vec::new(),
            virtual_host_extra: None,
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

    /// For an Envoy of a fleet under load (thousands of requests a second) behind a load balancer:
    /// quiet logs, quick connect failures (250 ms), `use_remote_address: false`.
    pub fn under_load(mut self) -> EnvoySpec {
        self.base_log_level = "warn".to_string();
        self.log_level = "wasm:warn".to_string();
        self.connect_timeout_ms = 250;
        self.use_remote_address = false;
        self
    }

    /// The static bootstrap: admin, the edge listener, the clusters.
    pub fn yaml(&self, wasm: &Path, listen_port: u16, admin_port: u16) -> String {
        format!(
            "{admin}static_resources:\n  listeners:\n{listener}  clusters:\n{clusters}",
            admin = admin(admin_port),
            listener = indent(&item(&self.listener(wasm, listen_port)), 2),
            clusters = indent(&self.clusters(), 2),
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
        let route = if self.direct_response {
            "direct_response: {status: 200, body: {inline_string: \"direct\\n\"}}".to_string()
        } else {
            let rate_limits = match &self.native_rls {
                Some(rls) => format!(", rate_limits: {}", rls.rate_limits),
                None => String::new(),
            };
            format!("route: {{cluster: upstream, timeout: 5s{rate_limits}}}")
        };
        let mut route_extra = String::new();
        if !self.request_headers.is_empty() {
            route_extra.push_str("request_headers_to_add:\n");
            for (k, v) in &self.request_headers {
                route_extra.push_str(&format!("- header: {{key: \"{k}\", value: \"{v}\"}}\n"));
            }
        }
        format!(
            r#"name: edge
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
            {route}
{route_extra}{vhost_extra}      http_filters:
{filters}"#,
            use_remote_address = self.use_remote_address,
            xff_num_trusted_hops = self.xff_num_trusted_hops,
            route_extra = indent(&route_extra, 12),
            vhost_extra = indent(self.virtual_host_extra.as_deref().unwrap_or(""), 10),
            filters = indent(&self.http_filters(wasm), 6),
        )
    }

    /// The edge listener's HTTP filters (a list at column 0): Tollgate, the native ratelimit
    /// filter, the extra filters, the router, in that order (those present).
    pub fn http_filters(&self, wasm: &Path) -> String {
        let mut filters = Vec::new();
        if let Some(json) = &self.plugin_config {
            let failure_policy = match &self.failure_policy {
                Some(p) => format!("\n    failure_policy: {p}"),
                None => String::new(),
            };
            filters.push(format!(
                r#"name: envoy.filters.http.wasm
typed_config:
  "@type": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
  config:
    name: tollgate
    vm_config:
      vm_id: tollgate
      runtime: envoy.wasm.runtime.v8
      code: {{local: {{filename: "{wasm}"}}}}{failure_policy}
    configuration:
      "@type": type.googleapis.com/google.protobuf.StringValue
      value: |
{json}"#,
                wasm = wasm.display(),
                json = indent(json, 8),
            ));
        }
        if let Some(rls) = &self.native_rls {
            let metadata = match &rls.token {
                Some(t) => format!(
                    "\n      initial_metadata: [{{key: authorization, value: \"Bearer {t}\"}}]"
                ),
                None => String::new(),
            };
            filters.push(format!(
                r#"name: envoy.filters.http.ratelimit
typed_config:
  "@type": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit
  domain: "{domain}"
  failure_mode_deny: true
  timeout: 2s
  rate_limit_service:
    transport_api_version: V3
    grpc_service:
      envoy_grpc: {{cluster_name: "{cluster}"}}
      timeout: 2s{metadata}
"#,
                domain = rls.domain,
                cluster = self.service_cluster,
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

    /// The clusters (a list at column 0): the service's, then `upstream`.
    pub fn clusters(&self) -> String {
        let connect_timeout = format!("{}s", self.connect_timeout_ms as f64 / 1000.0);
        item(&cluster(
            &self.service_cluster,
            &self.service_ports,
            &connect_timeout,
            self.service_http2,
        )) + &item(&cluster(
            "upstream",
            &[self.upstream_port],
            &connect_timeout,
            false,
        ))
    }
}

/// A STATIC cluster of 127.0.0.1 endpoints (a mapping at column 0), over HTTP/2 if `http2`.
fn cluster(name: &str, ports: &[u16], connect_timeout: &str, http2: bool) -> String {
    let endpoints: String = ports
        .iter()
        .map(|p| {
            format!(
                "    - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {p}}}}}}}\n"
            )
        })
        .collect();
    let protocol = if http2 {
        r#"typed_extension_protocol_options:
  envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
    "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
    explicit_http_config: {http2_protocol_options: {}}
"#
    } else {
        ""
    };
    format!(
        "name: \"{name}\"\ntype: STATIC\nconnect_timeout: {connect_timeout}\nload_assignment:\n  \
         cluster_name: \"{name}\"\n  endpoints:\n  - lb_endpoints:\n{endpoints}{protocol}"
    )
}

fn admin(port: u16) -> String {
    format!("admin:\n  address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}\n")
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

/// The mapping `text` (at column 0) as an item of a YAML list.
fn item(text: &str) -> String {
    let body = indent(text, 2);
    format!("- {}", body.get(2..).unwrap_or(""))
}
