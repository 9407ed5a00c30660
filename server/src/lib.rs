//! tollgate-server: Tollgate's decision service.
//!
//! Its main question is *take*: may this request pass, given a list of rate-limit buckets
//! `(key, capacity, rate per period, cost, algorithm)`? All buckets are charged or none is
//! (contract/README.md is the normative wire contract). The state lives in Redis, decided by Lua
//! scripts that read Redis's own clock, so any number of service replicas share exact limits; or,
//! with no Redis configured, in memory for a single replica. Beside it: batches of takes (also as
//! messages on one gRPC stream), concurrency slots (acquire, release), refunds and settlements,
//! each an operation of [`ops`].
//!
//! # Layout
//!
//! | module | what |
//! |---|---|
//! | [`domain`] | the bottom layer: validated buckets, settlements and slots, the contract's answers under its own names, the contract's bounds, [`domain::InvalidArgument`] |
//! | [`store`] | the [`store::Store`] trait; [`store::memory`], [`store::redis`] (scripts in `store/lua/`), [`store::keys`], [`store::coalesce`], [`store::algorithm`] (one module per algorithm), [`store::slots`] (concurrency slots); imports only `domain` |
//! | [`metrics`] | Prometheus metrics |
//! | [`trace`] | OpenTelemetry traces (`--otlp-endpoint`): a span per decision, its parent the call's `traceparent` |
//! | [`api`] | what every operation shares: [`api::Api`] (store, metrics, auth, readiness, live instances, admission, one store call, the shutdown signal), the strict JSON reader, the gRPC codec and status, the HTTP answer |
//! | [`ops`] | one module per operation (take, batch, a stream of batches, acquire, release, refund, settle): its raw form, validation, both wire forms and handler; the tonic service; [`ops::Decide`], all RLS may ask |
//! | [`rls`] | Envoy's rate limit service (RLS v3) over [`ops::Decide`], limits from a file reloaded when it changes |
//! | [`router`] | the one port: JSON routes, health, metrics, and the content-type switch to gRPC |
//! | [`serve`] | the accept loop: connection cap, header and idle timeouts, HTTP/2 limits |
//! | [`calendar`] | a calendar window's span from its unit, its zone (a fixed offset, or a named zone of the bundled IANA database) and the service's clock |
//! | [`check`] | `tollgate-server check`: filter configurations and limits files checked by the module's and the service's own readers (a CI step) |
//! | [`cli`] | flags and environment variables; reads and checks the `--redis-tls-*` and `--token-file` files |
//! | `main.rs` | parse flags, set up tracing, bind, build the store, call [`run`] |
//! | `src/generated/` | protobuf/gRPC code from `contract/tollgate.proto`, `proto/tollgate/admin.proto` and `proto/envoy/`, written by `make protos` (`protogen/`: protox, no `protoc`) |
//! | `tests/` | behaviour suite over both stores, contract fixtures, the service over HTTP and gRPC, Redis outages and Cluster, TLS to Redis (private CA, mutual TLS, TLS Cluster; certificates made with `openssl`), the real binary (each test starts its own `redis-server`) |
//! | `examples/loadgen.rs` | load generator used by `scripts/bench-service.sh` |
//!
//! # Design choices
//!
//! * **Exactness first**: the Redis side is one script per request (per slot on a Cluster, with
//!   refunds), integer micro-tokens and an exact refill remainder; see [`store::redis`] for what
//!   is guaranteed where.
//! * **Fail visibly**: a store that is down or slow is a 503 / `UNAVAILABLE` within the configured
//!   timeout, never an "allowed": the caller (the Envoy filter) owns the failure policy.
//! * **One port**: Envoy clusters and Istio services need one; the switch is on
//!   `content-type: application/grpc`.
//! * **No client can starve, bloat or fool it**: a take's token is checked from its headers before
//!   its body is read; the body is bounded ([`domain::MAX_TAKE_BYTES`], 413 /
//!   `RESOURCE_EXHAUSTED`; a batch by [`domain::MAX_BATCH_BYTES`]) and timed; decoding stops at
//!   a 17th bucket (a 65th take); takes beyond
//!   `max_in_flight` are shed at once (503), never queued (a stream's messages likewise, each
//!   bounded, holding a permit while it is decided, a bounded number at once per stream, and the
//!   bytes of messages not yet whole bounded for all streams together); probes never wait behind
//!   takes;
//!   connections are capped and timed out ([`serve`]); callers get generic error texts, the log
//!   gets the detail (with Redis passwords redacted by parsing the URL).

pub mod api;
pub mod calendar;
pub mod check;
pub mod cli;
pub mod domain;
pub mod metrics;
pub mod ops;
pub mod rls;
pub mod router;
pub mod serve;
pub mod store;
pub mod trace;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;

use crate::api::Api;
use crate::serve::ConnectionLimits;
use crate::store::Store;

/// What [`run`] needs besides the listener and the store. Every field has a command-line flag
/// (`cli.rs`); the defaults here are the flags' defaults.
#[derive(Clone)]
pub struct ServiceConfig {
    /// Bearer token every take must carry; `None` = no auth.
    pub token: Option<String>,
    /// Bearer token of the admin endpoints (`ops/buckets.rs`); `None`: they answer 404.
    pub admin_token: Option<String>,
    /// Most takes being decoded or decided at once (a stream's message counts while it is
    /// decided); more are answered 503 / `UNAVAILABLE` at once.
    pub max_in_flight: usize,
    /// Most connections served at once; more are closed on accept.
    pub max_connections: usize,
    /// Time to receive a request head (HTTP/1.1, also between keep-alive requests) and for a new
    /// connection to send its first request.
    pub header_timeout: Duration,
    /// Time to receive a take's whole body.
    pub body_timeout: Duration,
    /// A connection with no request in progress for this long is closed (gracefully); a request
    /// is in progress until its response body has ended, so an open stream keeps its connection.
    pub idle_timeout: Duration,
    /// Concurrent streams per HTTP/2 connection.
    pub http2_max_streams: u32,
    /// Messages of one `TakeStream` stream decided at once; one more is answered `UNAVAILABLE`
    /// at once (`ops/stream.rs`).
    pub stream_max_in_flight: usize,
    /// Bytes all `TakeStream` streams together may hold of messages not yet whole; a stream that
    /// would hold more ends `UNAVAILABLE` (`api/frames.rs`).
    pub stream_buffer_bytes: usize,
    /// How often the store is pinged for `/readyz`.
    pub ready_interval: Duration,
    /// Limits for Envoy's rate limit service (`--rls-config`); `None`: RLS calls are
    /// `UNIMPLEMENTED`.
    pub rls: Option<Arc<rls::LimitsFile>>,
    /// How often the limits file is checked for a change.
    pub rls_poll: Duration,
    /// Coalescing of concurrent takes into batch calls of a Redis store
    /// ([`store::coalesce`]); `None`: every take is its own store call.
    pub coalesce: Option<store::coalesce::CoalesceConfig>,
    /// Milliseconds a proxy instance stays counted after its last callout
    /// ([`api::instances`]).
    pub instance_ttl_ms: u64,
}

impl std::fmt::Debug for ServiceConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServiceConfig")
            .field("token", &self.token.as_ref().map(|_| "***"))
            .field("admin_token", &self.admin_token.as_ref().map(|_| "***"))
            .field("max_in_flight", &self.max_in_flight)
            .field("max_connections", &self.max_connections)
            .field("header_timeout", &self.header_timeout)
            .field("body_timeout", &self.body_timeout)
            .field("idle_timeout", &self.idle_timeout)
            .field("http2_max_streams", &self.http2_max_streams)
            .field("stream_max_in_flight", &self.stream_max_in_flight)
            .field("stream_buffer_bytes", &self.stream_buffer_bytes)
            .field("ready_interval", &self.ready_interval)
            .field("rls", &self.rls.as_ref().map(|f| f.path().to_path_buf()))
            .field("rls_poll", &self.rls_poll)
            .field("coalesce", &self.coalesce)
            .field("instance_ttl_ms", &self.instance_ttl_ms)
            .finish()
    }
}

impl Default for ServiceConfig {
    fn default() -> Self {
        ServiceConfig {
            token: None,
            admin_token: None,
            max_in_flight: 1024,
            max_connections: 1024,
            header_timeout: Duration::from_millis(5000),
            body_timeout: Duration::from_millis(500),
            idle_timeout: Duration::from_millis(60_000),
            http2_max_streams: 128,
            stream_max_in_flight: api::STREAM_MAX_IN_FLIGHT,
            stream_buffer_bytes: api::STREAM_BUFFER_BYTES,
            ready_interval: Duration::from_millis(1000),
            rls: None,
            rls_poll: Duration::from_millis(1000),
            coalesce: Some(store::coalesce::CoalesceConfig::default()),
            instance_ttl_ms: api::instances::DEFAULT_TTL_MS,
        }
    }
}

/// Serves the API on `listener` until `shutdown` completes, then drains in-flight requests: open
/// streams end with `UNAVAILABLE` (each once the messages it is deciding are answered) before the
/// connections are told to close.
pub async fn run(
    listener: TcpListener,
    store: Arc<dyn Store>,
    config: ServiceConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let addr = listener.local_addr()?;
    // Only Redis gains from sharing calls; the memory store decides in place.
    let store: Arc<dyn Store> = match config.coalesce {
        Some(c) if store.kind().starts_with("redis") => {
            Arc::new(store::coalesce::Coalescer::new(store, c))
        }
        _ => store,
    };
    let api = Arc::new(
        Api::new(
            store.clone(),
            config.token.as_deref(),
            config.max_in_flight,
            config.body_timeout,
        )
        .with_admin_token(config.admin_token.as_deref())
        .with_instance_ttl(config.instance_ttl_ms)
        .with_stream_limits(config.stream_max_in_flight, config.stream_buffer_bytes),
    );
    // /readyz answers from this check, refreshed in the background: probes never reach the store.
    api.readiness.refresh(store.as_ref()).await;
    let refresher = tokio::spawn({
        let (api, every) = (
            api.clone(),
            config.ready_interval.max(Duration::from_millis(10)),
        );
        async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            loop {
                tick.tick().await;
                api.readiness.refresh(api.store.as_ref()).await;
            }
        }
    });
    let watcher = config
        .rls
        .clone()
        .map(|f| f.watch(config.rls_poll, api.metrics.clone()));
    let app = router::router(api.clone(), config.rls.clone());
    tracing::info!(%addr, store = store.kind(), auth = config.token.is_some(), "listening on {addr}");
    let limits = ConnectionLimits {
        max_connections: config.max_connections,
        header_timeout: config.header_timeout,
        idle_timeout: config.idle_timeout,
        http2_max_streams: config.http2_max_streams,
    };
    // The streams learn of the shutdown first, so a proxy reopens its stream on another replica
    // at once, instead of when its connection is closed under it.
    let shutdown = {
        let api = api.clone();
        async move {
            shutdown.await;
            api.shut_down();
        }
    };
    let result = serve::serve(listener, app, limits, api.metrics.clone(), shutdown).await;
    refresher.abort();
    if let Some(w) = watcher {
        w.abort();
    }
    result?;
    tracing::info!("stopped");
    Ok(())
}
