//! The one port: HTTP routes and the switch between HTTP/JSON and gRPC.
//!
//! A request whose `content-type` starts with `application/grpc` goes to the tonic service (which
//! answers unknown methods with gRPC `UNIMPLEMENTED`); everything else to the JSON routes. A take,
//! in either form, passes [`Api::admit`] first: its body is not read before its token is checked,
//! nor decoded before it arrived whole within the bound, and it is shed at once when the take
//! limit is reached. A `TakeStream` stream (`ops/stream.rs`), whose body is never read whole,
//! passes [`Api::admit_token`] alone and goes to `ops/stream.rs` with its body streaming, not to
//! tonic: it reads and bounds each message itself, and each takes its own permit. The admin
//! service's calls (`tollgate.admin.v1.Admin`, `ops/buckets.rs`) pass [`Api::admit_admin`]
//! instead: the admin token, never the takes'. `/healthz`, `/readyz` and `/metrics` never wait
//! behind takes.

use std::convert::Infallible;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use tonic::server::NamedService;
use tower::{Service, ServiceExt};

use crate::api::grpc::admin_pb::admin_server::AdminServer;
use crate::api::grpc::{pb::rate_limiter_server::RateLimiterServer, status_of};
use crate::api::{Api, GRPC_FRAMING_BYTES};
use crate::domain::{MAX_BATCH_BYTES, MAX_TAKE_BYTES};
use crate::ops::buckets::AdminService;
use crate::ops::{self, RateLimiterService};
use crate::rls::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitServiceServer;
use crate::rls::{LimitsFile, RlsService};

async fn healthz() -> &'static str {
    "ok\n"
}

/// Answers from the cached store check; never asks the store itself.
async fn readyz(State(api): State<Arc<Api>>) -> Response {
    if api.readiness.is_ready() {
        (StatusCode::OK, "ready\n").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "store not ready\n").into_response()
    }
}

async fn metrics(State(api): State<Arc<Api>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        api.metrics.encode(),
    )
        .into_response()
}

fn is_grpc(req: &Request) -> bool {
    req.headers()
        .get(header::CONTENT_TYPE)
        .map(|v| v.as_bytes().starts_with(b"application/grpc"))
        .unwrap_or(false)
}

/// A gRPC call of one of our methods (Take, or RLS's ShouldRateLimit): admitted like a JSON take
/// (`admin`: with the admin token, as the admin endpoints are), then handed to the generated
/// server with its body already read (and the permit held until the answer).
async fn grpc_take<S>(api: Arc<Api>, server: S, req: Request, admin: bool) -> Response
where
    S: Service<
        axum::http::Request<tonic::body::Body>,
        Response = axum::http::Response<tonic::body::Body>,
        Error = Infallible,
    >,
{
    let (parts, body) = req.into_parts();
    let limit = body_bound(parts.uri.path());
    let admitted = if admin {
        api.admit_admin(
            &parts.headers,
            body,
            ops::buckets::BODY_BYTES,
            GRPC_FRAMING_BYTES,
        )
        .await
    } else {
        api.admit(&parts.headers, body, limit, GRPC_FRAMING_BYTES)
            .await
    };
    match admitted {
        Ok((bytes, permit)) => {
            let req =
                Request::from_parts(parts, tonic::body::Body::new(axum::body::Body::from(bytes)));
            let resp = match server.oneshot(req).await {
                Ok(r) => r.map(axum::body::Body::new),
                Err(never) => match never {},
            };
            drop(permit);
            resp
        }
        Err(e) => {
            api.metrics.request("grpc", e.code());
            status_of(&e).into_http()
        }
    }
}

/// A `TakeStream` stream (`ops/stream.rs`): admitted by its token alone, from the headers, then
/// answered by [`ops::stream::respond`] with its body still streaming, each message read,
/// bounded and decided under a permit of its own there.
fn grpc_stream(api: Arc<Api>, req: Request) -> Response {
    if let Err(e) = api.admit_token(req.headers()) {
        api.metrics.request("grpc", e.code());
        return status_of(&e).into_http();
    }
    ops::stream::respond(api, req.into_body()).map(axum::body::Body::new)
}

/// The whole application: JSON routes and the gRPC service behind the content-type switch.
/// [`crate::run`] serves it as it is (no outer `Router`): the switch is the only thing in front
/// of the two services.
pub fn router(
    api: Arc<Api>,
    rls: Option<Arc<LimitsFile>>,
) -> impl Service<Request, Response = Response, Error = Infallible, Future: Send + 'static>
       + Clone
       + Send
       + 'static {
    let http = ops::routes()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(api.clone());
    // A unary call's body reaching tonic was bounded already (by method); this is the larger
    // bound, a batch's.
    let server = RateLimiterServer::new(RateLimiterService::new(api.clone()))
        .max_decoding_message_size(MAX_BATCH_BYTES);
    // A call of one of our methods goes straight to the generated server, which dispatches on the
    // full path itself (and answers an unknown method of the service with UNIMPLEMENTED). Any
    // other gRPC path goes through tonic's router as before (UNIMPLEMENTED for unknown services):
    // routing every call through it matched the path twice and captured it as a parameter.
    let grpc = tonic::service::Routes::new(server.clone()).into_axum_router();
    // The operator's service (ops/buckets.rs), behind the admin token.
    let admin = AdminServer::new(AdminService::new(api.clone()));
    // Envoy's RLS v3, when a limits file is given; otherwise its calls are UNIMPLEMENTED.
    let rls = rls.map(|limits| {
        RateLimitServiceServer::new(RlsService::new(api.clone(), limits))
            .max_decoding_message_size(MAX_TAKE_BYTES)
    });
    tower::service_fn(move |req: Request| {
        let (http, grpc, server, api) = (http.clone(), grpc.clone(), server.clone(), api.clone());
        let admin = admin.clone();
        let rls = rls.clone();
        async move {
            let head = req.method() == Method::HEAD;
            let resp = if !is_grpc(&req) {
                match http.oneshot(req).await {
                    Ok(r) => r,
                    Err(never) => match never {},
                }
            } else if is_stream(req.uri().path()) {
                grpc_stream(api, req)
            } else if is_our_method(req.uri().path()) {
                grpc_take(api, server, req, false).await
            } else if is_method_of::<AdminServer<AdminService>>(req.uri().path()) {
                grpc_take(api, admin, req, true).await
            } else if let Some(rls) = rls.filter(|_| is_rls_method(req.uri().path())) {
                grpc_take(api, rls, req, false).await
            } else {
                match grpc.oneshot(req).await {
                    Ok(r) => r,
                    Err(never) => match never {},
                }
            };
            Ok::<Response, Infallible>(top_level(resp, head))
        }
    })
}

/// What axum's `Router` did to every response when the switch was its fallback: a body of known
/// size gets its `content-length`, and the answer to a `HEAD` has no body.
fn top_level(mut resp: Response, head: bool) -> Response {
    if !resp.headers().contains_key(header::CONTENT_LENGTH) {
        if let Some(len) = axum::body::HttpBody::size_hint(resp.body()).exact() {
            resp.headers_mut()
                .insert(header::CONTENT_LENGTH, HeaderValue::from(len));
        }
    }
    if head {
        *resp.body_mut() = axum::body::Body::empty();
    }
    resp
}

/// `/envoy.service.ratelimit.v3.RateLimitService/<method>` with a non-empty method.
fn is_rls_method(path: &str) -> bool {
    path.strip_prefix('/')
        .and_then(|p| {
            p.strip_prefix(<RateLimitServiceServer<RlsService<Api>> as NamedService>::NAME)
        })
        .and_then(|p| p.strip_prefix('/'))
        .is_some_and(|method| !method.is_empty())
}

/// `/<S's service name>/<method>` with a non-empty method.
fn is_method_of<S: NamedService>(path: &str) -> bool {
    path.strip_prefix('/')
        .and_then(|p| p.strip_prefix(S::NAME))
        .and_then(|p| p.strip_prefix('/'))
        .is_some_and(|method| !method.is_empty())
}

/// `/tollgate.v1.RateLimiter/<method>` with a non-empty method: the paths tonic's router sends to
/// the generated server.
fn is_our_method(path: &str) -> bool {
    path.strip_prefix('/')
        .and_then(|p| p.strip_prefix(<RateLimiterServer<RateLimiterService> as NamedService>::NAME))
        .and_then(|p| p.strip_prefix('/'))
        .is_some_and(|method| !method.is_empty())
}

/// `/tollgate.v1.RateLimiter/TakeStream`: a stream, admitted and answered by [`grpc_stream`].
fn is_stream(path: &str) -> bool {
    is_our_method(path) && path.ends_with("/TakeStream")
}

/// The body bound of a gRPC call: a batch's for `TakeBatch`, a take's for anything else.
fn body_bound(path: &str) -> usize {
    if is_our_method(path) && path.ends_with("/TakeBatch") {
        MAX_BATCH_BYTES
    } else {
        MAX_TAKE_BYTES
    }
}
