//! Shared test support: real redis-server processes on free ports (the shared test support's,
//! `testkit/`: killed by PID on drop), the
//! service started in-process on 127.0.0.1:0 through `run`, and small HTTP/gRPC helpers;
//! [`binary`]: the real `tollgate-server` binary as a child process; [`gated`]: a store whose
//! takes wait until the test lets them through; [`h2_stream`]: `TakeStream` streams over bare
//! HTTP/2, any bytes sent; [`envoy`]: a real Envoy with the filter asking the service.
//! `store_suite!`: a behavioural suite run on every store, each built by the one helper of its
//! kind ([`memory_store`], [`redis_store`], [`cluster_store`], the last two over
//! [`redis_config`]).
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

pub mod binary;
pub mod envoy;
pub mod gated;
pub mod h2_stream;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::sync::oneshot;
use tollgate_server::api::grpc::pb;
use tollgate_server::store::memory::MemoryStore;
use tollgate_server::store::redis::{RedisConfig, RedisStore};
use tollgate_server::store::Store;
use tollgate_server::{run, ServiceConfig};
use tollgate_testkit::process::{self, Proc, TempDir};
use tollgate_testkit::redis;

/// `n` Redis nodes on free ports joined into a cluster of masters (cluster state ok on return).
#[allow(dead_code)] // not every test binary starts a cluster
pub fn start_cluster(n: usize) -> Vec<RedisProc> {
    let nodes: Vec<RedisProc> = (0..n)
        .map(|_| {
            let port = free_port();
            let conf = format!("nodes-{port}.conf");
            // The cluster bus on a free port of its own: by default it is `port + 10000`, which
            // another process may hold (the node then exits at start).
            let bus = free_port().to_string();
            RedisProc::start_on(
                port,
                &[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-port",
                    &bus,
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

/// Joins `nodes` (started with `--cluster-enabled yes`) into a cluster of masters; `cli` are the
/// redis-cli arguments that reach them (e.g. `--tls --cacert ...`). Waits for `cluster_state:ok`.
pub fn create_cluster(nodes: &[RedisProc], cli: &[&str]) {
    let ports: Vec<u16> = nodes.iter().map(|n| n.port).collect();
    redis::create_cluster(&ports, 0, cli);
}

/// The workspace root (server/..).
pub fn workspace() -> PathBuf {
    process::workspace_root()
}

/// redis-cli (TOLLGATE_REDIS_CLI, default .tools/redis-cli). Fails the test when missing.
pub fn redis_cli_bin() -> PathBuf {
    redis::cli_bin()
}

/// A free TCP port on 127.0.0.1 (never handed out twice by one test process).
pub fn free_port() -> u16 {
    process::free_port()
}

/// A redis-server child process (the shared test support's), killed by PID on drop; its log in a
/// scratch directory, printed if a test panics.
pub struct RedisProc {
    pub port: u16,
    proc: Option<Proc>,
    extra: Vec<String>,
    /// Extra redis-cli arguments (`--tls --cacert ...` for a TLS-only server).
    cli: Vec<String>,
    dir: TempDir,
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
        let mut p = RedisProc {
            port,
            proc: None,
            extra: extra.iter().map(|s| s.to_string()).collect(),
            cli: cli.iter().map(|s| s.to_string()).collect(),
            dir: TempDir::new(&format!("redis-{port}")),
        };
        p.spawn();
        p
    }

    fn spawn(&mut self) {
        let extra: Vec<&str> = self.extra.iter().map(String::as_str).collect();
        let log = self.dir.log_file("redis");
        self.proc = Some(redis::spawn(
            &redis::server_bin(),
            self.port,
            self.dir.path(),
            &extra,
            log,
        ));
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
        if let Some(mut p) = self.proc.take() {
            p.kill();
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
        let cli: Vec<&str> = self.cli.iter().map(String::as_str).collect();
        redis::cli(self.port, &cli, args)
    }

    /// A synchronous redis-rs connection.
    pub fn conn(&self) -> ::redis::Connection {
        ::redis::Client::open(self.url())
            .and_then(|c| c.get_connection())
            .expect("connect to redis")
    }
}

/// The memory store, as the service's tests run it.
pub fn memory_store() -> Arc<dyn Store> {
    Arc::new(MemoryStore::new())
}

/// How the tests reach Redis: standalone on `url`, or a Cluster seeded with `cluster`; keys under
/// `test:`, no TLS, each call bounded by `timeout_ms` (a test that needs TLS or another prefix
/// sets those fields over this).
pub fn redis_config(url: Option<String>, cluster: Vec<String>, timeout_ms: u64) -> RedisConfig {
    RedisConfig {
        url,
        cluster,
        key_prefix: "test:".into(),
        timeout: Duration::from_millis(timeout_ms),
        tls: None,
    }
}

/// A Redis store on `url` with a unique prefix.
pub fn redis_store(url: &str, timeout_ms: u64) -> RedisStore {
    RedisStore::new(redis_config(Some(url.to_string()), vec![], timeout_ms)).expect("redis store")
}

/// A Redis Cluster store seeded with the first of `nodes` (see [`start_cluster`]).
pub fn cluster_store(nodes: &[RedisProc], timeout_ms: u64) -> RedisStore {
    RedisStore::new(redis_config(None, vec![nodes[0].url()], timeout_ms))
        .expect("redis cluster store")
}

/// The behavioural suite over every store: `store_suite!(case, ...)` expands each
/// `async fn case(s: Arc<dyn Store>)` of the calling module into a test on the memory store
/// (module `memory`) and one on a Redis of its own (module `redis`, a 500 ms timeout);
/// `store_suite!(multi_thread: case, ...)` runs the Redis tests on two worker threads.
#[macro_export]
macro_rules! store_suite {
    (@with #[$redis_test:meta] $($case:ident),* $(,)?) => {
        mod memory {
            $(
                #[tokio::test]
                async fn $case() {
                    super::$case($crate::common::memory_store()).await;
                }
            )*
        }
        mod redis {
            $(
                #[$redis_test]
                async fn $case() {
                    let r = $crate::common::RedisProc::start();
                    super::$case(std::sync::Arc::new($crate::common::redis_store(&r.url(), 500))).await;
                    drop(r);
                }
            )*
        }
    };
    (multi_thread: $($case:ident),* $(,)?) => {
        $crate::store_suite!(
            @with #[tokio::test(flavor = "multi_thread", worker_threads = 2)] $($case),*
        );
    };
    ($($case:ident),* $(,)?) => {
        $crate::store_suite!(@with #[tokio::test] $($case),*);
    };
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
        Self::start_with(
            store,
            ServiceConfig {
                token: token.map(str::to_string),
                ..ServiceConfig::default()
            },
        )
        .await
    }

    /// Starts the service with `config` (its readiness checked every 50 ms).
    pub async fn start_with(store: Arc<dyn Store>, config: ServiceConfig) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (tx, rx) = oneshot::channel::<()>();
        let config = ServiceConfig {
            ready_interval: Duration::from_millis(50),
            ..config
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

/// Whether bucket `key` still holds its one token: a take of capacity 1 over an hour passes only
/// if nothing was ever charged to the key (a refused request charged nothing).
pub async fn never_charged(store: &dyn Store, key: &str) -> bool {
    let one = tollgate_server::domain::BucketSpec {
        key: key.to_string(),
        capacity: 1,
        rate: 1,
        period_ms: 3_600_000,
        cost: 1,
        algorithm: tollgate_server::domain::Algorithm::TokenBucket,
        lease: 1,
        max_delay_ms: 0,
    };
    store.take(&[one]).await.is_ok_and(|d| d.allowed)
}
