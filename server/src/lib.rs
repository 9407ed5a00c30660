//! tollgate-server: Tollgate's decision service.
//!
//! It answers one question, *take*: may this request pass, given a list of rate-limit buckets
//! `(key, capacity, rate per period, cost, algorithm)`? All buckets are charged or none is
//! (contract/README.md is the normative wire contract). The state lives in Redis, decided by Lua
//! scripts that read Redis's own clock, so any number of service replicas share exact limits; or,
//! with no Redis configured, in memory for a single replica.
//!
//! # Layout
//!
//! | module | what |
//! |---|---|
//! | [`domain`] | bucket specs, decisions, the one validation both transports share |
//! | [`api`] | JSON over HTTP (`POST /v1/take`), gRPC (`tollgate.v1.RateLimiter/Take`), health, metrics, auth, the one-port switch |
//! | [`store`] | the [`store::Store`] trait; [`store::memory`], [`store::redis`] (scripts in `store/lua/`), [`store::keys`] |
//! | [`metrics`] | Prometheus metrics |
//! | [`cli`] | flags and environment variables; reads and checks the `--redis-tls-*` files |
//! | `main.rs` | parse flags, set up tracing, bind, build the store, call [`run`] |
//! | `build.rs` | protobuf/gRPC code from `contract/tollgate.proto` (protox, no `protoc`) |
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

pub mod api;
pub mod cli;
pub mod domain;
pub mod metrics;
pub mod store;

use std::future::Future;
use std::sync::Arc;

use tokio::net::TcpListener;

use crate::api::{Api, Auth};
use crate::metrics::Metrics;
use crate::store::Store;

/// What [`run`] needs besides the listener and the store.
#[derive(Clone)]
pub struct ServiceConfig {
    /// Bearer token every take must carry; `None` = no auth.
    pub token: Option<String>,
    /// Most requests handled at once.
    pub max_in_flight: usize,
}

impl std::fmt::Debug for ServiceConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServiceConfig")
            .field("token", &self.token.as_ref().map(|_| "***"))
            .field("max_in_flight", &self.max_in_flight)
            .finish()
    }
}

impl Default for ServiceConfig {
    fn default() -> Self {
        ServiceConfig {
            token: None,
            max_in_flight: 4096,
        }
    }
}

/// Serves the API on `listener` until `shutdown` completes, then drains in-flight requests.
pub async fn run(
    listener: TcpListener,
    store: Arc<dyn Store>,
    config: ServiceConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let addr = listener.local_addr()?;
    let api = Arc::new(Api {
        store: store.clone(),
        metrics: Metrics::new(),
        auth: Auth::new(config.token.as_deref()),
    });
    let app = api::http::router(api, config.max_in_flight);
    tracing::info!(%addr, store = store.kind(), auth = config.token.is_some(), "listening on {addr}");
    // Responses are small and latency-bound: no Nagle delay on accepted connections.
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "TCP_NODELAY");
        }
    });
    axum::serve(listener, axum::ServiceExt::into_make_service(app))
        .with_graceful_shutdown(shutdown)
        .await?;
    tracing::info!("stopped");
    Ok(())
}
