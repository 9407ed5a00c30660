//! Shared test support: real redis-server processes on free ports (killed by PID on drop), the
//! service started in-process on 127.0.0.1:0 through `run`, and small HTTP/gRPC helpers.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

pub mod binary;

use std::net::{SocketAddr, TcpListener as StdListener};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::sync::oneshot;
use tollgate_server::api::grpc::pb;
use tollgate_server::store::redis::{RedisConfig, RedisStore};
use tollgate_server::store::Store;
use tollgate_server::{run, ServiceConfig};

/// `n` Redis nodes on free ports joined into a cluster of masters (cluster state ok on return).
#[allow(dead_code)] // not every test binary starts a cluster
pub fn start_cluster(n: usize) -> Vec<RedisProc> {
    let nodes: Vec<RedisProc> = (0..n)
        .map(|_| {
            let port = free_port();
            let conf = format!("nodes-{port}.conf");
            RedisProc::start_on(
                port,
                &[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    &conf,
                    "--cluster-node-timeout",
                    "2000",
                ],
            )
        })
        .collect();
    create_cluster(&nodes, &[]);
    nodes
}

/// Joins `nodes` (started with `--cluster-enabled yes`) into a cluster of masters with
/// `redis-cli --cluster create` (`cli` goes before it, e.g. `--tls --cacert ...`), and waits until
/// every node reports `cluster_state:ok`.
pub fn create_cluster(nodes: &[RedisProc], cli: &[&str]) {
    let addrs: Vec<String> = nodes
        .iter()
        .map(|n| format!("127.0.0.1:{}", n.port))
        .collect();
    let out = Command::new(redis_cli_bin())
        .args(cli)
        .args(["--cluster", "create"])
        .args(&addrs)
        .args(["--cluster-replicas", "0", "--cluster-yes"])
        .stdin(Stdio::null())
        .output()
        .expect("redis-cli --cluster create");
    assert!(
        out.status.success(),
        "cluster create: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    for n in nodes {
        loop {
            let info = n.cmd(&["CLUSTER", "INFO"]).unwrap_or_default();
            if info.contains("cluster_state:ok") {
                break;
            }
            assert!(Instant::now() < deadline, "cluster not ok: {info}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// The workspace root (server/..).
pub fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf()
}

fn tool(var: &str, default: &str) -> PathBuf {
    let path = std::env::var_os(var)
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join(default));
    assert!(
        path.exists(),
        "{} not found at {} (set {var}, or run `bash scripts/tools.sh`)",
        default,
        path.display()
    );
    path
}

/// redis-server (TOLLGATE_REDIS_SERVER, default .tools/redis-server). Panics when missing.
pub fn redis_server_bin() -> PathBuf {
    tool("TOLLGATE_REDIS_SERVER", ".tools/redis-server")
}

/// redis-cli (TOLLGATE_REDIS_CLI, default .tools/redis-cli). Panics when missing.
pub fn redis_cli_bin() -> PathBuf {
    tool("TOLLGATE_REDIS_CLI", ".tools/redis-cli")
}

/// A free TCP port on 127.0.0.1 (bound then released).
pub fn free_port() -> u16 {
    StdListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

/// A redis-server child process, killed on drop.
pub struct RedisProc {
    pub port: u16,
    child: Option<Child>,
    extra: Vec<String>,
    /// Extra redis-cli arguments (`--tls --cacert ...` for a TLS-only server).
    cli: Vec<String>,
    dir: PathBuf,
}

impl RedisProc {
    /// Starts redis-server on a free port and waits until it answers PING.
    pub fn start() -> Self {
        Self::start_on(free_port(), &[])
    }

    /// Starts redis-server on `port` with extra arguments.
    pub fn start_on(port: u16, extra: &[&str]) -> Self {
        Self::start_with_cli(port, extra, &[])
    }

    /// Starts redis-server on `port` with extra arguments; `cli` are extra redis-cli arguments
    /// used to reach it (e.g. `--tls --cacert ca.pem` when it only listens with TLS on `port`).
    pub fn start_with_cli(port: u16, extra: &[&str], cli: &[&str]) -> Self {
        let dir =
            std::env::temp_dir().join(format!("tollgate-redis-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let mut p = RedisProc {
            port,
            child: None,
            extra: extra.iter().map(|s| s.to_string()).collect(),
            cli: cli.iter().map(|s| s.to_string()).collect(),
            dir,
        };
        p.spawn();
        p
    }

    fn spawn(&mut self) {
        let child = Command::new(redis_server_bin())
            .args([
                "--port",
                &self.port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.dir.to_str().expect("utf-8 dir"),
            ])
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn redis-server");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if self
                .cmd(&["PING"])
                .map(|s| s == "PONG" || s.contains("NOAUTH"))
                .unwrap_or(false)
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "redis-server did not start on port {}",
                self.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Kills the process (SIGKILL) and waits for it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it again on the same port (after `kill`).
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Runs one command through redis-cli and returns its raw output, trimmed.
    pub fn cmd(&self, args: &[&str]) -> Option<String> {
        let out = Command::new(redis_cli_bin())
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
            .args(&self.cli)
            .args(args)
            .stderr(Stdio::null())
            .output()
            .ok()?;
        if !out.status.success() {
            return None;
        }
        let s = String::from_utf8_lossy(&out.stdout).trim().to_string();
        if s.starts_with("Could not connect") {
            return None;
        }
        Some(s)
    }

    /// A synchronous redis-rs connection.
    pub fn conn(&self) -> redis::Connection {
        redis::Client::open(self.url())
            .and_then(|c| c.get_connection())
            .expect("connect to redis")
    }
}

impl Drop for RedisProc {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A Redis store on `url` with a unique prefix.
pub fn redis_store(url: &str, timeout_ms: u64) -> RedisStore {
    RedisStore::new(RedisConfig {
        url: Some(url.to_string()),
        cluster: vec![],
        key_prefix: "test:".into(),
        timeout: Duration::from_millis(timeout_ms),
        tls: None,
    })
    .expect("redis store")
}

/// A Redis Cluster store seeded with the first of `nodes` (see [`start_cluster`]).
pub fn cluster_store(nodes: &[RedisProc], timeout_ms: u64) -> RedisStore {
    RedisStore::new(RedisConfig {
        url: None,
        cluster: vec![nodes[0].url()],
        key_prefix: "test:".into(),
        timeout: Duration::from_millis(timeout_ms),
        tls: None,
    })
    .expect("redis cluster store")
}

/// The service running in-process on a free port; stops on drop.
pub struct Service {
    pub addr: SocketAddr,
    /// The store it serves (to ask it directly, e.g. for an error's detail).
    pub store: Arc<dyn Store>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
}

impl Service {
    pub async fn start(store: Arc<dyn Store>, token: Option<&str>) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (tx, rx) = oneshot::channel::<()>();
        let config = ServiceConfig {
            token: token.map(str::to_string),
            ready_interval: Duration::from_millis(50),
            ..ServiceConfig::default()
        };
        let task = tokio::spawn(run(listener, store.clone(), config, async {
            let _ = rx.await;
        }));
        Service {
            addr,
            store,
            stop: Some(tx),
            task: Some(task),
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    pub async fn grpc(
        &self,
    ) -> pb::rate_limiter_client::RateLimiterClient<tonic::transport::Channel> {
        pb::rate_limiter_client::RateLimiterClient::connect(format!("http://{}", self.addr))
            .await
            .expect("grpc connect")
    }

    pub async fn stop(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.task.take() {
            let _ = tokio::time::timeout(Duration::from_secs(5), t).await;
        }
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
    }
}

/// A gRPC client of the service at `base` (`http://host:port`).
pub async fn grpc_client(
    base: &str,
) -> pb::rate_limiter_client::RateLimiterClient<tonic::transport::Channel> {
    pb::rate_limiter_client::RateLimiterClient::connect(base.to_string())
        .await
        .expect("grpc connect")
}

/// A valid protobuf bucket: capacity 5 per second, the other fields left to their defaults.
pub fn pb_bucket(key: &str) -> pb::Bucket {
    pb::Bucket {
        key: key.into(),
        capacity: 5,
        rate: None,
        period_ms: 1000,
        cost: None,
        algorithm: 0,
        lease: None,
        ..Default::default()
    }
}

/// A JSON bucket.
pub fn bucket(key: &str, capacity: u64, rate: u64, period_ms: u64, cost: u64) -> Value {
    json!({"key": key, "capacity": capacity, "rate": rate, "period_ms": period_ms, "cost": cost})
}

/// POSTs a JSON body to /v1/take; returns status and body.
pub async fn post_take(client: &reqwest::Client, svc: &Service, body: &Value) -> (u16, Value) {
    let resp = client
        .post(svc.url("/v1/take"))
        .json(body)
        .send()
        .await
        .expect("POST /v1/take");
    let status = resp.status().as_u16();
    let body = resp.json::<Value>().await.unwrap_or(Value::Null);
    (status, body)
}

/// A unique name for keys of one test.
pub fn unique(name: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    format!(
        "{name}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// The body of a GET to `url` (e.g. a service's `/metrics`), which must answer.
pub async fn get_text(url: String) -> String {
    reqwest::get(url).await.unwrap().text().await.unwrap()
}
