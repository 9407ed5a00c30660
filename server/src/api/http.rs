//! HTTP routes and the one-port switch between HTTP/JSON and gRPC.
//!
//! A request whose `content-type` starts with `application/grpc` goes to the tonic service (which
//! answers unknown methods with gRPC `UNIMPLEMENTED`); everything else to the JSON routes. Both
//! share one listener, served by hyper-util's auto builder (HTTP/1.1, and HTTP/2 with prior
//! knowledge, which gRPC uses).

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, FromRequestParts, Request, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use tonic::server::NamedService;
use tower::{Service, ServiceExt};

use super::grpc::{pb::rate_limiter_server::RateLimiterServer, RateLimiterService};
use super::json::{decode_request, error_body};
use super::{Api, ApiError};

/// Largest accepted `POST /v1/take` body: 16 buckets of 4 KiB keys fit with room to spare.
pub const MAX_BODY_BYTES: usize = 256 * 1024;

fn error_response(e: &ApiError) -> Response {
    let (status, field) = match e {
        ApiError::Invalid(inv) => (StatusCode::BAD_REQUEST, Some(inv.field.as_str())),
        ApiError::Unauthenticated => (StatusCode::UNAUTHORIZED, None),
        ApiError::Unavailable(_) => (StatusCode::SERVICE_UNAVAILABLE, None),
    };
    let field = field.filter(|f| !f.is_empty());
    let mut resp = (status, Json(error_body(e.code(), field, &e.message()))).into_response();
    if matches!(e, ApiError::Unauthenticated) {
        resp.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            header::HeaderValue::from_static("Bearer"),
        );
    }
    resp
}

/// The `authorization` header of a request, if any: the one header a take reads (the `HeaderMap`
/// extractor would copy them all).
struct Authorization(Option<HeaderValue>);

impl<S: Send + Sync> FromRequestParts<S> for Authorization {
    type Rejection = Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Infallible> {
        Ok(Authorization(
            parts.headers.get(header::AUTHORIZATION).cloned(),
        ))
    }
}

async fn take(
    State(api): State<Arc<Api>>,
    Authorization(auth): Authorization,
    body: Bytes,
) -> Response {
    let auth = auth.as_ref().map(|v| v.as_bytes());
    match api.take(auth, decode_request(&body)).await {
        Ok(d) => {
            api.metrics.request("http", "ok");
            Json(d).into_response()
        }
        Err(e) => {
            api.metrics.request("http", e.code());
            error_response(&e)
        }
    }
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn readyz(State(api): State<Arc<Api>>) -> Response {
    match api.store.ping().await {
        Ok(()) => (StatusCode::OK, "ready\n").into_response(),
        Err(e) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("store not ready: {e}\n"),
        )
            .into_response(),
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

/// The whole application: JSON routes, the gRPC service, and at most `max_in_flight` requests
/// being handled at once (more wait for a slot). `axum::serve` runs it as it is (no outer
/// `Router`): the switch is the only thing in front of the two services.
pub fn router(
    api: Arc<Api>,
    max_in_flight: usize,
) -> impl Service<Request, Response = Response, Error = Infallible, Future: Send + 'static>
       + Clone
       + Send
       + 'static {
    let http = Router::new()
        .route("/v1/take", post(take))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(api.clone());
    let server = RateLimiterServer::new(RateLimiterService::new(api));
    // A call of one of our methods goes straight to the generated server, which dispatches on the
    // full path itself (and answers an unknown method of the service with UNIMPLEMENTED). Any
    // other gRPC path goes through tonic's router as before (UNIMPLEMENTED for unknown services):
    // routing every call through it matched the path twice and captured it as a parameter.
    let grpc = tonic::service::Routes::new(server.clone()).into_axum_router();
    let switch = tower::service_fn(move |req: Request| {
        let (http, grpc, server) = (http.clone(), grpc.clone(), server.clone());
        async move {
            let head = req.method() == Method::HEAD;
            let resp = if !is_grpc(&req) {
                http.oneshot(req).await
            } else if is_our_method(req.uri().path()) {
                let resp = server.oneshot(req.map(tonic::body::Body::new)).await;
                resp.map(|r| r.map(axum::body::Body::new))
            } else {
                grpc.oneshot(req).await
            };
            Ok::<Response, Infallible>(match resp {
                Ok(r) => top_level(r, head),
                Err(never) => match never {},
            })
        }
    });
    tower::ServiceBuilder::new()
        .layer(tower::limit::GlobalConcurrencyLimitLayer::new(
            max_in_flight.max(1),
        ))
        .service(switch)
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

/// `/tollgate.v1.RateLimiter/<method>` with a non-empty method: the paths tonic's router sends to
/// the generated server.
fn is_our_method(path: &str) -> bool {
    path.strip_prefix('/')
        .and_then(|p| p.strip_prefix(<RateLimiterServer<RateLimiterService> as NamedService>::NAME))
        .and_then(|p| p.strip_prefix('/'))
        .is_some_and(|method| !method.is_empty())
}
