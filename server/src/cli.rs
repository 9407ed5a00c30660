//! Command line and environment (each flag has an env var; flags win).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use clap::{Parser, ValueEnum};

use crate::store::redis::{ClientIdentity, RedisTls, TlsFileError};

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

    /// PEM bundle of CA certificates that Redis's certificate must chain to, instead of the public
    /// (webpki) roots: a private CA (cert-manager, a managed Redis's own CA). rediss:// only.
    #[arg(long, env = "TOLLGATE_REDIS_TLS_CA", value_name = "FILE")]
    pub redis_tls_ca: Option<PathBuf>,

    /// PEM client certificate (chain) for mutual TLS with Redis (`tls-auth-clients yes`).
    /// Needs --redis-tls-key. rediss:// only.
    #[arg(long, env = "TOLLGATE_REDIS_TLS_CERT", value_name = "FILE")]
    pub redis_tls_cert: Option<PathBuf>,

    /// PEM private key of --redis-tls-cert.
    #[arg(long, env = "TOLLGATE_REDIS_TLS_KEY", value_name = "FILE")]
    pub redis_tls_key: Option<PathBuf>,

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
            .field("redis_tls_ca", &self.redis_tls_ca)
            .field("redis_tls_cert", &self.redis_tls_cert)
            .field("redis_tls_key", &self.redis_tls_key)
            .field("token", &self.token.as_ref().map(|_| "***"))
            .field("log_format", &self.log_format)
            .field("max_in_flight", &self.max_in_flight)
            .field("worker_threads", &self.worker_threads)
            .finish()
    }
}

impl Cli {
    /// Reads and checks the `--redis-tls-*` files. `None` when none is given. Errors name the flag
    /// (and file) at fault: an unreadable file, bad PEM, a key that is not the certificate's, a
    /// certificate without a key, or TLS files with no `rediss://` URL to apply them to.
    pub fn redis_tls(&self) -> Result<Option<RedisTls>, String> {
        let (ca, cert, key) = (
            self.redis_tls_ca.as_deref(),
            self.redis_tls_cert.as_deref(),
            self.redis_tls_key.as_deref(),
        );
        if ca.is_none() && cert.is_none() && key.is_none() {
            return Ok(None);
        }
        let given = [
            ("--redis-tls-ca", ca.is_some()),
            ("--redis-tls-cert", cert.is_some()),
            ("--redis-tls-key", key.is_some()),
        ]
        .iter()
        .filter(|(_, g)| *g)
        .map(|(f, _)| *f)
        .collect::<Vec<_>>()
        .join(", ");
        // Which URLs the files would apply to (--redis-cluster wins over --redis-url).
        let urls: Vec<(&str, &str)> = if !self.redis_cluster.is_empty() {
            self.redis_cluster
                .iter()
                .map(|u| ("--redis-cluster", u.as_str()))
                .collect()
        } else {
            self.redis_url
                .iter()
                .map(|u| ("--redis-url", u.as_str()))
                .collect()
        };
        if urls.is_empty() {
            return Err(format!(
                "{given} given but no Redis is configured (--redis-url or --redis-cluster with rediss://)"
            ));
        }
        if let Some((flag, url)) = urls.iter().find(|(_, u)| !u.starts_with("rediss://")) {
            return Err(format!(
                "{given} apply to TLS connections only, but {flag} is {} (use rediss://)",
                crate::store::redis::redact_url(url)
            ));
        }
        let client = match (cert, key) {
            (Some(c), Some(k)) => Some(ClientIdentity {
                cert: read("--redis-tls-cert", c)?,
                key: read("--redis-tls-key", k)?,
            }),
            (Some(_), None) => return Err("--redis-tls-cert needs --redis-tls-key".into()),
            (None, Some(_)) => return Err("--redis-tls-key needs --redis-tls-cert".into()),
            (None, None) => None,
        };
        let tls = RedisTls {
            ca: ca.map(|p| read("--redis-tls-ca", p)).transpose()?,
            client,
        };
        let show = |p: Option<&Path>| p.map(|p| p.display().to_string()).unwrap_or_default();
        tls.check().map_err(|e| match e {
            TlsFileError::Ca(m) => format!("--redis-tls-ca {}: {m}", show(ca)),
            TlsFileError::Cert(m) => format!("--redis-tls-cert {}: {m}", show(cert)),
            TlsFileError::Key(m) => format!("--redis-tls-key {}: {m}", show(key)),
        })?;
        Ok(Some(tls))
    }
}

fn read(flag: &str, path: &Path) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("{flag} {}: cannot read: {e}", path.display()))
}
