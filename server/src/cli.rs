//! Command line and environment (each flag has an env var; flags win).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use clap::{Parser, Subcommand, ValueEnum};

use crate::store::redis::{ClientIdentity, RedisConfigError, RedisTls, TlsFileError};

/// Why the service did not start. Each error names the flag (and file, or address) at fault;
/// its text is the line the log shows.
#[derive(Debug, thiserror::Error)]
pub enum StartupError {
    /// A file given by a flag (--token-file, --redis-tls-*) cannot be read.
    #[error("{flag} {}: cannot read: {source}", path.display())]
    Unreadable {
        /// The flag that names the file.
        flag: &'static str,
        /// The file.
        path: PathBuf,
        /// Why it cannot be read.
        source: std::io::Error,
    },
    /// The OTLP exporter could not be set up (the text says why).
    #[error("{0}")]
    Otlp(String),
    /// The --token-file is not UTF-8.
    #[error("--token-file {}: not UTF-8", .0.display())]
    TokenFileNotUtf8(PathBuf),
    /// --token, TOLLGATE_TOKEN or --token-file holds an empty token.
    #[error("the bearer token is empty (--token, TOLLGATE_TOKEN or --token-file)")]
    TokenEmpty,
    /// --token, TOLLGATE_TOKEN or --token-file holds a token no header can carry.
    #[error("the bearer token holds control characters, which no header can carry (--token, TOLLGATE_TOKEN or --token-file)")]
    TokenControl,
    /// --token, TOLLGATE_TOKEN or --token-file holds a placeholder or a token too short to be a
    /// secret ([`check_token`]).
    #[error("the bearer token (--token, TOLLGATE_TOKEN or --token-file) {0}")]
    TokenWeak(WeakToken),
    /// --admin-token, TOLLGATE_ADMIN_TOKEN or --admin-token-file cannot be used (the text says why).
    #[error("the admin token (--admin-token, TOLLGATE_ADMIN_TOKEN or --admin-token-file) {0}")]
    AdminToken(String),
    /// --redis-tls-* given, but neither --redis-url nor --redis-cluster.
    #[error(
        "{given} given but no Redis is configured (--redis-url or --redis-cluster with rediss://)"
    )]
    TlsWithoutRedis {
        /// The --redis-tls-* flags given, comma-separated.
        given: String,
    },
    /// --redis-tls-* given for a `redis://` URL.
    #[error("{given} apply to TLS connections only, but {flag} is {url} (use rediss://)")]
    TlsWithoutRediss {
        /// The --redis-tls-* flags given, comma-separated.
        given: String,
        /// --redis-url, --redis-cluster or --redis-sentinel.
        flag: &'static str,
        /// The URL, redacted.
        url: String,
    },
    /// --redis-tls-cert without --redis-tls-key.
    #[error("--redis-tls-cert needs --redis-tls-key")]
    CertWithoutKey,
    /// --redis-tls-key without --redis-tls-cert.
    #[error("--redis-tls-key needs --redis-tls-cert")]
    KeyWithoutCert,
    /// A --redis-tls-* file holds bad PEM, or a key that is not the certificate's.
    #[error("{flag} {}: {problem}", path.display())]
    TlsFile {
        /// --redis-tls-ca, --redis-tls-cert or --redis-tls-key.
        flag: &'static str,
        /// The file.
        path: PathBuf,
        /// What is wrong in it.
        problem: String,
    },
    /// The --rls-config file cannot be loaded (the text names the file and what is wrong).
    #[error("--rls-config {0}")]
    RlsConfig(String),
    /// --redis-url, --redis-cluster, --redis-sentinel, --key-prefix or the TLS files cannot make
    /// a Redis store.
    #[error(transparent)]
    Redis(#[from] RedisConfigError),
    /// --listen cannot be bound.
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        /// The address.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// The server stopped with an error.
    #[error("server error: {0}")]
    Server(std::io::Error),
}

/// Fewest bytes a bearer token (--token, --admin-token) may have. A length is all a check sees of a
/// secret, so the bound is the length at which a random token in the sparsest usual encoding, hex
/// (4 bits a character), carries 128 bits (`openssl rand -hex 16`); base64 or alphanumerics carry
/// more in as many characters.
pub const MIN_TOKEN_BYTES: usize = 32;

/// A token holding this, in any case, is a placeholder: `replace-with-a-long-random-token`, which
/// the chart and deploy/ once shipped, and the markers deploy/ carries where a token goes.
pub const PLACEHOLDER_MARK: &str = "replace-with";

/// What a refused token's error says to do: 32 random bytes, as hex.
const MAKE_ONE: &str =
    "make one with `openssl rand -hex 32` (or `head -c 32 /dev/urandom | base64`)";

/// Why a token that a header could carry is still not a secret.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum WeakToken {
    /// It holds [`PLACEHOLDER_MARK`].
    #[error("is a placeholder (it contains {PLACEHOLDER_MARK:?}), not a secret: {MAKE_ONE}")]
    Placeholder,
    /// It has fewer than [`MIN_TOKEN_BYTES`] bytes (how many it has).
    #[error(
        "is {0} bytes long, too short to be a secret (at least {MIN_TOKEN_BYTES}): {MAKE_ONE}"
    )]
    Short(usize),
}

/// Whether `token` may guard the service: refused when it holds [`PLACEHOLDER_MARK`] (in any case)
/// or has fewer than [`MIN_TOKEN_BYTES`] bytes. Both tokens are checked with it at startup.
pub fn check_token(token: &str) -> Result<(), WeakToken> {
    if token.to_ascii_lowercase().contains(PLACEHOLDER_MARK) {
        return Err(WeakToken::Placeholder);
    }
    if token.len() < MIN_TOKEN_BYTES {
        return Err(WeakToken::Short(token.len()));
    }
    Ok(())
}

/// The async runtime's kind (`--runtime`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Runtime {
    /// One thread when the process may run on one CPU (its affinity or its cgroup's quota, or
    /// `--worker-threads 1`), else a thread per CPU.
    Auto,
    /// Every task on the main thread: no handing work between threads.
    CurrentThread,
    /// A pool of worker threads (`--worker-threads`, one per CPU by default).
    MultiThread,
}

impl Runtime {
    /// Whether the service runs on one thread, given `--worker-threads` (0: one per CPU) and the
    /// CPUs the process may run on.
    pub fn one_thread(self, worker_threads: usize, cpus: usize) -> bool {
        match self {
            Runtime::CurrentThread => true,
            Runtime::MultiThread => false,
            Runtime::Auto => match worker_threads {
                0 => cpus <= 1,
                n => n == 1,
            },
        }
    }
}

/// Log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// tollgate-server: Tollgate's decision service. Answers "may this request pass?" for a list of
/// rate-limit buckets, exactly and atomically, from Redis (standalone, Cluster or Sentinel) or
/// from memory.
///
/// One port serves HTTP/1.1 and HTTP/2 cleartext: JSON `POST /v1/take`, gRPC
/// `tollgate.v1.RateLimiter/Take`, Envoy's RLS v3 (with --rls-config), `GET /healthz`, `GET /readyz`, `GET /metrics`.
/// Log level: RUST_LOG, a level or `target=level` pairs (default `info`).
#[derive(Parser, Clone)]
#[command(name = "tollgate-server", version, about, long_about)]
pub struct Cli {
    /// Address to listen on (HTTP/1.1, HTTP/2 cleartext and gRPC on one port).
    #[arg(long, env = "TOLLGATE_LISTEN", default_value = "127.0.0.1:8081")]
    pub listen: SocketAddr,

    /// Standalone Redis: `redis://[user:password@]host:port[/db]`, or `rediss://` for TLS.
    /// None of this, --redis-cluster and --redis-sentinel: buckets are kept in memory (one replica
    /// only).
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

    /// Redis Sentinel: the sentinels, comma-separated URLs (`redis://[user:password@]host:26379,...`;
    /// the credentials are the sentinels' own). Decisions go to the master they name for
    /// --redis-sentinel-master, asked again after a failover; `rediss://` for TLS to the
    /// sentinels and to the master (with the --redis-tls-* files). Instead of --redis-url or
    /// --redis-cluster (envoyproxy/ratelimit's `REDIS_TYPE=sentinel`).
    #[arg(
        long,
        env = "TOLLGATE_REDIS_SENTINEL",
        value_delimiter = ',',
        hide_env_values = true,
        conflicts_with_all = ["redis_url", "redis_cluster"],
        requires = "redis_sentinel_master"
    )]
    pub redis_sentinel: Vec<String>,

    /// The master's name in the sentinels' configuration (`sentinel monitor <name> ...`).
    #[arg(long, env = "TOLLGATE_REDIS_SENTINEL_MASTER", value_name = "NAME")]
    pub redis_sentinel_master: Option<String>,

    /// With --redis-sentinel: the password of the master (and of the replica promoted in its
    /// place), Redis's `requirepass`. The sentinels' own password goes in their URLs.
    #[arg(
        long,
        env = "TOLLGATE_REDIS_MASTER_PASSWORD",
        hide_env_values = true,
        requires = "redis_sentinel"
    )]
    pub redis_master_password: Option<String>,

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
    /// At least 32 bytes and no placeholder (nothing containing `replace-with`), or the service
    /// does not start: make one with `openssl rand -hex 32`. A flag shows in `ps`: prefer the
    /// environment variable or --token-file.
    #[arg(
        long,
        env = "TOLLGATE_TOKEN",
        hide_env_values = true,
        conflicts_with = "token_file"
    )]
    pub token: Option<String>,

    /// File holding the bearer token (e.g. a mounted Kubernetes Secret); surrounding whitespace
    /// (a trailing newline) is ignored. Read once at startup.
    #[arg(long, env = "TOLLGATE_TOKEN_FILE", value_name = "FILE")]
    pub token_file: Option<PathBuf>,

    /// Bearer token of the admin endpoints (`GET /v1/buckets`, `POST /v1/buckets/reset`), which
    /// must differ from --token and, as it, have at least 32 bytes and no placeholder. Unset: those
    /// endpoints are off and answer 404.
    #[arg(
        long,
        env = "TOLLGATE_ADMIN_TOKEN",
        hide_env_values = true,
        conflicts_with = "admin_token_file"
    )]
    pub admin_token: Option<String>,

    /// File holding the admin token (e.g. a mounted Kubernetes Secret); surrounding whitespace is
    /// ignored. Read once at startup.
    #[arg(long, env = "TOLLGATE_ADMIN_TOKEN_FILE", value_name = "FILE")]
    pub admin_token_file: Option<PathBuf>,

    /// Log format.
    #[arg(long, env = "TOLLGATE_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,

    /// Most takes decoded or decided at once (counted from when the body has arrived); a take
    /// beyond it is answered 503 / UNAVAILABLE at once (`tollgate_shed_total`), never queued.
    /// /healthz, /readyz and /metrics are not counted.
    #[arg(long, env = "TOLLGATE_MAX_IN_FLIGHT", default_value_t = 1024)]
    pub max_in_flight: usize,

    /// Most connections open at once; one more is closed on accept (`tollgate_connections_refused_total`).
    #[arg(long, env = "TOLLGATE_MAX_CONNECTIONS", default_value_t = 1024)]
    pub max_connections: usize,

    /// Milliseconds to receive a request's head. HTTP/1.1: also the longest idle time between
    /// keep-alive requests. Any protocol: a new connection that sends no request by then is closed.
    #[arg(long, env = "TOLLGATE_HEADER_TIMEOUT_MS", default_value_t = 5000)]
    pub header_timeout_ms: u64,

    /// Milliseconds to receive a take's whole body once its head has arrived; a slower one gets
    /// 408 / DEADLINE_EXCEEDED and its connection is closed. Also a TakeStream message's, from its
    /// first byte: a slower one ends its stream DEADLINE_EXCEEDED.
    #[arg(long, env = "TOLLGATE_BODY_TIMEOUT_MS", default_value_t = 500)]
    pub body_timeout_ms: u64,

    /// Milliseconds a connection may stay open with no request in progress (HTTP/2: then GOAWAY).
    #[arg(long, env = "TOLLGATE_IDLE_TIMEOUT_MS", default_value_t = 60_000)]
    pub idle_timeout_ms: u64,

    /// Concurrent streams per HTTP/2 connection (SETTINGS_MAX_CONCURRENT_STREAMS).
    #[arg(long, env = "TOLLGATE_HTTP2_MAX_STREAMS", default_value_t = 128)]
    pub http2_max_streams: u32,

    /// Messages of one TakeStream stream decoded or decided at once (each also holds a permit of
    /// --max-in-flight); one more is answered UNAVAILABLE at once, with its id
    /// (`tollgate_stream_refusals_total{reason="in_flight"}`), the stream going on.
    #[arg(long, env = "TOLLGATE_STREAM_MAX_IN_FLIGHT", default_value_t = crate::api::STREAM_MAX_IN_FLIGHT)]
    pub stream_max_in_flight: usize,

    /// Bytes all TakeStream streams together may hold of messages not yet whole (a message that
    /// arrives whole within one read holds none); a stream whose message would take them past it
    /// ends UNAVAILABLE (`tollgate_stream_refusals_total{reason="buffer"}`). Under 1 MiB, a
    /// message of the largest size may never fit.
    #[arg(long, env = "TOLLGATE_STREAM_BUFFER_BYTES", default_value_t = crate::api::STREAM_BUFFER_BYTES)]
    pub stream_buffer_bytes: usize,

    /// Milliseconds between two store checks; /readyz answers from the last one.
    #[arg(long, env = "TOLLGATE_READY_INTERVAL_MS", default_value_t = 1000)]
    pub ready_interval_ms: u64,

    /// Memory store only: most buckets held. A take that needs one more is answered 503 /
    /// UNAVAILABLE ("store full") until idle buckets expire.
    #[arg(long, env = "TOLLGATE_MEMORY_MAX_BUCKETS", default_value_t = 100_000)]
    pub memory_max_buckets: usize,

    /// Limits file for Envoy's rate limit service (RLS v3,
    /// `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`, served on --listen), in
    /// envoyproxy/ratelimit's YAML format plus `algorithm` and `burst`. Reloaded when it changes; a
    /// file that does not parse is refused (logged) and the limits in force stay. Unset: RLS calls
    /// are UNIMPLEMENTED.
    #[arg(long, env = "TOLLGATE_RLS_CONFIG", value_name = "FILE")]
    pub rls_config: Option<PathBuf>,

    /// Milliseconds between two checks of --rls-config for a change.
    #[arg(long, env = "TOLLGATE_RLS_CONFIG_POLL_MS", default_value_t = 1000)]
    pub rls_config_poll_ms: u64,

    /// RLS answers carry response headers for Envoy to add (`RateLimit-Policy`, `RateLimit`,
    /// `x-ratelimit-limit`, `-remaining`, `-reset`, `retry-after` on a denial). Off by default:
    /// Envoy's `enable_x_ratelimit_headers` writes its own from the answer's statuses, and with
    /// both every header would be sent twice.
    #[arg(long, env = "TOLLGATE_RLS_HEADERS")]
    pub rls_headers: bool,

    /// Tokio worker threads (0 = one per CPU the process may run on: its affinity, its cgroup's
    /// CPU quota).
    #[arg(long, env = "TOLLGATE_WORKER_THREADS", default_value_t = 0)]
    pub worker_threads: usize,

    /// The runtime: `auto` runs every task on one thread when the process has one CPU (or
    /// --worker-threads 1), a pool of worker threads otherwise; `current-thread` or
    /// `multi-thread` choose. On one core a pool only hands work between threads that take turns
    /// on it (BENCHMARKS.md, "The service on one core").
    #[arg(long, env = "TOLLGATE_RUNTIME", value_enum, default_value_t = Runtime::Auto)]
    pub runtime: Runtime,

    /// Redis only: most takes one coalesced store call carries (at most 64). Takes that arrive
    /// while --coalesce-calls store calls are in flight wait and then leave together as one batch
    /// script run (each still decided on its own); a take that finds a call free goes out at once.
    /// 0 = off: every take is its own script call.
    #[arg(long, env = "TOLLGATE_COALESCE", default_value_t = 64)]
    pub coalesce: usize,

    /// Redis only: most store calls in flight at once while coalescing.
    #[arg(long, env = "TOLLGATE_COALESCE_CALLS", default_value_t = 2)]
    pub coalesce_calls: usize,

    /// Milliseconds a proxy instance stays counted after its last callout (`instances` in every
    /// answer, the fallback's N). Above the longest `lease.max_age_ms` (60 s), so a proxy serving
    /// its keys from leases, calling out about once a minute, stays counted; a proxy that stopped
    /// drops out after it. Give every replica of a deployment the same value.
    #[arg(long, env = "TOLLGATE_INSTANCE_TTL_MS", default_value_t = crate::api::instances::DEFAULT_TTL_MS,
          value_parser = clap::value_parser!(u64).range(
              crate::api::instances::MIN_TTL_MS..=crate::api::instances::MAX_TTL_MS))]
    pub instance_ttl_ms: u64,

    /// Export OpenTelemetry traces over OTLP/gRPC to this collector (e.g.
    /// `http://otel-collector:4317`): a span per decision, joined to the caller's `traceparent`.
    /// Unset: no traces.
    #[arg(long, env = "TOLLGATE_OTLP_ENDPOINT", value_name = "URL")]
    pub otlp_endpoint: Option<String>,

    /// With --otlp-endpoint: the share of calls without a `traceparent` that start a trace (0..=1);
    /// a call with one follows its sampling decision.
    #[arg(long, env = "TOLLGATE_OTLP_SAMPLE_RATIO", default_value_t = 1.0,
          value_parser = parse_ratio)]
    pub otlp_sample_ratio: f64,

    /// Instead of serving: a subcommand.
    #[command(subcommand)]
    pub command: Option<Command>,
}

/// A ratio 0..=1.
fn parse_ratio(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(r) if (0.0..=1.0).contains(&r) => Ok(r),
        _ => Err(format!("{s:?} is not a ratio from 0 to 1")),
    }
}

/// What the binary does instead of serving.
#[derive(Subcommand, Debug, Clone)]
pub enum Command {
    /// Check filter configurations and RLS limits files with the module's and the service's own
    /// readers, as a CI step: every refusal is reported with the field it names. Exit status 0
    /// when all are accepted, 1 when one is refused, 2 when a file cannot be read or holds
    /// nothing to check.
    Check(crate::check::CheckArgs),
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
            .field(
                "redis_sentinel",
                &crate::store::redis::redact_urls(&self.redis_sentinel),
            )
            .field("redis_sentinel_master", &self.redis_sentinel_master)
            .field(
                "redis_master_password",
                &self.redis_master_password.as_ref().map(|_| "***"),
            )
            .field("key_prefix", &self.key_prefix)
            .field("redis_timeout_ms", &self.redis_timeout_ms)
            .field("redis_tls_ca", &self.redis_tls_ca)
            .field("redis_tls_cert", &self.redis_tls_cert)
            .field("redis_tls_key", &self.redis_tls_key)
            .field("token", &self.token.as_ref().map(|_| "***"))
            .field("token_file", &self.token_file)
            .field("log_format", &self.log_format)
            .field("max_in_flight", &self.max_in_flight)
            .field("max_connections", &self.max_connections)
            .field("header_timeout_ms", &self.header_timeout_ms)
            .field("body_timeout_ms", &self.body_timeout_ms)
            .field("idle_timeout_ms", &self.idle_timeout_ms)
            .field("http2_max_streams", &self.http2_max_streams)
            .field("stream_max_in_flight", &self.stream_max_in_flight)
            .field("stream_buffer_bytes", &self.stream_buffer_bytes)
            .field("ready_interval_ms", &self.ready_interval_ms)
            .field("memory_max_buckets", &self.memory_max_buckets)
            .field("rls_config", &self.rls_config)
            .field("rls_config_poll_ms", &self.rls_config_poll_ms)
            .field("rls_headers", &self.rls_headers)
            .field("worker_threads", &self.worker_threads)
            .field("runtime", &self.runtime)
            .field("coalesce", &self.coalesce)
            .field("coalesce_calls", &self.coalesce_calls)
            .field("instance_ttl_ms", &self.instance_ttl_ms)
            .field("otlp_endpoint", &self.otlp_endpoint)
            .field("otlp_sample_ratio", &self.otlp_sample_ratio)
            .field("command", &self.command)
            .finish()
    }
}

/// A secret given as a flag's value or in a file (named by `file_flag`; surrounding whitespace
/// trimmed); `None` when neither is given.
fn secret(
    value: Option<&String>,
    file: Option<&Path>,
    file_flag: &'static str,
    not_utf8: impl FnOnce(&Path) -> StartupError,
) -> Result<Option<String>, StartupError> {
    match (value, file) {
        (Some(t), _) => Ok(Some(t.clone())),
        (None, Some(path)) => {
            let bytes = read(file_flag, path)?;
            let text = String::from_utf8(bytes).map_err(|_| not_utf8(path))?;
            Ok(Some(text.trim().to_string()))
        }
        (None, None) => Ok(None),
    }
}

impl Cli {
    /// The service's settings from the flags; reads --token-file. Errors name the flag.
    pub fn service_config(&self) -> Result<crate::ServiceConfig, StartupError> {
        let ms = |v: u64| std::time::Duration::from_millis(v.max(1));
        Ok(crate::ServiceConfig {
            token: self.token()?,
            admin_token: self.admin_token()?,
            max_in_flight: self.max_in_flight,
            max_connections: self.max_connections,
            header_timeout: ms(self.header_timeout_ms),
            body_timeout: ms(self.body_timeout_ms),
            idle_timeout: ms(self.idle_timeout_ms),
            http2_max_streams: self.http2_max_streams,
            stream_max_in_flight: self.stream_max_in_flight,
            stream_buffer_bytes: self.stream_buffer_bytes,
            ready_interval: ms(self.ready_interval_ms),
            rls: self
                .rls_config
                .as_deref()
                .map(|p| {
                    crate::rls::LimitsFile::load(p)
                        .map(|f| std::sync::Arc::new(f.with_headers(self.rls_headers)))
                        .map_err(StartupError::RlsConfig)
                })
                .transpose()?,
            rls_poll: ms(self.rls_config_poll_ms),
            coalesce: (self.coalesce > 0).then(|| crate::store::coalesce::CoalesceConfig {
                max_takes: self.coalesce,
                calls: self.coalesce_calls,
                max_wait: Some(ms(self.redis_timeout_ms)),
                ..Default::default()
            }),
            instance_ttl_ms: self.instance_ttl_ms,
        })
    }

    /// The bearer token, from --token (or TOLLGATE_TOKEN) or --token-file: refused when empty,
    /// unfit for a header, or no secret ([`check_token`]).
    pub fn token(&self) -> Result<Option<String>, StartupError> {
        let Some(token) = secret(
            self.token.as_ref(),
            self.token_file.as_deref(),
            "--token-file",
            |path| StartupError::TokenFileNotUtf8(path.to_path_buf()),
        )?
        else {
            return Ok(None);
        };
        if token.is_empty() {
            return Err(StartupError::TokenEmpty);
        }
        if token.bytes().any(|b| b.is_ascii_control()) {
            return Err(StartupError::TokenControl);
        }
        check_token(&token).map_err(StartupError::TokenWeak)?;
        Ok(Some(token))
    }

    /// The admin token, from --admin-token (or TOLLGATE_ADMIN_TOKEN) or --admin-token-file:
    /// refused when empty, unfit for a header, no secret ([`check_token`]), or the takes' token
    /// (which must not open them).
    pub fn admin_token(&self) -> Result<Option<String>, StartupError> {
        let Some(token) = secret(
            self.admin_token.as_ref(),
            self.admin_token_file.as_deref(),
            "--admin-token-file",
            |path| StartupError::AdminToken(format!("{}: not UTF-8", path.display())),
        )?
        else {
            return Ok(None);
        };
        let refused = |why: &str| Err(StartupError::AdminToken(why.to_string()));
        if token.is_empty() {
            return refused("is empty");
        }
        if token.bytes().any(|b| b.is_ascii_control()) {
            return refused("holds control characters, which no header can carry");
        }
        if let Err(weak) = check_token(&token) {
            return refused(&weak.to_string());
        }
        if self.token()?.as_deref() == Some(token.as_str()) {
            return refused("is the takes' token (--token): it must be a secret of its own");
        }
        Ok(Some(token))
    }

    /// Reads and checks the `--redis-tls-*` files. `None` when none is given. Errors name the flag
    /// (and file) at fault: an unreadable file, bad PEM, a key that is not the certificate's, a
    /// certificate without a key, or TLS files with no `rediss://` URL to apply them to.
    pub fn redis_tls(&self) -> Result<Option<RedisTls>, StartupError> {
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
        let urls: Vec<(&str, &str)> = if !self.redis_sentinel.is_empty() {
            self.redis_sentinel
                .iter()
                .map(|u| ("--redis-sentinel", u.as_str()))
                .collect()
        } else if !self.redis_cluster.is_empty() {
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
            return Err(StartupError::TlsWithoutRedis { given });
        }
        if let Some((flag, url)) = urls.iter().find(|(_, u)| !u.starts_with("rediss://")) {
            return Err(StartupError::TlsWithoutRediss {
                given,
                flag,
                url: crate::store::redis::redact_url(url),
            });
        }
        let client = match (cert, key) {
            (Some(c), Some(k)) => Some(ClientIdentity {
                cert: read("--redis-tls-cert", c)?,
                key: read("--redis-tls-key", k)?,
            }),
            (Some(_), None) => return Err(StartupError::CertWithoutKey),
            (None, Some(_)) => return Err(StartupError::KeyWithoutCert),
            (None, None) => None,
        };
        let tls = RedisTls {
            ca: ca.map(|p| read("--redis-tls-ca", p)).transpose()?,
            client,
        };
        let file = |flag, path: Option<&Path>, problem| StartupError::TlsFile {
            flag,
            path: path.map(Path::to_path_buf).unwrap_or_default(),
            problem,
        };
        tls.check().map_err(|e| match e {
            TlsFileError::Ca(m) => file("--redis-tls-ca", ca, m),
            TlsFileError::Cert(m) => file("--redis-tls-cert", cert, m),
            TlsFileError::Key(m) => file("--redis-tls-key", key, m),
        })?;
        Ok(Some(tls))
    }
}

fn read(flag: &'static str, path: &Path) -> Result<Vec<u8>, StartupError> {
    std::fs::read(path).map_err(|source| StartupError::Unreadable {
        flag,
        path: path.to_path_buf(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cli(args: &[&str]) -> Cli {
        Cli::try_parse_from(std::iter::once("tollgate-server").chain(args.iter().copied()))
            .unwrap_or_else(|e| unreachable!("{e}"))
    }

    /// `auto` is one thread on one CPU or with one worker thread asked for; the others choose.
    #[test]
    fn the_runtime_fits_the_cpus() {
        assert_eq!(cli(&[]).runtime, Runtime::Auto);
        for (runtime, workers, cpus, one) in [
            (Runtime::Auto, 0, 1, true),
            (Runtime::Auto, 0, 2, false),
            (Runtime::Auto, 1, 8, true),
            (Runtime::Auto, 4, 1, false),
            (Runtime::CurrentThread, 0, 8, true),
            (Runtime::MultiThread, 0, 1, false),
        ] {
            assert_eq!(
                runtime.one_thread(workers, cpus),
                one,
                "{runtime:?} {workers} {cpus}"
            );
        }
        assert_eq!(
            cli(&["--runtime", "current-thread"]).runtime,
            Runtime::CurrentThread
        );
    }

    /// Tokens that pass [`check_token`]: 32 bytes and more, none a placeholder.
    const TOKEN: &str = "0123456789abcdef0123456789abcdef";
    const ADMIN: &str = "fedcba9876543210fedcba9876543210";

    /// The admin token: off when unset, read from its file, refused when empty or the takes' own.
    #[test]
    fn admin_token() {
        assert_eq!(cli(&[]).admin_token().ok(), Some(None));
        assert_eq!(
            cli(&["--admin-token", ADMIN, "--token", TOKEN])
                .admin_token()
                .ok(),
            Some(Some(ADMIN.to_string()))
        );
        let refused = |args: &[&str]| cli(args).admin_token().err().map(|e| e.to_string());
        assert_eq!(
            refused(&["--admin-token="]).as_deref(),
            Some("the admin token (--admin-token, TOLLGATE_ADMIN_TOKEN or --admin-token-file) is empty")
        );
        assert!(
            refused(&["--admin-token", TOKEN, "--token", TOKEN])
                .is_some_and(|e| e
                    .ends_with("is the takes' token (--token): it must be a secret of its own"))
        );
        let file = std::env::temp_dir().join(format!("tollgate-admin-{}", std::process::id()));
        std::fs::write(&file, format!("{ADMIN}\n")).unwrap_or_else(|e| unreachable!("{e}"));
        let path = file.to_str().unwrap_or_default();
        assert_eq!(
            cli(&["--admin-token-file", path]).admin_token().ok(),
            Some(Some(ADMIN.to_string()))
        );
        let _ = std::fs::remove_file(&file);
    }

    /// The rule: a placeholder (`replace-with`, in any case, anywhere) or fewer than 32 bytes is
    /// refused; 32 bytes that are no placeholder pass, whatever their alphabet.
    #[test]
    fn check_token_refuses_placeholders_and_short_tokens() {
        assert_eq!(check_token(TOKEN), Ok(()));
        assert_eq!(check_token(&"x".repeat(MIN_TOKEN_BYTES)), Ok(()));
        for placeholder in [
            "replace-with-a-long-random-token",
            "REPLACE-WITH-openssl-rand-hex-32",
            "0123456789abcdef0123456789abcdef-Replace-With-yours",
        ] {
            assert_eq!(
                check_token(placeholder),
                Err(WeakToken::Placeholder),
                "{placeholder}"
            );
        }
        assert_eq!(
            check_token(&"x".repeat(MIN_TOKEN_BYTES - 1)),
            Err(WeakToken::Short(31))
        );
        assert_eq!(check_token("s3cret"), Err(WeakToken::Short(6)));
        // Bytes, not characters: 16 two-byte characters are 32 bytes.
        assert_eq!(check_token(&"é".repeat(16)), Ok(()));
    }

    /// --token (and TOLLGATE_TOKEN, --token-file) refuses the published placeholder and a short
    /// token, naming the flags and saying how to make one.
    #[test]
    fn token_refuses_the_placeholder() {
        let e = cli(&["--token", "replace-with-a-long-random-token"])
            .token()
            .err();
        assert!(
            matches!(e, Some(StartupError::TokenWeak(WeakToken::Placeholder))),
            "{e:?}"
        );
        assert_eq!(
            e.map(|e| e.to_string()).as_deref(),
            Some(
                "the bearer token (--token, TOLLGATE_TOKEN or --token-file) is a placeholder \
                 (it contains \"replace-with\"), not a secret: make one with `openssl rand -hex 32` \
                 (or `head -c 32 /dev/urandom | base64`)"
            )
        );
    }

    #[test]
    fn token_refuses_a_short_token() {
        let e = cli(&["--token", "tok-secret-123"]).token().err();
        assert!(
            matches!(e, Some(StartupError::TokenWeak(WeakToken::Short(14)))),
            "{e:?}"
        );
        assert_eq!(
            e.map(|e| e.to_string()).as_deref(),
            Some(
                "the bearer token (--token, TOLLGATE_TOKEN or --token-file) is 14 bytes long, \
                 too short to be a secret (at least 32): make one with `openssl rand -hex 32` \
                 (or `head -c 32 /dev/urandom | base64`)"
            )
        );
        assert_eq!(
            cli(&["--token", TOKEN]).token().ok(),
            Some(Some(TOKEN.to_string()))
        );
    }

    /// --token-file: the rule applies to the file's token once trimmed (a trailing newline does
    /// not make a short token long enough).
    #[test]
    fn token_file_refuses_a_short_token() {
        let file = std::env::temp_dir().join(format!("tollgate-short-{}", std::process::id()));
        let path = file.to_str().unwrap_or_default().to_string();
        let read = |text: &str| {
            std::fs::write(&file, text).unwrap_or_else(|e| unreachable!("{e}"));
            cli(&["--token-file", &path]).token()
        };
        let e = read(&format!("{}\n\n", &TOKEN[..31])).err();
        assert!(
            matches!(e, Some(StartupError::TokenWeak(WeakToken::Short(31)))),
            "{e:?}"
        );
        assert!(matches!(
            read("replace-with-a-long-random-token\n"),
            Err(StartupError::TokenWeak(WeakToken::Placeholder))
        ));
        assert_eq!(
            read(&format!("{TOKEN}\n")).ok(),
            Some(Some(TOKEN.to_string()))
        );
        let _ = std::fs::remove_file(&file);
    }

    /// The admin token is held to the same rule, and the refusal names its own flags.
    #[test]
    fn admin_token_refuses_the_placeholder() {
        let e = cli(&["--admin-token", "replace-with-a-long-random-token"])
            .admin_token()
            .err()
            .map(|e| e.to_string());
        assert_eq!(
            e.as_deref(),
            Some(
                "the admin token (--admin-token, TOLLGATE_ADMIN_TOKEN or --admin-token-file) is a \
                 placeholder (it contains \"replace-with\"), not a secret: make one with \
                 `openssl rand -hex 32` (or `head -c 32 /dev/urandom | base64`)"
            )
        );
    }

    #[test]
    fn admin_token_refuses_a_short_token() {
        let e = cli(&["--admin-token", "e2e-admin-token", "--token", TOKEN])
            .admin_token()
            .err()
            .map(|e| e.to_string());
        assert_eq!(
            e.as_deref(),
            Some(
                "the admin token (--admin-token, TOLLGATE_ADMIN_TOKEN or --admin-token-file) is 15 \
                 bytes long, too short to be a secret (at least 32): make one with \
                 `openssl rand -hex 32` (or `head -c 32 /dev/urandom | base64`)"
            )
        );
    }

    /// --redis-sentinel needs the master's name, takes the place of --redis-url and
    /// --redis-cluster, carries the TLS files only as rediss://, and shows no password.
    #[test]
    fn sentinel_flags() {
        let parse = |args: &[&str]| {
            Cli::try_parse_from(std::iter::once("tollgate-server").chain(args.iter().copied()))
        };
        assert!(parse(&["--redis-sentinel", "redis://h:26379"]).is_err());
        assert!(parse(&[
            "--redis-sentinel",
            "redis://h:26379",
            "--redis-sentinel-master",
            "m",
            "--redis-url",
            "redis://h:6379"
        ])
        .is_err());
        assert!(parse(&["--redis-master-password", "pw"]).is_err());
        let c = cli(&[
            "--redis-sentinel",
            "redis://:sentinelpw@a:26379,redis://:sentinelpw@b:26379",
            "--redis-sentinel-master",
            "m",
            "--redis-master-password",
            "masterpw",
        ]);
        assert_eq!(c.redis_sentinel.len(), 2);
        let dbg = format!("{c:?}");
        assert!(
            !dbg.contains("sentinelpw") && !dbg.contains("masterpw"),
            "{dbg}"
        );
        let e = cli(&[
            "--redis-sentinel",
            "redis://a:26379",
            "--redis-sentinel-master",
            "m",
            "--redis-tls-ca",
            "/x",
        ])
        .redis_tls()
        .err();
        assert_eq!(
            e.map(|e| e.to_string()).as_deref(),
            Some("--redis-tls-ca apply to TLS connections only, but --redis-sentinel is redis://a:26379 (use rediss://)")
        );
    }

    /// --instance-ttl-ms: 90 s unless given, and a value outside 1 s..=1 day is refused naming
    /// the flag.
    #[test]
    fn instance_ttl() {
        let ttl = |args: &[&str]| cli(args).service_config().map(|c| c.instance_ttl_ms).ok();
        assert_eq!(ttl(&[]), Some(90_000));
        assert_eq!(ttl(&["--instance-ttl-ms", "3000"]), Some(3_000));
        for bad in ["0", "999", "86400001", "x"] {
            let e = Cli::try_parse_from(["tollgate-server", "--instance-ttl-ms", bad])
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(e.contains("--instance-ttl-ms"), "{bad}: {e}");
        }
    }

    /// Each refusal is its own variant, naming the flag, with the text the log has always shown.
    #[test]
    fn startup_errors_name_the_flag() {
        let e = cli(&["--token="]).token().err();
        assert!(matches!(e, Some(StartupError::TokenEmpty)), "{e:?}");
        assert_eq!(
            e.map(|e| e.to_string()).as_deref(),
            Some("the bearer token is empty (--token, TOLLGATE_TOKEN or --token-file)")
        );

        let e = cli(&["--token-file", "/nonexistent/tok"])
            .service_config()
            .err();
        assert!(
            matches!(
                e,
                Some(StartupError::Unreadable {
                    flag: "--token-file",
                    ..
                })
            ),
            "{e:?}"
        );
        let shown = e.map(|e| e.to_string()).unwrap_or_default();
        assert!(
            shown.starts_with("--token-file /nonexistent/tok: cannot read: "),
            "{shown}"
        );

        let e = cli(&["--redis-url", "rediss://h:1", "--redis-tls-cert", "/x"])
            .redis_tls()
            .err();
        assert!(matches!(e, Some(StartupError::CertWithoutKey)), "{e:?}");

        let e = cli(&["--redis-tls-ca", "/x"]).redis_tls().err();
        assert_eq!(
            e.map(|e| e.to_string()).as_deref(),
            Some("--redis-tls-ca given but no Redis is configured (--redis-url or --redis-cluster with rediss://)")
        );

        let e = cli(&["--redis-url", "redis://:pw@h:1", "--redis-tls-ca", "/x"])
            .redis_tls()
            .err();
        assert_eq!(
            e.map(|e| e.to_string()).as_deref(),
            Some("--redis-tls-ca apply to TLS connections only, but --redis-url is redis://:***@h:1 (use rediss://)")
        );

        let e = cli(&["--rls-config", "/nonexistent/limits.yaml"])
            .service_config()
            .err();
        assert!(matches!(e, Some(StartupError::RlsConfig(_))), "{e:?}");
        let shown = e.map(|e| e.to_string()).unwrap_or_default();
        assert!(shown.starts_with("--rls-config "), "{shown}");

        let e = crate::store::redis::RedisStore::new(crate::store::redis::RedisConfig {
            url: Some("redis://h:1".into()),
            cluster: vec![],
            key_prefix: "a{b".into(),
            timeout: std::time::Duration::from_millis(50),
            tls: None,
        })
        .err()
        .map(StartupError::from);
        assert!(
            matches!(e, Some(StartupError::Redis(RedisConfigError::KeyPrefix(_)))),
            "{e:?}"
        );
        assert_eq!(
            e.map(|e| e.to_string()).as_deref(),
            Some("the key prefix must not contain '{' or '}'")
        );
    }
}
