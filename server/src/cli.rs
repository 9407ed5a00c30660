//! Command line and environment (each flag has an env var; flags win).

use std::net::SocketAddr;

use clap::{Parser, ValueEnum};

/// Log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// tollgate-server: Tollgate's decision service. Answers "may this request pass?" for a list of
/// rate-limit buckets, exactly and atomically, from Redis (standalone or Cluster) or from memory.
///
/// One port serves HTTP/1.1 and HTTP/2 cleartext: JSON `POST /v1/take`, gRPC
/// `tollgate.v1.RateLimiter/Take`, `GET /healthz`, `GET /readyz`, `GET /metrics`.
/// Log level: RUST_LOG (default `info`).
#[derive(Parser, Clone)]
#[command(name = "tollgate-server", version, about, long_about)]
pub struct Cli {
    /// Address to listen on (HTTP/1.1, HTTP/2 cleartext and gRPC on one port).
    #[arg(long, env = "TOLLGATE_LISTEN", default_value = "127.0.0.1:8081")]
    pub listen: SocketAddr,

    /// Standalone Redis: `redis://[user:password@]host:port[/db]`, or `rediss://` for TLS.
    /// Neither this nor --redis-cluster: buckets are kept in memory (one replica only).
    #[arg(long, env = "TOLLGATE_REDIS_URL", hide_env_values = true)]
    pub redis_url: Option<String>,

    /// Redis Cluster seed nodes, comma-separated URLs (`redis://host:port,...`). Wins over --redis-url.
    #[arg(
        long,
        env = "TOLLGATE_REDIS_CLUSTER",
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub redis_cluster: Vec<String>,

    /// Prefix of every Redis key (no `{` or `}`).
    #[arg(long, env = "TOLLGATE_KEY_PREFIX", default_value = "tollgate:")]
    pub key_prefix: String,

    /// Redis connect and response timeout in milliseconds. A take that Redis cannot answer in
    /// this time fails with 503 / UNAVAILABLE (never "allowed").
    #[arg(long, env = "TOLLGATE_REDIS_TIMEOUT_MS", default_value_t = 50)]
    pub redis_timeout_ms: u64,

    /// Bearer token that every take must carry (`authorization: Bearer <token>`). Unset: no auth.
    #[arg(long, env = "TOLLGATE_TOKEN", hide_env_values = true)]
    pub token: Option<String>,

    /// Log format.
    #[arg(long, env = "TOLLGATE_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,

    /// Most requests handled at once; more wait for a slot.
    #[arg(long, env = "TOLLGATE_MAX_IN_FLIGHT", default_value_t = 4096)]
    pub max_in_flight: usize,

    /// Tokio worker threads (0 = one per CPU).
    #[arg(long, env = "TOLLGATE_WORKER_THREADS", default_value_t = 0)]
    pub worker_threads: usize,
}

impl std::fmt::Debug for Cli {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use crate::store::redis::redact_url;
        f.debug_struct("Cli")
            .field("listen", &self.listen)
            .field("redis_url", &self.redis_url.as_deref().map(redact_url))
            .field(
                "redis_cluster",
                &self
                    .redis_cluster
                    .iter()
                    .map(|u| redact_url(u))
                    .collect::<Vec<_>>(),
            )
            .field("key_prefix", &self.key_prefix)
            .field("redis_timeout_ms", &self.redis_timeout_ms)
            .field("token", &self.token.as_ref().map(|_| "***"))
            .field("log_format", &self.log_format)
            .field("max_in_flight", &self.max_in_flight)
            .field("worker_threads", &self.worker_threads)
            .finish()
    }
}
