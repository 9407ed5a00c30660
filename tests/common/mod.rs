//! End-to-end harness: real Redis, the real `tollgate-server` and real Envoy with the real module, each a
//! child process on free 127.0.0.1 ports, configured from files in a per-test temporary directory.
//!
//! Layout:
//! - [`Components`]: where the binaries are (env vars with workspace defaults; missing = test failure).
//! - [`Redis`], [`Service`], [`Envoy`]: started and waited for (PING, `/healthz`, admin `/ready`), killed
//!   by PID on drop. Their logs go to files; when a test panics the logs are printed. Dropping an
//!   [`Envoy`] fails the test if the module panicked or trapped in it. Redis and the service can be
//!   started again on the port they had (`start_on`), the service under a shifted clock
//!   (`start_skewed`, libfaketime), several Envoys at once (`Envoy::start_all`).
//! - [`EnvoySpec`]: the generated Envoy configuration (edge listener with Tollgate, the service
//!   cluster over HTTP/2 with one or more endpoints, an `upstream` cluster to a test-side server).
//! - [`Upstream`]: a small HTTP/1.1 server in the test process that counts what reached it, also per
//!   value of a request header (e.g. one an Envoy adds, to tell which Envoy admitted what).
//! - [`Gate`]: a TCP listener in the test process in front of the service that forwards, refuses
//!   (accept then close) or black-holes (accept, read, never answer), and counts connections.
//! - [`Client`]: requests through Envoy (ureq) returning status, headers and body.
//! - [`Stack`]: Redis + service + upstream + Envoy for one plugin configuration, the usual test setup.
//! - [`config`]: plugin configurations as JSON, and `both_transports!` (one test per transport).
#![allow(dead_code)]

pub mod config;
pub mod faults;
pub mod loopback;
pub mod push;

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

/// How long a component may take to become ready before the test fails.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

// ---------------------------------------------------------------------------------------------
// Components and scratch space

/// Paths of the real components the end-to-end tests run.
#[derive(Clone, Debug)]
pub struct Components {
    pub envoy: PathBuf,
    pub redis_server: PathBuf,
    pub server: PathBuf,
    pub wasm: PathBuf,
}

/// The workspace root (the root package is the workspace root).
pub fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn component(var: &str, default_rel: &str) -> PathBuf {
    required_component(
        var,
        default_rel,
        &format!(
            ". Run `make build` (and `make tools`), or set {var}. \
             End-to-end tests need the real component and do not skip."
        ),
    )
}

/// The file named by env var `var`, else `default_rel` under the workspace root. A missing file
/// fails the test with "`var`: `path` is missing`remedy`".
pub fn required_component(var: &str, default_rel: &str, remedy: &str) -> PathBuf {
    let path = std::env::var_os(var)
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join(default_rel));
    assert!(
        path.is_file(),
        "{var}: {} is missing{remedy}",
        path.display()
    );
    path
}

impl Components {
    /// Resolves every component, failing the test with a clear message if one is missing.
    pub fn get() -> Components {
        Components {
            envoy: component("TOLLGATE_ENVOY", ".tools/envoy"),
            redis_server: component("TOLLGATE_REDIS_SERVER", ".tools/redis-server"),
            server: component("TOLLGATE_SERVER", "dist/tollgate-server"),
            wasm: component("TOLLGATE_WASM", "dist/tollgate.wasm"),
        }
    }
}

/// libfaketime, for running a service under a shifted clock (Debian package `faketime`, installed by
/// `scripts/tools.sh`; `TOLLGATE_LIBFAKETIME` overrides the path). Missing = test failure.
pub fn libfaketime() -> PathBuf {
    if let Some(p) = std::env::var_os("TOLLGATE_LIBFAKETIME") {
        return PathBuf::from(p);
    }
    let candidates = [
        "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1",
        "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
        "/usr/lib/aarch64-linux-gnu/faketime/libfaketimeMT.so.1",
        "/usr/lib/faketime/libfaketimeMT.so.1",
    ];
    candidates
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "libfaketime is missing (looked in {candidates:?}): run `bash scripts/tools.sh` \
                 (Debian package faketime) or set TOLLGATE_LIBFAKETIME"
            )
        })
}

/// A scratch directory, removed on drop unless the test is failing (its logs are then kept).
pub struct TempDir {
    path: PathBuf,
}

impl TempDir {
    pub fn new(label: &str) -> TempDir {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let n = SEQ.fetch_add(1, Ordering::Relaxed);
        let path =
            std::env::temp_dir().join(format!("tollgate-e2e-{}-{}-{label}", std::process::id(), n));
        let _ = fs::remove_dir_all(&path);
        fs::create_dir_all(&path).expect("create temp dir");
        TempDir { path }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A new log file path `<stem>-<n>.log`: a component started again on the same port does not
    /// overwrite the log of its predecessor.
    pub fn log_file(&self, stem: &str) -> PathBuf {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let n = SEQ.fetch_add(1, Ordering::Relaxed);
        self.path.join(format!("{stem}-{n}.log"))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if thread::panicking() {
            eprintln!("(test files kept in {})", self.path.display());
        } else {
            let _ = fs::remove_dir_all(&self.path);
        }
    }
}

/// A free 127.0.0.1 port: bound, then released for the child to take. Ports are handed out from a
/// process-wide sequence of OS-assigned ports; the small window before the child binds is accepted.
/// A port is never handed out twice by one test process; a clash with another process (the bind fails
/// and the child exits) is retried by the `start` functions.
pub fn free_port() -> u16 {
    static HANDED: Mutex<Vec<u16>> = Mutex::new(Vec::new());
    for _ in 0..100 {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
        let port = l.local_addr().expect("local addr").port();
        let mut handed = HANDED.lock().unwrap_or_else(|e| e.into_inner());
        if !handed.contains(&port) {
            handed.push(port);
            return port;
        }
    }
    panic!("no free port found");
}

/// How many times a component is started on a new port after it exited at start (port clash).
const START_ATTEMPTS: usize = 3;

/// A 127.0.0.1 port where nothing listens (connections are refused).
pub fn closed_port() -> u16 {
    free_port()
}

// ---------------------------------------------------------------------------------------------
// Child processes

/// A child process killed by PID on drop; its combined output goes to `log`.
pub struct Proc {
    pub name: String,
    child: Child,
    pub log: PathBuf,
}

impl Proc {
    /// Starts `cmd` with stdin closed and stdout and stderr into `log`.
    pub fn spawn(name: &str, mut cmd: Command, log: PathBuf) -> Proc {
        let out = File::create(&log).expect("create log file");
        let err = out.try_clone().expect("clone log file");
        cmd.stdin(Stdio::null())
            .stdout(Stdio::from(out))
            .stderr(Stdio::from(err));
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name} ({:?}): {e}", cmd.get_program()));
        Proc {
            name: name.to_string(),
            child,
            log,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The exit status if the process has exited.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// The whole log so far.
    pub fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Kills the process (SIGKILL) and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Waits up to `limit` for the process to exit by itself.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if let Some(st) = self.exited() {
                return Some(st);
            }
            thread::sleep(Duration::from_millis(20));
        }
        None
    }

    fn print_log(&self) {
        let text = self.log_text();
        let lines: Vec<&str> = text.lines().collect();
        let start = lines.len().saturating_sub(150);
        eprintln!(
            "----- {} (pid {}) log, last {} lines of {} -----",
            self.name,
            self.child.id(),
            lines.len() - start,
            self.log.display()
        );
        for l in &lines[start..] {
            eprintln!("{l}");
        }
        eprintln!("----- end of {} log -----", self.name);
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
        if thread::panicking() {
            self.print_log();
        }
    }
}

/// Waits for `ready`. `Err(true)` when the process exited first (e.g. its port was taken: worth a
/// retry on another port), panics with the log when it is not ready in time.
pub fn wait_until(
    what: &str,
    proc: &mut Proc,
    mut ready: impl FnMut() -> bool,
) -> Result<(), bool> {
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        if let Some(st) = proc.exited() {
            eprintln!("{what} exited before it was ready: {st}");
            proc.print_log();
            return Err(true);
        }
        if ready() {
            return Ok(());
        }
        if Instant::now() > deadline {
            proc.print_log();
            panic!("{what} not ready after {READY_TIMEOUT:?}");
        }
        thread::sleep(Duration::from_millis(25));
    }
}

// ---------------------------------------------------------------------------------------------
// Redis

/// A private redis-server on a free port, no persistence.
pub struct Redis {
    pub port: u16,
    pub proc: Proc,
}

impl Redis {
    pub fn start(c: &Components, dir: &TempDir) -> Redis {
        for _ in 0..START_ATTEMPTS {
            if let Some(redis) = Redis::launch(c, dir, free_port()) {
                return redis;
            }
        }
        panic!("redis-server did not start in {START_ATTEMPTS} attempts");
    }

    /// Starts Redis on `port` (e.g. the port of one that was stopped: clients reconnect to it).
    pub fn start_on(c: &Components, dir: &TempDir, port: u16) -> Redis {
        Redis::launch(c, dir, port)
            .unwrap_or_else(|| panic!("redis-server did not start on port {port}"))
    }

    /// One start on `port`; None when the process exited before it answered PING.
    fn launch(c: &Components, dir: &TempDir, port: u16) -> Option<Redis> {
        let mut cmd = Command::new(&c.redis_server);
        cmd.args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(dir.path());
        let mut proc = Proc::spawn("redis", cmd, dir.log_file(&format!("redis-{port}")));
        wait_until("redis-server", &mut proc, || redis_ping(port)).ok()?;
        Some(Redis { port, proc })
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Kills Redis (the service then answers 503).
    pub fn stop(&mut self) {
        self.proc.kill();
    }
}

/// PING over a raw socket: true on `+PONG`.
pub fn redis_ping(port: u16) -> bool {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    if s.write_all(b"PING\r\n").is_err() {
        return false;
    }
    let mut buf = [0u8; 16];
    matches!(s.read(&mut buf), Ok(n) if buf[..n].starts_with(b"+PONG"))
}

// ---------------------------------------------------------------------------------------------
// The decision service

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
            if let Some(service) = Service::launch(c, dir, free_port(), redis_url, extra, &[]) {
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
        Service::launch(c, dir, port, redis_url, extra, &[])
            .unwrap_or_else(|| panic!("tollgate-server did not start on port {port}"))
    }

    /// As [`Service::start_with`], with the process's wall clock shifted by `offset` (libfaketime
    /// syntax, e.g. `+3600s`); its monotonic clock is left alone.
    pub fn start_skewed(
        c: &Components,
        dir: &TempDir,
        redis_url: Option<&str>,
        extra: &[&str],
        offset: &str,
    ) -> Service {
        let faketime = libfaketime();
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
            if let Some(service) = Service::launch(c, dir, free_port(), redis_url, extra, &env) {
                return service;
            }
        }
        panic!("tollgate-server (clock {offset}) did not start in {START_ATTEMPTS} attempts");
    }

    /// One start on `port` with `env` added; None when the process exited before `/healthz` answered.
    fn launch(
        c: &Components,
        dir: &TempDir,
        port: u16,
        redis_url: Option<&str>,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Option<Service> {
        let mut cmd = Command::new(&c.server);
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
            .map(|r| r.1)
            .unwrap_or_default()
    }
}

// ---------------------------------------------------------------------------------------------
// Envoy

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
        let (status, body) = http_get(self.admin_port, &format!("/stats?filter={filter}"))
            .expect("envoy admin /stats");
        assert_eq!(status, 200, "admin /stats: {body}");
        parse_stats(&body)
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

/// The prefix Envoy gives the module's stats.
pub const TOLLGATE_STATS: &str = "wasmcustom.tollgate.";

/// Admin `/stats` text as name -> value; lines that are not a plain number (histograms) are skipped.
pub fn parse_stats(text: &str) -> BTreeMap<String, u64> {
    text.lines()
        .filter_map(|l| {
            let (k, v) = l.split_once(": ")?;
            Some((k.trim().to_string(), v.trim().parse().ok()?))
        })
        .collect()
}

/// The Tollgate stats among `stats`, by their names without [`TOLLGATE_STATS`].
pub fn tollgate_stats(stats: BTreeMap<String, u64>) -> BTreeMap<String, u64> {
    stats
        .into_iter()
        .filter_map(|(k, v)| Some((k.strip_prefix(TOLLGATE_STATS)?.to_string(), v)))
        .collect()
}

/// The Tollgate stats of several Envoys, summed name by name.
pub fn tg_total(envoys: &[Envoy]) -> BTreeMap<String, u64> {
    let mut sum: BTreeMap<String, u64> = BTreeMap::new();
    for e in envoys {
        for (k, v) in e.tg_all() {
            *sum.entry(k).or_default() += v;
        }
    }
    sum
}

// ---------------------------------------------------------------------------------------------
// Plain HTTP/1.1 to admin endpoints (no client library needed for these)

/// GET http://127.0.0.1:port/path with a short timeout: (status, body).
pub fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    let (head, body) = http_exchange(port, path)?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    Some((status, body))
}

/// The response head (status line and headers) of GET http://127.0.0.1:port/path.
pub fn http_head(port: u16, path: &str) -> Option<String> {
    http_exchange(port, path).map(|r| r.0)
}

/// One GET on a fresh connection: (head, body), a chunked body joined.
fn http_exchange(port: u16, path: &str) -> Option<(String, String)> {
    let mut s = TcpStream::connect_timeout(
        &format!("127.0.0.1:{port}").parse().ok()?,
        Duration::from_millis(500),
    )
    .ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n"
    )
    .ok()?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).ok()?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n")?;
    let chunked = head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    let body = if chunked {
        dechunk(body)
    } else {
        body.to_string()
    };
    Some((head.to_string(), body))
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        s = rest[n..].trim_start_matches("\r\n");
    }
    out
}

pub fn http_get_status(port: u16, path: &str) -> Option<u16> {
    http_get(port, path).map(|r| r.0)
}

// ---------------------------------------------------------------------------------------------
// Client through Envoy

/// A response as the client sees it.
#[derive(Clone, Debug)]
pub struct Reply {
    pub status: u16,
    /// Lower-case header names; repeated headers joined with ", ".
    pub headers: BTreeMap<String, String>,
    pub body: String,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .get(&name.to_ascii_lowercase())
            .map(String::as_str)
    }
}

impl From<ureq::http::Response<ureq::Body>> for Reply {
    fn from(mut resp: ureq::http::Response<ureq::Body>) -> Reply {
        let status = resp.status().as_u16();
        let mut map: BTreeMap<String, String> = BTreeMap::new();
        for (k, v) in resp.headers() {
            let v = v.to_str().unwrap_or("").to_string();
            map.entry(k.as_str().to_ascii_lowercase())
                .and_modify(|e| {
                    e.push_str(", ");
                    e.push_str(&v)
                })
                .or_insert(v);
        }
        let body = resp.body_mut().read_to_string().unwrap_or_default();
        Reply {
            status,
            headers: map,
            body,
        }
    }
}

/// An HTTP client with keep-alive that never turns a status into an error.
#[derive(Clone)]
pub struct Client {
    agent: ureq::Agent,
}

impl Default for Client {
    fn default() -> Self {
        Client::new()
    }
}

impl Client {
    pub fn new() -> Client {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(10)))
            .build()
            .into();
        Client { agent }
    }

    /// GET `url` with `headers`.
    pub fn get(&self, url: &str, headers: &[(&str, &str)]) -> Reply {
        self.try_get(url, headers)
            .unwrap_or_else(|e| panic!("GET {url} failed: {e}"))
    }

    /// GET `url` with `headers`; `Err` when no HTTP response came (connection, timeout).
    pub fn try_get(&self, url: &str, headers: &[(&str, &str)]) -> Result<Reply, ureq::Error> {
        let mut req = self.agent.get(url);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        req.call().map(Reply::from)
    }

    /// POST `body` to `url` with `headers`.
    pub fn post(&self, url: &str, headers: &[(&str, &str)], body: &[u8]) -> Reply {
        let mut req = self.agent.post(url);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let resp = req
            .send(body)
            .unwrap_or_else(|e| panic!("POST {url} failed: {e}"));
        Reply::from(resp)
    }

    /// `n` sequential GETs, returning the statuses.
    pub fn statuses(&self, url: &str, headers: &[(&str, &str)], n: usize) -> Vec<u16> {
        (0..n).map(|_| self.get(url, headers).status).collect()
    }
}

/// Counts `code` in `statuses`.
pub fn count(statuses: &[u16], code: u16) -> usize {
    statuses.iter().filter(|s| **s == code).count()
}

// ---------------------------------------------------------------------------------------------
// The upstream: counts what reached it

/// A minimal HTTP/1.1 server (keep-alive, a thread per connection) answering 200 "upstream\n" and
/// recording the head of every request it received (the first 10,000), and optionally counting the
/// requests per value of one header.
pub struct Upstream {
    pub port: u16,
    state: Arc<UpstreamState>,
}

struct UpstreamState {
    stop: AtomicBool,
    requests: AtomicU64,
    heads: Mutex<Vec<String>>,
    bodies: Mutex<Vec<Vec<u8>>>,
    /// The header (lower case) whose values are counted, and the counts.
    count_by: Option<String>,
    counts: Mutex<BTreeMap<String, u64>>,
}

impl Upstream {
    pub fn start() -> Upstream {
        Upstream::launch(None)
    }

    /// As [`Upstream::start`], also counting requests per value of `header` ("?" when absent); see
    /// [`Upstream::counts`].
    pub fn start_counting_by(header: &str) -> Upstream {
        Upstream::launch(Some(header.to_ascii_lowercase()))
    }

    fn launch(count_by: Option<String>) -> Upstream {
        let state = Arc::new(UpstreamState {
            stop: AtomicBool::new(false),
            requests: AtomicU64::new(0),
            heads: Mutex::new(Vec::new()),
            bodies: Mutex::new(Vec::new()),
            count_by,
            counts: Mutex::new(BTreeMap::new()),
        });
        let (st, stop) = (state.clone(), state.clone());
        let port = accept_on_free_port(
            "upstream",
            move || stop.stop.load(Ordering::SeqCst),
            move |conn| {
                let st = st.clone();
                thread::spawn(move || serve_upstream(conn, st));
            },
        );
        Upstream { port, state }
    }

    /// Requests received so far.
    pub fn requests(&self) -> u64 {
        self.state.requests.load(Ordering::SeqCst)
    }

    /// The request heads received so far (request line and headers).
    pub fn heads(&self) -> Vec<String> {
        self.state
            .heads
            .lock()
            .map(|h| h.clone())
            .unwrap_or_default()
    }

    /// Requests received so far per value of the header named in [`Upstream::start_counting_by`].
    pub fn counts(&self) -> BTreeMap<String, u64> {
        self.state
            .counts
            .lock()
            .map(|m| m.clone())
            .unwrap_or_default()
    }

    /// The request bodies received so far (those of the first 100 requests).
    pub fn bodies(&self) -> Vec<Vec<u8>> {
        self.state
            .bodies
            .lock()
            .map(|b| b.clone())
            .unwrap_or_default()
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.state.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}

fn serve_upstream(mut conn: TcpStream, st: Arc<UpstreamState>) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(30)));
    let mut buf: Vec<u8> = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        // Read one request head (bodies are skipped by content-length).
        let head_end = loop {
            if let Some(i) = find(&buf, b"\r\n\r\n") {
                break i + 4;
            }
            match conn.read(&mut chunk) {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
            if st.stop.load(Ordering::SeqCst) {
                return;
            }
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
        let body_len: usize = head
            .lines()
            .filter_map(|l| l.split_once(':'))
            .find(|(k, _)| k.trim().eq_ignore_ascii_case("content-length"))
            .and_then(|(_, v)| v.trim().parse().ok())
            .unwrap_or(0);
        while buf.len() < head_end + body_len {
            match conn.read(&mut chunk) {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        let body: Vec<u8> = buf.drain(..head_end + body_len).skip(head_end).collect();
        if let Ok(mut b) = st.bodies.lock() {
            if b.len() < 100 {
                b.push(body);
            }
        }
        st.requests.fetch_add(1, Ordering::SeqCst);
        if let Some(name) = &st.count_by {
            let value = head
                .lines()
                .filter_map(|l| l.split_once(':'))
                .find(|(k, _)| k.trim().eq_ignore_ascii_case(name))
                .map(|(_, v)| v.trim().to_string())
                .unwrap_or_else(|| "?".to_string());
            if let Ok(mut m) = st.counts.lock() {
                *m.entry(value).or_default() += 1;
            }
        }
        if let Ok(mut h) = st.heads.lock() {
            if h.len() < 10_000 {
                h.push(head);
            }
        }
        let body = "upstream\n";
        let resp = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        if conn.write_all(resp.as_bytes()).is_err() {
            return;
        }
    }
}

/// Binds a free 127.0.0.1 port and accepts on a thread of its own, handing each connection to
/// `on_conn` (on that thread) until `stopped` says so. The owner stops it by making `stopped` true,
/// then connecting once to wake the loop.
fn accept_on_free_port(
    what: &str,
    stopped: impl Fn() -> bool + Send + 'static,
    mut on_conn: impl FnMut(TcpStream) + Send + 'static,
) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap_or_else(|e| panic!("bind {what}: {e}"));
    let port = listener.local_addr().expect("addr").port();
    thread::spawn(move || {
        for conn in listener.incoming() {
            if stopped() {
                break;
            }
            let Ok(conn) = conn else { continue };
            on_conn(conn);
        }
    });
    port
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

// ---------------------------------------------------------------------------------------------
// The gate: a controllable TCP listener in front of the service

/// What a [`Gate`] does with a new connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GateMode {
    /// Pipe it to the target port.
    Forward = 0,
    /// Accept, then close at once (the service is "down" but the port is open).
    Refuse = 1,
    /// Accept and read, never answer (a hung service: callouts time out).
    BlackHole = 2,
}

/// A TCP listener on a free port whose behaviour can be switched while a test runs; it counts the
/// connections it accepted. Stopped on drop (open connections are shut down).
pub struct Gate {
    pub port: u16,
    state: Arc<GateState>,
}

struct GateState {
    mode: AtomicU8,
    target: u16,
    stop: AtomicBool,
    accepted: AtomicU64,
    conns: Mutex<Vec<TcpStream>>,
}

impl Gate {
    pub fn start(mode: GateMode, target: u16) -> Gate {
        let state = Arc::new(GateState {
            mode: AtomicU8::new(mode as u8),
            target,
            stop: AtomicBool::new(false),
            accepted: AtomicU64::new(0),
            conns: Mutex::new(Vec::new()),
        });
        let (st, stop) = (state.clone(), state.clone());
        let port = accept_on_free_port(
            "gate",
            move || stop.stop.load(Ordering::SeqCst),
            move |conn| {
                st.accepted.fetch_add(1, Ordering::SeqCst);
                let mode = st.mode.load(Ordering::SeqCst);
                if let Ok(c) = conn.try_clone() {
                    if let Ok(mut v) = st.conns.lock() {
                        v.push(c);
                    }
                }
                match mode {
                    0 => {
                        let target = st.target;
                        thread::spawn(move || pipe(conn, target));
                    }
                    1 => {
                        let _ = conn.shutdown(Shutdown::Both);
                    }
                    _ => {
                        thread::spawn(move || {
                            let mut conn = conn;
                            let mut sink = [0u8; 4096];
                            while let Ok(n) = conn.read(&mut sink) {
                                if n == 0 {
                                    break;
                                }
                            }
                        });
                    }
                }
            },
        );
        Gate { port, state }
    }

    pub fn set_mode(&self, mode: GateMode) {
        self.state.mode.store(mode as u8, Ordering::SeqCst);
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> u64 {
        self.state.accepted.load(Ordering::SeqCst)
    }

    /// Closes every connection accepted so far (forwarded ones included).
    pub fn drop_connections(&self) {
        if let Ok(mut v) = self.state.conns.lock() {
            for c in v.drain(..) {
                let _ = c.shutdown(Shutdown::Both);
            }
        }
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        self.state.stop.store(true, Ordering::SeqCst);
        self.drop_connections();
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}

fn pipe(client: TcpStream, target: u16) {
    let Ok(server) = TcpStream::connect(("127.0.0.1", target)) else {
        let _ = client.shutdown(Shutdown::Both);
        return;
    };
    let (Ok(mut c2), Ok(mut s2)) = (client.try_clone(), server.try_clone()) else {
        return;
    };
    let (mut c1, mut s1) = (client, server);
    let t = thread::spawn(move || {
        let _ = std::io::copy(&mut c1, &mut s1);
        let _ = s1.shutdown(Shutdown::Both);
        let _ = c1.shutdown(Shutdown::Both);
    });
    let _ = std::io::copy(&mut s2, &mut c2);
    let _ = c2.shutdown(Shutdown::Both);
    let _ = s2.shutdown(Shutdown::Both);
    let _ = t.join();
}

// ---------------------------------------------------------------------------------------------
// A whole stack

/// Redis + service + upstream + Envoy with one plugin configuration; fields drop in reverse order
/// of need (Envoy first).
pub struct Stack {
    pub envoy: Envoy,
    pub upstream: Upstream,
    pub service: Option<Service>,
    pub redis: Option<Redis>,
    pub client: Client,
    pub dir: TempDir,
    pub components: Components,
}

impl Stack {
    /// Starts Redis, the service on it, a counting upstream and Envoy whose `tollgate` cluster points
    /// at the service. `plugin_config` is the JSON of the plugin configuration.
    pub fn start(label: &str, plugin_config: &str) -> Stack {
        Stack::start_with(label, plugin_config, |_| {})
    }

    /// As [`Stack::start`], with `adjust` applied to the Envoy spec first.
    pub fn start_with(
        label: &str,
        plugin_config: &str,
        adjust: impl FnOnce(&mut EnvoySpec),
    ) -> Stack {
        let c = Components::get();
        let dir = TempDir::new(label);
        let redis = Redis::start(&c, &dir);
        let service = Service::start(&c, &dir, Some(&redis.url()));
        let upstream = Upstream::start();
        let mut spec = EnvoySpec::new(Some(plugin_config.to_string()), service.port, upstream.port);
        adjust(&mut spec);
        let envoy = Envoy::start(&c, &dir, &spec);
        Stack {
            envoy,
            upstream,
            service: Some(service),
            redis: Some(redis),
            client: Client::new(),
            dir,
            components: c,
        }
    }

    /// Starts Envoy whose `tollgate` cluster points at `service_port` (a gate, a closed port ...),
    /// with no service or Redis of its own.
    pub fn start_without_service(label: &str, plugin_config: &str, service_port: u16) -> Stack {
        let c = Components::get();
        let dir = TempDir::new(label);
        let upstream = Upstream::start();
        let spec = EnvoySpec::new(Some(plugin_config.to_string()), service_port, upstream.port);
        let envoy = Envoy::start(&c, &dir, &spec);
        Stack {
            envoy,
            upstream,
            service: None,
            redis: None,
            client: Client::new(),
            dir,
            components: c,
        }
    }

    pub fn url(&self, path: &str) -> String {
        self.envoy.url(path)
    }

    pub fn get(&self, path: &str, headers: &[(&str, &str)]) -> Reply {
        self.client.get(&self.url(path), headers)
    }
}

/// Waits (bounded) until `cond` holds; false on timeout.
pub fn eventually(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if cond() {
            return true;
        }
        thread::sleep(Duration::from_millis(20));
    }
    cond()
}

/// The transports every behaviour is checked over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    Http,
    Grpc,
}

impl Transport {
    pub fn name(self) -> &'static str {
        match self {
            Transport::Http => "http",
            Transport::Grpc => "grpc",
        }
    }
}
